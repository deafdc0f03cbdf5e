"""Density weights: kNN against a brute-force reference, duplicates, embeddings of a tiny model, the cache."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from lit_rl.data.density import (
    EmbeddingCache,
    StaleEmbeddingCacheError,
    dataset_fingerprint,
    density_weights_for,
    effective_sample_size,
    embed_prompts,
    embed_to_cache,
    inverse_density_weights,
    knn_search,
    peak_rss_stage,
)
from lit_rl.models.tiny import tiny_model, tiny_tokenizer

PROMPTS = [f"What is {a} + {b}?" for a in range(7) for b in range(3)] + ["Compute 12 * 7.", "hi", "x" * 40]


def reference_weights(x: np.ndarray, k: int) -> np.ndarray:
    """Brute force in float64: mean Euclidean distance to the k nearest other points, normalised."""
    x = np.asarray(x, dtype=np.float64)
    d = np.sqrt(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))  # [N, N]
    np.fill_diagonal(d, np.inf)
    mean = np.sort(d, axis=1)[:, :k].mean(1)
    return mean / mean.sum()


def clustered(n: int, dim: int, seed: int = 0, clusters: int = 8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=5.0, size=(clusters, dim))
    scales = rng.uniform(0.2, 2.0, size=clusters)  # clusters of different density
    label = rng.integers(clusters, size=n)
    return (centres[label] + rng.normal(size=(n, dim)) * scales[label, None]).astype(np.float32)


@pytest.mark.parametrize("backend", ["exact", "numpy"])
@pytest.mark.parametrize("k", [1, 5])
def test_weights_match_bruteforce_reference(backend, k):
    x = clustered(300, 12, seed=k)
    w = inverse_density_weights(x, k, backend=backend, batch_size=64)  # several search batches
    assert w.dtype == np.float64 and w.shape == (300,)
    np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-12)
    np.testing.assert_allclose(w, reference_weights(x, k), rtol=1e-4)


def test_knn_search_excludes_self_and_sorts():
    x = clustered(200, 6)
    dist, idx = knn_search(x, 4, backend="exact", batch_size=50)
    assert dist.shape == idx.shape == (200, 4)
    assert not (idx == np.arange(200)[:, None]).any()
    assert (np.diff(dist, axis=1) >= -1e-6).all()
    ref_d, ref_i = knn_search(x, 4, backend="numpy")
    np.testing.assert_allclose(dist, ref_d, rtol=1e-4, atol=1e-5)
    assert (idx == ref_i).mean() > 0.99  # ties aside


@pytest.mark.parametrize("ivf_search", ["by_list", "per_query"])
def test_ivf_agrees_with_exact(ivf_search):
    x = clustered(5000, 16, clusters=20)
    exact = inverse_density_weights(x, 10, backend="exact")
    kw = dict(backend="ivf", nlist=40, nprobe=4, ivf_search=ivf_search)
    ivf = inverse_density_weights(x, 10, **kw)
    assert np.corrcoef(exact, ivf)[0, 1] > 0.95
    np.testing.assert_allclose(ivf.sum(), 1.0)
    # deterministic for a seed: the training sample and k-means are seeded
    np.testing.assert_array_equal(ivf, inverse_density_weights(x, 10, **kw))


@pytest.mark.parametrize("ivf_search", ["by_list", "per_query"])
def test_ivf_probing_every_list_is_exact(ivf_search):
    x = clustered(1000, 8)
    dist, idx = knn_search(x, 5, backend="ivf", nlist=10, nprobe=10, ivf_search=ivf_search, batch_size=128)
    ref_d, ref_i = knn_search(x, 5, backend="numpy")
    np.testing.assert_allclose(dist, ref_d, rtol=1e-4, atol=1e-4)
    assert (idx == ref_i).mean() > 0.99


def test_ivf_by_list_searches_a_superset_of_per_query():
    x = clustered(3000, 16, clusters=30)
    kw = dict(backend="ivf", nlist=30, nprobe=2, batch_size=500)
    by_list, _ = knn_search(x, 10, ivf_search="by_list", **kw)
    per_query, _ = knn_search(x, 10, ivf_search="per_query", **kw)
    # the same quantizer; by_list's candidates include per_query's, so no neighbour is farther
    assert (by_list <= per_query + 1e-4).all()


def low_rank_clusters(n: int, dim: int = 48, latent: int = 6, clusters: int = 12, seed: int = 0) -> np.ndarray:
    """Clusters on random low-dimensional linear manifolds, like the bench's synthetic embeddings."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    bases = rng.normal(size=(clusters, latent, dim)) / np.sqrt(latent)
    spread = rng.uniform(0.1, 0.8, size=clusters)
    label = rng.integers(clusters, size=n)
    z = rng.normal(size=(n, latent))
    x = centres[label] + spread[label, None] * np.einsum("nl,nld->nd", z, bases[label])
    return (x + rng.normal(scale=0.01, size=(n, dim))).astype(np.float32)


