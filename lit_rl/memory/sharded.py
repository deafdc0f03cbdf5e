"""The estimate of one process of a sharded run (FSDP2): the same sharding, over processes that do not exist.

``lit-rl estimate`` on a config whose strategy is :class:`lit_rl.strategies.FSDP2Strategy` predicts the peak of
one process. It shards the method's models exactly as the run does (:func:`lit_rl.models.sharding.shard_model`),
on the fake tensors the estimate runs on, over a process group of torch's ``fake`` backend, whose collectives do
nothing: every process holds the same shapes, so one process's tensors are every process's. What the tensor
accounting then sees is what a process holds: its shard of the weights, gradients and optimizer state (made by
the optimizer from the sharded weights), the layers gathered for a forward or backward and freed after (FSDP2
frees a gathered weight by resizing its storage, which :class:`~lit_rl.memory.tracker.TensorMemoryTracker`
follows), the root unit (embedding and head) gathered from a step's first forward to its optimizer step, and
the policy gathered whole for the rollout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

STRATEGY = "lit_rl.strategies.FSDP2Strategy"


def sharding_settings(trainer_config: dict) -> dict:
    """:func:`~lit_rl.memory.estimate_step`'s ``shard_processes`` (devices x nodes under FSDP2Strategy, else 1),
    ``rollout_gather`` and ``shard_offload`` (the strategy's ``cpu_offload``) for a run of ``trainer_config`` (a
    Trainer's settings, its strategy an instance or a path)."""
    strategy = trainer_config.get("strategy")
    path = strategy.get("class_path") if isinstance(strategy, dict) else strategy
    name = path if isinstance(path, str) else f"{type(path).__module__}.{type(path).__name__}"
    if name != STRATEGY:
        return {"shard_processes": 1}
    if isinstance(strategy, dict):
        gather = (strategy.get("init_args") or {}).get("rollout_gather", "auto")
        offload = bool((strategy.get("init_args") or {}).get("cpu_offload", False))
    else:
        gather = getattr(strategy, "rollout_gather", "auto")
        offload = bool(getattr(strategy, "cpu_offload", False))
    devices = trainer_config.get("devices", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) and not str(devices).isdigit():
        raise ValueError(
            f"trainer.devices: {devices!r}; the estimate of a sharded run needs a number: set it to the devices per "
            "machine (and trainer.num_nodes to the machines)"
        )
    processes = int(devices) * int(trainer_config.get("num_nodes", 1) or 1)
    return {"shard_processes": processes, "rollout_gather": gather, "shard_offload": offload}


@contextlib.contextmanager
def fake_processes(world_size: int) -> Iterator[object]:
    """A device mesh over ``world_size`` processes of torch's ``fake`` backend, in this one process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise RuntimeError(
            "the estimate of a sharded run needs a process of its own (this one already belongs to a process group); "
            "run lit-rl estimate outside the training run"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def reshard_before_steps(optimizer: torch.optim.Optimizer, roots: list[torch.nn.Module]) -> None:
    """Shard the roots again before each optimizer step, as FSDP2Strategy does."""

    def reshard(*_: object) -> None:
        for root in roots:
            root.reshard()

    optimizer.register_step_pre_hook(reshard)


@contextlib.contextmanager
def offloaded_gathers(enabled: bool) -> Iterator[None]:
    """With FSDP2's ``cpu_offload``, each gather first copies the unit's shards from host memory to the device
    (``FSDPParam.all_gather_inputs``), so a unit's shards are on the device twice for a moment: the copies and the
    gathered weights. The estimate's shards are not offloaded, so the copy is made here, a clone the tracker counts
    until the gather is done with it."""
    if not enabled:
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

    plain = FSDPParam.all_gather_inputs

    def copied(self) -> list[torch.Tensor]:
        inputs = plain.fget(self)
        return [t.clone() for t in inputs] if self.sharded_state == ShardedState.SHARDED else inputs

    FSDPParam.all_gather_inputs = property(copied)
    try:
        yield
    finally:
        FSDPParam.all_gather_inputs = plain
