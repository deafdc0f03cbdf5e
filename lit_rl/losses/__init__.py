"""GRPO-family policy losses and group-relative advantages, as plain functions.

What is here and where it comes from:

- :func:`group_advantages`: ``(r - mean_group) / (std_group + eps)`` from DeepSeekMath (GRPO,
  arXiv 2402.03300), with ``scale_rewards="none"`` dropping the division as Dr. GRPO recommends
  (arXiv 2503.20783) and ``"batch"`` dividing by the whole batch's std.
- :func:`grpo_loss`: the policy-gradient surrogate of one micro-batch. Its parts, each optional:

  - the **policy term**, chosen by ``loss_type`` in the table :data:`POLICY_TERMS`: PPO's clipped surrogate
    with GRPO's group advantages (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``), asymmetric clipping
    (DAPO's clip-higher, arXiv 2503.14476) and INTELLECT-2's two-sided clip ``delta`` (arXiv 2505.07291);
    CISPO's clipped, detached importance weight times ``log p`` (MiniMax-M1, arXiv 2506.13585); SAPO's sigmoid
    gate (arXiv 2511.20347); VESPO's gamma weight of the sequence ratio (arXiv 2602.10693);
  - the **importance ratio** per token or, GSPO's (arXiv 2507.18071), one per sequence: the geometric mean
    of its tokens' ratios (:func:`importance_log_weights`);
  - **token masks** on the policy term: the top-entropy tokens only ("Beyond the 80/20 rule",
    arXiv 2506.01939; :func:`high_entropy_mask`) and DeepSeek-V3.2's off-policy sequence mask
    (arXiv 2512.02556; :func:`off_policy_mask`);
  - the ``beta * k3`` **KL penalty** to a reference policy (Schulman, "Approximating KL divergence",
    2020), optionally multiplied by the importance ratio so its gradient is the unbiased reverse-KL
    gradient (DeepSeek-V3.2);
  - the **normalisation** of the token sum, which ``loss_type`` also sets (the table :data:`NORMALISATIONS`):
    per-sequence mean then mean (``grpo``, ``sapo``), this micro-batch's token count (``bnpo``),
    ``B * max_completion_length`` (``dr_grpo``), the whole optimizer step's token count (``dapo``, ``cispo``,
    ``vespo``), or per-sequence sum then mean (``luspo``, arXiv 2602.05261).
- :class:`LossSettings`: every option above (and the entropy options below) as one dataclass, checked once when
  built; a method takes it as its ``loss`` group (``model.init_args.loss`` in a config).
- :func:`entropy_bonus`: the mean entropy an ``entropy_coef`` rewards (Skywork-OR1, arXiv 2505.22312,
  uses such a bonus).
- :func:`sampler_weights` and :func:`sampler_mismatch` (:mod:`lit_rl.losses.sampler`): the sampler's log-probs
  against the trainer's, the truncated or masked importance weights that correct for the gap (TRL's vLLM
  correction, its modes and bounds) and the gap a run logs every step.

Every option is named as TRL's ``GRPOConfig`` names it and computes what TRL 1.16's ``GRPOTrainer``
computes; ``tests/test_losses_trl.py`` runs TRL's own loss on the same tensors, option by option, and
``docs/methods.md`` maps each ``GRPOConfig`` loss option to ours.

How this differs from the papers and from TRL:

- The KL term is added per token *inside* the normalisation (as in TRL), not as a separate
  sequence-level term.
- Padding positions are zeroed before ``exp`` (and before ``log p`` is multiplied, for ``cispo`` and
  ``vespo``) so garbage (``-inf``) there can never turn into ``NaN`` in the loss or its gradient;
  denominators are clamped to at least 1 so an all-padding sequence or batch gives a zero loss, not ``NaN``.
- The entropy quantile is taken without a device sync or a data-dependent shape (a sort with the
  padding last), so the memory estimator runs it on fake tensors; the value is ``torch.quantile``'s.
- Gradient accumulation is the caller's business: these functions never divide by a number of
  micro-batches (see :func:`grpo_loss` for what to pass for ``dapo``).
"""

from lit_rl.losses.advantages import SCALE_REWARDS, frac_zero_std, group_advantages
from lit_rl.losses.policy import CLIPPED_LOSS_TYPES, GLOBAL_TOKEN_LOSS_TYPES, NORMALISATIONS, POLICY_TERMS, grpo_loss
from lit_rl.losses.sampler import SAMPLER_CORRECTION_MODES, sampler_mismatch, sampler_weights
from lit_rl.losses.settings import LOSS_TYPES, LossSettings
from lit_rl.losses.terms import (
    IMPORTANCE_SAMPLING_LEVELS,
    entropy_bonus,
    high_entropy_mask,
    importance_log_weights,
    masked_mean,
    masked_quantile,
    off_policy_mask,
    vespo_weights,
)

__all__ = [
    "CLIPPED_LOSS_TYPES",
    "GLOBAL_TOKEN_LOSS_TYPES",
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_TYPES",
    "NORMALISATIONS",
    "POLICY_TERMS",
    "SAMPLER_CORRECTION_MODES",
    "SCALE_REWARDS",
    "LossSettings",
    "entropy_bonus",
    "frac_zero_std",
    "group_advantages",
    "grpo_loss",
    "high_entropy_mask",
    "importance_log_weights",
    "masked_mean",
    "masked_quantile",
    "off_policy_mask",
    "sampler_mismatch",
    "sampler_weights",
    "vespo_weights",
]
