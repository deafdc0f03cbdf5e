"""Load a ``bench/`` script as a module, for the tests that run its ``--quick`` mode in this process."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


@contextmanager
def load_bench(filename: str) -> Iterator[ModuleType]:
    """``bench/<filename>`` imported under its own name while the block runs (dataclasses look their module up in
    ``sys.modules``), then forgotten. ``bench/`` is first on the module path meanwhile, as it is for
    ``python bench/<filename>``, so the script's ``import harness`` resolves."""
    spec = importlib.util.spec_from_file_location(Path(filename).stem, BENCH / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop(spec.name, None)
