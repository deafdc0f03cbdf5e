"""bench/bench_quantize.py --quick runs end to end, so the NF4 library comparison cannot rot.

The quick shapes are too small for the timings to mean anything; the checks table and the errors are checked.
"""

from __future__ import annotations

import pytest
from bench_loader import load_bench

pytestmark = [pytest.mark.bench, pytest.mark.slow]  # bench/bench_quantize.py --quick, in this process


@pytest.fixture(scope="module")
def bench():
    with load_bench("bench_quantize.py") as module:
        yield module


def test_quick_bench_prints_both_tables(bench, tmp_path):
    pytest.importorskip("bitsandbytes", reason="the bench compares NF4 libraries; `pip install bitsandbytes`")
    text = bench.main(["--quick", "--out", str(tmp_path)])
    assert text.startswith("# A 4-bit NF4 frozen base: bitsandbytes vs torchao\n")
    assert "This file: `OMP_NUM_THREADS=1 python bench/bench_quantize.py --quick --out" in text
    assert "load average" in text and "bitsandbytes 0." in text
    assert (tmp_path / "quantize.md").read_text().count("| bitsandbytes nf4 + double quant | float32 |") == 1
    checks = text.split("### What a QLoRA policy needs", 1)[1].split("###", 1)[0]
    row = next(ln for ln in checks.splitlines() if ln.startswith("| train after an eval no-grad pass"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["yes", "yes", "yes"]  # dense, and bitsandbytes as lit-rl uses it (repack off)
    rows = [ln for ln in text.splitlines() if ln.startswith("| bitsandbytes nf4 + double quant | float32")]
    value_err, grad_err = (float(c) for c in [c.strip() for c in rows[0].strip("|").split("|")][7:9])
    assert value_err < 1e-5 and grad_err < 1e-5
