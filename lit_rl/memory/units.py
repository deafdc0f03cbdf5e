"""Byte sizes: the units every memory tool prints in, one formatter and one parser."""

from __future__ import annotations

import re

GIB = 2**30
MIB = 2**20

_UNITS = {
    "": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip


def format_bytes(n: float) -> str:
    """``1.50 GiB``, ``12.00 MiB``, ``3.00 KiB`` or ``12 B``."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> bytes. Binary units (``KiB``, ``MiB``, ``GiB``, ``TiB``, and bare ``K/M/G/T``) and decimal ones
    (``kB``, ``MB``, ``GB``, ``TB``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 80GiB, 24GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
