"""The full-logits baselines of GRPO and Intuitor (``bench_policy_update.py``) and the legacy Gumbel path
(``gumbel_legacy.py``, measured by ``bench_gumbel_topk.py``), each run as it is, in its own process, for part 2 of
``bench/run.py``."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands(quick: bool, tmp: str) -> dict[str, list[str]]:
    """Script arguments per baseline; ``quick``: the scripts' own smoke sizes (a 2,048 vocabulary and 4 new tokens for Gumbel)."""
    if quick:
        return {
            "GRPO and Intuitor: logits-free vs full logits": ["bench/bench_policy_update.py", "--quick"],
            "GumbelTopK: legacy full-vocabulary path vs top-k": [
                "bench/bench_gumbel_topk.py", "--quick", "--vocab", "2048", "--new-tokens", "4", "--out", tmp],
        }  # fmt: skip
    return {
        "GRPO and Intuitor: logits-free vs full logits": ["bench/bench_policy_update.py"],
        # the quick case of the Gumbel grid (vocab 49,152, 32 new tokens, the three paths): the full grid takes
        # over an hour on 2 cores; bench/results/gumbel_topk.md has it
        "GumbelTopK: legacy full-vocabulary path vs top-k": ["bench/bench_gumbel_topk.py", "--quick", "--out", tmp],
    }


def run(quick: bool, log=print) -> list[tuple[str, str, str]]:
    """``[(title, command, markdown printed by the script)]``."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for title, args in commands(quick, tmp).items():
            shown = "python " + " ".join("<tmp>" if a == tmp else a for a in args)
            log(f"  {shown}")
            done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{shown} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            out.append((title, shown, done.stdout.strip()))
    return out


def demote_headings(text: str, levels: int = 1) -> str:
    """Markdown headings one level deeper, so a script's ``###`` sections nest under the suite's own."""
    return "\n".join("#" * levels + line if line.startswith("#") else line for line in text.splitlines())
