"""Every memory figure in a config header is what `lit-rl estimate` says, and names the command that says it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from lit_rl.cli import estimate_from_args
from lit_rl.memory.units import GIB

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"(\d+(?:\.\d+)?) GiB")
CITED = re.compile(r"(\d+\.\d+) GiB of tensors at the step peak.*`lit-rl estimate ([^`]+)`")


def _header(config: Path) -> list[str]:
    lines = config.read_text().splitlines()
    return [line for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]]


def _figures() -> list[tuple[str, float, str]]:
    out = []
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        for line in _header(config):
            match = CITED.search(line)
            if match:
                out.append((config.name, float(match.group(1)), match.group(2)))
    return out


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_a_memory_figure_in_a_header_cites_the_estimate(config):
    for line in _header(config):
        if FIGURE.search(line):
            assert CITED.search(line), f"{config.name}: '{line}' gives GiB without `lit-rl estimate ...` beside it"


@pytest.mark.slow  # estimates at full model size, one per cited command
@pytest.mark.parametrize(("config", "figure", "args"), _figures(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_figure_is_what_the_estimate_says(config, figure, args, monkeypatch):
    monkeypatch.chdir(ROOT)  # the cited command runs from the repository root
    estimate, _, _ = estimate_from_args(shlex.split(args))
    assert round(estimate.peak_bytes / GIB, 2) == figure, f"{config}: header says {figure} GiB"
