"""
Empty Cache
===========

Returns the CUDA caching allocator's unused blocks to the driver at chosen phase boundaries.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lit_rl.memory.units import GIB


class EmptyCache(Callback):
    r"""Calls ``torch.cuda.empty_cache()`` at the start or end of chosen phases and logs what it freed.

    **Saving**: generation (``rollout``) and the reference pass allocate many differently shaped
    blocks (KV caches growing token by token, one batch of log-probs); the caching allocator keeps
    them reserved after the tensors die. Releasing them before the policy update turns that
    fragmented reserve back into memory the backward pass can use, which is often the difference
    between fitting and an out-of-memory error whose message says "reserved but unallocated". It
    does not lower the peak of allocated tensors, only the reserved-but-unused part.

    **Cost**: each call synchronises the device, and the memory given back has to be re-requested
    from the driver (``cudaMalloc``) by the next phase, which stalls it, typically by milliseconds
    to tens of milliseconds per step. Call it at few boundaries; ``expandable_segments:True`` in
    ``PYTORCH_CUDA_ALLOC_CONF`` is the cheaper fix for fragmentation when it suffices.

    Without CUDA there is no cache to empty: the callback does nothing and says so once.

    **Logged Metrics** (each training step on CUDA, ``step = trainer.global_step``):

    - ``memory/empty_cache/freed_gib``: reserved memory before minus after, summed over the step's calls

    Args:
        phases: the phases at whose boundary the cache is emptied: any the method declares
            (``pl_module.phases.names``; for GRPO ``rollout``, ``reference``, ``policy_forward``,
            ``backward``, ``optimizer``).
        when: ``"end"`` (after the phase, releasing what it left behind) or ``"start"`` (before it).

    Raises:
        MisconfigurationException:
            If a phase name is not one the method declares, ``when`` is neither ``"start"`` nor ``"end"``, or
            the LightningModule has no ``phases`` attribute.

    Example::

        # callbacks/empty_cache.yaml
        trainer:
          callbacks+:
            - class_path: lit_rl.callbacks.EmptyCache
              init_args: {phases: [rollout, reference], when: end}
    """

    def __init__(self, phases: list[str] | None = None, when: Literal["start", "end"] = "end") -> None:
        self.phases = list(phases) if phases is not None else ["rollout", "reference"]
        self.when = when
        self._cuda = False
        self._device: torch.device | None = None
        self._freed = 0
        self._calls = 0
        self._said_noop = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.when not in ("start", "end"):
            raise MisconfigurationException(f"EmptyCache(when={self.when!r}): use 'start' or 'end'.")
        tracker = getattr(pl_module, "phases", None)
        if tracker is None or not hasattr(tracker, "add_listener"):
            raise MisconfigurationException(
                f"EmptyCache needs `{type(pl_module).__name__}.phases` (a lit_rl.memory.phases.PhaseTracker) to know "
                "the phase boundaries; use a lit-rl method or remove the EmptyCache callback."
            )
        declared = list(getattr(tracker, "names", ()))
        unknown = [p for p in self.phases if p not in declared]
        if unknown:
            raise MisconfigurationException(
                f"EmptyCache(phases={self.phases}): unknown phase(s) {unknown}; {type(pl_module).__name__} "
                f"declares {declared}."
            )
        self._device = trainer.strategy.root_device
        self._cuda = self._device.type == "cuda" and torch.cuda.is_available()
        if not self._cuda:
            if not self._said_noop:
                rank_zero_info(f"EmptyCache: training runs on {self._device}, which has no CUDA cache to empty; no-op.")
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
        if self.when == "start" and name in self.phases:
            self._empty()

    def on_phase_end(self, name: str) -> None:
        if self.when == "end" and name in self.phases:
            self._empty()

    def _empty(self) -> None:
        if not self._cuda:
            return
        before = torch.cuda.memory_reserved(self._device)
        torch.cuda.empty_cache()
        self._freed += before - torch.cuda.memory_reserved(self._device)
        self._calls += 1
