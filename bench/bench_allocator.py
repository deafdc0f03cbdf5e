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
  the many small blocks stay on the heap and are trimmed at phase ends);
- ``jemalloc``: glibc's ``malloc`` replaced by jemalloc (https://jemalloc.net) with ``LD_PRELOAD`` in the child's
  environment, jemalloc's defaults (freed pages are purged gradually over ``dirty_decay_ms``, 10 s);
- ``jemalloc decay 1s``: jemalloc with ``MALLOC_CONF=background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0``,
  which gives freed pages back within about a second (why this variant: see ``OPTIONS``);
- ``tcmalloc``: gperftools' tcmalloc (``libtcmalloc_minimal``, https://github.com/gperftools/gperftools) with
  ``LD_PRELOAD``, its defaults.

The preloaded libraries are Debian's ``apt-get install libjemalloc2 libtcmalloc-minimal4``; they are looked up in
the usual library folders (``/usr/lib/<multiarch>``, ``/usr/lib64``, ``/usr/lib``, ``/usr/local/lib``, the Python
environment's ``lib``), or given by path in ``LIT_RL_JEMALLOC`` / ``LIT_RL_TCMALLOC``. An option whose library is
missing, or that the dynamic loader did not load, is a table row saying so, not a measurement. Every child reads its own
``/proc/self/maps`` before it imports torch and fails unless it runs on the option's allocator (glibc for the first
five: an inherited ``LD_PRELOAD`` or ``MALLOC_*`` setting is removed from every child's environment); the table's
``allocator`` column is what the children found, with the library's version, and a note under it gives the paths and
the settings jemalloc read back (``mallctl``). With jemalloc or tcmalloc, ``trim`` (``malloc_trim``) would act on
glibc's unused heap only, so those options run without ``EmptyCache``.

The LoRA steps are ~4x longer, so by default that workload runs ``none``, ``trim``, ``env 64K``,
``trim + mallopt 4M`` and the three preloaded allocators (``--options`` chooses); ``mallopt 64K`` vs ``env 64K`` is
compared on full-ft.

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

Run (prints a markdown table; about 50 minutes for the five glibc options on 2 shared CPU cores, each preloaded
allocator adds about a quarter of that)::

    apt-get install libjemalloc2 libtcmalloc-minimal4    # optional: the jemalloc and tcmalloc rows
    python bench/bench_allocator.py --out bench/results/allocator.md
    python bench/bench_allocator.py --options 'none,trim,env 64K,jemalloc,jemalloc decay 1s,tcmalloc' \
        --out bench/results/allocator.md --results /tmp/allocator_runs.jsonl    # resumable
    python bench/bench_allocator.py --quick    # smoke test on configs/grpo_tiny.yaml, about a minute
    python bench/bench_allocator.py --quick --options 'none,jemalloc,tcmalloc' --out /tmp/alloc_quick.md
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
import sysconfig
import tempfile
import time
from pathlib import Path

import harness
from harness import ChildFailed, report, run_measured

ROOT = Path(__file__).resolve().parents[1]

GIB = 2**30
MARK = "BENCH_ALLOCATOR "
TRIM_ALL = {"phases": "all"}

#: option name -> (EmptyCache init_args or None, extra environment); PRELOAD adds LD_PRELOAD to some of them
OPTIONS: dict[str, tuple[dict | None, dict[str, str]]] = {
    "none": (None, {}),
    "trim": (TRIM_ALL, {}),
    "mallopt 64K": ({"phases": [], "mmap_threshold": 65536, "trim_threshold": 65536}, {}),
    "env 64K": (None, {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}),
    "trim + mallopt 4M": ({**TRIM_ALL, "mmap_threshold": 4 * 2**20}, {}),
    "jemalloc": (None, {}),
    # jemalloc keeps freed pages "dirty" and purges them over dirty_decay_ms (10 s by default, longer than a full-ft
    # step), and without background threads only when a thread calls into it: pages left by the generation phase can
    # still be resident at the update's peak. 1 s is about one phase, and a background thread purges on time while
    # the OpenMP threads compute. dirty_decay_ms:0 would purge on every free, the cost that `env 64K` already shows
    # for glibc. Freed pages skip the "muzzy" (MADV_FREE) stage, whose pages count in RSS until the kernel is short of
    # memory (0 is jemalloc 5.3's default, written out so the variant does not depend on the build).
    "jemalloc decay 1s": (None, {"MALLOC_CONF": "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"}),
    "tcmalloc": (None, {}),
}

#: option name -> the allocator it preloads (a key of PRELOADABLE); the other options run on glibc
PRELOAD: dict[str, str] = {"jemalloc": "jemalloc", "jemalloc decay 1s": "jemalloc", "tcmalloc": "tcmalloc"}

#: allocator -> (variable that names the library's path, library file names in search order, Debian package)
PRELOADABLE: dict[str, tuple[str, tuple[str, ...], str]] = {
    "jemalloc": ("LIT_RL_JEMALLOC", ("libjemalloc.so.2", "libjemalloc.so"), "libjemalloc2"),
    "tcmalloc": ("LIT_RL_TCMALLOC", ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), "libtcmalloc-minimal4"),
}
#: inherited settings that would make a glibc option run on something else, or tune the preloaded allocator
INHERITED_ALLOCATOR_ENV = ("LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_", "TCMALLOC_")

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
LORA_OPTIONS = ["none", "trim", "env 64K", "trim + mallopt 4M", "jemalloc", "jemalloc decay 1s", "tcmalloc"]


