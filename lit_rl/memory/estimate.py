"""Predict the peak memory of one training step, per phase, before a single weight is loaded.

``lit-rl estimate --config configs/grpo.yaml [--model.init_args.* ...] [--device-memory 80GiB]``

How: the method's own ``configure_model`` runs inside :func:`lit_rl.models.build_on_meta`, so every model
it loads (policy, reference copy, reward model) is built from its *config* on the meta device (no
weights are read), with LoRA if configured; then the whole method is materialised on a **fake** CPU
device (``FakeTensorMode``: tensors that have shapes, dtypes and devices but no storage) and the
method's own ``training_step`` runs on a fake prompt batch, without a Trainer, under
:class:`~lit_rl.memory.tracker.TensorMemoryTracker`, the exact tensor accounting that
:class:`~lit_rl.callbacks.MemoryProfiler` uses on CPU. The phases are the ones the method announces.
Predicted and measured are therefore the same quantity, *bytes held by tensors*
(``memory/<phase>/predicted_gib`` beside ``memory/<phase>/peak_gib``); ``bench/results/estimate.md`` records how
long a Qwen2.5-3B-shaped step takes to predict. A new method gets an estimate by implementing its step:
nothing here names a method, a hyper-parameter or a phase other than ``backward`` and ``optimizer``, which every
method's update announces; the batch and lengths it reports come from the method's ``rollout_shape()``
(:mod:`lit_rl.memory.rollout`). What fake tensors cannot do (value reads, ``generate``'s stopping checks, text)
is substituted in :mod:`lit_rl.memory.fake`; every completion runs to ``max_new_tokens``.

The prediction is for the **steady state** (second step on), when the optimizer state already exists;
:attr:`Estimate.first_step` is the first step, whose phases before the first ``optimizer.step()`` have no
state yet.

Not included, because they are not tensor bytes (add headroom for them on a GPU): the CUDA context
(its size depends on the GPU, the driver and the CUDA version), cuBLAS/cuDNN workspaces, the caching
allocator's rounding and fragmentation (the profiler's ``reserved_gib``), NCCL buffers, the Python heap.

Where a prediction can differ from a measurement:

- Lengths: ``lit-rl estimate`` pads every prompt to ``data.max_prompt_length`` (or ``--prompt-length``) and
  runs every completion to ``max_new_tokens``, so it is an **upper bound** for the run's steps; a real batch is
  padded to its longest prompt and generation stops when all completions have ended. The MemoryProfiler
  predicts each measured step at its own shapes (:mod:`lit_rl.memory.step_prediction`), which is what its
  ``predicted_gib`` beside ``peak_gib`` compares.
- Attention mask: transformers cannot read a fake mask, so on its own it would always build the
  ``[B, 1, q, kv]`` boolean mask that a real unpadded batch skips. The estimator decides as a real run
  does: a batch of several prompts is left-padded (mask built), a single prompt repeated
  ``num_generations`` times is not (``padded``).
- Kernels are the CPU ones. SDPA's CPU flash kernel saves the output and the log-sum-exp, like CUDA's
  flash and memory-efficient kernels, so attention activations match. The methods' AdamW is fused on CPU and
  CUDA alike (bf16 weights: float32 slices, their scratch counted); one that is not fused updates one tensor at a
  time on CPU but uses ``foreach`` on CUDA, which holds temporaries the size of all trainable weights:
  ``device_type="cuda"`` switches such an optimizer to ``foreach``. Mixed precision uses the CPU autocast op lists.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_rl.memory.components import component_table
from lit_rl.memory.fake import (
    PRECISIONS,
    GenerateRecord,
    StandInTokenizer,
    dtype_name,
    fake_generate,
    fake_mode,
    patches,
)
from lit_rl.memory.fake import (
    precision as precision_context,
)
from lit_rl.memory.peaks import PhasePeaks, category_for
from lit_rl.memory.phases import BACKWARD, SCRATCH_PHASES
from lit_rl.memory.report import Component, Estimate
from lit_rl.memory.rollout import rollout_shape
from lit_rl.memory.shapes import BUILTIN_SHAPES, config_resolver, model_config_for
from lit_rl.memory.sharded import fake_processes, offloaded_gathers, reshard_before_steps, sharding_settings
from lit_rl.memory.tracker import TensorMemoryTracker
from lit_rl.memory.units import GIB, MIB, format_bytes, parse_bytes
from lit_rl.models import base_model, build_on_meta, checkpointing_refused, enable_activation_checkpointing
from lit_rl.models.offload import OffloadSavedTensors
from lit_rl.models.sharding import shard_models
from lit_rl.models.shared_prompt import group_runs

# ------------------------------------------------------------------------------------------------ estimate


def estimate_step(
    module,
    *,
    batch_size: int,
    prompt_length: int,
    model_config: Any = None,
    reward_model_config: Any = None,
    precision: str = "32-true",
    activation_checkpointing: int = 0,
    padded: bool | None = None,
    device_type: str = "cpu",
    full_decode: bool = False,
    offload_activations: int | None = None,
    shard_processes: int = 1,
    rollout_gather: str | None = None,
    shard_offload: bool = False,
    **overrides: Any,
) -> Estimate:
    """Predict the per-phase peak memory of one training step of ``module``, without loading weights.

    ``module`` itself is never changed: a copy is built from its hyper-parameters (with ``overrides``),
    so this is safe to call on the module being trained.

    Args:
        module: an :class:`~lit_rl.methods.RLMethod` (anything with ``phases``, ``configure_model``,
            ``configure_optimizers``, ``attach_optimizer``, ``update``, ``training_step``, ``rollout_shape``,
            ``micro_batches`` and ``uses_lora``).
        batch_size: prompts per step (``data.batch_size``).
        prompt_length: prompt tokens (``data.max_prompt_length`` for the worst case).
        model_config: the policy's config instead of the one ``name_or_path`` names: see
            :func:`~lit_rl.memory.shapes.model_config_for`.
        reward_model_config: the same for a reward model, if the method loads one.
        precision: ``trainer.precision`` (``32-true``, ``bf16-true``, ``bf16-mixed``, ``16-true``, ``16-mixed``).
        activation_checkpointing: 0 for off, else checkpoint every n-th decoder layer of the policy (the
            :class:`~lit_rl.callbacks.ActivationCheckpointing` callback's ``every_n_layers``).
        padded: whether prompts are left-padded (the attention mask is built); ``None``: when ``batch_size > 1``.
        device_type: ``cpu`` or ``cuda``: which AdamW implementation to mirror when it is not fused (per tensor /
            ``foreach``).
        full_decode: run every decode step of ``generate`` (see :mod:`lit_rl.memory.fake`).
        offload_activations: the update's saved activations of at least this many bytes leave the device
            (:class:`~lit_rl.callbacks.ActivationOffloading`'s ``min_bytes``): only what stays is counted; ``None``: off.
        shard_processes: above 1, the models are sharded over that many processes (FSDP2) and the estimate is one
            process's (:mod:`lit_rl.memory.sharded`).
        rollout_gather: the strategy's ``rollout_gather`` under FSDP2 (``auto`` is predicted as ``whole``); given, the
            models are sharded even over one process (FSDP2Strategy on one device); ``None`` with
            ``shard_processes`` above 1 is ``auto``.
        shard_offload: FSDP2's ``cpu_offload``: the sharded weights, their gradients and the optimizer state live in
            host memory, and the peaks are the device's (what is gathered, activations, temporaries).
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
    method = copy_method(module, overrides)
    hp = method.hparams
    configs = config_resolver(
        policy_config=model_config,
        reward_config=reward_model_config,
        gguf_file=hp.get("gguf_file"),
        trust_remote_code=hp.get("trust_remote_code", False),
    )
    config = configs("policy", method.name_or_path)
    cast_dtype, autocast_dtype = PRECISIONS[precision]
    padded = batch_size > 1 if padded is None else padded
    method.tokenizer = StandInTokenizer(config)
    with build_on_meta(configs), _quiet_info():  # every model the method loads is built on the meta device
        method.configure_model()
    if cast_dtype is not None:  # Lightning's true-half precision converts the whole module after configure_model
        method.to(cast_dtype)
    record = GenerateRecord()
    sharded = shard_processes > 1 or rollout_gather is not None
    if shard_offload and not sharded:
        raise ValueError("shard_offload: the estimate offloads sharded weights; give rollout_gather (FSDP2)")
    rollout_gather = (rollout_gather or "auto") if sharded else None
    processes = fake_processes(shard_processes) if sharded else contextlib.nullcontext()
    # the mesh of real tensors, made before fake mode
    with processes as mesh, fake_mode(), patches(padded, device_type), offloaded_gathers(shard_offload):
        method.to_empty(device="cpu")
        _tie_all(method)
        roots = shard_models(method, mesh, rollout_gather=rollout_gather)[0] if mesh is not None else []
        method.train()
        if activation_checkpointing:
            refused = checkpointing_refused(method)  # as the ActivationCheckpointing callback refuses
            if refused:
                raise ValueError(f"activation checkpointing: {type(method).__name__} {refused}")
            enable_activation_checkpointing(method.policy, activation_checkpointing)
        optimizer = _the_optimizer(method.configure_optimizers())
        if autocast_dtype is not None:  # a real run under mixed precision gets no fused AdamW (no trainer here)
            for group in optimizer.param_groups:
                group["fused"] = False
        if device_type == "cuda":  # what torch picks for CUDA tensors when the optimizer is not fused
            for group in optimizer.param_groups:
                group["foreach"] = not group.get("fused")
        reshard_before_steps(optimizer, roots)
        method.attach_optimizer(optimizer)
        if offload_activations is not None:  # the run's hooks, holding no copy: what leaves the device is not counted
            hooks = OffloadSavedTensors(method.policy, "meta", min_bytes=offload_activations)
            method.update_forward = lambda: hooks
        method.policy.generate = fake_generate(
            method.policy, record, padded=padded, full_decode=full_decode, own_decode=method.own_decode
        )
        host = ("parameters", "gradients", "optimizer_state") if shard_offload else ()
        run = _run_step(method, optimizer, batch_size, prompt_length, cast_dtype, autocast_dtype, host)
    shape = rollout_shape(method)  # what the method says it generates, whatever its options are called
    generations = shape.completions_per_prompt
    batch = batch_size * generations
    settings = dict(
        method=type(method).__name__,
        model=str(model_config) if isinstance(model_config, str) else method.name_or_path,
        architecture=type(base_model(method.policy)).__name__,
        precision=precision,
        lora=method.uses_lora,
        device_type=device_type,
        prompts=batch_size,
        num_generations=generations,
        batch=batch,
        prompt_length=prompt_length,
        max_new_tokens=shape.max_new_tokens,
        sequence_length=prompt_length + shape.max_new_tokens,
        # the first micro-batch is the largest; with a token budget, every row at its longest
        micro_batch_size=method.micro_batches(batch, [prompt_length + shape.max_new_tokens] * batch)[0].stop,
        activation_checkpointing=activation_checkpointing,
        offload_activations=offload_activations,
        shard_processes=shard_processes,
        rollout_gather=rollout_gather,
        shard_offload=shard_offload,
        optimizer=run.optimizer_name,
        padded=padded,
        config=config,
        hparams=dict(hp),
    )
    return Estimate(
        phases=run.phases,
        first_step=run.first_step,
        breakdown=run.breakdown,
        components=component_table(method, run, record, config, settings),
        settings=settings,
        seconds=time.perf_counter() - start,
    )


def settings_from(datamodule, *, precision: str, callbacks, device_type: str) -> dict[str, Any]:
    """The keyword arguments of :func:`estimate_step` that a run's datamodule, precision and callbacks fix.

    A callback that changes what the step holds says how through ``estimate_settings() -> dict`` (e.g.
    :class:`~lit_rl.callbacks.ActivationCheckpointing` returns ``{"activation_checkpointing": n}``).
    """
    hparams = getattr(datamodule, "hparams", {}) if datamodule is not None else {}
    batch_size = hparams.get("batch_size", getattr(datamodule, "batch_size", None))
    prompt_length = hparams.get("max_prompt_length", getattr(datamodule, "max_prompt_length", None))
    settings: dict[str, Any] = dict(
        precision={"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}.get(str(precision), str(precision)),
        activation_checkpointing=0,
        device_type=device_type,
    )
    for callback in callbacks or []:
        hook = getattr(callback, "estimate_settings", None)
        if callable(hook):
            settings.update(hook())
    if batch_size is not None:
        settings["batch_size"] = int(batch_size)
    if prompt_length is not None:
        settings["prompt_length"] = int(prompt_length)
    return settings


def trainer_settings(trainer, **known: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`estimate_step` that a Trainer knows: the datamodule's ``batch_size`` and
    ``max_prompt_length``, ``trainer.precision``, the callbacks' ``estimate_settings()`` and the device type;
    ``known`` settings take precedence.

    Raises:
        ValueError: when neither the datamodule nor ``known`` give ``batch_size`` and ``prompt_length``.
    """
    settings = settings_from(
        getattr(trainer, "datamodule", None),
        precision=str(trainer.precision),
        callbacks=trainer.callbacks,
        device_type="cuda" if trainer.strategy.root_device.type == "cuda" else "cpu",
    )
    run = {"strategy": trainer.strategy, "devices": trainer.num_devices, "num_nodes": trainer.num_nodes}
    settings.update(sharding_settings(run))  # FSDP2Strategy: one process of a sharded run
    settings.update(known)
    if "batch_size" not in settings or "prompt_length" not in settings:
        raise ValueError(
            "estimate: the trainer has no datamodule with batch_size and max_prompt_length; "
            "call estimate_step(module, batch_size=..., prompt_length=...) instead"
        )
    return settings


def estimate_for_trainer(trainer, pl_module, **kwargs: Any) -> Estimate:
    """:func:`estimate_step` with :func:`trainer_settings` (``kwargs`` override them).

    Without ``kwargs`` this is the padded upper bound of the run's steps (``data.max_prompt_length``,
    ``max_new_tokens``); the MemoryProfiler passes each measured step's own shapes instead
    (:mod:`lit_rl.memory.step_prediction`). A fixed prediction can be logged beside every step with::

        pl_module.predicted_memory = estimate_for_trainer(trainer, pl_module).phases
    """
    return estimate_step(pl_module, **trainer_settings(trainer, **kwargs))


# ------------------------------------------------------------------------------------------------ internals


def copy_method(module, overrides: dict[str, Any]):
    """A fresh instance of ``module``'s class from its hyper-parameters: the estimate never touches the original."""
    accepted: set[str] = set()
    for cls in type(module).__mro__:  # options forwarded with **kwargs are accepted by a parent's __init__
        if "__init__" in vars(cls):
            params = inspect.signature(vars(cls)["__init__"]).parameters.values()
            accepted |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    # hparams may carry extras (jsonargparse's _class_path) that no constructor takes
    hparams = {k: v for k, v in dict(module.hparams).items() if k in accepted}
    hparams.update(overrides)  # settings stored as dicts (a checkpoint's LoraSettings) the constructors convert
    try:
        return type(module)(**hparams)
    except TypeError as err:
        raise TypeError(f"estimate: cannot rebuild {type(module).__name__} from its hparams ({err})") from err


@contextlib.contextmanager
def _quiet_info():
    """Lightning's info lines off: the method's "policy <name_or_path>: N parameters" names the config's model, not
    the shape estimated, and the planner builds the method once per candidate. Warnings still show."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _tie_all(method) -> None:
    # to_empty() gives tied parameters two storages; tie them again or the embedding counts twice
    from transformers import PreTrainedModel

    for module in method.modules():
        if isinstance(module, PreTrainedModel):
            module.tie_weights()


def _the_optimizer(configured):
    if isinstance(configured, (list, tuple)):
        configured = configured[0]
    if isinstance(configured, dict):  # {"optimizer": ..., "lr_scheduler": ...}
        configured = configured["optimizer"]
    return configured


@dataclass
class _Run:
    phases: dict[str, int] = field(default_factory=dict)
    first_step: dict[str, int] = field(default_factory=dict)
    breakdown: dict[str, dict[str, int]] = field(default_factory=dict)
    state_bytes: int = 0
    state_tensors: int = 0
    state_numel: dict[str, int] = field(default_factory=dict)  # {dtype name: values}: what the state is made of
    optimizer_name: str = ""
    saved_activations: int = 0
    saved_phase: str = ""


class _Listener:
    """Per-phase peaks of the tracker, whether the optimizer had stepped, and what the forward phases of each
    micro-batch keep for its backward (the saved activations)."""

    def __init__(self, tracker: TensorMemoryTracker) -> None:
        self.tracker = tracker
        self.peaks = PhasePeaks(
            read=lambda: {"peak_bytes": tracker.peak_bytes, "breakdown": tracker.peak_by_category()},
            reset=tracker.reset_peak,
        )
        self.stepped = False
        self.occurrences: list[tuple[str, int, bool]] = []  # (phase, peak, after the first optimizer step)
        self.saved, self.saved_phases = 0, ""
        self._starts: list[int] = []
        self._kept: list[tuple[str, int]] = []  # forward phases since the update or the last backward began

    def update_started(self) -> None:
        self._kept = []

    def on_phase_start(self, name: str) -> None:
        if name == BACKWARD:  # what the micro-batch's forward phases kept is what its backward consumes
            total = sum(kept for _, kept in self._kept)
            if total > self.saved:
                self.saved, self.saved_phases = total, " + ".join(dict.fromkeys(n for n, _ in self._kept))
            self._kept = []
        self.peaks.start(name)
        self.tracker.default_category = category_for(name)
        self._starts.append(self.tracker.current_bytes)

    def on_phase_end(self, name: str) -> None:
        peaks = self.peaks.end()
        kept = self.tracker.current_bytes - self._starts.pop()
        if name not in SCRATCH_PHASES:
            self._kept.append((name, kept))
        self.occurrences.append((name, peaks.get("peak_bytes", 0), self.stepped))
        self.tracker.default_category = category_for(self.peaks.current)


SKIP_REPEATS = True  # False: every micro-batch runs (the tests compare the two)


def without_repeats(slices: list[slice], group: int) -> list[slice]:
    """The micro-batches of a step whose memory can differ from one already run. On the estimator's uniform batch
    (every prompt equally long, every completion at ``max_new_tokens``) a micro-batch's work depends only on how its
    rows fall into prompts' groups of ``group`` completions. In the update the first of each kind allocates the
    gradients and the second adds into them, as every later one does; a pass without gradient writes each
    micro-batch's result into its rows of one output. From the third on they repeat the second byte for byte and
    are left out: a step of 64 completions in micro-batches of 8 (or of 1) runs 2 of its 8 (or 64). The contract
    this rests on (a loop over ``micro_batches`` keeps nothing per micro-batch but its rows of a preallocated
    output) is in docs/adding-a-method.md.
    """
    seen: dict[tuple[int, ...], int] = {}
    kept = []
    for sl in slices:  # a micro-batch's kind: the lengths of its runs of rows that share a prompt
        kind = tuple(group_runs(sl.start, sl.stop, group))
        seen[kind] = seen.get(kind, 0) + 1
        if seen[kind] <= 2:
            kept.append(sl)
    return kept


def _run_step(
    method,
    optimizer,
    batch_size: int,
    prompt_length: int,
    cast_dtype: torch.dtype | None,
    autocast: torch.dtype | None,
    host: tuple[str, ...] = (),
) -> _Run:
    """The method's own training step on a fake prompt batch, with the optimizer state already there; the tracker's
    categories in ``host`` live in host memory and are not counted."""
    run = _Run()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param in params:  # the steady state of step 2 onwards: one step on zero gradients creates the state
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in state]  # sharded (FSDP2): this process's share
    run.state_bytes = sum(t.untyped_storage().nbytes() for t in local)
    run.state_tensors = len(state)
    for t in state:
        run.state_numel[dtype_name(t.dtype)] = run.state_numel.get(dtype_name(t.dtype), 0) + t.numel()
    run.optimizer_name = type(optimizer).__name__
    batch = {  # the collated batch exists before the step's first phase, as in a real run
        "input_ids": torch.zeros(batch_size, prompt_length, dtype=torch.long),
        "attention_mask": torch.ones(batch_size, prompt_length, dtype=torch.long),
        "prompts": [""] * batch_size,
        "answers": [""] * batch_size,
        "index": list(range(batch_size)),
    }
    tracker = TensorMemoryTracker(uncounted=host)
    listener = _Listener(tracker)
    hook = optimizer.register_step_post_hook(lambda *_: setattr(listener, "stepped", True))
    method.phases.add_listener(listener)
    update = method.update

    def watched_update(*args, **kwargs):  # every method's optimizer step goes through update()
        listener.update_started()
        return update(*args, **kwargs)

    method.update = watched_update
    if SKIP_REPEATS:
        group, slicer = rollout_shape(method).completions_per_prompt, method.micro_batches
        method.micro_batches = lambda n, lengths=None: without_repeats(slicer(n, lengths), group)
    try:
        with precision_context(cast_dtype, autocast), tracker:
            tracker.track(method)
            tracker.track(optimizer)
            method.training_step(batch, 0)
    finally:
        method.__dict__.pop("micro_batches", None)
        method.__dict__.pop("update", None)
        method.phases.remove_listener(listener)
        hook.remove()
        tracker.close()
    peaks = listener.peaks.phases
    run.phases = {name: peaks[name]["peak_bytes"] for name in method.phases.names if name in peaks}
    run.breakdown = {name: peaks[name].get("breakdown", {}) for name in run.phases}
    for name, peak, after_step in listener.occurrences:  # the first step has no state until its first step()
        first = peak if after_step else peak - run.state_bytes
        run.first_step[name] = max(run.first_step.get(name, first), first)
    run.first_step = {name: run.first_step[name] for name in run.phases}
    run.saved_activations, run.saved_phase = listener.saved, listener.saved_phases
    return run


__all__ = [
    "BUILTIN_SHAPES",
    "GIB",
    "MIB",
    "Component",
    "Estimate",
    "copy_method",
    "estimate_for_trainer",
    "estimate_step",
    "format_bytes",
    "model_config_for",
    "parse_bytes",
    "settings_from",
    "trainer_settings",
]
