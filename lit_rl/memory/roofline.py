"""The roofline of a training step: how far each phase is from what the hardware can do.

For each phase of a step, :mod:`lit_rl.memory.work` counts the least work the phase must do (matmul and attention
FLOPs, and the bytes that must move between memory and the cores) from the policy's config, the step's shapes and
what the method declares in ``step_work()``: the GRPO family's ``rollout``, ``reference``, ``policy_forward``,
``backward`` and ``optimizer``, or a differentiable rollout's ``generate``, ``reward``, ``backward`` and
``optimizer`` (GumbelTopK). With a matmul rate (FLOP/s at the phase's precision) and a memory bandwidth (bytes/s),
both from :mod:`lit_rl.memory.machine_rates`, each phase gets a floor (:func:`~lit_rl.memory.work.floor`), and
``floor / measured seconds`` is the share of the hardware the phase achieved. FLOPs and bytes do not depend on the
machine or its load; the rates and the measured times do. The matmul rate is that of large square GEMMs;
``attainable_s`` uses the rate measured on a decode-shaped GEMM for the few-row parts instead (what the matmul
library reaches on a few rows per weight), so a phase's gap splits into "the library on skinny shapes" and the rest.

Precision: the matmul rate of the dtype the matmuls run in (bfloat16 or float16 under ``bf16-*``/``16-*``
precision, else the weights' dtype); weights, gradients and optimizer state at the weights' size (float32 master
weights under mixed precision), the KV cache at the compute dtype's.

Not modelled, and reported as such: phases the work counts do not name, mixture-of-experts layers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from lit_rl.memory.estimate import settings_from
from lit_rl.memory.machine_rates import load_rates, measure_rates
from lit_rl.memory.phases import BACKWARD
from lit_rl.memory.rollout import rollout_shape, step_work
from lit_rl.memory.step_prediction import step_shape
from lit_rl.memory.work import ModelShape, StepSettings, floor, floor_rates, phase_work
from lit_rl.models import base_model, nf4_memory

MEASURE = "measure"
_PRECISION_DTYPE = {"bf16": "bfloat16", "16": "float16"}  # mixed and true half precision compute in these


# ------------------------------------------------------------------------------------- the profiler's report


def _run_settings(trainer, module) -> tuple[ModelShape, StepSettings, str]:
    """The model's shape, the settings every step of this run shares (lengths come per step), the compute dtype."""
    policy = module.policy
    quantized, quantized_bytes, _ = nf4_memory(policy)  # a 4-bit base: its bytes per weight, scales included
    shape = ModelShape.from_config(base_model(policy).config)
    params = [p for p in policy.parameters() if p.is_floating_point()]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    settings = settings_from(None, precision=str(trainer.precision), callbacks=trainer.callbacks, device_type="")
    every = settings.get("activation_checkpointing", 0)
    precision = settings["precision"].split("-")[0]
    weight = next((p for p in params if not p.requires_grad), params[0])  # the base weights under LoRA
    dtype = _PRECISION_DTYPE.get(precision, str(weight.dtype).removeprefix("torch."))
    rollout, work = rollout_shape(module), step_work(module)  # what the method declares, whatever its options are
    base = StepSettings.of(
        work,
        trainable=trainable,
        device=trainer.strategy.root_device.type,
        prompts=1,
        generations=rollout.completions_per_prompt,
        prompt_length=1,
        new_tokens=rollout.max_new_tokens,
        micro_batch=work.micro_batch,
        weight_bytes=weight.element_size(),
        cache_bytes=getattr(torch, dtype).itemsize,
        checkpointed_layers=len(range(0, shape.layers, every)) if every else 0,
        base_nf4=quantized_bytes / quantized if quantized else 0.0,
    )
    return shape, base, dtype


