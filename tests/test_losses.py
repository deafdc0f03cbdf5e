"""Tests for lit_rl.losses: expected values are written out by hand, not recomputed by the same formula."""

from __future__ import annotations

import math

import pytest
import torch

from lit_rl.losses import (
    CLIPPED_LOSS_TYPES,
    LOSS_TYPES,
    NORMALISATIONS,
    POLICY_TERMS,
    LossSettings,
    frac_zero_std,
    group_advantages,
    grpo_loss,
    masked_mean,
)

# ---------------------------------------------------------------------------------------------
# A small explicit example, B=2, T=3, the first sequence padded by one token.
#
#   ratios  seq0: 1.1, 1.5, (pad)     A0 = +1.0
#           seq1: 0.7, 1.0, 0.9       A1 = -0.5
#   eps_low = eps_high = 0.2, so the ratio is clamped to [0.8, 1.2]
#
#   per-token loss = -min(r * A, clamp(r) * A)
#     seq0 t0: -min(1.1, 1.1)                 = -1.1
#     seq0 t1: -min(1.5, 1.2)                 = -1.2   (high-clipped: r > 1.2, A > 0)
#     seq1 t0: -min(-0.35, 0.8 * -0.5 = -0.4) = +0.4   (low-clipped: r < 0.8, A < 0)
#     seq1 t1: -min(-0.5, -0.5)               = +0.5
#     seq1 t2: -min(-0.45, -0.45)             = +0.45
#   token sum = -2.3 + 1.35 = -0.95, 5 completion tokens
# ---------------------------------------------------------------------------------------------

MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([1.0, -0.5])
OLD = torch.tensor([[-1.0, -2.0, -5.0], [-0.5, -1.5, -3.0]])
# the padded position holds garbage (ratio e^10) that must not leak into the loss
LOGP = OLD + torch.tensor([[math.log(1.1), math.log(1.5), 10.0], [math.log(0.7), 0.0, math.log(0.9)]])

EXPECTED = {
    "grpo": ((-1.1 - 1.2) / 2 + (0.4 + 0.5 + 0.45) / 3) / 2,  # per-sequence means -1.15, 0.45
    "bnpo": -0.95 / 5,
    "dr_grpo": -0.95 / (2 * 4),  # max_completion_length = 4
    "dapo": -0.95 / 10,  # num_items_in_batch = 10 (this micro-batch is half of a larger step)
    "luspo": (-2.3 + 1.35) / 2,  # per-sequence sums, then their mean
}
KWARGS = {"grpo": {}, "bnpo": {}, "dr_grpo": {"max_completion_length": 4}, "dapo": {"num_items_in_batch": 10}}
KWARGS.update({name: {} for name in LOSS_TYPES if name not in KWARGS})  # the other types' own tests: test_loss_options


def _example(loss_type: str, **overrides):
    logp = LOGP.clone().requires_grad_(True)
    kwargs = {"loss_type": loss_type, "epsilon_low": 0.2, "epsilon_high": 0.2, **KWARGS[loss_type], **overrides}
    loss, stats = grpo_loss(logp, OLD, None, ADV, MASK, **kwargs)
    return logp, loss, stats


@pytest.mark.parametrize("loss_type", CLIPPED_LOSS_TYPES)
def test_hand_computed_loss(loss_type):
    _, loss, stats = _example(loss_type)
    assert loss.item() == pytest.approx(EXPECTED[loss_type], rel=1e-5)
    assert stats == pytest.approx(
        {"clip_ratio/low_mean": 1 / 5, "clip_ratio/high_mean": 1 / 5, "clip_ratio/region_mean": 2 / 5}
    )
    assert "kl/mean" not in stats


def test_hand_computed_gradient_bnpo():
    # d(-r*A)/d logp = -r*A where unclipped, 0 where the clipped branch is the min; then / 5 tokens
    logp, loss, _ = _example("bnpo")
    loss.backward()
    expected = torch.tensor([[-1.1 * 1.0 / 5, 0.0, 0.0], [0.0, -1.0 * -0.5 / 5, -0.9 * -0.5 / 5]])
    torch.testing.assert_close(logp.grad, expected)


def test_dapo_without_global_count_is_bnpo():
    _, dapo, _ = _example("dapo", num_items_in_batch=None)
    assert dapo.item() == pytest.approx(EXPECTED["bnpo"], rel=1e-5)


def test_dapo_accepts_tensor_count():
    _, loss, _ = _example("dapo", num_items_in_batch=torch.tensor(10))
    assert loss.item() == pytest.approx(EXPECTED["dapo"], rel=1e-5)


