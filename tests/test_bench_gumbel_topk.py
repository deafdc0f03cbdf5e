"""bench/bench_gumbel_topk.py --quick runs end to end in a subprocess, so the GumbelTopK memory benchmark cannot rot.

The test runs the quick case at vocab 4,096 and 8 new tokens (the default quick case, 49,152 and 32, takes about
5.5 minutes on 2 cores); each of the three paths is measured and must match the estimator's prediction, which runs
the same step on fake tensors.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.slow]  # bench/bench_gumbel_topk.py --quick in a subprocess

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_gumbel_topk.py"
PATHS = ["legacy", "top-k", "top-k + ckpt"]
PHASES = ["generate", "reward", "backward", "optimizer", "**step peak**"]


def _table(text: str, heading: str) -> list[list[str]]:
    """Body rows of the first markdown table after ``heading`` (a table ends at a blank line), as stripped cells."""
    after = text.split(heading, 1)[1]
    block = after[after.index("\n|") + 1 :].split("\n\n", 1)[0]
    return [[c.strip() for c in row.strip("|").split("|")] for row in block.splitlines()[2:]]


def _mib(cell: str) -> float:
    return float(cell.split()[0].replace(",", ""))


def test_quick_bench_prints_every_table(tmp_path):
    done = subprocess.run(
        # a 4,096-token vocabulary and 8 new tokens: every table, in a fraction of the 49k case's minutes
        [sys.executable, str(BENCH), "--quick", "--vocab", "4096", "--new-tokens", "8", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    assert "Command: `python bench/bench_gumbel_topk.py --quick --vocab 4096 --new-tokens 8 --out" in text

    phases = _table(text, "### Per-phase peaks")
    assert [(r[0], r[1], r[2], r[3]) for r in phases] == [("4,096", "8", p, ph) for p in PATHS for ph in PHASES]
    for *_, path, phase, predicted, measured, error, rss in phases:
        assert _mib(predicted) > 0 and _mib(measured) > 0
        assert abs(float(error)) < 1.0, (path, phase)
        assert (_mib(rss) > _mib(measured)) if phase == "**step peak**" else rss == ""

    (summary,) = _table(text, "### Step peak")
    legacy, topk, ckpt = (_mib(c) for c in summary[2:5])
    assert min(legacy, topk, ckpt) > 0
    for cell, (a, b) in zip(summary[5:8], [(legacy, topk), (legacy, ckpt), (topk, ckpt)]):
        assert cell.endswith("x") and abs(float(cell[:-1]) - a / b) < 0.01  # the cells are rounded to 0.1 MiB
    assert float(summary[-1]) < 1.0  # worst phase error %

    assert "(one length only: no growth to show)" in text
    mass = _table(text, "### Top-256 mass")
    assert [r[1] for r in mass] == ["top-k", "top-k + ckpt"]
    assert all(0 < float(r[2]) <= 1 for r in mass)
    breakdown = _table(text, "### Where the steady-state peak goes")
    assert [r[0] for r in breakdown] == ["parameters", "gradients", "optimizer_state", "activations", "temporaries",
                                         "other", "total"]  # fmt: skip

    assert (tmp_path / "gumbel_topk.md").read_text().count("### ") >= 4
    assert (tmp_path / "gumbel_topk_peak_vs_length.png").stat().st_size > 0