class PhaseRoofline:
    """Times every phase of every training step and reports each beside its floor; the MemoryProfiler's helper.

    A :class:`~lit_rl.memory.phases.PhaseListener` of the method's phases (wall time, summed over repeats, as the
    method's ``time/<phase>_s``); :meth:`record` at the end of each training batch, with the batch (for the step's
    shapes); :meth:`report` for the summary.

    Args:
        rates: a JSON file of :func:`~lit_rl.memory.machine_rates.save_rates`, ``"measure"`` (a quick measurement
            on the training device when the report is first asked for, after the steps), or ``None`` (no floors).

    Raises:
        ValueError: when ``rates`` names a file that is not there.
    """

    def __init__(self, rates: str | None = MEASURE) -> None:
        if rates not in (None, MEASURE) and not Path(rates).is_file():
            raise ValueError(
                f"rates: no such file {rates!r}; write one with `lit-rl rates --out FILE`, "
                f"or use {MEASURE!r} (a quick measurement) or null (no floors)"
            )
        self.rates = rates
        self._steps: list[dict[str, Any]] = []
        self._times: dict[str, float] = {}
        self._open: dict[str, float] = {}
        self._run: tuple[ModelShape, StepSettings, str] | None = None
        self._names: tuple[str, ...] = ()
        self._device = torch.device("cpu")
        self._reason: str | None = None if rates is not None else "turned off (rates: null)"
        self._measured: dict[str, Any] | None = None

    def on_phase_start(self, name: str) -> None:
        self._open[name] = time.perf_counter()

    def on_phase_end(self, name: str) -> None:
        if name in self._open:
            self._times[name] = self._times.get(name, 0.0) + time.perf_counter() - self._open.pop(name)

    def record(self, trainer, module, batch: Any, *, tracked: bool) -> None:
        """Keep the phase times since the last call with the step's shapes; ``tracked``: the step ran under tensor
        accounting (slower on CPU)."""
        times, self._times, self._open = self._times, {}, {}
        if self._reason is not None or not times:
            return
        try:
            shape = step_shape(batch, module)
            if shape is None:
                raise ValueError("the batch is not a prompt batch")
            if self._run is None:
                self._run = _run_settings(trainer, module)
                self._names = tuple(module.phases.names)
                self._device = trainer.strategy.root_device
            settings = replace(
                self._run[1],
                prompts=shape.batch_size,
                prompt_length=shape.prompt_length,
                new_tokens=shape.new_tokens if shape.new_tokens is not None else self._run[1].new_tokens,
                completion_tokens=(getattr(module, "step_shape", None) or {}).get("completion_tokens"),
            )
        except Exception as err:  # a roofline is a convenience: it must never stop training
            self._reason = f"not modelled: {err}"
            return
        step = trainer.global_step  # optimizer steps done, this one included
        self._steps.append({"step": step, "tracked": tracked, "times": times, "settings": settings})

    def report(self) -> dict[str, Any]:
        """Per phase: median measured seconds over the steps after the first, the floor beside it, and the share.

        Returns ``{"rates", "steps", "settings", "phases", "note"}`` (``settings``: the last step's
        :class:`StepSettings`, with every prompt width and completion length seen), or ``{"skipped": reason}``.
        """
        if self._reason is not None:
            return {"skipped": self._reason}
        if not self._steps:
            return {"skipped": "no training step was timed"}
        model, _, dtype = self._run
        try:
            rates = self._rates()
            if rates["device"] != self._device.type:
                raise ValueError(f"{self.rates} holds {rates['device']} rates; this run trains on {self._device.type}")
            if dtype not in rates["dtypes"]:
                raise ValueError(f"{self.rates} has no {dtype} matmul rate")
        except ValueError as err:
            return {"skipped": str(err)}
        used = self._steps[1:] or self._steps  # the first step warms up (allocations, kernels)
        clean = [s for s in used if not s["tracked"]]
        note = None
        if clean:
            used = clean
        elif any(s["tracked"] for s in used):
            note = (
                "every timed step ran under tensor accounting, slower on CPU: raise every_n_steps or track_tensors off"
            )
        source = "measured at the end of the run (quick)" if self.rates == MEASURE else str(self.rates)
        settings = asdict(used[-1]["settings"])
        for key in ("prompt_length", "new_tokens"):  # every value the steps had
            settings[key] = sorted({getattr(s["settings"], key) for s in used})
        return {
            "rates": _rates_used(rates, dtype, source),
            "steps": [s["step"] for s in used],
            "settings": settings,
            "phases": phase_table(model, used, self._names, rates, dtype),
            "note": note,
            # what rerate() needs to put the same steps beside other rates
            "model": asdict(model),
            "names": list(self._names),
            "per_step": [{**s, "settings": asdict(s["settings"])} for s in used],
        }

    def _rates(self) -> dict[str, Any]:
        if self.rates != MEASURE:
            return load_rates(self.rates)
        if self._measured is None:
            sampler = self._run[1].rollout_dtype  # a sampler in its own dtype is timed at that dtype's rates
            dtypes = (self._run[2], *([sampler] if sampler and sampler != self._run[2] else []))
            self._measured = measure_rates(self._device, dtypes, quick=True)
        return self._measured


