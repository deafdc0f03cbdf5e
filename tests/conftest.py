"""Shared test helpers: a logger that keeps what was logged, an isolated model cache, and the test tiers.

Tiers (markers registered in pyproject.toml): ``slow`` tests take more than a couple of seconds, ``bench`` tests run a
``bench/`` script and ``multiprocess`` tests start several processes; the last two are always also ``slow``, so
``python -m pytest -m "not slow"`` is the fast inner loop and the plain ``python -m pytest`` runs everything.
"""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger


class CaptureLogger(Logger):
    """Keeps every logged metric as ``{key: [(step, value), ...]}``."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, list[tuple[int, float]]] = {}

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append((step, float(value)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # a bench or multiprocess test marked without `slow` still stays out of the fast tier
    for item in items:
        if item.get_closest_marker("bench") or item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def capture_logger() -> CaptureLogger:
    return CaptureLogger()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LIT_RL_CACHE", str(tmp_path_factory.getbasetemp() / "lit-rl-cache"))


@pytest.fixture
def quiet_trainer(tmp_path):
    """``make(**settings)``: a CPU Trainer that writes under the test's folder, with no progress bar, model summary,
    checkpoints or sanity validation, logging every step; ``settings`` add to or override these."""

    def make(**settings) -> Trainer:
        defaults = dict(
            accelerator="cpu", num_sanity_val_steps=0, log_every_n_steps=1, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        )  # fmt: skip
        return Trainer(**{**defaults, **settings})

    return make
