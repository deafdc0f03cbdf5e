"""
Run Log
=======

Plain lines that let a run be followed from a log file: where everything goes, progress, held-out scores, and
a summary at the end.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lit_rl.callbacks.memory_profiler import MemoryProfiler
from lit_rl.memory.roofline import summary_line
from lit_rl.memory.rss import probe_rss_source, read_peak_rss
from lit_rl.memory.units import GIB, format_bytes


class RunLog(Callback):
    r"""Writes a run's story as plain log lines (rank zero, Lightning's ``INFO`` logger, so they reach log files).

    - **At the start**: where the logs and TensorBoard events, the saved config, the checkpoints and the
      memory files go (everything follows ``trainer.default_root_dir`` unless a logger names its own ``save_dir``).
    - **Every N steps** (``progress``): ``step 10/60 | reward 0.412 | kl 0.0013 | 21.4 s/step | peak 3.27 GiB``.
      The peak is the MemoryProfiler's tensor peak of the step when it measured it, otherwise the process's
      peak RSS (``rss``) or the CUDA allocator's peak (``cuda``). The progress bar draws only on a terminal,
      so by default these lines are written when stderr is not one (a log file, a batch job).
    - **After each held-out evaluation**: its ``val/*`` scores.
    - **At the end** (and when the run fails): steps done, first and last training reward, first and last
      held-out scores, the steady-state peak per phase and each phase's median time beside its floor (the least time
      the hardware needs for its FLOPs and bytes) when a MemoryProfiler ran, and every file written (checkpoints with
      their sizes).

    **Logged Metrics**: none; it reads what the method and the other callbacks logged.

    Args:
        every_n_steps: a progress line every this many optimizer steps (and after the first).
        progress: ``auto`` (only when stderr is not a terminal or the progress bar is off), ``always`` or ``never``.

    Raises:
        MisconfigurationException: ``every_n_steps < 1`` or an unknown ``progress``.

    Example::

        trainer:
          callbacks:
            - class_path: lit_rl.callbacks.RunLog
              init_args: {every_n_steps: 5}
    """

    def __init__(self, every_n_steps: int = 10, progress: str = "auto") -> None:
        if every_n_steps < 1:
            raise MisconfigurationException(f"RunLog(every_n_steps={every_n_steps}): use 1 or more.")
        if progress not in ("auto", "always", "never"):
            raise MisconfigurationException(f"RunLog(progress={progress!r}): use auto, always or never.")
        self.every_n_steps = every_n_steps
        self.progress = progress
        self._show_progress = False
        self._pending: dict[str, Any] | None = None
        self._batch_start = 0.0
        self._start_step = 0
        self._first_reward: float | None = None
        self._last_reward: float | None = None
        self._evaluations: list[tuple[int, dict[str, float]]] = []
        self._rss_source: str | None = None

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        bar = trainer.progress_bar_callback is not None
        self._show_progress = self.progress == "always" or (
            self.progress == "auto" and (not bar or not sys.stderr.isatty())
        )
        self._rss_source = probe_rss_source()
        rank_zero_info(self._start_line(trainer))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._flush(trainer)
        self._batch_start = time.perf_counter()
        self._start_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        metrics = dict(getattr(pl_module, "last_metrics", {}) or {})
        reward = metrics.get("reward/mean")
        if reward is not None:
            self._first_reward = reward if self._first_reward is None else self._first_reward
            self._last_reward = reward
        step = trainer.global_step
        # the line is written once every callback has seen the step (the profiler's peak may come after this hook)
        due = step == 1 or step % self.every_n_steps == 0 or step >= (trainer.max_steps or -1) > 0
        if self._show_progress and due:
            seconds = time.perf_counter() - self._batch_start
            self._pending = {"step": step, "start_step": self._start_step, "seconds": seconds, "metrics": metrics}

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        scores = dict(getattr(pl_module, "last_evaluation", {}) or {})
        if not scores:
            return
        self._evaluations.append((trainer.global_step, scores))
        rank_zero_info(f"held-out after {trainer.global_step} steps: {_format_scores(scores)}")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer)
        rank_zero_info(self._summary(trainer, "finished"))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._flush(trainer)
        rank_zero_info(self._summary(trainer, f"failed ({type(exception).__name__})"))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"first_reward": self._first_reward, "evaluations": self._evaluations}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._first_reward = state_dict.get("first_reward")
        self._evaluations = [tuple(e) for e in state_dict.get("evaluations", [])]

    # ------------------------------------------------------------------------------------------ lines
    def _flush(self, trainer: pl.Trainer) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        m = pending["metrics"]
        total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
        parts = [f"step {pending['step']}{total}"]
        parts += [f"{label} {m[key]:.4g}" for key, label in (("reward/mean", "reward"), ("kl/mean", "kl")) if key in m]
        parts.append(f"{pending['seconds']:.1f} s/step")
        peak = self._peak(trainer, pending["start_step"])
        if peak:
            parts.append(f"peak {peak}")
        rank_zero_info(" | ".join(parts))

    def _peak(self, trainer: pl.Trainer, start_step: int) -> str:
        profiler = _profiler(trainer)
        record = profiler.last_record if profiler is not None else None
        if record and record.get("step") == start_step and "peak_bytes" in record.get("total", {}):
            return f"{format_bytes(record['total']['peak_bytes'])} (tensors)"
        if trainer.strategy.root_device.type == "cuda":
            return f"{format_bytes(torch.cuda.max_memory_allocated(trainer.strategy.root_device))} (cuda)"
        rss = read_peak_rss(self._rss_source) if self._rss_source else None
        return f"{format_bytes(rss)} (rss)" if rss else ""

    def _start_line(self, trainer: pl.Trainer) -> str:
        lines = [f"run: {trainer.max_steps if trainer.max_steps > 0 else 'unlimited'} steps, writing to"]
        for label, path in _paths(trainer).items():
            lines.append(f"  {label:<12} {path}")
        return "\n".join(lines)

    def _summary(self, trainer: pl.Trainer, status: str) -> str:
        lines = [f"run {status} after {trainer.global_step} steps"]
        if self._first_reward is not None:
            lines.append(f"  reward       first {self._first_reward:.4g}, last {self._last_reward:.4g}")
        if self._evaluations:
            (first_step, first), (last_step, last) = self._evaluations[0], self._evaluations[-1]
            lines.append(f"  held-out     after {first_step} steps: {_format_scores(first)}")
            if len(self._evaluations) > 1:
                lines.append(f"               after {last_step} steps: {_format_scores(last)}")
        profiler = _profiler(trainer)
        if profiler is not None:
            summary = profiler.summary()
            peaks = []
            for name, stats in summary["phases"].items():
                measured = stats.get("peak_gib", {}).get("steady")
                if measured is None:
                    continue
                text = f"{name} {measured:.2f}"
                if "predicted_gib" in stats:
                    text += f" (predicted {stats['predicted_gib']:.2f})"
                peaks.append(text)
            if peaks:
                lines.append(f"  peak GiB     {', '.join(peaks)}  (steady state, tensors)")
            if summary.get("roofline"):  # each phase's time beside the least time the hardware needs for its work
                lines.append(f"  time s       {summary_line(summary['roofline'])}")
        for label, path in _paths(trainer).items():
            lines.append(f"  {label:<12} {path}")
        checkpoints = sorted(Path(_checkpoint_dir(trainer) or "/nonexistent").glob("*.ckpt"))
        for ckpt in checkpoints:
            size = (
                sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt.is_dir() else ckpt.stat().st_size
            )
            lines.append(f"  checkpoint   {ckpt} ({size / GIB:.2f} GiB)")
        return "\n".join(lines)

    @property
    def evaluations(self) -> list[tuple[int, dict[str, float]]]:
        """``(optimizer steps done, held-out scores)`` of each evaluation so far."""
        return list(self._evaluations)


def _profiler(trainer: pl.Trainer) -> MemoryProfiler | None:
    return next((c for c in trainer.callbacks if isinstance(c, MemoryProfiler)), None)


def _checkpoint_dir(trainer: pl.Trainer) -> str | None:
    callback = trainer.checkpoint_callback
    return getattr(callback, "dirpath", None) if callback is not None else None


def _paths(trainer: pl.Trainer) -> dict[str, str]:
    """Where this run writes: logs and events, the saved config, checkpoints, memory files."""
    log_dir = trainer.log_dir or trainer.default_root_dir
    paths = {"logs": str(log_dir)}
    if any(isinstance(c, SaveConfigCallback) for c in trainer.callbacks):
        paths["config"] = str(Path(log_dir) / "config.yaml")
    ckpt_dir = _checkpoint_dir(trainer)
    paths["checkpoints"] = str(ckpt_dir) if ckpt_dir else "none (checkpointing off)"
    if _profiler(trainer) is not None:
        paths["memory"] = str(Path(log_dir) / "memory_summary.json")
    return paths


def _format_scores(scores: dict[str, float]) -> str:
    shown = {k: v for k, v in scores.items() if "/completions/" not in k} or scores
    return ", ".join(f"{k} {v:.4g}" for k, v in shown.items())
