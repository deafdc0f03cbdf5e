"""Held-out completions of a run before and after training, side by side, from the files its evaluations wrote.

Every held-out evaluation writes ``heldout/val_step<N>.jsonl`` in the run's log folder (one line per completion,
with its prompt and scores). This prints the first and the last evaluation's completions of the same prompts as a
markdown table, with the scores named by ``--keys``.

python bench/heldout_examples.py runs/gumbel_topk/lightning_logs/version_0 --keys afinn_positive --out FILE.md
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def evaluations(run: Path) -> dict[int, list[dict]]:
    """``{steps trained: rows}`` of every held-out evaluation the run wrote."""
    files = sorted((run / "heldout").glob("val_step*.jsonl"))
    if not files:
        raise SystemExit(f"{run}/heldout has no val_step*.jsonl; give a run's log folder (lightning_logs/version_N)")
    return {int(f.stem.removeprefix("val_step")): [json.loads(x) for x in f.read_text().splitlines()] for f in files}


def cell(text: str, limit: int = 160, *, tail: bool = False) -> str:
    """One table cell: white space folded, at most ``limit`` characters (the end of a long text with ``tail``)."""
    text = " ".join(text.split())
    if len(text) > limit:
        text = "…" + text[1 - limit :] if tail else text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def examples(run: Path, keys: list[str], count: int) -> str:
    evals = evaluations(run)
    first, last = min(evals), max(evals)
    after = {row["prompt"]: row for row in evals[last]}
    header = "| prompt | " + " | ".join(f"step {s}" for s in (first, last)) + " |"
    lines = [header, "| --- | --- | --- |"]
    for row in evals[first][:count]:
        end = after.get(row["prompt"])
        if end is None:
            continue
        cells = [
            f"{cell(r['completion'])} ({', '.join(f'{k} {r[k]:g}' for k in keys)})" if keys else cell(r["completion"])
            for r in (row, end)
        ]
        lines.append(
            f"| {cell(row['prompt'], 80, tail=True)} | " + " | ".join(cells) + " |"
        )  # a chat prompt ends in its question
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the run's log folder, e.g. runs/grpo/lightning_logs/version_0")
    parser.add_argument("--keys", nargs="*", default=[], help="scores to show beside each completion")
    parser.add_argument("--count", type=int, default=4, help="prompts to show")
    parser.add_argument("--title", default=None, help="a heading for the written file")
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    table = examples(Path(args.run), args.keys, args.count)
    print(table)
    if args.out:
        cmd = f"python bench/heldout_examples.py {shlex.join(argv if argv is not None else sys.argv[1:])}"
        title = f"# {args.title}\n\n" if args.title else ""
        Path(args.out).write_text(f"{title}Written by `{cmd}`: greedy completions of held-out prompts.\n\n{table}\n")
    return table


if __name__ == "__main__":
    main()
