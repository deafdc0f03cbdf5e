"""Allocator benchmark: peak RSS and step time of real lit-rl training steps under each CPU allocator option.

Measures the allocator's cached memory as a tactic with a cost, where a naive setup leaves it unmeasured: glibc keeps
the heap pages of freed tensors, so the process RSS of a CPU step sits far above the bytes tensors hold.
Options compared (each in a fresh ``python`` subprocess that runs ``lit-rl fit`` in-process):

- ``none``: glibc defaults (dynamic mmap threshold, 128 KiB trim threshold);
- ``trim``: :class:`lit_rl.callbacks.EmptyCache` with ``phases: all`` - ``malloc_trim(0)`` at every phase end;
- ``mallopt 64K``: ``EmptyCache(phases: [], mmap_threshold: 65536, trim_threshold: 65536)`` - thresholds
  set with ``mallopt`` in ``setup``, no trimming;
- ``env 64K``: ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536`` in the child's environment (set
  before Python starts, so ``import torch`` and the model load are under them too);
- ``trim + mallopt 4M``: trimming at every phase end and a fixed 4 MiB mmap threshold (the dynamic
  threshold no longer grows to 32 MiB, so KV caches and activations above 4 MiB are unmapped on free;
  the many small blocks stay on the heap and are trimmed at phase ends).

The LoRA steps are ~4x longer, so by default that workload runs ``none``, ``trim``, ``env 64K`` and
``trim + mallopt 4M`` (``--options`` chooses); ``mallopt 64K`` vs ``env 64K`` is compared on full-ft.

Per option and workload: **peak RSS** is the child's kernel high-water mark (``ru_maxrss`` from ``os.wait4``,
the whole process lifetime: import, model load and all steps); **step time** the median over the steps
after the first (a callback's wall time from ``on_train_batch_start`` to ``on_train_batch_end``, the
allocator's work included) of all rounds; **tensor peak** the exact bytes held by tensors at the step's
peak from :class:`lit_rl.callbacks.MemoryProfiler` (tensor accounting, the maximum over the phases of
one extra run per workload, 2 steps for full-ft so AdamW's state exists, 1 for LoRA: the allocator does
not change it); **baseline** the RSS at ``on_train_start`` (``import torch`` and the libraries + model load) minus the bytes of the tensors alive then (the weights), i.e. what the runtime
holds besides tensors; **ratio** ``peak RSS / (tensor peak + baseline)``, the target is <= 1.3.
The runs are interleaved (round 1 in option order, round 2 reversed, ...) so that load drift on a shared
machine affects every option. RSS and tensor bytes do not depend on the machine's load; times do.

Workloads:

- ``full-ft``: ``configs/grpo.yaml`` as shipped (embedded SmolLM2-135M-Instruct, full fine-tuning, 2 prompts x 8
  generations, 12 new tokens), shortened: ``--trainer.max_steps 3 --data.val_size 0``, no checkpoints, no logger;
- ``lora``: a LoRA run (2 prompts x 4 generations, LoRA r16 on all linear layers, activation
  checkpointing with ``--config callbacks/activation_checkpointing.yaml``), with 128 new tokens forced
  (``--model.min_new_tokens 128``; 256 in the TRL comparison of ``bench/vs_trl.py``: half the step time on a
  shared 2-core machine), 2 steps.

Run (prints a markdown table; about 50 minutes on 2 shared CPU cores)::

    python bench/bench_allocator.py --out bench/results/allocator.md
    python bench/bench_allocator.py --quick    # smoke test on configs/grpo_tiny.yaml, about a minute
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# runnable from a checkout without `pip install -e .`
sys.path.insert(0, str(ROOT))

GIB = 2**30
MARK = "BENCH_ALLOCATOR "
TRIM_ALL = {"phases": "all"}

#: option name -> (EmptyCache init_args or None, extra environment)
OPTIONS: dict[str, tuple[dict | None, dict[str, str]]] = {
    "none": (None, {}),
    "trim": (TRIM_ALL, {}),
    "mallopt 64K": ({"phases": [], "mmap_threshold": 65536, "trim_threshold": 65536}, {}),
    "env 64K": (None, {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}),
    "trim + mallopt 4M": ({**TRIM_ALL, "mmap_threshold": 4 * 2**20}, {}),
}

FIT = ["--data.val_size", "0", "--trainer.enable_checkpointing", "false", "--trainer.logger", "false"]
FIT += ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
#: workload -> lit-rl arguments (the callback list is emptied: no RunLog, no ModelCheckpoint)
WORKLOADS: dict[str, list[str]] = {
    "full-ft": ["--config", "configs/grpo.yaml", "--trainer.callbacks=[]", "--trainer.max_steps", "3", *FIT],
    "lora": [
        *["--config", "configs/grpo.yaml", "--trainer.callbacks=[]"],
        *["--config", "callbacks/activation_checkpointing.yaml"],
        *["--model.init_args.lora", '{"r": 16, "alpha": 32, "target_modules": "all-linear"}'],
        *["--model.init_args.num_generations", "4"],
        *["--model.init_args.max_new_tokens", "128", "--model.init_args.min_new_tokens", "128"],
        *["--trainer.max_steps", "2", *FIT],
    ],
    "tiny": ["--config", "configs/grpo_tiny.yaml", "--trainer.callbacks=[]", "--trainer.max_steps", "3", *FIT],
}


#: the LoRA steps are ~4x longer: there the two 64 KiB forms (same thresholds) are represented by the env one
LORA_OPTIONS = ["none", "trim", "env 64K", "trim + mallopt 4M"]


# --------------------------------------------------------------------------------------- child process


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU tensor storages reachable from Python (at train start: the weights)."""
    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except Exception:  # tensor subclasses without storage
            continue
    return sum(seen.values())


