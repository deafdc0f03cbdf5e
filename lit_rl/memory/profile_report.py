"""What the memory profiler writes from its per-step records: the summary (``memory_summary.json``) and the figure.

A record is one measured step: ``{"step", "phases": {phase: peaks}, "total": peaks, "predicted": {phase: bytes}}``
with peaks as :mod:`lit_rl.memory.peaks` folds them (``peak_bytes``, ``rss_peak_bytes``, ``reserved_bytes``,
``breakdown``).

**Steady state.** The first step of a fresh run (``step == 0``) is not like the others: AdamW creates its state
inside that step's ``optimizer.step()``, so every phase before it holds no optimizer state (two float32 values
per trainable parameter: 1 GiB at 135M parameters). The headline figures, the figure's bars and the prediction
error are therefore taken over the steady-state steps, ``step >= 1``; step 0 is kept in the per-step records and
in ``max``/``mean``.
"""

from __future__ import annotations

from typing import Any

from lit_rl.memory.tracker import CATEGORIES as BREAKDOWN
from lit_rl.memory.units import GIB

_QUANTITIES = (("peak_bytes", "peak_gib"), ("rss_peak_bytes", "rss_peak_gib"), ("reserved_bytes", "reserved_gib"))


def steady_state(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of steps after the first optimizer step (all records if only the first step was measured)."""
    steady = [r for r in records if r.get("step", 0) >= 1]
    return steady or list(records)


def phase_stats(peaks: list[dict[str, Any]], steady: list[dict[str, Any]]) -> dict[str, Any]:
    """Max and mean over all measured steps and mean over the steady-state ones (GiB); breakdown per category."""
    out: dict[str, Any] = {}
    for key, metric in _QUANTITIES:
        values = [p[key] / GIB for p in peaks if key in p]
        if values:
            steady_values = [p[key] / GIB for p in steady if key in p] or values
            out[metric] = {
                "max": max(values),
                "mean": sum(values) / len(values),
                "steady": sum(steady_values) / len(steady_values),
            }
    breakdowns = [p["breakdown"] for p in steady if "breakdown" in p] or [
        p["breakdown"] for p in peaks if "breakdown" in p
    ]
    if breakdowns:
        out["breakdown_gib"] = {c: sum(b.get(c, 0) for b in breakdowns) / len(breakdowns) / GIB for c in BREAKDOWN}
    return out


def prediction_stats(records: list[dict[str, Any]], phase: str) -> dict[str, float]:
    """Predicted beside measured over the steady-state steps that have both: mean prediction and the gap.

    ``error_pct`` is ``(predicted - measured) / measured`` per step, in percent: its mean, and the largest
    in absolute value (``max_abs``).
    """
    pairs = [
        (r["predicted"][phase], r["phases"][phase]["peak_bytes"])
        for r in steady_state(records)
        if phase in r.get("predicted", {}) and "peak_bytes" in r["phases"].get(phase, {})
    ]
    if not pairs:
        return {}
    errors = [100.0 * (p - m) / m for p, m in pairs if m > 0]
    out = {"predicted_gib": sum(p for p, _ in pairs) / len(pairs) / GIB}
    if errors:
        out["error_pct"] = {"mean": sum(errors) / len(errors), "max_abs": max(abs(e) for e in errors)}
    return out


def summarize(records: list[dict[str, Any]], phase_names: tuple[str, ...]) -> dict[str, Any]:
    """Per-phase statistics (and the step's, over the phase maxima) of ``records``, in ``phase_names`` order."""
    names = [p for p in phase_names if any(p in r["phases"] for r in records)]
    names += sorted({p for r in records for p in r["phases"]} - set(names))
    steady = steady_state(records)
    phases = {}
    for name in names:
        stats = phase_stats(
            [r["phases"][name] for r in records if name in r["phases"]],
            [r["phases"][name] for r in steady if name in r["phases"]],
        )
        pred = prediction_stats(records, name)
        if pred:
            stats["predicted_gib"] = pred["predicted_gib"]
            if "error_pct" in pred:
                stats["predicted_error_pct"] = pred["error_pct"]
        phases[name] = stats
    step = phase_stats([r["total"] for r in records if "total" in r], [r["total"] for r in steady if "total" in r])
    predicted_steps = [max(r["predicted"].values()) for r in steady if r.get("predicted")]
    if predicted_steps:
        step["predicted_gib"] = sum(predicted_steps) / len(predicted_steps) / GIB
    return {"phases": phases, "step": step, "steady_state_steps": [r["step"] for r in steady]}


def phase_figure(summary: dict[str, Any]):
    """Stacked per-phase bars of the steady state, predicted beside them; ``None`` without matplotlib or data."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend state, Agg canvas only
    except ImportError:
        return None
    phases = {name: s for name, s in summary["phases"].items() if "peak_gib" in s or "rss_peak_gib" in s}
    if not phases:
        return None
    names = list(phases)
    xs = list(range(len(names)))

    def series(metric: str, stat: str | None = "steady") -> list[float]:
        values = [phases[n].get(metric) for n in names]
        values = [v.get(stat) if stat and isinstance(v, dict) else v for v in values]
        return [float("nan") if v is None else v for v in values]

    tensor = series("peak_gib")
    rss = series("rss_peak_gib")
    panels = [p for p, v in (("tensors", tensor), ("rss", rss)) if any(x == x for x in v)]  # x == x: not NaN
    # tensor peak and RSS live on very different scales (RSS holds the interpreter and libraries): two panels
    fig = Figure(figsize=((1.3 * len(names) + 2.2) * len(panels) + 0.5, 4.5))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels, strict=True):
        shown = (tensor if panel == "tensors" else rss) + series("predicted_gib", None)
        scale, unit = _unit(max((x for x in shown if x == x), default=0.0))
        if panel == "tensors":
            bottom = [0.0] * len(names)
            for category in BREAKDOWN:  # tensor accounting: stacked by category at the phase's peak
                heights = [phases[n].get("breakdown_gib", {}).get(category, 0.0) * scale for n in names]
                if any(heights):
                    ax.bar(xs, heights, bottom=bottom, label=category)
                    bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
            if not any(bottom):  # allocator only: allocated, with the reserved headroom on top
                peaks = [0.0 if t != t else t * scale for t in tensor]
                ax.bar(xs, peaks, label="allocated")
                reserved = [0.0 if r != r else r * scale for r in series("reserved_gib")]
                if any(reserved):
                    headroom = [max(r - p, 0.0) for r, p in zip(reserved, peaks, strict=True)]
                    ax.bar(xs, headroom, bottom=peaks, label="reserved, unallocated")
            ax.set_title("peak held by tensors")
        else:
            ax.bar(xs, [r * scale for r in rss], color="tab:gray", label="RSS peak")
            ax.set_title("process peak RSS")
        predicted = [p * scale for p in series("predicted_gib", None)]
        if panel == panels[0] and any(p == p for p in predicted):  # predictions are of the tensor peak
            ax.scatter(xs, predicted, marker="_", s=900, linewidths=2.5, color="r", label="predicted", zorder=3)
        ax.set_xticks(xs, names, rotation=20)
        ax.set_ylabel(f"{unit} (mean over steady-state steps)")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    steps = summary.get("steady_state_steps") or []
    label = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}" if steps else ""
    fig.suptitle(
        f"{summary['method']}: peak memory per phase, steady state {label} ({summary['measurement']}, {summary['device']})"
    )
    fig.tight_layout()
    return fig


def _unit(gib: float) -> tuple[float, str]:
    """A scale factor from GiB and its unit, so small runs are not drawn as zero-height bars."""
    return (1.0, "GiB") if gib >= 1 else (1024.0, "MiB") if gib >= 1 / 1024 else (1024.0**2, "KiB")
