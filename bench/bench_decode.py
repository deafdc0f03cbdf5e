"""Rollout decoding: lit-rl's decode loop, eager and compiled, against transformers' ``generate``, on this machine.

All three complete the same rollout of the embedded SmolLM2-135M-Instruct: ``--prompts`` arithmetic prompts (the
default task's chat-formatted prompts) x ``--generations`` completions each, the prompts' KV cache computed once
and repeated (``share_prompt``, as the GRPO rollout does), sampled at temperature 1 with every completion forced
to the full length (``min_new_tokens = max_new_tokens``), so every side produces the same number of tokens. Each
run starts from the same random state; the check column says whether each loop produced ``generate``'s tokens,
greedy (one untimed run per side and length) and sampled (the timed runs).

The sides alternate (``generate``, own, compiled, ``generate``, ...) so that load drift on a shared machine falls
on all; the time is the best of ``--rounds``. Tokens per second = rows x new tokens / seconds (prefill
included). Seconds depend on the machine and its load; the tokens, and whether they are equal, do not.

What differs is the KV cache and the step: ``generate`` grows its cache by concatenation at every token, in every
layer (a copy of the whole cache per token, which grows with the length), the own loop writes into buffers
allocated once (:mod:`lit_rl.models.decode`), the compiled loop runs its one-token step through ``torch.compile``
over a static cache (:mod:`lit_rl.models.compiled_decode`). The compiled side's first rollout of each length
compiles its step: that rollout is untimed in the best-of, its compile seconds are a column of their own, and the
first rollout's seconds (compile included) are beside them, with the number of rollouts after which compiling has
paid for itself against the own loop.

Run (about 40 minutes on 2 CPU cores; 1,024 new tokens take most of it)::

    python bench/bench_decode.py                       # writes bench/results/decode.md
    python bench/bench_decode.py --lengths 16 --rounds 1 --out -   # a quick check, printed
    python bench/bench_decode.py --bf16-mixed --lengths 64 256 1024 --out bench/results/decode_bf16_mixed.md
"""

from __future__ import annotations

import argparse
import sys
import time

import harness
import torch

from lit_rl.data import PromptDataModule
from lit_rl.models import (
    compile_seconds,
    compile_unsupported,
    decode_unsupported,
    load_causal_lm,
    load_tokenizer,
    sample_completions,
)

SIDES = {"generate": False, "own": "own", "compiled": "compiled"}  # side -> sample_completions' own_decode
MIXED_NOTE = [
    "",
    "Under bf16-mixed, `generate` casts every weight at every token (Lightning's autocast keeps no cast cache) and "
    "the own loop casts each `nn.Linear` weight once per rollout (`lit_rl/models/cast_once.py`); the compiled side "
    "is not run (`-`).",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024], help="new tokens per completion")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side per length (best kept)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--bf16-mixed",
        action="store_true",
        help="float32 weights under CPU bf16 autocast with its cast cache off, as Lightning's bf16-mixed runs a "
        "rollout; the compiled side is left out",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=str(harness.ROOT / "bench" / "results" / "decode.md"), help="- prints only")
    return parser.parse_args(argv)


def prompts(tokenizer, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = PromptDataModule(source="arithmetic", difficulty=1, num_prompts=count, val_size=0, batch_size=count)
    data.connect(tokenizer)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    return batch["input_ids"], batch["attention_mask"]


def run(model, tokenizer, ids, mask, args, length: int, side: str, sample: bool = True) -> tuple[float, torch.Tensor]:
    torch.manual_seed(1234)
    settings = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0) if sample else dict(do_sample=False)
    start = time.perf_counter()
    out = sample_completions(
        model, ids, mask, tokenizer.pad_token_id, [tokenizer.eos_token_id], repeats=args.generations,
        share_prompt=True, own_decode=SIDES[side], max_new_tokens=length, min_new_tokens=length, **settings,
    )  # fmt: skip
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer("embedded")
    model = load_causal_lm("embedded", dtype=args.dtype)
    sides = [side for side in SIDES if not (args.bf16_mixed and side == "compiled")]
    reason = decode_unsupported(model) or ("compiled" in sides and compile_unsupported(model)) or None
    if reason is not None:
        raise SystemExit(f"the decode loop or its compiled step is off for the embedded model: {reason}")
    ids, mask = prompts(tokenizer, args.prompts)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=args.bf16_mixed):
        results = measure(model, tokenizer, ids, mask, args, sides)
    return write(args, argv, results)


