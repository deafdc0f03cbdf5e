"""Step time of the default GRPO config with and without shared-prompt passes, and the rewards they reach.

Runs the README's first command, ``lit-rl fit --config configs/grpo.yaml`` (embedded SmolLM2-135M-Instruct,
2 prompts x 8 completions of at most 12 tokens, full fine-tuning), for ``--steps`` optimizer steps with
``model.share_prompt`` true and false, each run a fresh process, in turn (A B A B ...) so that a change in the
machine's load reaches both. ``share_prompt: false`` is the path every step took before shared-prompt passes
existed: each completion's row runs its whole prompt, in the rollout's prefill and in every later pass.

Reported: the median over steps 2.. of each phase's wall time (``time/<phase>_s``, logged by the method), the
median step (sum of the phases), the speed-up, and ``reward/mean`` of every step side by side: the runs are
seeded, so the rewards agree unless floating-point order flips a sample. Times depend on the machine's load
(the load average is printed); the rewards do not.

Run (prints a markdown table; about 4 minutes on 2 CPU cores with the defaults)::

    python bench/bench_shared_prompt.py --out bench/results/shared_prompt.md
    python bench/bench_shared_prompt.py --steps 2 --rounds 1    # smoke test
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "reference", "policy_forward", "backward", "optimizer")


def read_scalars(root: str) -> dict[str, list[float]]:
    """Every scalar of the newest TensorBoard event file under ``root``, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(f"{root}/**/events.out.tfevents*", recursive=True), key=os.path.getmtime)
    if not files:
        raise SystemExit(f"no TensorBoard events under {root}: the run failed, see its log there")
    events = EventAccumulator(files[-1], size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def run_fit(share: bool, steps: int, config: str, extra: list[str]) -> dict[str, list[float]]:
    root = tempfile.mkdtemp(prefix=f"lit_rl_share_{'on' if share else 'off'}_")
    cmd = [
        sys.executable, "-m", "lit_rl", "fit", "--config", config,
        "--trainer.max_steps", str(steps), "--data.val_size", "0", "--trainer.default_root_dir", root,
        "--model.share_prompt", str(share).lower(), *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(Path(root) / "fit.log", "w") as log:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{shlex.join(cmd)} failed ({done.returncode}); its output is in {root}/fit.log")
    return read_scalars(root)


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="A B pairs (shared, plain) run in turn")
    parser.add_argument("--config", default="configs/grpo.yaml")
    parser.add_argument("--out", help="also write the markdown here")
    parser.add_argument("extra", nargs="*", help="more lit-rl fit arguments, after --")
    args = parser.parse_args(argv)

    load = [os.getloadavg()[0]]
    runs: dict[bool, list[dict[str, list[float]]]] = {True: [], False: []}
    for r in range(args.rounds):
        for share in (True, False):
            print(f"round {r + 1}/{args.rounds}: share_prompt {str(share).lower()} ...", file=sys.stderr, flush=True)
            runs[share].append(run_fit(share, args.steps, args.config, args.extra))
    load.append(os.getloadavg()[0])

    def phase_median(share: bool, phase: str) -> float:  # pooled over rounds, steps 2..
        return statistics.median([v for run in runs[share] for v in run[f"time/{phase}_s"][1:]])

    def step_median(share: bool) -> float:
        totals = [sum(run[f"time/{p}_s"][i] for p in PHASES) for run in runs[share] for i in range(1, args.steps)] or [
            sum(runs[share][0][f"time/{p}_s"][0] for p in PHASES)
        ]
        return statistics.median(totals)

    cmd = f"python bench/bench_shared_prompt.py {shlex.join(argv if argv is not None else sys.argv[1:])}".strip()
    lines = [
        f"Command: `{cmd}`  ",
        f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}; config "
        f"`{args.config}`, {args.steps} steps per run, {args.rounds} rounds of (shared, plain) in turn. Wall times "
        f"depend on the machine's load (1-minute load average {load[0]:.1f} before, {load[1]:.1f} after); the "
        "rewards do not.",
        "",
        "| phase | shared prompt (s) | plain (s) | speed-up |",
        "| --- | --- | --- | --- |",
    ]
    for phase in PHASES:
        a, b = phase_median(True, phase), phase_median(False, phase)
        lines.append(f"| {phase} | {a:.3f} | {b:.3f} | {b / a:.2f}x |")
    a, b = step_median(True), step_median(False)
    lines.append(f"| **step** (sum of phases) | **{a:.3f}** | **{b:.3f}** | **{b / a:.2f}x** |")
    lines += ["", "`reward/mean` per step (round 1; seeded, so equal up to floating-point order):", ""]
    lines.append("| step | " + " | ".join(str(i + 1) for i in range(args.steps)) + " |")
    lines.append("| --- |" + " --- |" * args.steps)
    for share, name in ((True, "shared prompt"), (False, "plain")):
        rewards = runs[share][0]["reward/mean"]
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for v in rewards) + " |")
    same = all(on["reward/mean"] == off["reward/mean"] for on, off in zip(runs[True], runs[False]))
    lines.append("")
    lines.append(f"Rewards identical in every round: {'yes' if same else 'no'}.")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