# ---------------------------------------------------------------------------------------------
# On-policy (old_logp=None): ratio == 1, loss == -(token sum of A) / normaliser, grad == -A / normaliser
# ---------------------------------------------------------------------------------------------

ON_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
ON_ADV = torch.tensor([0.5, -2.0, 1.0])
# completion lengths 3, 1, 4; 8 tokens; token sum of A = 3*0.5 + 1*(-2.0) + 4*1.0 = 3.5
ON_EXPECTED_LOSS = {
    "grpo": -(0.5 - 2.0 + 1.0) / 3,  # each sequence's mean is its A
    "bnpo": -3.5 / 8,
    "dr_grpo": -3.5 / (3 * 5),  # max_completion_length = 5
    "dapo": -3.5 / 16,  # num_items_in_batch = 16
    "luspo": -(3 * 0.5 + 1 * -2.0 + 4 * 1.0) / 3,  # each sequence's sum is its length times A
}
# per-token gradient factor: d loss / d logp[i, t] = -A_i * factor_i on completion tokens
ON_FACTOR = {
    "grpo": [1 / (3 * 3), 1 / (3 * 1), 1 / (3 * 4)],
    "bnpo": [1 / 8] * 3,
    "dr_grpo": [1 / 15] * 3,
    "dapo": [1 / 16] * 3,
    "luspo": [1 / 3] * 3,
}
ON_KWARGS = {"grpo": {}, "bnpo": {}, "dr_grpo": {"max_completion_length": 5}, "dapo": {"num_items_in_batch": 16}}
ON_KWARGS["luspo"] = {}


@pytest.mark.parametrize("loss_type", CLIPPED_LOSS_TYPES)
def test_on_policy_value_and_gradient(loss_type):
    logp = torch.randn(3, 4).requires_grad_(True)
    loss, stats = grpo_loss(logp, None, None, ON_ADV, ON_MASK, loss_type=loss_type, **ON_KWARGS[loss_type])
    assert loss.item() == pytest.approx(ON_EXPECTED_LOSS[loss_type], rel=1e-5)
    loss.backward()
    expected = torch.zeros(3, 4)
    for i, (a, factor) in enumerate(zip(ON_ADV.tolist(), ON_FACTOR[loss_type], strict=True)):
        for t in range(4):
            if ON_MASK[i, t]:
                expected[i, t] = -a * factor
    torch.testing.assert_close(logp.grad, expected)
    assert stats["clip_ratio/region_mean"] == 0.0


# ---------------------------------------------------------------------------------------------
# Clipping
# ---------------------------------------------------------------------------------------------


def _one_token(ratio: float, advantage: float, epsilon_low: float = 0.2, epsilon_high: float = 0.2):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = grpo_loss(
        logp,
        torch.zeros(1, 1),
        None,
        torch.tensor([advantage]),
        torch.ones(1, 1),
        loss_type="bnpo",
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
    )
    loss.backward()
    return loss.item(), logp.grad.item(), stats


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "grad", "low", "high"),
    [
        (1.5, 2.0, -2.4, 0.0, 0.0, 1.0),  # too likely, A > 0: clamped at 1.2, no further push up
        (0.5, -2.0, 1.6, 0.0, 1.0, 0.0),  # too unlikely, A < 0: clamped at 0.8, no further push down
        (1.5, -2.0, 3.0, 3.0, 0.0, 0.0),  # too likely but A < 0: unclipped, gradient -r*A = 3 pulls it back
        (0.5, 2.0, -1.0, -1.0, 0.0, 0.0),  # too unlikely but A > 0: unclipped, gradient -r*A = -1
        (1.1, 2.0, -2.2, -2.2, 0.0, 0.0),  # inside the trust region
    ],
)
def test_clipping_gradient_and_stats(ratio, advantage, loss, grad, low, high):
    got_loss, got_grad, stats = _one_token(ratio, advantage)
    assert got_loss == pytest.approx(loss, rel=1e-5)
    assert got_grad == pytest.approx(grad, rel=1e-5, abs=1e-7)
    assert stats["clip_ratio/low_mean"] == low
    assert stats["clip_ratio/high_mean"] == high
    assert stats["clip_ratio/region_mean"] == max(low, high)


