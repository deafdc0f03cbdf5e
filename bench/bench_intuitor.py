"""Intuitor on the embedded model: which settings keep held-out accuracy while self-certainty rises.

Intuitor (Zhao et al., arXiv 2505.19590) rewards the policy's own self-certainty, so nothing in the reward
says the arithmetic answer must be right; ``metric/correct_answer/mean`` (training samples) and
``val/correct_answer`` (greedy completions of the held-out questions) only watch. This sweep runs
``configs/intuitor.yaml`` with one named setting at a time (``lit-rl fit`` overrides on top of ``FIRST``, the
config's setting before the sweep, so that moving the config to the chosen setting changes no row), each in a fresh
process, seeded, for ``--steps`` optimizer steps with a held-out evaluation before the first step and every
``--every`` steps, then reads the run's TensorBoard scalars with ``plot_run.read_scalars``. ``--shipped`` also runs
the config as it is, with its own steps and evaluations.

The held-out evaluation completes with the method's ``max_new_tokens`` (``model.evaluation.max_new_tokens`` is
not set), so a setting that gives more room also gives the evaluation more room: compare each setting's
accuracy with its own start.

Written to ``--results``: ``intuitor_sweep.md`` (a row per setting: held-out accuracy and clipped share at each
evaluation, self-certainty and training accuracy over the first and last 10 steps, the final KL; the command,
commit and machine) and ``intuitor_sweep.png`` (held-out accuracy and clipped share against the step, a line per
setting). Each run's output is in ``--out/<setting>/fit.log``, its metadata in ``run.json`` beside it; checkpoints
(weights and AdamW state) are deleted after reading unless ``--keep-checkpoints``. Each run gets ``--threads`` CPU
threads (1 by default: on cores shared with other jobs a second thread mostly waits at barriers).

Run from the repository root, one run at a time (each 40-step run on the embedded model takes minutes on 2 CPU
cores; wall times depend on the machine's load, the seeded numbers do not)::

    nice -n 10 python bench/bench_intuitor.py                       # every setting
    nice -n 10 python bench/bench_intuitor.py --settings baseline mask_truncated
    nice -n 10 python bench/bench_intuitor.py --reuse               # table and plot from runs already in --out
    nice -n 10 python bench/bench_intuitor.py --reuse --shipped     # ... and the config as it is, in a table of its own
    python bench/bench_intuitor.py --quick                          # tiny random model, 2 steps: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from harness import git_commit, mean, read_scalars, shown

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# configs/intuitor.yaml's setting before this sweep: every setting starts from it (on the embedded config), so the
# sweep reruns the same runs after the config moves to the setting it chose
FIRST = [
    "--model.init_args.max_new_tokens", "12", "--model.init_args.mask_truncated_completions", "false",
    "--model.init_args.learning_rate", "1.0e-5",
]  # fmt: skip
# name -> overrides on top of FIRST; "room32": max_new_tokens 32, where FIRST's 12 cuts most sampled
# completions of the untrained model before they finish
ROOM = ["--model.init_args.max_new_tokens", "32"]
MASK = ["--model.init_args.mask_truncated_completions", "true"]
SETTINGS: dict[str, list[str]] = {
    "baseline": [],
    "mask_truncated": MASK,
    "room32_mask": [*ROOM, *MASK],
    "room32": ROOM,
    # second round: room32_mask held its start, then drifted down from its peak; slow it or anchor it
    "room32_mask_lr3e-6": [*ROOM, *MASK, "--model.init_args.learning_rate", "3.0e-6"],
    "room32_mask_beta0.04": [*ROOM, *MASK, "--model.init_args.beta", "0.04"],
    "room32_mask_temp0.7": [*ROOM, *MASK, "--model.init_args.temperature", "0.7"],
}
QUICK_SETTINGS = ["baseline", "mask_truncated"]
SHIPPED = "shipped"  # --shipped: the config as it is, its own schedule, in --out/shipped
# (key, required): distinct_bigrams is logged only by code that has it; kl/mean only with beta > 0
KEYS = (
    ("val/correct_answer", True),
    ("val/completions/clipped_ratio", True),
    ("val/completions/mean_length", True),
    ("self_certainty/mean", True),
    ("metric/correct_answer/mean", True),
    ("completions/clipped_ratio", True),
    ("kl/mean", False),
    ("val/completions/distinct_bigrams", False),
)
WINDOW = 10  # steps in the first / last window
EARLY, LATE = slice(None, WINDOW), slice(-WINDOW, None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", metavar="NAME", help=f"run these only, of: {', '.join(SETTINGS)}")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 40; --quick 2)")
    p.add_argument("--every", type=int, help="held-out evaluation every this many steps (default 10; --quick 1)")
    p.add_argument("--config", help="base config (default configs/intuitor.yaml; --quick configs/intuitor_tiny.yaml)")
    p.add_argument("--out", help="runs folder, a subfolder per setting (default runs/intuitor_sweep)")
    p.add_argument("--results", help="folder for intuitor_sweep.md and .png (default bench/results)")
    p.add_argument("--reuse", action="store_true", help="read a setting already run in --out instead of rerunning")
    p.add_argument(
        "--shipped", action="store_true", help="also run the config as it is (its own steps and evaluations), last"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads per run (OMP_NUM_THREADS); 1: on shared cores a second thread mostly waits at barriers",
    )
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's .ckpt files")
    p.add_argument("--quick", action="store_true", help="tiny random model, 2 steps, 2 settings, temporary folders")
    args = p.parse_args(argv)
    unknown = [s for s in args.settings or [] if s not in SETTINGS]
    if unknown:
        p.error(f"--settings: unknown {', '.join(unknown)}; use some of {', '.join(SETTINGS)}")
    quick = args.quick
    args.settings = args.settings or (QUICK_SETTINGS if quick else list(SETTINGS))
    args.steps = args.steps or (2 if quick else 40)
    args.every = args.every or (1 if quick else 10)
    args.config = args.config or ("configs/intuitor_tiny.yaml" if quick else "configs/intuitor.yaml")
    scratch = tempfile.mkdtemp(prefix="lit_rl_intuitor_sweep_") if quick and not (args.out and args.results) else None
    args.out = Path(args.out or (Path(scratch) / "runs" if quick else ROOT / "runs" / "intuitor_sweep"))
    args.results = Path(args.results or (Path(scratch) if quick else ROOT / "bench" / "results"))
    if args.steps < 1 or args.every < 1:
        p.error("--steps and --every: must be >= 1")
    return args


def fit_command(args: argparse.Namespace, name: str) -> list[str]:
    """The setting's ``lit-rl fit``; the shipped config keeps its own ``max_steps`` and evaluation interval."""
    if name == SHIPPED:
        return [sys.executable, "-m", "lit_rl", "fit", "--config", args.config,
                "--trainer.default_root_dir", str(args.out / name)]  # fmt: skip
    return [
        sys.executable, "-m", "lit_rl", "fit", "--config", args.config,
        "--trainer.max_steps", str(args.steps), "--trainer.val_check_interval", str(args.every),
        "--trainer.default_root_dir", str(args.out / name), *base(args), *SETTINGS[name],
    ]  # fmt: skip


