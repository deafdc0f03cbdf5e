"""GRPO's loss types on the default task: does the reward rise, and the held-out accuracy with it, under each.

Runs ``configs/grpo.yaml`` (the README's first command: SmolLM2-135M-Instruct learning single-digit sums) once per
setting, each in a fresh seeded process with the config's 60 optimizer steps, changing only the options the setting
names. On-policy (one optimizer step per rollout batch) the importance ratio is 1 and GSPO, CISPO and DAPO give the
same gradient, so every setting here takes two optimizer steps per rollout batch (``num_iterations: 2``): the
second step is off-policy, where the loss types differ (GSPO's one clipped ratio per completion, CISPO's capped and
detached token weight, DAPO's clipped token ratio). The 60 optimizer steps are then 30 rollout batches, with a
held-out evaluation before the first and after every 10.

From each run's TensorBoard scalars: the training reward over the first and last 10 rollout batches
(``reward/mean``, a mean over the batch's 16 sampled completions), the greedy held-out accuracy at each evaluation
(``val/correct_answer``, questions never trained on), the last step's KL to the reference and the clip statistics
of the setting's loss. Wall times depend on the machine's load (printed); the seeded numbers do not.

Run from the repository root (writes bench/results/loss_types.md)::

    nice -n 10 python bench/bench_loss_types.py                 # every setting, one run at a time
    nice -n 10 python bench/bench_loss_types.py --settings gspo
    python bench/bench_loss_types.py --reuse                     # the table from runs already in --out
    python bench/bench_loss_types.py --quick --results /tmp/q    # tiny random model, 2 steps: a smoke test
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # the sibling scripts this one reuses

import torch  # noqa: E402
from bench_gumbel_topk_vs_grpo import fit  # noqa: E402
from bench_intuitor import git_commit, mean, shown  # noqa: E402
from plot_run import read_scalar_events  # noqa: E402

# two optimizer steps per rollout batch: the config's 60 optimizer steps are 30 rollout batches, so the held-out
# evaluation runs every 10 batches (20 optimizer steps) to keep the config's four evaluations
OFF_POLICY = ["--model.init_args.num_iterations", "2", "--trainer.val_check_interval", "10"]
SETTINGS: dict[str, list[str]] = {
    "dapo": [*OFF_POLICY],  # the config's own loss: dapo, clip-higher 0.2 / 0.28
    # GSPO's clip range is about a thousand times narrower, as its ratio is a per-token geometric mean
    "gspo": [
        *OFF_POLICY, "--model.init_args.loss_type", "grpo", "--model.init_args.importance_sampling_level", "sequence",
        "--model.init_args.epsilon_low", "3.0e-4", "--model.init_args.epsilon_high", "4.0e-4",
    ],
    "cispo": [*OFF_POLICY, "--model.init_args.loss_type", "cispo", "--model.init_args.epsilon_high", "5.0"],
}  # fmt: skip
QUICK = ["--model.init_args.max_new_tokens", "4", "--data.init_args.val_size", "4", "--trainer.max_steps", "2",
         "--trainer.val_check_interval", "1"]  # fmt: skip
WINDOW = 10
REQUIRED = ("reward/mean", "val/correct_answer")
OPTIONAL = ("kl/mean", "clip_ratio/region_mean", "cispo_clip_ratio")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", metavar="NAME", help=f"run these only, of: {', '.join(SETTINGS)}")
    p.add_argument("--config", help="config (default configs/grpo.yaml; --quick configs/grpo_tiny.yaml)")
    p.add_argument("--out", help="runs folder, a subfolder per setting (default runs/loss_types)")
    p.add_argument("--results", help="folder for loss_types.md (default bench/results)")
    p.add_argument("--reuse", action="store_true", help="read a setting already run in --out instead of rerunning")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads per run (OMP_NUM_THREADS; 1: on shared cores a second thread waits)",
    )
    p.add_argument("--quick", action="store_true", help="tiny random model, 2 steps, temporary folders")
    args = p.parse_args(argv)
    unknown = [s for s in args.settings or [] if s not in SETTINGS]
    if unknown:
        p.error(f"--settings: unknown {', '.join(unknown)}; use some of {', '.join(SETTINGS)}")
    args.settings = args.settings or list(SETTINGS)
    args.config = args.config or ("configs/grpo_tiny.yaml" if args.quick else "configs/grpo.yaml")
    scratch = tempfile.mkdtemp(prefix="lit_rl_loss_types_") if args.quick and not (args.out and args.results) else None
    args.out = Path(args.out or (Path(scratch) / "runs" if scratch else ROOT / "runs" / "loss_types"))
    args.results = Path(args.results or (scratch if scratch else ROOT / "bench" / "results"))
    return args


def summarize(run: Path) -> dict:
    """Per-step and per-evaluation values of one run, ``{key: [(step, value)]}`` summarised for the table."""
    events = read_scalar_events(str(run), list(REQUIRED))
    events.update(read_scalar_events(str(run), list(OPTIONAL), optional=True))
    series = {k: [(e.step, e.value) for e in v] for k, v in events.items()}
    reward = [v for _, v in series["reward/mean"]]
    accuracy = series["val/correct_answer"]
    # the evaluation before training is logged at step 0; one after step k's update at k - 1
    eval_steps = [0] + [s + 1 for s, _ in accuracy[1:]]
    return {
        "steps": len(reward),
        "reward": (mean(reward[:WINDOW]), mean(reward[-WINDOW:])),
        "accuracy": [v for _, v in accuracy],
        "eval_steps": eval_steps,
        **{key: series[key][-1][1] for key in OPTIONAL if series.get(key)},
    }


def markdown(args: argparse.Namespace, argv: list[str], rows: dict[str, tuple[dict, dict]]) -> str:
    steps = sorted({s for _, summary in rows.values() for s in summary["eval_steps"]})
    loads = [x for info, _ in rows.values() for x in (info["load_before"], info["load_after"])]
    lines = [
        "# GRPO loss types on the default task",
        "",
        f"Regenerate: `nice -n 10 python bench/bench_loss_types.py`. This file: "
        f"`{shlex.join(['python', 'bench/bench_loss_types.py', *argv])}` at commit {git_commit()}.  ",
        f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}; {args.threads} CPU thread(s) per run; 1-minute load average "
        f"{min(loads):.1f}-{max(loads):.1f} during the runs. Wall times depend on the machine's load; the seeded "
        "numbers do not.",
        "",
        f"Each run: `python -m lit_rl fit --config {args.config} <overrides>`, the config's own optimizer steps. "
        "Every setting takes two optimizer steps per rollout batch, so that the second is off-policy and the loss "
        "types differ (on-policy their gradients are equal), and evaluates every 10 rollout batches. Reward: "
        f"`reward/mean`, a rollout batch's mean over its sampled completions, first and last {WINDOW} batches. "
        "Held-out: greedy accuracy on the config's held-out questions (never trained on), after the number of "
        "rollout batches in the header. KL and clip share: the last batch's.",
        "",
        f"| setting | overrides | reward first {WINDOW} → last {WINDOW} batches | held-out accuracy (after batches "
        f"{', '.join(map(str, steps))}) | KL (last batch) | clipped share (last batch) | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, (info, s) in rows.items():
        clipped = s.get("clip_ratio/region_mean", s.get("cispo_clip_ratio"))
        cells = [
            name,
            shown(SETTINGS[name]),
            f"{s['reward'][0]:.3f} → {s['reward'][1]:.3f}",
            " → ".join(f"{a:.2f}" for a in s["accuracy"]),
            f"{s['kl/mean']:.4f}" if "kl/mean" in s else "-",
            f"{clipped:.3f}" if clipped is not None else "-",
            f"{info['wall']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    rows = {}
    for name in args.settings:
        extra = [*SETTINGS[name], *(QUICK if args.quick else [])]
        run, info = fit(args.config, args.out / name, extra, reuse=args.reuse)
        rows[name] = (info, summarize(run))
        first, last = rows[name][1]["reward"]
        print(f"{name}: reward {first:.3f} -> {last:.3f}, held-out {rows[name][1]['accuracy']}", file=sys.stderr)
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / "loss_types.md"
    out.write_text(markdown(args, argv, rows))
    print(out.read_text())


if __name__ == "__main__":
    main()
