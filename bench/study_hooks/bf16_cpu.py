"""What the bf16 study's memory section needs: each phase's steady-state tensor peak, measured beside predicted.

``lit_rl.callbacks.MemoryProfiler`` writes ``memory_summary.json`` in the run's folder at the end of training: per
phase (and for the whole step) the steady-state mean of the measured peak (steps >= 1, where AdamW has its state)
and the mean prediction for the same steps.
"""

from __future__ import annotations

import json

PHASES = ("rollout", "reference", "policy_forward", "backward", "optimizer", "step")


def _summary(arm) -> dict:
    if "summary" not in arm.extra:
        found = sorted(arm.run_dir.rglob("memory_summary.json"))
        arm.extra["summary"] = json.loads(found[-1].read_text()) if found else {}
    return arm.extra["summary"]


def _phase(phase: str):
    def cell(arm) -> str:
        summary = _summary(arm)
        stats = summary.get("step", {}) if phase == "step" else summary.get("phases", {}).get(phase, {})
        measured, predicted = stats.get("peak_gib", {}).get("steady"), stats.get("predicted_gib")
        if measured is None or predicted is None:
            return "-"
        return f"{measured * 1024:.1f} / {predicted * 1024:.1f} ({predicted / measured:.3f})"

    return cell


def steady_steps(arm) -> str:
    return ", ".join(map(str, _summary(arm).get("steady_state_steps", []))) or "-"


cells = {phase: _phase(phase) for phase in PHASES} | {"steady_steps": steady_steps}
