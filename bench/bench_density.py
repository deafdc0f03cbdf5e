"""Density stage benchmark: embedding matrix size, kNN + weights time and peak RSS, IVF vs exact.

Measures the density stage at the scale it is built for, each part in a fresh subprocess so that its peak RSS
is its own:

(a) 28k prompts with the default model's hidden states (SmolLM2-135M: hidden 576, 30 layers):
    the matrix size against the naive design's mean-pooled logits, 28k x 50,304 (5.25 GiB); the embedding stage timed
    on a sample with a random-weight model of SmolLM2-135M's shape (``--model shape``, default) or
    on all prompts with the real model (``--model embedded``, needs
    ``lit_rl.models.load_embedded_default``); the density stage (exact kNN + weights) on a
    28k x 576 float32 matrix.
(b) 1M synthetic 576-d embeddings in a float16 memmap on disk: IVF kNN + weights.
(c) IVF vs exact on a 100k subset of (b): recall@k of the neighbour sets, weight errors.

The synthetic embeddings are a mixture of clusters of different sizes and spreads, each a random
16-dimensional linear manifold in 576 dims plus small noise (real sentence embeddings also have
a low intrinsic dimension), with 1% isolated background points, so the density varies.

Run (prints a markdown table; several minutes on 2 cores)::

    python bench/bench_density.py
    python bench/bench_density.py --quick           # smoke test, under a minute
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import numpy as np

# runnable from a checkout without `pip install -e .`

LOGITS_VOCAB = 50_304  # the naive design: each prompt embedded as its mean-pooled logits, GPT-2's padded vocab
SMOLLM2 = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49_152)


def gib(nbytes: float) -> float:
    return nbytes / 2**30


def current_rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def synth_prompts(n: int, seed: int = 0) -> list[str]:
    """Arithmetic-like prompts in the ChatML format of the default model."""
    rng = np.random.default_rng(seed)
    ops = ["+", "-", "*"]
    styles = [
        "What is {a} {op} {b}?",
        "Compute {a} {op} {b}. Answer with a number only.",
        "A store has {a} apples and the price changes by {op} {b}. What is {a} {op} {b}?",
        "Solve: {a} {op} {b} = ?",
    ]
    out = []
    for _ in range(n):
        a, b = rng.integers(0, 1000, size=2)
        text = styles[rng.integers(len(styles))].format(a=a, b=b, op=ops[rng.integers(3)])
        out.append(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    return out


def synth_embeddings(out: np.ndarray, seed: int = 0, clusters: int = 500, latent: int = 16, chunk: int = 65536):
    """Fill ``out`` [N, D] (array or memmap) chunk by chunk with clustered low-rank embeddings."""
    n, d = out.shape
    rng = np.random.default_rng(seed)
    clusters = max(1, min(clusters, n // 20))
    centres = rng.normal(size=(clusters, d)).astype(np.float32)
    bases = rng.normal(size=(clusters, latent, d)).astype(np.float32) / np.sqrt(latent)  # [C, L, D]
    spread = np.exp(rng.uniform(np.log(0.05), np.log(0.8), size=clusters)).astype(np.float32)
    sizes = 1.0 / np.arange(1, clusters + 1) ** 0.8  # a few big clusters, many small ones
    sizes /= sizes.sum()
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        label = rng.choice(clusters, size=m, p=sizes)
        z = rng.normal(size=(m, latent)).astype(np.float32)
        x = rng.normal(scale=0.01, size=(m, d)).astype(np.float32)
        order = np.argsort(label, kind="stable")
        bounds = np.searchsorted(label[order], np.arange(clusters + 1))
        for c in np.flatnonzero(np.diff(bounds)):  # one small matmul per cluster present
            rows = order[bounds[c] : bounds[c + 1]]
            x[rows] += centres[c] + spread[c] * (z[rows] @ bases[c])
        background = rng.random(m) < 0.01  # isolated points
        x[background] = rng.normal(scale=1.5, size=(int(background.sum()), d))
        out[s : s + m] = x
    if isinstance(out, np.memmap):
        out.flush()


# ------------------------------------------------------------------------------------------------
# parts, each run in its own process
# ------------------------------------------------------------------------------------------------


def part_embed(args) -> dict:
    """The embedding stage on a sample of the 28k prompts (or all of them with --model embedded)."""
    import torch

    from lit_rl.data.density import embed_prompts, peak_rss_stage

    torch.set_num_threads(os.cpu_count() or 1)
    prompts = synth_prompts(args.prompts, args.seed)
    if args.model == "embedded":
        from lit_rl.models import load_causal_lm, load_tokenizer

        model, tok = load_causal_lm("embedded"), load_tokenizer("embedded")
        sample = prompts
        label = "SmolLM2-135M-Instruct (embedded default)"
    else:
        from transformers import AutoModelForCausalLM, LlamaConfig

        from lit_rl.models import tiny_tokenizer

        cfg = LlamaConfig(
            vocab_size=SMOLLM2["vocab"], hidden_size=SMOLLM2["hidden"], intermediate_size=SMOLLM2["intermediate"],
            num_hidden_layers=SMOLLM2["layers"], num_attention_heads=SMOLLM2["heads"],
            num_key_value_heads=SMOLLM2["kv_heads"], tie_word_embeddings=True, max_position_embeddings=2048,
        )  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        tok = tiny_tokenizer()  # character-level: ~3x more tokens per prompt than SmolLM2's BPE
        sample = prompts[: args.embed_sample]
        label = "SmolLM2-135M shape, random weights, char tokens"
    tokens = float(np.mean([len(tok(p)["input_ids"]) for p in sample[:256]]))
    rss0 = current_rss_gib()
    with peak_rss_stage() as stage:
        emb = embed_prompts(model, tok, sample, batch_size=args.embed_batch_size, progress=False)
    per_prompt = stage.elapsed_s / len(sample)
    return {
        "label": label,
        "n": len(sample),
        "dim": int(emb.shape[1]),
        "tokens_per_prompt": tokens,
        "time_s": stage.elapsed_s,
        "cpu_s": stage.cpu_s,
        "time_28k_s": per_prompt * args.prompts,
        "rss_before_gib": rss0,
        "peak_rss_gib": stage.peak_rss_gib,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }


def part_small(args) -> dict:
    """Density stage (exact kNN + weights) on a 28k x 576 float32 matrix."""
    from lit_rl.data.density import effective_sample_size, inverse_density_weights, peak_rss_stage

    x = np.empty((args.prompts, args.dim), dtype=np.float32)
    synth_embeddings(x, seed=args.seed)
    rss0 = current_rss_gib()
    with peak_rss_stage() as stage:
        w = inverse_density_weights(x, args.k, backend="auto")
    return {
        "n": args.prompts,
        "matrix_mib": x.nbytes / 2**20,
        "time_s": stage.elapsed_s,
        "cpu_s": stage.cpu_s,
        "rss_before_gib": rss0,
        "peak_rss_gib": stage.peak_rss_gib,
        "ess": effective_sample_size(w),
    }


def part_generate(args) -> dict:
    path = Path(args.workdir) / "large.npy"
    start = time.perf_counter()
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(args.large, args.dim))
    synth_embeddings(mm, seed=args.seed + 1)
    del mm
    return {"path": str(path), "file_mib": path.stat().st_size / 2**20, "time_s": time.perf_counter() - start}


def exact_neighbours(x: np.ndarray, queries: np.ndarray, k: int, chunk: int = 131072) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest others of the rows ``queries`` of ``x`` (a memmap), streaming ``x`` in chunks."""
    import faiss

    q = np.asarray(x[np.sort(queries)], dtype=np.float32)
    queries = np.sort(queries)
    best_d = np.full((len(q), k + 1), np.inf, dtype=np.float32)
    best_i = np.full((len(q), k + 1), -1, dtype=np.int64)
    for s in range(0, x.shape[0], chunk):
        d, i = faiss.knn(q, np.asarray(x[s : s + chunk], dtype=np.float32), k + 1)
        d = np.concatenate([best_d, d], 1)
        i = np.concatenate([best_i, i + s], 1)
        top = np.argsort(d, axis=1, kind="stable")[:, : k + 1]
        best_d, best_i = np.take_along_axis(d, top, 1), np.take_along_axis(i, top, 1)
    keep = best_i != queries[:, None]
    keep[keep.all(1), -1] = False
    return queries, np.sqrt(np.maximum(best_d[keep].reshape(len(q), k), 0)), best_i[keep].reshape(len(q), k)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return sum(np.intersect1d(a, b).size for a, b in zip(found, truth, strict=True)) / truth.size