def measure(model, tokenizer, ids, mask, args, sides: list[str]) -> list[tuple]:
    """Per length: ``(length, best seconds per side, compile s, first compiled s, same tokens per loop, load)``."""
    rows = args.prompts * args.generations
    run(model, tokenizer, ids, mask, args, 4, "generate")  # warm both eager paths (first calls pick kernels)
    run(model, tokenizer, ids, mask, args, 4, "own")
    results = []
    for length in args.lengths:
        # the compiled step's first rollout of this shape compiles it: timed on its own, never in the best-of
        first = compiled_s = float("nan")
        if "compiled" in sides:
            before = set(compile_seconds(model))
            first, _ = run(model, tokenizer, ids, mask, args, length, "compiled")
            compiled_s = sum(s for shape, s in compile_seconds(model).items() if shape not in before)
            print(
                f"{length} new tokens, compiled: first rollout {first:.1f} s, {compiled_s:.1f} s of it compiling",
                flush=True,
            )
        greedy = {side: run(model, tokenizer, ids, mask, args, length, side, sample=False)[1] for side in sides}
        times = {side: [] for side in sides}
        outs = {}
        loads = []
        for _ in range(args.rounds):
            for side in sides:
                loads.append(harness.load_average())
                seconds, outs[side] = run(model, tokenizer, ids, mask, args, length, side)
                times[side].append(seconds)
                print(f"{length} new tokens, {side}: {seconds:.1f} s", flush=True)
        same = {
            side: (torch.equal(greedy[side], greedy["generate"]), torch.equal(outs[side], outs["generate"]))
            for side in sides[1:]
        }
        best = {side: min(t) for side, t in times.items()}
        results.append((length, best, compiled_s, first, same, sum(loads) / len(loads)))
        tokens = rows * length
        print("  tokens/s " + ", ".join(f"{side} {tokens / t:.1f}" for side, t in best.items()) + f"; same: {same}")
    return results


def write(args, argv, results: list[tuple]) -> str:
    rows = args.prompts * args.generations
    precision = "float32 weights under bf16 autocast (bf16-mixed)" if args.bf16_mixed else args.dtype
    argv = argv if argv is not None else sys.argv[1:]
    lines = harness.header_lines(
        "Rollout decoding: lit-rl's decode loop, eager and compiled, vs transformers' generate",
        "python bench/bench_decode.py --bf16-mixed --lengths 64 256 1024 --out bench/results/decode_bf16_mixed.md"
        if args.bf16_mixed
        else "python bench/bench_decode.py",
        this_file=" ".join(["python bench/bench_decode.py", *argv]),
        loads=[r[-1] for r in results],
        threads=torch.get_num_threads(),
        dists=("torch", "transformers"),
    )
    lines += [
        f"Model: embedded SmolLM2-135M-Instruct in {precision}.",
        "",
        f"Rollout: {args.prompts} prompts x {args.generations} completions = {rows} rows, shared-prompt prefill, "
        "temperature 1, every completion forced to the full length; the same random state for every side. "
        f"Best of {args.rounds} alternating runs per side. Seconds and tokens per second depend on the machine's "
        "load (the mean 1-minute load average during the runs is given); the tokens do not.",
        "",
        "The compiled side's first rollout of each length compiles its one-token step (`model.decode: compiled`): "
        "`compile s` is that compilation, `first compiled s` the whole first rollout with it, neither in the "
        "best-of; `break-even` is the number of rollouts after which the compiled loop's saving over the own loop "
        "has paid for the compilation (`never`: no saving). `same tokens` compares each loop's tokens with "
        "`generate`'s, greedy (one untimed run) / sampled (the timed runs); the compiled step's logits are close "
        "to, not bitwise equal to, `generate`'s.",
        *(MIXED_NOTE if args.bf16_mixed else []),
        "",
        "| new tokens | generate s | own loop s | compiled s | compile s | first compiled s "
        "| generate tokens/s | own loop tokens/s | compiled tokens/s | own vs generate | compiled vs generate "
        "| break-even | same tokens: own | same tokens: compiled | load |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for length, best, compile_s, first, same, load in results:
        tokens = rows * length
        g, o, c = best["generate"], best["own"], best.get("compiled")
        checks = ["/".join("yes" if x else "no" for x in same[side]) if side in same else "-" for side in SIDES][1:]
        if c is None:
            compiled = ["-"] * 6
        else:
            saving = o - c
            even = f"{compile_s / saving:.0f} rollouts" if saving > 0 else "never"
            compiled = [f"{c:.1f}", f"{compile_s:.1f}", f"{first:.1f}", f"{tokens / c:.1f}", f"{g / c:.2f}x", even]
        lines.append(
            f"| {length} | {g:.1f} | {o:.1f} | {compiled[0]} | {compiled[1]} | {compiled[2]} | {tokens / g:.1f} | "
            f"{tokens / o:.1f} | {compiled[3]} | {g / o:.2f}x | {compiled[4]} | {compiled[5]} | {checks[0]} | "
            f"{checks[1]} | {load:.1f} |"
        )
    return harness.write_results(lines, args.out)


if __name__ == "__main__":
    main()
