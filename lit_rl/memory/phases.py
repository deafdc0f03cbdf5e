"""Named phases of a training step, declared by each method, announced by it, and heard by callbacks.

A method declares the names of its phases (``RefCachedGRPO``: ``rollout``, ``reference``,
``policy_forward``, ``backward``, ``optimizer``; another method may have ``generate`` and ``reward``
instead of the first three) and wraps each part of its step in ``with self.phases("rollout"):``.
Listeners (the memory profiler, the empty-cache tactic, the OOM report, the estimator) register with
:meth:`PhaseTracker.add_listener` and are told when each phase starts and ends; they learn the names
from :attr:`PhaseTracker.names`, never from a global list. The tracker itself records the wall time
of every phase, which the methods log as ``time/<phase>_s``.

A step may announce a subset of its phases (``reference`` is skipped when ``beta = 0``) or repeat one
(``policy_forward`` and ``backward`` once per micro-batch). Two phases belong to every method,
because the shared base announces them around every update: :data:`BACKWARD` and :data:`OPTIMIZER`.
Tensors allocated in them are scratch space (:data:`SCRATCH_PHASES`), not saved activations.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

BACKWARD = "backward"
OPTIMIZER = "optimizer"
# phases whose fresh allocations are scratch space (gradient temporaries, optimizer temporaries)
SCRATCH_PHASES: tuple[str, ...] = (BACKWARD, OPTIMIZER)


@runtime_checkable
class PhaseListener(Protocol):
    """Anything with these two methods can listen to a :class:`PhaseTracker`."""

    def on_phase_start(self, name: str) -> None: ...

    def on_phase_end(self, name: str) -> None: ...


class PhaseTracker:
    """Announces phase boundaries to listeners and accumulates per-phase wall time.

    Args:
        names: the phase names the owner may announce, in step order; announcing another name raises
            ``ValueError`` (a typo would otherwise be measured as a phase of its own).

    Example::

        phases = PhaseTracker(("rollout", "backward", "optimizer"))
        with phases("rollout"):
            ...
        phases.pop_times()  # {"rollout": 0.42}
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names: tuple[str, ...] = tuple(names)
        if len(set(self.names)) != len(self.names) or not all(isinstance(n, str) and n for n in self.names):
            raise ValueError(f"phase names must be distinct non-empty strings, got {self.names}")
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

    def check(self, names: Iterable[str], who: str) -> None:
        """Raise ``ValueError`` naming ``who`` if any of ``names`` is not one of :attr:`names`."""
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise ValueError(f"{who}: unknown phase(s) {unknown}; this method's phases are {list(self.names)}")

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if name not in self.names:
            raise ValueError(f"phase {name!r} is not declared; declare it in the method's phase_names {self.names}")
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
