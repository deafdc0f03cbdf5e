"""The optimizer a method trains with, from the run's ``--optimizer`` (a class path and its options).

Every method steps one optimizer over the policy's trainable parameters. Without ``--optimizer`` it is
:class:`StochasticAdamW` (torch's fused AdamW, with stochastic rounding for bf16 weights); with it, any
``torch.optim.Optimizer`` subclass, chosen as in any LightningCLI program::

    lit-rl fit --config configs/grpo.yaml --optimizer bitsandbytes.optim.AdamW8bit
    # or in YAML:  optimizer: {class_path: bitsandbytes.optim.AdamW8bit, init_args: {betas: [0.9, 0.95]}}

The learning rate and weight decay stay the method's (``model.init_args.learning_rate`` / ``weight_decay``), so a
swapped optimizer never falls back to its class's default learning rate; the CLI does not offer ``optimizer.lr``.

What the state costs per trained weight (``lit-rl estimate`` runs the optimizer's own first step on fake tensors,
so it charges each optimizer's real state bytes; ``bench/bench_optimizer.py`` measures them with step time and the
update's drift from fp32 AdamW, ``bench/results/optimizer.md``): AdamW keeps two fp32 moments (8 bytes);
bitsandbytes' ``AdamW8bit`` two 8-bit moments with one fp32 scale per 256 values (tensors under
``min_8bit_size`` = 4096 values keep fp32 moments), blockwise dynamic quantization (Dettmers et al., "8-bit
Optimizers via Block-wise Quantization", arXiv 2110.02861).

On a CPU, bitsandbytes (0.50) steps a tensor inside one operator that holds five or six float32 copies of it (both
moments dequantized, the gradient, the weight, the denominator); tensor accounting cannot see inside an operator,
so neither ``lit-rl estimate`` nor the profiler's tensor peak would have that scratch. :func:`build_optimizer`
therefore steps bitsandbytes' 8-bit optimizers on a CPU in slices of :data:`SLICE_VALUES` values, whole 256-value
blocks each: every block is quantized on its own, so the result is bitwise the unsliced step's, and the scratch is
at most six float32 copies of one slice (24 MiB) whatever the tensor. CUDA's step is one fused kernel, left as is.

bf16 weights (``trainer.precision: bf16-true``) rounded to nearest lose every update smaller than half the bf16
spacing of the weight they change: at a full fine-tuning learning rate of 1e-5 almost every weight
(``docs/memory.md``, bf16 on the CPU). For them, on any device, the default :class:`StochasticAdamW` and the sliced
8-bit step update a float32 copy of each slice and write it back with stochastic rounding
(:func:`stochastic_round_bf16`: up or down with probabilities that make the expected weight the float32 one), which
keeps bf16 training close to float32 (Zamirai et al., "Revisiting BFloat16 Training", arXiv 2010.06192; torchao's
8-bit AdamW offers the same as ``bf16_stochastic_round``). The random bits (:func:`random_bits`) are keyed by the step,
the tensor's place and the slice, so a run and its resume draw the same ones.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Iterable
from typing import Any

import torch

#: the method options that the optimizer's own arguments of the same meaning take their values from
METHOD_OPTIONS = {"lr": "learning_rate", "weight_decay": "weight_decay"}
#: values per slice of a sliced bitsandbytes 8-bit step (CPU tensors, bf16 weights): whole 256-value blocks
SLICE_VALUES = 1 << 20
#: values per bitsandbytes quantization block of 8-bit optimizer state
_BLOCK = 256
#: the float32 bits that bf16 keeps
_HIGH_HALF = -(1 << 16)


def optimizer_class(class_path: str) -> type[torch.optim.Optimizer]:
    """The class ``class_path`` names, which must be a ``torch.optim.Optimizer`` subclass.

    Raises:
        ValueError: one line naming the option, what is wrong and the fix.
    """
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError) as err:
        hint = " (pip install 'lit-rl[qlora]' installs bitsandbytes)" if class_path.startswith("bitsandbytes") else ""
        raise ValueError(f"optimizer.class_path: cannot import {class_path!r} ({err}){hint}") from err
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(
            f"optimizer.class_path: {class_path!r} is not a torch.optim.Optimizer subclass; "
            "give one, e.g. torch.optim.AdamW or bitsandbytes.optim.AdamW8bit"
        )
    return cls


def build_optimizer(
    spec: dict[str, Any], params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """``spec['class_path'](params, lr=lr, weight_decay=weight_decay, **spec['init_args'])``.

    Args:
        spec: ``{"class_path": ..., "init_args": {...}}`` as LightningCLI's ``--optimizer`` gives it (the method's
            ``optimizer`` option); ``init_args`` must not set ``lr`` or ``weight_decay``.
        params: the trainable parameters.
        lr: the method's ``learning_rate``.
        weight_decay: the method's ``weight_decay``; a nonzero one needs an optimizer that takes ``weight_decay``.

    Raises:
        ValueError: one line for an unknown class, a class that is no optimizer, ``lr`` or ``weight_decay`` among
            the options, or weight decay asked of an optimizer without it.
    """
    cls = optimizer_class(spec["class_path"])
    init_args = dict(spec.get("init_args") or {})
    for key, option in METHOD_OPTIONS.items():
        if key in init_args:
            raise ValueError(
                f"optimizer.init_args.{key}: the method sets it; remove it and set model.init_args.{option} instead"
            )
    accepted = inspect.signature(cls).parameters
    if "lr" in accepted:
        init_args["lr"] = lr
    if "weight_decay" in accepted:
        init_args["weight_decay"] = weight_decay
    elif weight_decay:
        raise ValueError(
            f"model.weight_decay: {cls.__name__} has no weight decay; set model.init_args.weight_decay 0 "
            "or choose an optimizer that has one"
        )
    return _sliced(cls)(params, **init_args)


def stochastic_round_bf16(values: torch.Tensor, key: int | None = None) -> torch.Tensor:
    """bf16 of float32 ``values``, each rounded to one of its two bf16 neighbours with probability given by how near
    it is to each (so the expected result is ``values``): uniform random low 16 bits are added to the float32 bits,
    which then lose their low 16 bits (magnitude rounding; the sign bit is untouched). The bits are
    :func:`random_bits` of ``key`` (by default a key drawn from torch's global generator)."""
    if key is None:
        key = int(torch.randint(-(1 << 31), 1 << 31, ()))
    noise = random_bits(values.numel(), key, values.device).view(values.shape)
    noise &= 0xFFFF
    rounded = torch.empty_like(values, dtype=torch.bfloat16)
    _round_into(rounded, values.clone(), noise)
    return rounded


def random_bits(
    numel: int,
    key: int,
    device: torch.device | str = "cpu",
    *,
    out: torch.Tensor | None = None,
    temp: torch.Tensor | None = None,
) -> torch.Tensor:
    """``numel`` int32 values of 32 random bits each, the same for the same ``key`` on every device: a counter-based
    generator, the integer hash ``lowbias32`` (C. Wellons, github.com/skeeto/hash-prospector) of each value's index
    plus ``key``, in int32 arithmetic that wraps. Elementwise and parallel, several times faster than
    ``torch.randint``'s sequential Mersenne Twister on a CPU; the wrapping is tested against Python integers
    (``tests/test_optimizers.py``). ``out`` and ``temp`` (int32, ``numel`` values, on the device) spare the two
    allocations; the result is ``out``."""
    x = torch.arange(numel, dtype=torch.int32, device=device if out is None else out.device, out=out)
    temp = torch.empty_like(x) if temp is None else temp
    x += _int32(key)
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, None)):
        torch.bitwise_right_shift(x, shift, out=temp)
        temp &= (1 << (32 - shift)) - 1  # a logical shift: the arithmetic shift's sign bits masked off
        x ^= temp
        if multiplier is not None:
            x *= _int32(multiplier)
    return x