def test_asymmetric_epsilon_clip_higher():
    # DAPO clip-higher: with epsilon_high = 0.28 a ratio of 1.25 is still inside the region ...
    loss, grad, stats = _one_token(1.25, 1.0, epsilon_low=0.2, epsilon_high=0.28)
    assert (loss, grad) == (pytest.approx(-1.25), pytest.approx(-1.25))
    assert stats["clip_ratio/high_mean"] == 0.0
    # ... but clipped at 1.2 with the symmetric default
    loss, grad, stats = _one_token(1.25, 1.0)
    assert (loss, grad) == (pytest.approx(-1.2), 0.0)
    assert stats["clip_ratio/high_mean"] == 1.0
    # the lower bound still comes from epsilon_low = 0.2 only: 0.75 < 0.8 is clipped, 0.85 is not
    loss, grad, stats = _one_token(0.75, -1.0, epsilon_low=0.2, epsilon_high=0.28)
    assert (loss, grad, stats["clip_ratio/low_mean"]) == (pytest.approx(0.8), 0.0, 1.0)
    loss, grad, stats = _one_token(0.85, -1.0, epsilon_low=0.2, epsilon_high=0.28)
    assert (loss, grad, stats["clip_ratio/low_mean"]) == (pytest.approx(0.85), pytest.approx(0.85), 0.0)


# ---------------------------------------------------------------------------------------------
# KL (k3)
# ---------------------------------------------------------------------------------------------


def test_k3_kl_hand_values():
    # d = ref - logp; kl = e^d - d - 1
    #   d = -ln 2: 0.5 - (-0.693147) - 1 = 0.193147
    #   d = +ln 2: 2.0 - 0.693147 - 1    = 0.306853
    #   d = 0:     0
    logp = torch.tensor([[math.log(0.5), math.log(0.5), -1.0, 7.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(1.0), -1.0, -7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    kl_tokens = [0.5 + math.log(2) - 1, 2.0 - math.log(2) - 1, 0.0]
    # on-policy with A = 0, the surrogate is 0 and the loss is beta * mean kl (bnpo)
    loss, stats = grpo_loss(logp, None, ref, torch.zeros(1), mask, loss_type="bnpo", beta=0.1)
    assert stats["kl/mean"] == pytest.approx(sum(kl_tokens) / 3, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * sum(kl_tokens) / 3, rel=1e-5)
    # d kl / d logp = 1 - e^d: 1 - 0.5, 1 - 2, 0, and nothing for the padded token
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.1 * 0.5 / 3, 0.1 * -1.0 / 3, 0.0, 0.0]]))


def test_k3_kl_is_nonnegative():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(8, 16, generator=gen) * 3
    ref = torch.randn(8, 16, generator=gen) * 3
    _, stats = grpo_loss(logp, None, ref, torch.zeros(8), torch.ones(8, 16), beta=1.0)
    assert stats["kl/mean"] > 0
    # every token's kl >= 0: with A = 0, bnpo loss per token is beta * kl; check each one
    for i in range(8):
        for t in range(16):
            mask = torch.zeros(8, 16)
            mask[i, t] = 1
            loss, _ = grpo_loss(logp, None, ref, torch.zeros(8), mask, loss_type="bnpo", beta=1.0)
            assert loss.item() >= 0.0


def test_kl_stat_reported_with_ref_even_when_beta_zero():
    logp = torch.zeros(1, 2)
    _, stats = grpo_loss(logp, None, torch.full((1, 2), math.log(2)), torch.ones(1), torch.ones(1, 2), beta=0.0)
    assert stats["kl/mean"] == pytest.approx(2.0 - math.log(2) - 1)


def test_beta_zero_without_reference_works():
    logp = torch.randn(2, 3, requires_grad=True)
    loss, stats = grpo_loss(logp, None, None, ADV, MASK, beta=0.0)
    loss.backward()
    assert torch.isfinite(loss)
    assert set(stats) == {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}


def test_beta_without_reference_raises():
    with pytest.raises(ValueError, match="pass ref_logp or set beta=0"):
        grpo_loss(torch.zeros(2, 3), None, None, ADV, MASK, beta=0.04)


# ---------------------------------------------------------------------------------------------
# DAPO across micro-batches
# ---------------------------------------------------------------------------------------------


