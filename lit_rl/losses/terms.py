"""The per-token parts of a policy loss: masked means, importance weights, token and sequence masks, weights, bonus.

Each is a plain function of ``[B, T]`` tensors (no ``[B, T, V]``), used by :func:`lit_rl.losses.grpo_loss` and
citing the paper it comes from; the package docstring (:mod:`lit_rl.losses`) says how they fit together.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1.

    Args:
        x: values, any shape.
        mask: same shape as ``x``; 1 (or ``True``) where a value counts, 0 elsewhere.
        dim: reduce over this dimension only; ``None`` reduces over all elements.

    Returns:
        The masked mean: a scalar when ``dim`` is ``None``, else ``x`` reduced over ``dim``. Where no
        position counts the mean is 0 (the denominator is clamped to 1), never ``NaN``.
    """
    valid = mask.bool()  # same shape as x
    total = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))  # same shape as x
    if dim is None:
        return total.sum() / valid.sum().clamp(min=1)
    return total.sum(dim) / valid.sum(dim).clamp(min=1)


def importance_log_weights(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """Log importance weights ``log(pi / pi_old)`` per token, or one per sequence (GSPO).

    ``"sequence"`` is GSPO's ratio (Zheng et al., arXiv 2507.18071): the mean of a sequence's token log-ratios,
    i.e. the log of the geometric mean of its token ratios, so one weight covers every token of a completion.

    Args:
        logp: ``[B, T]`` log-probs under the current policy.
        old_logp: ``[B, T]`` log-probs under the sampling policy.
        mask: ``[B, T]``, 1 for completion tokens.
        level: ``"token"`` or ``"sequence"``.

    Returns:
        ``[B, T]`` for ``"token"`` (0 at padding), ``[B, 1]`` for ``"sequence"``.
    """
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}")
    valid = mask.bool()  # [B, T]
    log_ratio = torch.where(valid, logp - old_logp, 0.0)  # [B, T]
    if level == "token":
        return log_ratio
    return log_ratio.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]


def masked_quantile(x: Tensor, mask: Tensor, q: float) -> Tensor:
    """``torch.quantile`` (linear interpolation) of the values of ``x`` where ``mask`` is 1, as a 0-d tensor.

    Computed with a sort that puts the masked-out values last, so it needs no boolean indexing (no
    data-dependent shape, no device sync) and runs on the estimator's fake tensors. With no value to take a
    quantile of, the result is ``+inf``.

    Args:
        x: values, any shape, floating point.
        mask: same shape; 1 where a value counts.
        q: the quantile, in ``[0, 1]``.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    flat = x.reshape(-1)  # [N]
    valid = mask.reshape(-1).bool()  # [N]
    count = valid.sum()  # 0-d
    ordered = torch.where(valid, flat, torch.full((), math.inf, dtype=x.dtype, device=x.device)).sort().values  # [N]
    rank = torch.tensor(q, dtype=x.dtype, device=x.device) * (count - 1).clamp(min=0).to(x.dtype)  # 0-d
    below = rank.floor().long().clamp(max=max(flat.numel() - 1, 0))  # 0-d
    above = rank.ceil().long().clamp(max=max(flat.numel() - 1, 0))  # 0-d
    low, high = ordered[below], ordered[above]  # 0-d each
    value = torch.lerp(low, high, rank - below.to(x.dtype)) if q > 0 else low  # lerp(v, inf, 0) would be nan
    return torch.where(count > 0, value, torch.full((), math.inf, dtype=x.dtype, device=x.device))


def high_entropy_mask(
    entropy: Tensor, mask: Tensor, top_entropy_quantile: float, *, pooled: Tensor | None = None
) -> Tensor:
    """The completion tokens whose entropy is in the top ``top_entropy_quantile`` share.

    Wang et al., "Beyond the 80/20 Rule" (arXiv 2506.01939), train on the ~20% highest-entropy tokens (the
    "forking" tokens) only. A token is kept when its entropy is at or above the ``1 - top_entropy_quantile``
    quantile of the valid tokens' entropies: ``1.0`` keeps every token, ``0.0`` keeps only the highest.

    Args:
        entropy: ``[B, T]`` per-token entropy (no gradient needed).
        mask: ``[B, T]``, 1 for completion tokens.
        top_entropy_quantile: the share of tokens to keep, in ``[0, 1]`` (the paper uses 0.2).
        pooled: optional 1-D entropies of every process's valid tokens (DDP), so that all processes use one
            threshold; ``None`` takes the quantile over this micro-batch's valid tokens.

    Returns:
        ``[B, T]`` bool, never ``True`` at padding.
    """
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    q = 1.0 - top_entropy_quantile
    if pooled is None:
        threshold = masked_quantile(entropy.detach(), mask, q)  # 0-d
    else:
        threshold = masked_quantile(pooled.detach(), torch.ones_like(pooled, dtype=torch.bool), q)  # 0-d
    return (entropy.detach() >= threshold) & mask.bool()  # [B, T]


def off_policy_mask(advantages: Tensor, logp: Tensor, old_logp: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, its equation 9): which completions to keep.

    A completion with a negative advantage whose mean per-token KL ``log pi_old - log pi`` (the sampling policy
    against the current one) exceeds ``threshold`` is dropped from the policy term: it has drifted too far
    off-policy for its negative signal to be trusted. On-policy (``old_logp == logp``) every completion is kept.

    Args:
        advantages: ``[B]``.
        logp: ``[B, T]`` current log-probs (read without gradient).
        old_logp: ``[B, T]`` log-probs of the policy that sampled the tokens.
        mask: ``[B, T]``, 1 for completion tokens.
        threshold: the KL above which a negative-advantage completion is dropped (e.g. 0.5).

    Returns:
        ``[B, 1]`` of 1.0 (keep) and 0.0 (drop), in ``logp``'s dtype.
    """
    valid = mask.bool()  # [B, T]
    kl = torch.where(valid, old_logp - logp.detach(), 0.0)  # [B, T]
    mean_kl = kl.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    keep = (advantages[:, None] >= 0) | (mean_kl <= threshold)  # [B, 1]
    return keep.to(logp.dtype)


