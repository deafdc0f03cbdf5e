"""Intuitor: RL from internal feedback, the reward is the policy's own self-certainty.

INTUITOR (Zhao et al., "Learning to Reason without External Rewards", arXiv 2505.19590) runs GRPO
with the reward of a completion replaced by its self-certainty: the mean over its tokens of
KL(U ‖ p), how far the next-token distribution is from uniform. The paper's configuration uses a
KL coefficient of 0.005 to the reference.

How this implementation differs from the reference code, and why:

- Self-certainty comes from :func:`lit_rl.ops.token_stats` in the same chunked pass as the
  log-probs, never from ``[B, T, V]`` logits. Full logits and their gradient would grow with batch x
  length x vocabulary (``lit-rl estimate`` shows the difference for a config); here the reward costs one
  no-grad forward, like a reference pass, and the update is exactly GRPO's.
- It is computed once per rollout batch, without gradient, as a reward (the paper's formulation);
  with ``num_iterations > 1`` the same pass also gives the old log-probs.
- Positions are aligned to the completion tokens: the logits at position ``t`` predict token
  ``t + 1``, so the completion's ``C`` tokens are scored by positions ``P - 1 .. P + C - 2``. The
  open-r1 Intuitor code is off by one here and ignores the sampling temperature; we scale the
  logits by ``temperature`` as for the log-probs.
- External rewards can be added (``reward_funcs`` with ``reward_weights``) and ``metric_funcs``
  are logged but never rewarded, e.g. arithmetic accuracy to see whether self-certainty helps.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from lit_rl.losses import LossSettings, masked_mean
from lit_rl.memory.rollout import StepWork
from lit_rl.methods.grpo import RefCachedGRPO, Rollout


class Intuitor(RefCachedGRPO):
    """GRPO whose reward is self-certainty (plus optional weighted external rewards).

    **Phases**: those of :class:`RefCachedGRPO`; self-certainty is computed in ``reference``.

    **Logged Metrics**: everything :class:`RefCachedGRPO` logs, plus ``self_certainty/mean``,
    ``self_certainty/std`` (over completions) and ``metric/<function>/mean`` for each ``metric_funcs``.

    Args:
        self_certainty_weight: weight of self-certainty in the reward.
        reward_funcs: optional external rewards (import paths), added with ``reward_weights``; none by default.
        loss: the loss options as in :class:`RefCachedGRPO`; ``loss.beta``, the KL coefficient to the reference,
            defaults to 0.005 in the paper's configuration and here.
        **kwargs: everything else as in :class:`RefCachedGRPO` (``metric_funcs`` are logged, never rewarded).

    Example::

        lit-rl fit --config configs/intuitor.yaml
    """

    def __init__(
        self,
        self_certainty_weight: float = 1.0,
        reward_funcs: list[str] | None = None,
        loss: LossSettings = LossSettings(beta=0.005),
        **kwargs: Any,
    ) -> None:
        super().__init__(reward_funcs=reward_funcs if reward_funcs is not None else [], loss=loss, **kwargs)
        if self_certainty_weight == 0 and not self.reward_fns:
            raise ValueError(
                "model.self_certainty_weight: is 0 and there are no reward_funcs, so nothing is rewarded; "
                "set a positive weight or add reward_funcs"
            )

    def step_work(self) -> StepWork:
        # self-certainty needs a policy pass over the rollout every step; it gives the old log-probs too
        return replace(super().step_work(), scoring_passes=1)

    @torch.no_grad()
    def score_rollout(self, rollout: Rollout) -> dict[str, float]:
        """Reference log-probs, then self-certainty (and old log-probs) from one policy pass: phase ``reference``."""
        hp = self.hparams
        with self.phases("reference"):
            if self.needs_reference:
                rollout.ref_logp = self.reference_logp(rollout)
            old_logp, certainty = self.micro_batched_stats(self.policy, rollout, self_certainty=True)  # [B*G, C] x2
            if hp.num_iterations > 1:
                rollout.old_logp = old_logp
            per_completion = masked_mean(certainty, rollout.completion_mask, dim=1)  # [B*G]
            rollout.rewards = rollout.rewards + hp.self_certainty_weight * per_completion
        return {"self_certainty/mean": per_completion.mean().item(), "self_certainty/std": per_completion.std().item()}
