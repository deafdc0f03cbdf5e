"""The ``k`` nearest other points of every embedding, batch by batch: four backends.

- ``numpy``: float64 brute force, for tests and small N.
- ``exact``: FAISS ``IndexFlatL2``.
- ``ivf`` with ``ivf_search="per_query"``: FAISS ``IndexIVFFlat``'s own search, each point scanning
  its ``nprobe`` nearest inverted lists one vector at a time.
- ``ivf`` with ``ivf_search="by_list"`` (default): the same coarse quantizer, but the points of one
  inverted list are searched together, exactly, among the members of every list any of them
  probes, as torch matrix products (``faiss.knn`` reached ~15 GFLOP/s on these small blocks,
  a torch ``addmm`` + ``topk`` 20-60 on the same 2 cores).

How this differs from a plain all-pairs search: kNN runs on FAISS (exact
below ``ivf_threshold`` prompts, IVF from there on), searched in batches, so the distances of one
batch exist at a time; and the IVF search goes one inverted list at a time (``by_list``) instead
of FAISS's vector-at-a-time scan per query.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lit_rl.data.density.arrays import as_array, read_rows, release_pages

BACKENDS = ("auto", "exact", "ivf", "numpy")
# default IVF k-means sample: points per list (FAISS's own advice is 39 or more, see _train_ivf)
TRAIN_POINTS_PER_LIST = 20
# float32 elements of one by_list distance block (64 MiB): bounds the temporary memory of a list
_BLOCK_ELEMENTS = 2**24

# a batch of kNN results: (ids of the query points [b], squared distances [b, k], neighbour ids [b, k])
KnnBatch = tuple[np.ndarray, np.ndarray, np.ndarray]


def check_knn_inputs(embeddings: np.ndarray, k: int) -> tuple[int, int]:
    """``(N, D)`` of a valid input; a ``ValueError`` naming the fix otherwise."""
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
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; use one of {BACKENDS}")
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


def _numpy_batches(embeddings: np.ndarray, k: int, batch_size: int) -> Iterator[KnnBatch]:
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


def _exact_batches(embeddings: np.ndarray, k: int, batch_size: int) -> Iterator[KnnBatch]:
    import faiss

    n, d = embeddings.shape
    index = faiss.IndexFlatL2(d)  # holds a float32 copy: N * D * 4 bytes
    for s in range(0, n, batch_size):
        index.add(read_rows(embeddings, s, s + batch_size))
        release_pages(embeddings)
    for start in range(0, n, batch_size):
        ids = np.arange(start, min(n, start + batch_size))
        q = read_rows(embeddings, start, start + batch_size)
        release_pages(embeddings)
        d2, idx = index.search(q, k + 1)  # squared L2, [b, k+1]
        yield ids, *_drop_self(d2, idx, ids, k)


def _train_ivf(
    embeddings: np.ndarray, nlist: int | None, train_size: int | None, niter: int, seed: int, batch_size: int
) -> Any:
    """An empty ``IndexIVFFlat`` whose coarse quantizer is trained on a seeded random sample.

    The k-means costs ``train_size * nlist * D * niter`` multiply-adds: 20 points per list and 5
    iterations halve FAISS's sample and iterations, a quarter of the cost, while the ``by_list``
    search keeps recall@10 above 0.95 (``bench/results/density.md``). FAISS's own numbers: its
    ``ClusteringParameters`` warn below ``min_points_per_centroid = 39`` training points per
    centroid and subsample above ``max_points_per_centroid = 256`` (faiss/Clustering.h), and an
    IVF index's k-means runs ``cp.niter = 10`` iterations, "a low # iterations because this is
    typically used for large clusterings" (faiss/IndexIVF.cpp, ``Level1Quantizer``), where a plain
    ``faiss.Kmeans`` runs 25.
    """
    import faiss

    n, d = embeddings.shape
    if nlist is None:
        nlist = int(4 * math.sqrt(n))
    nlist = max(1, min(nlist, n // 39))  # at least 39 points per list on average
    if train_size is None:
        train_size = TRAIN_POINTS_PER_LIST * nlist
    train_size = max(nlist, min(train_size, n))
    sample = np.sort(np.random.default_rng(seed).choice(n, size=train_size, replace=False))
    train = np.empty((train_size, d), dtype=np.float32)
    for s in range(0, train_size, batch_size):  # gathered in batches from a memmap
        train[s : s + batch_size] = embeddings[sample[s : s + batch_size]]
    release_pages(embeddings)
    index = faiss.IndexIVFFlat(faiss.IndexFlatL2(d), d, nlist, faiss.METRIC_L2)
    index.cp.seed = seed  # k-means initialisation: deterministic for a given seed
    index.cp.niter = niter
    # FAISS warns below 39 training points per centroid (see above); 20 is this module's default on purpose
    index.cp.min_points_per_centroid = min(index.cp.min_points_per_centroid, TRAIN_POINTS_PER_LIST)
    index.train(train)
    return index


def _ivf_per_query_batches(
    index: Any, embeddings: np.ndarray, k: int, nprobe: int, batch_size: int
) -> Iterator[KnnBatch]:
    import faiss

    n = embeddings.shape[0]
    for s in range(0, n, batch_size):
        index.add(read_rows(embeddings, s, s + batch_size))
        release_pages(embeddings)
    index.nprobe = min(nprobe, index.nlist)
    for start in range(0, n, batch_size):
        ids = np.arange(start, min(n, start + batch_size))
        q = read_rows(embeddings, start, start + batch_size)
        release_pages(embeddings)
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


def _nearest_lists(embeddings: np.ndarray, centroids: torch.Tensor, nprobe: int, batch_size: int) -> np.ndarray:
    """Each point's ``nprobe`` nearest centroids, nearest first: ``[N, nprobe]`` int64."""
    n = embeddings.shape[0]
    c_sq = centroids.square().sum(1)  # [L]
    probe = np.empty((n, nprobe), dtype=np.int64)
    for s in range(0, n, batch_size):
        q = torch.from_numpy(read_rows(embeddings, s, s + batch_size))  # [b, D]
        release_pages(embeddings)
        d2 = torch.addmm(c_sq[None, :], q, centroids.T, alpha=-2.0)  # [b, L], |q|^2 left out: same order
        probe[s : s + batch_size] = torch.topk(d2, nprobe, dim=1, largest=False).indices.numpy()
    return probe


