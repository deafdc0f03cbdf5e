"""Top-k Gumbel-softmax: differentiable soft tokens over the k most likely tokens only.

The plain Gumbel-softmax (Jang et al., 2017) adds Gumbel noise to all ``V`` logits and returns a
dense ``[..., V]`` weight vector; a differentiable rollout that keeps those for every generated
token, plus their softmax for backward, holds ``B * T * V`` floats several times over, which is what
makes Gumbel training run out of memory. For GumbelTopK's differentiable rollouts
(:mod:`lit_rl.methods.gumbel_topk`), this version first takes the top-k logits, adds Gumbel noise to those k only and
returns ``softmax((topk + g) / tau)`` as ``[..., k]`` weights with their ``[..., k]`` token ids, so
a soft token is a sparse weighted gather of k embedding rows.

How it differs from the plain form: the truncation renormalises over the k tokens — tokens outside
the top-k get exactly zero weight and zero gradient, and which k tokens are kept does not depend on
the noise (like top-k sampling, unlike Gumbel-top-k sampling). ``k = 0`` runs the plain
full-vocabulary form (``indices = arange(V)`` expanded, not copied), kept for comparison.
``hard=True`` is the straight-through estimator: the forward value is exactly one-hot over the k
(at the argmax of the noisy soft weights), the gradient is that of the soft weights.

What is saved for backward: autograd keeps the softmax output and the top-k indices, ``[..., k]``
each (``[..., V]`` only on the ``k = 0`` path); the noise is drawn in float32 from ``generator``
(``torch.rand`` of shape ``[..., k]``), so a generator with a fixed seed reproduces it. The noise
can instead be given as ``noise`` ``[..., V]`` in vocabulary order (the top-k path gathers it at the
kept ids), so that the top-k and full paths can be compared on the same draw; that costs a dense
``[..., V]`` tensor and is meant for comparisons and tests, not for rollouts.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gumbel_softmax_topk(
    logits: Tensor,
    tau: float,
    k: int,
    *,
    hard: bool = False,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Gumbel-softmax over the top-k logits; differentiable w.r.t. ``logits``.

    Args:
        logits: ``[..., V]`` logits, any float dtype.
        tau: softmax temperature of the relaxation, must be positive (small: close to one-hot).
        k: tokens kept per position; ``0`` means the full vocabulary, ``k >= V`` is clamped to ``V``.
        hard: straight-through: forward exactly one-hot over the k, backward through the soft weights.
        generator: random generator for the noise (on the device of ``logits``); ``None`` uses the global one.
        noise: Gumbel noise ``[..., V]`` in vocabulary order (the shape of ``logits``) to use instead of drawing
            it; the top-k path gathers it at the kept ids. Not together with ``generator``.

    Returns:
        ``(weights, indices)``: weights ``[..., k]`` summing to 1 (float32, or float64 for double
        logits) and long token ids ``[..., k]`` of the kept tokens, in decreasing order of logit.

    Raises:
        ValueError: if ``k < 0`` or ``tau <= 0``, or ``noise`` is given with a ``generator`` or in another shape.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0 (0 means the full vocabulary), got {k}")
    if not tau > 0:
        raise ValueError(f"tau must be positive, got {tau}")
    if noise is not None and generator is not None:
        raise ValueError("pass either noise or a generator to draw it, not both")
    if noise is not None and noise.shape != logits.shape:
        raise ValueError(f"noise {tuple(noise.shape)} must have the shape of logits {tuple(logits.shape)}")
    v = logits.shape[-1]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if k == 0:
        vals = logits.to(dtype)  # [..., V]
        indices = torch.arange(v, device=logits.device).expand(logits.shape)  # [..., V], a view
    else:
        vals, indices = logits.to(dtype).topk(min(k, v), dim=-1)  # [..., k], [..., k]
    if noise is not None:
        g = noise if k == 0 else noise.gather(-1, indices)  # [..., k]
    else:
        u = torch.rand(vals.shape, generator=generator, device=vals.device, dtype=torch.float32)  # [..., k]
        g = -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))  # [..., k] Gumbel(0, 1)
    soft = torch.softmax((vals + g.to(dtype)) / tau, dim=-1)  # [..., k]
    if not hard:
        return soft, indices
    one_hot = torch.zeros_like(soft).scatter_(-1, soft.argmax(dim=-1, keepdim=True), 1.0)  # [..., k]
    return one_hot + (soft - soft.detach()), indices  # exactly one-hot forward, soft gradient
