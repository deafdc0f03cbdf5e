"""Vocabulary and length sweeps: lit-rl's logits-free reference pass + policy update against full logits, with
``lit-rl estimate``'s prediction beside each measured lit-rl peak (parts 3 and 4 of ``bench/run.py``).

Each point runs in a fresh process, ``python bench/bench_policy_update.py --point`` (its part S): one Qwen2-shaped
random model (Qwen2.5-0.5B's hidden size, heads, MLP width and tied embeddings) with LoRA r16 on all linear layers,
one batch of 2 prompts x 4 completions (left-padded prompts), and two phases under one memory measurement: the
no-grad ``reference`` pass (adapters disabled in lit-rl's step; here the same weights under ``no_grad``, which costs
the same) and the ``update`` (forward + GRPO loss + backward, no optimizer step). ``lit-rl logits-free`` runs
``RefCachedGRPO.completion_stats`` (chunked ``lit_rl.ops``) on whole rows, each completion with its prompt
(``share_prompt: false``, so the sweep isolates the logits; the shared-prompt saving is measured by the
``shared_prompt`` study and the TRL part);
``full-logits`` materialises ``[B, C, V]`` float32 logits (TRL-style, with ``logits_to_keep``).

Measured: on CPU, exact bytes held by tensors (``TensorMemoryTracker``, resident weights included); on CUDA,
``torch.cuda.max_memory_allocated`` per phase. Predicted: ``estimate_step`` for ``RefCachedGRPO`` with the same
model config, LoRA, batch, prompt width and completion length, first step (no optimizer state yet, as measured here):
``reference`` against the measured reference phase, ``max(policy_forward, backward)`` against the measured update.
Tensor bytes do not depend on the machine's load; the seconds do.

Run from the repository root (prints the markdown section; ``--plots DIR`` also writes the three PNGs)::

    python bench/sweeps.py --quick                   # tiny sizes: a smoke test
    python bench/sweeps.py --plots bench/results     # CPU: vocabularies 32k-152k, 64-512 completion tokens
    python bench/sweeps.py --gpu --plots bench/results
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import harness
import plots

MIB = 2**20
POINT_MARK = "POINT "  # what bench_policy_update.py --point prints before its JSON
LIT, FULL = "lit-rl logits-free", "full-logits"


@dataclass
class Point:
    """One (vocabulary, completion length) point: measured peaks and seconds per implementation, and the estimate."""

    vocab: int
    length: int
    peaks: dict[str, dict[str, int]]  # implementation -> phase -> bytes
    seconds: dict[str, float]  # implementation -> reference + update seconds
    resident: int  # bytes of the weights
    predicted: dict[str, int]  # phase -> bytes (reference, update)

    def peak(self, impl: str) -> int:
        return max(self.peaks[impl].values())

    def error(self, phase: str) -> float:
        """(predicted - measured lit-rl) / measured, in %."""
        measured = self.peaks[LIT][phase]
        return 100.0 * (self.predicted[phase] - measured) / measured


@dataclass
class SweepConfig:
    """``vocabs`` at ``base_length`` and ``lengths`` at ``base_vocab``; the model's shape is the point script's."""

    vocabs: tuple[int, ...] = (32_000, 64_000, 151_936)
    lengths: tuple[int, ...] = (64, 128, 256, 512)
    base_vocab: int = 32_000
    base_length: int = 128
    quick: bool = False
    gpu: bool = False

    def points(self) -> list[tuple[int, int]]:
        grid = [(v, self.base_length) for v in self.vocabs] + [(self.base_vocab, c) for c in self.lengths]
        return sorted(set(grid))

    def point_args(self) -> list[str]:
        """The point script's shape options besides the vocabulary and the length."""
        args = ["--quick"] if self.quick else []
        if self.gpu:  # Qwen2.5-0.5B's whole depth in bf16
            args += ["--device", "cuda", "--dtype", "bfloat16", "--precision", "bf16-true"]
            args += [] if self.quick else ["--layers", "24"]
        return args


def sweep_config(quick: bool, gpu: bool) -> SweepConfig:
    if quick:
        return SweepConfig(vocabs=(512, 1024, 2048), lengths=(8, 16), base_vocab=512, base_length=16, quick=True,
                           gpu=gpu)  # fmt: skip
    return SweepConfig(lengths=(256, 512, 1024, 2048), gpu=True) if gpu else SweepConfig()


