"""
Memory Profiler
===============

Records, per training step and per phase (the phases the method declares: ``rollout``, ``reference``,
``policy_forward``, ``backward``, ``optimizer`` for GRPO), the peak memory held by tensors and the
process's peak RSS, and logs them next to the estimator's prediction.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_rl.memory.peaks import PhasePeaks, category_for, merge
from lit_rl.memory.rss import probe_rss_source, read_peak_rss, reset_peak_rss
from lit_rl.memory.tracker import CATEGORIES as BREAKDOWN
from lit_rl.memory.tracker import TensorMemoryTracker
from lit_rl.memory.units import GIB


class MemoryProfiler(Callback):
    r"""Measures peak memory per phase of every N-th training step and logs it beside the prediction.

    The profiler listens to the phases the method announces through ``pl_module.phases`` and charts the
    names it declares (``pl_module.phases.names``), so a new method is measured without changes here.
    What it measures depends on the device:

    - **CUDA**: the caching allocator's ``max_memory_allocated`` (tensor peak) and
      ``max_memory_reserved`` (what the allocator holds from the driver), reset at each phase start.
      Nearly free.
    - **CPU** (and other devices): exact tensor accounting with
      :class:`~lit_rl.memory.tracker.TensorMemoryTracker`, entered at each phase start, with the
      parameters, gradients and optimizer state registered, so the peak includes the resident weights.
      Every operator goes through a Python dispatch mode, a fixed cost per operator that slows a
      measured step of a small model by up to ~2-3x (much less for large ones); ``every_n_steps``
      keeps most steps at full speed. Tensors allocated between phases are not seen (they are small
      in the lit-rl methods). ``torch.cuda.max_memory_allocated`` returns 0 without CUDA and is
      never logged there.

    On Linux the process's peak RSS is read per phase as well (``VmHWM``, reset by writing ``5`` to
    ``/proc/self/clear_refs``); where that is not possible it falls back to ``getrusage``, a peak over
    the whole process lifetime, and says so once. RSS includes the Python heap, the allocator's free
    lists and library code, so it sits above the tensor peak.

    If the method exposes ``predicted_memory`` (a dict phase -> bytes, filled by the estimator), the
    prediction is logged next to each measurement.

    **Logged Metrics** (on each measured step, ``step = trainer.global_step``):

    - ``memory/<phase>/peak_gib``: peak bytes held by tensors during the phase (allocator on CUDA,
      tracker elsewhere; absent when only RSS is available)
    - ``memory/<phase>/rss_peak_gib``: process peak RSS during the phase
    - ``memory/<phase>/reserved_gib``: allocator peak reserved memory during the phase (CUDA only)
    - ``memory/<phase>/predicted_gib``: the estimator's prediction, if ``pl_module.predicted_memory`` exists
    - ``memory/step/peak_gib``, ``memory/step/rss_peak_gib``, ``memory/step/predicted_gib``: maxima over phases
    - ``memory/breakdown/{parameters,gradients,optimizer_state,activations,temporaries,other}_gib``: bytes per
      category at the step's peak (tracker only): ``activations`` are tensors allocated in the forward-like phases,
      ``temporaries`` those allocated in ``backward`` and ``optimizer`` that are neither gradients nor state
      (on the first step the optimizer state being created counts as ``temporaries`` until ``step()`` returns)

    Only phases announced inside a training batch are measured (a validation rollout is not).

    Files, in ``trainer.log_dir``: ``memory_summary.json`` (per-phase max and mean over measured steps,
    per-step records, device, method; written at the end of training and when training fails),
    ``memory_phases.png`` (stacked per-phase bars, also sent to TensorBoard as ``memory/phases``) and, with
    ``cuda_snapshot_steps``, ``memory_snapshot.pickle`` (open it at https://pytorch.org/memory_viz).
    With a ``TensorBoardLogger``, a custom-scalars layout groups all memory charts on the "CUSTOM SCALARS" page.

    Args:
        every_n_steps: measure one step in this many (by ``trainer.global_step``); the first step is always
            measured. Tensor accounting on CPU slows the measured steps, so raise this for long runs.
        cuda_snapshot_steps: on CUDA, record the allocator's history for this many steps from the start of
            training and save it as ``memory_snapshot.pickle``; it costs host memory and some speed while
            recording. Ignored, with a warning, without CUDA.
        track_tensors: use exact tensor accounting off CUDA; ``False`` logs RSS only (full speed).
        predict: at the start of training, run the estimator (:mod:`lit_rl.memory.estimate`, fake tensors, a
            few seconds) so ``memory/<phase>/predicted_gib`` is logged beside the measurement. It pads every
            prompt to ``data.max_prompt_length`` and assumes full-length completions: an upper bound.

    Raises:
        MisconfigurationException:
            If ``every_n_steps < 1`` or ``cuda_snapshot_steps < 0``, or if the LightningModule has no
            ``phases`` attribute (a :class:`~lit_rl.memory.phases.PhaseTracker`).

    Example::

        # callbacks/memory_profiler.yaml
        trainer:
          callbacks+:
            - class_path: lit_rl.callbacks.MemoryProfiler
              init_args: {every_n_steps: 1}
    """

    def __init__(
        self, every_n_steps: int = 1, cuda_snapshot_steps: int = 0, track_tensors: bool = True, predict: bool = True
    ) -> None:
        if every_n_steps < 1:
            raise MisconfigurationException(f"MemoryProfiler(every_n_steps={every_n_steps}): use 1 or more.")
        if cuda_snapshot_steps < 0:
            raise MisconfigurationException(
                f"MemoryProfiler(cuda_snapshot_steps={cuda_snapshot_steps}): use 0 (off) or a positive count."
            )
        self.every_n_steps = every_n_steps
        self.cuda_snapshot_steps = cuda_snapshot_steps
        self.track_tensors = track_tensors
        self.predict = predict
        self._records: list[dict[str, Any]] = []
        self._record: dict[str, Any] | None = None
        self._peaks = PhasePeaks(read=self._read_peaks, reset=self._reset_peaks)
        self._phase_names: tuple[str, ...] = ()
        self._tracker: TensorMemoryTracker | None = None
        self._mode = "rss"  # "cuda" | "tracker" | "rss"
        self._rss_source: str | None = None  # "vmhwm" | "getrusage" | None
        self._device = torch.device("cpu")
        self._method = ""
        self._log_dir: str | None = None
        self._predicted: dict[str, int] = {}
        self._snapshot_recording = False
        self._snapshot_steps_done = 0
        self._snapshot_path: str | None = None

    # ------------------------------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        phases = getattr(pl_module, "phases", None)
        if phases is None or not hasattr(phases, "add_listener"):
            raise MisconfigurationException(
                f"MemoryProfiler needs `{type(pl_module).__name__}.phases`: create `self.phases = PhaseTracker(names)` "
                "(lit_rl.memory.phases) in __init__ and wrap each part of the step in `with self.phases(name):`, "
                "or remove the MemoryProfiler callback."
            )
        phases.add_listener(self)
        self._phase_names = tuple(getattr(phases, "names", ()))
        self._device = trainer.strategy.root_device
        self._method = type(pl_module).__name__
        self._log_dir = trainer.log_dir or trainer.default_root_dir  # computed here, on every rank
        if self._device.type == "cuda":
            self._mode = "cuda"
        elif self.track_tensors:
            self._mode = "tracker"
        else:
            self._mode = "rss"
        self._rss_source = self._probe_rss()
        if self.cuda_snapshot_steps and self._device.type != "cuda":
            rank_zero_warn(
                f"MemoryProfiler(cuda_snapshot_steps={self.cuda_snapshot_steps}) records CUDA allocator history, "
                f"but training runs on {self._device}; no snapshot will be written."
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        phases = getattr(pl_module, "phases", None)
        if phases is not None and hasattr(phases, "remove_listener"):
            phases.remove_listener(self)
        self._close_tracker()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_custom_scalars(self._layout())

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.predict and getattr(pl_module, "predicted_memory", None) is None:
            self._predict(trainer, pl_module)
        if self.cuda_snapshot_steps and self._device.type == "cuda" and not self._snapshot_path:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._snapshot_recording = True

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._peaks.clear()
        if trainer.global_step % self.every_n_steps != 0:
            self._record = None
            return
        self._record = {"step": trainer.global_step, "phases": {}}
        if self._mode == "tracker":
            self._open_tracker(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._close_tracker()
        if self._record is not None:
            self._finish_record(trainer, pl_module)
        if self._snapshot_recording:
            self._snapshot_steps_done += 1
            if self._snapshot_steps_done >= self.cuda_snapshot_steps:
                self.dump_cuda_snapshot()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.dump_cuda_snapshot()
        if trainer.is_global_zero:
            self._write_figure(trainer)
        self._write_summary(trainer, status="finished")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close_tracker()
        self._read_predicted(pl_module)
        self.dump_cuda_snapshot()
        self._write_summary(trainer, status=f"failed: {type(exception).__name__}: {exception}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"records": self._records}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._records = list(state_dict.get("records", []))

    # ------------------------------------------------------------------------------ phase listener

    def on_phase_start(self, name: str) -> None:
        if self._record is None:
            return  # not a measured training step (or a phase announced outside training)
        if self._tracker is not None and self._peaks.depth == 0 and not self._enter_tracker():
            return
        if self._tracker is not None:
            self._tracker.default_category = category_for(name)
        self._peaks.start(name)

    def on_phase_end(self, name: str) -> None:
        if self._record is None or not self._peaks.depth:
            return
        self._peaks.end()
        self._record["phases"] = dict(self._peaks.phases)  # repeats: max over micro-batches
        if self._tracker is None:
            return
        if self._peaks.depth:
            self._tracker.default_category = category_for(self._peaks.current)
        else:
            self._tracker.__exit__(None, None, None)

    # ---------------------------------------------------------------------------------- public helpers

    def summary(self) -> dict[str, Any]:
        """Per-phase max and mean over the measured steps, plus the per-step records (bytes)."""
        records = list(self._records)
        if self._record is not None and self._record["phases"]:  # a step cut short by an error
            partial = self._record
            records.append({**partial, "total": merge({}, *partial["phases"].values()), "incomplete": True})
        phase_names = [p for p in self._phase_names if any(p in r["phases"] for r in records)]
        phase_names += sorted({p for r in records for p in r["phases"]} - set(phase_names))
        phases = {name: _stats([r["phases"][name] for r in records if name in r["phases"]]) for name in phase_names}
        steps = _stats([r["total"] for r in records if "total" in r])
        for name, bytes_ in self._predicted.items():
            phases.setdefault(name, {})["predicted_gib"] = bytes_ / GIB
        if self._predicted:
            steps["predicted_gib"] = max(self._predicted.values()) / GIB
        return {
            "method": self._method,
            "device": str(self._device),
            "measurement": {"cuda": "cuda allocator", "tracker": "tensor accounting", "rss": "rss only"}[self._mode],
            "rss_source": self._rss_source,
            "every_n_steps": self.every_n_steps,
            "phases": phases,
            "step": steps,
            "steps": records,
            "cuda_snapshot": self._snapshot_path,
        }

    def dump_cuda_snapshot(self) -> str | None:
        """Save the CUDA allocator history recorded so far (if recording) and stop recording; returns the path."""
        if self._snapshot_recording:
            path = Path(self._log_dir or ".") / "memory_snapshot.pickle"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self._snapshot_recording = False
            self._snapshot_path = str(path)
        return self._snapshot_path

    # --------------------------------------------------------------------------------- measurements

    def _open_tracker(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self._tracker = TensorMemoryTracker().track(pl_module)
            # the full fine-tuning reference is kept out of the module tree (and the checkpoint): count it too
            if getattr(pl_module, "reference", None) is not None:
                self._tracker.track(pl_module.reference)
            for optimizer in trainer.optimizers:
                self._tracker.track(optimizer)
        except Exception as err:  # tracking is a measurement: it must never stop training
            self._fall_back_to_rss(err)

    def _enter_tracker(self) -> bool:
        try:
            self._tracker.__enter__()
        except Exception as err:
            self._fall_back_to_rss(err)
            return False
        return True

    def _fall_back_to_rss(self, err: Exception) -> None:
        rank_zero_warn(f"MemoryProfiler: tensor accounting is unavailable ({err!r}); logging process RSS only.")
        self._mode = "rss"
        self._close_tracker()

    def _close_tracker(self) -> None:
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None

    def _reset_peaks(self) -> None:
        if self._mode == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        elif self._tracker is not None:
            self._tracker.reset_peak()
        if self._rss_source == "vmhwm":
            reset_peak_rss()

    def _read_peaks(self) -> dict[str, Any]:
        peaks: dict[str, Any] = {}
        if self._mode == "cuda":
            peaks["peak_bytes"] = torch.cuda.max_memory_allocated(self._device)
            peaks["reserved_bytes"] = torch.cuda.max_memory_reserved(self._device)
        elif self._tracker is not None:
            peaks["peak_bytes"] = self._tracker.peak_bytes
            peaks["breakdown"] = self._tracker.peak_by_category()
        rss = read_peak_rss(self._rss_source)
        if rss is not None:
            peaks["rss_peak_bytes"] = rss
        return peaks

    def _probe_rss(self) -> str | None:
        source = probe_rss_source()
        if source == "getrusage":
            rank_zero_warn(
                "MemoryProfiler: cannot reset the peak RSS per phase (/proc/self/clear_refs is not writable here); "
                "`rss_peak_gib` is the process-lifetime peak from getrusage."
            )
        elif source is None:
            rank_zero_info(
                "MemoryProfiler: no way to read the peak RSS on this platform; `rss_peak_gib` is not logged."
            )
        return source

    # ------------------------------------------------------------------------------------ reporting

    def _finish_record(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record, self._record = self._record, None
        record["step"] = trainer.global_step
        if record["phases"]:
            record["total"] = merge({}, *record["phases"].values())
        self._records.append(record)
        self._read_predicted(pl_module)
        metrics = self._metrics(record)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _predict(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            from lit_rl.memory.estimate import estimate_for_trainer

            pl_module.predicted_memory = estimate_for_trainer(trainer, pl_module).phases
        except Exception as err:  # a prediction is a convenience: it must never stop training
            rank_zero_warn(f"MemoryProfiler: no memory prediction for this run ({type(err).__name__}: {err})")

    def _read_predicted(self, pl_module: pl.LightningModule) -> None:
        predicted = getattr(pl_module, "predicted_memory", None) or {}
        self._predicted = {str(k): int(v) for k, v in predicted.items()}

    def _metrics(self, record: dict[str, Any]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        keys = {"peak_bytes": "peak_gib", "rss_peak_bytes": "rss_peak_gib", "reserved_bytes": "reserved_gib"}
        for name, peaks in [*record["phases"].items(), ("step", record.get("total", {}))]:
            for key, metric in keys.items():
                if key in peaks:
                    metrics[f"memory/{name}/{metric}"] = peaks[key] / GIB
        for name, bytes_ in self._predicted.items():
            metrics[f"memory/{name}/predicted_gib"] = bytes_ / GIB
        if self._predicted:
            metrics["memory/step/predicted_gib"] = max(self._predicted.values()) / GIB
        for category, bytes_ in record.get("total", {}).get("breakdown", {}).items():
            metrics[f"memory/breakdown/{category}_gib"] = bytes_ / GIB
        return metrics

    def _layout(self) -> dict[str, Any]:
        charts = {
            phase: [
                "Multiline",
                [f"memory/{phase}/{m}" for m in ("peak_gib", "rss_peak_gib", "reserved_gib", "predicted_gib")],
            ]
            for phase in self._phase_names
        }
        charts["step"] = ["Multiline", [f"memory/step/{m}" for m in ("peak_gib", "rss_peak_gib", "predicted_gib")]]
        charts["breakdown at step peak"] = ["Multiline", [r"memory/breakdown/.*"]]
        charts["empty cache"] = ["Multiline", [r"memory/empty_cache/.*"]]
        return {"memory": charts}

    def _write_summary(self, trainer: pl.Trainer, status: str) -> None:
        if self._log_dir is None:
            return  # failed before setup: nothing was measured
        # every rank measures its own memory; a failure may happen on one rank only, so each writes its own file
        name = "memory_summary.json" if trainer.global_rank == 0 else f"memory_summary.rank{trainer.global_rank}.json"
        path = Path(self._log_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump({**self.summary(), "status": status}, f, indent=2)

    def _write_figure(self, trainer: pl.Trainer) -> None:
        try:
            from matplotlib.figure import Figure  # no pyplot: no global backend state, Agg canvas only
        except ImportError:
            rank_zero_info("MemoryProfiler: matplotlib is not installed; skipping the per-phase figure.")
            return
        summary = self.summary()
        phases = {name: s for name, s in summary["phases"].items() if "peak_gib" in s or "rss_peak_gib" in s}
        if not phases:
            return
        names = list(phases)
        xs = list(range(len(names)))

        def series(metric: str, stat: str | None = "mean") -> list[float]:
            values = [phases[n].get(metric) for n in names]
            values = [v.get(stat) if stat and isinstance(v, dict) else v for v in values]
            return [float("nan") if v is None else v for v in values]

        tensor = series("peak_gib")
        rss = series("rss_peak_gib")
        panels = [p for p, v in (("tensors", tensor), ("rss", rss)) if any(x == x for x in v)]  # x == x: not NaN
        # tensor peak and RSS live on very different scales (RSS holds the interpreter and libraries): two panels
        fig = Figure(figsize=((1.3 * len(names) + 2.2) * len(panels) + 0.5, 4.5))
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, panel in zip(axes, panels, strict=True):
            shown = (tensor if panel == "tensors" else rss) + series("predicted_gib", None)
            scale, unit = _unit(max((x for x in shown if x == x), default=0.0))
            if panel == "tensors":
                bottom = [0.0] * len(names)
                for category in BREAKDOWN:  # tensor accounting: stacked by category at the phase's peak
                    heights = [phases[n].get("breakdown_gib", {}).get(category, 0.0) * scale for n in names]
                    if any(heights):
                        ax.bar(xs, heights, bottom=bottom, label=category)
                        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
                if not any(bottom):  # allocator only: allocated, with the reserved headroom on top
                    peaks = [0.0 if t != t else t * scale for t in tensor]
                    ax.bar(xs, peaks, label="allocated")
                    reserved = [0.0 if r != r else r * scale for r in series("reserved_gib")]
                    if any(reserved):
                        headroom = [max(r - p, 0.0) for r, p in zip(reserved, peaks, strict=True)]
                        ax.bar(xs, headroom, bottom=peaks, label="reserved, unallocated")
                ax.set_title("peak held by tensors")
            else:
                ax.bar(xs, [r * scale for r in rss], color="tab:gray", label="RSS peak")
                ax.set_title("process peak RSS")
            predicted = [p * scale for p in series("predicted_gib", None)]
            if panel == panels[0] and any(p == p for p in predicted):  # predictions are of the tensor peak
                ax.scatter(xs, predicted, marker="_", s=900, linewidths=2.5, color="r", label="predicted", zorder=3)
            ax.set_xticks(xs, names, rotation=20)
            ax.set_ylabel(f"{unit} (mean over measured steps)")
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.suptitle(f"{summary['method']}: peak memory per phase ({summary['measurement']}, {summary['device']})")
        fig.tight_layout()
        if self._log_dir is not None:
            Path(self._log_dir).mkdir(parents=True, exist_ok=True)
            fig.savefig(os.path.join(self._log_dir, "memory_phases.png"), dpi=120)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_figure("memory/phases", fig, global_step=trainer.global_step, close=False)


def _unit(gib: float) -> tuple[float, str]:
    """A scale factor from GiB and its unit, so small runs are not drawn as zero-height bars."""
    return (1.0, "GiB") if gib >= 1 else (1024.0, "MiB") if gib >= 1 / 1024 else (1024.0**2, "KiB")


def _stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Max and mean (GiB) of each measured quantity; the breakdown is averaged per category."""
    out: dict[str, Any] = {}
    for key, metric in (
        ("peak_bytes", "peak_gib"),
        ("rss_peak_bytes", "rss_peak_gib"),
        ("reserved_bytes", "reserved_gib"),
    ):
        values = [r[key] / GIB for r in records if key in r]
        if values:
            out[metric] = {"max": max(values), "mean": sum(values) / len(values)}
    breakdowns = [r["breakdown"] for r in records if "breakdown" in r]
    if breakdowns:
        out["breakdown_gib"] = {c: sum(b.get(c, 0) for b in breakdowns) / len(breakdowns) / GIB for c in BREAKDOWN}
    return out
