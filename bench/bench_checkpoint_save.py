"""Checkpoint save benchmark: the host memory a save adds, Lightning's default IO against the streaming one.

Lightning's ``TorchCheckpointIO`` serializes a checkpoint into an ``io.BytesIO`` before writing it, so a save holds a
second copy of the weights and the optimizer state in host memory; :class:`lit_rl.callbacks.StreamingCheckpointIO`
(the ``lit-rl`` default) streams ``torch.save`` to a temporary file and renames it. Both run the README's first
command, shortened to one held-out evaluation and one checkpoint at step 2 (``configs/grpo.yaml``: the embedded
SmolLM2-135M-Instruct, full fine-tuning in fp32 with AdamW, ``ModelCheckpoint`` with the optimizer state), each in a
fresh ``python -m lit_rl fit`` process with ``trainer.plugins`` set to a subclass of the IO that measures each save:

- **peak RSS before the first save**: the kernel's high-water mark (``VmHWM``) when the first save starts (import,
  model load, held-out evaluations, the training steps);
- **save peak**: ``VmHWM`` reset when a save starts (``/proc/self/clear_refs``) and read when it ends, the highest of
  the run's saves; **RSS at save start** the resident memory when the first save starts;
- **overall peak**: the highest of those and the process's ``ru_maxrss`` from ``os.wait4`` (the high-water mark since
  the last reset, so the whole run is covered);
- **checkpoint** the file's size, **save** its wall seconds.

RSS does not depend on the machine's load; seconds do (the load average is given beside them).

Run (about 2 minutes on 2 shared CPU cores; ``--quick``: ``configs/grpo_tiny.yaml``, under a minute)::

    python bench/bench_checkpoint_save.py --out bench/results/checkpoint_save.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lit_rl.callbacks import StreamingCheckpointIO
from lit_rl.memory.rss import read_peak_rss, read_rss, reset_peak_rss

ROOT = Path(__file__).resolve().parents[1]

GIB = 2**30
LOG_ENV = "BENCH_CHECKPOINT_SAVE_LOG"  # the child appends one JSON line per save to this file
#: row name -> the measured IO's class path (this file is on the child's PYTHONPATH)
IOS = {
    "Lightning's TorchCheckpointIO (in memory, then written)": "bench_checkpoint_save.MeasuredTorchIO",
    "lit-rl StreamingCheckpointIO (streamed to a temporary file, renamed)": "bench_checkpoint_save.MeasuredStreamingIO",
}
#: the README's first command, shortened: one held-out evaluation and one checkpoint, at step 2
FULL = ["--config", "configs/grpo.yaml", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]
FULL += ["--data.val_size", "4"]
QUICK = ["--config", "configs/grpo_tiny.yaml", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]
QUICK += ["--trainer.enable_checkpointing", "true"]


# --------------------------------------------------------------------------------------- child process


class _MeasuredSave:
    """Measures each save of the IO it is mixed into and appends the record to the file ``$BENCH_CHECKPOINT_SAVE_LOG``
    names."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        record = {"peak_before": read_peak_rss("vmhwm"), "rss_start": read_rss(), "per_save": reset_peak_rss()}
        start = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        record |= {"seconds": time.perf_counter() - start, "save_peak": read_peak_rss("vmhwm")}
        record |= {"bytes": Path(path).stat().st_size, "path": str(path)}
        with open(os.environ[LOG_ENV], "a") as f:
            f.write(json.dumps(record) + "\n")


class MeasuredTorchIO(_MeasuredSave, TorchCheckpointIO):
    """Lightning's default checkpoint IO, each save measured."""


class MeasuredStreamingIO(_MeasuredSave, StreamingCheckpointIO):
    """lit-rl's streaming checkpoint IO, each save measured."""


# --------------------------------------------------------------------------------------- parent


def fit_args(args: argparse.Namespace) -> list[str]:
    return [*(QUICK if args.quick else FULL), "--trainer.enable_progress_bar", "false"]