# --------------------------------------------------------------------------------------- allocators


def library_dirs() -> list[Path]:
    """Where Debian, Fedora, a source install and a conda environment put shared libraries, in search order."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    dirs = [f"/usr/lib/{multiarch}", f"/lib/{multiarch}", "/usr/lib64", "/usr/lib", "/usr/local/lib"]
    return list(dict.fromkeys(Path(d) for d in [*dirs, Path(sys.prefix) / "lib"]))


def find_library(allocator: str) -> tuple[Path | None, str]:
    """The allocator's shared library, or ``None`` and why (the install command in it)."""
    variable, names, package = PRELOADABLE[allocator]
    if os.environ.get(variable):
        path = Path(os.environ[variable])
        return (path, "") if path.is_file() else (None, f"not found: {variable}={path} is not a file")
    for folder in library_dirs():
        for name in names:
            if (folder / name).is_file():
                return folder / name, ""
    return None, f"not installed (apt-get install {package})"


def child_env(option: str, library: Path | None = None) -> dict[str, str]:
    """The environment of a child measuring ``option``: this one without inherited allocator settings, plus the
    option's variables, ``LD_PRELOAD`` of ``library`` for a preloading option, and this checkout on ``PYTHONPATH``."""
    _, env_extra = OPTIONS[option]
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_ALLOCATOR_ENV)}
    env |= env_extra
    if option in PRELOAD:
        if library is None:
            raise ValueError(f"option {option!r} preloads {PRELOAD[option]}: pass its library")
        env["LD_PRELOAD"] = str(library)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def mapped_libraries(maps: str) -> dict[str, str]:
    """Allocator -> path of its library among the files mapped in a ``/proc/<pid>/maps`` text."""
    found: dict[str, str] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        for allocator, (_, names, _) in PRELOADABLE.items():
            stems = {name.split(".so")[0] for name in names}  # libjemalloc, libtcmalloc_minimal, libtcmalloc
            if Path(path).name.split(".so")[0] in stems:
                found.setdefault(allocator, path)
    return found


