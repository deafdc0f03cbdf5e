"""bf16 on the CPU against float32: step time, peak RSS, tensor peak per phase and learning on the default config.

Runs the default config, ``lit-rl fit --config configs/grpo.yaml`` (the embedded SmolLM2-135M-Instruct, full
fine-tuning with a frozen reference copy, 60 optimizer steps, greedy held-out evaluation before the first step and
every 20), once per ``trainer.precision``: ``32-true``, ``bf16-mixed`` (float32 weights, gradients and AdamW state;
matmuls in bf16 under CPU autocast) and ``bf16-true`` (bf16 weights, gradients and AdamW state). Each run is a fresh
process running ``lit-rl fit`` in-process, one after another, seeded, with the config's callbacks replaced by a
step clock (no checkpoints are written). Per precision:

- **step time**: wall seconds from ``on_train_batch_start`` to ``on_train_batch_end``, median over the steps after
  the first (evaluation runs between steps and is left out), and the median of each logged phase time
  (``time/<phase>_s``);
- **peak RSS**: the child's kernel high-water mark (``ru_maxrss`` from ``os.wait4``: import, model load, every step
  and evaluation);
- **learning**: the greedy held-out accuracy (``val/correct_answer``) at each evaluation, the training reward over
  the first and last 10 steps, and the share of the policy's weights that differ from the frozen reference (the
  starting weights) at the end: an AdamW update smaller than half a bf16 step of its weight is rounded away;
- **tensor peak per phase** (``--profile-steps``, a second, short run per precision with
  :class:`lit_rl.callbacks.MemoryProfiler`, no evaluation): the measured steady-state peak of each phase beside the
  profiler's own prediction for that step's shapes (the estimator on fake tensors).

Times depend on the machine and its load (the 1-minute load average is written beside them); bytes and the seeded
numbers do not. Each unit's numbers are saved as ``<out>/json/<unit>.json``, and ``bf16_cpu.md`` is written from
every unit saved so far, so a partial rerun (``--only``) redoes only what it names.

Run from the repository root, one precision at a time and one thread per run (on shared cores a second torch thread
mostly waits; about 20 minutes on 2 shared cores)::

    nice -n 5 python bench/bench_bf16_cpu.py --threads 1                  # writes bench/results/bf16_cpu.md
    nice -n 5 python bench/bench_bf16_cpu.py --only bf16-true --steps 6 --every 0 --out /tmp/b --results /tmp/b
    python bench/bench_bf16_cpu.py --reuse                                # rebuild bf16_cpu.md from the saved JSON
    python bench/bench_bf16_cpu.py --quick                                # tiny random model: a smoke test
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import (
    ChildFailed,
    header_lines,
    mean,
    read_scalar_events,
    report,
    run_measured,
    thread_env,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
VERSIONED = ("torch", "transformers", "lightning")
MARK = "BENCH_BF16_CPU "
GIB = 2**30
WINDOW = 10
# the config's callbacks (RunLog, ModelCheckpoint) replaced by the step clock: no checkpoint writes between steps
FIT = ["--trainer.callbacks=[]", "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false"]
QUICK = ["--model.init_args.max_new_tokens", "4", "--data.init_args.val_size", "4"]


# ------------------------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=PRECISIONS, help="run these precisions only (default: all three)")
    p.add_argument("--steps", type=int, help="optimizer steps of each training run (default 60; --quick 2)")
    p.add_argument("--every", type=int, help="held-out evaluation every N steps, 0: none (default 20; --quick 1)")
    p.add_argument("--profile-steps", type=int, help="steps of each profiled run, 0: none (default 3; --quick 2)")
    p.add_argument("--config", help="config (default configs/grpo.yaml; --quick configs/grpo_tiny.yaml)")
    p.add_argument("--out", help="runs and per-unit JSON (default runs/bf16_cpu)")
    p.add_argument("--results", help="folder for bf16_cpu.md (default bench/results)")
    p.add_argument("--reuse", action="store_true", help="read a unit already saved in --out instead of rerunning")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run (OMP_NUM_THREADS, torch threads)")
    p.add_argument("--quick", action="store_true", help="tiny random model, 2 steps, temporary folders")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--precision", choices=PRECISIONS, help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    args.steps = args.steps if args.steps is not None else (2 if quick else 60)
    args.every = args.every if args.every is not None else (1 if quick else 20)
    args.profile_steps = args.profile_steps if args.profile_steps is not None else (2 if quick else 3)
    if args.steps < 1 or args.every < 0 or args.profile_steps < 0 or args.threads < 1:
        p.error("--steps and --threads: must be >= 1; --every and --profile-steps: >= 0 (0 leaves the part out)")
    args.config = args.config or ("configs/grpo_tiny.yaml" if quick else "configs/grpo.yaml")
    args.precisions = [p for p in PRECISIONS if not args.only or p in args.only]
    scratch = tempfile.mkdtemp(prefix="lit_rl_bf16_cpu_") if quick and not (args.out and args.results) else None
    args.out = Path(args.out or (Path(scratch) / "runs" if scratch else ROOT / "runs" / "bf16_cpu"))
    args.results = Path(args.results or (scratch if scratch else ROOT / "bench" / "results"))
    return args


def fit_args(args: argparse.Namespace, precision: str, root: Path, profile: bool) -> list[str]:
    """The ``lit-rl fit`` arguments of one run (a profiled run: its own steps, no held-out evaluation)."""
    extra = ["--config", args.config, *FIT, "--trainer.precision", precision, "--trainer.default_root_dir", str(root)]
    extra += QUICK if args.quick else []
    if profile:
        return [*extra, "--trainer.max_steps", str(args.profile_steps), "--data.init_args.val_size", "0"]
    extra += ["--trainer.max_steps", str(args.steps)]
    if args.every == 0:
        return [*extra, "--data.init_args.val_size", "0"]
    return [*extra, "--trainer.val_check_interval", str(args.every)]


# ------------------------------------------------------------------------------------------------ child process
def child(args: argparse.Namespace) -> dict:
    """One ``lit-rl fit`` in this process: wall seconds per step, the share of weights moved, the profiler's summary."""
    import torch
    from lightning.pytorch.callbacks import Callback

    from lit_rl.callbacks import MemoryProfiler
    from lit_rl.cli import LitRLCLI

    torch.set_num_threads(args.threads)

    class StepClock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []  # wall seconds per step
            self.cpu: list[float] = []  # CPU seconds per step (user + system, all threads): less load-dependent
            self._t0, self._cpu0 = 0.0, 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._t0, self._cpu0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self._t0)
            self.cpu.append(time.process_time() - self._cpu0)

    root = Path(args.root)
    cli = LitRLCLI(args=fit_args(args, args.precision, root, args.profile), run=False)
    clock = StepClock()
    cli.trainer.callbacks.append(clock)
    if args.profile:
        cli.trainer.callbacks.append(MemoryProfiler(every_n_steps=1))
    cli.trainer.fit(cli.model, cli.datamodule)
    method = cli.model
    out: dict = {"times": clock.times, "cpu": clock.cpu, "run": str(Path(cli.trainer.log_dir).relative_to(root))}
    out["phase_names"] = list(method.phases.names)
    if method.reference is not None:  # full fine-tuning: the frozen copy holds the starting weights
        start = dict(method.reference.named_parameters())
        pairs = [(p, start[n]) for n, p in method.policy.named_parameters() if p.requires_grad and n in start]
        moved = sum(int((p != s).sum()) for p, s in pairs)
        out["moved"] = moved / sum(p.numel() for p, _ in pairs)
        out["weight_dtype"] = str(next(method.policy.parameters()).dtype).removeprefix("torch.")
    if args.profile:
        out["summary"] = json.loads(next(root.rglob("memory_summary.json")).read_text())
    return out


