"""What the tactics study needs beyond logged scalars: step time, the per-phase predicted-vs-measured table, and the
summary at the top of docs/memory.md.

``step`` is the median of a run's summed phase times (the first step left out) with its ratio to the first arm's;
``phase_error`` the largest |measured - predicted| / measured over the phases of the last profiled step. ``after``
adds a table of each phase's measured and predicted tensor peak, and on a full run into ``bench/results/`` writes
the summary table (tensor peak, peak RSS and step time against the run without a tactic, held-out accuracy) between
the markers in docs/memory.md, so the page shows what this command measured.
"""

from __future__ import annotations

from pathlib import Path

import harness

DOCS = harness.ROOT / "docs" / "memory.md"
BEGIN, END = "<!-- tactics table: written by `nice -n 10 python bench/study.py tactics` -->", "<!-- end of tactics -->"


def _median_step(arm) -> float | None:
    """The run's median step seconds, read from its logs once (every row's cell divides by the first arm's)."""
    if "median_step" not in arm.extra:
        arm.extra["median_step"] = harness.median_step_seconds(arm.run_dir)
    return arm.extra["median_step"]


def _ratio(own: float | None, first: float | None) -> str:
    return f"{own / first:.2f}x" if own is not None and first else "-"


def step(arm) -> str:
    own, first = _median_step(arm), _median_step(next(iter(arm.others.values())))
    return "-" if own is None else f"{own:.2f} ({_ratio(own, first)})"


def _phases(arm) -> dict[str, tuple[float, float]]:
    """``{phase: (measured GiB, predicted GiB)}`` at the last step where both were logged (``step`` and ``save`` are
    not phases)."""
    if "phases" not in arm.extra:
        events = harness.read_scalar_events(str(arm.run_dir), None)
        found = {}
        for tag, measured in events.items():
            name = tag.removeprefix("memory/").removesuffix("/peak_gib")
            predicted = events.get(f"memory/{name}/predicted_gib")
            if tag.startswith("memory/") and tag.endswith("/peak_gib") and name not in ("step", "save") and predicted:
                found[name] = (measured[-1].value, predicted[-1].value)
        arm.extra["phases"] = found
    return arm.extra["phases"]


def phase_error(arm) -> str:
    errors = [abs(m - p) / m for m, p in _phases(arm).values() if m > 0]
    return f"{100 * max(errors):.1f}%" if errors else "-"


cells = {"step": step, "phase_error": phase_error}


def _summary(arms: list) -> list[str]:
    first, key = arms[0], "val/correct_answer"

    def peak(arm):
        values = arm.values("memory/step/peak_gib")
        return values[-1] if values else None

    lines = [
        "| tactic | tensor peak GiB (vs none) | peak RSS GiB (vs none) | step s (vs none) | held-out accuracy |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for arm in arms:
        rss, rss0 = arm.record.get("peak_rss", 0) / 2**30, first.record.get("peak_rss", 0) / 2**30
        own = peak(arm)
        accuracy = " → ".join(f"{v:.2f}" for v in arm.values(key)) or "-"
        accuracy += arm.steps_note(key, arms)  # as in the results table, whose header names the same steps
        lines.append(
            f"| {arm.label or arm.name} | {'-' if own is None else f'{own:.3f}'} ({_ratio(own, peak(first))}) | "
            f"{rss:.2f} ({_ratio(rss, rss0)}) | {step(arm)} | {accuracy} |"
        )
    return lines


def after(study: dict, arms: list, results: Path) -> list[str]:
    """The per-phase table; on a full run into bench/results/, the summary written into docs/memory.md."""
    phases = study["phases"]
    lines = [
        "",
        "## Each phase: measured / predicted tensor peak (GiB), last profiled step",
        "",
        "| tactic | " + " | ".join(phases) + " |",
        "| --- | " + " | ".join("---:" for _ in phases) + " |",
    ]
    for arm in arms:
        found = _phases(arm)
        row = [f"{found[p][0]:.3f} / {found[p][1]:.3f}" if p in found else "-" for p in phases]
        lines.append(f"| {arm.label or arm.name} | " + " | ".join(row) + " |")
    runtime = study["runtime"]
    if not runtime.quick and results.resolve() == (harness.ROOT / "bench" / "results").resolve():
        text = DOCS.read_text()
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        DOCS.write_text(head + BEGIN + "\n" + "\n".join(_summary(arms)) + "\n" + END + tail)
    return lines
