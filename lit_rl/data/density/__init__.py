"""Density-aware prompt weights: embeddings, kNN density, inverse-density weights, offline cache.

Each prompt is embedded with the policy model, its mean Euclidean distance to its ``k`` nearest
other prompts is measured, and it is sampled with probability proportional to that distance, so
prompts from crowded regions of embedding space are drawn less often than isolated ones.

One file per job:

- :mod:`.embed`: the prompt embeddings (mean-pooled last hidden state over the policy's trunk).
- :mod:`.knn`: the ``k`` nearest neighbours, four backends (numpy, exact FAISS, IVF per query, IVF by list).
- :mod:`.weights`: inverse-density weights from the neighbour distances; effective sample size.
- :mod:`.cache`: the on-disk embedding cache (``.npy`` memmap + metadata JSON) and its staleness check.
- :mod:`.pipeline`: embed or reuse the cache, then weights, each stage timed (what the DataModule runs).
- :mod:`.arrays`: reading memmaps in batches without growing RSS (shared by ``embed`` and ``knn``).

The stage timer (:func:`peak_rss_stage`) lives in :mod:`lit_rl.memory.rss` and is re-exported here.
:data:`TRAIN_POINTS_PER_LIST` is how many points per inverted list the IVF index trains on when ``train_size`` is
not given.

How this differs from a first design that embeds prompts by their logits: hidden-state embeddings
instead of vocabulary-sized logits (:mod:`.embed`), FAISS kNN in batches with an IVF index for
millions of prompts (:mod:`.knn`), and an offline cache that training refuses when stale (:mod:`.cache`).
"""

from lit_rl.data.density.cache import EmbeddingCache, StaleEmbeddingCacheError, dataset_fingerprint, embedding_metadata
from lit_rl.data.density.embed import embed_prompts
from lit_rl.data.density.knn import TRAIN_POINTS_PER_LIST, knn_search
from lit_rl.data.density.pipeline import density_weights_for, embed_to_cache
from lit_rl.data.density.weights import effective_sample_size, inverse_density_weights, weights_from_mean_distances
from lit_rl.memory.rss import StageStats, peak_rss_stage

__all__ = [
    "EmbeddingCache",
    "StaleEmbeddingCacheError",
    "StageStats",
    "TRAIN_POINTS_PER_LIST",
    "dataset_fingerprint",
    "density_weights_for",
    "effective_sample_size",
    "embed_prompts",
    "embed_to_cache",
    "embedding_metadata",
    "inverse_density_weights",
    "knn_search",
    "peak_rss_stage",
    "weights_from_mean_distances",
]
