"""GRPO-family policy losses and group-relative advantages, as plain functions.

What is here and where it comes from:

- :func:`group_advantages`: ``(r - mean_group) / (std_group + eps)`` from DeepSeekMath (GRPO,
  arXiv 2402.03300), with ``scale_rewards="none"`` dropping the division as Dr. GRPO recommends
  (arXiv 2503.20783) and ``"batch"`` dividing by the whole batch's std.
- :func:`grpo_loss`: the PPO clipped surrogate with GRPO's group advantages, an optional
  ``beta * k3`` KL penalty to a reference policy (Schulman, "Approximating KL divergence", 2020),
  asymmetric clipping (DAPO's clip-higher, arXiv 2503.14476) and four ways to normalise the
  token sum: ``grpo`` (per-sequence mean, then mean), ``bnpo`` (mean over the batch's tokens),
  ``dr_grpo`` (divide by ``B * max_completion_length``) and ``dapo`` (divide by the token count of
  the global batch, so every token in an optimizer step weighs the same).

How this differs from the papers:

- The KL term is added per token *inside* the normalisation (as in TRL), not as a separate
  sequence-level term.
- Padding positions are zeroed before ``exp`` so garbage (``-inf``) there can never turn into
  ``NaN`` in the loss or its gradient; denominators are clamped to at least 1 so an all-padding
  sequence or batch gives a zero loss, not ``NaN``.
- Gradient accumulation is the caller's business: these functions never divide by a number of
  micro-batches (see :func:`grpo_loss` for what to pass for ``dapo``).
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")


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


def _check_groups(rewards: Tensor, num_generations: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * num_generations], got shape {tuple(rewards.shape)}")
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2 for group-relative advantages, got {num_generations}")
    if rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of num_generations={num_generations}; "
            "pass num_prompts * num_generations rewards"
        )


def group_advantages(
    rewards: Tensor,
    num_generations: int,
    *,
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> Tensor:
    """Group-relative advantages (GRPO, DeepSeekMath arXiv 2402.03300; Dr. GRPO arXiv 2503.20783).

    Completions ``[i * num_generations, (i + 1) * num_generations)`` answer prompt ``i``. Each
    advantage is the reward minus its group's mean, then optionally divided by a std. The std is
    ``torch.std``'s default, the *unbiased* (Bessel-corrected, ``N - 1``) estimate, as in TRL.

    Args:
        rewards: ``[B]`` rewards, ``B = num_prompts * num_generations``, groups consecutive.
        num_generations: completions per prompt (>= 2).
        scale_rewards: ``"group"`` divides by ``std_group + eps`` (GRPO); ``"batch"`` divides by the
            std of the whole batch ``+ eps`` (the mean stays per group); ``"none"`` does not divide
            (Dr. GRPO: the std division favours prompts that are too easy or too hard).
        eps: added to the std so a zero-std group gives zero advantages, not ``NaN``.

    Returns:
        ``[B]`` advantages, float.

    Raises:
        ValueError: ``scale_rewards`` is unknown, ``rewards`` is not 1-D, ``num_generations < 2`` or
            ``B`` is not a multiple of ``num_generations``.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    _check_groups(rewards, num_generations)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    grouped = rewards.view(-1, num_generations)  # [P, G]
    advantages = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)  # [P, G]
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + eps)  # [P, G]
    return advantages.reshape(-1)  # [B]


