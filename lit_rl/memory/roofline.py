"""The roofline of a training step: how far each phase is from what the hardware can do.

For each phase of a GRPO-family step (``rollout``, ``reference``, ``policy_forward``, ``backward``, ``optimizer``)
this module counts the least work the phase must do, from the policy's config and the step's shapes alone: matmul
and attention FLOPs, and the bytes that must move between memory and the cores. With a matmul rate (FLOP/s at the
phase's precision) and a memory bandwidth (bytes/s), both from :mod:`lit_rl.memory.machine_rates`, the phase's floor
is, for each part of it (the prefill, each decode step, each micro-batch's pass), summed over the parts::

    floor = max(FLOPs / matmul rate, bytes / bandwidth)

and ``floor / measured seconds`` is the share of the hardware the phase achieved. FLOPs and bytes do not depend
on the machine or its load; the rates and the measured times do. The matmul rate is that of large square GEMMs;
``attainable_s`` uses the rate measured on a decode-shaped GEMM for the decode steps instead (what the matmul
library reaches on a few rows per weight), so the rollout's gap splits into "the library on skinny shapes" and
the rest.

Counts, with ``H`` hidden size, ``I`` intermediate size, ``L`` layers, ``nh``/``nkv`` query/key-value heads of size
``d``, ``V`` vocabulary, ``W = L * (2*H*nh*d + 2*H*nkv*d + 3*H*I)`` the trunk's matmul weights (``2*H*I`` for a
plain GPT-2 MLP; biases, norms and embedding gathers not counted) and ``A`` the LoRA adapter weights:

- a token through the trunk costs ``2 * (W + A)`` FLOPs, one through the LM head ``2 * H * V`` (the logits-free
  ops compute every logit, in chunks);
- attention costs ``4 * nh * d * q * k`` per layer for ``q`` queries over ``k`` keys: the whole rectangle a masked
  kernel computes (a causal kernel may skip up to half of it); softmax and element-wise work are not counted;
- bytes: each weight a pass uses is read once per pass (per micro-batch, per decode step), the KV cache is read
  once per decode step and each new entry written once, gradients and optimizer state as below; activations are
  assumed to stay in cache, so bytes are a lower bound.

Phases (``B`` prompts, ``G`` completions per prompt, ``P`` the batch's padded prompt width, ``C`` the step's longest
completion, as :class:`~lit_rl.memory.step_prediction.StepShape` reads them):

- ``rollout``: a prefill of ``P - 1`` tokens per prompt (once per prompt with shared-prompt passes, once per
  completion without; no head), then ``C`` decode steps of ``B * G`` rows, step ``j`` attending over ``P + j - 1``
  keys and running the head; each reads every weight (``W + A + H*V``) and the cache so far. Reward functions and
  text decoding are not counted.
- ``reference``: a no-grad forward over the rollout per scoring pass, per micro-batch: ``u*P + b*C`` trunk tokens
  for ``b`` completions of ``u`` prompts with shared-prompt passes
  (:func:`~lit_rl.models.shared_prompt.group_runs`), ``b*(P + C)`` without, and the head on the ``b*C`` completion
  tokens. The passes are the ones the method declares in ``step_work()``
  (:class:`~lit_rl.memory.rollout.StepWork`): one for the reference when it runs, plus ``scoring_passes`` of the
  policy (RefCachedGRPO's old log-probs, Intuitor's self-certainty); adapters are not counted here.
- ``policy_forward``: the same forward with adapters, once per micro-batch and per iteration
  (``StepWork.iterations``, optimizer steps per rollout batch).
- ``backward``: full fine-tuning: twice the forward's trunk and attention FLOPs (input and weight gradients) and
  three times its head FLOPs (the chunked head recomputes its logits). LoRA: the frozen weights get no gradient,
  so once the trunk's FLOPs (the first layer's input gradient included, which only checkpointing asks for),
  twice the adapters' and the attention's, twice the head's. Activation checkpointing adds a forward of each
  checkpointed layer but, in full fine-tuning, its MLP's down projection (``H*I``: PyTorch's non-reentrant
  checkpoint stops recomputing once the backward has what it needs; under LoRA only the last, tiny adapter matmul
  is skipped, which is not counted). Bytes: the weights again (and again for the recomputation), the gradients
  written (read too when a later micro-batch adds to them).
- ``optimizer``: no matmul; per trainable value fused AdamW reads the gradient and reads and writes the parameter
  and both moments (7 accesses), the finite-gradient check reads the gradient (1), clipping reads it for the norm
  and reads and writes it to scale (3).

Precision: the matmul rate of the dtype the matmuls run in (bfloat16 or float16 under ``bf16-*``/``16-*``
precision, else the weights' dtype); weights, gradients and optimizer state at the weights' size (float32 master
weights under mixed precision), the KV cache at the compute dtype's.

Not modelled, and reported as such: other phase names (GumbelTopK's ``generate`` and ``reward``, and then its
``backward``), mixture-of-experts layers, a 4-bit base.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from lit_rl.memory.estimate import settings_from
from lit_rl.memory.machine_rates import load_rates, measure_rates
from lit_rl.memory.phases import BACKWARD, OPTIMIZER
from lit_rl.memory.rollout import StepWork, rollout_shape, step_work
from lit_rl.memory.step_prediction import step_shape
from lit_rl.models import base_model
from lit_rl.models.shared_prompt import group_runs

MEASURE = "measure"
MODELLED = ("rollout", "reference", "policy_forward", BACKWARD, OPTIMIZER)
_PRECISION_DTYPE = {"bf16": "bfloat16", "16": "float16"}  # mixed and true half precision compute in these


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that set its FLOPs and bytes."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    gated: bool = True  # gate, up and down projections (Llama, Qwen); False: GPT-2's two

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (Llama/Qwen/Mistral-like or GPT-2 field names).

        Raises:
            ValueError: for a mixture-of-experts config or one without these fields.
        """
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if any(getattr(text, n, None) for n in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise ValueError("mixture-of-experts layers are not modelled")

        def get(*names: str) -> Any:
            return next((getattr(text, n) for n in names if getattr(text, n, None) is not None), None)

        hidden, layers, heads = (
            get("hidden_size", "n_embd"),
            get("num_hidden_layers", "n_layer"),
            get("num_attention_heads", "n_head"),
        )
        if not (hidden and layers and heads and getattr(text, "vocab_size", None)):
            raise ValueError(f"{type(text).__name__} has no hidden size, layer count, head count or vocabulary")
        gpt2 = getattr(text, "model_type", "") == "gpt2"
        return cls(
            hidden=hidden,
            intermediate=get("intermediate_size", "n_inner") or 4 * hidden,
            layers=layers,
            heads=heads,
            kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or hidden // heads,
            vocab=text.vocab_size,
            gated=not gpt2,
        )

    @property
    def trunk_weights(self) -> int:
        """``W``: matmul weights of every decoder layer (attention projections and MLP)."""
        h, d = self.hidden, self.head_dim
        attention = 2 * h * self.heads * d + 2 * h * self.kv_heads * d  # q and o, k and v
        return self.layers * (attention + (3 if self.gated else 2) * h * self.intermediate)

    @property
    def head_weights(self) -> int:
        return self.hidden * self.vocab

    def attention_flops(self, pairs: int) -> int:
        """FLOPs of ``pairs`` (query, key) pairs in every layer: ``q @ k`` and ``p @ v``."""
        return 4 * self.heads * self.head_dim * self.layers * pairs

    @property
    def cache_values_per_token(self) -> int:
        """Keys and values one token adds to the KV cache, over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class StepSettings:
    """What, besides the model's shape, sets a step's work (the fields of the phases above)."""

    prompts: int  # B
    generations: int  # G
    prompt_length: int  # P, the padded width
    new_tokens: int  # C, the longest completion
    micro_batch: int | None = None  # completions per forward; None: all at once
    share_prompt: bool = True
    adapters: int = 0  # LoRA adapter weights; 0: full fine-tuning
    trainable: int = 0  # values the optimizer updates
    weight_bytes: int = 4  # per weight, gradient and optimizer value
    cache_bytes: int = 4  # per KV-cache value (the compute dtype)
    reference_passes: int = 1
    iterations: int = 1  # optimizer steps per rollout batch
    checkpointed_layers: int = 0
    clip: bool = True

    @classmethod
    def of(cls, work: StepWork, *, trainable: int, **shapes: Any) -> StepSettings:
        """The settings of a step whose passes ``work`` declares (:func:`~lit_rl.memory.rollout.step_work`), at
        ``shapes``: the other fields (``prompts``, ``generations``, lengths, ``micro_batch``, byte sizes,
        ``checkpointed_layers``). The one constructor the profiler's roofline and the planner share."""
        return cls(
            share_prompt=work.share_prompt,
            adapters=trainable if work.adapters else 0,
            trainable=trainable,
            reference_passes=int(work.reference_pass) + work.scoring_passes,
            iterations=work.iterations,
            clip=work.clip,
            **shapes,
        )


@dataclass(frozen=True)
class Work:
    """One part of a phase: FLOPs and the least bytes it moves; ``decode``: a decode step's few-row matmuls."""

    flops: float
    bytes: float
    decode: bool = False


def _micro_batches(s: StepSettings) -> list[tuple[int, int, int]]:
    """``(completions b, trunk tokens, attention pairs)`` of each micro-batch's forward."""
    n = s.prompts * s.generations
    size = s.micro_batch or n
    p, c = s.prompt_length, s.new_tokens
    out = []
    for start in range(0, n, size):
        stop = min(start + size, n)
        b = stop - start
        if s.share_prompt:
            u = len(group_runs(start, stop, s.generations))
            out.append((b, u * p + b * c, u * p * p + b * c * (p + c)))
        else:
            out.append((b, b * (p + c), b * (p + c) ** 2))
    return out


def phase_work(m: ModelShape, s: StepSettings) -> dict[str, list[Work]]:
    """The parts of each modelled phase of one step (the counts of the module docstring)."""
    wb, w, a, hv = s.weight_bytes, m.trunk_weights, s.adapters, m.head_weights
    rows = s.prompts * s.generations
    kv = m.cache_values_per_token * s.cache_bytes  # bytes per cached token
    rollout = []
    prefill_rows = s.prompts if s.share_prompt and s.generations > 1 and s.prompt_length > 1 else rows
    p = s.prompt_length - 1
    if p > 0:
        tokens = prefill_rows * p
        flops = 2 * tokens * (w + a) + m.attention_flops(prefill_rows * p * p)
        rollout.append(Work(flops, (w + a) * wb + tokens * kv))
    for j in range(1, s.new_tokens + 1):
        keys = s.prompt_length + j - 1
        flops = 2 * rows * (w + a + hv) + m.attention_flops(rows * keys)
        rollout.append(Work(flops, (w + a + hv) * wb + rows * keys * kv + rows * kv, decode=True))

    def forward(tokens: int, pairs: int, head_tokens: int, adapters: int) -> Work:
        flops = 2 * tokens * (w + adapters) + m.attention_flops(pairs) + 2 * head_tokens * hv
        return Work(flops, (w + adapters + hv) * wb)

    micro = _micro_batches(s)
    reference = [forward(t, q, b * s.new_tokens, 0) for _ in range(s.reference_passes) for b, t, q in micro]
    policy = [forward(t, q, b * s.new_tokens, a) for b, t, q in micro] * s.iterations
    # a checkpointed layer runs its forward again until the backward has every tensor it needs (PyTorch's
    # non-reentrant checkpoint stops early): all but the MLP's down projection, whose output is not one of them;
    # under LoRA that projection runs before its adapter, whose input is needed, so only the last adapter is skipped
    share = s.checkpointed_layers / m.layers
    skipped = 0 if a else m.hidden * m.intermediate
    redo = s.checkpointed_layers * (w // m.layers - skipped) + share * a  # weights the recomputation multiplies by
    backward = []
    for i, (b, t, q) in enumerate(micro):
        trunk, adapt, attn, head = 2 * t * w, 2 * t * a, m.attention_flops(q), 2 * b * s.new_tokens * hv
        flops = (trunk + 2 * adapt + 2 * attn + 2 * head) if a else (2 * trunk + 2 * attn + 3 * head)
        flops += 2 * t * redo + share * attn
        grads = s.trainable * wb * (1 if i == 0 else 2)
        backward.append(Work(flops, (w + a + redo + hv) * wb + grads))
    optimizer = [Work(0, s.trainable * wb * (7 + 1 + (3 if s.clip else 0)))]
    return {
        "rollout": rollout,
        "reference": reference,
        "policy_forward": policy,
        BACKWARD: backward * s.iterations,
        OPTIMIZER: optimizer * s.iterations,
    }


def floor(works: list[Work], matmul: float, bandwidth: float, skinny: float | None = None) -> dict[str, Any]:
    """FLOPs, bytes and the floor of a phase's parts at ``matmul`` FLOP/s and ``bandwidth`` bytes/s.

    ``skinny``: the decode-shaped matmul rate, for ``attainable_s`` (the decode steps at that rate).
    """
    flops, moved = sum(x.flops for x in works), sum(x.bytes for x in works)
    compute_s, memory_s = flops / matmul, moved / bandwidth
    floor_s = sum(max(x.flops / matmul, x.bytes / bandwidth) for x in works)
    rate = {False: matmul, True: skinny or matmul}
    attainable_s = sum(max(x.flops / rate[x.decode], x.bytes / bandwidth) for x in works)
    return {
        "flops": flops,
        "bytes": moved,
        "compute_s": compute_s,
        "memory_s": memory_s,
        "floor_s": floor_s,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "attainable_s": attainable_s,
    }


@lru_cache(maxsize=64)
def _step_floors(m: ModelShape, s: StepSettings, matmul: float, bandwidth: float, skinny: float):
    return {name: floor(works, matmul, bandwidth, skinny) for name, works in phase_work(m, s).items()}


# ------------------------------------------------------------------------------------- the profiler's report


def _run_settings(trainer, module) -> tuple[ModelShape, StepSettings, str]:
    """The model's shape, the settings every step of this run shares (lengths come per step), the compute dtype."""
    policy = module.policy
    if any(p.dtype == torch.uint8 for p in policy.parameters()):
        raise ValueError("a 4-bit base is not modelled")
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
        prompts=1,
        generations=rollout.completions_per_prompt,
        prompt_length=1,
        new_tokens=rollout.max_new_tokens,
        micro_batch=work.micro_batch,
        weight_bytes=weight.element_size(),
        cache_bytes=getattr(torch, dtype).itemsize,
        checkpointed_layers=len(range(0, shape.layers, every)) if every else 0,
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
            self._measured = measure_rates(self._device, (self._run[2],), quick=True)
        return self._measured


def phase_table(
    model: ModelShape, steps: list[dict[str, Any]], names: tuple[str, ...], rates: dict[str, Any], dtype: str
) -> dict[str, Any]:
    """Per phase of ``names`` over ``steps`` (``{"times": {phase: seconds}, "settings": StepSettings}``): the median
    measured seconds and, for the modelled phases, the median FLOPs, bytes, floors and ``achieved`` (floor / time)."""
    per_dtype = rates["dtypes"][dtype]
    args = (per_dtype["matmul_flops_per_s"], rates["bandwidth_bytes_per_s"], per_dtype["skinny_matmul_flops_per_s"])
    phases: dict[str, Any] = {}
    for name in names:
        timed = [s for s in steps if name in s["times"]]
        if not timed:
            continue
        entry: dict[str, Any] = {"measured_s": statistics.median(s["times"][name] for s in timed)}
        if name in MODELLED and (name != BACKWARD or "policy_forward" in names):
            floors = [_step_floors(model, s["settings"], *args)[name] for s in timed]
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
