"""What every benchmark shares: provenance, a measured child process, a run's logs, and the results file's header.

A benchmark measures the product the way a user runs it (``lit-rl fit`` with overrides, in a fresh process) and
tabulates what the run logged, as litgpt's and torchtune's benchmark tables do. This module is imported by name
(``import harness``): ``python bench/<script>.py`` puts the script's own folder on the module path first.
The library itself comes from the environment (``pip install -e .`` in this checkout); the child ``lit-rl fit``
runs as ``python -m lit_rl`` from the repository root, so it always runs this checkout's code.

- **provenance**: :func:`git_commit`, :func:`versions`, :func:`cpu_model`, :func:`cpu_flags`, :func:`load_average`;
- **a measured child**: :func:`run_measured` (any command; lifetime peak RSS from ``os.wait4``, wall seconds, the
  1-minute load average before and after, its last result line) and :func:`run_fit` (``lit-rl fit`` writing to a
  folder, with a ``bench_run.json`` record so a table can be rebuilt from runs already made; this checkout's code or
  a given commit's, :func:`export_commit`); what a run does not log by itself, a probe in ``bench/probes.py`` logs;
- **a run's logs**: :func:`read_scalar_events`, :func:`read_scalars`, :func:`training_seconds`,
  :func:`median_step_seconds` (TensorBoard);
- **the results file**: :func:`header_lines` (the command that reproduces the file, the machine, the commit,
  versions, and the note that times depend on the machine's load while tensor bytes do not) and
  :func:`markdown_table`;
- **``lit-rl estimate``'s printed tables**: :func:`estimated_step_gib` (the step's predicted tensor peak),
  :func:`planner_choice` (the row ``--plan`` chose), and :func:`last_line` (a child's one-line error).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = ("torch", "lightning", "transformers", "peft")
LOAD_NOTE = (
    "Wall times and peak RSS depend on the machine and its load (the load average is given); tensor bytes do not. "
    "Seeded rewards and scores do not depend on the load; in bf16 they can differ between CPU models, whose bf16 "
    "kernels round differently."
)


# ------------------------------------------------------------------------------------------------ provenance
def git_commit(ref: str = "HEAD", *, cwd: Path = ROOT) -> str:
    """Short hash of ``ref``, with ``+changes`` when ``ref`` is HEAD and tracked files differ from it.

    ``bench/results`` is left out of the comparison: it holds what the runs write (a study's ``before`` step writes
    a results file before its first run), not code a run executes."""
    head = subprocess.run(["git", "rev-parse", "--short", ref], cwd=cwd, capture_output=True, text=True)
    if ref != "HEAD":
        return head.stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"],
                           cwd=cwd, capture_output=True)  # fmt: skip
    return (head.stdout.strip() or "unknown") + ("+changes" if dirty.stdout.strip() else "")


def versions(dists: tuple[str, ...] = ("torch", "bitsandbytes", "torchao", "peft", "transformers")) -> dict[str, str]:
    """``{distribution: installed version or "not installed"}``."""
    out = {}
    for dist in dists:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _cpuinfo(field: str) -> str | None:
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith(field))
    except (OSError, StopIteration):
        return None
    return line.split(":", 1)[1].strip()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows of it."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> str:
    """Which of the instruction sets that change a CPU's matmul speed it has."""
    flags = _cpuinfo("flags")
    if flags is None:
        return "?"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return ", ".join(f for f in wanted if f in flags.split()) or "none of avx2/avx512"


