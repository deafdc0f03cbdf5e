"""bench/bench_checkpointing.py --quick runs end to end (a fresh subprocess per every_n_layers), so it cannot rot."""

from __future__ import annotations

import pytest
from bench_loader import load_bench

pytestmark = [pytest.mark.bench, pytest.mark.slow]  # bench/bench_checkpointing.py --quick, three fresh subprocesses


@pytest.fixture(scope="module")
def bench():
    with load_bench("bench_checkpointing.py") as module:
        yield module


def test_quick_bench_writes_a_row_per_setting(bench, tmp_path, capsys):
    out = tmp_path / "checkpointing.md"
    text = bench.main(["--quick", "--out", str(out)])
    assert text in capsys.readouterr().out and out.read_text() == text
    assert "Command: `python bench/bench_checkpointing.py --quick --out" in text
    assert "Load average (1, 5, 15 min):" in text
    body = text.split("## LoRA at 128 tokens", 1)[1].splitlines()
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in body if ln.startswith("| ") and "---" not in ln]
    rows = rows[1:]  # the header
    assert [r[0] for r in rows] == ["off", "1", "2"]
    assert [r[1] for r in rows] == ["0 of 2", "2 of 2", "1 of 2"]  # tiny:llama has two layers
    peaks = {r[0]: float(r[2]) for r in rows}
    predicted = {r[0]: float(r[3]) for r in rows}
    assert peaks["1"] <= peaks["2"] <= peaks["off"] and peaks["1"] < peaks["off"]
    for setting, peak in peaks.items():
        assert predicted[setting] == pytest.approx(peak, rel=0.25), setting
    for row in rows:
        assert float(row[10]) > 0 and int(row[12]) == 1, row  # one unprofiled step timed per run
