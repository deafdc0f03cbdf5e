"""
Streaming Checkpoint IO
=======================

Writes a checkpoint straight to disk instead of building it in memory first, and keeps the write atomic.

Lightning's default (``TorchCheckpointIO`` -> ``lightning.fabric.utilities.cloud_io._atomic_save``) serializes the
whole checkpoint into an ``io.BytesIO`` and then writes those bytes: for as long as a save lasts the process holds a
second, serialized copy of the weights and the optimizer state in host memory (a full fine-tuning checkpoint with
AdamW is three times the fp32 weights; 1.5 GiB for the embedded 135M model, tens of GiB at 7B). Here ``torch.save``
writes each tensor's bytes to a temporary file beside the final one as it goes, so a save adds only its pickled
metadata (kilobytes) to the process. The file is ``fsync``-ed, then ``os.replace``-d onto its final name, which is
atomic on one filesystem: a process killed during a save leaves the previous ``last.ckpt`` whole, never a truncated
one, and at worst a stale ``.<name>.<pid>-<token>.partial`` file beside it, which the next successful save into that
folder removes. The bytes written are the same as Lightning's (both go through ``torch.save`` to a file object).
Lightning's local write goes through an ``fsspec`` transaction instead: a temporary file in the system's temporary
folder, then ``shutil.move``, which is a copy, not an atomic rename, where that folder is another filesystem (and a
``tmpfs`` there holds the bytes in memory once more).

*Saving*: the serialized copy, i.e. the checkpoint's size, off the host memory peak of every run that saves a
checkpoint (measured in ``bench/results/checkpoint_save.md``). *Cost*: one ``fsync`` per save (the time the disk
needs to make the file durable, which Lightning's path does not wait for), and a process killed mid-save leaves up
to one checkpoint's size of disk in the stale temporary file until the next save. Remote paths (any ``fsspec`` URL
that is not the local filesystem) fall back to Lightning's own in-memory save, which object stores need for their
multipart uploads.

Why it is the default through the CLI's trainer defaults rather than a line in each config: ``lit-rl fit`` (and
``validate`` / ``test`` / ``predict``) sets ``trainer.plugins`` to this class as a *parser default*, which, unlike a
callback in ``trainer_defaults``, is part of the parsed config: ``--print_config`` and the ``config.yaml`` saved
beside every run show it, and ``--trainer.plugins null`` (or a config's own ``plugins:`` list) replaces it. A line in
each YAML would miss every run that adds a ``ModelCheckpoint`` to a config that has none (the tiny configs) or
brings its own config.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lit_rl.memory.phases import PhaseTracker
from lit_rl.memory.rss import read_peak_rss, read_rss, reset_peak_rss
from lit_rl.memory.units import GIB

log = logging.getLogger(__name__)

#: the phase a :class:`StreamingCheckpointIO` announces around every save
SAVE = "save"
#: how a temporary file ends; ``.<final name>.<pid>-<8 hex digits>.partial``
TEMP_SUFFIX = ".partial"
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)-[0-9a-f]{8}" + re.escape(TEMP_SUFFIX) + "$")


@dataclass
class SaveRecord:
    """One finished save.

    Attributes:
        path: the checkpoint's final path (or URL).
        bytes: its size on disk (``0`` for a remote URL, which is not asked for its size).
        seconds: wall time of the save, the ``fsync`` included.
        streamed: ``False`` for a remote URL saved the Lightning way (in memory first).
    """

    path: str
    bytes: int
    seconds: float
    streamed: bool


class StreamingCheckpointIO(TorchCheckpointIO):
    r"""Saves checkpoints by streaming ``torch.save`` to a temporary file, ``fsync``, then an atomic rename.

    Loading and removing are Lightning's (``TorchCheckpointIO``). Every save is announced as the phase ``"save"``
    on :attr:`phases`, so a listener (a :class:`SaveMeter`, which the :class:`~lit_rl.callbacks.MemoryProfiler`
    attaches) can measure it; the IO itself keeps the latest :class:`SaveRecord` in :attr:`last_save`.

    Attributes:
        phases: a :class:`~lit_rl.memory.phases.PhaseTracker` with the one phase ``"save"``.
        last_save: the latest save that finished, or ``None`` (before the first one and while one is running).

    Raises:
        TypeError: if ``storage_options`` is given (as ``TorchCheckpointIO``).

    Example::

        # what `lit-rl fit` sets by default (`--print_config` shows it)
        trainer:
          plugins:
            - class_path: lit_rl.callbacks.StreamingCheckpointIO
    """

    def __init__(self) -> None:
        super().__init__()
        self.phases = PhaseTracker((SAVE,))
        self.last_save: SaveRecord | None = None

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path``: streamed and atomic on the local filesystem, Lightning's way elsewhere."""
        self.last_save = None
        fs, local_path = url_to_fs(str(path))
        streamed = storage_options is None and isinstance(fs, LocalFileSystem)
        start = time.perf_counter()
        with self.phases(SAVE):
            if streamed:
                size = stream_save(checkpoint, Path(local_path))
            else:  # a remote URL (or storage_options, which TorchCheckpointIO refuses in one message)
                super().save_checkpoint(checkpoint, path, storage_options)
                size = 0
            self.last_save = SaveRecord(str(path), size, time.perf_counter() - start, streamed)
        log.debug(f"Saved checkpoint {path} ({size} bytes, streamed={streamed}) in {self.last_save.seconds:.2f}s")


