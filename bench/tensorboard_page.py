"""TensorBoard's memory page for docs/memory.md, remade from a fresh profiled run of the default config.

Runs ``lit-rl fit --config configs/grpo.yaml --config callbacks/memory_profiler.yaml`` for a few steps (3 by
default) into a temporary folder, with ``--trainer.limit_val_batches 0`` (no held-out evaluation, which the page does
not chart; the training prompts stay those of the default config) and ``--trainer.default_root_dir`` on that
folder; starts ``tensorboard`` on that folder on 127.0.0.1 at a free port; waits until it serves the memory layout
and the scalars; takes a headless Chromium screenshot of its Custom Scalars page (``#custom_scalars``); writes
``docs/tensorboard_memory.png``; and stops TensorBoard. The run's ``memory_phases.png`` is copied to
``docs/memory_phases.png`` only when docs/memory.md describes that figure as from a run of as many steps
(``... as the profiler wrote it for a 60-step run ...``: ``--steps 60``); otherwise the docs' figure is left alone
and the script says so. Beside the figures it writes ``bench/results/tensorboard_page.md`` (with ``--out-dir``: in that
folder): the results header (the command, commit, machine, versions, load) and the run's peak per phase, so the
docs need not say when the page was made.

Needs Chromium (``apt-get install chromium``; ``--chromium`` names another binary) and TensorBoard (a dependency).
Run from anywhere (the run is most of it: 13 minutes on 2 CPU cores shared with a load average of 11-17, three
profiled steps under tensor accounting; the screenshot a few seconds)::

    python bench/tensorboard_page.py                  # writes docs/tensorboard_memory.png, results/tensorboard_page.md
    python bench/tensorboard_page.py --out-dir /tmp/x # writes there instead; docs/ untouched
    python bench/tensorboard_page.py --keep runs/tb   # also keeps the run's log folder there
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

import harness

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "bench" / "results"
PHASES_TEXT = re.compile(r"`memory_phases\.png` as the profiler wrote it for a (\d+)-step run")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lit_rl_command() -> list[str]:
    exe = shutil.which("lit-rl")
    return [exe] if exe else [sys.executable, "-m", "lit_rl"]


def tensorboard_command() -> list[str]:
    exe = shutil.which("tensorboard")
    return [exe] if exe else [sys.executable, "-m", "tensorboard.main"]


def find_chromium(name: str | None) -> str:
    for candidate in [name] if name else ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]:
        path = shutil.which(candidate)
        if path:
            return path
    raise SystemExit("no Chromium found: apt-get install chromium, or pass --chromium /path/to/chrome")


def get_json(url: str) -> object | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def wait_for_page(base: str, tags: list[str], steps: int, timeout: float) -> None:
    """Until TensorBoard serves the memory layout and ``steps`` points of every ``tags`` scalar."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        layout = get_json(f"{base}/data/plugin/custom_scalars/layout") or {}
        loaded = get_json(f"{base}/data/plugin/scalars/tags") or {}
        if any(c.get("title") == "memory" for c in layout.get("category", [])) and len(loaded) == 1:
            (run,) = loaded
            series = [get_json(f"{base}/data/plugin/scalars/scalars?{urlencode({'run': run, 'tag': t})}") for t in tags]
            if all(isinstance(points, list) and len(points) >= steps for points in series):
                return
        time.sleep(1)
    raise SystemExit(f"TensorBoard at {base} did not serve the memory page within {timeout:.0f} s")