def best_seconds(fn, repeats: int) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` after one untimed call (a micro-benchmark's figure)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def machine(threads: int | None = None) -> str:
    """One line: cores, CPU model and flags, torch threads per run if given, Python."""
    cores = f"{os.cpu_count()} CPU cores ({cpu_model()}; {cpu_flags()})"
    per_run = f", {threads} CPU thread(s) per run" if threads else ""
    return f"{cores}{per_run}, {platform.machine()}, Python {platform.python_version()}"


def header_lines(
    title: str,
    command: str,
    *,
    this_file: str | None = None,
    commit: str | None = None,
    loads: list[float] | None = None,
    threads: int | None = None,
    dists: tuple[str, ...] = DISTRIBUTIONS,
) -> list[str]:
    """The opening of a results file: title, the command that regenerates it (and the one that wrote this file when
    it differs), the commit, the machine, package versions, the load average during the runs, and the load note."""
    loads = [x for x in (loads or []) if x is not None]
    load = f"; 1-minute load average {min(loads):.1f}-{max(loads):.1f} during the runs" if loads else ""
    wrote = f" This file: `{this_file}`." if this_file and this_file != command else ""
    return [
        f"# {title}",
        "",
        f"Regenerate: `{command}`.{wrote} At commit {commit or git_commit()}.  ",
        f"Machine: {machine(threads)}{load}.  ",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions(dists).items()) + ".  ",
        LOAD_NOTE,
        "",
    ]


# ---------------------------------------------------------------------------------------- measured child
@dataclass
class Measured:
    """What :func:`run_measured` saw of one child."""

    result: dict[str, Any]  # the JSON of the child's last result line ({} without a mark)
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


def run_measured(
    cmd: list[str],
    mark: str | None,
    env: dict[str, str],
    log: Path | None = None,
    *,
    cwd: Path = ROOT,
    stderr: Path | None = None,
) -> Measured:
    """Run ``cmd`` from ``cwd`` (the repository root) with ``env``, its output (stdout and stderr) in ``log`` (a
    temporary file when ``None``); with ``stderr`` (a file), the child's stderr goes there and ``log`` holds its
    stdout alone (what a results file quotes). ``os.wait4``'s ``ru_maxrss`` is the kernel's high-water mark of the
    child's whole lifetime. With a ``mark``, the child's last line starting with it is its result. Raises
    :class:`ChildFailed` on a non-zero exit, with both outputs."""
    load0, start = load_average(), time.perf_counter()
    with (
        open(log, "w+") if log is not None else tempfile.TemporaryFile("w+") as out,
        open(stderr, "w+") if stderr is not None else tempfile.TemporaryFile("w+") as err,
    ):
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT if stderr is None else err, text=True
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        text, errors = out.read(), err.read()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise ChildFailed(code, text + errors)
    result = {}
    if mark is not None:
        line = next(ln for ln in reversed(text.splitlines()) if ln.startswith(mark))
        result = json.loads(line[len(mark) :])
    return Measured(result, usage.ru_maxrss * 1024, wall, (load0, load_average()))


def measure_rates(out: str | Path, env: dict[str, str], *flags: str) -> None:
    """This machine's matmul rates and bandwidth, ``lit-rl rates --out OUT [flags]`` in a child: the file a
    MemoryProfiler's ``rates`` reads for its roofline. The command goes to stderr first."""
    cmd = [sys.executable, "-m", "lit_rl", "rates", "--out", str(out), *flags]
    print(f"+ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    run_measured(cmd, None, env)


def thread_env(threads: int | None, *, code: Path = ROOT) -> dict[str, str]:
    """This process's environment for a child: ``code`` (this checkout, or another commit's, see
    :func:`export_commit`) first on ``PYTHONPATH`` (so a child that runs a script, not ``-m lit_rl`` from the root,
    also imports that library), this checkout's ``bench/`` last (so a run's ``--trainer.callbacks+=probes.<Probe>``
    imports), and ``threads`` CPU threads (a fixed count also fixes the floating-point order, so seeded numbers
    repeat)."""
    paths = [str(code), os.environ.get("PYTHONPATH"), str(ROOT / "bench")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def export_commit(rev: str, folder: Path) -> Path:
    """The files of commit ``rev`` (code and configs) written to ``folder`` with ``git archive``: a run of the code
    before a change, beside this checkout's, without a worktree to clean up."""
    folder.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def fit_command(config: str, root: Path, overrides: list[str]) -> list[str]:
    """``python -m lit_rl fit --config config --trainer.default_root_dir root <overrides>``."""
    return [sys.executable, "-m", "lit_rl", "fit", "--config", config, "--trainer.default_root_dir", str(root),
            *overrides]  # fmt: skip


def run_fit(
    config: str,
    root: Path,
    overrides: list[str],
    *,
    reuse: bool = False,
    threads: int | None = None,
    env: dict[str, str] | None = None,
    commit: str | None = None,
) -> tuple[Path, dict[str, float]]:
    """``lit-rl fit --config config`` in a fresh process writing to ``root``: the run's TensorBoard folder, and its
    wall seconds, peak RSS (bytes) and the 1-minute load average before and after, saved in ``root/bench_run.json``
    (``reuse``: those of an earlier run in ``root``, nothing rerun). The output is in ``root/fit.log``. ``env``:
    variables added to the child's environment (set before Python starts, e.g. ``LD_PRELOAD``); ``commit``: run that
    commit's code and config instead of this checkout's."""
    root = root.resolve()  # another commit's code runs from its own folder
    cmd = fit_command(config, root, overrides)
    record = root / "bench_run.json"
    if not (reuse and record.exists()):
        root.mkdir(parents=True, exist_ok=True)
        print(f"+ {shlex.join(cmd)}" + (f"  (code of {commit})" if commit else ""), file=sys.stderr, flush=True)
        code_commit = git_commit(commit) if commit else git_commit()  # before the run: HEAD may move meanwhile
        with tempfile.TemporaryDirectory(prefix="lit_rl_code_") as tmp:
            code = export_commit(commit, Path(tmp)) if commit else ROOT
            try:
                child_env = {**thread_env(threads, code=code), **(env or {})}
                done = run_measured(cmd, None, child_env, root / "fit.log", cwd=code)
            except ChildFailed as e:
                raise SystemExit(
                    f"error: `{shlex.join(cmd)}` failed (exit {e.code}); its output is in {root}/fit.log"
                ) from None
        info = {"wall": done.wall, "load_before": done.load[0], "load_after": done.load[1],
                "peak_rss": done.peak_rss, "commit": code_commit}  # fmt: skip
        record.write_text(json.dumps(info))
    run = max((root / "lightning_logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    return run, json.loads(record.read_text())


# ---------------------------------------------------------------------------------------------- a run's logs
def read_scalar_events(run_dir: str, keys: list[str] | None, *, optional: bool = False) -> dict[str, list]:
    """``{key: [event]}`` from a run's TensorBoard files, each event with ``step``, ``wall_time`` and ``value``
    (``keys`` None: every scalar); ``optional``: skip missing keys."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    keys = sorted(tags) if keys is None else keys
    missing = [k for k in keys if k not in tags]
    if missing and not optional:
        raise SystemExit(f"{run_dir} has no scalar {missing}; it has {sorted(tags)}")
    return {k: list(acc.Scalars(k)) for k in keys if k in tags}


def read_scalars(run_dir: str, keys: list[str], *, optional: bool = False) -> dict[str, list[tuple[int, float]]]:
    """``{key: [(step, value)]}``; ``optional``: skip missing keys."""
    events = read_scalar_events(run_dir, keys, optional=optional)
    return {k: [(e.step, e.value) for e in v] for k, v in events.items()}


def training_seconds(run: Path) -> dict[int, float]:
    """``{steps trained: seconds}``: the sum of the logged phase times (``time/*_s``) of the first N optimizer steps
    (step N's metrics are logged at index N - 1)."""
    per_step: dict[int, float] = {}
    for tag, events in read_scalar_events(str(run), None).items():
        if tag.startswith("time/") and tag.endswith("_s"):
            for e in events:
                per_step[e.step] = per_step.get(e.step, 0.0) + e.value
    total, out = 0.0, {0: 0.0}
    for index in sorted(per_step):
        total += per_step[index]
        out[index + 1] = total
    return out


def median_step_seconds(run: Path) -> float | None:
    """The median of a run's per-step summed phase times (:func:`training_seconds`), the first step (warm-up) left
    out; None with fewer than two steps."""
    seconds = training_seconds(run)
    steps = sorted(seconds)
    each = [seconds[b] - seconds[a] for a, b in zip(steps, steps[1:])][1:]
    return statistics.median(each) if each else None


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def relative(path: Path) -> str:
    """``path`` relative to the repository root when it is inside it, so a command in a results file copies."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def shown(overrides: list[str]) -> str:
    """``--model.init_args.key value`` pairs as ``key=value``, for a table."""
    pairs = zip(overrides[::2], overrides[1::2])
    return ", ".join(f"`{k.split('.')[-1]}={v}`" for k, v in pairs) or "(none)"


def markdown_table(headers: list[str], rows: list[list[Any]], align: list[str] | None = None) -> list[str]:
    """A Markdown table's lines: the header, the alignment row (the first column left, the others right unless
    ``align`` gives one marker per column, e.g. ``"---"``), and one line per row, each cell ``str()``-ed."""
    align = align or ["---"] + ["---:"] * (len(headers) - 1)
    return ["| " + " | ".join(line) + " |" for line in (headers, align, *([str(c) for c in r] for r in rows))]


def write_results(lines: list[str], out: str) -> str:
    """The results file's text from its ``lines``: written to ``out`` (said in one line), or printed for ``-``."""
    text = "\n".join(lines) + "\n"
    if out == "-":
        print(text)
    else:
        Path(out).write_text(text)
        print(f"wrote {out}")
    return text


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size (``VmHWM`` from ``/proc/self/status``), or ``None`` off Linux: what a
    child reports of itself when the parent cannot wait on it (a trainer's steps, timed from inside)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ------------------------------------------------------------------------------- lit-rl estimate's printed tables
_PLAN_ROW = re.compile(r"\s(-?[\d.]+ (?:[KMGT]i)?B)\s+-?[\d.]+ (?:[KMGT]i)?B\s+(\S+)\s+yes\s+<- plan\s*$")


def estimated_step_gib(text: str) -> float | None:
    """The step's predicted tensor peak in GiB: the ``step`` row of ``lit-rl estimate``'s phase table (``step
    2.7165   2.72 GiB ...``), or None when ``text`` has none."""
    found = re.search(r"^step\s+(\d+\.\d+)\s", text, re.MULTILINE)
    return float(found[1]) if found else None


def planner_choice(text: str) -> dict[str, str] | None:
    """The row ``lit-rl estimate --plan`` marks ``<- plan``: ``{"plan": its tactics, "predicted": its predicted
    peak ("1.52 GiB"), "time": its roofline time against the config's ("1.83x")}``, or None when no row is marked
    (the planner exits 2 when no tactic fits, its last line naming the smallest peak reached)."""
    chosen = next((ln for ln in text.splitlines() if ln.rstrip().endswith("<- plan")), "")
    row = _PLAN_ROW.search(chosen)
    if row is None:
        return None
    return {"plan": chosen[: row.start()].strip(), "predicted": row[1], "time": row[2]}


def last_line(done: subprocess.CompletedProcess) -> str:
    """A finished child's last line of output (stderr if it wrote any, else stdout), at most 300 characters: where
    ``lit-rl`` puts its one-line error, and the planner the smallest peak it reached."""
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return tail[0][:300]
