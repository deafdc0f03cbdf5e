"""What the checkpointing study's table needs beyond logged scalars: the largest phase peak of the last profiled step,
times over the unprofiled steps, the checkpointed layers the callback reported, and each arm against ``off``.

The MemoryProfiler logs ``memory/<phase>/peak_gib`` (and ``predicted_gib``) at the steps it measures; the method logs
``time/<phase>_s`` at every step. A step is timed when the profiler did not measure it (its exact tensor accounting
slows a step); ``off`` is the sibling run folder of that name (``<out>/off``), so ``--arms`` without it leaves the
ratios out.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from harness import read_scalar_events

GIB, MIB = 2**30, 2**20
LAYERS = re.compile(r"ActivationCheckpointing: (\d+) module\(s\) of (\w+) checkpointed")


def _runs(arm) -> dict:
    """``arm.extra`` filled once: this run's figures, and ``off``'s."""
    if "own" not in arm.extra:
        arm.extra["own"] = _figures(arm.run_dir)
        off = arm.run_dir.parents[2] / "off" / "lightning_logs"
        found = sorted(off.glob("version_*"), key=lambda p: int(p.name.split("_")[1])) if off.exists() else []
        arm.extra["off"] = _figures(found[-1]) if found else None
    return arm.extra


def _figures(run: Path) -> dict:
    events = read_scalar_events(str(run), None)
    values = {k: {e.step: e.value for e in v} for k, v in events.items()}
    profiled = sorted(values.get("memory/step/peak_gib", {}))
    last = profiled[-1]
    phases = {k.split("/")[1]: v[last] for k, v in values.items()
              if k.startswith("memory/") and k.endswith("/peak_gib") and k != "memory/step/peak_gib" and last in v}  # fmt: skip
    peak_phase = max(phases, key=phases.get)
    per_step: dict[int, float] = {}
    for key, steps in values.items():
        if key.startswith("time/") and key.endswith("_s"):
            for step, seconds in steps.items():
                per_step[step] = per_step.get(step, 0.0) + seconds
    timed = [s for s in sorted(per_step) if s not in profiled]
    backward = values.get("time/backward_s", {})
    log = run.parents[1] / "fit.log"
    found = LAYERS.findall(log.read_text()) if log.exists() else []
    return {
        "tensor_peak": phases[peak_phase] * GIB,
        "peak_phase": peak_phase,
        "predicted": values.get(f"memory/{peak_phase}/predicted_gib", {}).get(last),
        "rss": values.get("memory/step/rss_peak_gib", {}).get(last),
        "step": statistics.median(per_step[s] for s in timed) if timed else None,
        "backward": statistics.median(backward[s] for s in timed if s in backward) if timed else None,
        "timed": len(timed),
        "checkpointed": int(found[-1][0]) if found else 0,
    }


def _vs_off(arm, key: str) -> str:
    runs = _runs(arm)
    own, off = runs["own"][key], (runs["off"] or {}).get(key)
    return f"{own / off:.2f}x" if own and off else "—"


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def checkpointed(arm) -> str:
    return str(_runs(arm)["own"]["checkpointed"])


def tensor_peak(arm) -> str:
    return f"{_runs(arm)['own']['tensor_peak'] / MIB:.2f}"


def predicted(arm) -> str:
    value = _runs(arm)["own"]["predicted"]
    return "—" if value is None else f"{value * GIB / MIB:.2f}"


def error(arm) -> str:
    own = _runs(arm)["own"]
    if own["predicted"] is None:
        return "—"
    return f"{100 * (own['predicted'] * GIB - own['tensor_peak']) / own['tensor_peak']:+.1f}%"


def peak_phase(arm) -> str:
    return _runs(arm)["own"]["peak_phase"]


def saved(arm) -> str:
    runs = _runs(arm)
    return "—" if runs["off"] is None else f"{(runs['off']['tensor_peak'] - runs['own']['tensor_peak']) / MIB:.2f}"


def step_rss(arm) -> str:
    rss = _runs(arm)["own"]["rss"]
    return f"{rss:.2f}" if rss is not None else f"{arm.record.get('peak_rss', 0) / GIB:.2f}"


def backward(arm) -> str:
    return _s(_runs(arm)["own"]["backward"])


def backward_ratio(arm) -> str:
    return _vs_off(arm, "backward")


def step(arm) -> str:
    return _s(_runs(arm)["own"]["step"])


def step_ratio(arm) -> str:
    return _vs_off(arm, "step")


def timed(arm) -> str:
    return str(_runs(arm)["own"]["timed"])


def load(arm) -> str:
    loads = [x for x in (arm.record.get("load_before"), arm.record.get("load_after")) if x is not None]
    return f"{sum(loads) / len(loads):.1f}" if loads else "—"


cells = {f.__name__: f for f in (checkpointed, tensor_peak, predicted, error, peak_phase, saved, step_rss, backward,
                                 backward_ratio, step, step_ratio, timed, load)}  # fmt: skip