def _int32(value: int) -> int:
    """``value`` modulo 2^32, as the signed int32 with those bits."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _round_into(out: torch.Tensor, values: torch.Tensor, noise: torch.Tensor) -> None:
    """:func:`stochastic_round_bf16` of float32 ``values`` (overwritten) into bf16 ``out``, with its 16 random bits
    per value given (``noise``, int32 in [0, 2^16))."""
    bits = values.view(torch.int32)
    bits += noise
    bits &= _HIGH_HALF
    out.copy_(values)  # exact: the low 16 bits are zero


class StochasticAdamW(torch.optim.AdamW):
    """torch's AdamW, except that bf16 tensors are stepped in float32 and written back with stochastic rounding.

    The methods' default optimizer. torch's AdamW keeps a bf16 weight's moments in bf16 and writes the weight and
    the second moment rounded to nearest, so an update below half the weight's bf16 spacing is lost (most of them
    at a learning rate of 1e-5), and the second moment, which moves by ``1 - beta2`` = 0.1% of itself per step
    (less than half its own bf16 spacing), cannot decay. Here each bf16 weight is stepped :data:`SLICE_VALUES` values
    at a time: the slice's weight, gradient and moments as float32 copies (with the random bits, 24 MiB of scratch
    at most, allocated once per tensor), torch's own fused AdamW kernel on them, and the weight and the second
    moment written back with stochastic rounding (:func:`stochastic_round_bf16`; one random draw of 32 bits gives
    both their 16 bits; the first moment moves by 10% per step: it is rounded to nearest). The state has torch's
    keys, dtypes and bytes (``step`` a Python int for the stepped tensors). Every other tensor takes torch's own
    (fused) step. ``amsgrad``, ``maximize`` and ``capturable`` are torch's alone: refused here.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 1e-2, **kwargs: Any) -> None:
        for flag in ("amsgrad", "maximize", "capturable"):
            if kwargs.get(flag):
                raise ValueError(f"optimizer: {flag} is not offered by StochasticAdamW; use torch.optim.AdamW")
        super().__init__(params, lr=lr, weight_decay=weight_decay, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [group["params"] for group in self.param_groups]
        try:  # torch's step for what is not bf16
            for group in self.param_groups:
                group["params"] = [p for p in group["params"] if p.dtype != torch.bfloat16]
            if any(p.grad is not None for group in self.param_groups for p in group["params"]):
                super().step()
        finally:
            for group, params in zip(self.param_groups, groups, strict=True):
                group["params"] = params
        for gindex, group in enumerate(self.param_groups):
            for pindex, p in enumerate(group["params"]):
                if p.dtype == torch.bfloat16 and p.grad is not None:
                    self._step_bf16(group, p, gindex, pindex)
        return loss

    def _step_bf16(self, group, p, gindex: int, pindex: int) -> None:
        state = self.state[p]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] = step = int(state["step"]) + 1
        lr, (beta1, beta2), eps, decay = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        kept = [_local(t) for t in (p.detach(), state["exp_avg"], state["exp_avg_sq"])]  # a shard's own values
        weights, first, second = (t.view(-1) if t.is_contiguous() else t.reshape(-1) for t in kept)
        grads = _local(p.grad).reshape(-1)
        steps = torch.tensor(float(step), dtype=torch.float32, device=weights.device)
        scratch = torch.empty(6, min(weights.numel(), SLICE_VALUES), dtype=torch.float32, device=weights.device)
        for start in range(0, weights.numel(), SLICE_VALUES):
            values = slice(start, start + SLICE_VALUES)
            w, g, m, v, low, high = scratch[:, : weights[values].numel()]
            for copy, kept_values in zip((w, g, m, v), (weights, grads, first, second), strict=True):
                copy.copy_(kept_values[values])  # float32
            torch._fused_adamw_([w], [g], [m], [v], [], [steps], lr=lr, beta1=beta1, beta2=beta2,  # torch's kernel
                                weight_decay=decay, eps=eps, amsgrad=False, maximize=False)  # fmt: skip
            low, high = low.view(torch.int32), high.view(torch.int32)
            random_bits(low.numel(), _key(gindex, pindex, step, start), out=low, temp=high)
            torch.bitwise_right_shift(low, 16, out=high)  # one draw of 32 bits: the high 16 for the second moment,
            high &= 0xFFFF
            low &= 0xFFFF  # the low 16 for the weight
            _round_into(weights[values], w, low)
            _round_into(second[values], v, high)
            first[values] = m
        for tensor, flat in zip(kept, (weights, first, second), strict=True):
            if not tensor.is_contiguous():  # reshape copied it
                tensor.copy_(flat.view_as(tensor))