# ------------------------------------------------------------------------------------------------ parent
def run_child(args: argparse.Namespace, precision: str, root: Path, profile: bool) -> dict:
    """One run in a fresh interpreter with ``--threads`` threads; its kernel peak RSS comes from ``wait4``."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    threads = str(args.threads)
    env = thread_env(int(threads))
    cmd = [sys.executable, __file__, "--child", "--precision", precision, "--root", str(root),
           "--steps", str(args.steps), "--every", str(args.every), "--profile-steps", str(args.profile_steps),
           "--config", args.config, "--threads", threads]  # fmt: skip
    cmd += ["--quick"] * args.quick + ["--profile"] * profile
    print(f"+ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    try:
        run = run_measured(cmd, MARK, env, log=root / "fit.log")
    except ChildFailed as err:
        raise SystemExit(f"{shlex.join(cmd)} failed ({err.code}); its output is in {root}/fit.log") from None
    result = run.result | {"peak_rss": run.peak_rss, "wall": run.wall}
    result |= {"load_before": run.load[0], "load_after": run.load[1]}
    shown_root = root.relative_to(ROOT) if root.is_relative_to(ROOT) else root
    result["command"] = shlex.join(["lit-rl", "fit", *fit_args(args, precision, shown_root, profile)])
    return result


def training(args: argparse.Namespace, precision: str) -> dict:
    """One training run: step time (whole step and per phase), peak RSS, held-out accuracy, reward, weights moved."""
    root = args.out / "train" / precision
    result = run_child(args, precision, root, profile=False)
    run = root / result.pop("run")
    events = read_scalar_events(str(run), ["reward/mean"])
    events.update(read_scalar_events(str(run), ["val/correct_answer", "kl/mean"], optional=True))
    logged = read_scalar_events(str(run), [f"time/{name}_s" for name in result.pop("phase_names")], optional=True)
    phases = {tag[5:-2]: [e.value for e in events[1:]] for tag, events in logged.items()}  # the steps after the first
    reward = [e.value for e in events["reward/mean"]]
    accuracy = events.get("val/correct_answer", [])
    times, cpu = result.pop("times"), result.pop("cpu")
    return {
        **result,
        "steps": len(times),
        "step_s": statistics.median(times[1:] or times),
        "step_cpu_s": statistics.median(cpu[1:] or cpu),
        "phase_s": {name: statistics.median(values) for name, values in phases.items() if values},
        "reward": [mean(reward[:WINDOW]), mean(reward[-WINDOW:])],
        # the evaluation before training is logged at step 0, the one after step k's update at k - 1
        "eval_steps": [0] + [e.step + 1 for e in accuracy[1:]] if accuracy else [],
        "accuracy": [e.value for e in accuracy],
        "kl": events["kl/mean"][-1].value if events.get("kl/mean") else None,
    }


def memory(args: argparse.Namespace, precision: str) -> dict:
    """One profiled run: each phase's steady-state tensor peak, measured and predicted (GiB)."""
    root = args.out / "memory" / precision
    result = run_child(args, precision, root, profile=True)
    summary = result.pop("summary")
    phases = {}
    for phase, stats in [*summary["phases"].items(), ("step", summary["step"])]:
        phases[phase] = {"measured": stats["peak_gib"]["steady"], "predicted": stats.get("predicted_gib")}
    return {
        "command": result["command"],
        "steady_state_steps": summary["steady_state_steps"],
        "phases": phases,
        "peak_rss": result["peak_rss"],
        "wall": result["wall"],
        "load_before": result["load_before"],
        "load_after": result["load_after"],
    }


