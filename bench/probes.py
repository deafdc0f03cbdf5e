"""Bench-only probes: Lightning callbacks that log, as TensorBoard scalars, what a benchmark reads inside a run and
the run does not log by itself.

A study's arm adds one by class path, e.g. ``--trainer.callbacks+=probes.StepClock``; :func:`harness.run_fit` puts
``bench/`` on the child's ``PYTHONPATH``, so the child imports this module by that name. Each probe logs through
the trainer's loggers at the step the method's own metrics of the batch are logged at (``trainer.global_step - 1``
after the update), a run-level value at ``trainer.global_step``. Users measure a run with
:class:`lit_rl.callbacks.MemoryProfiler`; these answer a benchmark's narrower questions.

- :class:`StepClock`: wall, CPU and system seconds of every training step;
- :class:`WeightsMoved`: the share of the policy's weights that differ from the frozen reference after training;
- :class:`Allocator`: which ``malloc`` the process runs on (checked against the one the arm asked for) and what the
  runtime holds besides tensors when training starts;
- :class:`SaveMemory`: the host memory and seconds of each checkpoint save of whichever checkpoint IO runs.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lit_rl.memory import read_peak_rss, read_rss, reset_peak_rss

GIB = 2**30


def _log(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


class StepClock(Callback):
    """Wall, CPU and system seconds of every training step, from ``on_train_batch_start`` to ``on_train_batch_end``
    (the allocator's work and every callback's included; the evaluation between steps left out).

    **Logged Metrics**: ``bench/step/wall_s``; ``bench/step/cpu_s`` (user + system, all threads: a busy machine
    inflates it less than the wall time; on an oversubscribed one it includes OpenMP spin-waiting);
    ``bench/step/system_s`` (of which system: page faults, ``mmap``/``munmap``, ``madvise``).

    Example::

        --trainer.callbacks+=probes.StepClock
    """

    def __init__(self) -> None:
        self._start: tuple[float, os.times_result] | None = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self._start = (time.perf_counter(), os.times())

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        wall0, os0 = self._start
        now = os.times()
        metrics = {
            "bench/step/wall_s": time.perf_counter() - wall0,
            "bench/step/cpu_s": now.user + now.system - os0.user - os0.system,
            "bench/step/system_s": now.system - os0.system,
        }
        _log(trainer, metrics, trainer.global_step - 1)


class WeightsMoved(Callback):
    """The share of the policy's trainable weight elements that differ from the frozen reference copy (the starting
    weights, in full fine-tuning) when training ends: an AdamW update smaller than half a step of the weight's dtype
    (bf16: 1/256 of it) is rounded away.

    **Logged Metrics**: ``bench/weights_moved`` (0 to 1).

    Raises:
        MisconfigurationException: the method holds no frozen reference copy (LoRA, or ``beta = 0``).

    Example::

        --trainer.callbacks+=probes.WeightsMoved
    """

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if getattr(pl_module, "reference", None) is None:
            raise MisconfigurationException(
                "WeightsMoved compares the policy with the frozen reference copy, and this run has none; "
                "use full fine-tuning with beta > 0, or drop the probe"
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start = dict(pl_module.reference.named_parameters())
        pairs = [(p, start[n]) for n, p in pl_module.policy.named_parameters() if p.requires_grad and n in start]
        moved = sum(int((p != s).sum()) for p, s in pairs)
        _log(trainer, {"bench/weights_moved": moved / sum(p.numel() for p, _ in pairs)}, trainer.global_step)


# ------------------------------------------------------------------------------------------------ allocator
#: allocator -> the stems of its library's file names, as ``/proc/<pid>/maps`` shows them
LIBRARIES = {"jemalloc": ("libjemalloc",), "tcmalloc": ("libtcmalloc_minimal", "libtcmalloc")}


def mapped_allocators(maps: str) -> dict[str, str]:
    """Allocator -> path of its library among the files mapped in a ``/proc/<pid>/maps`` text."""
    found: dict[str, str] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6:
            stem = Path(fields[5].strip()).name.split(".so")[0]
            for allocator, stems in LIBRARIES.items():
                if stem in stems:
                    found.setdefault(allocator, fields[5].strip())
    return found


def _jemalloc() -> dict[str, Any]:
    """jemalloc's version and the options it runs with, read back with ``mallctl``."""
    mallctl = ctypes.CDLL(None).mallctl
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                        ctypes.c_size_t]  # fmt: skip

    def read(key: str, ctype: type) -> Any:
        value, size = ctype(), ctypes.c_size_t(ctypes.sizeof(ctype))
        if mallctl(key.encode(), ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
            return None
        return value.value.decode() if isinstance(value.value, bytes) else value.value

    settings = {"background_thread": read("opt.background_thread", ctypes.c_bool)}
    settings |= {k: read(f"opt.{k}", ctypes.c_ssize_t) for k in ("dirty_decay_ms", "muzzy_decay_ms")}
    return {"version": str(read("version", ctypes.c_char_p)).split("-")[0], "settings": settings}


def _tcmalloc() -> dict[str, Any]:
    tc_version = ctypes.CDLL(None).tc_version
    tc_version.restype = ctypes.c_char_p
    major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_char_p()
    version = tc_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch)) or b""
    return {"version": version.decode().removeprefix("gperftools ")}


