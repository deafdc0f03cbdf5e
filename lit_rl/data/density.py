"""Density-aware prompt weights: embeddings, kNN density, inverse-density weights, offline cache.

Each prompt is embedded with the policy model, its mean Euclidean distance to its ``k`` nearest
other prompts is measured, and it is sampled with probability proportional to that distance, so
prompts from crowded regions of embedding space are drawn less often than isolated ones.

How this differs from the seed analysis (``004_28939806410824da.txt``):

- Embeddings are the mean-pooled **last hidden state** (576 dims for SmolLM2-135M) instead of
  mean-pooled logits (50,304 dims): 28k prompts take 64 MB in float32 (32 MB in float16) where
  the seed needed 5.25 GB. ``pooling="logits"`` keeps the seed's definition for parity, and even
  then no ``[B, T, V]`` logits tensor is built: the LM head is linear, so the mean of the logits
  over tokens equals the LM head applied to the mean hidden state.
- kNN runs on FAISS (exact ``IndexFlatL2`` below ``ivf_threshold`` prompts, an IVF index from
  there on), searched in batches, so the distances of one batch exist at a time. The IVF search
  goes one inverted list at a time, as matrix products over every list its points would probe
  (``ivf_search="by_list"``), instead of FAISS's vector-at-a-time scan per query.
- Embeddings can be computed offline (``lit-rl embed``) into an ``.npy`` memmap with a metadata
  JSON; training reuses the file when the metadata matches and refuses a stale one.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import mmap
import os
import resource
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lit_rl.models import base_model

__all__ = [
    "EmbeddingCache",
    "StaleEmbeddingCacheError",
    "StageStats",
    "dataset_fingerprint",
    "density_weights_for",
    "effective_sample_size",
    "embed_prompts",
    "inverse_density_weights",
    "knn_search",
    "peak_rss_stage",
]

_POOLINGS = ("hidden", "logits")
_DTYPES = {"float32": np.float32, "float16": np.float16}
_BACKENDS = ("auto", "exact", "ivf", "numpy")
# metadata fields that must match for a cached embedding file to be reused
_IDENTITY_FIELDS = ("model", "pooling", "dim", "dtype", "count", "dataset_fingerprint", "max_length")


# ----------------------------------------------------------------------------------------------
# peak memory of a stage
# ----------------------------------------------------------------------------------------------


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


def _reset_peak_rss() -> bool:
    # "5" resets VmHWM to the current RSS (Linux >= 4.0); not writable in some sandboxes
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


@contextmanager
def peak_rss_stage() -> Iterator[StageStats]:
    """Measure the wall time and peak RSS of the enclosed block.

    On Linux the kernel's high-water mark is reset on entry (``echo 5 > /proc/self/clear_refs``)
    and ``VmHWM`` is read on exit, so the peak belongs to this block alone. Where the reset is
    refused the lifetime peak (``VmHWM`` or ``getrusage``) is reported and ``per_stage`` is ``False``.
    Resetting the counter is process-wide: do not nest two measured stages.

    Example::

        with peak_rss_stage() as stage:
            weights = inverse_density_weights(embeddings, k=10)
        print(stage.elapsed_s, stage.peak_rss_gib)
    """
    stats = StageStats(per_stage=_reset_peak_rss())
    start, cpu = time.perf_counter(), time.process_time()
    try:
        yield stats
    finally:
        stats.elapsed_s = time.perf_counter() - start
        stats.cpu_s = time.process_time() - cpu
        stats.peak_rss_gib = _peak_rss_bytes() / 2**30


# ----------------------------------------------------------------------------------------------
# embeddings
# ----------------------------------------------------------------------------------------------


def _trunk(model: torch.nn.Module) -> torch.nn.Module | None:
    """The transformer without its LM head (``model.model`` / ``model.transformer``), if exposed."""
    base = getattr(model, "base_model", None)
    if isinstance(base, torch.nn.Module) and base is not model:
        return base
    return None


def _linear_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head when logits are a plain linear map of the last hidden state, else ``None``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    if not isinstance(head, torch.nn.Linear):
        return None
    # soft-capping (Gemma 2) or a logit scale (Cohere) would make mean(logits) != head(mean(hidden))
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return None
    return head


def _accepts(module: torch.nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # masked_fill, not a product: fully masked pad rows may hold NaN after attention
    x = x.float().masked_fill(~mask[..., None], 0.0)  # [B, T, D]
    return x.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)  # [B, D]


class _Pooler:
    """One embedding pass per batch, with what it needs (trunk, LM head, signature) resolved once."""

    def __init__(self, model: torch.nn.Module, pooling: str) -> None:
        self.model, self.pooling = model, pooling
        trunk = _trunk(model)
        head = _linear_head(model) if pooling == "logits" else None
        # the trunk alone when the LM head is not needed or can be applied after pooling
        self.trunk = trunk if trunk is not None and (pooling == "hidden" or head is not None) else None
        self.head_weight = head.weight.float() if self.trunk is not None and head is not None else None  # [V, H]
        self.head_bias = head.bias.float() if self.head_weight is not None and head.bias is not None else None
        self.positions = _accepts(self.trunk if self.trunk is not None else model, "position_ids")

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.bool()  # [B, T]
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
        if self.positions:
            # counted from the first real token, so the amount of left padding never changes a
            # vector (models with absolute position embeddings would otherwise shift with it)
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
        if self.trunk is not None:
            out = self.trunk(**kwargs)
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, T, H]
            pooled = _masked_mean(hidden, mask)  # [B, H]
            if self.head_weight is not None:
                # the mean over tokens commutes with the linear head: no [B, T, V] tensor
                pooled = pooled @ self.head_weight.T  # [B, V]
                if self.head_bias is not None:
                    pooled = pooled + self.head_bias
            return pooled
        # fallback for models whose trunk is not exposed: the full forward (logits are computed)
        out = self.model(**kwargs, output_hidden_states=self.pooling == "hidden")
        states = out.hidden_states[-1] if self.pooling == "hidden" else out.logits  # [B, T, H or V]
        return _masked_mean(states, mask)


def embed_prompts(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    pooling: str = "hidden",
    batch_size: int = 16,
    max_length: int = 256,
    dtype: str = "float32",
    out_path: str | os.PathLike | None = None,
    progress: bool = True,
    sort_by_length: bool = True,
) -> np.ndarray:
    """Embed already-formatted prompt strings with a causal LM, one batch at a time.

    The model runs in eval mode without gradients. ``pooling="hidden"`` mean-pools the last hidden
    state over non-pad tokens through the model's trunk (``model.base_model``), so the LM head never
    runs; ``pooling="logits"`` mean-pools the logits (the seed's definition, ``D = vocab``) computed
    as ``lm_head(mean hidden)``, which is equal for a linear head and never builds ``[B, T, V]``.
    Position ids count from the first real token, so a prompt's vector does not depend on how much
    padding its batch needed. The training mode of the model is restored afterwards.

    Args:
        model: a transformers causal LM (or a peft model wrapping one).
        tokenizer: its tokenizer; padded on the left; when it has no pad token, EOS is used.
        texts: the prompts, already formatted (chat template applied).
        pooling: ``"hidden"`` (``D = hidden_size``) or ``"logits"`` (``D = vocab_size``).
        batch_size: prompts per forward pass.
        max_length: prompts are truncated to this many tokens.
        dtype: ``"float32"`` or ``"float16"`` (half the storage; distances are still computed in float32).
        out_path: write into an ``.npy`` memmap at this path, row by row, and return it: the matrix
            never has to fit in RAM.
        progress: show a tqdm progress bar.
        sort_by_length: batch prompts of similar length together (less padding); rows are written
            back in the input order.

    Returns:
        ``[N, D]`` array (a ``np.memmap`` when ``out_path`` is given), row ``i`` for ``texts[i]``.

    Raises:
        ValueError: on an unknown ``pooling`` or ``dtype``, or no texts.
    """
    if pooling not in _POOLINGS:
        raise ValueError(f"pooling={pooling!r} is not supported; use one of {_POOLINGS}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {tuple(_DTYPES)}")
    n = len(texts)
    if n == 0:
        raise ValueError("embed_prompts got no texts")
    np_dtype = _DTYPES[dtype]
    model = base_model(model)  # a peft PeftModel forwards to the causal LM it wraps; adapters stay active
    device = next(model.parameters()).device
    order = sorted(range(n), key=lambda i: len(texts[i])) if sort_by_length else list(range(n))

    saved = (tokenizer.padding_side, tokenizer.pad_token)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    was_training = model.training
    model.eval()
    pooler = _Pooler(model, pooling)
    out: np.ndarray | None = None
    try:
        with tqdm(total=n, desc=f"embed ({pooling})", unit="prompt", disable=not progress) as bar:
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                enc = tokenizer(
                    [texts[i] for i in idx], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
                )
                emb = pooler(enc["input_ids"].to(device), enc["attention_mask"].to(device)).cpu().numpy()  # [b, D]
                if out is None:  # the width is known after the first batch
                    shape = (n, emb.shape[1])
                    if out_path is not None:
                        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
                        out = np.lib.format.open_memmap(os.fspath(out_path), mode="w+", dtype=np_dtype, shape=shape)
                    else:
                        out = np.empty(shape, dtype=np_dtype)
                if sort_by_length:
                    out[np.asarray(idx)] = emb
                else:
                    out[start : start + len(idx)] = emb
                if isinstance(out, np.memmap) and (start // batch_size) % 256 == 255:
                    out.flush()  # written pages leave RSS: millions of rows never sit in memory
                    _release_pages(out)
                bar.update(len(idx))
    finally:
        tokenizer.padding_side, tokenizer.pad_token = saved
        model.train(was_training)
    if isinstance(out, np.memmap):
        out.flush()
    return out


# ----------------------------------------------------------------------------------------------
# kNN and inverse-density weights
# ----------------------------------------------------------------------------------------------

# a batch of kNN results: (ids of the query points [b], squared distances [b, k], neighbour ids [b, k])
_KnnBatch = tuple[np.ndarray, np.ndarray, np.ndarray]


def _release_pages(arr: np.ndarray) -> None:
    # drop the memmap's already-read pages from this process (they stay in the page cache), so
    # streaming a file larger than RAM does not inflate RSS; best effort, no-op for plain arrays
    mm = getattr(arr, "_mmap", None)
    if getattr(arr, "mode", None) == "c":  # copy-on-write pages would lose their writes
        return
    if isinstance(mm, mmap.mmap) and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


def _as_array(embeddings: Any) -> np.ndarray:
    if isinstance(embeddings, np.ndarray):  # includes np.memmap, kept on disk
        return embeddings
    if isinstance(embeddings, torch.Tensor):
        return embeddings.detach().cpu().numpy()
    return np.asarray(embeddings)


def _f32(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.float16:  # torch's vectorised half -> float conversion is ~10x numpy's
        with warnings.catch_warnings():  # a read-only memmap: torch only reads it here
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.ascontiguousarray(a)).float().numpy()
    return np.ascontiguousarray(a, dtype=np.float32)


def _rows(embeddings: np.ndarray, start: int, stop: int) -> np.ndarray:
    return _f32(embeddings[start:stop])


def _check_inputs(embeddings: np.ndarray, k: int) -> tuple[int, int]:
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings must be a 2-D [N, D] array, got shape {embeddings.shape}")
    n, d = embeddings.shape
    if k < 1:
        raise ValueError(f"k={k} must be at least 1")
    if k >= n:
        raise ValueError(
            f"k={k} nearest neighbours need more than k points, but there are only N={n}; "
            f"use density_k < {n} or add prompts"
        )
    return n, d


def _resolve_backend(backend: str, n: int, ivf_threshold: int) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; use one of {_BACKENDS}")
    if backend == "auto":
        return "exact" if n < ivf_threshold else "ivf"
    return backend


def _drop_self(dist: np.ndarray, idx: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """From ``k + 1`` neighbours per row, drop the query itself (by index) or, if absent, the farthest."""
    is_self = idx == ids[:, None]  # [b, k+1]
    # a row whose own index is missing (many exact duplicates tie at distance 0) drops its last
    # column: every kept neighbour is then as close as the query itself would have been
    is_self[~is_self.any(1), -1] = True
    keep = ~is_self
    return dist[keep].reshape(len(ids), k), idx[keep].reshape(len(ids), k)


def _numpy_batches(embeddings: np.ndarray, k: int, batch_size: int) -> Iterator[_KnnBatch]:
    # brute force in float64; meant for tests and small N (it reads the whole matrix per batch)
    data = np.asarray(embeddings, dtype=np.float64)
    sq = np.einsum("nd,nd->n", data, data)  # [N]
    n = data.shape[0]
    for start in range(0, n, batch_size):
        q = data[start : start + batch_size]  # [b, D]
        ids = np.arange(start, start + len(q))
        d2 = sq[ids, None] + sq[None, :] - 2.0 * q @ data.T  # [b, N]
        np.maximum(d2, 0.0, out=d2)
        d2[np.arange(len(q)), ids] = np.inf  # never its own neighbour
        part = np.argpartition(d2, k - 1, axis=1)[:, :k]  # [b, k]
        pd = np.take_along_axis(d2, part, 1)
        order = np.argsort(pd, axis=1, kind="stable")
        yield ids, np.take_along_axis(pd, order, 1), np.take_along_axis(part, order, 1)


def _exact_batches(embeddings: np.ndarray, k: int, batch_size: int) -> Iterator[_KnnBatch]:
    import faiss

    n, d = embeddings.shape
    index = faiss.IndexFlatL2(d)  # holds a float32 copy: N * D * 4 bytes
    for s in range(0, n, batch_size):
        index.add(_rows(embeddings, s, s + batch_size))
        _release_pages(embeddings)
    for start in range(0, n, batch_size):
        ids = np.arange(start, min(n, start + batch_size))
        q = _rows(embeddings, start, start + batch_size)
        _release_pages(embeddings)
        d2, idx = index.search(q, k + 1)  # squared L2, [b, k+1]
        yield ids, *_drop_self(d2, idx, ids, k)


def _train_ivf(embeddings: np.ndarray, nlist: int | None, train_size: int | None, seed: int, batch_size: int) -> Any:
    """An empty ``IndexIVFFlat`` whose coarse quantizer is trained on a seeded random sample."""
    import faiss

    n, d = embeddings.shape
    if nlist is None:
        nlist = int(4 * math.sqrt(n))
    nlist = max(1, min(nlist, n // 39))  # faiss wants at least 39 training points per list
    if train_size is None:
        train_size = 40 * nlist
    train_size = max(nlist, min(train_size, n))
    sample = np.sort(np.random.default_rng(seed).choice(n, size=train_size, replace=False))
    train = np.empty((train_size, d), dtype=np.float32)
    for s in range(0, train_size, batch_size):  # gathered in batches from a memmap
        train[s : s + batch_size] = embeddings[sample[s : s + batch_size]]
    _release_pages(embeddings)
    index = faiss.IndexIVFFlat(faiss.IndexFlatL2(d), d, nlist, faiss.METRIC_L2)
    index.cp.seed = seed  # k-means initialisation: deterministic for a given seed
    index.train(train)
    return index


def _ivf_per_query_batches(
    index: Any, embeddings: np.ndarray, k: int, nprobe: int, batch_size: int
) -> Iterator[_KnnBatch]:
    import faiss

    n = embeddings.shape[0]
    for s in range(0, n, batch_size):
        index.add(_rows(embeddings, s, s + batch_size))
        _release_pages(embeddings)
    index.nprobe = min(nprobe, index.nlist)
    for start in range(0, n, batch_size):
        ids = np.arange(start, min(n, start + batch_size))
        q = _rows(embeddings, start, start + batch_size)
        _release_pages(embeddings)
        d2, idx = index.search(q, k + 1)  # squared L2, [b, k+1]
        # the probed lists held fewer than k + 1 points: widen the search for those rows only
        missing = (idx < 0).any(1)
        probe = index.nprobe
        while missing.any() and probe < index.nlist:
            probe = min(index.nlist, probe * 4)
            params = faiss.SearchParametersIVF(nprobe=probe)
            d2[missing], idx[missing] = index.search(q[missing], k + 1, params=params)
            missing = (idx < 0).any(1)
        yield ids, *_drop_self(d2, idx, ids, k)


def _ivf_by_list_batches(
    index: Any, embeddings: np.ndarray, k: int, nprobe: int, batch_size: int
) -> Iterator[_KnnBatch]:
    import faiss

    n, d = embeddings.shape
    quantizer, nlist = index.quantizer, index.nlist
    nprobe = min(nprobe, nlist)
    # each point's nprobe nearest lists (the first is its own): what per-query IVF would scan
    probe = np.empty((n, nprobe), dtype=np.int32)
    for s in range(0, n, batch_size):
        probe[s : s + batch_size] = quantizer.search(_rows(embeddings, s, s + batch_size), nprobe)[1]
        _release_pages(embeddings)
    order = np.argsort(probe[:, 0], kind="stable")  # point ids grouped by their own list
    offsets = np.zeros(nlist + 1, dtype=np.int64)
    np.cumsum(np.bincount(probe[:, 0], minlength=nlist), out=offsets[1:])
    # the vectors in list order, in their stored precision (float16 input: half the memory)
    store = np.float16 if embeddings.dtype == np.float16 else np.float32
    grouped = np.empty((n, d), dtype=store)
    for s in range(0, n, batch_size):
        chunk = order[s : s + batch_size]
        perm = np.argsort(chunk)  # read the memmap in increasing row order
        grouped[s + perm] = embeddings[chunk[perm]]
        _release_pages(embeddings)
    centroids = quantizer.reconstruct_n(0, nlist)  # [nlist, D]
    sizes = np.diff(offsets)
    for lst in range(nlist):
        lo, hi = offsets[lst], offsets[lst + 1]
        if lo == hi:
            continue
        # candidates: every list that any point of this list would probe, so each point sees at
        # least what per-query IVF scans for it; widened by the lists nearest to this list's
        # centroid until they hold k + 1 points
        lists = np.unique(probe[order[lo:hi]])
        if sizes[lists].sum() < k + 1:
            near = np.argsort(((centroids - centroids[lst]) ** 2).sum(1), kind="stable")
            near = near[~np.isin(near, lists)]
            extra = int(np.searchsorted(np.cumsum(sizes[near]), k + 1 - sizes[lists].sum())) + 1
            lists = np.concatenate([lists, near[:extra]])
        cand_pos = np.concatenate([np.arange(offsets[c], offsets[c + 1]) for c in lists])  # rows of `grouped`
        cand = _f32(grouped[cand_pos])  # [c, D]
        for qs in range(lo, hi, batch_size):
            qe = min(hi, qs + batch_size)
            q = _f32(grouped[qs:qe])  # [b, D]
            d2, local = faiss.knn(q, cand, k + 1)  # exact within the candidates, as matrix products
            ids = order[qs:qe]
            yield ids, *_drop_self(d2, order[cand_pos[local]], ids, k)


def _knn_batches(
    embeddings: np.ndarray,
    k: int,
    *,
    backend: str,
    nprobe: int,
    ivf_threshold: int,
    nlist: int | None,
    train_size: int | None,
    seed: int,
    batch_size: int,
    ivf_search: str,
) -> Iterator[_KnnBatch]:
    """Yield ``(ids [b], squared_distances [b, k], neighbour_ids [b, k])`` batch by batch, self excluded."""
    n, _ = _check_inputs(embeddings, k)
    kind = _resolve_backend(backend, n, ivf_threshold)
    if kind == "numpy":
        yield from _numpy_batches(embeddings, k, batch_size)
    elif kind == "exact":
        yield from _exact_batches(embeddings, k, batch_size)
    else:
        if ivf_search not in ("by_list", "per_query"):
            raise ValueError(f"ivf_search={ivf_search!r} is not supported; use 'by_list' or 'per_query'")
        index = _train_ivf(embeddings, nlist, train_size, seed, batch_size)
        search = _ivf_by_list_batches if ivf_search == "by_list" else _ivf_per_query_batches
        yield from search(index, embeddings, k, nprobe, batch_size)


def knn_search(
    embeddings: np.ndarray,
    k: int,
    *,
    backend: str = "auto",
    nprobe: int = 16,
    ivf_threshold: int = 200_000,
    nlist: int | None = None,
    train_size: int | None = None,
    seed: int = 0,
    batch_size: int = 65536,
    ivf_search: str = "by_list",
) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` nearest other points of every point: Euclidean distances and indices.

    Same arguments as :func:`inverse_density_weights`. Holds ``[N, k]`` results (12 bytes per
    neighbour); :func:`inverse_density_weights` keeps only the per-point mean.

    Returns:
        ``(distances [N, k] float32, indices [N, k] int64)``, nearest first, the point itself excluded.
    """
    embeddings = _as_array(embeddings)
    n, _ = _check_inputs(embeddings, k)
    dist = np.empty((n, k), dtype=np.float32)
    index = np.empty((n, k), dtype=np.int64)
    for ids, d2, idx in _knn_batches(
        embeddings, k, backend=backend, nprobe=nprobe, ivf_threshold=ivf_threshold, nlist=nlist,
        train_size=train_size, seed=seed, batch_size=batch_size, ivf_search=ivf_search,
    ):  # fmt: skip
        dist[ids] = np.sqrt(np.maximum(d2, 0.0))
        index[ids] = idx
    return dist, index


def _weights_from_mean_distances(mean_dist: np.ndarray, min_distance_fraction: float) -> np.ndarray:
    """Normalise mean kNN distances into weights, with a floor for duplicates.

    A point whose ``k`` neighbours are all exact duplicates has mean distance 0; it, and any point
    closer than the floor, is given ``min_distance_fraction`` times the median positive mean
    distance instead, so it keeps a small non-zero weight. When every distance is 0 (all points
    identical) the weights are uniform.
    """
    mean_dist = np.asarray(mean_dist, dtype=np.float64)
    positive = mean_dist[mean_dist > 0]
    floor = min_distance_fraction * float(np.median(positive)) if positive.size else 1.0
    d = np.maximum(mean_dist, floor)
    return d / d.sum()


def inverse_density_weights(
    embeddings: np.ndarray,
    k: int,
    *,
    backend: str = "auto",
    nprobe: int = 16,
    ivf_threshold: int = 200_000,
    nlist: int | None = None,
    train_size: int | None = None,
    seed: int = 0,
    batch_size: int = 65536,
    ivf_search: str = "by_list",
    min_distance_fraction: float = 0.01,
) -> np.ndarray:
    """Sampling weights proportional to each point's mean Euclidean distance to its ``k`` nearest others.

    Sparse regions weigh more: the weight is an inverse kNN density estimate. Each point searches
    ``k + 1`` neighbours and drops itself by index (robust to exact duplicates, where it may not
    come first); FAISS returns squared distances, which are square-rooted before averaging.

    Duplicates: a mean distance below ``min_distance_fraction * median(positive mean distances)``
    (in particular 0, when all ``k`` neighbours are exact copies) is raised to that floor, so no
    weight is 0 and the normalisation never divides by 0; all-identical inputs give uniform weights.

    IVF: a FAISS ``IndexIVFFlat`` coarse quantizer (k-means with ``nlist`` centroids) is trained on
    ``train_size`` points drawn with ``seed``, and every point is given its ``nprobe`` nearest
    lists. ``ivf_search="per_query"`` is FAISS's own search: each point scans its lists one vector
    at a time. ``ivf_search="by_list"`` (default) searches the points of one list together,
    exactly, among the members of every list that any of them probes: a superset of what
    ``per_query`` scans, so it finds at least the same neighbours, and computed as matrix products
    it is also faster on CPU (``bench/results/density.md``).

    Memory: ``exact`` and ``per_query`` IVF hold a float32 copy of the matrix in the index
    (``N * D * 4`` bytes); ``by_list`` holds one copy in the input's precision (half that for a
    float16 memmap) plus one list's candidates. The input may be a float16 memmap on disk, read and
    converted one batch at a time.

    Args:
        embeddings: ``[N, D]`` float32 or float16 array or memmap.
        k: neighbours per point (``1 <= k < N``).
        backend: ``"exact"`` (FAISS ``IndexFlatL2``), ``"ivf"`` (FAISS IVF, approximate),
            ``"numpy"`` (float64 brute force, for tests and small N) or ``"auto"`` (exact below
            ``ivf_threshold`` points, IVF from there on).
        nprobe: IVF lists searched per query: more is slower and closer to exact.
        ivf_threshold: number of points from which ``"auto"`` switches to IVF.
        nlist: IVF lists; default ``4 * sqrt(N)`` (at most ``N / 39``).
        train_size: points the IVF k-means is trained on, drawn at random with ``seed``; default ``40 * nlist``.
        seed: seeds the IVF training sample and k-means, so results are deterministic.
        batch_size: query rows per search batch (bounds the temporary memory).
        ivf_search: ``"by_list"`` or ``"per_query"``, see above.
        min_distance_fraction: the duplicate floor, as a fraction of the median positive mean distance.

    Returns:
        ``[N]`` float64 weights summing to 1.

    Raises:
        ValueError: ``k >= N``, ``k < 1``, a non 2-D input or an unknown backend.
    """
    embeddings = _as_array(embeddings)
    n, _ = _check_inputs(embeddings, k)
    mean_dist = np.empty(n, dtype=np.float64)
    for ids, d2, _ in _knn_batches(
        embeddings, k, backend=backend, nprobe=nprobe, ivf_threshold=ivf_threshold, nlist=nlist,
        train_size=train_size, seed=seed, batch_size=batch_size, ivf_search=ivf_search,
    ):  # fmt: skip
        mean_dist[ids] = np.sqrt(np.maximum(d2.astype(np.float64), 0.0)).mean(1)
    return _weights_from_mean_distances(mean_dist, min_distance_fraction)


def effective_sample_size(weights: np.ndarray) -> float:
    """Kish's effective sample size relative to N: ``(sum w)^2 / sum w^2 / N``, 1.0 for uniform weights."""
    w = np.asarray(weights, dtype=np.float64)
    return float(w.sum() ** 2 / np.square(w).sum() / len(w))


# ----------------------------------------------------------------------------------------------
# offline cache
# ----------------------------------------------------------------------------------------------


class StaleEmbeddingCacheError(ValueError):
    """The cached embedding file was built for different prompts, model or settings."""


def dataset_fingerprint(texts: Iterable[str]) -> str:
    """SHA-256 over the prompt strings in order, streamed (each string length-prefixed, so
    ``["ab", "c"]`` and ``["a", "bc"]`` differ)."""
    h = hashlib.sha256()
    for text in texts:
        b = text.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


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
            f"Rebuild it with `lit-rl embed --config <your config>` or delete {self.npy_path} and {self.json_path}."
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
            for key in _IDENTITY_FIELDS
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


def _model_id(model: torch.nn.Module, model_id: str) -> str:
    if model_id:
        return model_id
    config = getattr(base_model(model), "config", None)
    return str(getattr(config, "_name_or_path", "") or "")


def embed_to_cache(
    texts: Sequence[str],
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    cache_dir: str | os.PathLike,
    model_id: str = "",
    pooling: str = "hidden",
    batch_size: int = 16,
    max_length: int = 256,
    dtype: str = "float32",
    progress: bool = True,
    overwrite: bool = False,
) -> tuple[np.ndarray, bool]:
    """Load the cached embeddings of ``texts`` or compute and store them (what ``lit-rl embed`` runs).

    Args:
        overwrite: rebuild a stale cache instead of raising (``lit-rl embed`` sets it).
        others: as in :func:`embed_prompts`; ``model_id`` defaults to ``model.config._name_or_path``.

    Returns:
        ``(embeddings memmap, reused)`` where ``reused`` says the file was already there.

    Raises:
        StaleEmbeddingCacheError: a cache with other metadata exists and ``overwrite`` is ``False``.
    """
    cache = EmbeddingCache(cache_dir)
    expected = embedding_metadata(
        texts, model_id=_model_id(model, model_id), pooling=pooling, dtype=dtype, max_length=max_length
    )
    try:
        cached = cache.load(expected)
    except StaleEmbeddingCacheError:
        if not overwrite:
            raise
        cached = None
    if cached is not None:
        return cached, True
    emb = embed_prompts(
        model, tokenizer, texts, pooling=pooling, batch_size=batch_size, max_length=max_length, dtype=dtype,
        out_path=cache.partial_path, progress=progress,
    )  # fmt: skip
    del emb  # flushed; reopened read-only below
    return cache.commit(expected), False


def density_weights_for(
    texts: Sequence[str],
    *,
    model: torch.nn.Module | None,
    tokenizer: Any,
    k: int = 10,
    pooling: str = "hidden",
    backend: str = "auto",
    cache_dir: str | os.PathLike | None = None,
    model_id: str = "",
    batch_size: int = 16,
    max_length: int = 256,
    dtype: str = "float32",
    progress: bool = True,
    nprobe: int = 16,
    ivf_threshold: int = 200_000,
    seed: int = 0,
) -> tuple[np.ndarray, dict[str, float]]:
    """Inverse-density sampling weights of ``texts``, embedding them with ``model`` or reusing a cache.

    With ``cache_dir`` a matching cache file is reused (the model is not run), a stale one is
    refused with :class:`StaleEmbeddingCacheError`, and a missing one is written. Without it the
    embeddings are computed in memory (``N * D`` values: 64 MB for 28k prompts at 576 dims, float32).

    Args:
        texts: the formatted prompts, in dataset order.
        model: the causal LM that embeds them (may be ``None`` when a matching cache exists).
        tokenizer: its tokenizer.
        k: neighbours of the density estimate.
        pooling, batch_size, max_length, dtype, progress: see :func:`embed_prompts`.
        backend, nprobe, ivf_threshold, seed: see :func:`inverse_density_weights`.
        cache_dir: folder of the offline :class:`EmbeddingCache`.
        model_id: the model's name or path, recorded in and checked against the cache metadata.

    Returns:
        ``(weights [N] float64 summing to 1, stats)`` where ``stats`` holds ``density/ess``,
        ``density/embed_time_s``, ``density/embed_peak_rss_gib``, ``density/knn_time_s``,
        ``density/knn_peak_rss_gib``, ``density/num_prompts``, ``density/dim`` and
        ``density/cache_hit`` (1.0 when the embeddings came from the cache).

    Raises:
        StaleEmbeddingCacheError: the cache exists but was built for other prompts, model or settings.
        ValueError: ``k >= len(texts)``, or ``model`` is ``None`` and no cache can be reused.
    """
    n = len(texts)
    if k >= n:  # fail before spending minutes embedding
        raise ValueError(f"density k={k} needs more than k prompts, but there are only N={n}; use k < {n}")
    with peak_rss_stage() as embed_stage:
        if cache_dir is not None:
            cache = EmbeddingCache(cache_dir)
            expected = embedding_metadata(
                texts, model_id=_model_id(model, model_id) if model is not None else model_id, pooling=pooling,
                dtype=dtype, max_length=max_length,
            )  # fmt: skip
            emb = cache.load(expected)
            hit = emb is not None
            if emb is None:
                if model is None:
                    raise ValueError(f"no embedding cache in {cache_dir} and no model to compute one")
                emb, _ = embed_to_cache(
                    texts, model=model, tokenizer=tokenizer, cache_dir=cache_dir, model_id=expected["model"],
                    pooling=pooling, batch_size=batch_size, max_length=max_length, dtype=dtype, progress=progress,
                )  # fmt: skip
        else:
            if model is None:
                raise ValueError("density weights need a model to embed the prompts, or a cache_dir to reuse")
            hit = False
            emb = embed_prompts(
                model, tokenizer, texts, pooling=pooling, batch_size=batch_size, max_length=max_length, dtype=dtype,
                progress=progress,
            )  # fmt: skip
    with peak_rss_stage() as knn_stage:
        weights = inverse_density_weights(
            emb, k, backend=backend, nprobe=nprobe, ivf_threshold=ivf_threshold, seed=seed
        )
    stats = {
        "density/ess": effective_sample_size(weights),
        "density/embed_time_s": embed_stage.elapsed_s,
        "density/embed_peak_rss_gib": embed_stage.peak_rss_gib,
        "density/knn_time_s": knn_stage.elapsed_s,
        "density/knn_peak_rss_gib": knn_stage.peak_rss_gib,
        "density/num_prompts": float(n),
        "density/dim": float(emb.shape[1]),
        "density/cache_hit": float(hit),
    }
    return weights, stats
