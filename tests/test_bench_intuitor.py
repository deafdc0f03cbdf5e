"""bench/bench_intuitor.py --quick runs end to end in a subprocess, so the Intuitor sweep cannot rot.

The quick path trains configs/intuitor_tiny.yaml (a random two-layer model built in memory) for 2 steps with a
held-out evaluation before the first step and after each, for two settings; the numbers mean nothing, the table's
shape and the files written are checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.slow]  # bench/bench_intuitor.py in a subprocess

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_intuitor.py"
SETTINGS = ["baseline", "mask_truncated"]  # the script's QUICK_SETTINGS
COLUMNS = [
    "setting", "overrides", "held-out accuracy (steps 0, 1, 2)", "held-out clipped share", "held-out mean length",
    "self_certainty/mean first 10 → last 10", "self-certainty per finished completion (masked runs)",
    "training accuracy first 10 → last 10", "final KL", "verdict", "wall s",
]  # fmt: skip


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600)


def _table(text: str) -> tuple[list[str], list[list[str]]]:
    """Header and body rows of the first markdown table, as stripped cells."""
    lines = text[text.index("\n|") + 1 :].split("\n\n", 1)[0].splitlines()  # a table ends at a blank line
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    return cells[0], cells[2:]


def _numbers(cell: str) -> list[float]:
    return [float(v) for v in cell.split(" → ")]


def test_quick_sweep_writes_a_row_per_setting(tmp_path):
    out, results = tmp_path / "runs", tmp_path / "results"
    done = _bench("--quick", "--out", str(out), "--results", str(results))
    assert done.returncode == 0, done.stderr[-3000:]
    text = (results / "intuitor_sweep.md").read_text()
    assert text in done.stdout
    assert f"`python bench/bench_intuitor.py --quick --out {out} --results {results}`" in text
    assert "--config configs/intuitor_tiny.yaml --trainer.max_steps 2 --trainer.val_check_interval 1" in text

    header, rows = _table(text)
    optional = "held-out distinct bigrams"  # a column only when the code logs val/completions/distinct_bigrams
    assert [h for h in header if h != optional] == COLUMNS
    assert [row[0] for row in rows] == SETTINGS
    for row in rows:
        assert len(row) == len(header), row
        cell = dict(zip(header, row))
        accuracy, clipped, length = (_numbers(cell[c]) for c in COLUMNS[2:5])
        assert len(accuracy) == len(clipped) == len(length) == 3  # before training, after step 1, after step 2
        assert all(0 <= v <= 1 for v in accuracy + clipped)
        assert all(0 < v <= 8 for v in length)  # intuitor_tiny.yaml: max_new_tokens 8
        assert len(_numbers(cell["self_certainty/mean first 10 → last 10"])) == 2
        assert cell["verdict"].startswith(("holds", "below the start from step"))
        assert float(cell["wall s"]) > 0
    assert rows[0][1] == "(none)" and rows[1][1] == "`mask_truncated_completions=true`"
    # the per-finished-completion self-certainty is given for the masked run only
    assert rows[0][6] == "—" and rows[1][6] != "—"

    assert (results / "intuitor_sweep.png").stat().st_size > 0
    for name in SETTINGS:
        assert "held-out evaluation before the first training step" in (out / name / "fit.log").read_text()
        assert not list((out / name).rglob("*.ckpt"))
        assert json.loads((out / name / "run.json").read_text())["overrides"] == (
            [] if name == "baseline" else ["--model.init_args.mask_truncated_completions", "true"]
        )

    # read again, not rerun; and the config as it is (intuitor_tiny.yaml: 3 steps, evaluated before and after)
    again = _bench("--quick", "--out", str(out), "--results", str(results), "--reuse", "--settings", "baseline",
                   "--shipped")  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "baseline: reusing" in again.stderr and "baseline: running" not in again.stderr
    text = (results / "intuitor_sweep.md").read_text()
    assert _table(text)[1] == rows[:1]  # the same numbers
    shipped = text.split("## The shipped config, as it is", 1)[1]
    assert "--config configs/intuitor_tiny.yaml --trainer.default_root_dir" in shipped
    assert "--trainer.max_steps" not in shipped
    header, (row,) = _table(shipped)
    assert row[0] == "shipped" and header[2] == "held-out accuracy (steps 0, 3)" and len(_numbers(row[2])) == 2


def test_an_unknown_setting_is_a_usage_error(tmp_path):
    done = _bench("--quick", "--settings", "nope", "--out", str(tmp_path), "--results", str(tmp_path))
    assert done.returncode == 2
    assert "--settings: unknown nope; use some of baseline" in done.stderr
