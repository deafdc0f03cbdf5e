"""Micro-batches by token budget (``micro_batch_tokens``): the packing, its bound, and an update that equals the
one without a budget (float64), with the rows reordered and each pass cut to its micro-batch's longest completion."""

from __future__ import annotations

import pytest
import torch

from lit_rl.losses import LossSettings
from lit_rl.memory.estimate import estimate_step
from lit_rl.methods import Intuitor, RefCachedGRPO
from lit_rl.methods.grpo import Rollout
from lit_rl.methods.token_budget import group_order

G, P, C = 4, 7, 6  # completions per prompt, prompt and completion lengths


def _method(cls=RefCachedGRPO, **kw):
    args = dict(name_or_path="tiny:llama", num_generations=G, max_new_tokens=C, learning_rate=1e-2, temperature=0.7)
    method = cls(**{**args, **kw})
    method.setup("fit")
    method.configure_model()
    return method.double()


@pytest.mark.parametrize(
    ("lengths", "size", "budget", "expected"),
    [
        ([10, 10, 10, 10], None, 25, [(0, 2), (2, 4)]),  # two rows of 10 fit in 25, three do not
        ([30, 5, 5, 5, 5], None, 25, [(0, 1), (1, 5)]),  # a row over the budget is a slice of its own
        ([9, 8, 7, 6, 5, 4], 2, 100, [(0, 2), (2, 4), (4, 6)]),  # micro_batch_size still caps the rows
        ([4, 9, 4, 4], None, 18, [(0, 2), (2, 4)]),  # the slice's longest row counts for every row
    ],
)
def test_micro_batches_keep_rows_times_longest_within_the_budget(lengths, size, budget, expected):
    method = RefCachedGRPO(name_or_path="tiny:llama", micro_batch_size=size, micro_batch_tokens=budget)
    slices = method.micro_batches(len(lengths), lengths)
    assert [(s.start, s.stop) for s in slices] == expected
    for s in slices:
        assert s.stop - s.start == 1 or (s.stop - s.start) * max(lengths[s]) <= budget
    rows_only, step = [(s.start, s.stop) for s in method.micro_batches(len(lengths))], size or len(lengths)
    assert rows_only == [(i, min(i + step, len(lengths))) for i in range(0, len(lengths), step)]  # no lengths given


def test_group_order_keeps_groups_together_longest_first():
    tokens = [3, 4, 9, 1, 5, 5]  # groups of 2: longest rows 4, 9, 5
    assert group_order(tokens, 2) == [2, 3, 4, 5, 0, 1]
    assert group_order([1, 2, 3], 1) == [2, 1, 0]