def part_large(args) -> dict:
    """IVF kNN + weights on the 1M float16 memmap, then a check of a random sample against exact search."""
    from lit_rl.data.density import (
        TRAIN_POINTS_PER_LIST,
        effective_sample_size,
        knn_search,
        peak_rss_stage,
        weights_from_mean_distances,
    )

    x = np.load(Path(args.workdir) / "large.npy", mmap_mode="r")
    # the library's defaults unless given on the command line
    defaults = {name: p.default for name, p in inspect.signature(knn_search).parameters.items()}
    settings = {"nlist": args.nlist, "nprobe": args.nprobe, "train_size": args.train_size, "niter": args.niter}
    settings = {key: defaults[key] if value is None else value for key, value in settings.items()}
    rss0 = current_rss_gib()
    load0 = harness.load_average()
    with peak_rss_stage() as stage:
        # what inverse_density_weights does, keeping the [N, k] neighbours for the check below
        dist, idx = knn_search(x, args.k, backend="ivf", seed=args.seed, progress=True, **settings)
        w = weights_from_mean_distances(dist.astype(np.float64).mean(1), 0.01)
    load1 = harness.load_average()
    sample = np.random.default_rng(args.seed).choice(x.shape[0], size=args.check_sample, replace=False)
    t = time.perf_counter()
    queries, ref_d, ref_i = exact_neighbours(x, sample, args.k)
    check_s = time.perf_counter() - t
    mean_ivf, mean_ref = dist[queries].astype(np.float64).mean(1), ref_d.astype(np.float64).mean(1)
    rel = np.abs(mean_ivf - mean_ref) / mean_ref
    nlist = settings["nlist"] or int(4 * np.sqrt(x.shape[0]))
    return {
        "n": int(x.shape[0]),
        "nlist": nlist,
        "nprobe": settings["nprobe"],
        "train_size": settings["train_size"] or TRAIN_POINTS_PER_LIST * nlist,
        "niter": settings["niter"],
        "time_s": stage.elapsed_s,
        "cpu_s": stage.cpu_s,
        "rss_before_gib": rss0,
        "peak_rss_gib": stage.peak_rss_gib,
        "load": (load0, load1),
        "ess": effective_sample_size(w),
        "w_ratio": float(w.max() / w.min()),
        "check_n": len(queries),
        "check_s": check_s,
        "recall": recall(idx[queries], ref_i),
        "mean_rel_err": float(rel.mean()),
        "max_rel_err": float(rel.max()),
    }


