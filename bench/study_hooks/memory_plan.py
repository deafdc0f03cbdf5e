"""What the memory-plan study needs beyond logged scalars: the plans themselves, and the step time of each run.

``before`` asks the planner for each planned arm's budget (``lit-rl estimate --config C --device-memory B --allow A
--plan <results>/plan_<arm>.yaml``), the file the arm's ``--config {results}/plan_<arm>.yaml`` applies; ``plan``
shows what the plan turned on, ``fits`` compares the run's measured tensor peak with the budget, ``step`` is the
median of the run's summed phase times. ``after`` asks the planner for the study's ``scale`` entries, models too
large to train here (estimate only, nothing runs), and adds each one's plan table; their output is kept under the
study's runs, so ``--reuse`` reads it again.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import harness
import yaml

GIB = 2**30


def _budget(study: dict, spec: dict) -> str | None:
    return spec.get("quick_budget" if study["runtime"].quick else "budget")


def before(study: dict, results: Path) -> None:
    """A plan file per planned arm, from the planner itself."""
    runtime = study["runtime"]
    config = study["quick"]["config"] if runtime.quick else study["config"]
    results.mkdir(parents=True, exist_ok=True)
    for name in runtime.arms:  # only the arms this run trains: a plan takes the planner's whole search
        spec = study["arms"][name]
        budget = _budget(study, spec)
        if budget is None:
            continue
        cmd = [sys.executable, "-m", "lit_rl", "estimate", "--config", config, "--device-memory", budget,
               "--allow", spec.get("allow", ""), "--plan", str(results / f"plan_{name}.yaml")]  # fmt: skip
        print(f"+ {shlex.join(cmd)}", file=sys.stderr, flush=True)
        harness.run_measured(cmd, None, harness.thread_env(runtime.threads))


def _plan_file(arm) -> Path | None:
    for i, value in enumerate(arm.overrides[:-1]):
        if value == "--config" and Path(arm.overrides[i + 1]).name.startswith("plan_"):
            return harness.ROOT / arm.overrides[i + 1]  # {results} is filled relative to the repository root
    return None


def plan(arm) -> str:
    path = _plan_file(arm)
    if path is None:
        return "—"
    fragment = yaml.safe_load(path.read_text()) or {}
    parts = [f"{k}: {v}" for k, v in (fragment.get("model", {}).get("init_args") or {}).items() if v is not None]
    if "optimizer" in fragment:
        parts.append(fragment["optimizer"]["class_path"].rsplit(".", 1)[-1])
    trainer = fragment.get("trainer", {})
    if "precision" in trainer:
        parts.append(f"precision: {trainer['precision']}")
    for callback in trainer.get("callbacks+", []):
        parts.append(f"checkpoint every {callback['init_args']['every_n_layers']}")
    return ", ".join(parts) or "the config as it is"


def budget(arm) -> str:
    text = arm.spec.get("budget") if arm.spec else None
    return text or "—"


def fits(arm) -> str:
    path = _plan_file(arm)
    peaks = arm.values("memory/step/peak_gib")
    if path is None or not peaks:
        return "—"
    line = path.read_text().splitlines()[1]  # "# budget 2.00 GiB; apply: ..."
    number, unit = line.split()[2:4]
    limit = float(number) * {"GiB": 1, "MiB": 1 / 1024, "KiB": 1 / 2**20}[unit.rstrip(";")]
    return "yes" if max(peaks) <= limit else "NO"


def step(arm) -> str:
    seconds = harness.median_step_seconds(arm.run_dir)
    return "—" if seconds is None else f"{seconds:.2f}"


cells = {"plan": plan, "budget": budget, "fits": fits, "step": step}


def after(study: dict, arms: list, results: Path) -> list[str]:
    """The planner's table for each ``scale`` entry (``config``, ``args``, ``budget``, ``allow``, and ``rates``: a
    rates file of the step's device, passed where it exists): the plan at each budget a large model needs, from the
    estimate alone."""
    runtime = study["runtime"]
    entries = study.get("quick", {}).get("scale", {}) if runtime.quick else study.get("scale", {})
    if not entries:
        return []
    lines = ["", "## Plans at scale (estimated, not run)", "", study.get("scale_description", "").strip(), ""]
    for title, spec in entries.items():
        slug = re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")
        saved, plan = runtime.out / f"scale_{slug}.log", runtime.out / f"scale_{slug}.yaml"
        args = ["estimate", "--config", spec["config"], *map(str, spec.get("args", [])),
                "--device-memory", spec["budget"], "--allow", spec.get("allow", "")]  # fmt: skip
        if spec.get("rates") and (harness.ROOT / spec["rates"]).is_file():  # the target device's, once measured
            args += ["--rates", spec["rates"]]
        shown = shlex.join(["lit-rl", *args, "--plan", "plan.yaml"])
        made = saved.with_suffix(".json")  # the commit and load the table was made at (rates measured then vary)
        if not (runtime.reuse and saved.is_file()):
            cmd = [sys.executable, "-m", "lit_rl", *args, "--plan", str(plan)]
            print(f"+ {shlex.join(cmd)}", file=sys.stderr, flush=True)
            runtime.out.mkdir(parents=True, exist_ok=True)
            before = harness.load_average()
            try:
                harness.run_measured(cmd, None, harness.thread_env(runtime.threads), saved)
            except harness.ChildFailed as err:  # no plan fits: the planner says so in its last line, exit 2
                if err.code != 2:
                    raise
            made.write_text(json.dumps({"commit": harness.git_commit(), "load": [before, harness.load_average()]}))
        text = saved.read_text().splitlines()
        table = text[next((i for i, ln in enumerate(text) if ln.startswith("plan for")), 0) :]
        table = table[: table.index("")] if "" in table else table  # the table; not where this machine wrote the plan
        at = json.loads(made.read_text()) if made.is_file() else None
        when = [f"At commit {at['commit']}; 1-minute load average {at['load'][0]:.1f} before, {at['load'][1]:.1f} "
                "after (the table's last line says whose rates its times are at).", ""] if at else []  # fmt: skip
        lines += [f"### {title}", "", f"`{shown}`", "", *when, "```", *table, "```", ""]
    return lines
