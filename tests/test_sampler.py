"""The weighted stream sampler: reproducible, follows the weights, splits across ranks, resumes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lit_rl.data.sampler import BLOCK, UniformStreamSampler, WeightedStreamSampler

WEIGHTS = np.array([1.0, 2.0, 3.0, 4.0, 0.0, 10.0])


def test_reproducible_for_a_seed_and_epoch():
    a = list(WeightedStreamSampler(WEIGHTS, 500, seed=7))
    assert a == list(WeightedStreamSampler(WEIGHTS, 500, seed=7))
    assert a != list(WeightedStreamSampler(WEIGHTS, 500, seed=8))
    s = WeightedStreamSampler(WEIGHTS, 500, seed=7)
    s.set_epoch(1)
    assert list(s) != a


def test_frequencies_follow_the_weights():
    n = 200_000
    draws = WeightedStreamSampler(WEIGHTS, seed=0).global_stream(0, n).numpy()
    counts = np.bincount(draws, minlength=len(WEIGHTS))
    assert counts[4] == 0  # zero weight: never drawn
    p = WEIGHTS / WEIGHTS.sum()
    nz = p > 0
    chi2 = ((counts[nz] - n * p[nz]) ** 2 / (n * p[nz])).sum()
    assert chi2 < 25  # 4 degrees of freedom: P(chi2 > 25) < 1e-4


def test_uniform_shares_the_code_path():
    s = UniformStreamSampler(50, 100_000, seed=0)
    counts = np.bincount(s.global_stream(0, 100_000).numpy(), minlength=50)
    chi2 = ((counts - 2000) ** 2 / 2000).sum()
    assert chi2 < 100  # 49 degrees of freedom: P(chi2 > 100) < 1e-4
    assert list(WeightedStreamSampler(None, 300, seed=3, num_items=50)) == list(UniformStreamSampler(50, 300, seed=3))


def test_iteration_equals_global_stream_across_blocks():
    n = 2 * BLOCK + 123
    s = WeightedStreamSampler(WEIGHTS, n, seed=1)
    assert list(s) == s.global_stream(0, n).tolist()
    # the stream does not depend on the epoch length
    assert s.global_stream(0, 50).tolist() == s.global_stream(0, n)[:50].tolist()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("total", [BLOCK + 7, 30])
def test_ddp_shards_are_disjoint_and_complete(world_size, total):
    single = list(WeightedStreamSampler(WEIGHTS, total, seed=5))
    shards = [
        list(WeightedStreamSampler(WEIGHTS, total, seed=5, rank=r, world_size=world_size)) for r in range(world_size)
    ]
    per_rank = -(-total // world_size)
    assert all(len(s) == per_rank for s in shards)  # every rank takes the same number of steps
    # rank r holds positions r, r + W, ... of one global stream: disjoint, and interleaved they are it
    interleaved = [shards[p % world_size][p // world_size] for p in range(per_rank * world_size)]
    assert interleaved[:total] == single
    assert interleaved == WeightedStreamSampler(WEIGHTS, seed=5).global_stream(0, per_rank * world_size).tolist()


def test_rank_defaults_without_process_group_and_validation():
    s = WeightedStreamSampler(WEIGHTS)
    assert (s.rank, s.num_replicas, len(s)) == (0, 1, len(WEIGHTS))
    with pytest.raises(ValueError, match="rank=2"):
        WeightedStreamSampler(WEIGHTS, rank=2, world_size=2)
    with pytest.raises(ValueError, match="non-negative"):
        WeightedStreamSampler([1.0, -1.0])
    with pytest.raises(ValueError, match="not all zero"):
        WeightedStreamSampler([0.0, 0.0])
    with pytest.raises(ValueError, match="num_items"):
        WeightedStreamSampler(None)


def test_lightning_leaves_it_in_place():
    # Lightning only injects its DistributedSamplerWrapper when the sampler is not a DistributedSampler
    assert isinstance(WeightedStreamSampler(WEIGHTS), DistributedSampler)


@pytest.mark.parametrize("world_size", [1, 3])
def test_state_dict_resume_continues_the_stream(world_size):
    rank = world_size - 1
    full = WeightedStreamSampler(WEIGHTS, 40, seed=2, rank=rank, world_size=world_size)
    full.set_epoch(3)
    expected = list(full)
    s = WeightedStreamSampler(WEIGHTS, 40, seed=2, rank=rank, world_size=world_size)
    s.set_epoch(3)
    it = iter(s)
    head = [next(it) for _ in range(5)]
    state = s.state_dict()
    assert state == {"epoch": 3, "position": 5, "seed": 2, "world_size": world_size}
    resumed = WeightedStreamSampler(WEIGHTS, 40, seed=99, rank=rank, world_size=world_size)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # Lightning calls this after restoring: same epoch, no reset
    assert head + list(resumed) == expected


def test_resume_on_a_different_world_size():
    two = [WeightedStreamSampler(WEIGHTS, 40, seed=2, rank=r, world_size=2) for r in range(2)]
    its = [iter(s) for s in two]
    for it in its:
        for _ in range(6):  # 12 global draws consumed
            next(it)
    one = WeightedStreamSampler(WEIGHTS, 40, seed=2)
    one.load_state_dict(two[0].state_dict())
    assert list(one) == WeightedStreamSampler(WEIGHTS, seed=2).global_stream(0, 40)[12:].tolist()


def test_epochs_advance_and_end_of_epoch_state():
    s = WeightedStreamSampler(WEIGHTS, 20, seed=0)
    first, second = list(s), list(s)  # a plain loop without set_epoch gets a new epoch each time
    assert first == s.global_stream(0, 20).tolist() and second == s.global_stream(1, 20).tolist()
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["position"] == 0
    assert s.state_dict(epoch=0, position=20) == {"epoch": 1, "position": 0, "seed": 0, "world_size": 1}
    s.set_epoch(5)
    assert list(s) == s.global_stream(5, 20).tolist()


def test_live_iterator_follows_load_state_dict():
    s = WeightedStreamSampler(WEIGHTS, 30, seed=4)
    it = iter(s)
    next(it)  # e.g. prefetched before Lightning restored the checkpoint
    s.load_state_dict({"epoch": 0, "position": 10, "seed": 4})
    assert list(it) == s.global_stream(0, 30)[10:].tolist()


class _Indices(Dataset):
    def __len__(self):
        return 37

    def __getitem__(self, i):
        return torch.tensor([float(i)])


def test_lightning_checkpoint_resumes_the_same_stream(tmp_path):
    """A run stopped mid-epoch and resumed from its checkpoint trains on the uninterrupted run's indices."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_rl.data.sampler import trained_position

    seen: list[list[int]] = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            seen.append(batch[:, 0].long().tolist())
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Data(L.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.sampler, self.state = None, None

        def train_dataloader(self):
            self.sampler = WeightedStreamSampler(np.linspace(1, 3, 37), 30, seed=1)
            if self.state is not None:
                self.sampler.load_state_dict(self.state)
            return DataLoader(_Indices(), batch_size=4, sampler=self.sampler)

        def state_dict(self):
            epoch, position = trained_position(self.trainer, 4)
            return {"sampler": self.sampler.state_dict(epoch=epoch, position=position)}

        def load_state_dict(self, state):
            self.state = state["sampler"]

    def fit(max_steps, ckpt_path=None, callbacks=()):
        seen.clear()
        trainer = L.Trainer(
            max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
        )  # fmt: skip
        trainer.fit(Module(), datamodule=Data(), ckpt_path=ckpt_path)
        return list(seen)

    full = fit(12)  # 8 batches per epoch: crosses into the second epoch
    head = fit(5, callbacks=[ModelCheckpoint(tmp_path, every_n_train_steps=5)])
    tail = fit(12, ckpt_path=str(tmp_path / "epoch=0-step=5.ckpt"))
    assert head + tail == full
