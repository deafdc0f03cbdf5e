"""The GRPO-family loss of one micro-batch: a loss type is its policy term and its normalisation, in two tables.

:func:`grpo_loss` computes the importance ratio, looks the loss type's policy term up in :data:`POLICY_TERMS`
(each returns the per-token loss and its own statistics), applies the masks and the KL penalty, and divides the
masked token sum as :data:`NORMALISATIONS` says. The settings are one :class:`~lit_rl.losses.LossSettings`,
checked when it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from lit_rl.losses.settings import LOSS_TYPES, LossSettings
from lit_rl.losses.terms import importance_log_weights, masked_mean, off_policy_mask, vespo_weights


@dataclass
class PolicyInputs:
    """What a policy term reads: one micro-batch's log-probs, advantages and importance ratio."""

    logp: Tensor  # [B, T] current policy, with grad
    old_logp: Tensor  # [B, T] sampling policy
    mask: Tensor  # [B, T] 1 for completion tokens
    valid: Tensor  # [B, T] mask as bool
    advantages: Tensor  # [B]
    adv: Tensor  # [B, 1] in logp's dtype
    log_weights: Tensor  # [B, T], or [B, 1] with importance_sampling_level "sequence"
    ratio: Tensor  # exp(log_weights), same shape


#: ``(inputs, settings) -> (per-token loss, statistics by name)``, each ``[B, T]`` or, per sequence, ``[B, 1]``
PolicyTerm = Callable[[PolicyInputs, LossSettings], tuple[Tensor, dict[str, Tensor]]]
#: ``(masked token losses [B, T], mask [B, T] float, max_completion_length, num_items_in_batch) -> scalar loss``
Normalisation = Callable[[Tensor, Tensor, "int | None", "int | float | Tensor | None"], Tensor]


