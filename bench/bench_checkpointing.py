"""Selective activation checkpointing: memory saved against recompute paid, for every ``every_n_layers``.

:class:`lit_rl.callbacks.ActivationCheckpointing` checkpoints every ``every_n_layers``-th decoder layer of the policy
(layers 0, k, 2k, ...: ``ceil(L / k)`` of ``L``); each checkpointed layer keeps only its input for the backward and
runs its forward again there. ``lit-rl estimate --device-memory X`` names the largest ``every_n_layers`` whose
predicted step peak fits X (:func:`lit_rl.memory.fit.choose_checkpointing`). This script measures what each setting
holds and costs, in a fresh ``python`` process per run that runs ``lit-rl fit`` in-process, with the checkpointing
added exactly as ``lit-rl estimate`` prints it::

    --config callbacks/activation_checkpointing.yaml --trainer.callbacks.init_args.every_n_layers K

Workloads (``--workloads``):

- ``lora128`` (the default): ``bench/grpo_vs_trl.yaml`` (embedded SmolLM2-135M-Instruct, 30 layers, 2 prompts x 4
  completions, beta 0.04) with every completion forced to 128 tokens and LoRA r 16 on all linear layers;
- ``full-ft``: ``configs/grpo.yaml`` as shipped (full fine-tuning, 2 prompts x 8 completions of at most 12 tokens),
  without held-out evaluation, checkpoints or its callbacks.

Per run, ``--steps`` optimizer steps (default 4) with :class:`lit_rl.callbacks.MemoryProfiler` measuring the first and
the last step (``every_n_steps = steps - 1``) and the steps between them at full speed:

- **checkpointed layers**: decoder layers with checkpointing on, counted on the trained model;
- **tensor peak**: the profiler's exact tensor accounting at the last step (AdamW's state exists: the steady state),
  the largest phase peak, and **predicted**: the estimator's prediction of that step at its own shapes (what the
  profiler logs as ``memory/<phase>/predicted_gib``);
- **step peak RSS**: the process's peak RSS during each unprofiled step (``VmHWM``, reset at the step's start; the
  process-lifetime ``ru_maxrss`` where it cannot be reset), the largest;
- **backward s** and **step s**: the median, over the unprofiled steps after the first, of the backward phase's wall
  seconds (summed over micro-batches) and of the whole step's.

Bytes do not depend on the machine's load; seconds do (the load averages are recorded beside them). With
``--rounds 2`` the settings run twice, the second time in reverse order, so load drift touches every setting.

Run (about 20 minutes on 2 idle CPU cores for ``lora128``, estimated, not timed; ``full-ft`` adds about 7)::

    nice -n 10 python bench/bench_checkpointing.py                          # writes bench/results/checkpointing.md
    nice -n 10 python bench/bench_checkpointing.py --workloads lora128,full-ft
    python bench/bench_checkpointing.py --reuse                             # the markdown again from checkpointing.json
    python bench/bench_checkpointing.py --quick --out /tmp/checkpointing.md  # smoke test: tiny model, a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import ChildFailed, report, run_measured, thread_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

GIB = 2**30
MIB = 2**20
MARK = "BENCH_CHECKPOINTING "
SETTINGS = (0, 1, 2, 3, 5, 10, 30)  # every_n_layers; 0: no checkpointing. SmolLM2-135M has 30 layers
QUICK_SETTINGS = (0, 1, 2)  # tiny:llama has 2

QUIET = ["--trainer.enable_checkpointing", "false", "--trainer.logger", "false"]
QUIET += ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
WORKLOADS: dict[str, dict] = {
    "lora128": dict(
        title="LoRA at 128 tokens: `bench/grpo_vs_trl.yaml`, LoRA r 16",
        args=[
            *["--config", "bench/grpo_vs_trl.yaml"],
            *["--model.init_args.max_new_tokens", "128", "--model.init_args.min_new_tokens", "128"],
            *["--model.init_args.lora.r", "16"],
        ],
    ),
    "full-ft": dict(
        title="Full fine-tuning: `configs/grpo.yaml`",
        args=["--config", "configs/grpo.yaml", "--trainer.callbacks=[]", "--data.val_size", "0"],
    ),
}
QUICK = ["--model.init_args.name_or_path", "tiny:llama"]
QUICK_LORA = ["--model.init_args.max_new_tokens", "8", "--model.init_args.min_new_tokens", "8"]


def fit_args(workload: str, every: int, steps: int, quick: bool) -> list[str]:
    """The ``lit-rl fit`` arguments of one run (without its output folder)."""
    args = list(WORKLOADS[workload]["args"])
    if every:  # what `lit-rl estimate --device-memory` prints
        args += ["--config", "callbacks/activation_checkpointing.yaml"]
        args += ["--trainer.callbacks.init_args.every_n_layers", str(every)]
    args += ["--trainer.max_steps", str(steps), *QUIET]
    if quick:
        args += QUICK + (QUICK_LORA if workload == "lora128" else [])
    return args


# --------------------------------------------------------------------------------------- child process


def child(args: argparse.Namespace) -> dict:
    """One ``lit-rl fit`` in this process; returns per-step times, RSS peaks and the profiler's last record."""
    from lightning.pytorch.callbacks import Callback
    from transformers.modeling_layers import GradientCheckpointingLayer

    from lit_rl.callbacks import MemoryProfiler
    from lit_rl.cli import LitRLCLI
    from lit_rl.memory.rss import probe_rss_source, read_peak_rss, reset_peak_rss
    from lit_rl.models import base_model

    every_n_steps = max(1, args.steps - 1)  # the profiler measures steps 0 and steps - 1

    class StepClock(Callback):
        """Wall seconds of each step and of its backward phase, and the step's peak RSS."""

        def __init__(self) -> None:
            self.steps: list[dict] = []
            self.source = probe_rss_source()
            self._t0 = self._b0 = self._backward = 0.0
            self._profiled = False

        def on_phase_start(self, name: str) -> None:
            if name == "backward":
                self._b0 = time.perf_counter()

        def on_phase_end(self, name: str) -> None:
            if name == "backward":
                self._backward += time.perf_counter() - self._b0

        def on_train_start(self, trainer, pl_module) -> None:
            pl_module.phases.add_listener(self)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._profiled = trainer.global_step % every_n_steps == 0
            if self.source == "vmhwm":
                reset_peak_rss()
            self._backward, self._t0 = 0.0, time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seconds = time.perf_counter() - self._t0
            rss = read_peak_rss(self.source)
            self.steps.append({"seconds": seconds, "backward": self._backward, "rss": rss, "profiled": self._profiled})

    with tempfile.TemporaryDirectory(prefix="bench_checkpointing_") as tmp:
        fit = fit_args(args.workload, args.every, args.steps, args.quick)
        cli = LitRLCLI(args=[*fit, "--trainer.default_root_dir", tmp], run=False)
        profiler = MemoryProfiler(every_n_steps=every_n_steps, predict=True, rates=None)
        clock = StepClock()
        cli.trainer.callbacks.extend([profiler, clock])
        cli.trainer.fit(cli.model, cli.datamodule)
    layers = [m for m in base_model(cli.model.policy).modules() if isinstance(m, GradientCheckpointingLayer)]
    record = profiler.summary()["steps"][-1]
    peaks = {name: p["peak_bytes"] for name, p in record["phases"].items()}
    return {
        "layers": len(layers),
        "checkpointed": sum(bool(getattr(m, "gradient_checkpointing", False)) for m in layers),
        "profiled_step": record["step"],
        "peaks": peaks,
        "predicted": record.get("predicted", {}),
        "steps": clock.steps,
        "rss_source": clock.source,
    }