def base(args: argparse.Namespace) -> list[str]:
    """What every setting starts from: FIRST, or the config as it is with --quick (the tiny config's own lengths)."""
    return [] if args.quick else FIRST


def run_setting(args: argparse.Namespace, name: str) -> dict:
    """One fresh ``lit-rl fit`` of ``name``'s overrides; its metadata, also saved as ``run.json`` beside the logs."""
    folder = args.out / name
    shutil.rmtree(folder, ignore_errors=True)  # a fresh version_0
    folder.mkdir(parents=True)
    cmd = fit_command(args, name)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        # a fixed thread count also fixes the floating-point order, so the seeded numbers repeat
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
    }
    load, start, commit = os.getloadavg()[0], time.perf_counter(), git_commit()
    with open(folder / "fit.log", "w") as log:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"error: {name}: `{shlex.join(cmd)}` failed ({done.returncode}); see {folder / 'fit.log'}")
    if not args.keep_checkpoints:
        for ckpt in folder.rglob("*.ckpt"):
            ckpt.unlink()
    meta = {
        "overrides": SETTINGS.get(name, []),
        "command": shlex.join(["python", *cmd[1:]]),
        "commit": commit,
        "threads": args.threads,
        "wall_s": time.perf_counter() - start,
        "load": [load, os.getloadavg()[0]],
    }
    (folder / "run.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def read_run(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    """The sweep's scalars of one run, ``{key: [(step, value)]}`` (optional keys the run did not log are left out),
    and the config the run saved."""
    run_dir = folder / "lightning_logs" / "version_0"
    series = read_scalars(str(run_dir), [k for k, required in KEYS if required])
    for key, required in KEYS:
        if not required:
            try:
                series.update(read_scalars(str(run_dir), [key]))
            except SystemExit:  # read_scalars' answer for a key the run never logged
                pass
    return series, yaml.safe_load((run_dir / "config.yaml").read_text())


def summarize(series: dict[str, list[tuple[int, float]]], config: dict) -> dict:
    """Held-out values per evaluation, first/last window means, where held-out accuracy first fell below its start."""
    masked = bool(config["model"]["init_args"].get("mask_truncated_completions", False))
    acc = [v for _, v in series["val/correct_answer"]]
    # optimizer steps done at each evaluation: Lightning logs step k's metrics, and the evaluation that follows it,
    # at k - 1; the evaluation before training is logged at 0
    steps = [0] + [s + 1 for s, _ in series["val/correct_answer"][1:]]
    certainty = [v for _, v in series["self_certainty/mean"]]
    train_acc = [v for _, v in series["metric/correct_answer/mean"]]
    below = [i for i, v in enumerate(acc) if v < acc[0] - 1e-9]
    # with mask_truncated_completions a truncated completion's mask is all zero, so its self-certainty (its reward)
    # is 0 and self_certainty/mean averages those zeros in: dividing by the share that finished gives the mean over
    # the completions that finished; steps where every completion was cut have none and are left out
    cut = [v for _, v in series["completions/clipped_ratio"]] if masked else [0.0] * len(certainty)
    scored = [[c / (1 - r) for c, r in zip(certainty[w], cut[w]) if r < 1] for w in (EARLY, LATE)]
    return {
        "masked": masked,
        "held_out": config["data"]["init_args"].get("val_size"),
        "eval_steps": steps,
        "accuracy": acc,
        "clipped": [v for _, v in series["val/completions/clipped_ratio"]],
        "length": [v for _, v in series["val/completions/mean_length"]],
        "bigrams": [v for _, v in series.get("val/completions/distinct_bigrams", [])],
        "certainty": (mean(certainty[EARLY]), mean(certainty[LATE])),
        "scored_certainty": (mean(scored[0]), mean(scored[1])),
        "train_accuracy": (mean(train_acc[EARLY]), mean(train_acc[LATE])),
        "kl": series["kl/mean"][-1][1] if "kl/mean" in series else None,
        "first_drop": steps[below[0]] if below else None,  # first evaluation below the start
        "safe_until": steps[below[0] - 1] if below else steps[-1],  # last evaluation before that one
        "holds": acc[-1] >= acc[0] - 1e-9 and mean(scored[1]) > mean(scored[0]),
    }


def verdict(s: dict) -> str:
    if s["holds"]:
        if s["first_drop"] is None:
            return "holds at every evaluation"
        return f"holds at the end; below the start at step {s['first_drop']}"
    if s["first_drop"] is None:
        return "holds accuracy; certainty does not rise"
    return f"below the start from step {s['first_drop']} (not before step {s['safe_until']})"


def markdown(args: argparse.Namespace, argv: list[str], rows: dict[str, tuple[dict, dict]]) -> str:
    steps = sorted({s for name, (_, summary) in rows.items() if name != SHIPPED for s in summary["eval_steps"]})
    has_bigrams = any(summary["bigrams"] for _, summary in rows.values())
    commits = sorted({meta["commit"] for meta, _ in rows.values()})
    loads = [x for meta, _ in rows.values() for x in meta["load"]]
    held_out = ", ".join(sorted({str(summary["held_out"]) for _, summary in rows.values()}))
    threads = ", ".join(sorted({str(meta["threads"]) for name, (meta, _) in rows.items() if name != SHIPPED}))

    header = [
        "setting", "overrides", f"held-out accuracy (steps {', '.join(map(str, steps))})", "held-out clipped share",
        "held-out mean length", f"self_certainty/mean first {WINDOW} → last {WINDOW}",
        "self-certainty per finished completion (masked runs)",
        f"training accuracy first {WINDOW} → last {WINDOW}", "final KL",
        *(["held-out distinct bigrams"] if has_bigrams else []), "verdict", "wall s",
    ]  # fmt: skip
    lines = [
        "# Intuitor sweep: held-out accuracy while self-certainty rises",
        "",
        f"Regenerate: `nice -n 10 python bench/bench_intuitor.py{' --shipped' * (SHIPPED in rows)}` (every setting, "
        "one run at a time). This file: "
        f"`{shlex.join(['python', 'bench/bench_intuitor.py', *argv])}`, runs at commit {', '.join(commits)} (each "
        "setting's commit and command are in `<out>/<setting>/run.json`).  ",
        f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}; CPU threads per sweep run: {threads}; 1-minute load average "
        f"{min(loads):.1f}-{max(loads):.1f} during the runs. "
        "Wall times depend on the machine's load; the seeded numbers do not.",
        "",
        f"Each run: `python -m lit_rl fit --config {args.config} --trainer.max_steps {args.steps} "
        f"--trainer.val_check_interval {args.every} --trainer.default_root_dir <out>/<setting> "
        f"{' '.join([*base(args), '<overrides>'])}`: every setting starts from "
        f"{shown(base(args)) if base(args) else 'the config as it is'}"
        f"{' (the config before this sweep)' if base(args) else ''} and changes what its overrides say. Held-out: "
        "greedy completions of the config's held-out questions at the method's `max_new_tokens` (so a setting with "
        f"more tokens starts from another accuracy), before the first step and every {args.every} steps. "
        "Self-certainty and training accuracy are per-step means over the sampled completions"
        f" (first and last {WINDOW} steps); the KL is the last step's. With "
        "`mask_truncated_completions` a truncated completion's mask is empty, so its self-certainty, its whole reward, "
        "is 0 (the lowest of its group: masking is also a length penalty here) and `self_certainty/mean` averages "
        "those zeros in; the next column divides them out (`self_certainty/mean / (1 - completions/clipped_ratio)`, "
        "steps where every completion was cut left out). Self-certainty is computed at the sampling temperature, so "
        "rows at another temperature are not comparable with the rest. Verdict: `holds` when the last held-out "
        "accuracy is not below the first while self-certainty (per finished completion where masked) rises, with the "
        "first evaluation below the start if any; otherwise the first evaluation below the start and the last one "
        f"not below it. Held-out questions: {held_out} (one question is 1/{held_out} of the accuracy). `+changes` "
        "after a commit: tracked files differed from it when the run started.",
        "",
    ]
    sweep = {name: row for name, row in rows.items() if name != SHIPPED}
    lines += table(header, sweep, has_bigrams)
    if SHIPPED in rows:
        meta, s = rows[SHIPPED]
        keys = ("accuracy", "clipped", "length", "certainty", "train_accuracy", "kl")
        twins = [name for name, (_, other) in sweep.items() if all(other[k] == s[k] for k in keys)]
        twin = (
            f" Its numbers are those of the `{twins[0]}` row, run with {sweep[twins[0]][0]['threads']} thread(s): "
            "the seeded numbers repeat."
            if twins
            else ""
        )
        lines += [
            "",
            "## The shipped config, as it is",
            "",
            f"`OMP_NUM_THREADS={meta['threads']} {meta['command'].replace(f'{ROOT}{os.sep}', '')}`: held-out "
            "evaluations at steps "
            f"{', '.join(map(str, s['eval_steps']))}.{twin}",
            "",
            *table(
                [*header[:2], f"held-out accuracy (steps {', '.join(map(str, s['eval_steps']))})", *header[3:]],
                {SHIPPED: rows[SHIPPED]},
                has_bigrams,
            ),
        ]
    return "\n".join(lines) + "\n"


def table(header: list[str], rows: dict[str, tuple[dict, dict]], has_bigrams: bool) -> list[str]:
    """Markdown lines of one table: the header, then a row per setting."""

    def seq(values: list[float]) -> str:
        return " → ".join(f"{v:.2f}" for v in values)

    lines = ["| " + " | ".join(header) + " |", "| --- | --- |" + " ---: |" * (len(header) - 4) + " --- | ---: |"]
    for name, (meta, s) in rows.items():
        cells = [
            name,
            shown(meta["overrides"]),
            seq(s["accuracy"]),
            seq(s["clipped"]),
            " → ".join(f"{v:.1f}" for v in s["length"]),
            f"{s['certainty'][0]:.2f} → {s['certainty'][1]:.2f}",
            f"{s['scored_certainty'][0]:.2f} → {s['scored_certainty'][1]:.2f}" if s["masked"] else "—",
            f"{s['train_accuracy'][0]:.3f} → {s['train_accuracy'][1]:.3f}",
            "—" if s["kl"] is None else f"{s['kl']:.4f}",
            *([seq(s["bigrams"]) if s["bigrams"] else "—"] if has_bigrams else []),
            verdict(s),
            f"{meta['wall_s']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(rows: dict[str, tuple[dict, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(7.5, 6.5), sharex=True)
    for i, (name, (_, s)) in enumerate(rows.items()):
        style = dict(marker="o", lw=1.5, color=f"C{i % 10}", ls="-" if i < 10 else "--", label=name)
        if name == SHIPPED:
            style.update(color="black", ls=":", marker="s", mfc="none", ms=10, label=f"{SHIPPED} config, as it is")
        axes[0].plot(s["eval_steps"], s["accuracy"], **style)
        axes[1].plot(s["eval_steps"], s["clipped"], **style)
    axes[0].set_ylabel("held-out accuracy (greedy)")
    axes[1].set_ylabel("held-out clipped share")
    axes[1].set_xlabel("optimizer step")
    for ax in axes:
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2, loc="best")
    axes[0].set_title("Intuitor on the embedded model: bench/bench_intuitor.py")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    print(f"runs in {args.out}, results in {args.results}", file=sys.stderr, flush=True)
    rows: dict[str, tuple[dict, dict]] = {}
    names = [*args.settings, *([SHIPPED] if args.shipped else [])]
    for i, name in enumerate(names):
        saved = args.out / name / "run.json"
        if args.reuse and saved.exists():
            meta = json.loads(saved.read_text())
            print(f"[{i + 1}/{len(names)}] {name}: reusing {args.out / name}", file=sys.stderr, flush=True)
        else:
            print(f"[{i + 1}/{len(names)}] {name}: running, log {args.out / name / 'fit.log'}", file=sys.stderr)
            meta = run_setting(args, name)
            print(f"[{i + 1}/{len(names)}] {name}: done in {meta['wall_s']:.0f} s", file=sys.stderr, flush=True)
        rows[name] = (meta, summarize(*read_run(args.out / name)))
    text = markdown(args, argv, rows)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "intuitor_sweep.md").write_text(text)
    plot(rows, args.results / "intuitor_sweep.png")
    print(text)
    print(f"wrote {args.results / 'intuitor_sweep.md'} and {args.results / 'intuitor_sweep.png'}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