def run(args: argparse.Namespace, class_path: str) -> dict:
    """One ``lit-rl fit`` in a fresh interpreter with ``class_path`` as its checkpoint IO; its saves and peak RSS."""
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_save_") as tmp:
        log = Path(tmp) / "saves.jsonl"
        paths = [str(ROOT / "bench"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, LOG_ENV: str(log), "PYTHONPATH": os.pathsep.join(filter(None, paths))}
        plugins = f"[{{class_path: {class_path}}}]"
        cmd = [sys.executable, "-m", "lit_rl", "fit", *fit_args(args), "--trainer.plugins", plugins]
        cmd += ["--trainer.default_root_dir", str(Path(tmp) / "run")]
        print(f"[bench] {class_path} ...", file=sys.stderr, flush=True)
        load0, start = os.getloadavg()[0], time.perf_counter()
        with open(Path(tmp) / "fit.log", "w+") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
            out.seek(0)
            text = out.read()
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"{class_path} failed:\n{text[-4000:]}")
        saves = [json.loads(line) for line in log.read_text().splitlines()]
    if not saves:
        raise RuntimeError(f"{class_path}: the run saved no checkpoint")
    first = saves[0]
    result = {
        "saves": len(saves),
        "peak_before": first["peak_before"],
        "rss_start": first["rss_start"],
        "save_peak": max(s["save_peak"] for s in saves),
        "per_save": all(s["per_save"] for s in saves),
        "bytes": first["bytes"],
        "seconds": max(s["seconds"] for s in saves),
        "wall": time.perf_counter() - start,
        "load": (load0, os.getloadavg()[0]),
    }
    result["overall"] = max(result["peak_before"], result["save_peak"], usage.ru_maxrss * 1024)
    print(
        f"[bench] {class_path}: before the save {result['peak_before'] / GIB:.2f} GiB, save peak "
        f"{result['save_peak'] / GIB:.2f} GiB, overall {result['overall'] / GIB:.2f} GiB, "
        f"{result['bytes'] / GIB:.2f} GiB in {result['seconds']:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return result


def markdown(argv: list[str], args: argparse.Namespace, results: dict[str, dict], wall: float) -> str:
    command = " ".join(["lit-rl", "fit", *map(shlex.quote, fit_args(args))])
    lines = harness.header_lines(
        "Checkpoint save: Lightning's in-memory save against lit-rl's streaming one",
        "python bench/bench_checkpoint_save.py --out bench/results/checkpoint_save.md",
        this_file=shlex.join(["python", "bench/bench_checkpoint_save.py", *argv]),
        loads=[x for r in results.values() for x in r["load"]],
        dists=("torch", "lightning", "transformers"),
    )
    lines += [
        f"Each row runs `{command} --trainer.plugins '[{{class_path: <the IO>}}]'` in a fresh process; "
        f"{wall / 60:.0f} min of runs.",
        "",
        "Peak RSS in GiB (the kernel's high-water mark; does not depend on the machine's load): before the first save, "
        "during the save (reset when it starts), and over the whole run. RSS at save start: resident memory when the "
        "save begins. The save's seconds depend on the load (the load average at the start and end of each run beside "
        "them) and on the disk; the streaming IO's include an `fsync`.",
        "",
        "| IO | peak RSS before the first save | RSS at save start | save peak | overall peak | added by the save "
        "| checkpoint (GiB) | save (s) | load |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, r in results.items():
        added = max(r["save_peak"] - r["rss_start"], 0)
        lines.append(
            f"| {name} | {r['peak_before'] / GIB:.2f} | {r['rss_start'] / GIB:.2f} | {r['save_peak'] / GIB:.2f} "
            f"| {r['overall'] / GIB:.2f} | {added / GIB:.2f} | {r['bytes'] / GIB:.2f} | {r['seconds']:.1f} "
            f"| {r['load'][0]:.1f} -> {r['load'][1]:.1f} |"
        )
    if not all(r["per_save"] for r in results.values()):
        lines += ["", "The peak RSS could not be reset here: the save peak is the process's peak so far."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the markdown table here (default: print it only)")
    parser.add_argument("--quick", action="store_true", help="configs/grpo_tiny.yaml: a smoke test in seconds")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    start = time.perf_counter()
    results = {name: run(args, class_path) for name, class_path in IOS.items()}
    text = markdown(argv, args, results, time.perf_counter() - start)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
