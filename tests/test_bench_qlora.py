"""bench/bench_qlora.py --quick runs end to end in a subprocess, so the QLoRA benchmark cannot rot.

The quick path trains configs/grpo_lora.yaml and configs/grpo_qlora.yaml on a random two-layer model (tiny:llama)
for 2 steps, profiles 2 steps of each in float32 and bfloat16, and estimates both methods' LoRA configs on the tiny
model with a dense and an NF4 base; the numbers mean nothing, the tables, the saved per-unit JSON and the reuse path
are checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.slow]  # bench/bench_qlora.py in a subprocess

pytest.importorskip("bitsandbytes", reason="model.quantize_base: nf4 needs bitsandbytes")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_qlora.py"
UNITS = ["learning-lora", "learning-qlora", "memory-fp32", "memory-bf16", "memory-nf4-fp32", "memory-nf4-bf16",
         "memory-weights", "estimates-grpo-7b-none", "estimates-grpo-7b-nf4", "estimates-gumbel-4b-none",
         "estimates-gumbel-4b-nf4", "estimates-grpo-7b-mb1-none", "estimates-grpo-7b-mb1-nf4"]  # fmt: skip


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=900)


def _rows(text: str, first_cell: str) -> list[list[str]]:
    """Body rows (stripped cells) of the markdown table whose header starts with ``first_cell``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_cell} |"))
    body = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        body.append([c.strip() for c in ln.strip("|").split("|")])
    return body


def test_quick_run_writes_every_part_and_reuses_saved_units(tmp_path):
    out, results = tmp_path / "runs", tmp_path / "results"
    done = _bench("--quick", "--out", str(out), "--results", str(results))
    assert done.returncode == 0, done.stderr[-3000:]
    text = (results / "qlora.md").read_text()
    assert text in done.stdout
    assert sorted(p.stem for p in (out / "json").glob("*.json")) == sorted(UNITS)
    assert "+changes" in text or "At commit " in text
    assert "bitsandbytes " in text and "load average" in text

    # part 1: a row per base, two evaluations after the one before training
    learning = _rows(text, "base")
    assert [r[0] for r in learning] == ["dense bf16 (grpo_lora)", "NF4 (grpo_qlora)"]
    for row in learning:
        assert len(row[1].split(" → ")) == 2
        assert row[2].endswith("(0, 1, 2)") and len(row[2].split(" (")[0].split(" → ")) == 3
        assert float(row[3]) > 0
    saved = json.loads((out / "json" / "learning-qlora.json").read_text())
    assert "--config configs/grpo_qlora.yaml" in saved["command"] and saved["steps"] == 2

    # part 2: every phase measured and predicted in each of the four columns; NF4 storage a quarter of bf16's
    memory = _rows(text, "phase")
    assert [r[0] for r in memory] == ["rollout", "reference", "policy_forward", "backward", "optimizer", "step"]
    for row in memory:
        assert len(row) == 5 and all(" / " in c and "(" in c for c in row[1:]), row
    weights = json.loads((out / "json" / "memory-weights.json").read_text())
    assert 0.25 * weights["dense_bf16"] < weights["nf4"] < 0.3 * weights["dense_bf16"]
    run = next((out / "memory" / "nf4-bf16").rglob("memory_summary.json"))
    assert json.loads(run.read_text())["measurement"] == "tensor accounting"

    # part 3: every case, both bases, a step row whose NF4 peak is below the dense one
    assert text.count("| phase | dense base GiB | NF4 base GiB | NF4 / dense |") == 3
    for case in ("grpo-7b", "grpo-7b-mb1", "gumbel-4b"):
        dense, nf4 = (json.loads((out / "json" / f"estimates-{case}-{q}.json").read_text()) for q in ("none", "nf4"))
        assert 0 < nf4["phases"]["step"] < dense["phases"]["step"]
        assert "base weights (NF4)" in nf4["components"] and "base weights (NF4)" not in dense["components"]

    # read again, not rerun; estimates skipped but kept in the file from their saved JSON
    again = _bench("--quick", "--out", str(out), "--results", str(results), "--reuse", "--skip-estimates")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "learning-lora: reusing" in again.stderr and "+ " not in again.stderr
    assert (results / "qlora.md").read_text().split("## 1.")[1] == text.split("## 1.")[1]


def test_an_unknown_unit_is_a_usage_error(tmp_path):
    done = _bench("--quick", "--units", "nope", "--out", str(tmp_path), "--results", str(tmp_path))
    assert done.returncode == 2
    assert "--units: unknown nope; use some of" in done.stderr