@torch.no_grad()
def vespo_weights(
    advantages: Tensor,
    log_ratio: Tensor,
    mask: Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> Tensor:
    """VESPO's gamma weight of each completion's sequence ratio ``w`` (arXiv 2602.10693), without gradient.

    ``phi(w) = exp(lambda) * w**k * exp(-lambda * w)``, so ``phi(1) = 1`` and the weight falls smoothly on both
    sides instead of being clipped; ``k`` and ``lambda`` depend on the sign of the advantage. ``w`` is the
    product of the token ratios (the sum of token log-ratios, each clamped to ``[-20, 20]``), clamped to
    ``[1e-8, e**20]``; computed in log space. The loss uses ``phi`` as a detached coefficient of ``A * log p``.

    Args:
        advantages: ``[B]``.
        log_ratio: ``[B, T]`` token log-ratios ``log pi - log pi_old``.
        mask: ``[B, T]``, 1 for completion tokens.
        k_pos, lambda_pos: the exponent and decay for ``A >= 0``.
        k_neg, lambda_neg: the same for ``A < 0``.

    Returns:
        ``[B, 1]`` weights (0 where the arithmetic overflows).
    """
    lowest = math.log(1e-8)
    maskf = mask.to(log_ratio.dtype)  # [B, T]
    seq_log_ratio = (log_ratio.clamp(-20.0, 20.0) * maskf).sum(-1, keepdim=True)  # [B, 1]
    log_w = seq_log_ratio.clamp(lowest, 20.0)  # [B, 1]
    non_negative = advantages[:, None] >= 0  # [B, 1]

    def pick(positive: float, negative: float) -> Tensor:  # in log_w's dtype (python floats would make it float32)
        as_tensor = (torch.tensor(x, dtype=log_w.dtype, device=log_w.device) for x in (positive, negative))
        return torch.where(non_negative, *as_tensor)  # [B, 1]

    k = pick(k_pos, k_neg)  # [B, 1]
    lam = pick(lambda_pos, lambda_neg).clamp(min=1e-4)  # [B, 1]
    log_phi = lam + k * log_w - lam * torch.exp(log_w)  # [B, 1]
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def entropy_bonus(entropy: Tensor, mask: Tensor, token_mask: Tensor | None = None) -> Tensor:
    """The mean entropy over the tokens the policy term trains on, which ``entropy_coef`` rewards.

    The loss becomes ``loss - entropy_coef * entropy_bonus`` for every loss type alike (not rescaled by the loss
    type's normalisation, as in TRL), so a coefficient means the same whatever the loss.

    Args:
        entropy: ``[B, T]`` per-token entropy, with gradient.
        mask: ``[B, T]``, 1 for completion tokens.
        token_mask: optional ``[B, T]`` bool, the tokens the policy term keeps (:func:`high_entropy_mask`).
    """
    keep = mask.bool() if token_mask is None else mask.bool() & token_mask  # [B, T]
    return masked_mean(entropy, keep)
