"""
Empty Cache
===========

Gives the memory an allocator keeps after tensors die back to the system at chosen phase boundaries: the CUDA
caching allocator's unused blocks on a GPU, glibc's free heap pages (``malloc_trim``) on a CPU.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lit_rl.memory.host_allocator import MMAP_THRESHOLD_MAX, malloc_trim, set_malloc_thresholds, why_not_glibc
from lit_rl.memory.phases import BACKWARD
from lit_rl.memory.rss import read_rss
from lit_rl.memory.units import GIB


class EmptyCache(Callback):
    r"""Releases the allocator's cached memory at the start or end of chosen phases and logs how much it released.

    **On CUDA** it calls ``torch.cuda.empty_cache()``. *Saving*: generation (``rollout``) and the reference pass
    allocate many differently shaped blocks (KV caches growing token by token, one batch of log-probs); the
    caching allocator keeps them reserved after the tensors die. Releasing them before the policy update turns
    that fragmented reserve back into memory the backward pass can use, which is often the difference between
    fitting and an out-of-memory error whose message says "reserved but unallocated". It does not lower the
    peak of allocated tensors. *Cost*: each call synchronises the device, and the memory given back has to be
    re-requested from the driver (``cudaMalloc``) by the next phase, typically milliseconds to tens of
    milliseconds per step. The cheaper fix for fragmentation, when it suffices, is to start the process with
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (the allocator grows segments in place instead of
    keeping many fixed-size ones); it is an environment variable read when CUDA initialises, so it cannot be
    set from here.

    **On CPU with glibc** (Linux) it calls ``malloc_trim(0)``, which returns every whole free page of glibc's
    heaps to the OS. glibc keeps freed blocks below its (dynamic, up to 32 MiB) mmap threshold, so without it
    the process RSS holds activations, KV caches and gradient temporaries the step freed. *Saving* and *cost* are
    measured by ``python bench/study.py allocator`` (table in ``bench/results/allocator.md``): trimming at every
    phase end lowers the peak RSS between phases but not within one; each call costs the page faults of
    re-touching the released pages in the next phase.

    ``mmap_threshold`` / ``trim_threshold`` additionally fix glibc's thresholds in ``setup`` (``mallopt``),
    the run-time form of ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``: every block above the mmap
    threshold then goes back to the OS as soon as it is freed, inside a phase too. *Saving*: the lowest RSS of
    all options. *Cost*: an ``mmap``/``munmap`` pair and fresh page faults for every large allocation, more step
    time than trimming at every phase end (both measured on ``configs/grpo.yaml`` in
    ``bench/results/allocator.md``). Process-wide and for the rest of the process. Blocks allocated before
    ``setup`` (``import torch``) stay where they are.

    Elsewhere (macOS, musl, Windows), and where jemalloc or tcmalloc serves ``malloc`` (``LD_PRELOAD``), the CPU work
    is a no-op that says once why.

    **Logged Metrics** (each training step in which it released something, ``step = trainer.global_step``):

    - ``memory/empty_cache/freed_gib``: CUDA reserved memory (CUDA) or process RSS (CPU) before minus after,
      summed over the step's calls

    Args:
        phases: the phases at whose boundary memory is released: any the method declares
            (``pl_module.phases.names``; for GRPO ``rollout``, ``reference``, ``policy_forward``, ``backward``,
            ``optimizer``), ``"all"`` for every declared phase, or ``None`` (the default) for the phases a method
            declares before its update's forward, which is the phase listed just before ``backward``: the
            update's activations are still needed by the backward, and releasing inside the update would cost a
            device sync per micro-batch. That is ``rollout`` and ``reference`` for RefCachedGRPO and Intuitor,
            ``generate`` for GumbelTopK; any method gets a default that fits its own phases.
        when: ``"end"`` (after the phase, releasing what it left behind) or ``"start"`` (before it).
        mmap_threshold: glibc ``M_MMAP_THRESHOLD`` in bytes (0 to 32 MiB), applied in ``setup``; ``None`` keeps
            glibc's dynamic threshold.
        trim_threshold: glibc ``M_TRIM_THRESHOLD`` in bytes, applied in ``setup``; ``None`` keeps glibc's.

    Raises:
        MisconfigurationException:
            If a phase name is not one the method declares, ``when`` is neither ``"start"`` nor ``"end"``, a
            threshold is out of glibc's range, or the LightningModule has no ``phases`` attribute.

    Example::

        # callbacks/empty_cache.yaml
        trainer:
          callbacks+:
            - class_path: lit_rl.callbacks.EmptyCache
              init_args: {phases: null, when: end}
    """

    def __init__(
        self,
        phases: list[str] | Literal["all"] | None = None,
        when: Literal["start", "end"] = "end",
        mmap_threshold: int | None = None,
        trim_threshold: int | None = None,
    ) -> None:
        self.phases: list[str] | Literal["all"] | None = phases if phases in (None, "all") else list(phases)
        self.when = when
        self.mmap_threshold = mmap_threshold
        self.trim_threshold = trim_threshold
        self._names: tuple[str, ...] = ()
        self._mode: Literal["cuda", "trim", "off"] = "off"
        self._device: torch.device | None = None
        self._freed = 0
        self._calls = 0
        self._said_noop = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.when not in ("start", "end"):
            raise MisconfigurationException(f"EmptyCache(when={self.when!r}): use 'start' or 'end'.")
        for name, value, top in (
            ("mmap", self.mmap_threshold, MMAP_THRESHOLD_MAX),
            ("trim", self.trim_threshold, None),
        ):
            if value is not None and (not isinstance(value, int) or value < 0 or (top is not None and value > top)):
                limit = f"0 to {top} bytes (32 MiB, glibc's maximum)" if top else "a byte count >= 0"
                raise MisconfigurationException(
                    f"EmptyCache({name}_threshold={value!r}): use {limit}, e.g. 65536, or null to keep glibc's default."
                )
        tracker = getattr(pl_module, "phases", None)
        if tracker is None or not hasattr(tracker, "add_listener"):
            raise MisconfigurationException(
                f"EmptyCache needs `{type(pl_module).__name__}.phases` (a lit_rl.memory.phases.PhaseTracker) to know "
                "the phase boundaries; use a lit-rl method or remove the EmptyCache callback."
            )
        declared = tuple(getattr(tracker, "names", ()))
        if isinstance(self.phases, list):
            unknown = [p for p in self.phases if p not in declared]
            if unknown:
                raise MisconfigurationException(
                    f"EmptyCache(phases={self.phases}): unknown phase(s) {unknown}; {type(pl_module).__name__} "
                    f"declares {list(declared)} (or use phases: all, or null for the phases before its update)."
                )
        if self.phases is None:
            self._names = default_phases(declared)
            if not self._names:
                rank_zero_info(
                    f"EmptyCache: {type(pl_module).__name__} declares no phase before its update's forward "
                    f"({list(declared)}), so phases: null releases nothing; name phases or use phases: all."
                )
        else:
            self._names = declared if self.phases == "all" else tuple(self.phases)
        self._device = trainer.strategy.root_device
        if self._device.type == "cuda" and torch.cuda.is_available():
            self._mode = "cuda"
        elif why_not_glibc():
            self._mode = "off"
        else:
            self._mode = "trim"
        if self.mmap_threshold is not None or self.trim_threshold is not None:
            try:
                set_malloc_thresholds(self.mmap_threshold, self.trim_threshold)
            except ValueError as err:  # glibc refused a value the checks above let through
                raise MisconfigurationException(f"EmptyCache: {err}") from err
        if self._mode == "off":
            if not self._said_noop:
                what = "malloc_trim" + ("/mallopt" if self.mmap_threshold or self.trim_threshold else "")
                rank_zero_info(
                    f"EmptyCache: training runs on {self._device} without CUDA and {why_not_glibc()}: {what} is "
                    "glibc's, so this callback is a no-op."
                )
                self._said_noop = True
            return
        tracker.add_listener(self)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        tracker = getattr(pl_module, "phases", None)
        if tracker is not None and hasattr(tracker, "remove_listener"):
            tracker.remove_listener(self)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._calls:
            return
        metrics = {"memory/empty_cache/freed_gib": self._freed / GIB}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        self._freed = self._calls = 0

    def on_phase_start(self, name: str) -> None:
        if self.when == "start" and name in self._names:
            self._release()

    def on_phase_end(self, name: str) -> None:
        if self.when == "end" and name in self._names:
            self._release()

    def _release(self) -> None:
        if self._mode == "cuda":
            before = torch.cuda.memory_reserved(self._device)
            torch.cuda.empty_cache()
            after = torch.cuda.memory_reserved(self._device)
        elif self._mode == "trim":
            before = read_rss() or 0
            malloc_trim()
            after = read_rss() or 0
        else:
            return
        self._freed += before - after
        self._calls += 1


def default_phases(declared: tuple[str, ...]) -> tuple[str, ...]:
    """The phases declared before the update's forward: every phase ahead of the one just before ``backward``.

    ``(rollout, reference, policy_forward, backward, optimizer)`` gives ``(rollout, reference)``; a method whose
    only phase before ``backward`` is the update's forward gives none.
    """
    before = declared[: declared.index(BACKWARD)] if BACKWARD in declared else declared
    return before[:-1]
