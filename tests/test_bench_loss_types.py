"""bench/bench_loss_types.py --quick runs end to end in a subprocess, so the loss-type comparison cannot rot.

The quick path trains configs/grpo_tiny.yaml (a random model built in memory) for 2 steps per setting, two optimizer
steps per rollout batch, with a held-out evaluation before the first step and after each; the numbers mean nothing,
the table's shape, the settings' overrides reaching the runs and the reuse path are checked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.bench, pytest.mark.slow]  # bench/bench_loss_types.py in a subprocess

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_loss_types.py"


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600)


def test_quick_run_writes_a_row_per_setting_and_reuses_its_runs(tmp_path):
    out, results = tmp_path / "runs", tmp_path / "results"
    done = _bench("--quick", "--out", str(out), "--results", str(results))
    assert done.returncode == 0, done.stderr[-3000:]
    text = (results / "loss_types.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| setting", "| ---"))]
    assert [r.split("|")[1].strip() for r in rows] == ["dapo", "gspo", "cispo"]
    for row in rows:
        reward, accuracy = (c.strip() for c in row.strip("|").split("|")[2:4])
        # first and last window; evaluations before the first step and after it
        assert len(reward.split(" → ")) == 2 and len(accuracy.split(" → ")) == 2
    saved = yaml.safe_load(next((out / "cispo").rglob("config.yaml")).read_text())["model"]["init_args"]
    assert (saved["loss_type"], saved["epsilon_high"], saved["num_iterations"]) == ("cispo", 5.0, 2)
    saved = yaml.safe_load(next((out / "gspo").rglob("config.yaml")).read_text())["model"]["init_args"]
    assert saved["importance_sampling_level"] == "sequence"
    again = _bench("--quick", "--reuse", "--out", str(out), "--results", str(results))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "+ " not in again.stderr  # nothing was run again
