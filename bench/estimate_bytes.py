"""Exact predicted bytes per phase (steady state and first step) for every config of ``bench_estimate.py``, as JSON.

Writes ``bench/results/estimate_bytes.json`` (or the path given), with the commit and versions beside the numbers.
Tensor bytes do not depend on the machine or its load, so the committed file is rerun, not apologised for, whenever
the estimator changes (a few seconds). To show that a change to the estimator moved no prediction (or which), run it
on two commits and diff::

    python bench/estimate_bytes.py                       # bench/results/estimate_bytes.json
    python bench/estimate_bytes.py /tmp/after.json
    git stash; git checkout <older commit>; python bench/estimate_bytes.py /tmp/before.json

Each config is estimated at its own ``max_prompt_length`` and at ``--prompt-length 44`` (the embedded run's real
prompt width). ``estimate_from_args`` is what ``lit-rl estimate`` runs (``lit_rl.cli``): its result object has the
exact bytes per phase, which the command's printed table rounds.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import warnings
from pathlib import Path

import bench_estimate
import harness

from lit_rl.cli import estimate_from_args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    warnings.filterwarnings("ignore")
    out: dict[str, dict[str, dict[str, int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = bench_estimate.prompts_file(tmp)
        for name, args in bench_estimate.CONFIGS.items():
            args = [a.format(prompts_jsonl=prompts) for a in args]
            for extra in ([], ["--prompt-length", "44"]):
                estimate, _, _ = estimate_from_args(args + extra)
                key = f"{name} {' '.join(extra)}".strip()
                out[key] = {"phases": estimate.phases, "first_step": estimate.first_step}
                print(key, estimate.phases, file=sys.stderr, flush=True)
    saved = {
        "command": shlex.join(["python", "bench/estimate_bytes.py", *argv]),
        "commit": harness.git_commit(),
        "versions": harness.versions(harness.DISTRIBUTIONS),
        "note": "exact predicted tensor bytes per phase; they do not depend on the machine or its load",
        "estimates": out,
    }
    path = Path(argv[0]) if argv else harness.ROOT / "bench" / "results" / "estimate_bytes.json"
    path.write_text(json.dumps(saved, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return saved


if __name__ == "__main__":
    main()
