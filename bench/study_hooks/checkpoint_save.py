"""What the checkpoint-save study's table needs beyond one logged scalar: the first save's figures, the highest of
every save's, the whole run's peak and what the save added.

``probes.SaveMemory`` logs ``bench/save/<figure>`` at every save; the run's lifetime peak RSS is the measured child's
``ru_maxrss`` (``arm.record``). GiB, as logged.
"""

from __future__ import annotations

GIB = 2**30


def _first(arm, key: str) -> float:
    return arm.values(f"bench/save/{key}")[0]


def _highest(arm, key: str) -> float:
    return max(arm.values(f"bench/save/{key}"))


def overall(arm) -> str:
    peaks = (_first(arm, "peak_before_gib"), _highest(arm, "peak_gib"), arm.record["peak_rss"] / GIB)
    return f"{max(peaks):.2f}"


def added(arm) -> str:
    return f"{max(_highest(arm, 'peak_gib') - _first(arm, 'rss_start_gib'), 0):.2f}"


def _shown(pick, key: str, spec: str):
    return lambda arm: format(pick(arm, key), spec)


cells = {
    "before": _shown(_first, "peak_before_gib", ".2f"),  # everything before the first save
    "rss_start": _shown(_first, "rss_start_gib", ".2f"),
    "save_peak": _shown(_highest, "peak_gib", ".2f"),
    "overall": overall,
    "added": added,
    "checkpoint": _shown(_first, "file_gib", ".2f"),
    "seconds": _shown(_highest, "seconds", ".1f"),
}


def after(study: dict, arms: list, results) -> list[str]:
    if all(min(a.values("bench/save/reset")) == 1 for a in arms):
        return []
    return ["", "The peak RSS could not be reset here: the save peak is the process's peak so far."]