@lru_cache(maxsize=64)
def _step_floors(m: ModelShape, s: StepSettings, matmul: float, bandwidth: float, skinny: float, other: tuple):
    return {name: floor(works, matmul, bandwidth, skinny, other) for name, works in phase_work(m, s).items()}


def phase_table(
    model: ModelShape, steps: list[dict[str, Any]], names: tuple[str, ...], rates: dict[str, Any], dtype: str
) -> dict[str, Any]:
    """Per phase of ``names`` over ``steps`` (``{"times": {phase: seconds}, "settings": StepSettings}``): the median
    measured seconds and, for the modelled phases, the median FLOPs, bytes, floors and ``achieved`` (floor / time)."""
    args = floor_rates(rates, dtype)
    phases: dict[str, Any] = {}
    for name in names:
        timed = [s for s in steps if name in s["times"]]
        if not timed:
            continue
        entry: dict[str, Any] = {"measured_s": statistics.median(s["times"][name] for s in timed)}
        all_floors = [_step_floors(model, s["settings"], *args) for s in timed]
        # a sampled rollout's backward is the GRPO family's only beside its policy_forward
        grpo_backward = name == BACKWARD and not timed[-1]["settings"].soft_topk and "policy_forward" not in names
        if all(name in f for f in all_floors) and not grpo_backward:
            floors = [f[name] for f in all_floors]
            for key in ("flops", "bytes", "compute_s", "memory_s", "floor_s", "attainable_s"):
                entry[key] = statistics.median(f[key] for f in floors)
            entry["bound"] = "compute" if entry["compute_s"] >= entry["memory_s"] else "memory"
            entry["achieved"] = entry["floor_s"] / entry["measured_s"] if entry["measured_s"] > 0 else None
        phases[name] = entry
    return phases


def rerate(report: dict[str, Any], rates: dict[str, Any], source: str) -> dict[str, Any]:
    """``report`` (of :meth:`PhaseRoofline.report`) with its floors at other machine ``rates`` (same steps and times).

    Raises:
        ValueError: when ``rates`` has no matmul rate for the report's dtype.
    """
    if "skipped" in report:
        return report
    dtype = report["rates"]["dtype"]
    if dtype not in rates["dtypes"]:
        raise ValueError(f"{source} has no {dtype} matmul rate")
    steps = [{"times": s["times"], "settings": StepSettings(**s["settings"])} for s in report["per_step"]]
    phases = phase_table(ModelShape(**report["model"]), steps, tuple(report["names"]), rates, dtype)
    return {**report, "rates": _rates_used(rates, dtype, source), "phases": phases}


def _rates_used(rates: dict[str, Any], dtype: str, source: str) -> dict[str, Any]:
    values = rates["dtypes"][dtype]
    return dict(source=source, dtype=dtype, machine=rates.get("machine"), load=rates.get("load_average"),
                matmul_flops_per_s=values["matmul_flops_per_s"], bandwidth_bytes_per_s=rates["bandwidth_bytes_per_s"],
                skinny_matmul_flops_per_s=values["skinny_matmul_flops_per_s"])  # fmt: skip


def summary_line(report: dict[str, Any]) -> str:
    """One line for a run's end summary: each phase's median time beside its floor, or why there is none."""
    if "skipped" in report:
        return f"no floors: {report['skipped']}"
    parts = []
    for name, e in report["phases"].items():
        if "floor_s" in e:
            share = f"{100 * e['achieved']:.2g}%" if e.get("achieved") is not None else "-"
            parts.append(f"{name} {e['measured_s']:.3g} (floor {e['floor_s']:.2g} {e['bound']}, {share})")
        else:
            parts.append(f"{name} {e['measured_s']:.3g} (not modelled)")
    steps = report["steps"]
    where = f"median of steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    text = f"{', '.join(parts)}  ({where}; rates: {report['rates']['source']})"
    return text + (f"; {report['note']}" if report.get("note") else "")
