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
estimator and the tensor tracker count a packed weight at its dense bytes. Last, a whole decode step's linears with a
weight of its own for every layer, as a rollout reads them from memory, beside one sum over the same bytes.

``--float32``: the same layers in float32, without autocast: ``F.linear`` on the float32 weight (what the exact decode
loop runs) against the layer inside ``float32_weights_packed`` and ``linear_weights_cast_once``, which packs a
float32 copy (``model.rollout_linear: packed``). oneDNN sums in another order there, so ``bitwise`` is ``no`` and the
cell gives both sides' largest error against a float64 ``F.linear`` over the same inputs.

    python bench/bench_packed_linear.py            # writes bench/results/packed_linear.md
    python bench/bench_packed_linear.py --float32  # writes bench/results/packed_linear_float32.md
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

from lit_rl.models import float32_weights_packed, linear_weights_cast_once

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
    p.add_argument("--float32", action="store_true", help="float32 weights, no autocast (rollout_linear: packed)")
    p.add_argument("--out", default=None, help="default: bench/results/packed_linear[_float32].md")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(harness.ROOT / "bench" / "results" / f"packed_linear{'_float32' if args.float32 else ''}.md")
    if args.quick:
        args.repeats, args.out = 5, "-"
    return args


def context(args):
    """What the timed calls run under: bf16 autocast, or (``--float32``) the float32 packing switch."""
    if args.float32:
        return float32_weights_packed()
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)


def agreement(layer, x, packed: torch.Tensor, plain: torch.Tensor, float32: bool) -> str:
    """``yes`` where the two outputs are equal; in float32 also each side's largest error against float64."""
    same = torch.equal(packed, plain)
    if same or not float32:
        return "yes" if same else "no"
    exact = F.linear(x.double(), layer.weight.double())
    errors = [f"{(y.double() - exact).abs().max().item():.1e}" for y in (plain, packed)]
    return f"no: F.linear {errors[0]}, packed {errors[1]}"


def measure(args) -> list[list[str]]:
    rows, generator = [], torch.Generator().manual_seed(0)
    shapes = dict(list(SHAPES.items())[:2]) if args.quick else SHAPES
    dtype = weight_dtype(args)
    for n in args.rows:
        step = {"cast": 0.0, "packed": 0.0}
        for name, (out_features, in_features, uses) in shapes.items():
            layer = torch.nn.Linear(in_features, out_features, bias=False)
            torch.nn.init.normal_(layer.weight, std=in_features**-0.5, generator=generator)
            x = torch.randn(n, 1, in_features, generator=generator).to(dtype)  # [rows, 1 token, in]
            cast = layer.weight.detach().to(dtype)
            with torch.no_grad(), context(args):
                plain = functools.partial(F.linear, x, cast)
                times = {"cast": harness.best_seconds(plain, args.repeats)}
                with linear_weights_cast_once(layer):
                    times["packed"] = harness.best_seconds(functools.partial(layer, x), args.repeats)
                    same = agreement(layer, x, layer(x), plain(), args.float32)
            megabytes = out_features * in_features * dtype.itemsize / 1e6  # the weight, read once per call
            for side in step:
                step[side] += times[side] * uses
            speed = (f"{times['cast'] / times['packed']:.2f}x", *(f"{megabytes / times[s] / 1e3:.1f}" for s in step))
            rows.append([name, f"{out_features}x{in_features}", n, *(f"{times[s] * 1e6:.0f}" for s in step), *speed,
                         same, f"{harness.load_average():.1f}"])  # fmt: skip
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
        if not args.quick:
            rows.append([f"**one decode step** ({LAYERS} layers + head)", "", n,
                         *(f"{step[s] * 1e6:,.0f}" for s in step), f"{step['cast'] / step['packed']:.2f}x",
                         "", "", "", f"{harness.load_average():.1f}"])  # fmt: skip
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def streamed(args, packs: bool) -> list[str]:
    """A whole decode step's linears with a weight of its own for every projection of every layer, as a rollout reads
    them (about 540 MB in float32: more than any cache holds, so each step streams them from memory), ``F.linear``
    against the packed copies, beside one sum over the same bytes (a read at the rate this process can stream)."""
    dtype = weight_dtype(args)
    shapes = list(SHAPES.values())[:2] if args.quick else SHAPES.values()  # quick: one q/o and one k/v weight
    sizes = [(out, inp) for out, inp, uses in shapes for _ in range(1 if args.quick else uses)]
    flat = torch.empty(sum(o * i for o, i in sizes), dtype=dtype)  # every weight a view of one buffer: the sum reads it
    flat.normal_(std=0.03, generator=torch.Generator().manual_seed(1))
    weights, start = [], 0
    for out, inp in sizes:
        weights.append(flat[start : start + out * inp].view(out, inp))
        start += out * inp
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights] if packs else weights
    gigabytes = flat.numel() * dtype.itemsize / 1e9
    rows = []
    for n in args.rows:
        inputs = {inp: torch.randn(n, inp).to(dtype) for _, inp in sizes}  # [rows, in]: one token of each row
        sides = {"F.linear": lambda x=inputs: [F.linear(x[w.shape[1]], w) for w in weights]}
        if packs:
            sides["packed"] = lambda x=inputs: [torch.ops.mkldnn._linear_pointwise(x[i], w, None, "none", [], "")
                                                for (_, i), w in zip(sizes, packed)]  # fmt: skip
        times = {side: harness.best_seconds(fn, 5) for side, fn in sides.items()}
        read = harness.best_seconds(flat.sum, 5)
        rows.append([n, *(f"{times[s] * 1e3:.1f}" for s in sides), *(f"{gigabytes / times[s]:.1f}" for s in sides),
                     f"{gigabytes / read:.1f}", f"{harness.load_average():.1f}"])  # fmt: skip
    header = ["rows", *(f"{s} ms" for s in times), *(f"{s} GB/s" for s in times), "sum GB/s", "load"]
    return [
        "",
        "## A whole decode step, every weight read from memory",
        "",
        f"The same projections with a weight of its own for each of the {LAYERS} layers and the head "
        f"({gigabytes:.2f} GB of {kind(args)} weights), one decode step's linears called in order: milliseconds per "
        "step (the best of 5 steps), the weights' bytes over that time, and one sum over the same bytes (the best of "
        "5), the rate this process streams them at. The table above times one weight called again and again, which "
        "stays in cache; here, as in a rollout, none does. Both depend on the machine and its load.",
        "",
        *harness.markdown_table(header, rows),
    ]


