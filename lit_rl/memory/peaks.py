"""Per-phase peaks with nested phases: the one folding rule the profiler and the estimator share.

A phase's peak is the highest reading between its start and end, over all its repeats (``backward``
runs once per micro-batch). Phases may nest: the outer phase's peak covers the inner one's, and what
the outer phase reached before the inner one started is kept, because starting the inner phase
resets the reading.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lit_rl.memory.phases import SCRATCH_PHASES


def merge(*peaks: dict[str, Any]) -> dict[str, Any]:
    """Element-wise max of peak dicts; ``breakdown`` is the one taken at the largest ``peak_bytes``."""
    out: dict[str, Any] = {}
    best = -1
    for p in peaks:
        for key, value in p.items():
            if key != "breakdown":
                out[key] = max(out.get(key, value), value)
        if "breakdown" in p and p.get("peak_bytes", 0) > best:
            best = p.get("peak_bytes", 0)
            out["breakdown"] = p["breakdown"]
    return out


def category_for(phase: str | None) -> str:
    """Where the tensor tracker files fresh allocations made during ``phase``."""
    return "temporaries" if phase in SCRATCH_PHASES else "activations"


class PhasePeaks:
    """Folds readings into per-phase peaks as phases start and end (possibly nested).

    Args:
        read: the current peak readings since the last reset, e.g. ``{"peak_bytes": ..., "breakdown": {...}}``.
        reset: starts a new peak window (allocator counters, tracker peak, RSS high-water mark).

    Attributes:
        phases: phase -> merged peaks over every occurrence so far.
        occurrences: ``(phase, peaks)`` of each ended occurrence, in order.
    """

    def __init__(self, read: Callable[[], dict[str, Any]], reset: Callable[[], None]) -> None:
        self.read = read
        self.reset = reset
        self.phases: dict[str, dict[str, Any]] = {}
        self.occurrences: list[tuple[str, dict[str, Any]]] = []
        self._stack: list[tuple[str, dict[str, Any]]] = []

    @property
    def current(self) -> str | None:
        """The innermost open phase."""
        return self._stack[-1][0] if self._stack else None

    @property
    def depth(self) -> int:
        return len(self._stack)

    def start(self, name: str) -> None:
        if self._stack:  # nested: keep what the outer phase reached before the reset
            outer, peaks = self._stack[-1]
            self._stack[-1] = (outer, merge(peaks, self.read()))
        self._stack.append((name, {}))
        self.reset()

    def end(self) -> dict[str, Any]:
        """Close the innermost phase; returns its peaks."""
        name, peaks = self._stack.pop()
        peaks = merge(peaks, self.read())
        self.phases[name] = merge(self.phases.get(name, {}), peaks)
        self.occurrences.append((name, peaks))
        if self._stack:
            outer, outer_peaks = self._stack[-1]
            self._stack[-1] = (outer, merge(outer_peaks, peaks))
        return peaks

    def clear(self) -> None:
        self.phases.clear()
        self.occurrences.clear()
        self._stack.clear()