def test_dapo_micro_batches_sum_to_token_mean_of_the_step():
    # Identity: sum_k (S_k / N) == (sum_k S_k) / N == bnpo(concatenation), where S_k is micro-batch
    # k's masked token sum and N the tokens of all micro-batches. It holds for any completion lengths
    # (only T must match to concatenate); the lengths here differ on purpose.
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 5, generator=gen).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(4, 5, generator=gen)
    ref = logp.detach() + 0.3 * torch.randn(4, 5, generator=gen)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.25])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    n_tokens = int(mask.sum())  # 11: 7 in the first micro-batch, 4 in the second
    kw = {"epsilon_low": 0.2, "epsilon_high": 0.28, "beta": 0.04}

    whole, _ = grpo_loss(logp, old, ref, adv, mask, loss_type="bnpo", **kw)
    (grad_whole,) = torch.autograd.grad(whole, logp)

    parts = [
        grpo_loss(logp[s], old[s], ref[s], adv[s], mask[s], loss_type="dapo", num_items_in_batch=n_tokens, **kw)[0]
        for s in (slice(0, 2), slice(2, 4))
    ]
    (grad_parts,) = torch.autograd.grad(parts[0] + parts[1], logp)
    torch.testing.assert_close(parts[0] + parts[1], whole)
    torch.testing.assert_close(grad_parts, grad_whole)

    # whereas averaging per-micro-batch bnpo losses weighs the 4 tokens of the second like the 7 of the first
    bnpo_parts = [
        grpo_loss(logp[s], old[s], ref[s], adv[s], mask[s], loss_type="bnpo", **kw)[0]
        for s in (slice(0, 2), slice(2, 4))
    ]
    assert not torch.allclose((bnpo_parts[0] + bnpo_parts[1]) / 2, whole)


# ---------------------------------------------------------------------------------------------
# Padding and empty sequences
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_empty_sequence_and_inf_padding_give_no_nan(loss_type):
    logp = torch.tensor([[-1.0, -2.0], [-float("inf"), -float("inf")]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0], [-3.0, -float("inf")]])
    ref = torch.tensor([[-1.5, -2.0], [-float("inf"), 0.0]])
    mask = torch.tensor([[1, 1], [0, 0]])  # the second completion has no tokens at all
    loss, stats = grpo_loss(
        logp, old, ref, torch.tensor([1.0, 1.0]), mask, loss_type=loss_type, beta=0.1, **KWARGS[loss_type]
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[1] == 0).all()
    assert all(math.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_padding_batch_gives_zero_loss(loss_type):
    kwargs = {**KWARGS[loss_type], **({"num_items_in_batch": 0} if loss_type == "dapo" else {})}
    logp = torch.randn(2, 3, requires_grad=True)
    loss, stats = grpo_loss(logp, None, None, ADV, torch.zeros(2, 3), loss_type=loss_type, **kwargs)
    assert loss.item() == 0.0
    assert all(math.isfinite(v) for v in stats.values())
    if loss_type in CLIPPED_LOSS_TYPES:
        assert stats["clip_ratio/region_mean"] == 0.0


def test_bool_mask_equals_int_mask():
    a, _ = grpo_loss(LOGP, OLD, None, ADV, MASK)
    b, _ = grpo_loss(LOGP, OLD, None, ADV, MASK.bool())
    assert a.item() == b.item()


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "ppo"}, r"loss_type: 'ppo' is not one of \('grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo'"),
        ({"importance_sampling_level": "batch"}, "importance_sampling_level: 'batch' is not one of"),
        ({"delta": 1.0}, "delta: must be > 1"),
        ({"loss_type": "sapo", "sapo_temperature_neg": 0.0}, "sapo_temperature_neg: must be > 0"),
        ({"epsilon_low": 0.3, "epsilon_high": 0.2}, "epsilon_high"),
        ({"epsilon_low": 1.0, "epsilon_high": 1.0}, "epsilon_low"),
        ({"loss_type": "dr_grpo"}, "max_completion_length"),
        ({"loss_type": "dr_grpo", "max_completion_length": 0}, "max_completion_length"),
    ],
)
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo_loss(LOGP, OLD, None, ADV, MASK, **kwargs)


def test_an_unknown_option_is_refused():
    with pytest.raises(TypeError, match="epsilon"):
        grpo_loss(LOGP, OLD, None, ADV, MASK, epsilon=0.2)  # TRL's name for epsilon_low


def test_settings_and_keywords_give_the_same_loss():
    kw = {"loss_type": "bnpo", "epsilon_high": 0.28, "delta": 1.5}
    by_keywords = grpo_loss(LOGP, OLD, None, ADV, MASK, **kw)
    by_settings = grpo_loss(LOGP, OLD, None, ADV, MASK, settings=LossSettings(**kw))
    overridden = grpo_loss(LOGP, OLD, None, ADV, MASK, settings=LossSettings(loss_type="grpo"), **kw)
    assert by_keywords[0].item() == by_settings[0].item() == overridden[0].item()
    assert by_keywords[1] == by_settings[1] == overridden[1]


