"""The roofline of a training step: each phase's measured time beside the least time the hardware needs for its work.

Three parts, written to ``bench/results/`` (``--results``):

1. **Machine rates** (``machine_rates.json``): matmul throughput in float32 and bfloat16 (2048^3 GEMMs and the
   decode-shaped ``[8 x 576] @ [576 x 1536]``) and memory bandwidth (512 MiB ``copy_`` counted as bytes read +
   written, ``sum`` and an in-place ``mul_``), each the fastest of as many timings as fit in 2 s
   (:func:`lit_rl.memory.machine_rates.measure_rates`).
2. **The default config**, ``lit-rl fit --config configs/grpo.yaml`` (embedded SmolLM2-135M-Instruct, 2 prompts x 8
   completions of at most 12 tokens, full fine-tuning in float32), ``--steps`` optimizer steps without held-out
   evaluation.
3. **LoRA at 256 tokens**, the command of ``bench/BENCHMARKS.md`` (``bench/grpo_vs_trl.yaml``, 2 prompts x 4
   completions forced to 256 tokens, LoRA r 16, activation checkpointing), ``--lora-steps`` steps.

The rates are measured before the runs and again after them, and each figure is the better of the two (load only
ever lowers a rate); ``--rates-only`` on a quiet machine followed by ``--reuse`` puts the same runs beside new rates.
Each run is a fresh process with the MemoryProfiler added (``track_tensors: false`` and ``predict: false``, so every
step runs at full speed; ``rates:`` the file of part 1); its ``memory_summary.json`` holds the roofline
(:mod:`lit_rl.memory.roofline`): per phase the median wall time over the steps after the first, FLOPs and bytes
from the model's config and each step's shapes, the compute-bound and memory-bound floors and the share of the

floor achieved. The runs' roofline sections are saved in ``roofline.json``; ``roofline.md`` is built from them.
Both runs train on the CPU; ``--device cuda`` measures the rates on the GPU and trains both runs there.

Run (about 8 minutes on 2 CPU cores)::

    nice -n 10 python bench/bench_roofline.py                  # all three parts
    nice -n 10 python bench/bench_roofline.py --rates-only     # part 1 only (about 15 s), then --reuse
    nice -n 10 python bench/bench_roofline.py --reuse-rates    # parts 2 and 3 with the saved machine_rates.json
    nice -n 10 python bench/bench_roofline.py --reuse-rates --only default   # rerun one run, keep the other's
    python bench/bench_roofline.py --reuse                     # roofline.md from roofline.json and the rates file
    python bench/bench_roofline.py --quick --results /tmp/r    # smoke test: tiny model, quick rates, 3 steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import git_commit, versions

from lit_rl.memory.machine_rates import best_of, load_rates, measure_rates, save_rates
from lit_rl.memory.roofline import rerate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PROFILER = "lit_rl.callbacks.MemoryProfiler"
RUNS = {
    "default": dict(
        title="Default config: `configs/grpo.yaml`",
        args=["--config", "configs/grpo.yaml", "--data.val_size", "0"],
        quick=["--model.init_args.name_or_path", "tiny:llama"],
    ),
    "lora256": dict(
        title="LoRA at 256 tokens: `bench/grpo_vs_trl.yaml` with activation checkpointing",
        args=[
            "--config",
            "bench/grpo_vs_trl.yaml",
            "--config",
            "callbacks/activation_checkpointing.yaml",
            "--model.init_args.max_new_tokens",
            "256",
            "--model.init_args.min_new_tokens",
            "256",
            "--model.init_args.lora.r",
            "16",
        ],  # fmt: skip
        quick=[
            "--model.init_args.name_or_path",
            "tiny:llama",
            "--model.init_args.max_new_tokens",
            "8",
            "--model.init_args.min_new_tokens",
            "8",
        ],  # fmt: skip
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=HERE / "results", help="folder of the results files")
    p.add_argument("--rates", type=Path, help="machine rates file (default: <results>/machine_rates.json)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps of the default config")
    p.add_argument("--lora-steps", type=int, default=3, help="optimizer steps of the LoRA 256-token run")
    p.add_argument("--rates-only", action="store_true", help="measure the machine rates only")
    p.add_argument("--reuse-rates", action="store_true", help="use the saved machine rates instead of measuring")
    p.add_argument("--reuse", action="store_true", help="rebuild roofline.md from roofline.json and the rates file")
    p.add_argument("--only", choices=list(RUNS), help="rerun this run only; the other's saved results are kept")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, quick rates, 3 steps each")
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where the rates are measured and both runs train"
    )
    args = p.parse_args(argv)
    args.rates = args.rates or args.results / "machine_rates.json"
    if args.quick:
        args.steps = args.lora_steps = 3
    if min(args.steps, args.lora_steps) < 2:
        p.error("--steps and --lora-steps: at least 2 (the first step warms up and is left out)")
    return args


def fit(name: str, args: argparse.Namespace) -> tuple[dict, str, float]:
    """One ``lit-rl fit`` of run ``name`` in a fresh process: its roofline section, its command and seconds."""
    run = RUNS[name]
    steps = args.steps if name == "default" else args.lora_steps
    root = Path(tempfile.mkdtemp(prefix=f"lit_rl_roofline_{name}_"))
    shown = [*run["args"], "--trainer.accelerator", args.device, "--trainer.max_steps", str(steps),
             "--trainer.callbacks+", PROFILER,
             "--trainer.callbacks+.track_tensors", "false", "--trainer.callbacks+.predict", "false",
             "--trainer.callbacks+.rates", _shown(args.rates)]  # fmt: skip
    cmd = [sys.executable, "-m", "lit_rl", "fit", *shown, "--trainer.default_root_dir", str(root)]
    cmd += run["quick"] if args.quick else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    print(f"{name}: {steps} steps, log in {root}/fit.log ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(root / "fit.log", "w") as log:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{shlex.join(cmd)} failed ({done.returncode}); its output is in {root}/fit.log")
    summary = json.loads(next(root.rglob("memory_summary.json")).read_text())
    command = "python -m lit_rl fit " + shlex.join(shown + (run["quick"] if args.quick else []))
    return summary["roofline"], command, time.perf_counter() - start


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (commands stay copyable)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def rates_lines(rates: dict) -> list[str]:
    loads = rates.get("load_average") or []
    loads = [load for load in (loads if isinstance(loads, list) else [loads]) if load]
    shown = " and ".join(f"{load['before'][0]} to {load['after'][0]}" for load in loads) or "unknown"
    times = f"the better of {len(loads)} measurements (before and after the runs), " if len(loads) > 1 else ""
    lines = [
        f"Machine rates (`{_shown(Path(rates['path']))}`): {rates['machine']}, torch {rates['torch']}, "
        f"{rates['threads']} threads, 1-minute load average {shown} while measuring; each rate {times}the fastest "
        f"of as many timings as fit in {rates['sizes']['seconds']} s.",
        "",
        "| dtype | GEMM {0}^3 | decode-shaped GEMM [{1} x {2}] @ [{2} x {3}] |".format(
            rates["sizes"]["gemm"], *rates["sizes"]["skinny"]
        ),
        "| --- | --- | --- |",
    ]
    for dtype, r in rates["dtypes"].items():
        lines.append(
            f"| {dtype} | {_si(r['matmul_flops_per_s'], 'FLOP/s')} | {_si(r['skinny_matmul_flops_per_s'], 'FLOP/s')} |"
        )
    d = rates["details"]
    lines += ["", f"Memory bandwidth over {rates['sizes']['copy_mib']} MiB: {_si(d['copy_bytes_per_s'], 'B/s')} "
              f"copying it (read + written), {_si(d['sum_bytes_per_s'], 'B/s')} summing it (read), "
              f"{_si(d['in_place_bytes_per_s'], 'B/s')} scaling it in place (read + written); the floors use the "
              "largest."]  # fmt: skip
    return lines


def run_lines(name: str, run: dict, command: str) -> list[str]:
    roof = run["roofline"]
    lines = [f"## {RUNS[name]['title']}", "", f"Command: `{run['command']}`  "]
    if run.get("bench", command) != command:
        lines.append(f"(measured by an earlier `{run['bench']}`)  ")
    if "skipped" in roof:
        return [*lines, f"No floors: {roof['skipped']}.", ""]
    s = roof["settings"]
    what = "LoRA" if s["adapters"] else "full fine-tuning"
    lines.append(
        f"{s['prompts']} prompts x {s['generations']} completions, prompt width {s['prompt_length']}, completion "
        f"length {s['new_tokens']} (longest per step), {what} ({s['trainable']:,} trainable), "
        f"{roof['rates']['dtype']}, {s['checkpointed_layers']} checkpointed layers, shared-prompt passes "
        f"{'on' if s['share_prompt'] else 'off'}, {s['reference_passes']} reference pass(es). Median over steps "
        f"{roof['steps'][0]}-{roof['steps'][-1]} (the first step warms up); the run took {run['seconds']:.0f} s with "
        f"model loading; 1-minute load average {run['load'][0]:.1f} before, {run['load'][1]:.1f} after."
    )
    lines += [
        "",
        "| phase | measured s | FLOPs | bytes | compute floor s | memory floor s | floor s | bound | floor / measured "
        "| decode-shaped rate s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    total = {"measured_s": 0.0, "floor_s": 0.0, "attainable_s": 0.0}
    for phase, e in roof["phases"].items():
        total["measured_s"] += e["measured_s"]
        if "floor_s" not in e:
            lines.append(f"| {phase} | {e['measured_s']:.3f} | not modelled |" + " |" * 7)
            continue
        total["floor_s"] += e["floor_s"]
        total["attainable_s"] += e["attainable_s"]
        lines.append(
            f"| {phase} | {e['measured_s']:.3f} | {_si(e['flops'], 'FLOP')} | {_si(e['bytes'], 'B')} | "
            f"{e['compute_s']:.4f} | {e['memory_s']:.4f} | {e['floor_s']:.4f} | {e['bound']} | "
            f"{100 * e['achieved']:.1f}% | {e['attainable_s']:.4f} |"
        )
    lines.append(
        f"| **step** (sum) | **{total['measured_s']:.3f}** | | | | | **{total['floor_s']:.4f}** | | "
        f"**{100 * total['floor_s'] / total['measured_s']:.1f}%** | **{total['attainable_s']:.4f}** |"
    )
    gaps = {p: e["measured_s"] - e["floor_s"] for p, e in roof["phases"].items() if "floor_s" in e}
    if gaps and max(gaps.values()) > 0:
        worst = max(gaps, key=gaps.get)
        lines += ["", f"Most seconds above the floor: {worst} ({gaps[worst]:.2f} s of the "
                  f"{sum(g for g in gaps.values() if g > 0):.2f} s the phases spend above theirs)."]  # fmt: skip
    return [*lines, ""]


def bench_command(argv: list[str]) -> str:
    return f"nice -n 10 python bench/bench_roofline.py {shlex.join(argv)}".strip()


def markdown(saved: dict, argv: list[str]) -> str:
    cmd = bench_command(argv)
    lines = [
        "# Roofline of a training step",
        "",
        f"Command: `{cmd}` (at commit {saved['commit']})  ",
        f"Versions: Python {saved['python']}, " + ", ".join(f"{k} {v}" for k, v in saved["versions"].items()) + ".",
        "",
        "Each phase's median wall time beside its floor, the least time this machine needs for the phase's work: per "
        "part of the phase (the prefill, each decode step, each micro-batch) the larger of FLOPs / matmul rate and "
        "bytes / memory bandwidth, summed. FLOPs and bytes are counted from the model's config and each step's "
        "shapes ([`lit_rl/memory/roofline.py`](../../lit_rl/memory/roofline.py) states every formula and "
        "assumption; bytes are a lower bound). **FLOPs and bytes do not depend on the machine or its load; the "
        "measured times and the machine rates do** (the load average is given beside each). `floor / measured` is "
        "the share of the hardware a phase achieved (above 100%: the phase beat the micro-benchmark's rate, which "
        "depends on the load and the access pattern too); the last column puts the decode steps at the rate of a "
        "decode-shaped GEMM (what the matmul library reaches on a few rows per weight) instead of the large-GEMM rate.",
        "",
        *rates_lines(saved["rates"]),
        "",
    ]
    for name, run in saved["runs"].items():
        lines += run_lines(name, run, cmd)
    return "\n".join(lines).rstrip() + "\n"


def measure(args: argparse.Namespace, when: str) -> dict:
    print(f"machine rates {when} ...", file=sys.stderr, flush=True)
    return measure_rates(args.device, ("float32", "bfloat16"), quick=args.quick)


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.results.mkdir(parents=True, exist_ok=True)
    saved_path = args.results / "roofline.json"
    if args.rates_only:
        save_rates(measure(args, "only"), args.rates)
        print(f"wrote {args.rates}", file=sys.stderr)
        return args.rates.read_text()
    if args.reuse:
        saved = json.loads(saved_path.read_text())
        argv = saved["argv"]
    else:
        measured = [] if args.reuse_rates else [measure(args, "before the runs")]
        if measured:
            save_rates(measured[0], args.rates)  # what the runs' profiler reads; the floors are redone below
        kept = json.loads(saved_path.read_text())["runs"] if args.only and saved_path.exists() else {}
        saved = {"argv": argv, "commit": git_commit(), "python": platform.python_version(),
                 "versions": versions(("torch", "transformers", "lightning", "peft")), "runs": kept}  # fmt: skip
        for name in [args.only] if args.only else RUNS:
            before = os.getloadavg()[0]
            roof, command, seconds = fit(name, args)
            saved["runs"][name] = {"roofline": roof, "command": command, "seconds": seconds,
                                   "load": [before, os.getloadavg()[0]], "bench": bench_command(argv)}  # fmt: skip
        if measured:  # load only ever lowers a rate: the best of a measurement before and one after the runs
            save_rates(best_of(*measured, measure(args, "after the runs")), args.rates)
        saved_path.write_text(json.dumps(saved, indent=2) + "\n")
    # every floor at the rates file as it is now, so `--rates-only` on a quiet machine and `--reuse` update them
    rates = load_rates(args.rates)
    for run in saved["runs"].values():
        run["roofline"] = rerate(run["roofline"], rates, _shown(args.rates))
    text = markdown({**saved, "rates": {**rates, "path": str(args.rates)}}, argv)
    out = args.results / "roofline.md"
    out.write_text(text)
    print(text)
    print(f"wrote {out}, {saved_path} and {args.rates}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