@pytest.mark.slow  # an exact k-NN search over enough points for the defaults to matter
def test_ivf_defaults_keep_recall_against_exact():
    # the defaults (nprobe 3, 20 training points per list, 5 k-means iterations, by_list) on
    # clustered data, checked against float64 brute force: recall@10 and the weights
    x = low_rank_clusters(4000)
    nlist = 64  # ~60 points per list, as 4 sqrt(N) gives at this N (the 1M bench: 250)
    dist, idx = knn_search(x, 10, backend="ivf", nlist=nlist)
    ref_d, ref_i = knn_search(x, 10, backend="numpy")
    recall = np.mean([np.intersect1d(a, b).size / 10 for a, b in zip(idx, ref_i, strict=True)])
    assert recall >= 0.95, recall
    w = inverse_density_weights(x, 10, backend="ivf", nlist=nlist)
    np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-12)
    ref_w = reference_weights(x, 10)
    assert np.corrcoef(w, ref_w)[0, 1] > 0.99
    assert np.median(np.abs(w - ref_w) / ref_w) < 1e-3
    # one probed list per point and a single k-means iteration on the minimum sample: the same
    # check must be able to fail, or it would say nothing about the defaults
    _, poor = knn_search(x, 10, backend="ivf", nlist=nlist, nprobe=1, train_size=nlist, niter=1)
    poor_recall = np.mean([np.intersect1d(a, b).size / 10 for a, b in zip(poor, ref_i, strict=True)])
    assert poor_recall < recall


def test_ivf_by_list_distances_are_exact_for_the_neighbours_found():
    # found neighbours are re-measured as sums of squared differences, not |q|^2 + |c|^2 - 2 q.c,
    # so points far from the origin with close neighbours keep their small distances
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(2000, 32)) * 1e-3 + 100.0).astype(np.float32)
    dist, idx = knn_search(x, 5, backend="ivf", nlist=20, nprobe=2)
    x64 = x.astype(np.float64)
    true = np.sqrt(((x64[:, None, :] - x64[idx]) ** 2).sum(-1))  # [N, k]
    np.testing.assert_allclose(dist, true, rtol=1e-4)
    assert (np.diff(dist, axis=1) >= 0).all()


def test_ivf_by_list_float16_memmap(tmp_path):
    # the on-disk form lit-rl embed writes: float16, read in batches, equal to the float32 array's result
    x = low_rank_clusters(3000).astype(np.float16)
    mm = np.lib.format.open_memmap(tmp_path / "e.npy", mode="w+", dtype=np.float16, shape=x.shape)
    mm[:] = x
    mm.flush()
    kw = dict(backend="ivf", nlist=40, batch_size=700)
    from_disk = inverse_density_weights(np.load(tmp_path / "e.npy", mmap_mode="r"), 10, **kw)
    in_memory = inverse_density_weights(x.astype(np.float32), 10, **kw)
    np.testing.assert_allclose(from_disk, in_memory, rtol=1e-5)


def test_ivf_by_list_widens_small_lists():
    x = clustered(400, 8)
    dist, idx = knn_search(x, 60, backend="ivf", nlist=10, nprobe=1)  # lists of ~40 < k + 1
    assert (idx >= 0).all() and not (idx == np.arange(400)[:, None]).any()
    assert all(len(set(row)) == 60 for row in idx)


def test_auto_switches_to_ivf_at_threshold():
    x = clustered(2000, 8)
    auto = inverse_density_weights(x, 5, backend="auto", ivf_threshold=1000, nlist=20, nprobe=2)
    ivf = inverse_density_weights(x, 5, backend="ivf", nlist=20, nprobe=2)
    np.testing.assert_array_equal(auto, ivf)
    np.testing.assert_array_equal(
        inverse_density_weights(x, 5, backend="auto"), inverse_density_weights(x, 5, backend="exact")
    )


def test_dense_cluster_weighs_less_than_isolated_points():
    rng = np.random.default_rng(0)
    dense = rng.normal(scale=0.01, size=(200, 8))
    isolated = rng.normal(scale=10.0, size=(10, 8)) + 30.0
    x = np.concatenate([dense, isolated]).astype(np.float32)
    w = inverse_density_weights(x, 5, backend="exact")
    assert w[200:].min() > 10 * w[:200].max()


