"""Step time of the default GRPO config: shared-prompt passes on, off, and the code before a given commit.

Runs the README's first command, ``lit-rl fit --config configs/grpo.yaml`` (embedded SmolLM2-135M-Instruct,
2 prompts x 8 completions of at most 12 tokens, full fine-tuning), for ``--steps`` optimizer steps, each run a
fresh process, the variants in turn (A B C A B C ...) so that a change in the machine's load reaches all:

- ``shared prompt``: this checkout as configured (``model.share_prompt`` true, the default);
- ``share_prompt false``: this checkout with every completion's row running its whole prompt, in the rollout's
  prefill and in every later pass;
- ``before (<commit>)`` with ``--before <commit>``: that commit's code and config, checked out in a temporary
  git worktree (e.g. the commit before shared-prompt passes and fused AdamW).

Reported: the median over steps 2.. of each phase's wall time (``time/<phase>_s``, logged by the method), the
median step (sum of the phases), the speed-up, and ``reward/mean`` of every step side by side: the runs are
seeded, so the rewards agree unless floating-point order flips a sample. Times depend on the machine's load
(the load average is printed); the rewards do not.

Run (prints a markdown table; about 6 minutes on 2 quiet CPU cores with these settings)::

    python bench/bench_shared_prompt.py --before b8477ee --out bench/results/shared_prompt.md
    python bench/bench_shared_prompt.py --before 5b5f8c1 --skip-unshared --out bench/results/default_step.md
    python bench/bench_shared_prompt.py --steps 2 --rounds 1    # smoke test
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
from harness import git_commit, read_scalars

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "reference", "policy_forward", "backward", "optimizer")


def run_fit(checkout: Path, variant: list[str], steps: int, config: str, extra: list[str]) -> dict[str, list[float]]:
    """``lit-rl fit`` of ``checkout``'s code and config, in a fresh process; the run's scalars."""
    root = tempfile.mkdtemp(prefix="lit_rl_share_")
    cmd = [
        sys.executable, "-m", "lit_rl", "fit", "--config", config,
        "--trainer.max_steps", str(steps), "--data.val_size", "0", "--trainer.default_root_dir", root,
        *variant, *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{checkout}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(Path(root) / "fit.log", "w") as log:
        done = subprocess.run(cmd, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{shlex.join(cmd)} failed ({done.returncode}); its output is in {root}/fit.log")
    keys = [f"time/{phase}_s" for phase in PHASES] + ["reward/mean"]
    series = read_scalars(str(Path(root) / "lightning_logs" / "version_0"), keys)  # [(step, value)] per key
    return {key: [value for _, value in pairs] for key, pairs in series.items()}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the variants, run in turn")
    parser.add_argument("--config", default="configs/grpo.yaml")
    parser.add_argument(
        "--before", help="also run the code and config of this git commit (e.g. the one before a change)"
    )
    parser.add_argument(
        "--skip-unshared",
        action="store_true",
        help="leave out the share_prompt false variant (with --before: this checkout against that commit only)",
    )
    parser.add_argument("--out", help="also write the markdown here")
    parser.add_argument("extra", nargs="*", help="more lit-rl fit arguments, after --")
    args = parser.parse_args(argv)

    first = f"this checkout ({git_commit()})" if args.skip_unshared else "shared prompt"
    variants = {first: (ROOT, ["--model.share_prompt", "true"])}
    if not args.skip_unshared:
        variants["share_prompt false"] = (ROOT, ["--model.share_prompt", "false"])
    if args.before:  # the code and config of an earlier commit, checked out beside this one
        checkout = Path(tempfile.mkdtemp(prefix="lit_rl_before_")) / "checkout"
        subprocess.run(["git", "worktree", "add", "--detach", str(checkout), args.before], cwd=ROOT, check=True)
        variants[f"before ({git_commit(args.before)})"] = (checkout, [])
    load = [os.getloadavg()[0]]
    runs: dict[str, list[dict[str, list[float]]]] = {name: [] for name in variants}
    try:
        for r in range(args.rounds):
            for name, (checkout, variant) in variants.items():
                print(f"round {r + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
                runs[name].append(run_fit(checkout, variant, args.steps, args.config, args.extra))
    finally:
        if args.before:
            subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT, check=False)
    load.append(os.getloadavg()[0])

    def phase_median(name: str, phase: str) -> float:  # pooled over rounds, steps 2..
        return statistics.median([v for run in runs[name] for v in run[f"time/{phase}_s"][1:]])

    def step_median(name: str) -> float:
        first = 1 if args.steps > 1 else 0
        return statistics.median(
            [sum(run[f"time/{p}_s"][i] for p in PHASES) for run in runs[name] for i in range(first, args.steps)]
        )

    names = list(variants)
    base = names[-1]
    cmd = f"python bench/bench_shared_prompt.py {shlex.join(argv if argv is not None else sys.argv[1:])}".strip()
    lines = harness.header_lines(
        "Shared-prompt passes: step time per phase",
        "python bench/bench_shared_prompt.py --before b8477ee --out bench/results/shared_prompt.md",
        this_file=cmd,
        loads=load,
        dists=("torch", "lightning", "transformers"),
    )
    lines += [
        f"Config `{args.config}`, {args.steps} steps per run, {args.rounds} rounds of ({', '.join(names)}) in turn. "
        f"Median seconds over steps 2-{args.steps} of every round.",
        "",
        "| phase | " + " | ".join(f"{n} (s)" for n in names) + f" | speed-up of {names[0]} over {base} |",
        "| --- |" + " --- |" * (len(names) + 1),
    ]
    for phase in PHASES:
        values = [phase_median(n, phase) for n in names]
        lines.append(f"| {phase} | " + " | ".join(f"{v:.3f}" for v in values) + f" | {values[-1] / values[0]:.2f}x |")
    values = [step_median(n) for n in names]
    lines.append(
        "| **step** (sum of phases) | "
        + " | ".join(f"**{v:.3f}**" for v in values)
        + f" | **{values[-1] / values[0]:.2f}x** |"
    )
    lines += ["", "`reward/mean` per step (round 1; the runs are seeded):", ""]
    lines.append("| step | " + " | ".join(str(i + 1) for i in range(args.steps)) + " |")
    lines.append("| --- |" + " --- |" * args.steps)
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for v in runs[name][0]["reward/mean"]) + " |")
    same = all(run["reward/mean"] == runs[names[0]][0]["reward/mean"] for name in names for run in runs[name])
    lines += ["", f"Rewards identical in every run: {'yes' if same else 'no'}."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