# --------------------------------------------------------------------------------------- parent


def run_child(args: argparse.Namespace, workload: str, every: int) -> dict:
    """One run in a fresh interpreter; its lifetime peak RSS comes from ``wait4``."""
    env = thread_env(None)
    cmd = [sys.executable, __file__, "--child", "--workload", workload, "--every", str(every)]
    cmd += ["--steps", str(args.steps)] + (["--quick"] if args.quick else [])
    label = f"{workload} / every_n_layers {every or 'off'}"
    print(f"[bench] {label} ...", file=sys.stderr, flush=True)
    try:
        run = run_measured(cmd, MARK, env)
    except ChildFailed as err:
        raise RuntimeError(f"{label} failed (exit {err.code}):\n{err.output[-4000:]}") from None
    result = run.result | {"lifetime_rss": run.peak_rss, "wall": run.wall, "load": run.load}
    times = ", ".join(f"{s['seconds']:.1f}{'*' if s['profiled'] else ''}" for s in result["steps"])
    print(f"[bench] {label}: tensor peak {max(result['peaks'].values()) / MIB:.1f} MiB, steps {times} s "
          f"(* profiled), load {run.load[0]:.1f} -> {run.load[1]:.1f}", file=sys.stderr, flush=True)  # fmt: skip
    return result