def stream_save(obj: Any, path: Path) -> int:
    """``torch.save(obj)`` to ``path`` through a temporary file in the same folder, ``fsync``-ed and renamed.

    Args:
        obj: anything ``torch.save`` takes.
        path: the final file; its folder is created if missing.

    Returns:
        The size of the written file in bytes.

    Raises:
        Whatever ``torch.save``, the write or the rename raised; the temporary file is removed first and a file
        already at ``path`` is left as it was.
    """
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    temp = folder / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TEMP_SUFFIX}"
    try:
        # the umask applies (as to Lightning's files), unlike tempfile.mkstemp's 0o600
        with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            torch.save(obj, f)  # a file object: the same bytes as Lightning's save into a BytesIO
            f.flush()
            os.fsync(f.fileno())
        size = temp.stat().st_size
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    _fsync_folder(folder)  # the rename itself survives a power cut
    remove_stale_temp_files(folder)
    return size


def remove_stale_temp_files(folder: Path) -> list[Path]:
    """Remove the temporary files that saves of processes no longer running left in ``folder``.

    Only names of the form ``.<name>.<pid>-<token>.partial`` are touched, and only when ``<pid>`` is neither this
    process nor a running one (a save running in another process keeps its file).

    Returns:
        The files removed.
    """
    removed = []
    for candidate in folder.glob(f".*{TEMP_SUFFIX}"):
        match = _TEMP_NAME.match(candidate.name)
        if match is None or _running(int(match["pid"])):
            continue
        with contextlib.suppress(OSError):
            candidate.unlink()
            removed.append(candidate)
    return removed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: running, as another user
        return True
    return True


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class SaveMeter:
    """Listens to the ``"save"`` phase of a trainer's checkpoint IO: logs the wall time and peak RSS of each save.

    The :class:`~lit_rl.callbacks.MemoryProfiler` attaches one in ``setup``. The peak is the kernel's ``VmHWM``, reset
    when a save starts where ``rss_source`` is ``"vmhwm"`` (so it belongs to the save alone), the lifetime peak
    otherwise (see :mod:`lit_rl.memory.rss`).

    **Logged Metrics** (after each save that finished, at ``step = trainer.global_step``):

    - ``memory/save/rss_peak_gib``: process peak RSS during the save (where it can be read)
    - ``memory/save/checkpoint_gib``: the checkpoint's size on disk
    - ``time/save_s``: wall seconds of the save

    Args:
        trainer: the trainer whose ``strategy.checkpoint_io`` is listened to and whose loggers get the metrics.
        phases: that IO's :class:`~lit_rl.memory.phases.PhaseTracker`.
        rss_source: ``"vmhwm"``, ``"getrusage"`` or ``None`` (no RSS).
        saves: the list each finished save's record is appended to: ``{"step", "path", "bytes", "seconds",
            "rss_start_bytes", "rss_peak_bytes"}`` (the RSS keys only where they can be read).
    """

    def __init__(self, trainer: Any, phases: PhaseTracker, rss_source: str | None, saves: list[dict[str, Any]]) -> None:
        self._trainer, self._phases, self._rss_source = trainer, phases, rss_source
        self.saves = saves
        self._start = 0.0
        self._rss_start: int | None = None
        phases.add_listener(self)

    @classmethod
    def attach(cls, trainer: Any, rss_source: str | None, saves: list[dict[str, Any]]) -> SaveMeter | None:
        """A meter listening to the trainer's checkpoint IO, or ``None`` if that IO announces no saves (Lightning's)."""
        phases = getattr(getattr(trainer.strategy, "checkpoint_io", None), "phases", None)
        if not isinstance(phases, PhaseTracker) or SAVE not in phases.names:
            return None
        return cls(trainer, phases, rss_source, saves)

    def detach(self) -> None:
        self._phases.remove_listener(self)

    def on_phase_start(self, name: str) -> None:
        self._rss_start = read_rss()
        if self._rss_source == "vmhwm":
            reset_peak_rss()
        self._start = time.perf_counter()

    def on_phase_end(self, name: str) -> None:
        seconds = time.perf_counter() - self._start
        done = getattr(self._trainer.strategy.checkpoint_io, "last_save", None)
        if done is None:
            return  # the save raised
        step = self._trainer.global_step
        record: dict[str, Any] = {"step": step, "path": done.path, "bytes": done.bytes, "seconds": seconds}
        metrics = {"memory/save/checkpoint_gib": done.bytes / GIB, "time/save_s": seconds}
        if self._rss_start is not None:
            record["rss_start_bytes"] = self._rss_start
        peak = read_peak_rss(self._rss_source)
        if peak is not None:
            record["rss_peak_bytes"] = peak
            metrics["memory/save/rss_peak_gib"] = peak / GIB
        self.saves.append(record)
        for logger in self._trainer.loggers:
            logger.log_metrics(metrics, step=step)
