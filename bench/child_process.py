"""One benchmark measurement in a fresh interpreter: its result line, lifetime peak RSS, wall seconds and load.

The benchmarks that measure a process's peak RSS (``bench_allocator.py``, ``bench_bf16_cpu.py``,
``bench_checkpointing.py``) run each measurement as a child of themselves. The child prints its result as one line,
``<mark>`` followed by JSON (:func:`report`); the parent (:func:`run_measured`) waits for it with ``os.wait4``, whose
``ru_maxrss`` is the kernel's high-water mark of the child's whole lifetime (imports, model load, every step), and
reads the last such line from the child's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Measured:
    """What :func:`run_measured` saw of one child."""

    result: dict[str, Any]  # the JSON of the child's last result line
    peak_rss: int  # bytes: ru_maxrss (KiB on Linux) x 1024
    wall: float  # seconds from start to exit
    load: tuple[float, float]  # 1-minute load average before and after


class ChildFailed(RuntimeError):
    """The child exited with a non-zero code; ``output`` is everything it printed."""

    def __init__(self, code: int, output: str) -> None:
        super().__init__(f"exit {code}")
        self.code, self.output = code, output


def report(mark: str, result: dict[str, Any]) -> None:
    """The child's side: print ``result`` as the line :func:`run_measured` reads."""
    print(mark + json.dumps(result), flush=True)


def run_measured(cmd: list[str], mark: str, env: dict[str, str], log: Path | None = None) -> Measured:
    """Run ``cmd`` from the repository root with ``env``, its output (stdout and stderr) in ``log`` (a temporary
    file when ``None``). Raises :class:`ChildFailed` on a non-zero exit."""
    load0, start = os.getloadavg()[0], time.perf_counter()
    with open(log, "w+") if log is not None else tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0)
        text = out.read()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise ChildFailed(code, text)
    line = next(ln for ln in reversed(text.splitlines()) if ln.startswith(mark))
    return Measured(json.loads(line[len(mark) :]), usage.ru_maxrss * 1024, wall, (load0, os.getloadavg()[0]))