def summarize(runs: list[dict]) -> dict:
    """One setting's row: bytes from the first round, seconds over every round's unprofiled steps after the first."""
    first = runs[0]
    timed = [s for r in runs for s in r["steps"][1:] if not s["profiled"]]
    peak_phase = max(first["peaks"], key=first["peaks"].get)
    rss = [s["rss"] for s in timed if s["rss"]] if first["rss_source"] == "vmhwm" else []
    return {
        "layers": first["layers"],
        "checkpointed": first["checkpointed"],
        "tensor_peak": first["peaks"][peak_phase],
        "peak_phase": peak_phase,
        "predicted": max(first["predicted"].values()) if first["predicted"] else None,
        "step_rss": max(rss) if rss else None,
        "lifetime_rss": max(r["lifetime_rss"] for r in runs),
        "backward": statistics.median(s["backward"] for s in timed) if timed else None,
        "step": statistics.median(s["seconds"] for s in timed) if timed else None,
        "timed": len(timed),
        "load": statistics.mean(x for r in runs for x in r["load"]),
    }


def _gib(x: float | None) -> str:
    return "—" if x is None else f"{x / GIB:.2f}"


def _mib(x: float | None) -> str:
    return "—" if x is None else f"{x / MIB:.2f}"


def _loads(loads: tuple[float, ...]) -> str:
    return ", ".join(f"{x:.2f}" for x in loads)


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def workload_lines(args: argparse.Namespace, workload: str, rows: dict[int, dict]) -> list[str]:
    off = rows.get(0)
    example = max(args.settings)
    shown = fit_args(workload, example, args.steps, args.quick)
    lines = [
        f"## {WORKLOADS[workload]['title']}",
        "",
        f"One run (every_n_layers {example}; `off` runs without the two checkpointing arguments): "
        f"`python -m lit_rl fit {shlex.join(shown)}`, with a MemoryProfiler (`every_n_steps: {max(1, args.steps - 1)}`) "
        "and the bench's step clock added in-process.",
        "",
        "| every_n_layers | checkpointed layers | tensor peak (MiB) | predicted (MiB) | error | peak phase "
        "| saved vs off (MiB) | step peak RSS (GiB) | backward (s) | backward vs off "
        "| step (s) | step vs off | steps timed | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for every, s in rows.items():
        error = f"{100 * (s['predicted'] - s['tensor_peak']) / s['tensor_peak']:+.1f}%" if s["predicted"] else "—"
        saved = _mib(off["tensor_peak"] - s["tensor_peak"]) if off else "—"

        def ratio(key: str, s=s) -> str:
            return f"{s[key] / off[key]:.2f}x" if off and s[key] and off[key] else "—"

        lines.append(
            f"| {every or 'off'} | {s['checkpointed']} of {s['layers']} | {_mib(s['tensor_peak'])} | "
            f"{_mib(s['predicted'])} | {error} | {s['peak_phase']} | {saved} | {_gib(s['step_rss'] or s['lifetime_rss'])} | "
            f"{_s(s['backward'])} | {ratio('backward')} | {_s(s['step'])} | "
            f"{ratio('step')} | {s['timed']} | {s['load']:.1f} |"
        )
    return [*lines, ""]


def markdown(args: argparse.Namespace, results: dict[str, dict[int, dict]], loads: list, wall: float) -> str:
    import torch
    import transformers

    command = shlex.join(["python", "bench/bench_checkpointing.py", *args.argv])
    lines = [
        "# Selective activation checkpointing: memory against recompute",
        "",
        f"Command: `{command}`  ",
        f"Machine: `{platform.platform()}`, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads, "
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{args.rounds} round(s), {wall / 60:.0f} min of runs.  ",
        f"Load average (1, 5, 15 min): {_loads(loads[0])} at the start, {_loads(loads[1])} at the end.",
        "",
        "`every_n_layers` k checkpoints decoder layers 0, k, 2k, ... of the policy: each keeps only its input for the "
        "backward and runs its forward again there, so the recompute is the checkpointed share of one policy forward "
        "per backward. **Does not depend on the machine's load**: checkpointed layers; tensor peak, the exact bytes "
        "held by tensors at the step's peak (MemoryProfiler on CPU, the last step, when AdamW's state exists), and the "
        "estimator's prediction of the same step (`error` = (predicted - measured) / measured); saved vs off; peak "
        "RSS of a step (the largest over the unprofiled steps, the kernel's high-water mark reset at each step's start, "
        "which also resets the process's `ru_maxrss`; it varies a little with allocator timing). **Depends on the "
        "load**: backward and step seconds, medians over the unprofiled steps after the first (`steps timed`), and "
        "their ratios to `off`; `load` is the mean 1-minute load average at the start and end of the runs. The "
        "rollout, which checkpointing does not touch, is most of a step.",
        "",
        "To pick a setting for a memory budget: `lit-rl estimate --config ... --device-memory X` names the largest "
        "every_n_layers that fits (`lit_rl/memory/fit.py`, `choose_checkpointing`).",
        "",
    ]
    for workload, rows in results.items():
        lines += workload_lines(args, workload, rows)
    return "\n".join(lines).rstrip() + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: tiny:llama (2 layers), off/1/2, 3 steps")
    p.add_argument("--workloads", default="lora128", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--settings", help="comma-separated every_n_layers, 0 for off (default 0,1,2,3,5,10,30)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 4; --quick 3)")
    p.add_argument("--rounds", type=int, default=1, help="runs per setting, in alternating order")
    p.add_argument(
        "--out",
        type=Path,
        default=HERE / "results" / "checkpointing.md",
        help="the markdown file; the runs' measurements go beside it (.json)",
    )
    p.add_argument("--reuse", action="store_true", help="rebuild the markdown from the .json beside --out")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--every", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else 4)
    if args.steps < 3:
        p.error("--steps: at least 3 (the first and last steps are profiled, the ones between timed)")
    if args.child:
        return args
    args.workloads = args.workloads.split(",")
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"--workloads: unknown {unknown}; choose from {', '.join(WORKLOADS)}")
    try:
        settings = [int(x) for x in args.settings.split(",")] if args.settings else None
    except ValueError:
        p.error("--settings: comma-separated integers, 0 for off")
    args.settings = settings or list(QUICK_SETTINGS if args.quick else SETTINGS)
    if any(k < 0 for k in args.settings) or args.rounds < 1:
        p.error("--settings: 0 (off) or a positive every_n_layers; --rounds: at least 1")
    return args