def frac_zero_std(rewards: Tensor, num_generations: int) -> float:
    """Fraction of groups whose rewards all agree (zero std), so that give no learning signal.

    Args:
        rewards: ``[B]`` rewards, groups of ``num_generations`` consecutive completions.
        num_generations: completions per prompt (>= 2).

    Returns:
        A python float in ``[0, 1]``.
    """
    _check_groups(rewards, num_generations)
    std = rewards.float().view(-1, num_generations).std(dim=1)  # [P]
    return torch.isclose(std, torch.zeros_like(std)).float().mean().item()


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    max_completion_length: int | None = None,
    num_items_in_batch: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped-surrogate GRPO loss with optional k3 KL penalty and a choice of normalisation.

    Per token, with ``ratio = exp(logp - old_logp)``::

        loss_t = -min(ratio * A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * kl_t
        kl_t   = exp(ref_logp - logp) - (ref_logp - logp) - 1      # k3 estimator, >= 0

    The masked token sum is then normalised according to ``loss_type``:

    - ``"grpo"``: mean over each sequence's tokens, then mean over sequences (DeepSeekMath,
      arXiv 2402.03300). Long completions weigh less per token.
    - ``"bnpo"``: sum over all tokens / number of completion tokens in this batch.
    - ``"dr_grpo"``: sum over all tokens / ``(B * max_completion_length)``, a constant, so no length
      bias (Dr. GRPO, arXiv 2503.20783).
    - ``"dapo"``: sum over all tokens / ``num_items_in_batch``, the completion-token count of the
      whole optimizer step (DAPO, arXiv 2503.14476). Summed over the micro-batches of one step, the
      losses then equal one token-level mean over the step. ``None`` uses this batch's count
      (== ``"bnpo"``).

    For ``dapo`` the function divides by exactly ``num_items_in_batch``; pass the count that makes
    the *applied* gradient a token mean over the optimizer step. DDP averages gradients over
    ``world_size`` ranks and Lightning's automatic optimisation divides each micro-batch loss by
    ``accumulate_grad_batches``, so there pass ``global_tokens / (world_size * accumulate_grad_batches)``
    (TRL, which does not divide by the accumulation steps for ``dapo``, passes ``global_tokens / world_size``).

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy (with grad).
        old_logp: ``[B, T]`` log-probs under the policy that sampled them; ``None`` means on-policy
            (``logp.detach()``: ratio 1, gradient ``A * d logp``).
        ref_logp: ``[B, T]`` log-probs under the reference policy; ``None`` only with ``beta = 0``.
        advantages: ``[B]``, one per completion.
        mask: ``[B, T]``, 1 for completion tokens, 0 for padding and after EOS.
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"`` or ``"dapo"``.
        epsilon_low: lower clip, ratio is clamped at ``1 - epsilon_low``.
        epsilon_high: upper clip, ratio is clamped at ``1 + epsilon_high`` (DAPO clip-higher: larger).
        beta: KL coefficient; 0 disables the penalty (and no reference pass is needed).
        max_completion_length: the generation limit ``L``; required for ``"dr_grpo"``.
        num_items_in_batch: completion tokens in the global batch, for ``"dapo"``.

    Returns:
        ``(loss, stats)``: the scalar loss, and detached python floats ``"clip_ratio/low_mean"``,
        ``"clip_ratio/high_mean"``, ``"clip_ratio/region_mean"`` (masked token means of
        ``ratio < 1 - epsilon_low and A < 0``, ``ratio > 1 + epsilon_high and A > 0``, either) and
        ``"kl/mean"`` (masked token mean of the k3 KL; only when ``ref_logp`` is given).

    Raises:
        ValueError: unknown ``loss_type``; ``epsilon_high < epsilon_low`` or ``epsilon_low`` outside
            ``[0, 1)``; ``beta != 0`` without ``ref_logp``; ``"dr_grpo"`` without
            ``max_completion_length``; shapes that do not match.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if not 0.0 <= epsilon_low < 1.0:
        raise ValueError(f"epsilon_low must be in [0, 1), got {epsilon_low}")
    if epsilon_high < epsilon_low:
        raise ValueError(f"epsilon_high ({epsilon_high}) must be >= epsilon_low ({epsilon_low})")
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={beta} needs reference log-probs: pass ref_logp or set beta=0")
    if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length < 1):
        raise ValueError(
            f"loss_type='dr_grpo' needs max_completion_length >= 1 (the generation limit), got {max_completion_length}"
        )
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise ValueError(f"logp and mask must both be [B, T], got {tuple(logp.shape)} and {tuple(mask.shape)}")
    for name, other in (("old_logp", old_logp), ("ref_logp", ref_logp)):
        if other is not None and other.shape != logp.shape:
            raise ValueError(f"{name} must have logp's shape {tuple(logp.shape)}, got {tuple(other.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(logp.shape[:1])}, got {tuple(advantages.shape)}")

    if old_logp is None:
        old_logp = logp.detach()  # [B, T]
    valid = mask.bool()  # [B, T]
    maskf = valid.to(logp.dtype)  # [B, T]
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [B, 1]

    # padding may hold -inf or garbage; zero it before exp() so neither the loss nor the gradient sees NaN
    log_ratio = torch.where(valid, logp - old_logp, 0.0)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)  # [B, T]
    per_token_loss = -torch.min(ratio * adv, clipped * adv)  # [B, T]

    kl = None
    if ref_logp is not None:
        log_ref_ratio = torch.where(valid, ref_logp - logp, 0.0)  # [B, T]
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0  # [B, T], k3 >= 0
        if beta != 0.0:
            per_token_loss = per_token_loss + beta * kl  # [B, T]

    masked_loss = per_token_loss * maskf  # [B, T]
    if loss_type == "grpo":
        seq_loss = masked_loss.sum(dim=1) / maskf.sum(dim=1).clamp(min=1.0)  # [B]
        loss = seq_loss.mean()
    elif loss_type == "bnpo" or (loss_type == "dapo" and num_items_in_batch is None):
        loss = masked_loss.sum() / maskf.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = masked_loss.sum() / (logp.shape[0] * max_completion_length)
    else:  # dapo with a global token count
        if isinstance(num_items_in_batch, Tensor):
            normaliser = num_items_in_batch.to(device=logp.device, dtype=logp.dtype).clamp(min=1.0)
        else:
            normaliser = max(float(num_items_in_batch), 1.0)
        loss = masked_loss.sum() / normaliser

    with torch.no_grad():
        is_low = (ratio < 1.0 - epsilon_low) & (adv < 0)  # [B, T]
        is_high = (ratio > 1.0 + epsilon_high) & (adv > 0)  # [B, T]
        names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
        values = [masked_mean(is_low.float(), valid), masked_mean(is_high.float(), valid)]
        values.append(masked_mean((is_low | is_high).float(), valid))
        if kl is not None:
            names.append("kl/mean")
            values.append(masked_mean(kl.float(), valid))
        stats = dict(zip(names, torch.stack(values).tolist(), strict=True))  # one device sync for all stats
    return loss, stats
