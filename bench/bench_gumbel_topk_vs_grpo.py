"""Differentiable rollouts against policy gradients on one task, in one framework: GumbelTopK beside GRPO on the sentiment task.

Runs ``configs/gumbel_topk.yaml`` (GumbelTopK: the built-in reward model's score backpropagated through
differentiable rollouts) and ``configs/grpo_sentiment.yaml`` (RefCachedGRPO: VADER's score as a reward, no
gradient through it) one after the other, each in a fresh process, for the same number of optimizer steps
with the same 16 completions per step and held-out evaluations at the same steps. Then, from the runs' logs:

- **judges** on held-out openings, greedy completions: ``val/vader_positive`` (VADER, the labeller both rewards
  come from) and ``val/afinn_positive`` (AFINN, a lexicon neither method is trained on), by step and by
  seconds of training;
- **the reward model's score** of the same held-out completions, for both methods alike: each run writes its
  completions to ``heldout/val_step*.jsonl``, and this script scores them with the shipped reward model after
  the run (mean score, and the share it calls positive);
- KL per token to the reference, completion length and distinct bigrams (degeneration) on the training samples;
- **at equal wall time**: each method's held-out scores at its last evaluation within the training seconds
  the faster run took in all (seconds of training = the sum of the logged phase times, evaluation left out);
- **peak memory per phase** from a separate short run of each config with the memory profiler (exact tensor
  accounting slows a CPU step, so the timed runs go without it).

Wall times depend on the machine and its load (the load average is printed); the seeded scores do not.

Run (writes bench/results/gumbel_topk_vs_grpo.md and .png)::

    python bench/bench_gumbel_topk_vs_grpo.py
    python bench/bench_gumbel_topk_vs_grpo.py --quick --results /tmp/q    # smoke test on tiny models
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from pathlib import Path

from harness import git_commit, mean, read_scalar_events, training_seconds
from harness import run_fit as fit
from heldout_examples import examples  # bench/ is on the path when this runs as a script

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"GumbelTopK": "configs/gumbel_topk.yaml", "GRPO": "configs/grpo_sentiment.yaml"}
# per held-out completion in the run's heldout/*.jsonl: the judges, then text statistics
HELD_OUT = (
    "vader_positive",
    "afinn_positive",
    "vader_compound",
    "completions/distinct_bigrams",
    "completions/mean_length",
)
TRAIN = ("kl/mean", "completions/mean_length", "completions/distinct_bigrams", "reward/mean")
# tiny models for --quick: the policy and (GumbelTopK's) reward model random, a few tokens, evaluation every step
QUICK = {
    "GumbelTopK": ["--model.init_args.name_or_path", "tiny:llama", "--model.init_args.reward_model", "tiny:llama"],
    "GRPO": ["--model.init_args.name_or_path", "tiny:llama"],
}
QUICK_ALL = [
    "--model.init_args.max_new_tokens",
    "4",
    "--data.init_args.batch_size",
    "2",
    "--data.init_args.val_size",
    "4",
]


def held_out_scores(run: Path, reward_model: str, head_file: str | None) -> dict[int, dict[str, float]]:
    """``{steps trained: {score: mean}}`` over each evaluation's completions (``heldout/val_step*.jsonl``): the
    judges and text statistics the run wrote, plus ``rm`` (the reward model's mean score) and ``rm_positive``."""
    from lit_rl.models import load_reward_model, load_tokenizer
    from lit_rl.reward_model.train import score_soft_sparse

    tokenizer = load_tokenizer(reward_model)
    model = load_reward_model(reward_model, policy_tokenizer=tokenizer, vocab_size=len(tokenizer), head_file=head_file)
    out = {}
    for path in sorted((run / "heldout").glob("val_step*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        groups = []
        for row in rows:
            prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id]
            groups.append((prompt, [completion]))
        scores = score_soft_sparse(model, groups, pad_id=tokenizer.pad_token_id)  # [N]
        means = {k: mean([row[k] for row in rows]) for k in HELD_OUT}
        means.update(rm=scores.mean().item(), rm_positive=(scores > 0).float().mean().item())
        out[int(path.stem.removeprefix("val_step"))] = means
    return out


def memory_peaks(run: Path, phases: list[str]) -> dict[str, float]:
    """The highest tensor peak (GiB) the memory profiler logged for each phase, over the run's steps."""
    keys = [f"memory/{p}/peak_gib" for p in phases]
    events = read_scalar_events(str(run), keys, optional=True)
    return {k.split("/")[1]: max(e.value for e in v) for k, v in events.items()}


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def phase_names(config: str) -> list[str]:
    from lit_rl.methods import GumbelTopK, RefCachedGRPO

    return list((GumbelTopK if "gumbel" in config else RefCachedGRPO).phase_names)


def collect(
    name: str, config: str, out: Path, steps: int, every: int, memory_steps: int, quick: bool, reuse: bool
) -> dict:
    """Run one method (timed run, then the profiled one) and gather everything the table and plot need."""
    extra = ["--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(every),
             "--trainer.max_time", "null"]  # fmt: skip
    if quick:
        extra += QUICK[name] + QUICK_ALL
    run, info = fit(config, out / name, extra, reuse=reuse)
    train = read_scalar_events(str(run), list(TRAIN), optional=True)
    from lit_rl.reward_model.train import shipped_head_file

    reward_model, head = ("tiny:llama", None) if quick else ("embedded", shipped_head_file())
    held_out = held_out_scores(run, reward_model, head)
    memory = {}
    if memory_steps:
        mem_extra = ["--trainer.max_steps", str(memory_steps), "--data.init_args.val_size", "0",
                     "--trainer.max_time", "null"]  # fmt: skip
        if quick:
            mem_extra += QUICK[name] + QUICK_ALL[:4]
        profiler = ["--config", "callbacks/memory_profiler.yaml"]
        mem_run, _ = fit(config, out / f"{name}-memory", [*profiler, *mem_extra], reuse=reuse)
        memory = memory_peaks(mem_run, phase_names(config))
    return {
        "config": config,
        "held_out": held_out,
        "examples": examples(run, ["vader_compound", "afinn_positive"], 4),
        "train": {k: [(e.step + 1, e.value) for e in v] for k, v in train.items()},  # by steps trained
        "seconds": training_seconds(run),
        "run": info,
        "memory": memory,
    }


def report(results: dict[str, dict], steps: int, every: int, window: int, cmd: str, commit: str) -> str:
    names = list(results)
    columns = ("vader_positive", "afinn_positive", "vader_compound", "rm", "rm_positive",
               "completions/distinct_bigrams", "completions/mean_length")  # fmt: skip
    lines = [
        f"Command: `{cmd}`  ",
        f"Code: lit_rl at {commit or 'unknown'}; machine: {os.cpu_count()} CPU cores, {platform.machine()}, Python "
        f"{platform.python_version()}; {torch_threads()} torch threads. Seconds depend on the machine and its load "
        "(the 1-minute load average before and after each run is in the last table); the scores are seeded and do "
        "not.",
        "",
        f"Both methods: {steps} optimizer steps of 16 completions, greedy completions of the same held-out "
        f"openings evaluated before the first step and every {every} steps. `vader_positive` and `afinn_positive`: "
        "share of completions each lexicon calls positive; `RM score` / `RM positive`: the shipped reward model's "
        "mean score of the same completions and the share above 0 (GumbelTopK optimises this model; GRPO never "
        "sees it). Training seconds: the sum of the logged phase times, evaluation left out.",
        "",
        "## Held-out scores by step",
        "",
        "| method | step | training s | vader_positive | afinn_positive | vader_compound | RM score | RM positive "
        "| distinct bigrams | length |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        r = results[name]
        for step, scores in sorted(r["held_out"].items()):
            seconds = r["seconds"].get(step, float("nan"))
            lines.append(
                f"| {name} | {step} | {seconds:.0f} | " + " | ".join(f"{scores[c]:.3f}" for c in columns) + " |"
            )
    budget = min(max(r["seconds"].values()) for r in results.values())
    lines += [
        "",
        f"## At equal wall time: {budget:.0f} s of training (the shorter run's total)",
        "",
        "| method | last evaluation within the budget (step) | vader_positive | afinn_positive | RM score |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        r = results[name]
        step = max(s for s in r["held_out"] if r["seconds"].get(s, float("inf")) <= budget + 1e-6)
        scores = r["held_out"][step]
        lines.append(f"| {name} | {step} | " + " | ".join(f"{scores[c]:.3f}" for c in columns[:2] + ("rm",)) + " |")
    w = window
    lines += [
        "",
        f"## Training samples (first {w} vs last {w} steps) and cost",
        "",
        "| method | KL per token | completion length | distinct bigrams | training s per step | whole run s "
        "| load before, after | peak GiB per phase (profiled run) |",
        "| --- | --- | --- | --- | ---: | ---: | --- | --- |",
    ]
    for name in names:
        r = results[name]
        cells = []
        for key in TRAIN[:3]:
            vals = [v for _, v in r["train"].get(key, [])]
            cells.append(f"{mean(vals[:w]):.3f} → {mean(vals[-w:]):.3f}" if vals else "n/a")
        per_step = max(r["seconds"].values()) / steps
        memory = ", ".join(f"{p} {g:.2f}" for p, g in r["memory"].items()) or "not measured"
        run = r["run"]
        load = f"{run['load_before']:.1f}, {run['load_after']:.1f}"
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {per_step:.1f} | {run['wall']:.0f} | {load} | {memory} |"
        )
    for name in names:
        lines += ["", f"## {name}: held-out completions before and after", "", results[name]["examples"]]
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("vader_positive", "VADER positive (held-out)", True),
              ("afinn_positive", "AFINN positive (judge, held-out)", True),
              ("rm", "reward-model score (held-out)", True), ("kl/mean", "KL per token (training)", False),
              ("completions/mean_length", "completion length (training)", False),
              ("completions/distinct_bigrams", "distinct bigrams (training)", False)]  # fmt: skip
    fig, axes = plt.subplots(2, len(panels), figsize=(3.2 * len(panels), 5.6), squeeze=False)
    for name, r in results.items():
        for col, (key, title, held_out) in enumerate(panels):
            points = sorted((s, v[key]) for s, v in r["held_out"].items()) if held_out else r["train"].get(key, [])
            if not points:
                continue
            steps, values = zip(*points)
            seconds = [r["seconds"].get(s, float("nan")) for s in steps]
            style = "o-" if held_out else "-"
            axes[0][col].plot(steps, values, style, label=name, markersize=4)
            axes[1][col].plot(seconds, values, style, label=name, markersize=4)
            axes[0][col].set_title(title, fontsize=9)
            axes[0][col].set_xlabel("optimizer step", fontsize=8)
            axes[1][col].set_xlabel("seconds of training", fontsize=8)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of each method")
    parser.add_argument("--eval-every", type=int, default=20, help="held-out evaluation every this many steps")
    parser.add_argument("--memory-steps", type=int, default=2, help="steps of the profiled run (0: none)")
    parser.add_argument("--window", type=int, default=10, help="steps in the first/last training means")
    parser.add_argument("--out", default="runs/gumbel_topk_vs_grpo", help="folder for the runs")
    parser.add_argument("--results", default="bench/results", help="folder for gumbel_topk_vs_grpo.md and .png")
    parser.add_argument("--quick", action="store_true", help="tiny random models, a few tokens: a smoke test")
    parser.add_argument("--reuse", action="store_true", help="read the runs already in --out instead of running them")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.memory_steps, args.window = 2, 1, 1, 1
    commit = git_commit()
    out = Path(args.out)
    results = {
        name: collect(name, config, out, args.steps, args.eval_every, args.memory_steps, args.quick, args.reuse)
        for name, config in METHODS.items()
    }
    cmd = f"python bench/bench_gumbel_topk_vs_grpo.py {shlex.join(argv if argv is not None else sys.argv[1:])}".strip()
    text = report(results, args.steps, args.eval_every, args.window, cmd, commit)
    results_dir = Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "gumbel_topk_vs_grpo.md").write_text(
        "# GumbelTopK vs GRPO on the sentiment task\n\nWritten by `bench/bench_gumbel_topk_vs_grpo.py`.\n\n"
        + text + "\n"
    )  # fmt: skip
    plot(results, results_dir / "gumbel_topk_vs_grpo.png")
    print(text)
    return text


if __name__ == "__main__":
    main()