def child(args: argparse.Namespace) -> dict:
    """One lit-rl fit in this process; returns step times, the RSS baseline and (with --profile) the tensor peak."""
    from lightning.pytorch.callbacks import Callback

    from lit_rl.callbacks import EmptyCache, MemoryProfiler
    from lit_rl.cli import LitRLCLI
    from lit_rl.memory.rss import read_rss

    class StepClock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []  # wall seconds per step
            self.cpu: list[float] = []  # CPU seconds per step, user + system, all threads
            self.sys: list[float] = []  # of which system (page faults, mmap/munmap, madvise)
            self.rss_start = self.tensors_start = 0
            self._t0, self._os0 = 0.0, os.times()

        def on_train_start(self, trainer, pl_module) -> None:
            self.tensors_start = live_tensor_bytes()
            self.rss_start = read_rss() or 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._t0, self._os0 = time.perf_counter(), os.times()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = os.times()
            self.times.append(time.perf_counter() - self._t0)
            self.cpu.append(now.user + now.system - self._os0.user - self._os0.system)
            self.sys.append(now.system - self._os0.system)

    init_args, _ = OPTIONS[args.option]
    with tempfile.TemporaryDirectory(prefix="bench_allocator_") as tmp:
        # full fine-tuning: step 1 is the steady state (AdamW state exists); LoRA's state is a few MiB
        extra = ["--trainer.max_steps", "1" if args.workload == "lora" else "2"] if args.profile else []
        cli = LitRLCLI(args=[*WORKLOADS[args.workload], *extra, "--trainer.default_root_dir", tmp], run=False)
        clock = StepClock()
        cli.trainer.callbacks.append(clock)
        if init_args is not None:
            cli.trainer.callbacks.append(EmptyCache(**init_args))
        if args.profile:
            cli.trainer.callbacks.append(MemoryProfiler(every_n_steps=1, predict=False))
        cli.trainer.fit(cli.model, cli.datamodule)
        out = {"times": clock.times, "cpu": clock.cpu, "sys": clock.sys}
        out |= {"rss_start": clock.rss_start, "tensors_start": clock.tensors_start}
        if args.profile:
            summary = json.loads(next(Path(tmp).rglob("memory_summary.json")).read_text())
            out["tensor_peak"] = max(s["peak_gib"]["max"] for s in summary["phases"].values() if "peak_gib" in s)
    return out


# --------------------------------------------------------------------------------------- parent


def run_child(workload: str, option: str, profile: bool = False) -> dict:
    """Run one measurement in a fresh interpreter; its kernel peak RSS comes from ``wait4``."""
    _, env_extra = OPTIONS[option]
    env = {
        **os.environ,
        **env_extra,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, __file__, "--child", "--workload", workload, "--option", option]
    if profile:
        cmd.append("--profile")
    label = f"{workload} / {option}{' (tensor profile)' if profile else ''}"
    print(f"[bench] {label} ...", file=sys.stderr, flush=True)
    load0, start = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed (exit {proc.returncode}):\n{text[-4000:]}")
    result = json.loads(next(ln for ln in reversed(text.splitlines()) if ln.startswith(MARK))[len(MARK) :])
    result |= {"peak_rss": usage.ru_maxrss * 1024, "wall": time.perf_counter() - start}
    result["load"] = (load0, os.getloadavg()[0])
    wall, cpu = (", ".join(f"{t:.1f}" for t in result[k]) for k in ("times", "cpu"))
    print(
        f"[bench] {label}: peak RSS {result['peak_rss'] / GIB:.2f} GiB, steps {wall} s wall, {cpu} s CPU, "
        f"load {load0:.1f} -> {result['load'][1]:.1f}",
        file=sys.stderr,
        flush=True,
    )
    return result


def summarize(runs: list[dict], profile: dict) -> dict:
    def later(key: str) -> list[float]:  # the steps after the first of each run
        return [t for r in runs for t in r[key][1:]] or [t for r in runs for t in r[key]]

    rss = [r["peak_rss"] for r in runs]
    baseline = statistics.median(r["rss_start"] - r["tensors_start"] for r in runs)
    tensor_peak = profile["tensor_peak"] * GIB
    return {
        "peak_rss": max(rss),
        "rss_spread": max(rss) - min(rss),
        "step": statistics.median(later("times")),
        "cpu": statistics.median(later("cpu")),
        "sys": statistics.median(later("sys")),
        "steps": len(later("times")),
        "rss_start": statistics.median(r["rss_start"] for r in runs),
        "baseline": baseline,
        "tensor_peak": tensor_peak,
        "ratio": max(rss) / (tensor_peak + baseline),
        "load": statistics.mean(x for r in runs for x in r["load"]),
    }