def _rollout(groups: int = 3, seed: int = 0) -> Rollout:
    """``groups`` prompts x ``G`` completions of lengths 1..C (zero mask after each one's end)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 90, (groups, P), generator=gen)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[1, :2] = 0
    ids = torch.cat([prompts.repeat_interleave(G, 0), torch.randint(3, 90, (groups * G, C), generator=gen)], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(G, 0), torch.ones(groups * G, C, dtype=torch.long)], 1)
    lengths = torch.randint(1, C + 1, (groups * G,), generator=gen)
    lengths[0] = C  # one completion runs to the end
    completion_mask = (torch.arange(C)[None, :] < lengths[:, None]).float()
    return Rollout(ids, mask, completion_mask, P, torch.zeros(groups * G), torch.randn(groups * G, generator=gen))


def _update(method, rollout: Rollout):
    """Reference log-probs, the micro-batched loss and every gradient, as the step computes them."""
    method.zero_grad(set_to_none=True)
    rollout.ref_logp = method.reference_logp(rollout)
    total, slices = 0.0, method.micro_batches(len(rollout), rollout.row_tokens)
    for sl in slices:
        loss, _ = method.policy_loss(rollout, sl, float(rollout.completion_mask.sum()))
        loss.backward()
        total = total + loss.detach()
    grads = {n: p.grad.clone() for n, p in method.policy.named_parameters() if p.grad is not None}
    return total, grads, slices


@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_budgeted_update_equals_the_update_without_a_budget_in_float64(share_prompt, loss_type):
    settings = LossSettings(beta=0.04, loss_type=loss_type)
    plain = _method(share_prompt=share_prompt, loss=settings, micro_batch_size=4)
    budgeted = _method(share_prompt=share_prompt, loss=settings, micro_batch_size=4, micro_batch_tokens=3 * (P + 3))
    with torch.no_grad():  # move the policy away from the reference
        for p in plain.policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    budgeted.policy.load_state_dict(plain.policy.state_dict())
    loss_a, grads_a, _ = _update(plain, _rollout())
    rollout = _rollout()
    rollout.row_tokens = [P + int(n) for n in rollout.completion_mask.sum(1)]
    rollout.sort_by_length(G)
    loss_b, grads_b, slices = _update(budgeted, rollout)
    widths = [rollout.width(sl) for sl in slices]
    assert len(slices) > 3 and min(widths) < C  # the budget cut the batch differently and trimmed some passes
    assert rollout.row_tokens[0] == P + C  # the longest group first
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-10, atol=1e-12)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:  # RMSNorm computes in float32 whatever the model dtype: float32 roundoff of the sums
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=2e-6, atol=2e-6, msg=name)


def test_sorted_rollout_keeps_every_row_field_together():
    rollout = _rollout()
    rollout.completions = [f"c{i}" for i in range(len(rollout))]
    rollout.rewards = torch.arange(len(rollout), dtype=torch.float)
    rollout.row_tokens = [P + int(n) for n in rollout.completion_mask.sum(1)]
    before = {i: (rollout.input_ids[i].clone(), rollout.completion_mask[i].clone()) for i in range(len(rollout))}
    rollout.sort_by_length(G)
    for row in range(len(rollout)):
        source = int(rollout.rewards[row])
        assert rollout.completions[row] == f"c{source}"
        assert torch.equal(rollout.input_ids[row], before[source][0])
        assert rollout.row_tokens[row] == P + int(before[source][1].sum())
    for start in range(0, len(rollout), G):  # each block of G rows is one whole group of the original order
        assert len({int(r) // G for r in rollout.rewards[start : start + G]}) == 1


def test_intuitor_scoring_pass_pads_cut_micro_batches_back_to_the_rollout_width():
    method = _method(Intuitor, micro_batch_tokens=2 * (P + 2), loss=LossSettings(beta=0.0))
    rollout = _rollout()
    rollout.row_tokens = [P + int(n) for n in rollout.completion_mask.sum(1)]
    rollout.sort_by_length(G)
    logp, certainty = method.micro_batched_stats(method.policy, rollout, self_certainty=True)
    assert logp.shape == certainty.shape == rollout.completion_mask.shape
    whole = _method(Intuitor, loss=LossSettings(beta=0.0))
    whole.policy.load_state_dict(method.policy.state_dict())
    rollout.row_tokens = None  # the same rows in one pass over every column
    logp_all, certainty_all = whole.micro_batched_stats(whole.policy, rollout, self_certainty=True)
    valid = rollout.completion_mask.bool()
    torch.testing.assert_close(logp[valid], logp_all[valid], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(certainty[valid], certainty_all[valid], rtol=2e-6, atol=2e-6)


def test_estimate_takes_every_row_at_its_longest_under_a_budget():
    method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=G, max_new_tokens=C)
    whole = estimate_step(method, batch_size=2, prompt_length=P)
    budget = estimate_step(method, batch_size=2, prompt_length=P, micro_batch_tokens=2 * (P + C))
    assert whole.settings["micro_batch_size"] == 2 * G
    assert budget.settings["micro_batch_size"] == 2  # two rows of P + C tokens each
    assert budget.phases["backward"] < whole.phases["backward"]


def test_a_budget_below_one_row_is_refused_in_one_line():
    method = RefCachedGRPO(name_or_path="tiny:llama", max_new_tokens=C, micro_batch_tokens=P + C - 1)
    with pytest.raises(ValueError, match=rf"micro_batch_tokens: {P + C - 1} is below .* at least {P + C}$"):
        method.check_micro_batch_tokens(P)
    method.check_micro_batch_tokens(P - 1)  # one row fits: no error
    with pytest.raises(ValueError, match="must be >= 1 or null"):
        RefCachedGRPO(name_or_path="tiny:llama", micro_batch_tokens=0)
