"""The LM head as the logits-free ops see it: weight, bias and the transforms real checkpoints apply.

Most causal LMs compute ``logits = hidden @ W.T + b``. Some transform them, and a model's log-probs are
those of the transformed logits:

- a **scale**: Cohere multiplies by ``logit_scale``, Granite divides by ``logits_scaling``, Falcon-H1
  multiplies by ``lm_head_multiplier``, MiniCPM3 divides the hidden states before a bias-free head (the same
  thing);
- a final **softcap** ``c * tanh(z / c)``: Gemma 2 (``final_logit_softcapping``), RecurrentGemma
  (``logits_soft_cap``), ...;
- a **transform** of the hidden states before the head (BERT-style ``dense -> act -> norm``, ELECTRA's
  projection to the embedding size).

The ops compute ``z = softcap(scale * (features @ W.T + b)) / temperature`` one block at a time, where
``features = transform(hidden)`` is computed once by the caller (it is ``[B, T, E]``, not ``[B, T, V]``),
and chain the gradient through the softcap inside the same blocks: ``dz/draw = scale * (1 - tanh^2) / T``.
Temperature divides the capped logits, as sampling does with the model's logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class HeadSpec:
    """What the ops need of a model's LM head; :func:`lit_rl.models.head_spec` reads it from a model.

    Attributes:
        weight: the head weight ``[V, E]``.
        bias: the head bias ``[V]`` or ``None``.
        scale: logits are multiplied by it (before the softcap).
        softcap: ``c`` of the final ``c * tanh(z / c)``, or ``None``.
        transform: a module mapping hidden states ``[..., H]`` to the head's input ``[..., E]``, or ``None``.
    """

    weight: Tensor
    bias: Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None
    transform: torch.nn.Module | None = None

    def features(self, hidden: Tensor) -> Tensor:
        """The head's input ``[..., E]`` from the trunk's hidden states ``[..., H]``."""
        return self.transform(hidden) if self.transform is not None else hidden

    def logits(self, hidden: Tensor, sink=None) -> Tensor:
        """The model's logits ``[..., V]`` from trunk hidden states, materialised (one position at a time only).

        ``sink``: a :class:`~lit_rl.ops.gradient_sink.GradientSink` of ``weight``, which then takes its gradient.
        """
        features = self.features(hidden)
        if sink is None:
            z = torch.nn.functional.linear(features, self.weight, self.bias)  # [..., V]
        else:
            z = sink.linear(features)  # [..., V]
            z = z + self.bias.to(z.dtype) if self.bias is not None else z
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    @property
    def op_kwargs(self) -> dict[str, object]:
        """``bias``, ``scale`` and ``softcap`` as keyword arguments of the token-math ops."""
        return {"bias": self.bias, "scale": self.scale, "softcap": self.softcap}


def check_transform(scale: float, softcap: float | None) -> None:
    """Refuse a scale or softcap the ops cannot use.

    Raises:
        ValueError: a zero or non-finite scale, or a softcap that is not positive and finite.
    """
    if not math.isfinite(scale) or scale == 0:
        raise ValueError(f"logit scale must be finite and non-zero, got {scale}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be positive and finite, got {softcap}")


def transform_block_(z: Tensor, scale: float, softcap: float | None, temperature: float) -> Tensor:
    """``softcap(scale * z) / temperature`` of a raw logits block, in place (no second block)."""
    if softcap is None:
        factor = scale / temperature
        return z.mul_(factor) if factor != 1.0 else z
    z.mul_(scale / softcap).tanh_()
    return z.mul_(softcap / temperature)


def softcap_slope(z: Tensor, softcap: float | None, temperature: float) -> Tensor | None:
    """``1 - tanh^2`` ``[tc, vc]`` from a transformed block (the softcap's derivative), or ``None`` without softcap."""
    if softcap is None:
        return None
    return (z * (temperature / softcap)).square_().neg_().add_(1.0)  # a new block: z is still needed


def chain_(dz: Tensor, slope: Tensor | None, scale: float, temperature: float) -> Tensor:
    """Turn ``dloss/dz`` of transformed logits into ``dloss/draw`` of ``features @ W.T + b``, in place."""
    factor = scale / temperature
    if factor != 1.0:
        dz.mul_(factor)
    if slope is not None:
        dz.mul_(slope)
    return dz
