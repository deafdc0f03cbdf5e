"""Peak resident memory (RSS) of this process: reset the kernel's high-water mark, read it back, time a stage.

The one implementation of the process-RSS readings that the memory profiler logs beside its tensor
accounting and that the density stages report. Two sources:

- ``"vmhwm"``: ``VmHWM`` from ``/proc/self/status`` (Linux). Writing ``5`` to ``/proc/self/clear_refs``
  resets it to the current RSS (Linux >= 4.0), so a peak can belong to one phase or stage.
- ``"getrusage"``: ``ru_maxrss`` from :func:`resource.getrusage`, the peak of the whole process
  lifetime (it cannot be reset). Kilobytes on Linux, bytes on macOS; absent on Windows.

The reset is process-wide: two measurements that overlap in time see each other's peaks.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["StageStats", "peak_rss_stage", "probe_rss_source", "read_peak_rss", "read_rss", "reset_peak_rss"]


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (``VmHWM``) of this process to its current RSS.

    Returns:
        ``True`` on success; ``False`` where ``/proc/self/clear_refs`` is absent (not Linux) or not
        writable (some sandboxes and containers).
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def read_peak_rss(source: str | None) -> int | None:
    """The peak RSS of this process in bytes, from ``source``.

    Args:
        source: ``"vmhwm"`` (``/proc/self/status``, since the last :func:`reset_peak_rss`),
            ``"getrusage"`` (process lifetime) or ``None``.

    Returns:
        Bytes, or ``None`` when the source cannot be read here (or is ``None`` or unknown).
    """
    if source == "vmhwm":
        return _proc_status_bytes("VmHWM:")
    if source == "getrusage":
        try:
            import resource
        except ImportError:  # Windows
            return None
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB on Linux
    return None


def read_rss() -> int | None:
    """The current RSS of this process in bytes (``VmRSS`` from ``/proc/self/status``), or ``None`` off Linux."""
    return _proc_status_bytes("VmRSS:")


def _proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes; ``None`` where the file or the field is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def probe_rss_source() -> str | None:
    """Which source works here: ``"vmhwm"`` (resettable), else ``"getrusage"`` (lifetime peak), else ``None``.

    Probing ``"vmhwm"`` resets the peak counter once, as a side effect.
    """
    if reset_peak_rss() and read_peak_rss("vmhwm") is not None:
        return "vmhwm"
    if read_peak_rss("getrusage") is not None:
        return "getrusage"
    return None


@dataclass
class StageStats:
    """Time and peak resident memory of one stage, filled in when the ``with`` block ends.

    Attributes:
        elapsed_s: wall-clock seconds of the block.
        cpu_s: CPU seconds the process spent in the block, all threads (less sensitive than
            ``elapsed_s`` to other processes competing for the cores).
        peak_rss_gib: peak resident set size during the block, GiB. When ``per_stage`` is ``False``
            the kernel counter could not be reset and this is the peak of the whole process so far.
        per_stage: whether the peak was reset at the start of the block.
    """

    elapsed_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss_gib: float = 0.0
    per_stage: bool = False


@contextmanager
def peak_rss_stage() -> Iterator[StageStats]:
    """Measure the wall time, CPU time and peak RSS of the enclosed block.

    On Linux the kernel's high-water mark is reset on entry (:func:`reset_peak_rss`) and ``VmHWM``
    is read on exit, so the peak belongs to this block alone. Where the reset is refused the
    lifetime peak (``VmHWM`` or ``getrusage``) is reported and ``per_stage`` is ``False``; where
    neither can be read ``peak_rss_gib`` stays 0. Do not nest two measured stages.

    Example::

        with peak_rss_stage() as stage:
            weights = inverse_density_weights(embeddings, k=10)
        print(stage.elapsed_s, stage.peak_rss_gib)
    """
    stats = StageStats(per_stage=reset_peak_rss())
    start, cpu = time.perf_counter(), time.process_time()
    try:
        yield stats
    finally:
        stats.elapsed_s = time.perf_counter() - start
        stats.cpu_s = time.process_time() - cpu
        peak = read_peak_rss("vmhwm")
        if peak is None:
            peak = read_peak_rss("getrusage")
        stats.peak_rss_gib = (peak or 0) / 2**30
