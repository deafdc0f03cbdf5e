"""Seeded, resumable, DDP-aware weighted sampling with replacement.

One global stream of indices per epoch is defined by ``(seed, epoch)`` alone: draw ``g`` of the
stream depends on neither the number of ranks nor the epoch length. Under DDP rank ``r`` of ``W``
takes draws ``r, r + W, r + 2W, ...``, so the ranks' parts are disjoint and together they are the
stream a single process would draw. Uniform and density-weighted sampling share this code path
(``weights=None`` is uniform).

Draws are made in blocks of ``BLOCK`` from a ``torch.Generator`` seeded by ``(seed, epoch, block)``,
so a resumed sampler jumps to its position without replaying the epoch, and the stream does not
change when the epoch is made longer or shorter. Each draw is an inverse-CDF lookup
(``searchsorted`` of a float64 uniform in the cumulative weights), which has no limit on the
number of prompts (``torch.multinomial`` stops at 2^24 categories).

Why this replaces Lightning's automatic ``DistributedSampler``: Lightning would wrap any other
sampler in ``DistributedSamplerWrapper``, which materialises an epoch, shuffles it and keeps every
``W``-th element, so a weighted stream would be re-shuffled and its per-rank split would depend on
the wrapper. ``WeightedStreamSampler`` subclasses ``DistributedSampler`` (without using its
``__init__``; every method is overridden) precisely so that Lightning recognises it as already
distributed and leaves it in place, whatever ``Trainer(use_distributed_sampler=...)`` says.

Resuming inside an epoch (how to carry the state in a Lightning checkpoint):

Lightning 2.6 saves ``state_dict()`` of every *DataLoader* that has ``state_dict`` /
``load_state_dict`` (``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]``) and the
*DataModule's* ``state_dict()`` (``checkpoint["PromptDataModule"]``); a sampler is never asked on
its own. Hook it through the DataModule, recording what training consumed rather than what the
sampler yielded (DataLoader workers prefetch ``num_workers * prefetch_factor`` batches ahead):

.. code-block:: python

    def state_dict(self):
        if self._train_sampler is None:
            return {}
        epoch, position = trained_position(self.trainer, self.batch_size)
        return {"sampler": self._train_sampler.state_dict(epoch=epoch, position=position)}

    def load_state_dict(self, state):
        self._sampler_state = state.get("sampler")  # applied when the sampler is built

    def train_dataloader(self):
        self._train_sampler = WeightedStreamSampler(self.weights, seed=self.seed)
        if self._sampler_state is not None:
            self._train_sampler.load_state_dict(self._sampler_state)
            self._sampler_state = None
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=self._train_sampler, ...)

Lightning restores the DataModule before it first calls ``train_dataloader()`` (for ``ddp`` and
single-device runs; FSDP and DeepSpeed restore after ``configure_optimizers``, so there
``load_state_dict`` should also apply the state to an existing ``self._train_sampler``: a live
iterator follows ``load_state_dict``). The DataModule route avoids Lightning issue #20550, where
DataLoader states are dropped when ``configure_optimizers`` reads
``trainer.estimated_stepping_batches``. Only rank 0 writes the checkpoint; every rank draws the
same number of samples per step, so the per-rank ``position`` holds for all ranks; a different
``world_size`` on resume is converted through the global position (rounded down). Checked with
``ModelCheckpoint(every_n_train_steps=...)`` mid-epoch, at epoch end, with
``limit_train_batches``, with ``num_workers=2`` and after ``trainer.save_checkpoint`` at the end
of ``fit``: the resumed run trains on exactly the indices of an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler

__all__ = ["UniformStreamSampler", "WeightedStreamSampler", "trained_position"]

BLOCK = 4096  # draws per generator seed; part of the stream's definition, do not change casually


def _dist_default(rank: int | None, world_size: int | None) -> tuple[int, int]:
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if world_size is None:
        world_size = torch.distributed.get_world_size() if initialised else 1
    if rank is None:
        rank = torch.distributed.get_rank() if initialised else 0
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    return rank, world_size


def _block_seed(seed: int, epoch: int, block: int) -> int:
    # SeedSequence mixes the three numbers well: neighbouring epochs/blocks get unrelated streams
    state = np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, epoch, block]).generate_state(2, np.uint32)
    return (int(state[0]) << 32 | int(state[1])) & 0x7FFFFFFFFFFFFFFF


class WeightedStreamSampler(DistributedSampler):
    """Weighted sampling with replacement: a seeded stream per epoch, split across DDP ranks, resumable.

    Args:
        weights: ``[N]`` non-negative sampling weights (need not sum to 1), e.g. from
            :func:`lit_rl.data.density.inverse_density_weights`; ``None`` samples uniformly over
            ``num_items``.
        num_samples_per_epoch: length of the global stream per epoch; default ``N``. Each rank
            yields ``ceil(num_samples_per_epoch / world_size)`` indices (the global stream is
            extended to a multiple of ``world_size`` so that all ranks take the same number of steps).
        seed: the stream is a function of ``(seed, epoch)``.
        rank: this process's rank; default ``torch.distributed.get_rank()`` when initialised, else 0.
        world_size: number of ranks; default ``torch.distributed.get_world_size()`` when initialised, else 1.
        num_items: ``N`` when ``weights`` is ``None``.

    Iteration: an iterator is a cursor on the sampler's ``(epoch, position)``; a new one starts
    there and ends any older one. Running to the end of an epoch moves the sampler to the start of
    the next epoch (so plain ``for epoch ...: for batch in loader`` loops get a fresh stream each
    time); ``set_epoch(e)`` with a different ``e`` starts epoch ``e`` from the beginning, and with
    the same ``e`` changes nothing (Lightning calls it after restoring a mid-epoch position).

    Raises:
        ValueError: negative, non-finite or all-zero weights; a rank outside ``[0, world_size)``.

    Example::

        sampler = WeightedStreamSampler(weights, seed=0)
        loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    """

    def __init__(
        self,
        weights: Sequence[float] | np.ndarray | torch.Tensor | None,
        num_samples_per_epoch: int | None = None,
        *,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        num_items: int | None = None,
    ) -> None:
        # DistributedSampler.__init__ is not called: it needs a dataset and an initialised process group
        if weights is None:
            if num_items is None or num_items < 1:
                raise ValueError("uniform sampling (weights=None) needs num_items >= 1")
            self.num_items = int(num_items)
            self._cdf = None
        else:
            w = torch.as_tensor(np.asarray(weights, dtype=np.float64)).flatten()
            if w.numel() == 0:
                raise ValueError("weights is empty")
            if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
                raise ValueError("weights must be finite, non-negative and not all zero")
            cdf = torch.cumsum(w, 0)
            self._cdf = cdf / cdf[-1]  # [N]; exactly 1.0 at the last positive weight
            self.num_items = w.numel()
        self.rank, self.num_replicas = _dist_default(rank, world_size)
        self.total = int(num_samples_per_epoch) if num_samples_per_epoch is not None else self.num_items
        if self.total < 1:
            raise ValueError(f"num_samples_per_epoch={num_samples_per_epoch} must be at least 1")
        self.num_samples = -(-self.total // self.num_replicas)  # per rank
        self.total_size = self.num_samples * self.num_replicas
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0  # samples this rank has yielded in the current epoch
        # attributes DistributedSampler users may read
        self.dataset = None
        self.shuffle = True
        self.drop_last = False
        self._generation = 0  # a new iterator ends older ones: they share (epoch, position)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning; calling it again with the current epoch does nothing."""
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.position = 0

    def _block(self, epoch: int, block: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(_block_seed(self.seed, epoch, block))
        u = torch.rand(BLOCK, generator=gen, dtype=torch.float64)  # [BLOCK]
        if self._cdf is None:
            idx = (u * self.num_items).long()
        else:
            idx = torch.searchsorted(self._cdf, u, right=True)
        return idx.clamp_(max=self.num_items - 1)

    def global_stream(self, epoch: int, length: int) -> torch.Tensor:
        """The first ``length`` draws of epoch ``epoch``'s global stream (what one process would yield)."""
        blocks = [self._block(epoch, b) for b in range(-(-length // BLOCK))]
        return torch.cat(blocks)[:length] if blocks else torch.empty(0, dtype=torch.long)

    def __iter__(self) -> Iterator[int]:
        if self.position >= self.num_samples:  # restored at the very end of an epoch
            self.epoch, self.position = self.epoch + 1, 0
        self._generation += 1
        generation = self._generation
        key, draws = None, []
        # a cursor on (epoch, position): a live iterator follows load_state_dict() and set_epoch(),
        # so a restore that lands after Lightning created the iterator still takes effect
        while generation == self._generation and self.position < self.num_samples:
            g = self.position * self.num_replicas + self.rank  # this rank's next draw in the global stream
            block = g // BLOCK
            if key != (self.seed, self.epoch, block):
                key, draws = (self.seed, self.epoch, block), self._block(self.epoch, block).tolist()
            self.position += 1
            yield draws[g - block * BLOCK]
        if generation == self._generation:  # ran to the end: the next iterator starts the next epoch
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self, *, epoch: int | None = None, position: int | None = None) -> dict[str, Any]:
        """``{"epoch", "position", "seed", "world_size"}``.

        ``position`` counts the samples this rank has yielded in ``epoch``. Both can be overridden
        with what training actually consumed, which lags behind what DataLoader workers prefetched:
        see :func:`trained_position`.
        """
        ep = self.epoch if epoch is None else int(epoch)
        pos = self.position if position is None else int(position)
        if pos >= self.num_samples:  # a finished epoch resumes at the start of the next one
            ep, pos = ep + 1, 0
        return {"epoch": ep, "position": pos, "seed": self.seed, "world_size": self.num_replicas}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the stream saved by :meth:`state_dict`: the next index is the one that would
        have followed. The checkpoint's seed wins over the constructor's."""
        self.seed = int(state_dict["seed"])
        self.epoch = int(state_dict["epoch"])
        position = int(state_dict["position"])
        saved_world = int(state_dict.get("world_size", self.num_replicas))
        if saved_world != self.num_replicas:  # same global position, split over a new number of ranks
            position = position * saved_world // self.num_replicas
        self.position = position


class UniformStreamSampler(WeightedStreamSampler):
    """Uniform sampling with replacement over ``num_items``, on the same seeded, resumable stream.

    Args:
        num_items: dataset size ``N``.
        others: as in :class:`WeightedStreamSampler`.
    """

    def __init__(
        self,
        num_items: int,
        num_samples_per_epoch: int | None = None,
        *,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__(None, num_samples_per_epoch, seed=seed, rank=rank, world_size=world_size, num_items=num_items)


def trained_position(trainer: Any, batch_size: int) -> tuple[int, int]:
    """``(epoch, position)`` of the next sample a resumed run should train on, from Lightning's loop progress.

    The sampler's own position runs ahead of training when DataLoader workers prefetch, so a
    checkpoint must record what the training loop consumed. Lightning resumes an epoch after the
    batches counted in ``batch_progress.current.processed`` (a checkpoint written in
    ``on_train_batch_end`` includes the batch just trained), and ``epoch_progress`` tells whether the
    epoch is still running (``started > processed``) or its training part is over.

    Args:
        trainer: the ``lightning.pytorch.Trainer`` that is saving a checkpoint.
        batch_size: samples per training batch on one rank.
    """
    fit_loop = trainer.fit_loop
    ep = fit_loop.epoch_progress.current
    done = fit_loop.epoch_loop.batch_progress.current.processed
    if ep.started > ep.processed:  # inside an epoch
        if done < trainer.num_training_batches:
            return ep.processed, done * batch_size
        return ep.processed + 1, 0  # its last batch is done, the epoch-end hooks are pending
    return ep.processed, 0  # between epochs: ``processed`` is the index of the next one