def jemalloc_settings() -> dict[str, object]:
    """jemalloc's version and the options it runs with, read back with ``mallctl`` (jemalloc preloaded)."""
    import ctypes

    mallctl = ctypes.CDLL(None).mallctl
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p]
    mallctl.argtypes += [ctypes.c_size_t]

    def read(key: str, ctype: type) -> object:
        value, size = ctype(), ctypes.c_size_t(ctypes.sizeof(ctype))
        if mallctl(key.encode(), ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
            return None
        return value.value.decode() if isinstance(value.value, bytes) else value.value

    out: dict[str, object] = {"version": read("version", ctypes.c_char_p)}
    for key, ctype in [("background_thread", ctypes.c_bool), ("narenas", ctypes.c_uint)]:
        out[key] = read(f"opt.{key}", ctype)
    for key in ("dirty_decay_ms", "muzzy_decay_ms"):
        out[key] = read(f"opt.{key}", ctypes.c_ssize_t)
    return out


def tcmalloc_version() -> str | None:
    import ctypes

    tc_version = ctypes.CDLL(None).tc_version
    tc_version.restype = ctypes.c_char_p
    major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_char_p()
    version = tc_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
    return version.decode() if version else None


def allocator_in_process() -> dict:
    """Which ``malloc`` this process runs on: a preloadable allocator mapped into it (``/proc/self/maps``) or glibc."""
    try:
        found = mapped_libraries(Path("/proc/self/maps").read_text())
    except OSError:  # not Linux
        return {"name": "unknown (no /proc/self/maps)"}
    if len(found) > 1:
        return {"name": "+".join(sorted(found)), "path": ", ".join(found.values())}
    if "jemalloc" in found:
        settings = jemalloc_settings()
        return {"name": "jemalloc", "path": found["jemalloc"], "version": settings.pop("version"), "settings": settings}
    if "tcmalloc" in found:
        return {"name": "tcmalloc", "path": found["tcmalloc"], "version": tcmalloc_version()}
    return {"name": "glibc", "version": platform.libc_ver()[1]}


def allocator_problem(option: str, allocator: dict) -> str:
    """'' when a child of ``option`` ran on the option's allocator with the option's ``MALLOC_CONF``, else why not."""
    expected = PRELOAD.get(option, "glibc")
    if allocator.get("name") != expected:
        return f"runs on {allocator.get('name')}, not {expected}"
    conf = OPTIONS[option][1].get("MALLOC_CONF")
    for pair in conf.split(",") if conf else []:
        key, value = pair.split(":", 1)
        read = allocator.get("settings", {}).get(key)
        if str(read).lower() != value.lower():
            return f"MALLOC_CONF {key}:{value} not applied (jemalloc reads {read})"
    return ""


def allocator_label(allocator: dict | None) -> str:
    """The table's short name for an allocator, e.g. ``jemalloc 5.3.0`` or ``glibc 2.36``."""
    if not allocator:
        return "not recorded"
    version = str(allocator.get("version") or "").split("-")[0]  # jemalloc: 5.3.0-0-g<commit>
    version = version.removeprefix("gperftools ")
    return " ".join(filter(None, [allocator["name"], version]))


def probe(option: str) -> tuple[dict | None, str]:
    """Start a bare interpreter with ``option``'s environment and see what it runs on, before any measurement.

    Returns:
        What :func:`allocator_in_process` found there and ``''``, or ``None`` and why the option cannot be measured.
    """
    library = None
    if option in PRELOAD:
        library, why = find_library(PRELOAD[option])
        if library is None:
            return None, why
    cmd = [sys.executable, __file__, "--probe", "--option", option]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(option, library), capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        return None, f"probe failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
    allocator = json.loads(lines[-1][len(MARK) :])
    problem = allocator_problem(option, allocator)
    if problem:
        loader = " ".join(ln for ln in proc.stderr.splitlines() if "LD_PRELOAD" in ln or "jemalloc" in ln)
        return None, f"not loaded: {problem}{f' ({loader.strip()})' if loader else ''}"
    return allocator, ""


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
    """One lit-rl fit in this process; returns step times, the RSS baseline, the allocator it ran on and (with
    --profile) the tensor peak."""
    # before torch is imported: a preload that the loader ignored must not be measured as if it had worked
    allocator = allocator_in_process()
    problem = allocator_problem(args.option, allocator)
    if problem:
        raise SystemExit(
            f"error: option {args.option!r}: this process {problem}; run it from bench/bench_allocator.py, "
            "which sets LD_PRELOAD and MALLOC_CONF"
        )
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
        out |= {"rss_start": clock.rss_start, "tensors_start": clock.tensors_start, "allocator": allocator}
        if args.profile:
            summary = json.loads(next(Path(tmp).rglob("memory_summary.json")).read_text())
            out["tensor_peak"] = max(s["peak_gib"]["max"] for s in summary["phases"].values() if "peak_gib" in s)
    return out


# --------------------------------------------------------------------------------------- parent


def run_child(workload: str, option: str, profile: bool = False, library: Path | None = None) -> dict:
    """Run one measurement in a fresh interpreter (``library`` preloaded for a PRELOAD option); its kernel peak RSS
    comes from ``wait4``."""
    env = child_env(option, library)
    cmd = [sys.executable, __file__, "--child", "--workload", workload, "--option", option]
    if profile:
        cmd.append("--profile")
    label = f"{workload} / {option}{' (tensor profile)' if profile else ''}"
    print(f"[bench] {label} ...", file=sys.stderr, flush=True)
    try:
        run = run_measured(cmd, MARK, env)
    except ChildFailed as err:
        raise RuntimeError(f"{label} failed (exit {err.code}):\n{err.output[-4000:]}") from None
    result = run.result | {"peak_rss": run.peak_rss, "wall": run.wall, "load": run.load}
    wall, cpu = (", ".join(f"{t:.1f}" for t in result[k]) for k in ("times", "cpu"))
    print(
        f"[bench] {label}: peak RSS {result['peak_rss'] / GIB:.2f} GiB, steps {wall} s wall, {cpu} s CPU, "
        f"load {run.load[0]:.1f} -> {run.load[1]:.1f}",
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
        # what the children found in their /proc/self/maps (results files from before the check: "not recorded")
        "allocator": ", ".join(dict.fromkeys(allocator_label(r.get("allocator")) for r in runs)),
        "preloaded": list(
            {json.dumps(r["allocator"]): r["allocator"] for r in runs if r.get("allocator", {}).get("path")}.values()
        ),
    }


def table(args: argparse.Namespace, results: dict[str, dict[str, dict]], wall: float) -> str:
    lines = harness.header_lines(
        "CPU allocators: peak RSS and step time of real training steps",
        "python bench/bench_allocator.py --out bench/results/allocator.md",
        this_file=shlex.join(["python", "bench/bench_allocator.py", *args.argv]),
        loads=[r["load"] for rows in results.values() for r in rows.values() if r.get("load") is not None],
        dists=("torch", "lightning", "transformers"),
    )
    lines += [
        f"glibc {platform.libc_ver()[1]}; {args.rounds} rounds interleaved, {wall / 60:.0f} min of runs.",
        "",
        "Load-independent: peak RSS, tensor peak, baseline, ratio (bytes; the peak RSS of the rounds differed by "
        "'spread'). Load-dependent: wall and CPU seconds per step and their ratios to `none` of the same workload "
        "(the load column is the mean load average at the start and end of each run; the machine is shared). CPU "
        "seconds are user + system, all threads; on an oversubscribed machine they include OpenMP spin-waiting. "
        "The allocator's own cost (page faults, mmap/munmap, madvise) is the system seconds, the least "
        "load-sensitive time column. The allocator column is the `malloc` each run found in its `/proc/self/maps`.",
    ]
    for workload, rows in results.items():
        ref = rows["none"]
        lines += [
            "",
            f"### {workload}",
            "",
            "| option | peak RSS (GiB) | spread | tensor peak (GiB) | baseline (GiB) | RSS / (tensor peak + baseline) "
            "| step wall (s) | wall vs none | step CPU (s) | CPU vs none | of which system (s) | steps timed | load "
            "| allocator |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        preloaded: dict[str, list[dict]] = {}
        for option, s in rows.items():
            if "unavailable" in s:  # a row that says why, so a missing library is not mistaken for a measurement
                lines.append(f"| {option} | {s['unavailable']} |{' |' * 12}")
                continue
            preloaded[option] = s["preloaded"]
            lines.append(
                f"| {option} | {s['peak_rss'] / GIB:.2f} | {s['rss_spread'] / GIB:.2f} | {s['tensor_peak'] / GIB:.2f} | "
                f"{s['baseline'] / GIB:.2f} | {s['ratio']:.2f}x | {s['step']:.1f} | {s['step'] / ref['step']:.2f}x | "
                f"{s['cpu']:.1f} | {s['cpu'] / ref['cpu']:.2f}x | {s['sys']:.1f} | {s['steps']} | {s['load']:.1f} | "
                f"{s['allocator']} |"
            )
        notes = [
            f"`{option}`: `LD_PRELOAD={a['path']}`"
            + (f" `MALLOC_CONF={OPTIONS[option][1]['MALLOC_CONF']}`" if "MALLOC_CONF" in OPTIONS[option][1] else "")
            + (
                f" (jemalloc reads back {', '.join(f'{k} {v}' for k, v in a['settings'].items())})"
                if "settings" in a
                else ""
            )
            for option, found in preloaded.items()
            for a in found
        ]
        if notes:
            lines += ["", "Preloaded, and mapped in every run of the option: " + "; ".join(notes) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="configs/grpo_tiny.yaml, one round; none, trim and env 64K unless --options says",
    )
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
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        report(MARK, allocator_in_process())
        return None
    if args.child:
        report(MARK, child(args))
        return None
    args.argv = argv
    if args.quick:
        args.rounds, args.workloads, args.options = 1, "tiny", args.options or "none,trim,env 64K"
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
    # each preloaded allocator is tried once in a bare interpreter first: missing or not loaded, it is a row saying so
    unavailable: dict[str, str] = {}
    for option in dict.fromkeys(o for w in workloads for o in options[w] if o in PRELOAD):
        found, why = probe(option)
        if found is None:
            unavailable[option] = why
        print(
            f"[bench] {option}: {why or allocator_label(found) + ' at ' + found['path']}", file=sys.stderr, flush=True
        )

    def measure(workload: str, option: str, run: str) -> dict:
        if (workload, option, run) not in done:
            library = find_library(PRELOAD[option])[0] if option in PRELOAD else None
            rec = run_child(workload, option, profile=run == "profile", library=library)
            rec |= {"workload": workload, "option": option}
            done[workload, option, run] = rec | {"run": run}
            if args.results:
                with open(args.results, "a") as f:
                    f.write(json.dumps(done[workload, option, run]) + "\n")
        return done[workload, option, run]

    runs: dict[str, dict[str, list[dict]]] = {w: {o: [] for o in options[w]} for w in workloads}
    for r in range(args.rounds):
        for w in workloads:
            for o in options[w] if r % 2 == 0 else reversed(options[w]):
                if o not in unavailable:
                    runs[w][o].append(measure(w, o, str(r)))
    # tensor accounting slows a step 2-3x; the allocator does not change tensor bytes: one profiled run each, last
    profiles = {w: measure(w, "none", "profile") for w in workloads}
    results = {
        w: {
            o: {"unavailable": unavailable[o]} if o in unavailable else summarize(runs[w][o], profiles[w])
            for o in options[w]
        }
        for w in workloads
    }
    wall = sum(rec["wall"] for rec in done.values())
    text = table(args, results, wall)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"[bench] wrote {args.out}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
