"""``StepTimer``: wall time of every training step and the process's peak RSS, written as JSON when training ends.

The lit-rl side of ``bench/vs_trl.py`` adds it with ``--trainer.callbacks+`` (``bench/`` on ``PYTHONPATH``), so the
step time is measured the way the TRL side measures it: from the start of a batch to its end, optimizer included.

Example::

    PYTHONPATH=.:bench python -m lit_rl fit --config bench/grpo_vs_trl.yaml \\
        --trainer.callbacks+ step_timer.StepTimer --trainer.callbacks+.out /tmp/steps.json
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from harness import peak_rss_bytes
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class StepTimer(Callback):
    """Times each training step (``on_train_batch_start`` to ``on_train_batch_end``) and records the peak RSS.

    Args:
        out: the JSON file to write: ``{"step_s": [...], "peak_rss_bytes": int, "threads": int}``, on CUDA also
            ``cuda_max_allocated_bytes`` and ``cuda_max_reserved_bytes``.
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self.step_s: list[float] = []
        self._start = 0.0

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_s.append(time.perf_counter() - self._start)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        import torch

        record = {"step_s": self.step_s, "peak_rss_bytes": peak_rss_bytes(), "threads": torch.get_num_threads(),
                  "pid": os.getpid()}  # fmt: skip
        if torch.cuda.is_available():  # the whole run's allocator peaks (bench/device_check.py reads them)
            record["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
            record["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
        Path(self.out).write_text(json.dumps(record))