def table(args: argparse.Namespace, results: dict[str, dict[str, dict]], wall: float) -> str:
    import torch

    lines = [
        f"Command: `{' '.join(['python', 'bench/bench_allocator.py', *map(shlex.quote, args.argv)])}`  ",
        f"Machine: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, "
        f"{platform.libc_ver()[0]} {platform.libc_ver()[1]}, torch {torch.__version__}, {args.rounds} rounds "
        f"interleaved, {wall / 60:.0f} min of runs.",
        "",
        "Load-independent: peak RSS, tensor peak, baseline, ratio (bytes; the peak RSS of the rounds differed by "
        "'spread'). Load-dependent: wall and CPU seconds per step and their ratios to `none` of the same workload "
        "(the load column is the mean load average at the start and end of each run; the machine is shared). CPU "
        "seconds are user + system, all threads; on an oversubscribed machine they include OpenMP spin-waiting. "
        "The allocator's own cost (page faults, mmap/munmap, madvise) is the system seconds, the least "
        "load-sensitive time column.",
    ]
    for workload, rows in results.items():
        ref = rows["none"]
        lines += [
            "",
            f"### {workload}",
            "",
            "| option | peak RSS (GiB) | spread | tensor peak (GiB) | baseline (GiB) | RSS / (tensor peak + baseline) "
            "| step wall (s) | wall vs none | step CPU (s) | CPU vs none | of which system (s) | steps timed | load |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for option, s in rows.items():
            lines.append(
                f"| {option} | {s['peak_rss'] / GIB:.2f} | {s['rss_spread'] / GIB:.2f} | {s['tensor_peak'] / GIB:.2f} | "
                f"{s['baseline'] / GIB:.2f} | {s['ratio']:.2f}x | {s['step']:.1f} | {s['step'] / ref['step']:.2f}x | "
                f"{s['cpu']:.1f} | {s['cpu'] / ref['cpu']:.2f}x | {s['sys']:.1f} | {s['steps']} | {s['load']:.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="configs/grpo_tiny.yaml, one round, three options")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default="full-ft,lora", help="comma-separated, of " + ", ".join(WORKLOADS))
    p.add_argument(
        "--options",
        default=None,
        help=f"comma-separated, of {', '.join(OPTIONS)}; default: all for full-ft, {', '.join(LORA_OPTIONS)} for lora",
    )
    p.add_argument("--out", default=None, help="also write the table (with the command) to this markdown file")
    p.add_argument(
        "--results",
        default=None,
        help="JSON-lines file of finished runs: appended to, and runs already in it are skipped",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--option", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(MARK + json.dumps(child(args)), flush=True)
        return None
    args.argv = argv
    if args.quick:
        args.rounds, args.workloads, args.options = 1, "tiny", "none,trim,env 64K"
    workloads = args.workloads.split(",")
    options = {
        w: args.options.split(",") if args.options else (LORA_OPTIONS if w == "lora" else list(OPTIONS))
        for w in workloads
    }
    unknown = [w for w in workloads if w not in WORKLOADS] + [
        o for w in workloads for o in options[w] if o not in OPTIONS
    ]
    if unknown or any("none" not in o for o in options.values()):
        p.error(f"unknown workload/option {unknown} or `none` missing; choose from {list(WORKLOADS)}, {list(OPTIONS)}")
    done: dict[tuple[str, str, str], dict] = {}
    if args.results and Path(args.results).exists():
        for line in Path(args.results).read_text().splitlines():
            rec = json.loads(line)
            done[rec["workload"], rec["option"], rec["run"]] = rec

    def measure(workload: str, option: str, run: str) -> dict:
        if (workload, option, run) not in done:
            rec = run_child(workload, option, profile=run == "profile") | {"workload": workload, "option": option}
            done[workload, option, run] = rec | {"run": run}
            if args.results:
                with open(args.results, "a") as f:
                    f.write(json.dumps(done[workload, option, run]) + "\n")
        return done[workload, option, run]

    runs: dict[str, dict[str, list[dict]]] = {w: {o: [] for o in options[w]} for w in workloads}
    for r in range(args.rounds):
        for w in workloads:
            for o in options[w] if r % 2 == 0 else reversed(options[w]):
                runs[w][o].append(measure(w, o, str(r)))
    # tensor accounting slows a step 2-3x; the allocator does not change tensor bytes: one profiled run each, last
    profiles = {w: measure(w, "none", "profile") for w in workloads}
    results = {w: {o: summarize(runs[w][o], profiles[w]) for o in options[w]} for w in workloads}
    wall = sum(rec["wall"] for rec in done.values())
    text = table(args, results, wall)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"[bench] wrote {args.out}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
