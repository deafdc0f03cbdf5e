"""Exact predicted bytes per phase (steady state and first step) for every config of ``bench_estimate.py``, as JSON.

Run it on two commits and compare, to show that a change to the estimator moved no prediction (or which):

    python bench/estimate_bytes.py /tmp/after.json
    git stash; git checkout <older commit>; python bench/estimate_bytes.py /tmp/before.json   # same script

Each config is estimated at its own ``max_prompt_length`` and at ``--prompt-length 44`` (the embedded run's real
prompt width). Tensor bytes do not depend on machine load. The script imports ``estimate_from_args`` from where it
lives (``lit_rl.cli`` now, ``lit_rl.memory.estimate`` before the architecture change), so it runs on both.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

import bench_estimate

try:
    from lit_rl.cli import estimate_from_args
except ImportError:  # before the architecture change the estimator held its own CLI
    from lit_rl.memory.estimate import estimate_from_args


def main() -> None:
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
                print(key, estimate.phases, flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
