"""bench/bench_allocator.py --quick runs end to end (fresh subprocesses, one per option), so it cannot rot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.slow]  # bench/bench_allocator.py --quick, one fresh subprocess per option

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_allocator.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_allocator", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_bench_prints_a_row_per_option_and_resumes(bench, tmp_path, capsys):
    results = tmp_path / "runs.jsonl"
    text = bench.main(["--quick", "--results", str(results)])
    assert text in capsys.readouterr().out
    assert "Command: `python bench/bench_allocator.py --quick" in text
    body = text.split("### tiny", 1)[1].splitlines()[4:]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in body if ln.startswith("|")]
    assert [r[0] for r in rows] == ["none", "trim", "env 64K"]
    for option, rss, _spread, _tensor, baseline, ratio, *_ in rows:
        assert float(rss) > 0 and float(baseline) > 0 and float(ratio.rstrip("x")) > 0, option
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert {(r["option"], r["run"]) for r in records} == {
        ("none", "0"),
        ("trim", "0"),
        ("env 64K", "0"),
        ("none", "profile"),
    }
    assert all(r["peak_rss"] > 0 and r["times"] and len(r["cpu"]) == len(r["times"]) for r in records)
    # a second call with the same results file measures nothing again: the same table
    assert bench.main(["--quick", "--results", str(results)]).split("\n", 2)[2] == text.split("\n", 2)[2]