def part_compare(args) -> dict:
    """IVF vs exact on the first ``--subset`` rows of the 1M file, IVF at its default nlist (4 sqrt(N))."""
    from lit_rl.data.density import knn_search, weights_from_mean_distances

    x = np.asarray(np.load(Path(args.workdir) / "large.npy", mmap_mode="r")[: args.subset], dtype=np.float32)
    load0 = harness.load_average()
    t, cpu = time.perf_counter(), time.process_time()
    ref_d, ref_i = knn_search(x, args.k, backend="exact")
    exact_s, exact_cpu = time.perf_counter() - t, time.process_time() - cpu
    ref_w = weights_from_mean_distances(ref_d.astype(np.float64).mean(1), 0.01)
    rows = []
    for search, nprobe in args.compare:
        t, cpu = time.perf_counter(), time.process_time()
        d, i = knn_search(x, args.k, backend="ivf", nprobe=nprobe, ivf_search=search, seed=args.seed)
        elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
        w = weights_from_mean_distances(d.astype(np.float64).mean(1), 0.01)
        rel = np.abs(w - ref_w) / ref_w
        rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731
        rows.append(
            {
                "search": search,
                "nprobe": nprobe,
                "time_s": elapsed,
                "cpu_s": cpu,
                "recall": recall(i, ref_i),
                "mean_rel_err": float(rel.mean()),
                "max_rel_err": float(rel.max()),
                "pearson": float(np.corrcoef(w, ref_w)[0, 1]),
                "spearman": float(np.corrcoef(rank(w), rank(ref_w))[0, 1]),
            }
        )
    return {
        "n": args.subset,
        "nlist": int(4 * np.sqrt(args.subset)),
        "exact_s": exact_s,
        "exact_cpu_s": exact_cpu,
        "rows": rows,
        "load": (load0, harness.load_average()),
    }


