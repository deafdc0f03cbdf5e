"""Intuitor: self-certainty rewards aligned to the completion tokens, at the sampling temperature."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lit_rl.data import PromptDataModule
from lit_rl.losses import LossSettings
from lit_rl.methods import Intuitor
from lit_rl.methods.grpo import Rollout


def constant_one(completions, **_):
    return [1.0] * len(completions)


def _method(**kw) -> Intuitor:
    args = dict(name_or_path="tiny:llama", num_generations=2, max_new_tokens=5, learning_rate=1e-2)
    args.update(kw)
    method = Intuitor(**args)
    method.setup("fit")
    method.configure_model()
    return method


def _full_logits_self_certainty(model, ids, mask, prompt, completion_mask, temperature):
    """Float64 reference: mean over completion tokens of logsumexp(z) - mean(z) - log V, z at the position before."""
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    z = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits.double() / temperature
    z = z[:, prompt - 1 : -1]  # position t predicts token t + 1
    per_token = torch.logsumexp(z, -1) - z.mean(-1) - math.log(z.shape[-1])
    return (per_token * completion_mask).sum(1) / completion_mask.sum(1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_self_certainty_reward_matches_full_logits_reference(temperature):
    method = _method(
        temperature=temperature,
        reward_funcs=["test_intuitor.constant_one"],
        reward_weights=[0.5],
        self_certainty_weight=2.0,
        loss=LossSettings(beta=0.0),
    )
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (4, 10))
    ids[1::2, :6] = ids[::2, :6]  # two groups of two completions, each sharing its prompt
    mask = torch.ones_like(ids)
    mask[:2, :2] = 0  # the first group's prompt is left-padded
    completion_mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
    rollout = Rollout(ids, mask, completion_mask, 6, torch.full((4,), 0.5), torch.zeros(4))
    metrics = method.score_rollout(rollout)
    expected = _full_logits_self_certainty(method.policy, ids, mask, 6, completion_mask, temperature)
    torch.testing.assert_close(rollout.rewards.double(), 0.5 + 2.0 * expected, atol=1e-5, rtol=1e-5)
    assert metrics["self_certainty/mean"] == pytest.approx(expected.mean().item(), abs=1e-5)


def test_old_log_probs_come_from_the_same_pass():
    method = _method(num_iterations=2, loss=LossSettings(beta=0.0))
    ids = torch.randint(3, 90, (2, 8))
    ids[1, :5] = ids[0, :5]  # one group: two completions of one prompt
    rollout = Rollout(ids, torch.ones_like(ids), torch.ones(2, 3), 5, torch.zeros(2), torch.zeros(2))
    method.score_rollout(rollout)
    expected = method.completion_stats(method.policy, ids, torch.ones_like(ids), 5, temperature=1.0).logp
    torch.testing.assert_close(rollout.old_logp, expected)


def test_training_logs_self_certainty_and_accuracy_without_rewarding_it(capture_logger):
    method = Intuitor(
        name_or_path="tiny:llama",
        num_generations=4,
        max_new_tokens=6,
        learning_rate=1e-2,
        metric_funcs=["lit_rl.data.rewards.correct_answer"],
    )
    method.setup("fit")
    method.configure_model()
    before = {n: p.detach().clone() for n, p in method.policy.named_parameters()}
    trainer = L.Trainer(
        max_steps=2,
        logger=capture_logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(method, PromptDataModule(num_prompts=8, batch_size=2))
    logged = capture_logger.metrics
    for key in ("self_certainty/mean", "self_certainty/std", "metric/correct_answer/mean", "reward/mean", "kl/mean"):
        assert key in logged, key
    assert "reward/correct_answer/mean" not in logged, "accuracy is monitored, not rewarded"
    # the reward is the self-certainty alone (no external rewards): same mean
    for (_, reward), (_, certainty) in zip(logged["reward/mean"], logged["self_certainty/mean"]):
        assert reward == pytest.approx(certainty, rel=1e-5)
    assert any(not torch.equal(p, before[n]) for n, p in method.policy.named_parameters())


def test_nothing_to_learn_from_is_refused():
    with pytest.raises(ValueError, match="self_certainty_weight: is 0 and there are no reward_funcs"):
        Intuitor(name_or_path="tiny:llama", self_certainty_weight=0.0)