def test_every_loss_type_has_a_policy_term_and_a_normalisation():
    assert tuple(POLICY_TERMS) == tuple(NORMALISATIONS) == LOSS_TYPES


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(LOGP, OLD, None, torch.zeros(3), MASK)
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(LOGP, OLD, None, ADV, MASK[:, :2])
    with pytest.raises(ValueError, match="old_logp"):
        grpo_loss(LOGP, OLD[:1], None, ADV, MASK)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(LOGP, OLD, OLD[:, :2], ADV, MASK, beta=0.1)


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------

# three prompts, two completions each: groups (1, 0), (2, 2), (3, 5); means 0.5, 2, 4
REWARDS = torch.tensor([1.0, 0.0, 2.0, 2.0, 3.0, 5.0])
CENTRED = [0.5, -0.5, 0.0, 0.0, -1.0, 1.0]


def test_advantages_group():
    # unbiased std of a pair (a, b) is |a - b| / sqrt(2): 0.707107, 0, 1.414214
    s0, s2 = 1 / math.sqrt(2), 2 / math.sqrt(2)
    expected = [0.5 / (s0 + 1e-4), -0.5 / (s0 + 1e-4), 0.0, 0.0, -1.0 / (s2 + 1e-4), 1.0 / (s2 + 1e-4)]
    got = group_advantages(REWARDS, 2, scale_rewards="group")
    assert got.tolist() == pytest.approx(expected, rel=1e-6)


def test_advantages_group_std_is_unbiased():
    # group (0, 1, 2): mean 1, unbiased std sqrt((1 + 0 + 1) / 2) = 1 (biased would be sqrt(2/3))
    got = group_advantages(torch.tensor([0.0, 1.0, 2.0]), 3, scale_rewards="group", eps=0.0)
    assert got.tolist() == pytest.approx([-1.0, 0.0, 1.0])


def test_advantages_batch():
    # mean stays per group; std over all six rewards: mean 13/6, sum of squared deviations 89/6,
    # unbiased variance 89/30, std 1.722401
    std = math.sqrt(89 / 30)
    got = group_advantages(REWARDS, 2, scale_rewards="batch")
    assert got.tolist() == pytest.approx([c / (std + 1e-4) for c in CENTRED], rel=1e-6)


def test_advantages_none():
    got = group_advantages(REWARDS, 2, scale_rewards="none")
    assert got.tolist() == pytest.approx(CENTRED)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_zero_std_group_gives_zero_advantages(scale_rewards):
    # first group all 3.0 (std 0), second group (0, 1, 2) as above
    got = group_advantages(torch.tensor([3.0, 3.0, 3.0, 0.0, 1.0, 2.0]), 3, scale_rewards=scale_rewards)
    assert torch.isfinite(got).all()
    assert got[:3].tolist() == [0.0, 0.0, 0.0]
    assert got[3] < 0 < got[5]


def test_integer_rewards_are_promoted():
    got = group_advantages(torch.tensor([1, 0, 1, 1]), 2, scale_rewards="none")
    assert got.dtype == torch.float32
    assert got.tolist() == [0.5, -0.5, 0.0, 0.0]


def test_frac_zero_std():
    assert frac_zero_std(REWARDS, 2) == pytest.approx(1 / 3)
    assert frac_zero_std(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2) == 1.0
    assert frac_zero_std(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2) == 0.0


def test_advantage_errors():
    with pytest.raises(ValueError, match=r"scale_rewards must be one of \('group', 'batch', 'none'\)"):
        group_advantages(REWARDS, 2, scale_rewards="std")
    with pytest.raises(ValueError, match="multiple of num_generations"):
        group_advantages(REWARDS, 4)
    with pytest.raises(ValueError, match="num_generations must be >= 2"):
        group_advantages(REWARDS, 1)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(REWARDS.view(3, 2), 2)
    with pytest.raises(ValueError, match="multiple of num_generations"):
        frac_zero_std(REWARDS, 4)


# ---------------------------------------------------------------------------------------------
# masked_mean
# ---------------------------------------------------------------------------------------------


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 4 + 5 + 6) / 5)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([1.5, 5.0, 0.0])
    assert masked_mean(x, mask, dim=0).tolist() == pytest.approx([2.5, 3.5, 6.0])
    assert masked_mean(x, torch.zeros(3, 3)).item() == 0.0
