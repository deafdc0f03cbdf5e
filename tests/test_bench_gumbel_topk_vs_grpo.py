"""bench/bench_gumbel_topk_vs_grpo.py --quick runs end to end on tiny models, so the GumbelTopK-vs-GRPO comparison cannot rot.

Tiny random models learn nothing in two steps; what is checked is that both methods ran, every table row is there,
the held-out scores are the means of the completions each run wrote, and the plot was drawn.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.slow]  # bench/bench_gumbel_topk_vs_grpo.py --quick in a subprocess

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_gumbel_topk_vs_grpo.py"


def _rows(text: str, heading: str) -> list[list[str]]:
    """Body rows of the first markdown table after ``heading``, as stripped cells."""
    block = text.split(heading, 1)[1]
    block = block[block.index("\n|") + 1 :].split("\n\n", 1)[0]
    return [[c.strip() for c in row.strip("|").split("|")] for row in block.splitlines()[2:]]


def test_quick_bench_writes_every_table_and_the_plot(tmp_path):
    runs, results = tmp_path / "runs", tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(runs), "--results", str(results)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = (results / "gumbel_topk_vs_grpo.md").read_text()
    assert (results / "gumbel_topk_vs_grpo.png").stat().st_size > 10_000
    by_step = _rows(text, "## Held-out scores by step")
    assert [(r[0], r[1]) for r in by_step] == [(m, s) for m in ("GumbelTopK", "GRPO") for s in ("0", "1", "2")]
    for row in by_step:  # the afinn_positive column is the mean over the completions that run wrote at that step
        run = max((runs / row[0] / "lightning_logs").glob("version_*"))
        lines = (run / "heldout" / f"val_step{int(row[1]):06d}.jsonl").read_text().splitlines()
        scores = [json.loads(line)["afinn_positive"] for line in lines]
        assert len(scores) == 4 and float(row[4]) == round(sum(scores) / len(scores), 3)
    assert [r[0] for r in _rows(text, "## At equal wall time")] == ["GumbelTopK", "GRPO"]
    cost = _rows(text, "## Training samples")
    assert [r[0] for r in cost] == ["GumbelTopK", "GRPO"]
    assert cost[0][-1].startswith("generate ") and cost[1][-1].startswith("rollout "), "each method's own phases"
