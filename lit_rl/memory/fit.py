"""Whether a step fits a device, and how much each memory tactic would save: the estimator run again per tactic."""

from __future__ import annotations

from typing import Any

from lit_rl.memory.estimate import Estimate, estimate_step
from lit_rl.memory.tactics import TACTICS
from lit_rl.memory.units import format_bytes


def estimate_savings(module, baseline: Estimate | None = None, **settings: Any) -> dict[str, int]:
    """Predicted saving of each memory tactic that is not on yet: tactic -> bytes off the step peak.

    Each tactic of :data:`~lit_rl.memory.tactics.TACTICS` that the estimator can predict is estimated by
    re-running :func:`estimate_step` with it applied: ``activation_checkpointing`` (every layer),
    ``micro_batch`` (half the current micro-batch), ``lora`` (r=16 on all linear layers; also drops the
    frozen reference copy) and ``bf16`` (``bf16-true``).

    Args:
        module: as for :func:`estimate_step`.
        baseline: the estimate without the tactics (computed if not given).
        **settings: the keyword arguments of :func:`estimate_step`.
    """
    baseline = baseline or estimate_step(module, **settings)
    return {name: saved for name, (saved, _) in _tactic_estimates(module, baseline, settings).items()}


def _tactic_estimates(module, baseline: Estimate, settings: dict[str, Any]) -> dict[str, tuple[int, Estimate]]:
    out: dict[str, tuple[int, Estimate]] = {}
    for name, change in _tactics(baseline).items():
        estimate = estimate_step(module, **{**settings, **change})
        out[name] = (baseline.peak_bytes - estimate.peak_bytes, estimate)
    return out


def _tactics(baseline: Estimate) -> dict[str, dict[str, Any]]:
    """The settings change of each estimable tactic that is not on yet."""
    from lit_rl.models import LoraSettings

    s = baseline.settings
    changes: dict[str, dict[str, Any]] = {}
    if not s["activation_checkpointing"]:
        changes["activation_checkpointing"] = {"activation_checkpointing": 1}
    if s["micro_batch_size"] > 1:
        changes["micro_batch"] = {"micro_batch_size": max(1, s["micro_batch_size"] // 2)}
    if not s["lora"]:
        changes["lora"] = {"lora": LoraSettings()}
    if s["precision"] in ("32-true", "32"):
        changes["bf16"] = {"precision": "bf16-true"}
    assert set(changes) <= {name for name, t in TACTICS.items() if t.estimated}
    return changes


def fit_report(
    module, estimate: Estimate, device_bytes: int, settings: dict[str, Any], tactics: bool = True
) -> tuple[bool, str]:
    """Whether the step fits in ``device_bytes`` and, if not, which tactics help and by how much (text)."""
    peak = estimate.peak_bytes
    fits = peak <= device_bytes
    lines = [
        f"device memory {format_bytes(device_bytes)}: predicted step peak {format_bytes(peak)} "
        f"({estimate.peak_phase}) {'fits' if fits else 'does NOT fit'}"
        + (f", {format_bytes(device_bytes - peak)} to spare" if fits else f", {format_bytes(peak - device_bytes)} over")
    ]
    if fits and peak > 0.9 * device_bytes:
        lines.append("  tight: the CUDA context, workspaces and allocator fragmentation are not in the estimate")
    if fits or not tactics:
        return fits, "\n".join(lines)
    results = _tactic_estimates(module, estimate, settings)
    if not results:
        lines.append("  every tactic the estimator knows is already on; use a smaller batch or shorter sequences")
        return fits, "\n".join(lines)
    lines.append("tactics (each alone, re-estimated):")
    order = sorted(results, key=lambda n: -results[n][0])
    for name in order:
        saved, other = results[name]
        how = TACTICS[name].how.format(value=other.settings["micro_batch_size"])
        if saved <= 0:
            lines.append(f"  - {name}: no saving, the peak stays in {other.peak_phase} ({how})")
            continue
        verdict = "fits" if other.peak_bytes <= device_bytes else "still over"
        lines.append(
            f"  - {name}: saves {format_bytes(saved)} -> peak {format_bytes(other.peak_bytes)} "
            f"({other.peak_phase}), {verdict}; add {how}"
        )
    if any(other.peak_bytes <= device_bytes for _, other in results.values()):
        return fits, "\n".join(lines)
    # no tactic is enough alone: add them up, largest saving first, until the step fits
    combined: dict[str, Any] = dict(settings)
    applied: list[str] = []
    for name in (n for n in order if results[n][0] > 0):
        combined.update(_tactics(estimate)[name])
        applied.append(name)
        if len(applied) < 2:
            continue
        together = estimate_step(module, **combined)
        verdict = "fits" if together.peak_bytes <= device_bytes else "still over"
        lines.append(f"  - together, {' + '.join(applied)}: peak {format_bytes(together.peak_bytes)}, {verdict}")
        if together.peak_bytes <= device_bytes:
            break
    return fits, "\n".join(lines)