def resident_bytes() -> int:
    """This process's resident set size now (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def packed_bytes(args, packs: bool) -> list[str]:
    """Per larger shape: the resident bytes one packed copy adds, against its dense bytes (``packs``: this CPU
    packs these casts)."""
    if not packs or args.quick:
        return []
    lines, libc = [], ctypes.CDLL(None)  # glibc (Linux, as resident_bytes)
    dtype = weight_dtype(args)
    for name in ("gate, up", "head"):
        out_features, in_features, _ = SHAPES[name]
        cast = torch.randn(out_features, in_features).to(dtype)
        held = max(2, math.ceil(args.megabytes * 1e6 / (cast.numel() * dtype.itemsize)))
        gc.collect()
        libc.malloc_trim(0)  # freed memory back to the OS: the copies cannot land in it unseen
        before = resident_bytes()
        copies = [torch.ops.mkldnn._reorder_linear_weight(cast) for _ in range(held)]
        added = (resident_bytes() - before) / len(copies)
        del copies
        lines.append(f"- {name} ({out_features}x{in_features}): {added / 1e6:.2f} MB resident per packed copy "
                     f"({held} held), {cast.numel() * dtype.itemsize / 1e6:.2f} MB dense {kind(args)}.")  # fmt: skip
    return lines


def weight_dtype(args) -> torch.dtype:
    """The dtype the layers' weights are read in: float32 (``--float32``) or their bf16 casts."""
    return torch.float32 if args.float32 else torch.bfloat16


def kind(args) -> str:
    return "float32" if args.float32 else "bf16"


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    packs = torch.backends.mkldnn.is_available() and (args.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    rows = measure(args)
    held = packed_bytes(args, packs)
    title = "A decode step's linear layers under bf16 autocast: F.linear on the cast vs the packed cast"
    if args.float32:
        title = "A decode step's linear layers in float32: F.linear vs a packed copy (rollout_linear: packed)"
    lines = harness.header_lines(
        title,
        "python bench/bench_packed_linear.py" + (" --float32" if args.float32 else ""),
        this_file=" ".join(["python bench/bench_packed_linear.py", *(argv if argv is not None else sys.argv[1:])]),
        loads=[float(r[-1]) for r in rows],
        threads=torch.get_num_threads(),
        dists=("torch",),
    )
    lines += [
        f"SmolLM2-135M's projections for one decoded token of each row. oneDNN {kind(args)} on this CPU: "
        f"{'yes (the packed side is packed)' if packs else 'no (both sides run F.linear on the cast)'}. "
        f"Microseconds: the best of {args.repeats} calls, and GB/s the {kind(args)} weight's bytes over that time "
        "(both depend on the machine and its load); the decode-step rows weight each projection by its uses per step. "
        "`bitwise`: the packed layer's output equals F.linear's (it does not depend on load)"
        + (", and where not, each side's largest error against a float64 F.linear." if args.float32 else "."),
        "",
        *harness.markdown_table([c.replace("cast", "F.linear") for c in COLUMNS] if args.float32 else COLUMNS, rows),
        *(["", "Resident memory of a packed copy (it does not depend on load):", "", *held] if held else []),
        *streamed(args, packs),
    ]
    return harness.write_results(lines, args.out)


if __name__ == "__main__":
    main()
