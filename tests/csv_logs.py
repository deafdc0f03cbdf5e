"""Reading what a run logged with Lightning's CSVLogger, for the tests that check logged metrics."""

from __future__ import annotations

import csv
from pathlib import Path


def logged(folder: Path, key: str) -> dict[int, float]:
    """``{step: value}`` of one metric over every CSV log under ``folder`` (a resumed run writes a new version)."""
    values = {}
    for path in sorted(folder.rglob("metrics.csv")):
        for row in csv.DictReader(path.open()):
            if row.get(key):
                values[int(row["step"])] = float(row[key])
    return values
