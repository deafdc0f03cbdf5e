"""constraints.txt: every dependency pinned, each pin inside pyproject's range, and the README installs through it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_every_dependency_and_extra_is_pinned_inside_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    extras = [text for group in project["optional-dependencies"].values() for text in group]  # dev, datasets, ...
    for text in [*project["dependencies"], *extras]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"constraints.txt: {name} is not pinned; rerun the steps in docs/development.md"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt: {name}=={pins[name]} is outside pyproject's {requirement.specifier}"
        )
    # a CUDA build of the same torch release must satisfy the pin, so no local label such as +cpu
    assert pins["torch"].local is None


def test_the_readme_commands_install_through_the_constraints():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)[:2]
    assert len(commands) == 2
    for command in commands:
        assert "pip install -c constraints.txt -e " in command, command
