"""Inverse-density sampling weights from kNN distances, and their effective sample size.

Each prompt is sampled with probability proportional to its mean Euclidean distance to its ``k``
nearest other prompts in embedding space, so prompts from crowded regions are drawn less often
than isolated ones. The neighbours come from :mod:`.knn`; only the per-point mean is kept.
"""

from __future__ import annotations

import numpy as np

from lit_rl.data.density.arrays import as_array
from lit_rl.data.density.knn import check_knn_inputs, knn_batches


def weights_from_mean_distances(mean_dist: np.ndarray, min_distance_fraction: float) -> np.ndarray:
    """Normalise mean kNN distances into weights, with a floor for duplicates.

    A point whose ``k`` neighbours are all exact duplicates has mean distance 0; it, and any point
    closer than the floor, is given ``min_distance_fraction`` times the median positive mean
    distance instead, so it keeps a small non-zero weight. When every distance is 0 (all points
    identical) the weights are uniform.

    Args:
        mean_dist: ``[N]`` mean distance of each point to its ``k`` nearest others.
        min_distance_fraction: the floor, as a fraction of the median positive mean distance.

    Returns:
        ``[N]`` float64 weights summing to 1.
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
    nprobe: int = 3,
    ivf_threshold: int = 200_000,
    nlist: int | None = None,
    train_size: int | None = None,
    niter: int = 5,
    seed: int = 0,
    batch_size: int = 65536,
    ivf_search: str = "by_list",
    min_distance_fraction: float = 0.01,
    progress: bool = False,
) -> np.ndarray:
    """Sampling weights proportional to each point's mean Euclidean distance to its ``k`` nearest others.

    Sparse regions weigh more: the weight is an inverse kNN density estimate. Each point searches
    ``k + 1`` neighbours and drops itself by index (robust to exact duplicates, where it may not
    come first); FAISS returns squared distances, which are square-rooted before averaging.

    Duplicates: a mean distance below ``min_distance_fraction * median(positive mean distances)``
    (in particular 0, when all ``k`` neighbours are exact copies) is raised to that floor, so no
    weight is 0 and the normalisation never divides by 0; all-identical inputs give uniform weights.

    IVF: a FAISS ``IndexIVFFlat`` coarse quantizer (k-means with ``nlist`` centroids, ``niter``
    iterations) is trained on ``train_size`` points drawn with ``seed``, and every point is given its
    ``nprobe`` nearest lists. ``ivf_search="per_query"`` is FAISS's own search: each point scans its
    lists one vector at a time. ``ivf_search="by_list"`` (default) searches the points of one list
    together, exactly, among the members of every list that any of them probes: a superset of what
    ``per_query`` scans, so it finds at least the same neighbours. It runs as matrix products in
    torch (``|c|^2 - 2 q.c``, then the ``k + 1`` found re-measured as sums of squared differences),
    which on CPU is several times faster than FAISS's scan or ``faiss.knn`` on blocks this small
    (``bench/results/density.md``: 1M float16 576-d points in under 600 s on 2 cores, recall@10
    above 0.95 against exact search).

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
        nprobe: IVF lists probed per point: more is slower and closer to exact. With ``by_list`` a
            point is compared with every list probed by any point of its own list, so a small nprobe
            already recalls most true neighbours (recall and time by nprobe: ``bench/results/density.md``).
        ivf_threshold: number of points from which ``"auto"`` switches to IVF.
        nlist: IVF lists; default ``4 * sqrt(N)`` (at most ``N / 39``).
        train_size: points the IVF k-means is trained on, drawn at random with ``seed``; default ``20 * nlist``
            (FAISS asks for 39 or more per list; fewer costs little recall here, see ``niter``).
        niter: IVF k-means iterations (FAISS's IVF default is 10): the training costs
            ``train_size * nlist * D * niter`` multiply-adds, a quarter of it at 5 and ``20 * nlist``.
        seed: seeds the IVF training sample and k-means, so results are deterministic.
        batch_size: query rows per search batch (bounds the temporary memory).
        ivf_search: ``"by_list"`` or ``"per_query"``, see above.
        min_distance_fraction: the duplicate floor, as a fraction of the median positive mean distance.
        progress: a progress bar over the IVF lists of the ``by_list`` search.

    Returns:
        ``[N]`` float64 weights summing to 1.

    Raises:
        ValueError: ``k >= N``, ``k < 1``, a non 2-D input or an unknown backend.
    """
    embeddings = as_array(embeddings)
    n, _ = check_knn_inputs(embeddings, k)
    mean_dist = np.empty(n, dtype=np.float64)
    for ids, d2, _ in knn_batches(
        embeddings, k, backend=backend, nprobe=nprobe, ivf_threshold=ivf_threshold, nlist=nlist,
        train_size=train_size, seed=seed, batch_size=batch_size, ivf_search=ivf_search, niter=niter,
        progress=progress,
    ):  # fmt: skip
        mean_dist[ids] = np.sqrt(np.maximum(d2.astype(np.float64), 0.0)).mean(1)
    return weights_from_mean_distances(mean_dist, min_distance_fraction)


def effective_sample_size(weights: np.ndarray) -> float:
    """Kish's effective sample size relative to N: ``(sum w)^2 / sum w^2 / N``, 1.0 for uniform weights."""
    w = np.asarray(weights, dtype=np.float64)
    return float(w.sum() ** 2 / np.square(w).sum() / len(w))
