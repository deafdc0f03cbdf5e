"""Sharding a method's models over processes: FSDP2 through Lightning's ``ModelParallelStrategy``.

:class:`FSDP2Strategy` is Lightning's ``ModelParallelStrategy`` with every process in one data-parallel (sharding)
dimension, and the sharding applied for the method: after ``configure_model`` has loaded the models, the policy
and every frozen model the method holds (the full fine-tuning reference, GumbelTopK's reward model) are sharded
per decoder layer with the trunk as the root unit (:func:`lit_rl.models.sharding.shard_model`, whose docstring
says why). A method needs no code of its own for it. Launch as any Lightning strategy: ``trainer.devices`` and
``trainer.num_nodes`` in the config, ``torchrun`` or SLURM for several machines (Lightning's own launchers).
:func:`leave_process_group` ends every distributed run of ``lit-rl`` that ended well, whatever its strategy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lit_rl.models.sharding import shard_models

__all__ = ["FSDP2Strategy", "leave_process_group"]

#: the OS names torch gives gloo's worker threads (``c10::setThreadName`` in ProcessGroupGloo)
GLOO_WORKERS = ("pt_gloo_runloop",)


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over every process, for any lit-rl method (see the module docstring).

    Args:
        cpu_offload: keep the sharded parameters, gradients and optimizer state in host memory (torch's
            ``CPUOffloadPolicy``), gathered to the accelerator layer by layer; only on an accelerator.
        rollout_gather: ``auto`` (gather the whole policy once per rollout when it takes at most half of the free
            device memory, else layer by layer; the run says which), ``whole`` or ``layers``
            (:func:`lit_rl.models.sharding.gathered`).
        save_distributed_checkpoint: each process writes its own shard of a checkpoint (a folder); ``False``
            gathers the full state on rank 0 into one file.
        process_group_backend: ``gloo`` or ``nccl``; by default the device's (gloo on CPU).
        timeout: of the process group's collectives.
    """

    def __init__(
        self,
        cpu_offload: bool = False,
        rollout_gather: Literal["auto", "whole", "layers"] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if cpu_offload and process_group_backend is None:
            # offloaded gradients are host tensors: the step's gradient norm and clipping reduce them over gloo
            process_group_backend = "cpu:gloo,cuda:nccl"
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.cpu_offload = cpu_offload
        self.rollout_gather = rollout_gather
        self._roots: list = []

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every process shards; none replicates
        super().setup_environment()

    @override
    def _configure_launcher(self) -> None:
        # checked here, when the Trainer is built: before any process starts, so the refusal is said once
        if self.cpu_offload and self.parallel_devices and self.parallel_devices[0].type == "cpu":
            raise ValueError(
                "trainer.strategy.init_args.cpu_offload: the model already lives in host memory on a CPU run; "
                "remove cpu_offload or set trainer.accelerator: gpu"
            )
        super()._configure_launcher()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        mesh = self.device_mesh["data_parallel"]
        self._roots, units = shard_models(
            self.lightning_module, mesh, offload=self.cpu_offload, rollout_gather=self.rollout_gather
        )
        rank_zero_info(f"FSDP2: {units} units sharded over {mesh.size()} processes")
        super().setup(trainer)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        # the roots stay gathered through the step's backward (lit_rl.models.sharding); the gathered copies would be
        # stale after the update, so they go now and the next forward gathers the updated shards
        for root in self._roots:
            root.reshard()
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def model_to_device(self) -> None:
        if not self.cpu_offload:  # offloaded shards stay in host memory; FSDP moves what each forward needs
            super().model_to_device()


def leave_process_group(timeout: float = 5.0) -> bool:
    """End a distributed run that ended well: destroy the process group, then wait (at most ``timeout`` seconds,
    giving up the GIL) until gloo's worker threads are idle. Returns whether they were (``True`` without a group).

    A gloo worker thread drops its last collective's tensors after the caller's ``wait()`` has returned; a tensor that
    Python no longer holds then needs the GIL to free its Python object. If the interpreter is finalizing by then, the
    thread is ended inside C++ code that cannot unwind, and the process aborts after a run that succeeded (SIGABRT,
    "terminate called without an active exception"; pytorch/pytorch#179291). ``destroy_process_group`` joins those
    threads only when it drops the group's last reference, and after an FSDP2 fit something else still holds it
    (its worker threads outlive ``destroy_process_group`` and a garbage collection; DTensor's caches still hold the
    device mesh). So the threads must finish before the interpreter does: a thread is idle when the OS reports it
    sleeping in three polls in a row. Not after an error: a process still inside a collective would wait in it
    (pytorch/torchtitan#1342).
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return True
    torch.distributed.destroy_process_group()
    return _workers_idle(GLOO_WORKERS, timeout)


def _workers_idle(names: tuple[str, ...], timeout: float, settle: int = 3, pause: float = 0.005) -> bool:
    """Whether every thread of this process whose OS name is in ``names`` sleeps in ``settle`` polls in a row, within
    ``timeout`` seconds (Linux's ``/proc``; elsewhere ``True`` at once)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return True
    deadline, quiet = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        quiet = 0 if any(_running(task, names) for task in tasks.iterdir()) else quiet + 1
        if quiet >= settle:
            return True
        time.sleep(pause)  # gives up the GIL, which a thread freeing a tensor's Python object may be waiting for
    return False


def _running(task: Path, names: tuple[str, ...]) -> bool:
    try:
        if (task / "comm").read_text().strip() not in names:
            return False
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0] != "S"  # the state follows the (name)
    except (OSError, IndexError):
        return False  # the thread ended