def _key(*place: int) -> int:
    """The stochastic rounding's key (:func:`random_bits`) for ``place`` (group, tensor, step and, sliced, the slice's
    start): made of it alone, so a run and its resume draw the same bits."""
    return hash(place)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) tensor's local shard, which its writes update; any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def default_optimizer(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float, mixed: bool):
    """The methods' optimizer without ``--optimizer``: :class:`StochasticAdamW`, fused (one kernel per parameter group
    on CPU and CUDA, without foreach's temporaries the size of every trainable weight; ``bench/results/estimate.md``
    shows them on a Qwen2.5-3B shape), except under mixed precision, where Lightning refuses to clip a fused
    optimizer's gradients (it unscales them)."""
    fused = not mixed and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return StochasticAdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


class _SlicedStep:
    """Mixed in before a bitsandbytes 8-bit optimizer: steps a tensor's blockwise 8-bit state slice by slice.

    What bitsandbytes' own ``update_step`` passes to ``optimizer_update_8bit_blockwise`` for the whole tensor is
    passed for one :data:`SLICE_VALUES` of it at a time (views, which the operator updates in place), on a CPU,
    and for bf16 weights on any device, whose slice is stepped as a float32 copy and rounded back stochastically. A
    bf16 weight whose moments bitsandbytes keeps in fp32 (fewer than ``min_8bit_size`` values: norms, biases) is
    stepped whole as a float32 copy by bitsandbytes' 32-bit operator and rounded back stochastically too. Anything
    else (float32 weights on CUDA, fp32 state of small float32 tensors, AdEMAMix's stacked state) is bitsandbytes'
    own step.
    """

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        state = self.state[p]
        absmax = state.get("absmax1")
        rounded = p.dtype == torch.bfloat16
        if rounded and state["state1"].dtype == torch.float32:
            return self._rounded_32bit(group, p, gindex, pindex)
        sliced = rounded or (p.device.type == "cpu" and p.numel() > SLICE_VALUES)
        if absmax is None or absmax.ndim != 1 or not sliced:
            return super().update_step(group, p, gindex, pindex)
        from bitsandbytes import functional

        p.data = p.data.contiguous()
        weights, grads = p.data.view(-1), p.grad.contiguous().view(-1)
        config = self.get_config(gindex, pindex, group)
        state["step"] += 1
        betas, two = config["betas"], state.get("absmax2") is not None
        for start in range(0, weights.numel(), SLICE_VALUES):
            values, blocks = (
                slice(start, start + SLICE_VALUES),
                slice(start // _BLOCK, -(-(start + SLICE_VALUES) // _BLOCK)),
            )
            stepped = weights[values].float() if rounded else weights[values]
            functional.optimizer_update_8bit_blockwise(  # weight and gradient of one dtype, as the operator checks
                self.optimizer_name,
                grads[values].float() if rounded else grads[values],
                stepped,
                state["state1"].view(-1)[values],
                state["state2"].view(-1)[values] if two else None,
                betas[0],
                betas[1],
                betas[2] if two and len(betas) >= 3 else 0.0,
                config.get("alpha", 0.0) if two else 0.0,
                config["eps"],
                state["step"],
                config["lr"],
                state["qmap1"],
                state["qmap2"] if two else None,
                absmax[blocks],
                state["absmax2"][blocks] if two else None,
                config["weight_decay"],
                gnorm_scale=1.0,
                skip_zeros=config["skip_zeros"],
            )
            if rounded:
                weights[values] = stochastic_round_bf16(stepped, _key(gindex, pindex, state["step"], start))
        return None

    def _rounded_32bit(self, group, p, gindex: int, pindex: int) -> None:
        """What bitsandbytes' ``update_step`` passes to ``optimizer_update_32bit``, with a float32 copy of the bf16
        weight and gradient, and the weight rounded back stochastically."""
        from bitsandbytes import functional

        state, config = self.state[p], self.get_config(gindex, pindex, group)
        state["step"] += 1
        stepped, betas = p.data.float(), config["betas"]
        functional.optimizer_update_32bit(
            self.optimizer_name, p.grad.float(), stepped, state["state1"], betas[0], config["eps"], state["step"],
            config["lr"], state.get("state2"), betas[1], betas[2] if len(betas) >= 3 else 0.0, config.get("alpha", 0.0),
            config["weight_decay"], 1.0, state["unorm_vec"] if config["max_unorm"] > 0.0 else None,
            max_unorm=config["max_unorm"], skip_zeros=config["skip_zeros"],
        )  # fmt: skip
        p.data.copy_(stochastic_round_bf16(stepped, _key(gindex, pindex, state["step"])))


def keeps_bf16_updates(spec: dict[str, Any] | None) -> bool:
    """Whether the optimizer for ``spec`` (``None``: the methods' default, :class:`StochasticAdamW`) keeps the updates
    of bf16 weights smaller than half their bf16 spacing: :class:`StochasticAdamW` and the sliced bitsandbytes 8-bit
    step do (stochastic rounding); every other optimizer writes bf16 weights rounded to nearest.
    """
    if spec is None:
        return True  # StochasticAdamW
    return issubclass(_sliced(optimizer_class(spec["class_path"])), (StochasticAdamW, _SlicedStep))


@functools.cache
def _sliced(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` itself, or for a bitsandbytes 8-bit optimizer a subclass of the same name that steps CPU tensors and
    bf16 weights in slices (:class:`_SlicedStep`)."""
    if not cls.__module__.startswith("bitsandbytes"):
        return cls
    from bitsandbytes.optim.optimizer import Optimizer8bit

    if not issubclass(cls, Optimizer8bit):
        return cls
    return type(cls.__name__, (_SlicedStep, cls), {"__module__": __name__, "__doc__": cls.__doc__})


__all__ = [
    "METHOD_OPTIONS",
    "SLICE_VALUES",
    "StochasticAdamW",
    "build_optimizer",
    "default_optimizer",
    "keeps_bf16_updates",
    "optimizer_class",
    "random_bits",
    "stochastic_round_bf16",
]
