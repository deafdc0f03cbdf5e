"""The settings of a GRPO-family loss, one dataclass: TRL's ``GRPOConfig`` option names, checked once when built.

A method takes them as one group (``model.init_args.loss`` in a config, ``--model.init_args.loss.<name>`` on the
command line) and :func:`lit_rl.losses.grpo_loss` reads them; a bad value is refused here, in one line that names
the field and the fix, before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from lit_rl.losses.sampler import SAMPLER_CORRECTION_MODES
from lit_rl.losses.terms import IMPORTANCE_SAMPLING_LEVELS

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
ImportanceSamplingLevel = Literal["token", "sequence"]  # IMPORTANCE_SAMPLING_LEVELS, as a type the CLI checks
SamplerCorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@dataclass(frozen=True)
class LossSettings:
    """The options of the loss (``model.init_args.loss``), named as TRL's ``GRPOConfig`` names them.

    The defaults are TRL 1.16's, except ``use_bias_correction_kl`` (off here, on in TRL) and ``epsilon_low``, which is
    TRL's ``epsilon``. A method may default to other values (``RefCachedGRPO``: ``beta`` 0.04); a config that sets
    some fields keeps the method's default for the others.

    Args:
        loss_type: the policy term and its normalisation: ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``cispo``,
            ``sapo``, ``luspo`` or ``vespo``; each is described, with its paper, in :func:`lit_rl.losses.grpo_loss`.
        beta: KL coefficient to the reference. ``beta = 0`` skips the reference pass entirely (no reference memory
            or time); with full fine-tuning ``beta > 0`` also keeps a frozen copy of the weights.
        epsilon_low: lower clip of the ratio, clamped at ``1 - epsilon_low`` (TRL's ``epsilon``).
        epsilon_high: upper clip (DAPO's clip-higher uses 0.28); under ``cispo`` the cap of the importance weight
            itself, which a method then wants above 1 (ScaleRL uses 5.0).
        importance_sampling_level: ``token``, or ``sequence`` for GSPO's one ratio per completion (GSPO uses it with
            ``epsilon_low: 3.0e-4``, ``epsilon_high: 4.0e-4``).
        delta: two-sided clip (INTELLECT-2): the ratio of a negative-advantage token is capped at ``delta`` (> 1);
            ``null`` is off.
        sapo_temperature_pos: SAPO's gate temperature for positive advantages.
        sapo_temperature_neg: SAPO's gate temperature for the other advantages.
        vespo_k_pos: VESPO's gamma-weight exponent for non-negative advantages.
        vespo_lambda_pos: VESPO's gamma-weight decay for non-negative advantages.
        vespo_k_neg: VESPO's gamma-weight exponent for negative advantages.
        vespo_lambda_neg: VESPO's gamma-weight decay for negative advantages.
        use_bias_correction_kl: multiply the KL term by the importance ratio (DeepSeek-V3.2): its gradient is then
            the unbiased reverse-KL gradient. TRL 1.16 turns it on by default; here it is off, so that existing
            configs train as before: set it to ``true`` to match a TRL run with ``beta > 0``.
        off_policy_mask_threshold: with ``num_iterations > 1``, drop negative-advantage completions whose mean KL
            to the sampling policy exceeds this (DeepSeek-V3.2); ``null`` is off.
        top_entropy_quantile: train on this share of each micro-batch's completion tokens, those of highest entropy
            ("Beyond the 80/20 rule" uses 0.2); 1.0 keeps every token. The entropy comes from the same chunked pass
            as the log-probs; under DDP the threshold is taken over every process's tokens.
        entropy_coef: weight of an entropy bonus, the mean entropy of the trained tokens subtracted from the loss.
        importance_sampling_correction: weigh each token's policy term by ``p_trainer / p_sampler``, the sampler's
            own log-probs against the trainer's (:mod:`lit_rl.losses.sampler`); TRL's
            ``vllm_importance_sampling_correction``, which is on there because vLLM samples. Off here by default: the
            sampler is the trained model itself (the gap is logged every step as ``rollout/sampler_*``; under bf16 it
            is not zero: docs/methods.md).
        importance_sampling_mode: ``token_truncate``, ``token_mask``, ``sequence_truncate`` or ``sequence_mask``
            (TRL's ``vllm_importance_sampling_mode`` and its default).
        importance_sampling_clip_min: lower bound of the ratio (TRL's ``vllm_importance_sampling_clip_min``), or
            ``null``.
        importance_sampling_clip_max: upper bound (TRL's ``vllm_importance_sampling_clip_max``, default 3.0), or
            ``null``.

    ``top_entropy_quantile`` and ``entropy_coef`` need the entropies, which the caller of
    :func:`~lit_rl.losses.grpo_loss` has: it passes the mask (:func:`~lit_rl.losses.high_entropy_mask`) and adds
    the bonus (:func:`~lit_rl.losses.entropy_bonus`).

    Raises:
        ValueError: a field outside its range, or ``epsilon_high < epsilon_low``; the message names the field.

    Example::

        model:
          init_args:
            loss: {loss_type: dapo, epsilon_high: 0.28, beta: 0.04}
    """

    loss_type: LossType = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    importance_sampling_level: ImportanceSamplingLevel = "token"
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_bias_correction_kl: bool = False
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    importance_sampling_correction: bool = False
    importance_sampling_mode: SamplerCorrectionMode = "sequence_mask"
    importance_sampling_clip_min: float | None = None
    importance_sampling_clip_max: float | None = 3.0

    def __post_init__(self) -> None:
        # checked here, at parse time, so a bad value is one line naming the field before any model loads
        where = "model.loss."
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"{where}loss_type: {self.loss_type!r} is not one of {LOSS_TYPES}; use one of them")
        if self.beta < 0:
            raise ValueError(f"{where}beta: must be >= 0, got {self.beta}; use 0 to skip the reference pass")
        if not 0.0 <= self.epsilon_low < 1.0:
            raise ValueError(f"{where}epsilon_low: must be in [0, 1), got {self.epsilon_low}; TRL's default is 0.2")
        if self.epsilon_high < self.epsilon_low:
            raise ValueError(
                f"{where}epsilon_high: {self.epsilon_high} < {where}epsilon_low ({self.epsilon_low}); "
                "clip-higher needs epsilon_high >= epsilon_low"
            )
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"{where}importance_sampling_level: {self.importance_sampling_level!r} is not one of "
                f"{IMPORTANCE_SAMPLING_LEVELS}; use token, or sequence for GSPO"
            )
        if self.delta is not None and self.delta <= 1:
            raise ValueError(
                f"{where}delta: must be > 1 (a cap on the ratio, above 1 + epsilon_high), got {self.delta}; "
                "INTELLECT-2 uses 4.0, or null to switch it off"
            )
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"{where}{name}: must be > 0, got {getattr(self, name)}; the SAPO paper uses 1.0 and 1.05"
                )
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold < 0:
            raise ValueError(
                f"{where}off_policy_mask_threshold: must be >= 0, got {self.off_policy_mask_threshold}; "
                "DeepSeek-V3.2 suggests about 0.5, or null to switch it off"
            )
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ValueError(
                f"{where}top_entropy_quantile: must be in [0, 1], got {self.top_entropy_quantile}; 1.0 keeps every "
                "token, 0.2 the highest-entropy fifth"
            )
        if self.entropy_coef < 0:
            raise ValueError(f"{where}entropy_coef: must be >= 0, got {self.entropy_coef}; use 0 for no entropy bonus")
        if self.importance_sampling_mode not in SAMPLER_CORRECTION_MODES:
            raise ValueError(
                f"{where}importance_sampling_mode: {self.importance_sampling_mode!r} is not one of "
                f"{SAMPLER_CORRECTION_MODES}; TRL's default is sequence_mask"
            )
        low, high = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        if (
            (low is not None and low < 0)
            or (high is not None and high <= 0)
            or (None not in (low, high) and low > high)
        ):
            raise ValueError(
                f"{where}importance_sampling_clip_min/_max: [{low}, {high}] is not a range of ratios; use 0 <= min <= max "
                "with max > 0 (TRL: no min, max 3.0), or null for an open side"
            )
        if self.importance_sampling_correction and self.loss_type == "vespo":
            raise ValueError(
                f"{where}importance_sampling_correction: not built for loss_type vespo (which folds the ratio into its "
                "gamma weight); use another loss_type or set it false"
            )
