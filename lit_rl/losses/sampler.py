"""The sampler against the trainer: how far the rollout's log-probs are from the trainer's, and the correction.

The decode loop records, for each sampled token, its log-probability under the distribution it sampled from
(``log_softmax(logits / temperature)`` of the sampler's own logits, before top-k or top-p: the quantity the trainer
computes). The trainer recomputes the same quantity with a full forward. The two differ when the sampler is not the
trainer: different kernels (an incremental decode against one forward over the whole sequence), a lower precision,
merged or quantized weights. "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (Yao et al.,
2025) shows the gap biases the gradient; the correction multiplies each token's policy term by an importance weight
``exp(trainer - sampler)``, truncated or masked, per token or per sequence. The modes and their defaults are TRL's
(``vllm_importance_sampling_mode`` and ``_clip_min`` / ``_clip_max`` in its ``GRPOConfig``, where the sampler is
vLLM): ``tests/test_losses_trl.py`` runs TRL's loss on the same weights.

- :func:`sampler_weights`: the weights ``[B, T]`` (token modes) or ``[B, 1]`` (sequence modes), without gradient.
- :func:`sampler_mismatch`: what the run logs every step (``rollout/sampler_*``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SAMPLER_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _token_gap(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor, mode: str) -> Tensor:
    """``trainer - sampler`` per token ``[B, T]``: 0 off the completion and where the sampler gave no log-prob (NaN),
    in float32 at least (float64 stays float64)."""
    if mode not in SAMPLER_CORRECTION_MODES:
        raise ValueError(f"importance sampling mode {mode!r} is not one of {SAMPLER_CORRECTION_MODES}")
    dtype = torch.promote_types(trainer_logp.dtype, torch.float32)
    diff = (trainer_logp.to(dtype) - sampler_logp.to(dtype)) * mask.to(dtype)  # [B, T]
    return torch.nan_to_num(diff, nan=0.0)


def _ratio(gap: Tensor, mode: str) -> Tensor:
    """``exp`` of the gap per token ``[B, T]``, or of its sum per completion ``[B, 1]`` (sequence modes)."""
    return torch.exp(gap.sum(-1, keepdim=True) if mode.startswith("sequence") else gap)


def _outside(ratio: Tensor, clip_min: float | None, clip_max: float | None) -> Tensor:
    """Where ``ratio`` lies outside ``[clip_min, clip_max]`` (a bound left ``None`` is open)."""
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return (ratio < low) | (ratio > high)


@torch.no_grad()
def sampler_weights(
    trainer_logp: Tensor,
    sampler_logp: Tensor,
    mask: Tensor,
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> Tensor:
    """Importance weights of the sampled tokens, ``p_trainer / p_sampler``, for the policy term.

    ``*_truncate`` clamps the ratio to ``[clip_min, clip_max]``; ``*_mask`` sets it to 0 outside that range (a
    bound left ``None`` is open). ``token_*``: one ratio per token; ``sequence_*``: one per completion, the product of
    its tokens' ratios.

    Args:
        trainer_logp: ``[B, T]`` log-probs of the sampled tokens under the trainer's weights before the update (the old
            policy's).
        sampler_logp: ``[B, T]`` the sampler's log-probs of the same tokens.
        mask: ``[B, T]``, 1 for completion tokens.
        mode: one of :data:`SAMPLER_CORRECTION_MODES`.
        clip_min: lower bound, or ``None``.
        clip_max: upper bound, or ``None``.

    Returns:
        ``[B, T]`` or ``[B, 1]`` weights, in float32 (float64 for float64 inputs).
    """
    ratio = _ratio(_token_gap(trainer_logp, sampler_logp, mask, mode), mode)
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max) if (clip_min, clip_max) != (None, None) else ratio
    return ratio.masked_fill(_outside(ratio, clip_min, clip_max), 0.0)


@torch.no_grad()
def sampler_mismatch(
    trainer_logp: Tensor,
    sampler_logp: Tensor,
    mask: Tensor,
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> dict[str, Tensor]:
    """The gap between sampler and trainer on one rollout, as 0-d tensors (read them in one sync).

    - ``rollout/sampler_logp_diff/mean`` and ``/max``: ``|trainer - sampler|`` over the completion tokens.
    - ``rollout/sampler_k3``: the k3 estimate of KL(sampler || trainer) per token, ``exp(d) - d - 1`` with
      ``d = trainer - sampler`` (unbiased, >= 0, on tokens drawn from the sampler; Schulman's k3).
    - ``rollout/sampler_past_cap``: the share of tokens (token modes) or completions (sequence modes) whose ratio
      lies outside ``[clip_min, clip_max]``: what a mask would drop or a truncation would clamp.
    """
    valid = mask.bool()  # [B, T]
    d = _token_gap(trainer_logp, sampler_logp, mask, mode)  # [B, T], computed once for every figure below
    count = valid.sum().clamp(min=1)
    past = _outside(_ratio(d, mode), clip_min, clip_max)  # [B, T] or [B, 1]
    past_share = past.to(d.dtype).mean() if mode.startswith("sequence") else (past & valid).to(d.dtype).sum() / count
    return {
        "rollout/sampler_logp_diff/mean": d.abs().sum() / count,
        "rollout/sampler_logp_diff/max": d.abs().max(),
        "rollout/sampler_k3": (torch.exp(d) - d - 1.0).sum() / count,
        "rollout/sampler_past_cap": past_share,
    }
