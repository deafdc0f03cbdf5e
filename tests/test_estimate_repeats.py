"""The estimator runs only the micro-batches whose memory can differ (``without_repeats``), and predicts exactly what
running every micro-batch predicts: every phase's peak and first-step peak, the breakdown at each peak, and the
component table, for each method, misaligned micro-batches, a token budget, checkpointing, LoRA and old-policy
log-probs."""

from __future__ import annotations

import pytest

from lit_rl.memory import estimate as estimate_module
from lit_rl.memory.estimate import estimate_step, without_repeats
from lit_rl.methods import GumbelTopK, Intuitor, RefCachedGRPO
from lit_rl.models import LoraSettings


def test_the_third_of_a_kind_is_left_out():
    # 8 prompts x 4 completions in micro-batches of 3: runs of rows sharing a prompt (3), (1, 2), (2, 1), (3), ...
    slices = [slice(i, min(i + 3, 32)) for i in range(0, 32, 3)]
    kept = without_repeats(slices, group=4)
    assert [sl.start for sl in kept] == [0, 3, 6, 9, 15, 18, 30]  # 12, 21, 24 are a third (3), 27 a third (1, 2)
    ones = [slice(i, i + 1) for i in range(16)]
    assert without_repeats(ones, group=8) == ones[:2]  # one row is one run wherever it starts
    assert without_repeats(slices[:2], group=4) == slices[:2]
    aligned = [slice(i, i + 8) for i in range(0, 64, 8)]
    assert without_repeats(aligned, group=8) == aligned[:2]
    assert without_repeats(aligned, group=1) == aligned[:2]


GRPO = dict(name_or_path="tiny:llama", num_generations=4, max_new_tokens=3, learning_rate=1e-3)
CASES = [  # aligned micro-batches are a case of the first test; here each kind of loop and offset
    pytest.param(
        RefCachedGRPO,
        {**GRPO, "num_generations": 2, "micro_batch_size": 3, "lora": LoraSettings(r=4, alpha=8), "num_iterations": 2},
        {"activation_checkpointing": 1},
        id="grpo-misaligned-lora-checkpointing-old-policy",
    ),
    pytest.param(
        RefCachedGRPO, {**GRPO, "micro_batch_size": 8, "micro_batch_tokens": 14, "padding_free": False}, {}, id="budget"
    ),
    pytest.param(Intuitor, {**GRPO, "micro_batch_size": 2}, {}, id="intuitor"),
    pytest.param(
        GumbelTopK,
        dict(name_or_path="tiny:llama", reward_model="tiny:llama", max_new_tokens=3, gumbel_topk=8, micro_batch_size=1),
        {},
        id="gumbel_topk",
    ),
]


@pytest.mark.slow  # two estimates each, one running every micro-batch
@pytest.mark.parametrize(("cls", "kw", "settings"), CASES)
def test_leaving_repeats_out_predicts_what_every_micro_batch_predicts(cls, kw, settings, monkeypatch):
    method = cls(**kw)
    shape = dict(batch_size=8, prompt_length=4, **settings)
    ran = []  # (micro-batches, kept) of each loop
    cut = estimate_module.without_repeats
    monkeypatch.setattr(
        estimate_module, "without_repeats", lambda s, g: ran.append((len(s), len(cut(s, g)))) or cut(s, g)
    )
    fast = estimate_step(method, **shape)
    assert any(kept < total for total, kept in ran), ran  # micro-batches were left out
    monkeypatch.setattr(estimate_module, "SKIP_REPEATS", False)
    every = estimate_step(method, **shape)
    assert fast.phases == every.phases
    assert fast.first_step == every.first_step
    assert fast.breakdown == every.breakdown
    assert fast.components == every.components