def clipped_term(x: PolicyInputs, s: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate ``-min(r * A, clamp(r, 1 - epsilon_low, 1 + epsilon_high) * A)``, ``r`` capped at
    ``delta`` when set (INTELLECT-2's two-sided clip, arXiv 2505.07291)."""
    clipped = torch.clamp(x.ratio, 1.0 - s.epsilon_low, 1.0 + s.epsilon_high)  # [B, T] or [B, 1]
    ratio = x.ratio if s.delta is None else torch.clamp(x.ratio, max=s.delta)  # a negative advantage's is capped too
    is_low = (ratio < 1.0 - s.epsilon_low) & (x.adv < 0)  # [B, T] or [B, 1]
    is_high = (ratio > 1.0 + s.epsilon_high) & (x.adv > 0)  # [B, T] or [B, 1]
    stats = {"clip_ratio/low_mean": is_low, "clip_ratio/high_mean": is_high, "clip_ratio/region_mean": is_low | is_high}
    return -torch.min(ratio * x.adv, clipped * x.adv), stats  # [B, T] or [B, 1]


def cispo_term(x: PolicyInputs, s: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO's ``-sg(min(r, epsilon_high)) * A * log p``, sg: no gradient (MiniMax-M1, arXiv 2506.13585)."""
    safe_logp = torch.where(x.valid, x.logp, 0.0)  # [B, T]
    loss = -torch.clamp(x.ratio, max=s.epsilon_high).detach() * x.adv * safe_logp  # [B, T]
    return loss, {"cispo_clip_ratio": (x.ratio > s.epsilon_high) & (x.adv > 0)}


def sapo_term(x: PolicyInputs, s: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO's gate ``-sigmoid(tau * (r - 1)) * 4 / tau * A``, ``tau`` by the sign of ``A`` (arXiv 2511.20347)."""
    pos, neg = (
        torch.tensor(t, dtype=x.logp.dtype, device=x.logp.device)
        for t in (s.sapo_temperature_pos, s.sapo_temperature_neg)
    )  # in logp's dtype: python floats would make tau float32
    tau = torch.where(x.adv > 0, pos, neg)  # [B, 1]
    return -torch.sigmoid(tau * (x.ratio - 1.0)) * 4.0 / tau * x.adv, {}  # [B, T] or [B, 1]


def vespo_term(x: PolicyInputs, s: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO's ``-phi(w) * A * log p`` with ``phi`` the gamma weight of :func:`vespo_weights` (arXiv 2602.10693)."""
    token_log_ratio = (  # VESPO weighs the product of the token ratios whatever the level
        x.log_weights if s.importance_sampling_level == "token" else importance_log_weights(x.logp, x.old_logp, x.mask)
    )  # [B, T]
    phi = vespo_weights(
        x.advantages, token_log_ratio, x.mask,
        k_pos=s.vespo_k_pos, lambda_pos=s.vespo_lambda_pos, k_neg=s.vespo_k_neg, lambda_neg=s.vespo_lambda_neg,
    )  # [B, 1]  # fmt: skip
    return -phi * x.adv * torch.where(x.valid, x.logp, 0.0), {"vespo/phi_seq_mean": phi}  # [B, T]


def per_sequence_mean(loss: Tensor, mask: Tensor, max_completion_length, num_items_in_batch) -> Tensor:
    """Mean over each sequence's tokens, then over sequences (DeepSeekMath): long completions weigh less per token."""
    return (loss.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()


def per_sequence_sum(loss: Tensor, mask: Tensor, max_completion_length, num_items_in_batch) -> Tensor:
    """Sum over each sequence's tokens, then mean over sequences (LUSPO): a sequence weighs with its length."""
    return loss.sum(dim=1).mean()


def batch_tokens(loss: Tensor, mask: Tensor, max_completion_length, num_items_in_batch) -> Tensor:
    """Sum over all tokens / this micro-batch's completion-token count."""
    return loss.sum() / mask.sum().clamp(min=1.0)


def completion_limit(loss: Tensor, mask: Tensor, max_completion_length, num_items_in_batch) -> Tensor:
    """Sum over all tokens / ``(B * max_completion_length)``, a constant, so no length bias (Dr. GRPO)."""
    if max_completion_length is None or max_completion_length < 1:
        raise ValueError(
            f"loss_type='dr_grpo' needs max_completion_length >= 1 (the generation limit), got {max_completion_length}"
        )
    return loss.sum() / (loss.shape[0] * max_completion_length)


def step_tokens(loss: Tensor, mask: Tensor, max_completion_length, num_items_in_batch) -> Tensor:
    """Sum over all tokens / the optimizer step's completion-token count (DAPO); ``None``: this batch's count."""
    if num_items_in_batch is None:
        return batch_tokens(loss, mask, max_completion_length, num_items_in_batch)
    if isinstance(num_items_in_batch, Tensor):
        normaliser = num_items_in_batch.to(device=loss.device, dtype=loss.dtype).clamp(min=1.0)
    else:
        normaliser = max(float(num_items_in_batch), 1.0)
    return loss.sum() / normaliser


POLICY_TERMS: dict[str, PolicyTerm] = {
    "grpo": clipped_term, "bnpo": clipped_term, "dr_grpo": clipped_term, "dapo": clipped_term,
    "cispo": cispo_term, "sapo": sapo_term, "luspo": clipped_term, "vespo": vespo_term,
}  # fmt: skip
NORMALISATIONS: dict[str, Normalisation] = {
    "grpo": per_sequence_mean, "bnpo": batch_tokens, "dr_grpo": completion_limit, "dapo": step_tokens,
    "cispo": step_tokens, "sapo": per_sequence_mean, "luspo": per_sequence_sum, "vespo": step_tokens,
}  # fmt: skip
CLIPPED_LOSS_TYPES: tuple[str, ...] = tuple(t for t in LOSS_TYPES if POLICY_TERMS[t] is clipped_term)
GLOBAL_TOKEN_LOSS_TYPES: tuple[str, ...] = tuple(t for t in LOSS_TYPES if NORMALISATIONS[t] is step_tokens)


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    settings: LossSettings | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: int | float | Tensor | None = None,
    token_mask: Tensor | None = None,
    sampler_weights: Tensor | None = None,
    **options: Any,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO-family loss of one micro-batch: a policy term, optional masks and KL, one normalisation.

    Per token, with ``r`` the importance ratio ``exp(logp - old_logp)`` (or GSPO's per-sequence ratio, arXiv
    2507.18071) and ``A`` the completion's advantage, the policy term is :data:`POLICY_TERMS`'s for the loss type::

        clipped types   -min(r * A, clamp(r, 1 - epsilon_low, 1 + epsilon_high) * A)   r capped at delta if given
        cispo           -sg(min(r, epsilon_high)) * A * logp                          sg: no gradient
        sapo            -sigmoid(tau * (r - 1)) * 4 / tau * A                         tau by the sign of A
        vespo           -sg(phi(w)) * A * logp                                        see vespo_weights

    It is multiplied by ``token_mask``, the off-policy mask and ``sampler_weights`` when given, then ``beta * kl_t`` is
    added, with
    ``kl_t = exp(ref_logp - logp) - (ref_logp - logp) - 1`` (k3, >= 0), times ``r`` when
    ``use_bias_correction_kl``. The masked token sum is then normalised as :data:`NORMALISATIONS` says:

    - ``"grpo"``, ``"sapo"``: mean over each sequence's tokens, then mean over sequences (DeepSeekMath,
      arXiv 2402.03300). Long completions weigh less per token.
    - ``"bnpo"``: sum over all tokens / number of completion tokens in this batch.
    - ``"dr_grpo"``: sum over all tokens / ``(B * max_completion_length)``, a constant, so no length
      bias (Dr. GRPO, arXiv 2503.20783).
    - ``"dapo"``, ``"cispo"``, ``"vespo"``: sum over all tokens / ``num_items_in_batch``, the completion-token
      count of the whole optimizer step (DAPO, arXiv 2503.14476). Summed over the micro-batches of one step, the
      losses then equal one token-level mean over the step. ``None`` uses this batch's count.
    - ``"luspo"``: sum over each sequence's tokens, then mean over sequences (LUSPO, arXiv 2602.05261: a
      sequence's loss grows with its length, undoing GSPO's length bias; meant with
      ``importance_sampling_level="sequence"``).

    For the global-count types the function divides by exactly ``num_items_in_batch``; pass the count that makes
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
        settings: the loss options (:class:`~lit_rl.losses.LossSettings`); ``None``: its defaults.
        max_completion_length: the generation limit ``L``; required for ``"dr_grpo"``.
        num_items_in_batch: completion tokens in the global batch, for the global-count types.
        token_mask: optional ``[B, T]`` bool, the tokens the policy term trains on (:func:`high_entropy_mask`);
            the normalisation still counts every completion token, as in TRL.
        sampler_weights: optional ``[B, T]`` or ``[B, 1]`` importance weights of the sampler against the trainer
            (:func:`lit_rl.losses.sampler_weights`), on the policy term only, as TRL applies its vLLM correction.
        **options: fields of :class:`~lit_rl.losses.LossSettings` by name (``loss_type="dapo", beta=0.04``), which
            replace those of ``settings``.

    Returns:
        ``(loss, stats)``: the scalar loss, and detached python floats. Clipped types: ``"clip_ratio/low_mean"``,
        ``"clip_ratio/high_mean"``, ``"clip_ratio/region_mean"`` (masked token means, or means over sequences
        with ``"sequence"``, of ``r < 1 - epsilon_low and A < 0``, ``r > 1 + epsilon_high and A > 0``, either).
        ``cispo``: ``"cispo_clip_ratio"``; ``vespo``: ``"vespo/phi_seq_mean"``. With ``ref_logp``: ``"kl/mean"``
        (masked token mean of the KL term before ``beta``).

    Raises:
        ValueError: an option :class:`~lit_rl.losses.LossSettings` refuses; ``beta != 0`` without ``ref_logp``;
            ``"dr_grpo"`` without ``max_completion_length``; shapes that do not match.
        TypeError: an option that is not a field of :class:`~lit_rl.losses.LossSettings`.
    """
    s = replace(settings or LossSettings(), **options) if options else settings or LossSettings()
    if s.beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={s.beta} needs reference log-probs: pass ref_logp or set beta=0")
    _check_shapes(logp, old_logp, ref_logp, advantages, mask, token_mask)

    old_logp = logp.detach() if old_logp is None else old_logp  # [B, T]
    valid = mask.bool()  # [B, T]
    # padding may hold -inf or garbage; zero it before exp() so neither the loss nor the gradient sees NaN
    log_weights = importance_log_weights(logp, old_logp, mask, s.importance_sampling_level)  # [B, T] or [B, 1]
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [B, 1]
    x = PolicyInputs(logp, old_logp, mask, valid, advantages, adv, log_weights, torch.exp(log_weights))
    per_token_loss, stats = POLICY_TERMS[s.loss_type](x, s)  # [B, T] or [B, 1]

    if s.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask(advantages, logp, old_logp, mask, s.off_policy_mask_threshold)
    if token_mask is not None:
        per_token_loss = per_token_loss * token_mask.to(logp.dtype)  # [B, T]
    if sampler_weights is not None:
        per_token_loss = per_token_loss * sampler_weights.to(logp.dtype)  # [B, T] or [B, 1]
    if ref_logp is not None:
        log_ref_ratio = torch.where(valid, ref_logp - logp, 0.0)  # [B, T]
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0  # [B, T], k3 >= 0
        if s.use_bias_correction_kl:
            kl = kl * x.ratio  # [B, T]: the ratio carries the gradient even where its value is 1
        if s.beta != 0.0:
            per_token_loss = per_token_loss + s.beta * kl  # [B, T]
        stats["kl/mean"] = kl

    maskf = valid.to(logp.dtype)  # [B, T]
    masked_loss = per_token_loss * maskf  # [B, T] (a per-sequence term broadcasts over its tokens)
    loss = NORMALISATIONS[s.loss_type](masked_loss, maskf, max_completion_length, num_items_in_batch)
    return loss, _means(stats, valid)


def _check_shapes(logp, old_logp, ref_logp, advantages, mask, token_mask) -> None:
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise ValueError(f"logp and mask must both be [B, T], got {tuple(logp.shape)} and {tuple(mask.shape)}")
    for name, other in (("old_logp", old_logp), ("ref_logp", ref_logp), ("token_mask", token_mask)):
        if other is not None and other.shape != logp.shape:
            raise ValueError(f"{name} must have logp's shape {tuple(logp.shape)}, got {tuple(other.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(logp.shape[:1])}, got {tuple(advantages.shape)}")


@torch.no_grad()
def _means(stats: dict[str, Tensor], valid: Tensor) -> dict[str, float]:
    """Each statistic as a float, in one device sync: a per-sequence ``[B, 1]`` one as a mean over sequences, a
    ``[B, T]`` one as a masked token mean."""
    if not stats:
        return {}
    means = [x.float().mean() if x.shape[-1] == 1 else masked_mean(x.float(), valid) for x in stats.values()]
    return dict(zip(stats, torch.stack(means).tolist(), strict=True))