def _ivf_by_list_batches(
    index: Any, embeddings: np.ndarray, k: int, nprobe: int, batch_size: int, progress: bool
) -> Iterator[KnnBatch]:
    n, d = embeddings.shape
    nlist = index.nlist
    nprobe = min(nprobe, nlist)
    centroids = torch.from_numpy(index.quantizer.reconstruct_n(0, nlist))  # [L, D]
    # each point's nprobe nearest lists (the first is its own): what per-query IVF would scan
    probe = _nearest_lists(embeddings, centroids, nprobe, batch_size)  # [N, nprobe]
    order = np.argsort(probe[:, 0], kind="stable")  # point ids grouped by their own list
    offsets = np.zeros(nlist + 1, dtype=np.int64)
    np.cumsum(np.bincount(probe[:, 0], minlength=nlist), out=offsets[1:])
    # the vectors in list order, in their stored precision (float16 input: half the memory)
    store = np.float16 if embeddings.dtype == np.float16 else np.float32
    grouped_np = np.empty((n, d), dtype=store)
    for s in range(0, n, batch_size):
        chunk = order[s : s + batch_size]
        perm = np.argsort(chunk)  # read the memmap in increasing row order
        grouped_np[s + perm] = embeddings[chunk[perm]]
        release_pages(embeddings)
    grouped = torch.from_numpy(grouped_np)  # [N, D], shares memory
    sizes = np.diff(offsets)
    for lst in tqdm(range(nlist), desc="kNN by IVF list", unit="list", disable=not progress, mininterval=5.0):
        lo, hi = offsets[lst], offsets[lst + 1]
        if lo == hi:
            continue
        # candidates: every list that any point of this list would probe, so each point sees at
        # least what per-query IVF scans for it; widened by the lists nearest to this list's
        # centroid until they hold k + 1 points
        lists = np.unique(probe[order[lo:hi]])
        if sizes[lists].sum() < k + 1:
            near = torch.argsort(((centroids - centroids[lst]) ** 2).sum(1), stable=True).numpy()
            near = near[~np.isin(near, lists)]
            extra = int(np.searchsorted(np.cumsum(sizes[near]), k + 1 - sizes[lists].sum())) + 1
            lists = np.concatenate([lists, near[:extra]])
        # contiguous slices of `grouped`, one per candidate list: no gather index over rows
        cand = torch.cat([grouped[offsets[c] : offsets[c + 1]] for c in lists]).float()  # [c, D]
        cand_pos = np.concatenate([np.arange(offsets[c], offsets[c + 1]) for c in lists])  # rows of `grouped`
        cand_sq = cand.square().sum(1)  # [c]
        # bounds the [b, c] distance block and the [b, k+1, D] re-rank gather to ~64 MiB each
        rows = max(1, min(batch_size, _BLOCK_ELEMENTS // max(len(cand), (k + 1) * d)))
        for qs in range(lo, hi, rows):
            qe = min(hi, qs + rows)
            q = grouped[qs:qe].float()  # [b, D]
            # |c|^2 - 2 q.c ranks the candidates like the squared distance, as one matrix product
            d2 = torch.addmm(cand_sq[None, :], q, cand.T, alpha=-2.0)  # [b, c]
            top = torch.topk(d2, k + 1, dim=1, largest=False).indices  # [b, k+1]
            # the k + 1 found, re-measured as sums of squared differences: no cancellation error
            exact = (q[:, None, :] - cand[top]).square().sum(-1)  # [b, k+1]
            exact, resort = torch.sort(exact, dim=1)
            top = torch.gather(top, 1, resort)
            ids = order[qs:qe]
            yield ids, *_drop_self(exact.numpy(), order[cand_pos[top.numpy()]], ids, k)


def knn_batches(
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
    niter: int = 5,
    progress: bool = False,
) -> Iterator[KnnBatch]:
    """Yield ``(ids [b], squared_distances [b, k], neighbour_ids [b, k])`` batch by batch, self excluded.

    Arguments as in :func:`lit_rl.data.density.inverse_density_weights`; ``embeddings`` must be a
    numpy array or memmap (see :func:`lit_rl.data.density.arrays.as_array`).
    """
    n, _ = check_knn_inputs(embeddings, k)
    kind = _resolve_backend(backend, n, ivf_threshold)
    if kind == "numpy":
        yield from _numpy_batches(embeddings, k, batch_size)
    elif kind == "exact":
        yield from _exact_batches(embeddings, k, batch_size)
    else:
        if ivf_search not in ("by_list", "per_query"):
            raise ValueError(f"ivf_search={ivf_search!r} is not supported; use 'by_list' or 'per_query'")
        index = _train_ivf(embeddings, nlist, train_size, niter, seed, batch_size)
        if ivf_search == "by_list":
            yield from _ivf_by_list_batches(index, embeddings, k, nprobe, batch_size, progress)
        else:
            yield from _ivf_per_query_batches(index, embeddings, k, nprobe, batch_size)


def knn_search(
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
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` nearest other points of every point: Euclidean distances and indices.

    Same arguments as :func:`lit_rl.data.density.inverse_density_weights`. Holds ``[N, k]`` results
    (12 bytes per neighbour); ``inverse_density_weights`` keeps only the per-point mean.

    Returns:
        ``(distances [N, k] float32, indices [N, k] int64)``, nearest first, the point itself excluded.
    """
    embeddings = as_array(embeddings)
    n, _ = check_knn_inputs(embeddings, k)
    dist = np.empty((n, k), dtype=np.float32)
    index = np.empty((n, k), dtype=np.int64)
    for ids, d2, idx in knn_batches(
        embeddings, k, backend=backend, nprobe=nprobe, ivf_threshold=ivf_threshold, nlist=nlist,
        train_size=train_size, seed=seed, batch_size=batch_size, ivf_search=ivf_search, niter=niter,
        progress=progress,
    ):  # fmt: skip
        dist[ids] = np.sqrt(np.maximum(d2, 0.0))
        index[ids] = idx
    return dist, index
