"""Predict the peak memory of one training step, per phase, before a single weight is loaded.

``lit-rl estimate --config configs/grpo.yaml [--model.init_args.* ...] [--device-memory 80GiB]``

How: the policy is built from its *config* on the meta device (no weights are read), LoRA is added if
configured, and the model is materialised on a **fake** CPU device (``FakeTensorMode``: tensors that
have shapes, dtypes and devices but no storage). Then the method's own step runs on the fake tensors
under :class:`~lit_rl.memory.tracker.TensorMemoryTracker`, the exact tensor accounting that
:class:`~lit_rl.callbacks.MemoryProfiler` uses on CPU. Predicted and measured are therefore the same
quantity, *bytes held by tensors* (``memory/<phase>/predicted_gib`` beside ``memory/<phase>/peak_gib``),
and a Qwen2.5-3B-shaped step is predicted in about a minute on a laptop CPU.

What runs, phase by phase (assuming every completion runs to ``max_new_tokens``):

- ``rollout``: the prefill and the decode steps with a ``DynamicCache``, as ``generate`` does them
  (``logits_to_keep=1``, a float32 copy of the last logits, softmax, multinomial), then the rollout
  tensors the method keeps. ``generate`` itself is not called: its stopping checks read tensor values,
  which fake tensors do not have. Decode steps differ only in the cache length, which only grows, so
  by default the prefill, the first and the last decode step run and the cache is grown in between
  (same peak, seconds instead of minutes for long rollouts; ``full_decode=True`` runs every step).
- ``reference``: the method's own ``score_rollout`` on a full-length fake rollout.
- ``policy_forward`` / ``backward``: the method's own ``policy_loss`` per micro-batch, then ``backward()``.
- ``optimizer``: gradient clipping (``max_grad_norm``) and a ``step()`` of the method's own optimizer.

The prediction is for the **steady state** (second step on), when the optimizer state already exists;
:attr:`Estimate.first_step` is the first step, whose phases before ``optimizer`` have no state yet.

Not included, because they are not tensor bytes (add headroom for them on a GPU): the CUDA context
(~0.3-0.5 GiB), cuBLAS/cuDNN workspaces, the caching allocator's rounding and fragmentation (the
profiler's ``reserved_gib``), NCCL buffers, the Python heap.

Where a prediction can differ from a measurement:

- Prompt length: the prediction pads every prompt to ``data.max_prompt_length`` (or ``prompt_length``);
  a real batch is padded to its longest prompt, so the prediction is an upper bound.
- Attention mask: transformers cannot read a fake mask, so on its own it would always build the
  ``[B, 1, q, kv]`` boolean mask that a real unpadded batch skips. The estimator decides as a real run
  does: a batch of several prompts is left-padded (mask built), a single prompt repeated
  ``num_generations`` times is not (``padded``).
- Kernels are the CPU ones. SDPA's CPU flash kernel saves the output and the log-sum-exp, like CUDA's
  flash and memory-efficient kernels, so attention activations match; AdamW updates one tensor at a time
  on CPU but uses ``foreach`` on CUDA, which holds temporaries the size of all trainable weights:
  ``device_type="cuda"`` switches to ``foreach`` to predict that. Mixed precision autocasts with the CPU
  autocast op lists.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lit_rl.memory.phases import PHASES
from lit_rl.memory.tracker import TensorMemoryTracker

GIB = 2**30
MIB = 2**20

# Model shapes built in code, so a config can be estimated without the network: ``shape:<name>``.
# Values are those of the published config.json files (Qwen2.5-Coder-3B has the 3B's shape).
BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768,
    ),
    "qwen2.5-3b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=32768,
    ),
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    ),
}  # fmt: skip
SHAPE_PREFIX = "shape:"

# trainer.precision -> (weight dtype or None to keep the loaded one, autocast dtype or None)
PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "32-true": (None, None),
    "32": (None, None),
    "bf16-true": (torch.bfloat16, None),
    "bf16-mixed": (None, torch.bfloat16),
    "16-true": (torch.float16, None),
    "16-mixed": (None, torch.float16),
}

# the tactics estimate_savings() predicts, with the OOMReport's names
TACTIC_HOW: dict[str, str] = {
    "activation_checkpointing": "--config callbacks/activation_checkpointing.yaml",
    "micro_batch": "--model.init_args.micro_batch_size {value}",
    "lora": "--model.init_args.lora.r 16 (LoRA on all linear layers)",
    "bf16": "--trainer.precision bf16-true",
}
_TEMPORARY_PHASES = ("backward", "optimizer")


# ------------------------------------------------------------------------------------------------ results


@dataclass
class Component:
    """One line of the component table: what holds memory, its shape and its bytes."""

    name: str
    shape: str
    bytes: int
    note: str = ""


@dataclass
class Estimate:
    """Predicted per-phase peaks (bytes held by tensors) of one steady-state training step.

    Attributes:
        phases: phase -> peak bytes, the phases the step announces (``reference`` is absent with
            ``beta = 0`` and one iteration); the same quantity as ``memory/<phase>/peak_gib``.
        first_step: the same for the first step, before the optimizer state exists.
        breakdown: phase -> bytes per category (:data:`~lit_rl.memory.tracker.CATEGORIES`) at its peak.
        components: the table of what holds memory (parameters, gradients, optimizer state, KV cache, ...).
        settings: what was assumed (model, batch, lengths, precision, micro-batch, tactics, ...).
        seconds: wall time of the estimate.
    """

    phases: dict[str, int]
    first_step: dict[str, int]
    breakdown: dict[str, dict[str, int]]
    components: list[Component]
    settings: dict[str, Any]
    seconds: float = 0.0
    _result: Any = field(default=None, repr=False, compare=False)  # what a tactic re-run reuses

    @property
    def peak_bytes(self) -> int:
        """The step's peak: the largest phase peak."""
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r}; have {[c.name for c in self.components]}")

    def table(self) -> str:
        """The component table and the per-phase peaks, as plain text."""
        s = self.settings
        lines = [
            f"{s['method']} on {s['model']} ({s['architecture']}), precision {s['precision']}, "
            f"{'LoRA' if s['lora'] else 'full fine-tuning'}, predicted for {s['device_type']}",
            f"batch {s['batch']} completions ({s['prompts']} prompt{'s' * (s['prompts'] != 1)} x {s['num_generations']} "
            f"generations), "
            f"prompt {s['prompt_length']} + {s['max_new_tokens']} new tokens = {s['sequence_length']}, "
            f"micro-batch {s['micro_batch_size']}, activation checkpointing "
            f"{'on' if s['activation_checkpointing'] else 'off'}, attention mask "
            f"{'built (padded prompts)' if s['padded'] else 'skipped (no padding)'}",
            "",
        ]
        width = max(len(c.name) for c in self.components)
        shape_w = max(len(c.shape) for c in self.components)
        lines.append(f"{'component':<{width}}  {'shape':<{shape_w}}  {'bytes':>15}  {'':>10}  note")
        for c in self.components:
            lines.append(
                f"{c.name:<{width}}  {c.shape:<{shape_w}}  {c.bytes:>15,}  {format_bytes(c.bytes):>10}  {c.note}"
            )
        lines += ["", f"{'phase':<15} {'peak GiB':>9} {'peak':>10} {'first step':>11}   at the peak"]
        for name, peak in self.phases.items():
            parts = [f"{k} {format_bytes(v)}" for k, v in self.breakdown.get(name, {}).items() if v >= 0.005 * peak]
            lines.append(
                f"{name:<15} {peak / GIB:>9.4f} {format_bytes(peak):>10} {self.first_step[name] / GIB:>11.4f}   "
                f"{', '.join(parts)}"
            )
        first = max(self.first_step.values())
        lines.append(
            f"{'step':<15} {self.peak_bytes / GIB:>9.4f} {format_bytes(self.peak_bytes):>10} {first / GIB:>11.4f}"
        )
        lines.append(
            "\ntensor bytes (what memory/<phase>/peak_gib measures); a GPU adds the CUDA context, workspaces and "
            "allocator fragmentation on top."
        )
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


