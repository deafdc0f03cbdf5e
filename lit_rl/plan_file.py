"""The plan file ``lit-rl estimate --plan`` writes: a config fragment that applies a plan's tactics, headed by the
configs it was made for, and the check that refuses it beside any other config.

``lit-rl fit --config C --config plan.yaml`` applies a plan; its first line names each config it was made for with
a digest of the file (:func:`plan_header`), so a plan given with another config, or with its config edited since,
is refused in one line before anything runs (:func:`check_plan_files`). The search itself is
:mod:`lit_rl.planner`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lit_rl.memory.units import format_bytes

if TYPE_CHECKING:
    from lit_rl.planner import Candidate

PLAN_MARK = "# lit-rl plan for "

__all__ = ["PLAN_MARK", "check_plan_files", "config_digest", "plan_fragment", "plan_header"]


def plan_fragment(best: Candidate) -> dict[str, Any]:
    """The config fragment that applies ``best``'s tactics (YAML-ready)."""
    o = best.overrides
    model = {k: v for k, v in o.items() if k not in ("optimizer", "precision", "activation_checkpointing")}
    fragment: dict[str, Any] = {"model": {"init_args": model}} if model else {}
    if "optimizer" in o:
        fragment["optimizer"] = {"class_path": o["optimizer"]["class_path"]}
    trainer: dict[str, Any] = {}
    if "precision" in o:
        trainer["precision"] = o["precision"]
    if best.every_n_layers:
        trainer["callbacks+"] = [
            {
                "class_path": "lit_rl.callbacks.ActivationCheckpointing",
                "init_args": {"every_n_layers": best.every_n_layers},
            }
        ]
    if trainer:
        fragment["trainer"] = trainer
    return fragment


def config_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def plan_header(configs: list[str], device_bytes: int) -> str:
    """The plan file's first lines: the configs it was made for (with their digests) and the budget."""
    made_for = " ".join(f"{c}@{config_digest(c)}" for c in configs)
    return f"{PLAN_MARK}{made_for}\n# budget {format_bytes(device_bytes)}; apply: lit-rl fit --config ... --config <this file>\n"


def check_plan_files(config_files: list[str]) -> None:
    """Refuse a plan file (among ``--config`` files) made for other configs than the ones given with it.

    Raises:
        ValueError: one line naming the plan, the configs it was made for, and the fix.
    """
    for path in config_files:
        first = Path(path).read_text().split("\n", 1)[0] if Path(path).is_file() else ""
        if not first.startswith(PLAN_MARK):
            continue
        others = [c for c in config_files if c != path]
        for entry in first.removeprefix(PLAN_MARK).split():
            config, _, digest = entry.rpartition("@")
            same = any(Path(c).resolve() == Path(config).resolve() for c in others if Path(config).exists())
            if not same or config_digest(config) != digest:
                raise ValueError(
                    f"--config {path}: a plan made for {config} as it was then, not for "
                    f"{' '.join(others) or 'no config'}; make one for this config: lit-rl estimate --config ... "
                    "--device-memory X --plan FILE"
                )
