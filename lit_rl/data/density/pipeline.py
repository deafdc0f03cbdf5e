"""Density weights end to end: embed the prompts (or reuse the offline cache), then kNN and weights.

:func:`embed_to_cache` is what ``lit-rl embed`` runs; :func:`density_weights_for` is what the
DataModule runs at start-up. Each stage is timed with its peak RSS (:mod:`lit_rl.memory.rss`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_rl.data.density.cache import EmbeddingCache, StaleEmbeddingCacheError, embedding_metadata
from lit_rl.data.density.embed import embed_prompts
from lit_rl.data.density.weights import effective_sample_size, inverse_density_weights
from lit_rl.memory.rss import peak_rss_stage
from lit_rl.models import base_model


def _model_id(model: torch.nn.Module, model_id: str) -> str:
    if model_id:
        return model_id
    config = getattr(base_model(model), "config", None)
    return str(getattr(config, "name_or_path", "") or "")


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
        overwrite: rebuild a stale cache instead of raising (``lit-rl embed`` sets it); one log line
            says which file was replaced and why.
        others: as in :func:`embed_prompts`; ``model_id`` defaults to ``model.config.name_or_path``.

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
    except StaleEmbeddingCacheError as err:
        if not overwrite:
            raise
        rank_zero_info(f"replacing the stale embedding cache {cache.npy_path}: {err.reason}")
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
    nprobe: int = 3,
    ivf_threshold: int = 200_000,
    seed: int = 0,
    overwrite: bool = False,
) -> tuple[np.ndarray, dict[str, float]]:
    """Inverse-density sampling weights of ``texts``, embedding them with ``model`` or reusing a cache.

    With ``cache_dir`` a matching cache file is reused (the model is not run), a stale one is
    refused with :class:`StaleEmbeddingCacheError` (or rebuilt with ``overwrite``), and a missing
    one is written. Without it the embeddings are computed in memory (``N * D`` values: 64 MB for
    28k prompts at 576 dims, float32).

    Args:
        texts: the formatted prompts, in dataset order.
        model: the causal LM that embeds them (may be ``None`` when a matching cache exists).
        tokenizer: its tokenizer.
        k: neighbours of the density estimate.
        pooling, batch_size, max_length, dtype: see :func:`embed_prompts`.
        progress: progress bars for the embedding pass and the IVF kNN search.
        backend, nprobe, ivf_threshold, seed: see :func:`inverse_density_weights`.
        cache_dir: folder of the offline :class:`EmbeddingCache`.
        model_id: the model's name or path, recorded in and checked against the cache metadata.
        overwrite: rebuild a stale cache instead of raising (what ``lit-rl embed`` does).

    Returns:
        ``(weights [N] float64 summing to 1, stats)`` where ``stats`` holds ``density/ess``,
        ``density/embed_time_s``, ``density/embed_peak_rss_gib``, ``density/knn_time_s``,
        ``density/knn_peak_rss_gib``, ``density/num_prompts``, ``density/dim`` and
        ``density/cache_hit`` (1.0 when the embeddings came from the cache).

    Raises:
        StaleEmbeddingCacheError: the cache exists but was built for other prompts, model or settings,
            and ``overwrite`` is ``False``.
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
            try:
                emb = cache.load(expected)
            except StaleEmbeddingCacheError:
                if not overwrite:
                    raise
                emb = None  # embed_to_cache below says that it replaces it, and why
            hit = emb is not None
            if emb is None:
                if model is None:
                    raise ValueError(f"no embedding cache in {cache_dir} and no model to compute one")
                emb, _ = embed_to_cache(
                    texts, model=model, tokenizer=tokenizer, cache_dir=cache_dir, model_id=expected["model"],
                    pooling=pooling, batch_size=batch_size, max_length=max_length, dtype=dtype, progress=progress,
                    overwrite=overwrite,
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
            emb, k, backend=backend, nprobe=nprobe, ivf_threshold=ivf_threshold, seed=seed, progress=progress
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
