"""The offline embedding cache: an ``.npy`` memmap plus a metadata JSON that says what it was built for.

``lit-rl embed`` writes it; training reuses the file when the metadata matches the run (model,
pooling, dtype, prompt count and fingerprint, max length) and refuses a stale one with
:class:`StaleEmbeddingCacheError`, never silently using embeddings of other prompts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

# metadata fields that must match for a cached embedding file to be reused
IDENTITY_FIELDS = ("model", "pooling", "dim", "dtype", "count", "dataset_fingerprint", "max_length")


class StaleEmbeddingCacheError(ValueError):
    """The cached embedding file was built for different prompts, model or settings.

    Args:
        message: the whole message, with the fix.
        reason: what differs (``"count: cached 24 != expected 23; ..."``), without the fix, so a
            caller can say it in its own words.
    """

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


def dataset_fingerprint(texts: Iterable[str]) -> str:
    """SHA-256 over the prompt strings in order, streamed (each string length-prefixed, so
    ``["ab", "c"]`` and ``["a", "bc"]`` differ)."""
    h = hashlib.sha256()
    for text in texts:
        b = text.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def embedding_metadata(
    texts: Sequence[str], *, model_id: str, pooling: str, dtype: str, max_length: int
) -> dict[str, Any]:
    """The identity metadata of an embedding run (everything but ``dim`` and ``created``)."""
    return {
        "model": model_id,
        "pooling": pooling,
        "dtype": dtype,
        "count": len(texts),
        "dataset_fingerprint": dataset_fingerprint(texts),
        "max_length": max_length,
    }


class EmbeddingCache:
    """Prompt embeddings on disk: ``<name>.npy`` (read back as a memmap) plus ``<name>.json`` metadata.

    The metadata is ``{model, pooling, dim, dtype, count, dataset_fingerprint, max_length, created}``.
    A file is written as ``<name>.partial.npy`` and renamed when complete, and the JSON is written
    last, so an interrupted run never leaves a file that looks valid.

    Args:
        directory: folder of the cache (created on first write).
        name: file stem.

    Example::

        cache = EmbeddingCache("cache/embeddings")
        emb = cache.load(expected)  # None if absent, StaleEmbeddingCacheError if it does not match
    """

    def __init__(self, directory: str | os.PathLike, name: str = "embeddings") -> None:
        self.directory = Path(directory)
        self.name = name

    @property
    def npy_path(self) -> Path:
        return self.directory / f"{self.name}.npy"

    @property
    def json_path(self) -> Path:
        return self.directory / f"{self.name}.json"

    @property
    def partial_path(self) -> Path:
        return self.directory / f"{self.name}.partial.npy"

    def exists(self) -> bool:
        return self.npy_path.exists() or self.json_path.exists()

    def metadata(self) -> dict[str, Any] | None:
        """The stored metadata, or ``None`` when there is no JSON file."""
        if not self.json_path.exists():
            return None
        return json.loads(self.json_path.read_text())

    def _stale(self, reason: str) -> StaleEmbeddingCacheError:
        return StaleEmbeddingCacheError(
            f"The embedding cache {self.npy_path} does not match this run: {reason}. "
            f"Rebuild it with `lit-rl embed --config <your config>` or delete {self.npy_path} and {self.json_path}.",
            reason=reason,
        )

    def load(self, expected_metadata: dict[str, Any]) -> np.ndarray | None:
        """The cached matrix as a read-only memmap, if it matches ``expected_metadata``.

        Only the identity fields present in ``expected_metadata`` are compared (``model``,
        ``pooling``, ``dim``, ``dtype``, ``count``, ``dataset_fingerprint``, ``max_length``); leave
        ``dim`` out when it is not known before embedding.

        Returns:
            ``[count, dim]`` memmap, or ``None`` when no cache file exists.

        Raises:
            StaleEmbeddingCacheError: the file exists but its metadata differs, is missing, or does
                not agree with the array's shape; the message names the fields and the fix.
        """
        if not self.exists():
            return None
        meta = self.metadata()
        if meta is None:
            raise self._stale(f"its metadata file {self.json_path} is missing (an interrupted or foreign write)")
        if not self.npy_path.exists():
            raise self._stale(f"the array file is missing next to {self.json_path}")
        diffs = [
            f"{key}: cached {meta.get(key)!r} != expected {expected_metadata[key]!r}"
            for key in IDENTITY_FIELDS
            if key in expected_metadata and meta.get(key) != expected_metadata[key]
        ]
        if diffs:
            raise self._stale("; ".join(diffs))
        arr = np.load(self.npy_path, mmap_mode="r")
        if arr.shape != (meta.get("count"), meta.get("dim")) or str(arr.dtype) != meta.get("dtype"):
            raise self._stale(
                f"the array is {arr.dtype}{list(arr.shape)} but the metadata says "
                f"{meta.get('dtype')}[{meta.get('count')}, {meta.get('dim')}]"
            )
        return arr

    def commit(self, metadata: dict[str, Any]) -> np.ndarray:
        """Publish ``partial_path`` as the cache with ``metadata`` (``dim`` and ``created`` are filled
        in from the array) and return it as a read-only memmap."""
        arr = np.load(self.partial_path, mmap_mode="r")
        meta = {**metadata, "dim": int(arr.shape[1]), "count": int(arr.shape[0]), "dtype": str(arr.dtype)}
        meta.setdefault("created", datetime.now(timezone.utc).isoformat(timespec="seconds"))
        del arr
        if self.json_path.exists():
            self.json_path.unlink()  # never leave new metadata beside an old array, or the reverse
        os.replace(self.partial_path, self.npy_path)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.json_path)
        return np.load(self.npy_path, mmap_mode="r")
