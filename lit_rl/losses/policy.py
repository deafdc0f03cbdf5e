"""The GRPO-family loss of one micro-batch: the policy term of each loss type, masks, KL and normalisation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lit_rl.losses.terms import (
    IMPORTANCE_SAMPLING_LEVELS,
    importance_log_weights,
    masked_mean,
    off_policy_mask,
    vespo_weights,
)

LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO's clipped surrogate
GLOBAL_TOKEN_LOSS_TYPES: tuple[str, ...] = ("dapo", "cispo", "vespo")  # divided by the optimizer step's token count
# the options of grpo_loss a method takes under the same names (TRL's GRPOConfig names), passed on as they are
POLICY_LOSS_OPTIONS: tuple[str, ...] = (
    "loss_type", "epsilon_low", "epsilon_high", "beta", "importance_sampling_level", "delta",
    "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
    "vespo_lambda_neg", "use_bias_correction_kl", "off_policy_mask_threshold",
)  # fmt: skip


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
    importance_sampling_level: str = "token",
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    use_bias_correction_kl: bool = False,
    off_policy_mask_threshold: float | None = None,
    token_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO-family loss of one micro-batch: a policy term, optional masks and KL, one normalisation.

    Per token, with ``r`` the importance ratio ``exp(logp - old_logp)`` (or GSPO's per-sequence ratio) and
    ``A`` the completion's advantage, the policy term is::

        clipped types   -min(r * A, clamp(r, 1 - epsilon_low, 1 + epsilon_high) * A)   r capped at delta if given
        cispo           -sg(min(r, epsilon_high)) * A * logp                          sg: no gradient
        sapo            -sigmoid(tau * (r - 1)) * 4 / tau * A                         tau by the sign of A
        vespo           -sg(phi(w)) * A * logp                                        see vespo_weights

    It is multiplied by ``token_mask`` and the off-policy mask when given, then ``beta * kl_t`` is added, with
    ``kl_t = exp(ref_logp - logp) - (ref_logp - logp) - 1`` (k3, >= 0), times ``r`` when
    ``use_bias_correction_kl``. The masked token sum is then normalised according to ``loss_type``:

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
        loss_type: one of :data:`LOSS_TYPES`.
        epsilon_low: lower clip, ratio is clamped at ``1 - epsilon_low``.
        epsilon_high: upper clip, ratio is clamped at ``1 + epsilon_high`` (DAPO clip-higher: larger); for
            ``cispo`` the cap of the importance weight itself (ScaleRL, arXiv 2510.13786, uses 5.0).
        beta: KL coefficient; 0 disables the penalty (and no reference pass is needed).
        max_completion_length: the generation limit ``L``; required for ``"dr_grpo"``.
        num_items_in_batch: completion tokens in the global batch, for the global-count types.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO, arXiv 2507.18071).
        delta: INTELLECT-2's two-sided clip (arXiv 2505.07291): the ratio of a negative-advantage token is capped
            at ``delta`` too, so one token cannot dominate the update; ``None`` (default) is off. Above
            ``1 + epsilon_high``.
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for ``A > 0`` and ``A <= 0``.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma weight, see
            :func:`vespo_weights`.
        use_bias_correction_kl: multiply the KL term by the ratio, which makes its gradient the unbiased
            reverse-KL gradient (DeepSeek-V3.2, arXiv 2512.02556); it changes the gradient even on-policy.
        off_policy_mask_threshold: drop negative-advantage completions whose mean KL to the sampling policy
            exceeds this (:func:`off_policy_mask`); ``None`` (default) is off.
        token_mask: optional ``[B, T]`` bool, the tokens the policy term trains on (:func:`high_entropy_mask`);
            the normalisation still counts every completion token, as in TRL.

    Returns:
        ``(loss, stats)``: the scalar loss, and detached python floats. Clipped types: ``"clip_ratio/low_mean"``,
        ``"clip_ratio/high_mean"``, ``"clip_ratio/region_mean"`` (masked token means, or means over sequences
        with ``"sequence"``, of ``r < 1 - epsilon_low and A < 0``, ``r > 1 + epsilon_high and A > 0``, either).
        ``cispo``: ``"cispo_clip_ratio"``; ``vespo``: ``"vespo/phi_seq_mean"``. With ``ref_logp``: ``"kl/mean"``
        (masked token mean of the KL term before ``beta``).

    Raises:
        ValueError: unknown ``loss_type`` or ``importance_sampling_level``; ``epsilon_high < epsilon_low`` or
            ``epsilon_low`` outside ``[0, 1)``; ``delta <= 1``; a SAPO temperature ``<= 0``; ``beta != 0``
            without ``ref_logp``; ``"dr_grpo"`` without ``max_completion_length``; shapes that do not match.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {importance_sampling_level!r}"
        )
    if not 0.0 <= epsilon_low < 1.0:
        raise ValueError(f"epsilon_low must be in [0, 1), got {epsilon_low}")
    if epsilon_high < epsilon_low:
        raise ValueError(f"epsilon_high ({epsilon_high}) must be >= epsilon_low ({epsilon_low})")
    if delta is not None and not delta > 1.0:
        raise ValueError(f"delta must be > 1 (a cap on the ratio above 1 + epsilon_high), got {delta}")
    if min(sapo_temperature_pos, sapo_temperature_neg) <= 0:
        raise ValueError(
            f"sapo temperatures must be > 0, got {sapo_temperature_pos} (positive) and {sapo_temperature_neg}"
        )
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"beta={beta} needs reference log-probs: pass ref_logp or set beta=0")
    if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length < 1):
        raise ValueError(
            f"loss_type='dr_grpo' needs max_completion_length >= 1 (the generation limit), got {max_completion_length}"
        )
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise ValueError(f"logp and mask must both be [B, T], got {tuple(logp.shape)} and {tuple(mask.shape)}")
    for name, other in (("old_logp", old_logp), ("ref_logp", ref_logp), ("token_mask", token_mask)):
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
    log_weights = importance_log_weights(logp, old_logp, mask, importance_sampling_level)  # [B, T] or [B, 1]
    ratio = torch.exp(log_weights)  # [B, T] or [B, 1]

    kl = None
    if ref_logp is not None:
        log_ref_ratio = torch.where(valid, ref_logp - logp, 0.0)  # [B, T]
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0  # [B, T], k3 >= 0
        if use_bias_correction_kl:
            kl = kl * ratio  # [B, T]: the ratio carries the gradient even where its value is 1

    if loss_type == "cispo":
        safe_logp = torch.where(valid, logp, 0.0)  # [B, T]
        per_token_loss = -torch.clamp(ratio, max=epsilon_high).detach() * adv * safe_logp  # [B, T]
    elif loss_type == "sapo":
        pos, neg = (
            torch.tensor(x, dtype=logp.dtype, device=logp.device) for x in (sapo_temperature_pos, sapo_temperature_neg)
        )
        tau = torch.where(adv > 0, pos, neg)  # [B, 1], in logp's dtype (python floats would make it float32)
        per_token_loss = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv  # [B, T] or [B, 1]
    elif loss_type == "vespo":
        token_log_ratio = (  # VESPO weighs the product of the token ratios whatever the level
            log_weights if importance_sampling_level == "token" else importance_log_weights(logp, old_logp, mask)
        )  # [B, T]
        phi = vespo_weights(
            advantages, token_log_ratio, mask,
            k_pos=vespo_k_pos, lambda_pos=vespo_lambda_pos, k_neg=vespo_k_neg, lambda_neg=vespo_lambda_neg,
        )  # [B, 1]  # fmt: skip
        per_token_loss = -phi * adv * torch.where(valid, logp, 0.0)  # [B, T]
    else:
        clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)  # [B, T] or [B, 1]
        if delta is not None:
            ratio = torch.clamp(ratio, max=delta)  # two-sided: a negative advantage's ratio is capped too
        per_token_loss = -torch.min(ratio * adv, clipped * adv)  # [B, T] or [B, 1]

    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask(advantages, logp, old_logp, mask, off_policy_mask_threshold)
    if token_mask is not None:
        per_token_loss = per_token_loss * token_mask.to(logp.dtype)  # [B, T]
    if kl is not None and beta != 0.0:
        per_token_loss = per_token_loss + beta * kl  # [B, T]

    masked_loss = per_token_loss * maskf  # [B, T] (a per-sequence term broadcasts over its tokens)
    if loss_type in ("grpo", "sapo"):
        seq_loss = masked_loss.sum(dim=1) / maskf.sum(dim=1).clamp(min=1.0)  # [B]
        loss = seq_loss.mean()
    elif loss_type == "luspo":
        loss = masked_loss.sum(dim=1).mean()
    elif loss_type == "dr_grpo":
        loss = masked_loss.sum() / (logp.shape[0] * max_completion_length)
    elif loss_type == "bnpo" or num_items_in_batch is None:
        loss = masked_loss.sum() / maskf.sum().clamp(min=1.0)
    else:  # dapo, cispo, vespo with a global token count
        if isinstance(num_items_in_batch, Tensor):
            normaliser = num_items_in_batch.to(device=logp.device, dtype=logp.dtype).clamp(min=1.0)
        else:
            normaliser = max(float(num_items_in_batch), 1.0)
        loss = masked_loss.sum() / normaliser

    with torch.no_grad():
        names: list[str] = []
        values: list[Tensor] = []

        def add(name: str, x: Tensor) -> None:  # a per-sequence [B, 1] value is a mean over sequences
            names.append(name)
            values.append(x.float().mean() if x.shape[-1] == 1 else masked_mean(x.float(), valid))

        if loss_type in CLIPPED_LOSS_TYPES:
            is_low = (ratio < 1.0 - epsilon_low) & (adv < 0)  # [B, T] or [B, 1]
            is_high = (ratio > 1.0 + epsilon_high) & (adv > 0)  # [B, T] or [B, 1]
            add("clip_ratio/low_mean", is_low)
            add("clip_ratio/high_mean", is_high)
            add("clip_ratio/region_mean", is_low | is_high)
        elif loss_type == "cispo":
            add("cispo_clip_ratio", (ratio > epsilon_high) & (adv > 0))
        elif loss_type == "vespo":
            add("vespo/phi_seq_mean", phi)
        if kl is not None:
            add("kl/mean", kl)
        stats = dict(zip(names, torch.stack(values).tolist(), strict=True)) if names else {}  # one device sync
    return loss, stats


def check_loss_settings(settings: Mapping[str, Any], prefix: str = "") -> None:
    """Refuse, in one line naming the setting and the fix, loss options that cannot work (before any step runs).

    Args:
        settings: the loss options by name (``loss_type``, ``epsilon_low``, ``epsilon_high``,
            ``importance_sampling_level``, ``delta``, ``sapo_temperature_pos``, ``sapo_temperature_neg``,
            ``top_entropy_quantile``, ``entropy_coef``, ``off_policy_mask_threshold``), e.g. a method's hparams.
        prefix: put before each name in the message (``"model."`` for a config's ``model.init_args``).

    Raises:
        ValueError: the first setting that cannot work.
    """
    hp = settings
    if hp["loss_type"] not in LOSS_TYPES:
        raise ValueError(f"{prefix}loss_type: {hp['loss_type']!r} is not one of {LOSS_TYPES}; use one of them")
    if hp["epsilon_high"] < hp["epsilon_low"]:
        raise ValueError(
            f"{prefix}epsilon_high: {hp['epsilon_high']} < {prefix}epsilon_low ({hp['epsilon_low']}); "
            "clip-higher needs epsilon_high >= epsilon_low"
        )
    if hp["importance_sampling_level"] not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"{prefix}importance_sampling_level: {hp['importance_sampling_level']!r} is not one of "
            f"{IMPORTANCE_SAMPLING_LEVELS}; use token, or sequence for GSPO"
        )
    if hp["loss_type"] == "cispo" and hp["epsilon_high"] <= 1:
        raise ValueError(
            f"{prefix}epsilon_high: {hp['epsilon_high']} under loss_type cispo caps the importance weight itself, so "
            f"every token would weigh at most {hp['epsilon_high']}; set it above 1 (ScaleRL uses 5.0)"
        )
    if hp["delta"] is not None and hp["delta"] <= 1:
        raise ValueError(
            f"{prefix}delta: must be > 1 (a cap on the ratio, above 1 + epsilon_high), got {hp['delta']}; "
            "INTELLECT-2 uses 4.0, or null to switch it off"
        )
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if hp[name] <= 0:
            raise ValueError(f"{prefix}{name}: must be > 0, got {hp[name]}; the SAPO paper uses 1.0 and 1.05")
    if not 0 <= hp["top_entropy_quantile"] <= 1:
        raise ValueError(
            f"{prefix}top_entropy_quantile: must be in [0, 1], got {hp['top_entropy_quantile']}; 1.0 keeps every "
            "token, 0.2 the highest-entropy fifth"
        )
    if hp["entropy_coef"] < 0:
        raise ValueError(f"{prefix}entropy_coef: must be >= 0, got {hp['entropy_coef']}; use 0 for no entropy bonus")
    if hp["off_policy_mask_threshold"] is not None and hp["off_policy_mask_threshold"] < 0:
        raise ValueError(
            f"{prefix}off_policy_mask_threshold: must be >= 0, got {hp['off_policy_mask_threshold']}; "
            "DeepSeek-V3.2 suggests about 0.5, or null to switch it off"
        )