PARTS = {"embed": part_embed, "small": part_small, "generate": part_generate, "large": part_large}
PARTS["compare"] = part_compare


def run_part(name: str, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, *argv, "--part", name]
    print(f"[bench] {name} ...", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"[bench] {name}: {result}", file=sys.stderr, flush=True)
    return result


def table(args, res: dict) -> str:
    lines = harness.header_lines(
        "Prompt density: embedding and kNN stages at 28k prompts and 1M embeddings",
        "python bench/bench_density.py --out bench/results/density.md",
        this_file=shlex.join(["python", "bench/bench_density.py", *args.argv]),
        loads=[x for part in res.values() if isinstance(part, dict) for x in part.get("load", ())],
        dists=("torch", "numpy", "faiss-cpu"),
    )
    lines += [
        f"k = {args.k}. CPU time is the process's own, all threads. Peak RSS is the whole process "
        "(interpreter, torch, faiss included) with the kernel high-water mark reset at the start of the stage; "
        "'before' is the RSS when the stage began.",
        "",
        "### (a) 28k prompts: matrix size",
        "",
        "| embeddings | shape | float32 | float16 |",
        "| --- | --- | --- | --- |",
    ]
    n = args.prompts
    for name, dim in [
        ("naive: mean-pooled logits (50,304 vocab)", LOGITS_VOCAB),
        ("`pooling: logits` with SmolLM2 (49,152 vocab)", SMOLLM2["vocab"]),
        ("`pooling: hidden` (default), SmolLM2 hidden", args.dim),
    ]:
        lines.append(f"| {name} | {n:,} x {dim:,} | {gib(n * dim * 4):.3f} GiB | {gib(n * dim * 2):.3f} GiB |")
    lines += [
        "",
        "### (a) 28k prompts: stages",
        "",
        "| stage | N | wall (s) | CPU (s) | peak RSS (GiB) | RSS before (GiB) | notes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    e = res["embed"]
    note = f"{e['params_m']:.0f}M params, {e['tokens_per_prompt']:.0f} tokens/prompt, batch {args.embed_batch_size}"
    if e["n"] < n:
        note += f"; {n:,} prompts would take ~{e['time_28k_s'] / 60:.0f} min at this rate"
    lines.append(
        f"| embed ({e['label']}) | {e['n']:,} | {e['time_s']:.1f} | {e['cpu_s']:.0f} | {e['peak_rss_gib']:.2f} | "
        f"{e['rss_before_gib']:.2f} | {note} |"
    )
    s = res["small"]
    lines.append(
        f"| density: exact kNN + weights, {n:,} x {args.dim} float32 ({s['matrix_mib']:.0f} MiB) | {n:,} | "
        f"{s['time_s']:.1f} | {s['cpu_s']:.0f} | {s['peak_rss_gib']:.2f} | {s['rss_before_gib']:.2f} | ESS {s['ess']:.3f}; "
        f"mean-pooled logits would hold {gib(n * LOGITS_VOCAB * 4):.2f} GiB for the matrix alone |"
    )
    g, big = res["generate"], res["large"]
    lines += [
        "",
        f"### (b) {args.large:,} synthetic {args.dim}-d embeddings (float16 memmap, {g['file_mib']:.0f} MiB on disk)",
        "",
        "| stage | wall (s) | CPU (s) | peak RSS (GiB) | RSS before (GiB) | settings | result |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| IVF kNN + weights | {big['time_s']:.1f} | {big['cpu_s']:.0f} | {big['peak_rss_gib']:.2f} | "
        f"{big['rss_before_gib']:.2f} | "
        f"nlist {big['nlist']}, nprobe {big['nprobe']}, train {big['train_size']:,}, k-means iterations "
        f"{big['niter']}, by_list | "
        f"ESS {big['ess']:.3f}, max/min weight {big['w_ratio']:.0f} |",
        "",
        f"Check against exact search for {big['check_n']:,} random points of the {args.large:,} "
        f"({big['check_s']:.0f} s): recall@k {big['recall']:.4f}; mean kNN distance (the unnormalised weight) "
        f"relative error mean {big['mean_rel_err']:.2e}, max {big['max_rel_err']:.2e}. "
        f"Load average {big['load'][0]:.1f} -> {big['load'][1]:.1f} during the stage.",
    ]
    c = res["compare"]
    lines += [
        "",
        f"### (c) IVF vs exact on a {c['n']:,} subset (nlist {c['nlist']} = 4 sqrt(N), and the other IVF settings the "
        "library's defaults); "
        f"exact search {c['exact_s']:.1f} s wall, {c['exact_cpu_s']:.0f} s CPU",
        "",
        "| IVF search | nprobe | wall (s) | CPU (s) | recall@k | weight mean rel. err | max rel. err | Pearson | Spearman |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in c["rows"]:
        lines.append(
            f"| {r['search']} | {r['nprobe']} | {r['time_s']:.1f} | {r['cpu_s']:.0f} | {r['recall']:.4f} | "
            f"{r['mean_rel_err']:.2e} | "
            f"{r['max_rel_err']:.2e} | {r['pearson']:.5f} | {r['spearman']:.5f} |"
        )
    lines.append(f"\nLoad average {c['load'][0]:.1f} -> {c['load'][1]:.1f} during (c).")
    return "\n".join(lines)


def parse_compare(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        search, nprobe = item.split(":")
        out.append((search, int(nprobe)))
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test of every part")
    p.add_argument("--model", choices=["shape", "embedded"], default="shape", help="embedding model for (a)")
    p.add_argument("--prompts", type=int, default=28_000)
    p.add_argument("--dim", type=int, default=SMOLLM2["hidden"])
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--embed-sample", type=int, default=256, help="prompts embedded with --model shape")
    p.add_argument("--embed-batch-size", type=int, default=16)
    p.add_argument("--large", type=int, default=1_000_000)
    p.add_argument("--nlist", type=int, default=None, help="IVF lists for (b); default 4 sqrt(N)")
    p.add_argument("--nprobe", type=int, default=None, help="IVF lists probed per point in (b); default: the library's")
    p.add_argument("--train-size", type=int, default=None, help="IVF k-means sample in (b); default: the library's")
    p.add_argument("--niter", type=int, default=None, help="IVF k-means iterations in (b); default: the library's")
    p.add_argument("--subset", type=int, default=100_000)
    p.add_argument("--check-sample", type=int, default=2000, help="points of (b) checked against exact search")
    p.add_argument(
        "--compare", type=parse_compare, default=parse_compare("by_list:2,by_list:3,by_list:4,by_list:8,per_query:8,per_query:16"),
        help="IVF settings of (c), as search:nprobe pairs",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="folder for the 1M memmap (default: a temporary folder)")
    p.add_argument("--out", default=None, help="also write the table (with the command) to this markdown file")
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.embed_sample, args.large, args.subset, args.check_sample = 3000, 8, 50_000, 10_000, 200
    if args.part:  # child process: one part, one JSON line
        print(json.dumps(PARTS[args.part](args)))
        return
    args.argv = argv
    with tempfile.TemporaryDirectory(prefix="bench_density_", dir=args.workdir) as tmp:
        child = [a for a in argv if a != "--workdir"]
        if args.workdir is not None:  # drop its value too
            child = [a for i, a in enumerate(argv) if a != "--workdir" and (i == 0 or argv[i - 1] != "--workdir")]
        child += ["--workdir", tmp]
        res = {name: run_part(name, child) for name in ["embed", "small", "generate", "large", "compare"]}
    text = table(args, res)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
