"""Shared test helpers: a logger that keeps what was logged, Lightning's log lines, an isolated model cache, the
test tiers, and each pytest-xdist worker's share of the CPU threads.

Tiers (markers registered in pyproject.toml): ``slow`` tests take more than a couple of seconds, ``bench`` tests run a
``bench/`` script and ``multiprocess`` tests start several processes; the last two are always also ``slow``, so
``python -m pytest -m "not slow"`` is the fast inner loop and the plain ``python -m pytest`` runs everything.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger


def _share_of_the_cores() -> None:
    """Under pytest-xdist, each worker and every process it starts get ``cores / workers`` CPU threads (unless the
    environment sets them): ``-n 2`` on 2 cores otherwise runs two threads per worker, whose waits on each other
    spin on cores the other worker needs."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, threads)
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_of_the_cores()


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


class _KeepRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def lightning_log():
    """The messages of the INFO (and higher) records that reach ``lightning.pytorch``'s logger, in order.

    Lightning's logger stops propagating when the root logger had no handler at import time, and pytest's ``caplog``
    handles that differently across releases (9.1 attaches its handler to every non-propagating logger, so a test
    that also forced propagation saw each line twice). This handler sits on Lightning's logger itself, so each record
    is kept exactly once whatever pytest does. ``rank_zero_info`` and lit-rl's own lines log under this logger.
    """
    logger = logging.getLogger("lightning.pytorch")
    handler, level = _KeepRecords(), logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level or logging.INFO, logging.INFO))
    messages = _Messages(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class _Messages:
    """A live view of a handler's messages: ``list(log)``, ``"text" in log.text``, ``log.matching("text")``."""

    def __init__(self, handler: _KeepRecords) -> None:
        self._handler = handler

    def __iter__(self):
        return (record.getMessage() for record in self._handler.records)

    @property
    def text(self) -> str:
        return "\n".join(self)

    def matching(self, part: str) -> list[str]:
        return [message for message in self if part in message]


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
