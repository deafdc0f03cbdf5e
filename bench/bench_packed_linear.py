"""A decode step's linear layers on this CPU under bf16 autocast: ``F.linear`` on a bf16 cast against the packed cast.

Each projection of the embedded SmolLM2-135M-Instruct (q and o 576x576, k and v 192x576, gate and up 1536x576, down
576x1536, the head 49152x576) as a float32 ``nn.Linear``, run on ``--rows`` rows of one decoded token under
``torch.autocast("cpu", bfloat16)`` two ways: ``F.linear`` on the weight cast to bf16 once (what lit-rl's decode
loop ran before), and the layer inside ``linear_weights_cast_once``, which on a CPU with oneDNN bf16 packs the cast
into oneDNN's layout once and calls oneDNN's linear on it (lit_rl/models/cast_once.py). Each time is the best of
``--repeats`` calls; ``bitwise`` says whether the two outputs are equal. The last row sums one decode step's
linears (30 layers of seven projections, and the head once). Below the table, the resident memory one packed copy
adds (``/proc/self/statm`` around packed casts of the larger shapes, at least ``--megabytes`` of them, so that
memory the allocator freed before is a small part) beside its dense bf16 bytes: the
estimator and the tensor tracker count a packed weight at its dense bytes.

    python bench/bench_packed_linear.py            # writes bench/results/packed_linear.md
    python bench/bench_packed_linear.py --quick    # two shapes, a few calls, printed
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import math
import os
import sys
from pathlib import Path

import harness
import torch
import torch.nn.functional as F

from lit_rl.models import linear_weights_cast_once

LAYERS = 30  # SmolLM2-135M's decoder layers
SHAPES = {  # name: (out, in, uses per decode step)
    "q, o": (576, 576, 2 * LAYERS),
    "k, v": (192, 576, 2 * LAYERS),
    "gate, up": (1536, 576, 2 * LAYERS),
    "down": (576, 1536, LAYERS),
    "head": (49152, 576, 1),
}
COLUMNS = "projection | out x in | rows | cast µs | packed µs | speed-up | cast GB/s | packed GB/s | bitwise | load"
COLUMNS = COLUMNS.split(" | ")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32], help="completions decoded together")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--megabytes", type=int, default=400, help="packed copies held at once to read resident bytes")
    p.add_argument("--quick", action="store_true", help="q/o and k/v only, 5 calls, printed only")
    p.add_argument("--out", default=str(harness.ROOT / "bench" / "results" / "packed_linear.md"))
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.out = 5, "-"
    return args


def measure(args) -> list[list[str]]:
    rows, generator = [], torch.Generator().manual_seed(0)
    shapes = dict(list(SHAPES.items())[:2]) if args.quick else SHAPES
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16, cache_enabled=False)
    for n in args.rows:
        step = {"cast": 0.0, "packed": 0.0}
        for name, (out_features, in_features, uses) in shapes.items():
            layer = torch.nn.Linear(in_features, out_features, bias=False)
            torch.nn.init.normal_(layer.weight, std=in_features**-0.5, generator=generator)
            x = torch.randn(n, 1, in_features, generator=generator).to(torch.bfloat16)  # [rows, 1 token, in]
            cast = layer.weight.detach().to(torch.bfloat16)
            with torch.no_grad(), autocast():
                plain = functools.partial(F.linear, x, cast)
                times = {"cast": harness.best_seconds(plain, args.repeats)}
                with linear_weights_cast_once(layer):
                    times["packed"] = harness.best_seconds(functools.partial(layer, x), args.repeats)
                    same = torch.equal(layer(x), plain())
            megabytes = out_features * in_features * 2 / 1e6  # the bf16 weight, read once per call
            for side in step:
                step[side] += times[side] * uses
            speed = (f"{times['cast'] / times['packed']:.2f}x", *(f"{megabytes / times[s] / 1e3:.1f}" for s in step))
            rows.append([name, f"{out_features}x{in_features}", n, *(f"{times[s] * 1e6:.0f}" for s in step), *speed,
                         "yes" if same else "no", f"{harness.load_average():.1f}"])  # fmt: skip
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
        if not args.quick:
            rows.append([f"**one decode step** ({LAYERS} layers + head)", "", n,
                         *(f"{step[s] * 1e6:,.0f}" for s in step), f"{step['cast'] / step['packed']:.2f}x",
                         "", "", "", f"{harness.load_average():.1f}"])  # fmt: skip
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def resident_bytes() -> int:
    """This process's resident set size now (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def packed_bytes(args, packs: bool) -> list[str]:
    """Per larger shape: the resident bytes one packed copy adds, against its dense bf16 bytes (``packs``: this CPU
    packs bf16 casts)."""
    if not packs or args.quick:
        return []
    lines, libc = [], ctypes.CDLL(None)  # glibc (Linux, as resident_bytes)
    for name in ("gate, up", "head"):
        out_features, in_features, _ = SHAPES[name]
        cast = torch.randn(out_features, in_features).to(torch.bfloat16)
        held = max(2, math.ceil(args.megabytes * 1e6 / (cast.numel() * 2)))
        gc.collect()
        libc.malloc_trim(0)  # freed memory back to the OS: the copies cannot land in it unseen
        before = resident_bytes()
        copies = [torch.ops.mkldnn._reorder_linear_weight(cast) for _ in range(held)]
        added = (resident_bytes() - before) / len(copies)
        del copies
        lines.append(f"- {name} ({out_features}x{in_features}): {added / 1e6:.2f} MB resident per packed copy "
                     f"({held} held), {cast.numel() * 2 / 1e6:.2f} MB dense bf16.")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    packs = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    rows = measure(args)
    held = packed_bytes(args, packs)
    lines = harness.header_lines(
        "A decode step's linear layers under bf16 autocast: F.linear on the cast vs the packed cast",
        "python bench/bench_packed_linear.py",
        this_file=" ".join(["python bench/bench_packed_linear.py", *(argv if argv is not None else sys.argv[1:])]),
        loads=[float(r[-1]) for r in rows],
        threads=torch.get_num_threads(),
        dists=("torch",),
    )
    lines += [
        f"SmolLM2-135M's projections for one decoded token of each row. oneDNN bf16 on this CPU: "
        f"{'yes (the packed side is packed)' if packs else 'no (both sides run F.linear on the cast)'}. "
        f"Microseconds: the best of {args.repeats} calls, and GB/s the bf16 weight's bytes over that time (both "
        "depend on the machine and its load); the decode-step rows weight each projection by its uses per step. "
        "`bitwise`: the packed layer's output equals F.linear's (it does not depend on load).",
        "",
        *harness.markdown_table(COLUMNS, rows),
        *(["", "Resident memory of a packed copy (it does not depend on load):", "", *held] if held else []),
    ]
    return harness.write_results(lines, args.out)


if __name__ == "__main__":
    main()