def main(argv: list[str] | None = None) -> str | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        report(MARK, child(args))
        return None
    saved_path = args.out.with_suffix(".json")
    if args.reuse:
        saved = json.loads(saved_path.read_text())
        args = parse_args(saved["argv"])
        args.argv, args.out = saved["argv"], Path(saved_path).with_suffix(".md")
    else:
        args.argv = argv
        n = len(args.workloads) * len(args.settings) * args.rounds
        print(f"[bench] {n} runs; writing {args.out} and {saved_path}", file=sys.stderr)
        start_load, start = os.getloadavg(), time.perf_counter()
        runs: dict[str, dict[str, list[dict]]] = {w: {str(k): [] for k in args.settings} for w in args.workloads}
        for r in range(args.rounds):
            for w in args.workloads:
                for k in args.settings if r % 2 == 0 else reversed(args.settings):
                    runs[w][str(k)].append(run_child(args, w, k))
        saved = {
            "argv": argv,
            "loads": [start_load, os.getloadavg()],
            "wall": time.perf_counter() - start,
            "runs": runs,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        saved_path.write_text(json.dumps(saved, indent=1) + "\n")
    results = {w: {int(k): summarize(r) for k, r in rows.items()} for w, rows in saved["runs"].items()}
    text = markdown(args, results, saved["loads"], saved["wall"])
    print(text)
    args.out.write_text(text)
    print(f"[bench] wrote {args.out}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
