"""A decode step's attention on this CPU: transformers' sdpa call for grouped heads against the packed one.

One decode step's attention in one layer of the embedded SmolLM2-135M-Instruct (9 query heads over 3 key-value
heads of 64 values, scale 1/8), for ``--rows`` completions over ``--keys`` cached positions, no mask (prompts without
padding): transformers' ``sdpa_attention_forward`` (``enable_gqa`` for a one-token query) and lit-rl's
``packed_sdpa_forward``, what lit-rl's decoding runs (each key-value head's query heads as a query of that many
tokens in bfloat16; in float32 transformers' call itself: lit_rl/models/decode_attention.py). Each time is the best
of ``--repeats`` calls; the error is the largest absolute difference from the same attention in float64, and
``bitwise`` says whether the two calls gave the same output.

    python bench/bench_decode_attention.py            # writes bench/results/decode_attention.md
    python bench/bench_decode_attention.py --quick    # small shapes, a few calls, printed
"""

from __future__ import annotations

import argparse
import functools
import sys

import harness
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lit_rl.models import packed_sdpa_forward

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's attention
SIDES = {"transformers sdpa (enable_gqa)": sdpa_attention_forward, "packed": packed_sdpa_forward}
COLUMNS = "dtype | keys | sdpa µs | packed µs | speed-up | sdpa error | packed error | bitwise equal | load".split(
    " | "
)


class _Heads(torch.nn.Module):
    num_key_value_groups, is_causal = HEADS // KV_HEADS, True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, nargs="+", default=[64, 256, 1024], help="cached positions attended over")
    p.add_argument("--rows", type=int, default=8, help="completions decoded together (2 prompts x 4 in the configs)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="keys 8 and 40, 5 calls, printed only")
    p.add_argument("--out", default=str(harness.ROOT / "bench" / "results" / "decode_attention.md"))
    args = p.parse_args(argv)
    if args.quick:
        args.keys, args.repeats, args.out = [8, 40], 5, "-"
    return args


def measure(args) -> list[list[str]]:
    rows, module, generator = [], _Heads(), torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for keys in args.keys:
            query = torch.randn(args.rows, HEADS, 1, DIM, generator=generator)
            key, value = (torch.randn(args.rows, KV_HEADS, keys, DIM, generator=generator) for _ in range(2))
            reference = torch.nn.functional.scaled_dot_product_attention(
                query.double(), *(t.double().repeat_interleave(HEADS // KV_HEADS, 1) for t in (key, value)), scale=0.125
            ).transpose(1, 2)
            inputs = [t.to(dtype) for t in (query, key, value)]
            outs, times = {}, {}
            for name, fn in SIDES.items():
                call = functools.partial(fn, module, *inputs, None, scaling=0.125)  # no mask
                with torch.no_grad():
                    times[name] = harness.best_seconds(call, args.repeats)
                    outs[name] = call()[0]
            (sdpa, packed) = SIDES
            errors = [f"{(outs[n].double() - reference).abs().max().item():.1e}" for n in SIDES]
            rows.append([str(dtype).removeprefix("torch."), keys, f"{times[sdpa] * 1e6:.0f}",
                         f"{times[packed] * 1e6:.0f}", f"{times[sdpa] / times[packed]:.2f}x", *errors,
                         "yes" if torch.equal(outs[sdpa], outs[packed]) else "no",
                         f"{harness.load_average():.1f}"])  # fmt: skip
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    rows = measure(args)
    lines = harness.header_lines(
        "A decode step's attention: transformers' sdpa for grouped heads vs the packed call",
        "python bench/bench_decode_attention.py",
        this_file=" ".join(["python bench/bench_decode_attention.py", *(argv if argv is not None else sys.argv[1:])]),
        loads=[float(r[-1]) for r in rows],
        threads=torch.get_num_threads(),
        dists=("torch", "transformers"),
    )
    lines += [
        f"One layer's attention for one decode step: {args.rows} rows, {HEADS} query heads over {KV_HEADS} key-value "
        f"heads of {DIM} values (SmolLM2-135M), no mask. Microseconds: the best of {args.repeats} calls (they depend "
        "on the machine and its load); errors: the largest absolute difference from float64 (they do not).",
        "",
        *harness.markdown_table(COLUMNS, rows),
    ]
    return harness.write_results(lines, args.out)


if __name__ == "__main__":
    main()