# ------------------------------------------------------------------------------------------------ report
def _label(precision: str) -> str:
    return "fp32 (32-true)" if precision == "32-true" else precision


def _command(rows: dict[str, dict]) -> str:
    """The runs' common command, the precision (and the folder named after it) shown as ``<precision>``."""
    precision, first = next(iter(rows.items()))
    return first["command"].replace(precision, "<precision>")


def training_table(saved: dict) -> list[str]:
    rows = {p: saved[f"train-{p}"] for p in PRECISIONS if f"train-{p}" in saved}
    if not rows:
        return []
    first = next(iter(rows.values()))
    names = list(first["phase_s"])  # the method's phases, in step order
    steps = sorted({s for r in rows.values() for s in r["eval_steps"]})
    base = rows.get("32-true")
    lines = [
        "## 1. Training runs: step time, peak RSS, learning",
        "",
        f"Each run: `{_command(rows)}`. "
        "Step s: the median wall time of a step after the first (evaluation left out); CPU s: its median CPU time (user "
        "+ system, all threads), which a busy machine inflates less; the phase columns: the median wall time of each "
        f"logged `time/<phase>_s`. Reward: `reward/mean` over the first and last {WINDOW} steps. Held-out: "
        "greedy `val/correct_answer` on the config's held-out questions (never trained on) after the optimizer steps "
        "in the header. Weights moved: the share of the policy's weight elements that differ from the starting "
        "weights (the frozen reference copy) after the last step.",
        "",
        "| precision | step s | vs fp32 | CPU s | vs fp32 | "
        + " | ".join(f"{n} s" for n in names)
        + " | peak RSS GiB | held-out "
        f"accuracy (steps {', '.join(map(str, steps))}) | reward first {WINDOW} → last {WINDOW} | weights moved | "
        "KL last step | wall s | load before, after |",
        "| --- | ---: | ---: | ---: | ---: | "
        + " | ".join("---:" for _ in names)
        + " | ---: | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for precision, r in rows.items():
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        cpu_ratio = f"{r['step_cpu_s'] / base['step_cpu_s']:.2f}x" if base else "-"
        cells = [
            _label(precision), f"{r['step_s']:.2f}", ratio, f"{r['step_cpu_s']:.2f}", cpu_ratio, *(f"{r['phase_s'].get(n, float('nan')):.2f}" for n in names),
            f"{r['peak_rss'] / GIB:.2f}", " → ".join(f"{a:.2f}" for a in r["accuracy"]) or "-",
            f"{r['reward'][0]:.3f} → {r['reward'][1]:.3f}", f"{r['moved']:.1%}" if "moved" in r else "-",
            f"{r['kl']:.4f}" if r.get("kl") is not None else "-", f"{r['wall']:.0f}",
            f"{r['load_before']:.2f}, {r['load_after']:.2f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def memory_table(saved: dict) -> list[str]:
    rows = {p: saved[f"memory-{p}"] for p in PRECISIONS if f"memory-{p}" in saved}
    if not rows:
        return []
    first = next(iter(rows.values()))
    lines = [
        "## 2. Tensor peak per phase, measured and predicted",
        "",
        f"Each run: `{_command(rows)}`, with "
        "`lit_rl.callbacks.MemoryProfiler(every_n_steps=1)` added. Measured: the profiler's tensor accounting, mean "
        f"over the steady-state steps {first['steady_state_steps']} (step 0 has no AdamW state yet); predicted: the "
        "profiler's own prediction for each measured step's shapes (the estimator on fake tensors, under the same "
        "precision). MiB, measured / predicted (ratio predicted / measured).",
        "",
        "| phase | " + " | ".join(_label(p) for p in rows) + " |",
        "| --- | " + " | ".join("---:" for _ in rows) + " |",
    ]
    for phase in first["phases"]:
        cells = []
        for r in rows.values():
            stats = r["phases"].get(phase, {})
            measured, predicted = stats.get("measured"), stats.get("predicted")
            if measured is None or predicted is None:
                cells.append("-")
                continue
            cells.append(f"{measured * 1024:.1f} / {predicted * 1024:.1f} ({predicted / measured:.3f})")
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Peak RSS, wall s and load average (1 min) per profiled run: "
        + "; ".join(
            f"{_label(p)} {r['peak_rss'] / GIB:.2f} GiB, {r['wall']:.0f} s ({r['load_before']:.2f}, {r['load_after']:.2f})"
            for p, r in rows.items()
        )
        + ".",
    ]
    return lines


def markdown(args: argparse.Namespace, argv: list[str], saved: dict) -> str:
    loads = [x for r in saved.values() for x in (r["load_before"], r["load_after"])]
    lines = header_lines(
        "bf16 on the CPU against float32",
        "nice -n 5 python bench/bench_bf16_cpu.py --threads 1",
        this_file=shlex.join(["python", "bench/bench_bf16_cpu.py", *argv]),
        loads=loads,
        threads=args.threads,
        dists=VERSIONED,
    )
    lines += ["Some precisions alone: `--only`, then `--reuse`.", ""]
    for part in (training_table(saved), memory_table(saved)):
        if part:
            lines += [*part, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        report(MARK, child(args))
        return None
    store = args.out / "json"
    store.mkdir(parents=True, exist_ok=True)
    units = [(f"train-{p}", training, p) for p in args.precisions]
    units += [(f"memory-{p}", memory, p) for p in args.precisions] if args.profile_steps else []
    for unit, measure, precision in units:
        path = store / f"{unit}.json"
        if not (args.reuse and path.exists()):
            path.write_text(json.dumps(measure(args, precision), indent=1))
            print(f"[bench] {unit} done", file=sys.stderr, flush=True)
    saved = {p.stem: json.loads(p.read_text()) for p in sorted(store.glob("*.json"))}
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / "bf16_cpu.md"
    text = markdown(args, argv, saved)
    out.write_text(text)
    print(text)
    print(f"[bench] wrote {out}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
