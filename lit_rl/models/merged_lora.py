"""LoRA merged into the weights the sampler reads: one matmul per layer and token instead of three.

A LoRA layer's forward runs its base matmul, then ``x A^T``, ``(.) B^T``, a scale and an add: on a decode step of a
few rows these skinny matmuls and small kernels cost about a fifth of the step on this project's CPU
(``bench/results/sampler_gap.md`` gives the rollout seconds). :func:`lora_merged` gives each plain LoRA layer a
merged weight ``W + scale * B A`` for the duration of a rollout and switches its adapters off there, so the layer
runs one dense matmul.

Why a merged copy, not peft's ``merge_adapter`` / ``unmerge_adapter``: those add the delta into ``W`` in place and
subtract it afterwards, and ``(W + D) - D`` is not ``W`` in floating point, so every rollout would move the frozen
base weights (and the reference, which is the base with adapters disabled) by a rounding error. Here the original
weight tensor is never written: it is swapped back in afterwards, bitwise what it was. The cost is one merged
copy of the adapted weights held through the rollout, which the estimator charges because the rollout it runs on
fake tensors enters the same context.

The sampler is then not the trainer: ``x (W + D)^T`` rounds differently from ``x W^T + (x A^T) B^T s``. The gap
is logged every step (``rollout/sampler_*``, :mod:`lit_rl.losses.sampler`) and ``loss.importance_sampling_*``
corrects for it.

Layers left as they are (their adapters still run): a quantized base (a 4-bit weight has no dense copy to add
to), DoRA and other LoRA variants, adapters with a bias, layers whose adapters are merged by peft already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["lora_merged"]


def _mergeable(module: torch.nn.Module) -> bool:
    if module.disable_adapters or module.merged:
        return False
    if type(module.base_layer) is not torch.nn.Linear or not module.base_layer.weight.dtype.is_floating_point:
        return False
    active = [name for name in module.active_adapters if name in module.lora_A]
    return bool(active) and not any(
        name in module.lora_variant or module.lora_bias.get(name, False) for name in active
    )


@contextlib.contextmanager
def lora_merged(model: torch.nn.Module) -> Iterator[tuple[int, int]]:
    """Within the context each plain LoRA layer of ``model`` reads ``W + sum of its active adapters' deltas``
    with its adapters off; yields ``(merged layers, LoRA layers left unmerged)``. On exit every layer has its own
    weight tensor back and its adapters on: no parameter is written. Gradients must not flow inside (a rollout)."""
    # imported here: peft imports bitsandbytes, whose import-time notice the CLI filters only once it has started
    from peft.tuners.lora.layer import Linear as LoraLinear

    swapped: list[tuple[torch.nn.Module, torch.nn.Module, torch.nn.Parameter]] = []
    left = 0
    try:
        with torch.no_grad():
            for module in model.modules():
                if not isinstance(module, LoraLinear):
                    continue
                if not _mergeable(module):
                    left += 1
                    continue
                base = module.base_layer
                weight = base.weight
                delta = sum(
                    module.get_delta_weight(name).float()
                    for name in module.active_adapters
                    if name in module.lora_A
                )  # [out, in] in float32: one rounding into the weight's dtype
                merged = (weight.float() + delta).to(weight.dtype)
                base._parameters["weight"] = torch.nn.Parameter(merged, requires_grad=False)
                swapped.append((module, base, weight))
                module._disable_adapters = True
        yield len(swapped), left
    finally:
        for module, base, weight in reversed(swapped):
            base._parameters["weight"] = weight
            module._disable_adapters = False
