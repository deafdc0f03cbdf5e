"""
OOM Report
==========

On an out-of-memory error, writes what was measured and which memory tactics would have helped.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lit_rl.callbacks.activation_checkpointing import ActivationCheckpointing
from lit_rl.callbacks.empty_cache import EmptyCache
from lit_rl.callbacks.memory_profiler import MemoryProfiler
from lit_rl.memory.estimate import trainer_settings
from lit_rl.memory.fit import estimate_savings
from lit_rl.memory.host_allocator import why_not_glibc
from lit_rl.memory.tactics import TACTICS
from lit_rl.memory.units import GIB

log = logging.getLogger(__name__)


class OOMReport(Callback):
    r"""Writes ``oom_report.json`` when training runs out of memory, naming the phase and the tactics that would help.

    On a ``torch.OutOfMemoryError`` (or a ``RuntimeError`` whose message says "out of memory") the
    report holds: the phase that was running (heard from ``pl_module.phases``), the step, the
    allocator's counters on CUDA, the :class:`~lit_rl.callbacks.MemoryProfiler`'s per-phase summary and
    its CUDA snapshot if one is among the callbacks, and the memory tactics with what each does,
    whether it is already on, how to turn it on and the saving the estimator predicts for this run
    (:func:`lit_rl.memory.fit.estimate_savings`; a module may answer itself with
    ``estimate_savings() -> dict[tactic, bytes]``). The same
    text is issued as a warning; Lightning then re-raises the error. Other errors are ignored.

    The report costs nothing until an error happens; then the estimate re-runs the step on fake tensors
    once per tactic (seconds to a minute).

    **Logged Metrics**: none (the report is a file and a warning).

    Args:
        filename: name of the report in ``trainer.log_dir``; ranks other than 0 add ``.rank<N>`` before ``.json``.

    Raises:
        Nothing itself; the out-of-memory error propagates unchanged.

    Example::

        # callbacks/oom_report.yaml
        trainer:
          callbacks+:
            - class_path: lit_rl.callbacks.OOMReport
    """

    def __init__(self, filename: str = "oom_report.json") -> None:
        self.filename = filename
        self._log_dir: str | None = None
        self._failed: tuple[BaseException, str] | None = None  # (error, innermost phase it escaped from)
        self._started: str | None = None
        self.report_path: str | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # computed now, on every rank: trainer.log_dir broadcasts, which would hang if only one rank fails
        self._log_dir = trainer.log_dir or trainer.default_root_dir
        phases = getattr(pl_module, "phases", None)
        if phases is not None and hasattr(phases, "add_listener"):
            phases.add_listener(self)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        phases = getattr(pl_module, "phases", None)
        if phases is not None and hasattr(phases, "remove_listener"):
            phases.remove_listener(self)

    def on_phase_start(self, name: str) -> None:
        self._started = name

    def on_phase_end(self, name: str) -> None:
        # PhaseTracker resets `current` while the error unwinds, so the phase is caught here, innermost first
        error = sys.exc_info()[1]
        if error is not None and _is_oom(error) and (self._failed is None or self._failed[0] is not error):
            self._failed = (error, name)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not _is_oom(exception):
            return
        report = self._report(trainer, pl_module, exception)
        self._failed = None
        directory = Path(self._log_dir or trainer.default_root_dir)
        name = self.filename
        if trainer.global_rank:
            name = name.removesuffix(".json") + f".rank{trainer.global_rank}.json"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / name
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        self.report_path = str(path)
        message = _message(report, path)
        if trainer.global_rank == 0:
            rank_zero_warn(message)
        else:
            log.warning(f"[rank {trainer.global_rank}] {message}")

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> dict[str, Any]:
        phases = getattr(pl_module, "phases", None)
        if self._failed is not None and self._failed[0] is exception:
            phase = self._failed[1]
        else:
            phase = getattr(phases, "current", None) or self._started
        device = trainer.strategy.root_device
        report: dict[str, Any] = {
            "error": f"{type(exception).__name__}: {str(exception)[:4000]}",
            "phase": phase,
            "step": trainer.global_step,
            "method": type(pl_module).__name__,
            "device": str(device),
            "precision": str(trainer.precision),
        }
        if device.type == "cuda" and torch.cuda.is_available():
            report["cuda_gib"] = {
                "allocated": torch.cuda.memory_allocated(device) / GIB,
                "reserved": torch.cuda.memory_reserved(device) / GIB,
                "max_allocated": torch.cuda.max_memory_allocated(device) / GIB,
                "max_reserved": torch.cuda.max_memory_reserved(device) / GIB,
                "total": torch.cuda.get_device_properties(device).total_memory / GIB,
            }
        profiler = next((c for c in trainer.callbacks if isinstance(c, MemoryProfiler)), None)
        if profiler is not None:
            summary = profiler.summary()
            report["measured"] = {
                "phases": summary["phases"],
                "step": summary["step"],
                "last_steps": summary["steps"][-3:],
            }
            report["cuda_snapshot"] = profiler.dump_cuda_snapshot()
        report["tactics"] = self._tactics(trainer, pl_module)
        return report

    def _tactics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[dict[str, Any]]:
        savings: dict[str, int] = {}
        own = getattr(pl_module, "estimate_savings", None)  # a module may answer for itself
        try:
            raw = own() if callable(own) else estimate_savings(pl_module, **trainer_settings(trainer))
            savings = {str(k): int(v) for k, v in (raw or {}).items()}
        except Exception as err:  # a broken estimate must not hide the report
            log.warning(f"OOMReport: no predicted savings ({type(err).__name__}: {err})")
        policy = getattr(pl_module, "policy", None)
        active = {
            "activation_checkpointing": any(isinstance(c, ActivationCheckpointing) for c in trainer.callbacks),
            "bf16": "bf16" in str(trainer.precision),
            "lora": policy is not None and hasattr(policy, "peft_config"),
            "adamw8bit": "8bit" in str((getattr(pl_module, "hparams", {}) or {}).get("optimizer") or ""),
            "empty_cache": any(isinstance(c, EmptyCache) for c in trainer.callbacks),
            "host_offload": bool(getattr(trainer.strategy, "cpu_offload", False)),
        }
        micro = {k: v for k, v in dict(getattr(pl_module, "hparams", {}) or {}).items() if "micro_batch" in k}
        tactics = []
        sharded = hasattr(trainer.strategy, "rollout_gather")  # FSDP2Strategy
        for name, tactic in TACTICS.items():
            if name == "rollout_layers" and not sharded:
                continue  # a setting of sharded runs only
            if name == "host_offload" and trainer.strategy.root_device.type == "cpu":
                continue  # a CPU run's memory is host memory already
            what, how = tactic.what, tactic.how.replace(" {value}", "")
            if name == "micro_batch" and micro:
                how = ", ".join(f"lower {k} (now {v})" for k, v in micro.items())
            if name == "empty_cache" and trainer.strategy.root_device.type != "cuda" and why_not_glibc():
                what += " (CUDA, or glibc on CPU: a no-op here)"
            saving = savings.get(name)
            tactics.append(
                {
                    "tactic": name,
                    "active": active.get(name, False),
                    "what": what,
                    "how": how,
                    "predicted_saving_gib": None if saving is None else saving / GIB,
                }
            )
        # what is not on yet first, the largest predicted saving first
        tactics.sort(key=lambda t: (t["active"], -(t["predicted_saving_gib"] or 0.0)))
        return tactics


def _is_oom(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def _message(report: dict[str, Any], path: Path) -> str:
    lines = [
        f"Out of memory in phase {report['phase']!r} at step {report['step']} ({report['device']}); report: {path}"
    ]
    for t in report["tactics"]:
        if t["active"]:
            continue
        saving = "" if t["predicted_saving_gib"] is None else f" (predicted saving {t['predicted_saving_gib']:.2f} GiB)"
        lines.append(f"  - {t['tactic']}{saving}: {t['how']}")
    return "\n".join(lines)
