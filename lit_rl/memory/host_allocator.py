"""glibc's ``malloc`` seen from Python: give freed heap memory back to the OS, and set its two thresholds.

Why this matters on CPU: PyTorch's CPU tensors come from ``malloc`` (``posix_memalign``). glibc serves a
request above ``M_MMAP_THRESHOLD`` with its own ``mmap`` (returned to the OS on free) and everything
smaller from heaps it keeps. The threshold is *dynamic* by default: each time an mmapped block is freed
the threshold rises to its size (up to 32 MiB on 64-bit), so after the first step most activation,
KV-cache and gradient temporaries come from the heap, and when they die their pages stay in the
process. The process RSS then sits above the bytes tensors hold plus the runtime's own memory
(``bench/results/allocator.md`` has both, and the peak RSS, for ``configs/grpo.yaml``).

Two remedies, both process-wide:

- :func:`malloc_trim` (``malloc_trim(0)``): walks every arena and returns the whole free pages to the
  OS (``MADV_DONTNEED``, glibc >= 2.8), the top of each heap included. A one-off call; the next
  allocations fault the pages in again (zeroed by the kernel).
- :func:`set_malloc_thresholds` (``mallopt``): a fixed ``M_MMAP_THRESHOLD`` (which also switches the
  dynamic adjustment off) sends every larger block to its own ``mmap``; ``M_TRIM_THRESHOLD`` trims the
  heap top on ``free`` when that much is free. The same as starting Python with
  ``MALLOC_MMAP_THRESHOLD_=n MALLOC_TRIM_THRESHOLD_=n``, but applied at run time, so blocks already
  allocated keep where they are. Every large allocation then costs an ``mmap``/``munmap`` and page
  faults: fewer cached bytes, more system time.

Elsewhere (macOS, musl, Windows), and where another allocator serves ``malloc`` (jemalloc or tcmalloc through
``LD_PRELOAD``, as docs/memory.md suggests: glibc's heaps are then almost empty and the other allocator's cache is
out of their reach), :func:`glibc` is ``None`` and both are no-ops; :func:`why_not_glibc` says why in words.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

__all__ = ["MMAP_THRESHOLD_MAX", "glibc", "malloc_library", "malloc_trim", "set_malloc_thresholds", "why_not_glibc"]

# mallopt parameter numbers from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: glibc's largest M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX = 4 MiB * sizeof(long)); mallopt refuses more
MMAP_THRESHOLD_MAX = 32 * 2**20


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


@functools.cache
def malloc_library() -> str | None:
    """The file name of the library whose ``malloc`` this process calls (``libc.so.6``, ``libjemalloc.so.2``, ...).

    The symbol as the dynamic linker resolves it for the process (an ``LD_PRELOAD`` library comes first), located
    with ``dladdr``. ``None`` where that cannot be asked (not Linux, no ``dladdr``).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        process = ctypes.CDLL(None)
        dladdr = process.dladdr  # in libc since glibc 2.34, in libdl before
    except AttributeError:
        try:
            dladdr = ctypes.CDLL("libdl.so.2").dladdr
        except (OSError, AttributeError):
            return None
    except OSError:
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    info = _DlInfo()
    if not dladdr(ctypes.cast(process.malloc, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.basename(info.dli_fname.decode(errors="replace"))


def _malloc_is_not_libc() -> bool:
    name = malloc_library()
    return name is not None and not name.startswith("libc.")


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The running process's C library when it is glibc and serves ``malloc`` (so ``malloc_trim`` and ``mallopt``
    act on the heap tensors come from), else ``None``."""
    if not sys.platform.startswith("linux") or _malloc_is_not_libc():
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded into this process, libc among them
        version = libc.gnu_get_libc_version  # glibc only (musl has no such function)
        libc.malloc_trim, libc.mallopt  # noqa: B018 - raise AttributeError where they are missing
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def why_not_glibc() -> str:
    """One phrase: why :func:`malloc_trim` and :func:`set_malloc_thresholds` do nothing here ('' with glibc)."""
    if glibc() is not None:
        return ""
    if not sys.platform.startswith("linux"):
        return f"the C library of {platform.system() or sys.platform} is not glibc"
    if _malloc_is_not_libc():
        return (
            f"malloc is {malloc_library()}'s, not glibc's, so glibc's malloc_trim/mallopt do not reach the memory "
            "tensors come from (that allocator's own settings do)"
        )
    name = platform.libc_ver()[0] or "unknown"
    return f"this Linux runs on a C library other than glibc ({name}), which has no malloc_trim/mallopt"


def malloc_trim() -> bool:
    """Return the free pages of every glibc arena to the OS (``malloc_trim(0)``).

    Returns:
        ``True`` when glibc released some memory, ``False`` when it had nothing to release or this is not glibc.
    """
    libc = glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def set_malloc_thresholds(mmap_threshold: int | None = None, trim_threshold: int | None = None) -> bool:
    """Fix glibc's ``M_MMAP_THRESHOLD`` and/or ``M_TRIM_THRESHOLD`` (bytes) for the rest of the process.

    Args:
        mmap_threshold: blocks of at least this many bytes get their own ``mmap`` and go back to the OS on
            ``free``; ``0 <= n <= MMAP_THRESHOLD_MAX`` (32 MiB). ``None`` leaves it (and its dynamic adjustment).
        trim_threshold: the heap top is returned to the OS on ``free`` once this many bytes are free there;
            ``n >= 0``. ``None`` leaves it.

    Returns:
        ``True`` when applied, ``False`` when this is not glibc (nothing changed).

    Raises:
        ValueError: a value out of range, or glibc refused it; the message names the range.
    """
    if mmap_threshold is not None and not 0 <= mmap_threshold <= MMAP_THRESHOLD_MAX:
        raise ValueError(
            f"mmap_threshold={mmap_threshold}: glibc accepts 0 to {MMAP_THRESHOLD_MAX} bytes (32 MiB); "
            "use e.g. 65536, or null to keep glibc's dynamic threshold"
        )
    if trim_threshold is not None and not 0 <= trim_threshold < 2**31:
        raise ValueError(
            f"trim_threshold={trim_threshold}: use 0 to 2**31 - 1 bytes (e.g. 65536), or null to keep glibc's default"
        )
    libc = glibc()
    if libc is None:
        return False
    for param, value, name in ((M_MMAP_THRESHOLD, mmap_threshold, "mmap"), (M_TRIM_THRESHOLD, trim_threshold, "trim")):
        if value is not None and libc.mallopt(param, value) != 1:  # mallopt returns 1 on success
            raise ValueError(f"{name}_threshold={value}: glibc's mallopt refused it; use a smaller value or null")
    return True