@pytest.mark.parametrize("backend", ["exact", "numpy", "ivf"])
def test_duplicates_get_a_small_positive_weight(backend):
    rng = np.random.default_rng(1)
    x = np.concatenate([np.repeat(rng.normal(size=(1, 8)), 30, axis=0), rng.normal(size=(70, 8))])
    x = x.astype(np.float32)
    w = inverse_density_weights(x, 5, backend=backend, nlist=2, nprobe=1)
    assert np.isfinite(w).all() and (w > 0).all()
    np.testing.assert_allclose(w.sum(), 1.0)
    # 30 copies with k=5: all their neighbours are copies, so they sit at the floor, below everyone
    assert np.ptp(w[:30]) < 1e-12
    assert w[:30].max() < w[30:].min()


def test_all_identical_points_give_uniform_weights():
    w = inverse_density_weights(np.ones((10, 4), dtype=np.float32), 3, backend="exact")
    np.testing.assert_allclose(w, np.full(10, 0.1))


@pytest.mark.parametrize("backend", ["exact", "numpy"])
def test_k_too_large_names_k_and_n(backend):
    with pytest.raises(ValueError, match=r"k=5.*N=5"):
        inverse_density_weights(np.zeros((5, 3), dtype=np.float32), 5, backend=backend)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        inverse_density_weights(np.zeros((5, 3), dtype=np.float32), 2, backend="annoy")


def test_float16_and_memmap_input(tmp_path):
    x = clustered(400, 16).astype(np.float16)
    mm = np.lib.format.open_memmap(tmp_path / "e.npy", mode="w+", dtype=np.float16, shape=x.shape)
    mm[:] = x
    mm.flush()
    ref = reference_weights(x.astype(np.float32), 5)
    np.testing.assert_allclose(inverse_density_weights(x, 5, backend="exact"), ref, rtol=1e-4)
    ro = np.load(tmp_path / "e.npy", mmap_mode="r")
    np.testing.assert_allclose(inverse_density_weights(ro, 5, backend="exact", batch_size=100), ref, rtol=1e-4)


def test_effective_sample_size():
    assert effective_sample_size(np.full(8, 0.125)) == pytest.approx(1.0)
    assert effective_sample_size(np.eye(1, 8)[0]) == pytest.approx(1 / 8)


# ---------------------------------------------------------------------------------------------
# embeddings
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_embed_shapes_and_padding_invariance(arch):
    model, tok = tiny_model(arch), tiny_tokenizer()
    texts = ["hi", "a much longer prompt than the first one", "2 + 2 = ?"]
    emb = embed_prompts(model, tok, texts, batch_size=3, progress=False)
    assert emb.shape == (3, 32) and emb.dtype == np.float32
    # the same prompt, alone (no padding) and in a batch where it is left-padded by ~37 tokens
    alone = embed_prompts(model, tok, ["hi"], progress=False)
    np.testing.assert_allclose(emb[0], alone[0], atol=1e-5)
    assert model.training  # restored


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_logits_pooling_is_mean_of_logits(arch):
    model, tok = tiny_model(arch).eval(), tiny_tokenizer()
    emb = embed_prompts(model, tok, ["hello there", "2+2"], pooling="logits", progress=False)
    assert emb.shape == (2, 128)  # D = vocab
    with torch.no_grad():
        full = model(**tok(["hello there"], return_tensors="pt")).logits.mean(1)[0]  # [V]
    np.testing.assert_allclose(emb[0], full.numpy(), atol=1e-5)


def test_embed_to_memmap_float16_and_missing_pad_token(tmp_path):
    model, tok = tiny_model(), tiny_tokenizer(pad_token=False)
    out = embed_prompts(model, tok, PROMPTS, batch_size=4, dtype="float16", out_path=tmp_path / "e.npy", progress=False)
    assert isinstance(out, np.memmap) and out.dtype == np.float16 and out.shape == (len(PROMPTS), 32)
    np.testing.assert_array_equal(np.load(tmp_path / "e.npy"), out)
    assert tok.pad_token is None  # the caller's tokenizer is left as it was
    ref = embed_prompts(model, tiny_tokenizer(pad_token=False), PROMPTS, batch_size=len(PROMPTS), progress=False)
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3)


def test_embed_rejects_unknown_pooling():
    with pytest.raises(ValueError, match="pooling"):
        embed_prompts(tiny_model(), tiny_tokenizer(), ["a"], pooling="cls", progress=False)