def allocator_in_process() -> dict[str, Any]:
    """Which ``malloc`` this process runs on: ``name``, ``version``, the preloaded library's ``path`` and
    jemalloc's ``settings``."""
    found = mapped_allocators(Path("/proc/self/maps").read_text())
    if len(found) > 1:
        return {"name": "+".join(sorted(found)), "path": ", ".join(found.values())}
    if found:
        name, path = next(iter(found.items()))
        return {"name": name, "path": path, **(_jemalloc() if name == "jemalloc" else _tcmalloc())}
    return {"name": "glibc", "version": platform.libc_ver()[1]}


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU tensor storages reachable from Python (at train start: the weights)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except Exception:  # tensor subclasses without storage
            continue
    return sum(seen.values())


class Allocator(Callback):
    """Checks that the process runs on the ``malloc`` the arm asked for (an ``LD_PRELOAD`` the dynamic loader
    ignored, or a ``MALLOC_CONF`` jemalloc did not apply, fails the run instead of being measured as if it had
    worked), says which in the run's log, and logs what the runtime holds besides tensors when training starts.

    The log line: ``Allocator: <name> <version>`` and, for a preloaded one, its path and jemalloc's settings as
    ``mallctl`` reads them back (JSON).

    **Logged Metrics**: ``bench/start/rss_gib`` (resident memory at ``on_train_start``: ``import torch``, the
    libraries, the model) and ``bench/start/tensor_gib`` (the CPU tensors alive then: the weights).

    Args:
        expect: ``glibc``, ``jemalloc`` or ``tcmalloc``.

    Raises:
        MisconfigurationException: the process runs on another allocator, or jemalloc reads back another setting
            than ``MALLOC_CONF`` names.

    Example::

        --trainer.callbacks+=probes.Allocator --trainer.callbacks.init_args.expect jemalloc
    """

    def __init__(self, expect: str = "glibc") -> None:
        self.expect = expect

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        found = allocator_in_process()
        problem = f"runs on {found['name']}, not {self.expect}" if found["name"] != self.expect else ""
        conf = os.environ.get("MALLOC_CONF") if self.expect == "jemalloc" else None
        for key, value in (pair.split(":", 1) for pair in conf.split(",")) if conf else ():
            read = found["settings"].get(key)
            if str(read).lower() != value.lower():
                problem = problem or f"MALLOC_CONF {key}:{value} not applied (jemalloc reads {read})"
        if problem:
            raise MisconfigurationException(
                f"Allocator: this process {problem}; set LD_PRELOAD (and MALLOC_CONF) in the arm's env, or expect "
                f"{found['name']}"
            )
        rank_zero_info(f"Allocator: {found['name']} {found.get('version') or ''} {json.dumps(found)}")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = {"bench/start/tensor_gib": live_tensor_bytes() / GIB, "bench/start/rss_gib": (read_rss() or 0) / GIB}
        _log(trainer, metrics, 0)


# ------------------------------------------------------------------------------------------------ checkpoint save
class SaveMemory(Callback):
    """The host memory and seconds of each checkpoint save, whichever checkpoint IO the run saves with
    (``trainer.plugins``): the IO's ``save_checkpoint`` is wrapped in ``setup``.

    **Logged Metrics**, per save at the step it happens: ``bench/save/peak_before_gib`` (the kernel's high-water
    mark ``VmHWM`` when the save starts: everything before it), ``bench/save/rss_start_gib`` (resident memory then),
    ``bench/save/peak_gib`` (``VmHWM`` reset when the save starts and read when it ends), ``bench/save/reset`` (1
    when the reset worked; 0: the save peak is the process's peak so far), ``bench/save/file_gib``,
    ``bench/save/seconds``.

    Example::

        --trainer.callbacks+=probes.SaveMemory
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        save = io.save_checkpoint

        def measured(checkpoint: dict, path: str, storage_options: Any = None) -> None:
            metrics = {"bench/save/peak_before_gib": read_peak_rss("vmhwm") / GIB, "bench/save/rss_start_gib":
                       read_rss() / GIB, "bench/save/reset": float(reset_peak_rss())}  # fmt: skip
            start = time.perf_counter()
            save(checkpoint, path, storage_options)
            metrics |= {"bench/save/seconds": time.perf_counter() - start,
                        "bench/save/peak_gib": read_peak_rss("vmhwm") / GIB,
                        "bench/save/file_gib": Path(path).stat().st_size / GIB}  # fmt: skip
            _log(trainer, metrics, trainer.global_step)

        io.save_checkpoint = measured
