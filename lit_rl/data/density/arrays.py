"""Reading ``[N, D]`` embedding matrices (arrays, tensors, ``.npy`` memmaps) in batches without growing RSS.

Shared by the embedding writer (:mod:`.embed`) and the kNN backends (:mod:`.knn`): a float16 memmap
on disk is read and converted to float32 one batch at a time, and the pages already read are
dropped from this process, so a matrix larger than RAM can be streamed.
"""

from __future__ import annotations

import mmap
import warnings
from typing import Any

import numpy as np
import torch


def release_pages(arr: np.ndarray) -> None:
    """Drop a memmap's already-read pages from this process (they stay in the page cache).

    Streaming a file larger than RAM then does not inflate RSS. Best effort; a no-op for plain
    arrays and for copy-on-write memmaps (whose pages would lose their writes).
    """
    mm = getattr(arr, "_mmap", None)  # numpy's own attribute: np.memmap has no public handle on its mmap
    if getattr(arr, "mode", None) == "c":
        return
    if isinstance(mm, mmap.mmap) and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


def as_array(embeddings: Any) -> np.ndarray:
    """A numpy view of ``embeddings``; a ``np.memmap`` is returned as is, so it stays on disk."""
    if isinstance(embeddings, np.ndarray):  # includes np.memmap
        return embeddings
    if isinstance(embeddings, torch.Tensor):
        return embeddings.detach().cpu().numpy()
    return np.asarray(embeddings)


def as_float32(a: np.ndarray) -> np.ndarray:
    """A C-contiguous float32 copy of ``a`` (or ``a`` itself when it already is one)."""
    if a.dtype == np.float16:  # torch's half -> float conversion is vectorised; numpy's is not
        with warnings.catch_warnings():  # a read-only memmap: torch only reads it here
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.ascontiguousarray(a)).float().numpy()
    return np.ascontiguousarray(a, dtype=np.float32)


def read_rows(embeddings: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` as float32."""
    return as_float32(embeddings[start:stop])