def run_point(cfg: SweepConfig, vocab: int, length: int) -> tuple[Point, dict]:
    """``(the point, what the point script reports of its shape and device)``."""
    cmd = [sys.executable, "bench/bench_policy_update.py", "--point", "--vocabs", str(vocab), "--completion-len",
           str(length), *cfg.point_args()]  # fmt: skip
    try:
        done = harness.run_measured(cmd, POINT_MARK, harness.thread_env(None))
    except harness.ChildFailed as err:
        raise SystemExit(f"error: {' '.join(cmd)} failed (exit {err.code}):\n{err.output[-3000:]}") from None
    r = done.result
    point = Point(vocab, length, r["peaks"], r["seconds"], r["resident"], r["predicted"])
    for impl in (LIT, FULL):
        print(f"  V={vocab:,} C={length} {impl}: peak {mib(point.peak(impl))} MiB, {point.seconds[impl]:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    return point, {"config": r["config"], "device_name": r["device_name"]}


def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:,.1f}"


def table(points: list[Point]) -> list[str]:
    headers = (
        "vocab | completion tokens | lit-rl reference MiB | predicted | error % | lit-rl update MiB | predicted "
        "| error % | full-logits reference MiB | full-logits update MiB | peak ratio lit-rl / full-logits "
        "| lit-rl s | full-logits s"
    ).split(" | ")
    rows = []
    for p in points:
        cells = [f"{p.vocab:,}", p.length]
        for phase in ("reference", "update"):  # lit-rl's, measured and predicted
            cells += [mib(p.peaks[LIT][phase]), mib(p.predicted[phase]), f"{p.error(phase):+.1f}"]
        cells += [mib(p.peaks[FULL]["reference"]), mib(p.peaks[FULL]["update"]), f"{p.peak(LIT) / p.peak(FULL):.3f}"]
        rows.append(cells + [f"{p.seconds[impl]:.1f}" for impl in (LIT, FULL)])
    return harness.markdown_table(headers, rows, ["---:"] * len(headers))


def describe(cfg: SweepConfig, shape: dict) -> str:
    s = shape["config"]
    return (
        f"Qwen2-shaped random model: hidden {s['hidden']}, intermediate {s['intermediate']}, {s['heads']} heads / "
        f"{s['kv_heads']} KV heads, {s['layers']} layers, tied embeddings, {s['dtype']}, LoRA r16 all-linear; "
        f"{s['num_prompts']} prompts x {s['num_generations']} completions, prompt {s['prompt_len']} tokens "
        f"(left-padded); vocabulary sweep {', '.join(f'{v:,}' for v in cfg.vocabs)} at {cfg.base_length} completion "
        f"tokens; length sweep {', '.join(map(str, cfg.lengths))} at vocabulary {cfg.base_vocab:,}; device "
        f"{s['device']}, {s['precision']}."
    )


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test (numbers meaningless)")
    p.add_argument("--gpu", action="store_true", help="Qwen2.5-0.5B's 24 layers in bf16 on CUDA, longer completions")
    p.add_argument("--plots", type=Path, help="folder for the PNG figures (default: none)")
    args = p.parse_args(argv)
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("not run: no CUDA device")
            return "not run: no CUDA device"
    cfg = sweep_config(args.quick, args.gpu)
    runs = [run_point(cfg, v, c) for v, c in cfg.points()]
    points, shape = [pt for pt, _ in runs], runs[0][1]
    title = f"CUDA ({shape['device_name']})" if args.gpu else "CPU"
    files = []
    if args.plots is not None:
        files = plots.all_plots(
            points, cfg.base_vocab, cfg.base_length, args.plots, "gpu" if args.gpu else "cpu", title
        )
    lines = [
        describe(cfg, shape) + (f" GPU: {shape['device_name']}." if args.gpu else ""),
        "",
        *table(points),
        "",
        "MiB: peak bytes held by tensors in the phase, resident weights included (does not depend on the machine's "
        "load). predicted: `estimate_step` (what `lit-rl estimate` runs), first step; error = (predicted - measured) "
        "/ measured. Seconds: reference + update, one run (depend on the machine's load).",
        "",
        *(f"![{f.stem}](results/{f.name})" for f in files),
    ]
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