# ---------------------------------------------------------------------------------------------
# cache
# ---------------------------------------------------------------------------------------------


def count_forwards(model: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    model.model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_density_weights_for_reuses_cache(tmp_path):
    model, tok = tiny_model(), tiny_tokenizer()
    calls = count_forwards(model)
    kw = dict(model=model, tokenizer=tok, k=3, cache_dir=tmp_path, model_id="tiny", batch_size=8, progress=False)
    w1, stats = density_weights_for(PROMPTS, **kw)
    assert len(calls) == 3  # 24 prompts / 8
    assert set(stats) >= {
        "density/ess", "density/embed_time_s", "density/embed_peak_rss_gib", "density/knn_time_s",
        "density/knn_peak_rss_gib", "density/num_prompts", "density/dim",
    }  # fmt: skip
    assert stats["density/num_prompts"] == len(PROMPTS) and stats["density/dim"] == 32
    assert stats["density/cache_hit"] == 0.0 and 0 < stats["density/ess"] <= 1
    meta = EmbeddingCache(tmp_path).metadata()
    assert meta["model"] == "tiny" and meta["count"] == len(PROMPTS) and meta["dim"] == 32
    assert meta["dataset_fingerprint"] == dataset_fingerprint(PROMPTS) and "created" in meta

    w2, stats2 = density_weights_for(PROMPTS, **kw)
    assert len(calls) == 3  # nothing recomputed
    assert stats2["density/cache_hit"] == 1.0
    np.testing.assert_array_equal(w1, w2)
    np.testing.assert_allclose(w1, reference_weights(np.load(tmp_path / "embeddings.npy"), 3), rtol=1e-4)


def test_stale_cache_is_refused_with_the_fix(tmp_path):
    model, tok = tiny_model(), tiny_tokenizer()
    kw = dict(model=model, tokenizer=tok, k=3, cache_dir=tmp_path, model_id="tiny", progress=False)
    density_weights_for(PROMPTS, **kw)
    with pytest.raises(StaleEmbeddingCacheError) as err:
        density_weights_for(PROMPTS[:-1], **kw)
    msg = str(err.value)
    assert "dataset_fingerprint" in msg and "count: cached 24 != expected 23" in msg
    assert "lit-rl embed --config" in msg and str(tmp_path / "embeddings.npy") in msg
    assert isinstance(err.value, ValueError)
    with pytest.raises(StaleEmbeddingCacheError, match="pooling: cached 'hidden' != expected 'logits'"):
        density_weights_for(PROMPTS, **{**kw, "pooling": "logits"})
    with pytest.raises(StaleEmbeddingCacheError, match="model: cached 'tiny' != expected 'other'"):
        density_weights_for(PROMPTS, **{**kw, "model_id": "other"})
    # `lit-rl embed` rebuilds it
    emb, reused = embed_to_cache(PROMPTS[:-1], model=model, tokenizer=tok, cache_dir=tmp_path, model_id="tiny",
                                 progress=False, overwrite=True)  # fmt: skip
    assert not reused and emb.shape == (23, 32)
    density_weights_for(PROMPTS[:-1], **kw)


def test_cache_without_metadata_is_stale(tmp_path):
    np.save(tmp_path / "embeddings.npy", np.zeros((3, 2), dtype=np.float32))
    with pytest.raises(StaleEmbeddingCacheError, match="metadata file .* is missing"):
        EmbeddingCache(tmp_path).load({"count": 3})
    assert EmbeddingCache(tmp_path / "empty").load({"count": 3}) is None


def test_dataset_fingerprint_is_order_and_boundary_sensitive():
    assert dataset_fingerprint(["ab", "c"]) != dataset_fingerprint(["a", "bc"])
    assert dataset_fingerprint(["a", "b"]) != dataset_fingerprint(["b", "a"])
    assert dataset_fingerprint(iter(["a", "b"])) == dataset_fingerprint(["a", "b"])


def test_peak_rss_stage_sees_a_large_allocation():
    with peak_rss_stage() as small:
        pass
    with peak_rss_stage() as big:
        # 64 MiB of fresh anonymous pages, touched: np.ones could be served from freed pages malloc still holds
        # resident (after other tests in the same process), which raise no peak
        block = mmap.mmap(-1, 64 * 2**20)
        view = np.frombuffer(block, dtype=np.uint8)
        view[:] = 1
        del view
        block.close()
    assert big.elapsed_s > 0 and big.peak_rss_gib > 0  # 0.0 is the unset default
    if big.per_stage:
        assert big.peak_rss_gib - small.peak_rss_gib > 0.05