def provenance(fit: list[str], steps: int, run_s: float, loads: list[float], phases: dict) -> str:
    """The results file beside the screenshot: its header, the run, and the peak per phase the page charts."""
    shown = shlex.join(["lit-rl", *fit[fit.index("fit") :]]).split(" --trainer.default_root_dir")[0]
    lines = harness.header_lines(
        "TensorBoard's memory page: the run behind docs/tensorboard_memory.png",
        "python bench/tensorboard_page.py",
        this_file=shlex.join(["python", "bench/tensorboard_page.py", *sys.argv[1:]]),
        loads=loads,
    )
    lines += [f"The run: `{shown}` ({steps} steps, {run_s:.0f} s), into a temporary folder. Its steady-state peaks "
              "per phase (`memory_summary.json`), what the page charts:", "",
              "| phase | steady-state peak GiB (`memory/<phase>/peak_gib`) | predicted GiB |", "| --- | ---: | ---: |"]  # fmt: skip
    for phase, stats in phases.items():
        peak = stats.get("peak_gib")  # {"max", "mean", "steady"} over the run's steps
        cells = [peak.get("steady") if isinstance(peak, dict) else peak, stats.get("predicted_gib")]
        lines.append(f"| {phase} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps of the profiled run")
    parser.add_argument("--out-dir", type=Path, default=DOCS, help="where the PNGs go (default docs/)")
    parser.add_argument("--keep", type=Path, default=None, help="copy the run's log folder here")
    parser.add_argument("--chromium", default=None, help="Chromium binary (default: the first found on PATH)")
    parser.add_argument("--window", default="1400,1000", help="browser window size, WIDTH,HEIGHT")
    parser.add_argument("--wait-ms", type=int, default=20000, help="Chromium's --virtual-time-budget")
    args = parser.parse_args()
    chromium = find_chromium(args.chromium)
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    with tempfile.TemporaryDirectory(prefix="lit-rl-tb-") as tmp:
        run_root = Path(tmp) / "run"
        fit = lit_rl_command() + [
            "fit",
            "--config", "configs/grpo.yaml",
            "--config", "callbacks/memory_profiler.yaml",
            "--trainer.max_steps", str(args.steps),
            "--trainer.limit_val_batches", "0",
            "--trainer.default_root_dir", str(run_root),
        ]  # fmt: skip
        print("$ " + shlex.join(fit), flush=True)
        started, load = time.monotonic(), harness.load_average()
        subprocess.run(fit, cwd=ROOT, check=True)
        run_s, loads = time.monotonic() - started, [load, harness.load_average()]
        print(f"run: {run_s:.0f} s", flush=True)
        summaries = sorted(run_root.rglob("memory_summary.json"))
        if len(summaries) != 1:
            raise SystemExit(f"expected one memory_summary.json under {run_root}, found {summaries}")
        log_dir = summaries[0].parent
        phases = json.loads(summaries[0].read_text()).get("phases") or {}
        tags = [f"memory/{phase}/peak_gib" for phase in phases] + ["memory/step/peak_gib"]
        record = (out_dir if out_dir != DOCS.resolve() else RESULTS) / "tensorboard_page.md"
        record.write_text(provenance(fit, args.steps, run_s, loads, phases))
        written.append(record)

        port = free_port()
        base = f"http://127.0.0.1:{port}"
        board = tensorboard_command() + ["--logdir", str(run_root), "--host", "127.0.0.1", "--port", str(port)]
        print("$ " + shlex.join(board), flush=True)
        tb = subprocess.Popen(board, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_page(base, tags, args.steps, timeout=120)
            shot = out_dir / "tensorboard_memory.png"
            profile = Path(tmp) / "chromium-profile"
            browse = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={args.window}",
                      f"--virtual-time-budget={args.wait_ms}", f"--screenshot={shot}", f"{base}/#custom_scalars"]  # fmt: skip
            print("$ " + shlex.join(browse), flush=True)
            subprocess.run(browse, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
            if not shot.is_file() or shot.stat().st_size == 0:
                raise SystemExit(f"Chromium wrote no screenshot to {shot}")
            written.append(shot)
        finally:
            tb.terminate()
            try:
                tb.wait(timeout=10)
            except subprocess.TimeoutExpired:
                tb.kill()
                tb.wait()

        figure = log_dir / "memory_phases.png"
        docs_text = (DOCS / "memory.md").read_text()
        described = PHASES_TEXT.search(docs_text)
        if not figure.is_file():
            print(f"the run wrote no {figure.name}; docs/memory_phases.png left as it is")
        elif described and int(described.group(1)) == args.steps:
            shutil.copyfile(figure, out_dir / "memory_phases.png")
            written.append(out_dir / "memory_phases.png")
        else:
            said = f"a {described.group(1)}-step run" if described else "no run length"
            print(f"{figure.name} not copied: docs/memory.md describes {said}, this run had {args.steps} steps")
        if args.keep:
            shutil.copytree(log_dir, args.keep, dirs_exist_ok=True)
            written.append(args.keep)

    print("wrote:")
    for path in written:
        print(f"  {path}")
    print("command: " + shlex.join(["python", "bench/tensorboard_page.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