_UNITS = {
    "": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> bytes. Binary units (``KiB``, ``MiB``, ``GiB``, ``TiB``, and bare ``K/M/G/T``) and decimal ones
    (``kB``, ``MB``, ``GB``, ``TB``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 80GiB, 24GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


# ------------------------------------------------------------------------------------------------ configs


def model_config_for(
    name_or_path: str,
    *,
    model_config: Any = None,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
):
    """The transformers config of the policy, read without loading any weight.

    Args:
        name_or_path: the method's ``name_or_path`` (``embedded``, ``tiny:*``, ``shape:*``, a folder, a GGUF file
            or a hub id).
        model_config: overrides it: a ``PretrainedConfig``, ``shape:<name>`` (see :data:`BUILTIN_SHAPES`), or a
            ``config.json`` file or folder holding one.
        gguf_file: as for the method.
        trust_remote_code: as for the method.

    Raises:
        ValueError: when the config cannot be read (a hub id without network), naming ``--model-config``.
    """
    from transformers import AutoConfig, PretrainedConfig

    from lit_rl.models import EMBEDDED, EMBEDDED_NAME, TINY_PREFIX, cache_dir, resolve_source

    source = name_or_path if model_config is None else model_config
    if isinstance(source, PretrainedConfig):
        return copy.deepcopy(source)
    source = str(source)
    if source.startswith(SHAPE_PREFIX):
        name = source[len(SHAPE_PREFIX) :].lower()
        if name not in BUILTIN_SHAPES:
            raise ValueError(
                f"unknown model shape {source!r}; use one of {', '.join(SHAPE_PREFIX + n for n in BUILTIN_SHAPES)}"
            )
        kwargs = dict(BUILTIN_SHAPES[name])
        return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    if source.startswith(TINY_PREFIX):
        from lit_rl.testing import tiny_config, tiny_tokenizer

        # configure_model sizes a tiny model's vocabulary to its tokenizer
        return tiny_config(source[len(TINY_PREFIX) :], vocab_size=len(tiny_tokenizer()))
    if source == EMBEDDED:
        converted = cache_dir() / EMBEDDED_NAME / "config.json"
        if converted.exists():
            return AutoConfig.from_pretrained(converted)
        return model_config_for(EMBEDDED, model_config=SHAPE_PREFIX + "smollm2-135m")
    try:
        if model_config is not None:
            return AutoConfig.from_pretrained(Path(source).expanduser(), trust_remote_code=trust_remote_code)
        path, gguf = resolve_source(source, gguf_file)
        return AutoConfig.from_pretrained(path, gguf_file=gguf, trust_remote_code=trust_remote_code)
    except Exception as err:  # a hub id without network, a folder without config.json, ...
        raise ValueError(
            f"cannot read the model config of {source!r} ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
            f"pass --model-config path/to/config.json or one of {', '.join(SHAPE_PREFIX + n for n in BUILTIN_SHAPES)}"
        ) from err


def _weight_dtype(dtype: str, config) -> torch.dtype:
    from lit_rl.models import DTYPES

    if dtype not in DTYPES:
        raise ValueError(f"model.dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    resolved = DTYPES[dtype]
    if resolved == "auto":
        resolved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if isinstance(resolved, str):
            resolved = getattr(torch, resolved)
    return resolved


# ------------------------------------------------------------------------------------------------ estimate


def estimate_step(
    module,
    *,
    batch_size: int,
    prompt_length: int,
    model_config: Any = None,
    precision: str = "32-true",
    activation_checkpointing: int = 0,
    padded: bool | None = None,
    device_type: str = "cpu",
    full_decode: bool = False,
    _reuse_rollout: Estimate | None = None,
    **overrides: Any,
) -> Estimate:
    """Predict the per-phase peak memory of one training step of ``module``, without loading weights.

    ``module`` itself is never changed: a copy is built from its hyper-parameters (with ``overrides``),
    so this is safe to call on the module being trained.

    Args:
        module: a method whose step is rollout -> ``score_rollout`` -> ``policy_loss`` per micro-batch ->
            optimizer (:class:`~lit_rl.methods.RefCachedGRPO`, :class:`~lit_rl.methods.Intuitor`).
        batch_size: prompts per step (``data.batch_size``); the step has ``batch_size * num_generations``
            completions.
        prompt_length: prompt tokens (``data.max_prompt_length`` for the worst case).
        model_config: see :func:`model_config_for`; ``None`` reads it from ``name_or_path``.
        precision: ``trainer.precision`` (``32-true``, ``bf16-true``, ``bf16-mixed``, ``16-true``, ``16-mixed``).
        activation_checkpointing: 0 for off, else checkpoint every n-th decoder layer (the
            :class:`~lit_rl.callbacks.ActivationCheckpointing` callback's ``every_n_layers``).
        padded: whether prompts are left-padded (the attention mask is built); ``None``: when
            ``batch_size > 1``.
        device_type: ``cpu`` or ``cuda``: which AdamW implementation to mirror (per tensor / ``foreach``).
        full_decode: run every decode step. By default only the prefill, the first and the last decode
            step run, with the KV cache grown to its final length in between: the steps in between hold
            less (a shorter cache), so the peak is the same, and a long rollout costs seconds, not minutes.
        **overrides: hyper-parameters to change (``micro_batch_size=4``, ``lora=LoraSettings()``, ...).

    Returns:
        The :class:`Estimate`.
    """
    start = time.perf_counter()
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision: {precision!r} is not one of {sorted(PRECISIONS)} (for the estimate)")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if batch_size < 1 or prompt_length < 1:
        raise ValueError(f"batch_size and prompt_length must be >= 1, got {batch_size} and {prompt_length}")
    method = _copy_method(module, overrides)
    for name in ("score_rollout", "policy_loss", "_micro_batches"):
        if not hasattr(method, name):
            raise NotImplementedError(
                f"estimate needs a method with rollout -> score_rollout -> policy_loss (RefCachedGRPO, Intuitor); "
                f"{type(method).__name__} has no {name}()"
            )
    hp = method.hparams
    mkw = method._model_kwargs
    config = model_config_for(
        method.name_or_path,
        model_config=model_config,
        gguf_file=mkw["gguf_file"],
        trust_remote_code=mkw["trust_remote_code"],
    )
    weight_dtype = _weight_dtype(mkw["dtype"], config)
    cast_dtype, autocast_dtype = PRECISIONS[precision]
    padded = batch_size > 1 if padded is None else padded
    plan = _Plan(
        prompts=batch_size,
        generations=hp.num_generations,
        prompt_length=prompt_length,
        new_tokens=hp.max_new_tokens,
        padded=padded,
        autocast_dtype=autocast_dtype,
        default_dtype=cast_dtype,
    )
    # dtypes are set on the meta device: fake parameters cannot be converted in place
    policy = _build_model(config, weight_dtype, mkw["lora"], name=method.name_or_path)
    if cast_dtype is not None:  # Lightning's true-half precision converts the whole module after configure_model
        policy.to(cast_dtype)
    reference = None
    if hp.beta > 0 and mkw["lora"] is None:  # the frozen copy a full fine-tuning run keeps, in the policy's dtype
        reference = _build_model(config, next(policy.parameters()).dtype, None, name=method.name_or_path)
        reference.eval().requires_grad_(False)
    with _fake_mode(), _estimate_patches(padded):
        policy.to_empty(device="cpu")
        _tie(policy)
        policy.config.use_cache = True
        policy.train()
        if reference is not None:
            reference.to_empty(device="cpu")
            _tie(reference)
        if activation_checkpointing:
            _enable_checkpointing(policy, activation_checkpointing)
        method.policy = policy
        method.__dict__["reference"] = reference
        optimizer = method.configure_optimizers()
        if isinstance(optimizer, (list, tuple)):
            optimizer = optimizer[0]
        if isinstance(optimizer, dict):  # {"optimizer": ..., "lr_scheduler": ...}
            optimizer = optimizer["optimizer"]
        if device_type == "cuda":  # what torch picks for CUDA tensors
            for group in optimizer.param_groups:
                group["foreach"] = True
        simulation = _Simulation(method, policy, reference, optimizer, plan, full_decode=full_decode)
        result = simulation.run(_reuse_rollout)
    settings = dict(
        method=type(method).__name__,
        model=str(model_config) if isinstance(model_config, str) else method.name_or_path,
        architecture=type(_base(policy)).__name__,
        precision=precision,
        lora=mkw["lora"] is not None,
        device_type=device_type,
        prompts=batch_size,
        num_generations=hp.num_generations,
        batch=plan.batch,
        prompt_length=prompt_length,
        max_new_tokens=hp.max_new_tokens,
        sequence_length=prompt_length + hp.max_new_tokens,
        micro_batch_size=min(hp.micro_batch_size or plan.batch, plan.batch),
        activation_checkpointing=activation_checkpointing,
        padded=padded,
        beta=hp.beta,
        num_iterations=hp.num_iterations,
        config=config,
        hparams=dict(hp),
    )
    estimate = Estimate(
        phases=result.phases,
        first_step=result.first_step,
        breakdown=result.breakdown,
        components=_components(result, method, policy, reference, config, plan, settings),
        settings=settings,
        seconds=time.perf_counter() - start,
        _result=result,
    )
    return estimate


def trainer_settings(trainer) -> dict[str, Any]:
    """The keyword arguments of :func:`estimate_step` that a Trainer knows: the datamodule's ``batch_size`` and
    ``max_prompt_length``, ``trainer.precision``, an :class:`~lit_rl.callbacks.ActivationCheckpointing` callback
    and the device type.

    Raises:
        ValueError: without a datamodule that has ``batch_size`` and ``max_prompt_length``.
    """
    settings = _settings_from(
        getattr(trainer, "datamodule", None),
        precision=str(trainer.precision),
        callbacks=trainer.callbacks,
        device_type="cuda" if trainer.strategy.root_device.type == "cuda" else "cpu",
    )
    if "batch_size" not in settings or "prompt_length" not in settings:
        raise ValueError(
            "estimate: the trainer has no datamodule with batch_size and max_prompt_length; "
            "call estimate_step(module, batch_size=..., prompt_length=...) instead"
        )
    return settings


def estimate_for_trainer(trainer, pl_module, **kwargs: Any) -> Estimate:
    """:func:`estimate_step` with :func:`trainer_settings` (``kwargs`` override them).

    Use it to fill ``pl_module.predicted_memory`` (logged by the MemoryProfiler) once the Trainer is set up::

        pl_module.predicted_memory = estimate_for_trainer(trainer, pl_module).phases
    """
    return estimate_step(pl_module, **{**trainer_settings(trainer), **kwargs})


def estimate_savings(module, baseline: Estimate | None = None, **settings: Any) -> dict[str, int]:
    """Predicted saving of each memory tactic that is not on yet: tactic -> bytes off the step peak.

    Each tactic is estimated by re-running :func:`estimate_step` with it applied:
    ``activation_checkpointing`` (every layer), ``micro_batch`` (half the current micro-batch),
    ``lora`` (r=16 on all linear layers; also drops the frozen reference copy) and ``bf16`` (``bf16-true``).
    Tactics that only change the policy update reuse the baseline's rollout, so they are cheap.
    The keys are those of :data:`lit_rl.callbacks.oom_report.TACTICS` (``empty_cache`` is absent: it frees
    allocator blocks, not tensor bytes).

    Args:
        module: as for :func:`estimate_step`.
        baseline: the estimate without the tactics (computed if not given).
        **settings: the keyword arguments of :func:`estimate_step`.
    """
    baseline = baseline or estimate_step(module, **settings)
    return {name: saved for name, (saved, _) in _tactic_estimates(module, baseline, settings).items()}


def _tactic_estimates(module, baseline: Estimate, settings: dict[str, Any]) -> dict[str, tuple[int, Estimate]]:
    out: dict[str, tuple[int, Estimate]] = {}
    for name, change in _tactics(baseline).items():
        kwargs = {**settings, **change}
        reuse = baseline if name in ("activation_checkpointing", "micro_batch") else None
        estimate = estimate_step(module, _reuse_rollout=reuse, **kwargs)
        out[name] = (baseline.peak_bytes - estimate.peak_bytes, estimate)
    return out


def _tactics(baseline: Estimate) -> dict[str, dict[str, Any]]:
    """The settings change of each tactic that is not on yet."""
    from lit_rl.models import LoraSettings

    s = baseline.settings
    tactics: dict[str, dict[str, Any]] = {}
    if not s["activation_checkpointing"]:
        tactics["activation_checkpointing"] = {"activation_checkpointing": 1}
    if s["micro_batch_size"] > 1:
        tactics["micro_batch"] = {"micro_batch_size": max(1, s["micro_batch_size"] // 2)}
    if not s["lora"]:
        tactics["lora"] = {"lora": LoraSettings()}
    if s["precision"] in ("32-true", "32"):
        tactics["bf16"] = {"precision": "bf16-true"}
    return tactics


# ------------------------------------------------------------------------------------------------ internals


@dataclass
class _Plan:
    prompts: int
    generations: int
    prompt_length: int
    new_tokens: int
    padded: bool
    autocast_dtype: torch.dtype | None
    default_dtype: torch.dtype | None

    @property
    def batch(self) -> int:
        return self.prompts * self.generations


@dataclass
class _Result:
    phases: dict[str, int] = field(default_factory=dict)
    first_step: dict[str, int] = field(default_factory=dict)
    breakdown: dict[str, dict[str, int]] = field(default_factory=dict)
    kv_cache_bytes: int = 0
    kv_cache_shape: str = ""
    generation_logits_bytes: int = 0
    saved_activations: int = 0
    saved_rows: int = 0
    rollout_bytes: int = 0
    cache_bytes: dict[str, int] = field(default_factory=dict)
    state_bytes: int = 0
    state_tensors: int = 0


def _copy_method(module, overrides: dict[str, Any]):
    """A fresh instance of ``module``'s class from its hyper-parameters: the estimate never touches the original."""
    import inspect

    accepted = inspect.signature(type(module).__init__).parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    # hparams may carry extras (jsonargparse's _class_path) that the constructor does not take
    hparams = {k: v for k, v in dict(module.hparams).items() if open_ended or k in accepted}
    hparams.update(overrides)
    if isinstance(hparams.get("lora"), dict):  # save_hyperparameters stores the LoraSettings dataclass as a dict
        from lit_rl.models import LoraSettings

        hparams["lora"] = LoraSettings(**hparams["lora"])
    try:
        return type(module)(**hparams)
    except TypeError as err:
        raise TypeError(f"estimate: cannot rebuild {type(module).__name__} from its hparams ({err})") from err


@contextlib.contextmanager
def _fake_mode() -> Iterator[Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # allow_scalar_outputs: `.item()` in the methods' statistics returns a symbolic float instead of failing;
    # allow_non_fake_inputs: the meta-device model is turned into fake tensors by to_empty()
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(allow_scalar_outputs=True))
    with mode:
        yield mode


@contextlib.contextmanager
def _estimate_patches(padded: bool) -> Iterator[None]:
    """What fake tensors cannot do on their own, decided as the real run would decide it."""
    import torch.optim.adam as adam_module
    import transformers.masking_utils as masking_utils
    from torch._subclasses.fake_tensor import FakeTensor

    def ignore_causal_mask(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        # transformers reads the mask to skip building it when nothing is padded; a fake mask has no values
        if padded or (local_attention_size is not None and kv_length >= local_attention_size):
            return False
        return q_length == 1 or kv_length == q_length or q_offset == 0

    original_get_value = adam_module._get_value

    def get_value(x):
        # Adam reads its step counter with .item() for the bias correction; the value does not change memory
        return 1.0 if isinstance(x, FakeTensor) else original_get_value(x)

    original_ignore = masking_utils._ignore_causal_mask_sdpa
    masking_utils._ignore_causal_mask_sdpa = ignore_causal_mask
    adam_module._get_value = get_value
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original_ignore
        adam_module._get_value = original_get_value


def _build_model(config, dtype: torch.dtype, lora, *, name: str):
    """The causal LM on the meta device, with LoRA adapters as :func:`lit_rl.models.load_causal_lm` adds them."""
    from transformers import AutoModelForCausalLM

    from lit_rl.models import apply_lora, check_supported

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    model.to(dtype)
    check_supported(model, name)
    if lora is not None:
        model = apply_lora(model, lora)
    return model


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _tie(model) -> None:
    # to_empty() gives tied parameters two storages; tie them again or the embedding counts twice
    _base(model).tie_weights()


def _enable_checkpointing(policy, every_n_layers: int) -> None:
    """What :class:`~lit_rl.callbacks.ActivationCheckpointing` does (non-reentrant, no offload)."""
    base = _base(policy)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(base).__name__} does not support activation checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers, offload=False
        )
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if any(not p.requires_grad for p in base.parameters()):
        base.enable_input_require_grads()


class _PhasePeaks:
    """Per-phase peak of a tracker, with the MemoryProfiler's semantics (reset at start, max over repeats)."""

    def __init__(self, tracker: TensorMemoryTracker) -> None:
        self.tracker = tracker
        self.peaks: dict[str, int] = {}
        self.breakdown: dict[str, dict[str, int]] = {}
        self._stack: list[list[Any]] = []  # [name, peak so far, breakdown]

    def on_phase_start(self, name: str) -> None:
        if self._stack:  # nested: keep what the outer phase reached before the reset
            self._fold(self._stack[-1])
        self._stack.append([name, 0, {}])
        self.tracker.default_category = "temporaries" if name in _TEMPORARY_PHASES else "activations"
        self.tracker.reset_peak()

    def on_phase_end(self, name: str) -> None:
        frame = self._stack.pop()
        self._fold(frame)
        if frame[1] > self.peaks.get(frame[0], -1):
            self.peaks[frame[0]], self.breakdown[frame[0]] = frame[1], frame[2]
        if self._stack:
            outer = self._stack[-1]
            if frame[1] > outer[1]:
                outer[1], outer[2] = frame[1], frame[2]
            self.tracker.default_category = "temporaries" if outer[0] in _TEMPORARY_PHASES else "activations"

    def _fold(self, frame: list[Any]) -> None:
        if self.tracker.peak_bytes > frame[1]:
            frame[1], frame[2] = self.tracker.peak_bytes, self.tracker.peak_by_category()


class _Simulation:
    """One training step of the method on fake tensors, glued as ``RefCachedGRPO.training_step`` glues it."""

    def __init__(self, method, policy, reference, optimizer, plan: _Plan, full_decode: bool) -> None:
        self.method, self.policy, self.reference, self.optimizer = method, policy, reference, optimizer
        self.plan = plan
        self.full_decode = full_decode
        self.result = _Result()

    def run(self, reuse_rollout: Estimate | None) -> _Result:
        plan, method = self.plan, self.method
        self._warm_optimizer()
        b, p = plan.prompts, plan.prompt_length
        prompt_ids = torch.zeros(b, p, dtype=torch.long)  # the collated batch: allocated before any phase
        prompt_mask = torch.ones(b, p, dtype=torch.long)
        tracker = TensorMemoryTracker()
        listener = _PhasePeaks(tracker)
        method.phases.add_listener(listener)
        try:
            with self._precision(), tracker:
                tracker.track(method)
                if self.reference is not None:
                    tracker.track(self.reference)
                tracker.track(self.optimizer)
                if reuse_rollout is None:
                    rollout = self._rollout(prompt_ids, prompt_mask)
                else:
                    rollout = self._fake_rollout(prompt_mask)
                    listener.peaks["rollout"] = reuse_rollout.phases["rollout"]
                    listener.breakdown["rollout"] = reuse_rollout.breakdown["rollout"]
                    old = reuse_rollout._result
                    self.result.kv_cache_bytes, self.result.kv_cache_shape = old.kv_cache_bytes, old.kv_cache_shape
                    self.result.generation_logits_bytes = old.generation_logits_bytes
                self.result.rollout_bytes = sum(
                    t.untyped_storage().nbytes()
                    for t in (rollout.input_ids, rollout.attention_mask, rollout.completion_mask)
                )
                method.score_rollout(rollout)
                self.result.cache_bytes = {
                    name: getattr(rollout, name).untyped_storage().nbytes()
                    for name in ("ref_logp", "old_logp")
                    if getattr(rollout, name) is not None
                }
                self._update(rollout, tracker)
        finally:
            method.phases.remove_listener(listener)
            tracker.close()
        r = self.result
        r.phases = {name: listener.peaks[name] for name in PHASES if name in listener.peaks}
        r.breakdown = {name: listener.breakdown[name] for name in r.phases}
        state = r.state_bytes
        # the first step allocates the state in its first optimizer phase; with several iterations per rollout the
        # later iterations' update phases already hold it
        without = (
            ("rollout", "reference") if method.hparams.num_iterations > 1 else ("rollout", "reference", *PHASES[2:4])
        )
        r.first_step = {name: peak - (state if name in without else 0) for name, peak in r.phases.items()}
        return r

    # ----------------------------------------------------------------------------------------- pieces

    @contextlib.contextmanager
    def _precision(self) -> Iterator[None]:
        """Lightning's precision plugin around ``training_step``: default dtype (true half) or autocast (mixed)."""
        with contextlib.ExitStack() as stack:
            if self.plan.default_dtype is not None:
                previous = torch.get_default_dtype()
                torch.set_default_dtype(self.plan.default_dtype)
                stack.callback(torch.set_default_dtype, previous)
            if self.plan.autocast_dtype is not None:
                # as Lightning's MixedPrecision: no cast cache, so weights are re-cast by every op that uses them
                stack.enter_context(torch.autocast("cpu", dtype=self.plan.autocast_dtype, cache_enabled=False))
            yield

    def _warm_optimizer(self) -> None:
        """Create the optimizer state with one step on zero gradients: the steady state of step 2 onwards."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for param in params:
            param.grad = torch.zeros_like(param)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        tensors = [t for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        self.result.state_bytes = sum(t.untyped_storage().nbytes() for t in tensors)
        self.result.state_tensors = len(tensors)

    def _rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """Phase ``rollout``: generate's prefill and decode steps, then the tensors ``RefCachedGRPO.rollout`` keeps."""
        from transformers import DynamicCache

        plan, method, policy = self.plan, self.method, self.policy
        g = plan.generations
        with method.phases("rollout"), torch.no_grad():
            input_ids = prompt_ids.repeat_interleave(g, dim=0)  # [B, P]
            attention_mask = prompt_mask.repeat_interleave(g, dim=0)  # [B, P]
            policy.eval()
            # generate(): positions from the mask; an all-ones mask is dropped (no 4D mask is built then)
            position_ids = attention_mask.long().cumsum(-1) - 1  # [B, P]
            position_ids = position_ids.masked_fill(attention_mask == 0, 0)
            mask = attention_mask if plan.padded else None
            cache = DynamicCache(config=_base(policy).config)
            unfinished = torch.ones(plan.batch, dtype=torch.long)  # [B]
            eos = torch.tensor([0])
            sequences = input_ids
            step_ids, step_positions = input_ids, position_ids
            c = plan.new_tokens
            # decode steps differ only in the cache length, which only grows: unless asked for every step, run the
            # prefill, the first decode step and the last one, growing the cache in between
            steps = list(range(c)) if self.full_decode or c <= 3 else [0, 1, c - 1]
            for i, step in enumerate(steps):
                skipped = step - steps[i - 1] - 1 if i else 0
                if skipped:
                    b = sequences.shape[0]
                    for layer_idx, layer in enumerate(cache.layers):
                        shape = (b, layer.keys.shape[1], skipped, layer.keys.shape[3])
                        cache.update(layer.keys.new_zeros(shape), layer.values.new_zeros(shape), layer_idx)
                    grown = position_ids[:, -1:] + torch.arange(1, skipped + 1)  # [B, skipped]
                    position_ids = torch.cat([position_ids, grown], dim=-1)
                    if mask is not None:
                        mask = torch.cat([mask, mask.new_ones((b, skipped))], dim=-1)
                    sequences = torch.cat([sequences, sequences.new_zeros((b, skipped))], dim=-1)
                    step_ids, step_positions = sequences[:, -1:], position_ids[:, -1:]
                    del grown
                out = policy(
                    input_ids=step_ids.clone(),
                    attention_mask=mask,
                    position_ids=step_positions.clone(),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                    return_dict=True,
                )
                step_positions = position_ids[:, -1:] + 1  # [B, 1]
                position_ids = torch.cat([position_ids, step_positions], dim=-1)
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
                logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)  # [B, V]
                if step == 0:
                    self.result.generation_logits_bytes = 2 * logits.untyped_storage().nbytes()  # + probs
                probs = torch.softmax(logits, dim=-1)  # [B, V]
                next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)  # [B]
                next_tokens = next_tokens * unfinished + 0 * (1 - unfinished)
                sequences = torch.cat([sequences, next_tokens[:, None]], dim=-1)  # [B, P + t]
                unfinished = unfinished & ~torch.isin(sequences[:, -1], eos)
                step_ids = sequences[:, -1:]
                del out, logits, probs
            self.result.kv_cache_bytes, self.result.kv_cache_shape = _cache_size(cache)
            del cache
            policy.train()
            rollout = self._rollout_tensors(sequences, attention_mask)
        return rollout

    def _rollout_tensors(self, sequences: torch.Tensor, prompt_mask: torch.Tensor):
        from lit_rl.losses import group_advantages
        from lit_rl.methods.grpo import Rollout

        plan, hp = self.plan, self.method.hparams
        completion = sequences[:, plan.prompt_length :]  # [B, C]
        completion_mask = torch.ones(completion.shape, dtype=torch.float32)  # [B, C] full length, no EOS
        rewards = torch.zeros(plan.batch, dtype=torch.float32)  # [B]
        advantages = group_advantages(rewards, plan.generations, scale_rewards=hp.scale_rewards)  # [B]
        attention_mask = torch.cat([prompt_mask, torch.ones_like(completion)], dim=1)  # [B, P + C]
        return Rollout(
            input_ids=sequences,
            attention_mask=attention_mask,
            completion_mask=completion_mask,
            prompt_length=plan.prompt_length,
            rewards=rewards,
            advantages=advantages,
        )

    def _fake_rollout(self, prompt_mask: torch.Tensor):
        """The rollout tensors without generating (tactics that only change the update reuse a rollout peak)."""
        plan = self.plan
        sequences = torch.zeros(plan.batch, plan.prompt_length + plan.new_tokens, dtype=torch.long)
        return self._rollout_tensors(sequences, prompt_mask.repeat_interleave(plan.generations, dim=0))

    def _update(self, rollout, tracker: TensorMemoryTracker) -> None:
        """Micro-batched ``policy_loss`` + backward, then clipping and the optimizer step."""
        method, hp = self.method, self.method.hparams
        num_items = float(rollout.completion_mask.numel())  # dapo's token count: every completion full length
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for sl in method._micro_batches(len(rollout)):
            before = tracker.current_bytes
            with method.phases("policy_forward"):
                loss, _ = method.policy_loss(rollout, sl, num_items)
            saved = tracker.current_bytes - before
            if saved > self.result.saved_activations:
                self.result.saved_activations, self.result.saved_rows = saved, sl.stop - sl.start
            with method.phases("backward"):
                loss.backward()
        with method.phases("optimizer"):
            if hp.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, hp.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def _cache_size(cache) -> tuple[int, str]:
    layers = [layer for layer in getattr(cache, "layers", []) if getattr(layer, "keys", None) is not None]
    if not layers:
        return 0, ""
    total = sum(layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes() for layer in layers)
    k = layers[0].keys
    return total, f"{len(layers)} layers x 2 x {list(k.shape)} {_dtype_name(k.dtype)}"


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "int64"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


def _param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _components(result: _Result, method, policy, reference, config, plan: _Plan, settings) -> list[Component]:
    from lit_rl.models import lm_head
    from lit_rl.ops.token_math import _LOGITS_BUDGET_BYTES, _plan_chunks

    hp = method.hparams
    params = list(policy.parameters())
    trainable = [p for p in params if p.requires_grad]
    dtype = _dtype_name(params[0].dtype)
    n_total, n_train = sum(p.numel() for p in params), sum(p.numel() for p in trainable)
    train_dtype = _dtype_name(trainable[0].dtype) if trainable else dtype
    rows: list[Component] = [
        Component("parameters (policy)", f"{n_total:,} x {dtype}", _param_bytes(params),
                  "tied input/output embedding counted once" if getattr(config, "tie_word_embeddings", False) else ""),
    ]  # fmt: skip
    if reference is not None:
        rows.append(Component("reference weights", "frozen copy of the policy", _param_bytes(reference.parameters())))
    elif hp.beta > 0:
        rows.append(Component("reference weights", "shared: LoRA adapters disabled", 0, "no second copy"))
    else:
        rows.append(Component("reference weights", "none (beta = 0)", 0))
    rows.append(Component("gradients", f"{n_train:,} trainable x {train_dtype}", _param_bytes(trainable)))
    state_note = f"{result.state_tensors} tensors"
    rows.append(
        Component(
            "optimizer state (AdamW)",
            f"2 x {n_train:,} x {train_dtype} + {len(trainable)} step counters",
            result.state_bytes,
            state_note,
        )
    )
    b, c = plan.batch, plan.new_tokens
    seq = plan.prompt_length + c
    rows.append(Component("KV cache (end of rollout)", result.kv_cache_shape, result.kv_cache_bytes))
    v = config.vocab_size if not hasattr(lm_head(policy), "weight") else lm_head(policy).weight.shape[0]
    rows.append(
        Component(
            "generation logits + probs", f"2 x [{b}, {v}] fp32", result.generation_logits_bytes, "per decode step"
        )
    )
    rows.append(
        Component(
            "rollout tensors", f"ids + mask [{b}, {seq}] int64, completion mask [{b}, {c}] fp32", result.rollout_bytes
        )
    )
    for name, nbytes in result.cache_bytes.items():
        label = "reference log-probs cache" if name == "ref_logp" else "old log-probs cache"
        rows.append(Component(label, f"[{b}, {c}] fp32", nbytes, "instead of [B, T, V] logits"))
    mb = settings["micro_batch_size"]
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    act_note = f"{format_bytes(result.saved_activations / max(layers, 1))} per layer" if layers else ""
    if settings["activation_checkpointing"]:
        act_note += ", checkpointed"
    rows.append(
        Component(
            "saved activations (policy forward)",
            f"[{result.saved_rows}, {seq}] tokens x {layers} layers",
            result.saved_activations,
            act_note,
        )
    )
    tokens = mb * c
    tc, vc = _plan_chunks(tokens, v, hidden, hp.chunk_size, None, _LOGITS_BUDGET_BYTES)
    rows.append(Component("logits chunk (token math)", f"[{tc}, {vc}] fp32", tc * vc * 4, "about two live at a time"))
    rows.append(
        Component(
            "full logits (never allocated)",
            f"[{mb}, {c}, {v}] fp32",
            mb * c * v * 4,
            "what a logits-based loss would hold per micro-batch",
        )
    )
    if plan.padded:
        rows.append(
            Component("attention mask (padded prompts)", f"[{mb}, 1, {seq}, {seq}] bool", mb * seq * seq, "per forward")
        )
    return rows


# ------------------------------------------------------------------------------------------------ command line


def _settings_from(datamodule, *, precision: str, callbacks, device_type: str) -> dict[str, Any]:
    from lit_rl.callbacks.activation_checkpointing import ActivationCheckpointing

    hparams = getattr(datamodule, "hparams", {}) if datamodule is not None else {}
    batch_size = hparams.get("batch_size", getattr(datamodule, "batch_size", None))
    prompt_length = hparams.get("max_prompt_length", getattr(datamodule, "max_prompt_length", None))
    checkpointing = next((c for c in callbacks or [] if isinstance(c, ActivationCheckpointing)), None)
    settings: dict[str, Any] = dict(
        precision=_precision_name(precision),
        activation_checkpointing=checkpointing.every_n_layers if checkpointing is not None else 0,
        device_type=device_type,
    )
    if batch_size is not None:
        settings["batch_size"] = int(batch_size)
    if prompt_length is not None:
        settings["prompt_length"] = int(prompt_length)
    return settings


def _precision_name(precision: Any) -> str:
    text = str(precision)
    return {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}.get(text, text)


def _option_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lit-rl estimate",
        add_help=False,
        description="Predict the per-phase peak memory (tensor bytes) of one training step without loading weights. "
        "Every other option is the fit command's (--config, --model.init_args.*, --data.init_args.*, --trainer.*).",
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    parser.add_argument(
        "--model-config",
        help="the policy's config instead of name_or_path's: a config.json (or its folder), or shape:NAME with NAME "
        f"one of {', '.join(BUILTIN_SHAPES)} (no network)",
    )
    parser.add_argument("--prompt-length", type=int, help="prompt tokens (default: data.max_prompt_length)")
    parser.add_argument("--batch-size", type=int, help="prompts per step (default: data.batch_size)")
    parser.add_argument(
        "--device-memory", help="memory of the target device, e.g. 80GiB or 24GB: says whether the step fits"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="which kernels to mirror (AdamW per tensor on cpu, foreach on cuda); default: from trainer.accelerator",
    )
    parser.add_argument(
        "--padded",
        choices=("auto", "yes", "no"),
        default="auto",
        help="whether prompts are left-padded, so the [B, 1, q, kv] attention mask is built (auto: batch size > 1)",
    )
    parser.add_argument("--no-tactics", action="store_true", help="with --device-memory: do not estimate tactics")
    return parser


def _parse_config(args: list[str]):
    """The method, the datamodule and the trainer settings of a fit config, without building the Trainer."""
    from lit_rl.cli import LitRLCLI

    class _NoTrainerCLI(LitRLCLI):
        def instantiate_trainer(self, **kwargs: Any):  # noqa: D102 — the estimate needs no Trainer (or a GPU)
            return None

    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when it is given args and sys.argv has some too
    try:
        cli = _NoTrainerCLI(args=args, run=False, save_config_callback=None)
    finally:
        sys.argv = argv
    trainer_config = cli.config_init.get("trainer", {}) or {}
    return cli.model, cli.datamodule, trainer_config


def estimate_from_args(args: list[str]) -> tuple[Estimate, dict[str, Any], Any]:
    """Parse ``lit-rl estimate`` arguments and estimate; returns ``(estimate, settings, module)``."""
    options, rest = _option_parser().parse_known_args(args)
    module, datamodule, trainer_config = _parse_config(rest)
    accelerator = str(trainer_config.get("accelerator", "auto"))
    device_type = options.device or ("cuda" if accelerator in ("gpu", "cuda") else "cpu")
    settings = _settings_from(
        datamodule,
        precision=str(trainer_config.get("precision", "32-true") or "32-true"),
        callbacks=trainer_config.get("callbacks"),
        device_type=device_type,
    )
    if options.prompt_length is not None:
        settings["prompt_length"] = options.prompt_length
    if options.batch_size is not None:
        settings["batch_size"] = options.batch_size
    if "batch_size" not in settings or "prompt_length" not in settings:
        raise SystemExit(
            "lit-rl estimate: the data module has no batch_size / max_prompt_length; pass --batch-size and --prompt-length"
        )
    if options.model_config is not None:
        settings["model_config"] = options.model_config
    if options.padded != "auto":
        settings["padded"] = options.padded == "yes"
    return estimate_step(module, **settings), settings, module


def fit_report(
    module, estimate: Estimate, device_bytes: int, settings: dict[str, Any], tactics: bool = True
) -> tuple[bool, str]:
    """Whether the step fits in ``device_bytes`` and, if not, which tactics help and by how much (text)."""
    peak = estimate.peak_bytes
    fits = peak <= device_bytes
    lines = [
        f"device memory {format_bytes(device_bytes)}: predicted step peak {format_bytes(peak)} "
        f"({estimate.peak_phase}) {'fits' if fits else 'does NOT fit'}"
        + (f", {format_bytes(device_bytes - peak)} to spare" if fits else f", {format_bytes(peak - device_bytes)} over")
    ]
    if fits and peak > 0.9 * device_bytes:
        lines.append("  tight: the CUDA context, workspaces and allocator fragmentation are not in the estimate")
    if fits or not tactics:
        return fits, "\n".join(lines)
    results = _tactic_estimates(module, estimate, settings)
    if not results:
        lines.append("  every tactic the estimator knows is already on; use a smaller batch or shorter sequences")
        return fits, "\n".join(lines)
    lines.append("tactics (each alone, re-estimated):")
    order = sorted(results, key=lambda n: -results[n][0])
    for name in order:
        saved, other = results[name]
        how = TACTIC_HOW[name].format(value=other.settings["micro_batch_size"])
        if saved <= 0:
            lines.append(f"  - {name}: no saving, the peak stays in {other.peak_phase} ({how})")
            continue
        verdict = "fits" if other.peak_bytes <= device_bytes else "still over"
        lines.append(
            f"  - {name}: saves {format_bytes(saved)} -> peak {format_bytes(other.peak_bytes)} "
            f"({other.peak_phase}), {verdict}; add {how}"
        )
    if any(other.peak_bytes <= device_bytes for _, other in results.values()):
        return fits, "\n".join(lines)
    # no tactic is enough alone: add them up, largest saving first, until the step fits
    combined: dict[str, Any] = dict(settings)
    applied: list[str] = []
    for name in (n for n in order if results[n][0] > 0):
        combined.update(_tactics(estimate)[name])
        applied.append(name)
        if len(applied) < 2:
            continue
        together = estimate_step(module, **combined)
        verdict = "fits" if together.peak_bytes <= device_bytes else "still over"
        lines.append(f"  - together, {' + '.join(applied)}: peak {format_bytes(together.peak_bytes)}, {verdict}")
        if together.peak_bytes <= device_bytes:
            break
    return fits, "\n".join(lines)


def main(args: list[str] | None = None) -> None:
    """``lit-rl estimate``: print the component table, the per-phase peaks and, with ``--device-memory``, the fit."""
    args = list(sys.argv[1:] if args is None else args)
    options, _ = _option_parser().parse_known_args(args)
    if options.help:
        _option_parser().print_help()
        return
    device_bytes = parse_bytes(options.device_memory) if options.device_memory else None
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices from peft/transformers internals
    try:
        estimate, settings, module = estimate_from_args(args)
    except (ValueError, NotImplementedError) as err:  # bad settings: the message names the fix
        raise SystemExit(f"lit-rl estimate: {err}") from err
    print(estimate.table())
    print(f"\n(estimated in {estimate.seconds:.1f} s on fake tensors; no weights were loaded)")
    if device_bytes is not None:
        _, report = fit_report(module, estimate, device_bytes, settings, tactics=not options.no_tactics)
        print("\n" + report)


__all__ = [
    "BUILTIN_SHAPES",
    "Component",
    "Estimate",
    "estimate_for_trainer",
    "trainer_settings",
    "estimate_from_args",
    "estimate_savings",
    "estimate_step",
    "fit_report",
    "format_bytes",
    "main",
    "model_config_for",
    "parse_bytes",
]
