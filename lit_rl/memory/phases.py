"""Named phases of a training step, announced by the methods and heard by callbacks.

A method wraps each part of its step in ``with self.phases("rollout"):``. Listeners (the memory
profiler, the empty-cache tactic, the OOM report) register with :meth:`PhaseTracker.add_listener`
and are told when each phase starts and ends. The tracker itself records the wall time of every
phase, which the methods log as ``time/<phase>_s``.

The phase names a step may announce are listed in :data:`PHASES`; a method may announce a subset
(``reference`` is skipped when ``beta = 0``) or repeat a phase (``policy_forward`` and
``backward`` once per micro-batch).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

PHASES: tuple[str, ...] = ("rollout", "reference", "policy_forward", "backward", "optimizer")


@runtime_checkable
class PhaseListener(Protocol):
    """Anything with these two methods can listen to a :class:`PhaseTracker`."""

    def on_phase_start(self, name: str) -> None: ...

    def on_phase_end(self, name: str) -> None: ...


class PhaseTracker:
    """Announces phase boundaries to listeners and accumulates per-phase wall time.

    Example::

        phases = PhaseTracker()
        with phases("rollout"):
            ...
        phases.pop_times()  # {"rollout": 0.42}
    """

    def __init__(self) -> None:
        self._listeners: list[PhaseListener] = []
        self._times: dict[str, float] = defaultdict(float)
        self.current: str | None = None

    def add_listener(self, listener: PhaseListener) -> None:
        if not isinstance(listener, PhaseListener):
            raise TypeError(f"{type(listener).__name__} needs on_phase_start(name) and on_phase_end(name)")
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_listener(self, listener: PhaseListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        previous = self.current
        self.current = name
        for listener in self._listeners:
            listener.on_phase_start(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._times[name] += time.perf_counter() - start
            # listeners hear the end in reverse order, so nested tactics unwind like context managers
            for listener in reversed(self._listeners):
                listener.on_phase_end(name)
            self.current = previous

    def pop_times(self) -> dict[str, float]:
        """Seconds spent in each phase since the last call (summed over repeats), then reset."""
        times = dict(self._times)
        self._times.clear()
        return times
