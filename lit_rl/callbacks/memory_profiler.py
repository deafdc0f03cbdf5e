"""
Memory Profiler
===============

Records, per training step and per phase (the phases the method declares: ``rollout``, ``reference``,
``policy_forward``, ``backward``, ``optimizer`` for GRPO), the peak memory held by tensors and the
process's peak RSS, and logs them next to the estimator's prediction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_rl.callbacks.checkpoint_io import SaveMeter
from lit_rl.memory.peaks import PhasePeaks, category_for, merge
from lit_rl.memory.profile_report import phase_figure, summarize
from lit_rl.memory.roofline import MEASURE, PhaseRoofline
from lit_rl.memory.rss import probe_rss_source, read_peak_rss, reset_peak_rss
from lit_rl.memory.step_prediction import StepPredictor, step_shape
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
      measured step, severalfold for a small model and much less for a large one; ``every_n_steps``
      keeps most steps at full speed. Tensors allocated between phases are not seen (they are small
      in the lit-rl methods). ``torch.cuda.max_memory_allocated`` returns 0 without CUDA and is
      never logged there.

    On Linux the process's peak RSS is read per phase as well (``VmHWM``, reset by writing ``5`` to
    ``/proc/self/clear_refs``); where that is not possible it falls back to ``getrusage``, a peak over
    the whole process lifetime, and says so once. RSS includes the Python heap, the allocator's free
    lists and library code, so it sits above the tensor peak.

    With ``predict`` (the default), each measured step is predicted by the estimator at that step's own shapes
    (its prompt count and padded prompt length, and the completion length it generated; see
    :mod:`lit_rl.memory.step_prediction`), once per distinct shape, so ``predicted_gib`` and ``peak_gib`` are
    the same quantity for the same tensors. A method that sets ``predicted_memory`` (phase -> bytes) gets that
    fixed prediction logged instead.

    **Logged Metrics** (on each measured step, at the same step as the method's own metrics of that step):

    - ``memory/<phase>/peak_gib``: peak bytes held by tensors during the phase (allocator on CUDA,
      tracker elsewhere; absent when only RSS is available)
    - ``memory/<phase>/rss_peak_gib``: process peak RSS during the phase
    - ``memory/<phase>/reserved_gib``: allocator peak reserved memory during the phase (CUDA only)
    - ``memory/<phase>/predicted_gib``: the estimator's prediction for this step's shapes
    - ``memory/step/peak_gib``, ``memory/step/rss_peak_gib``, ``memory/step/predicted_gib``: maxima over phases
    - ``memory/breakdown/{parameters,gradients,optimizer_state,activations,temporaries,other}_gib``: bytes per
      category at the step's peak (tracker only): ``activations`` are tensors allocated in the forward-like phases,
      ``temporaries`` those allocated in ``backward`` and ``optimizer`` that are neither gradients nor state
      (on the first step the optimizer state being created counts as ``temporaries`` until ``step()`` returns)

    Only phases announced inside a training batch are measured (a validation rollout is not). Checkpoint saves, where
    the IO announces them (``lit-rl``'s default does), are measured apart: ``memory/save/rss_peak_gib``,
    ``memory/save/checkpoint_gib`` and ``time/save_s`` (:class:`~lit_rl.callbacks.checkpoint_io.SaveMeter`).

    Files, in ``trainer.log_dir``: ``memory_summary.json`` (per phase: max and mean over measured steps, the
    steady-state mean over steps after the first, where AdamW has its state; the mean prediction and the
    prediction error in percent; per-step records with their predictions; device, method; written at the
    end of training and when training fails), ``memory_phases.png`` (stacked per-phase bars of the steady
    state with the prediction, also sent to TensorBoard as ``memory/phases``) and, with
    ``cuda_snapshot_steps``, ``memory_snapshot.pickle`` (open it at https://pytorch.org/memory_viz).
    With a ``TensorBoardLogger``, a custom-scalars layout groups all memory charts on the "CUSTOM SCALARS" page.

    Args:
        every_n_steps: measure one step in this many (by ``trainer.global_step``); the first step is always
            measured. Tensor accounting on CPU slows the measured steps, so raise this for long runs.
        cuda_snapshot_steps: on CUDA, record the allocator's history for this many steps from the start of
            training and save it as ``memory_snapshot.pickle``; it costs host memory and some speed while
            recording. Ignored, with a warning, without CUDA.
        track_tensors: use exact tensor accounting off CUDA; ``False`` logs RSS only (full speed).
        predict: after each measured step, run the estimator (:mod:`lit_rl.memory.estimate`, fake tensors, cached
            per distinct shape: about a second for a small model, 17-55 s for a 0.5-1.5B one) at that step's shapes,
            so ``memory/<phase>/predicted_gib`` is logged beside the measurement. Batches that are not prompt batches
            (no ``input_ids``) get the padded upper bound of ``lit-rl estimate`` instead.
        predict_budget: the share of the run's wall time the predictions may take; a step of a new shape past it is
            measured but not predicted (counted at the end). The first shape is always predicted.
        rates: ``measure`` (a quick measurement after the steps), a file of ``lit-rl rates --out FILE`` or null:
            the rates of ``roofline`` in the summary, each phase's time beside its floor
            (:mod:`lit_rl.memory.roofline`).

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
        self,
        every_n_steps: int = 1,
        cuda_snapshot_steps: int = 0,
        track_tensors: bool = True,
        predict: bool = True,
        rates: str | None = MEASURE,
        predict_budget: float = 0.1,
    ) -> None:
        if every_n_steps < 1:
            raise MisconfigurationException(f"MemoryProfiler(every_n_steps={every_n_steps}): use 1 or more.")
        if cuda_snapshot_steps < 0:
            raise MisconfigurationException(
                f"MemoryProfiler(cuda_snapshot_steps={cuda_snapshot_steps}): use 0 (off) or a positive count."
            )
        if predict_budget < 0:
            raise MisconfigurationException(
                f"MemoryProfiler(predict_budget={predict_budget}): use 0 or more (0.1: a tenth)."
            )
        self.every_n_steps = every_n_steps
        self.cuda_snapshot_steps = cuda_snapshot_steps
        self.track_tensors = track_tensors
        self.predict = predict
        self.predict_budget = predict_budget
        self._roofline = PhaseRoofline(rates)  # each phase's time beside its floor, in the summary
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
        self._predicted: dict[str, int] = {}  # the latest step's prediction
        self._predictor: StepPredictor | None = None
        self._upper_bound: dict[str, int] | None = None
        self._snapshot_recording = False
        self._snapshot_steps_done = 0
        self._snapshot_path: str | None = None
        self._save_meter: SaveMeter | None = None
        self._saves: list[dict[str, Any]] = []  # checkpoint saves, measured outside the steps

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
        phases.add_listener(self._roofline)
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
        self._save_meter = self._save_meter or SaveMeter.attach(trainer, self._rss_source, self._saves)
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
            phases.remove_listener(self._roofline)
        if self._save_meter is not None:
            self._save_meter.detach()
            self._save_meter = None
        self._close_tracker()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_custom_scalars(self._layout())

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.predict:
            self._predictor = StepPredictor(trainer, pl_module, budget=self.predict_budget)
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
        # whether the optimizer state exists yet: the first step of a fresh run creates it in its optimizer phase
        has_state = any(len(optimizer.state) for optimizer in trainer.optimizers)
        self._record = {"step": trainer.global_step, "phases": {}, "optimizer_state": has_state}
        if self._mode == "tracker":
            self._open_tracker(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._roofline.record(trainer, pl_module, batch, tracked=self._record is not None and self._mode == "tracker")
        self._close_tracker()
        if self._record is not None:
            self._finish_record(trainer, pl_module, batch)
        if self._snapshot_recording:
            self._snapshot_steps_done += 1
            if self._snapshot_steps_done >= self.cuda_snapshot_steps:
                self.dump_cuda_snapshot()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._predictor is not None and self._predictor.cache:
            rank_zero_info(
                f"MemoryProfiler: predicted {len(self._predictor.cache)} distinct step shapes in "
                f"{self._predictor.seconds:.0f}s on fake tensors"
                + (f"; {self._predictor.skipped} measured steps of new shapes left unpredicted past predict_budget "
                   f"{self.predict_budget}" if self._predictor.skipped else "")
            )  # fmt: skip
        self.dump_cuda_snapshot()
        if trainer.is_global_zero:
            self._write_figure(trainer)
        self._write_summary(trainer, status="finished")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close_tracker()
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
        stats = summarize(records, self._phase_names)
        return {
            "method": self._method,
            "device": str(self._device),
            "measurement": {"cuda": "cuda allocator", "tracker": "tensor accounting", "rss": "rss only"}[self._mode],
            "rss_source": self._rss_source,
            "every_n_steps": self.every_n_steps,
            "prediction": "the step's own shapes" if self._predictor is not None else "fixed (predicted_memory)",
            **stats,
            "steps": records,
            "saves": list(self._saves),
            "cuda_snapshot": self._snapshot_path,
            "roofline": self._roofline.report(),
        }

    @property
    def last_record(self) -> dict[str, Any] | None:
        """The latest measured step: ``{"step", "phases", "total", "predicted"}`` (bytes), or ``None``."""
        return self._records[-1] if self._records else None

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

    def _finish_record(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        record, self._record = self._record, None
        if record["phases"]:
            record["total"] = merge({}, *record["phases"].values())
        self._predicted = self._prediction(trainer, pl_module, batch, record.get("optimizer_state", True))
        if self._predicted:
            record["predicted"] = dict(self._predicted)
        self._records.append(record)
        metrics = self._metrics(record)
        # the step the method's own metrics of this batch are logged at (trainer.global_step is already one
        # further, and pl_module.log would re-log these values at unmeasured steps); as LearningRateMonitor does
        step = _logging_step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _prediction(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, optimizer_state: bool
    ) -> dict[str, int]:
        fixed = getattr(pl_module, "predicted_memory", None)
        if fixed:
            return {str(k): int(v) for k, v in fixed.items()}
        if self._predictor is None:
            return {}
        try:
            shape = step_shape(batch, pl_module)
            if shape is not None:
                return self._predictor.predict(shape, optimizer_state=optimizer_state)
            if self._upper_bound is None:  # not a prompt batch: the padded bound of `lit-rl estimate`
                from lit_rl.memory.estimate import estimate_for_trainer

                self._upper_bound = dict(estimate_for_trainer(trainer, pl_module).phases)
            return self._upper_bound
        except Exception as err:  # a prediction is a convenience: it must never stop training
            rank_zero_warn(f"MemoryProfiler: no memory prediction for this run ({type(err).__name__}: {err})")
            self._predictor = None
            return {}

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
        charts["checkpoint save"] = ["Multiline", ["memory/save/rss_peak_gib", "memory/save/checkpoint_gib"]]
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
        fig = phase_figure(self.summary())
        if fig is None:
            rank_zero_info("MemoryProfiler: no per-phase figure (nothing measured, or matplotlib is not installed).")
            return
        if self._log_dir is not None:
            Path(self._log_dir).mkdir(parents=True, exist_ok=True)
            fig.savefig(Path(self._log_dir) / "memory_phases.png", dpi=120)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_figure("memory/phases", fig, global_step=trainer.global_step, close=False)


def _logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs ``self.log`` metrics of the current training batch at."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return loop._batches_that_stepped if loop is not None else trainer.global_step
