"""Rollout decoding: lit-rl's decode loop against transformers' ``generate``, tokens per second on this machine.

Both complete the same rollout of the embedded SmolLM2-135M-Instruct: ``--prompts`` arithmetic prompts (the
default task's chat-formatted prompts) x ``--generations`` completions each, the prompts' KV cache computed once
and repeated (``share_prompt``, as the GRPO rollout does), sampled at temperature 1 with every completion forced
to the full length (``min_new_tokens = max_new_tokens``), so both sides produce the same number of tokens. Each
run starts from the same random state: the check column says whether the two produced the same tokens.

The two sides alternate (``generate``, own, ``generate``, own, ...) so that load drift on a shared machine falls
on both; the time is the best of ``--rounds``. Tokens per second = rows x new tokens / seconds (prefill
included). Seconds depend on the machine and its load; the tokens, and whether they are equal, do not.

What differs is the KV cache: ``generate`` grows it by concatenation at every token, in every layer (a copy of
the whole cache per token, which grows with the length), the loop writes into buffers allocated once
(:mod:`lit_rl.models.decode`).

Run (about 15 minutes on 2 CPU cores; 1,024 new tokens take most of it)::

    python bench/bench_decode.py                       # writes bench/results/decode.md
    python bench/bench_decode.py --lengths 16 --rounds 1 --out -   # a quick check, printed
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_quantize import versions  # noqa: E402

from lit_rl.data import PromptDataModule  # noqa: E402
from lit_rl.methods.evaluation import sample_completions  # noqa: E402
from lit_rl.models import load_causal_lm, load_tokenizer  # noqa: E402
from lit_rl.models.decode import decode_unsupported  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024], help="new tokens per completion")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side per length (best kept)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode.md"), help="- prints only")
    return parser.parse_args(argv)


def prompts(tokenizer, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = PromptDataModule(source="arithmetic", difficulty=1, num_prompts=count, val_size=0, batch_size=count)
    data.connect(tokenizer)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    return batch["input_ids"], batch["attention_mask"]


def run(model, tokenizer, ids, mask, args, length: int, own: bool) -> tuple[float, torch.Tensor]:
    torch.manual_seed(1234)
    start = time.perf_counter()
    out = sample_completions(
        model, ids, mask, tokenizer.pad_token_id, [tokenizer.eos_token_id], repeats=args.generations,
        share_prompt=True, own_decode=own, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
        max_new_tokens=length, min_new_tokens=length,
    )  # fmt: skip
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer("embedded")
    model = load_causal_lm("embedded", dtype=args.dtype)
    reason = decode_unsupported(model)
    if reason is not None:
        raise SystemExit(f"the decode loop is off for the embedded model: {reason}")
    ids, mask = prompts(tokenizer, args.prompts)
    rows = args.prompts * args.generations
    run(model, tokenizer, ids, mask, args, 4, own=False)  # warm both paths (first calls pick kernels)
    run(model, tokenizer, ids, mask, args, 4, own=True)
    results = []
    for length in args.lengths:
        times = {False: [], True: []}
        outs = {}
        loads = []
        for _ in range(args.rounds):
            for own in (False, True):
                loads.append(os.getloadavg()[0])
                seconds, outs[own] = run(model, tokenizer, ids, mask, args, length, own)
                times[own].append(seconds)
                print(f"{length} new tokens, {'own loop' if own else 'generate'}: {seconds:.1f} s", flush=True)
        same = torch.equal(outs[False], outs[True])
        results.append((length, min(times[False]), min(times[True]), same, sum(loads) / len(loads)))
        tokens = rows * length
        print(f"  {tokens / min(times[False]):.1f} vs {tokens / min(times[True]):.1f} tokens/s, same tokens: {same}")
    lines = [
        "# Rollout decoding: lit-rl's decode loop vs transformers' generate",
        "",
        "Command: `" + " ".join(["python bench/bench_decode.py", *(argv if argv is not None else sys.argv[1:])]) + "`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads; "
        + ", ".join(f"{k} {v}" for k, v in versions(("torch", "transformers")).items())
        + f"; model: embedded SmolLM2-135M-Instruct in {args.dtype}.",
        "",
        f"Rollout: {args.prompts} prompts x {args.generations} completions = {rows} rows, shared-prompt prefill, "
        "temperature 1, every completion forced to the full length; the same random state for both sides. "
        f"Best of {args.rounds} alternating runs per side. Seconds and tokens per second depend on the machine's "
        "load (the mean 1-minute load average during the runs is given); the tokens do not.",
        "",
        "| new tokens | generate s | own loop s | generate tokens/s | own loop tokens/s | speed-up | same tokens | load |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for length, slow, fast, same, load in results:
        tokens = rows * length
        lines.append(
            f"| {length} | {slow:.1f} | {fast:.1f} | {tokens / slow:.1f} | {tokens / fast:.1f} | {slow / fast:.2f}x | "
            f"{'yes' if same else 'no'} | {load:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return text


if __name__ == "__main__":
    main()
