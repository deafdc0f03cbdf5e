"""Shared test helpers: a logger that keeps what was logged, and an isolated model cache."""

from __future__ import annotations

import pytest
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


@pytest.fixture
def capture_logger() -> CaptureLogger:
    return CaptureLogger()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LIT_RL_CACHE", str(tmp_path_factory.getbasetemp() / "lit-rl-cache"))
