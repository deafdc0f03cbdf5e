"""A rollout decoded in chunks (``model.rollout_rows``): the same completions as one batch, chunk by chunk; the KV
cache of one chunk, measured and predicted; its extra weight reads in the roofline; chosen by the planner when the
rollout's own peak does not fit."""

from __future__ import annotations

import pytest
import torch
from test_decode import EOS, PAD, _prompts
from test_grpo import _data, _method, _trainer
from test_plan import RATES
from test_rollout_samplers import _ending_early, _live
from test_roofline import _counted, _model

from lit_rl.memory.estimate import estimate_step
from lit_rl.memory.work import ModelShape, StepSettings, phase_work
from lit_rl.methods import RefCachedGRPO
from lit_rl.models import sample_completions
from lit_rl.models.sampling import rollout_chunks
from lit_rl.models.tiny import tiny_model
from lit_rl.plan_file import plan_fragment
from lit_rl.planner import describe, plan


@pytest.mark.parametrize(
    ("prompts", "repeats", "rows", "chunks"),
    [
        (3, 4, None, [(0, 3, 4)]),
        (3, 4, 12, [(0, 3, 4)]),
        (3, 4, 8, [(0, 2, 4), (2, 1, 4)]),  # whole groups: two prompts, then the last
        (3, 4, 11, [(0, 2, 4), (2, 1, 4)]),  # rows that hold no whole group are left unused
        (2, 4, 3, [(0, 1, 3), (0, 1, 1), (1, 1, 3), (1, 1, 1)]),  # below a group: runs of one prompt's completions
        (2, 3, 1, [(0, 1, 1)] * 3 + [(1, 1, 1)] * 3),
        (1, 1, 1, [(0, 1, 1)]),
    ],
)
def test_rollout_chunks_cover_every_completion_once_in_row_order(prompts, repeats, rows, chunks):
    got = rollout_chunks(prompts, repeats, rows)
    assert got == chunks
    order = [first + i for first, n, r in got for i in range(n) for _ in range(r)]
    assert order == [p for p in range(prompts) for _ in range(repeats)]  # rows i * repeats ... continue prompt i
    assert max(n * r for _, n, r in got) <= (rows or prompts * repeats)


def test_rollout_chunks_refuse_fewer_than_one_row():
    with pytest.raises(ValueError, match="rows_at_once: must be >= 1, got 0"):
        rollout_chunks(2, 4, 0)
    with pytest.raises(ValueError, match="model.rollout_rows: must be >= 1, got 0; set it to 1 or more"):
        _method(rollout_rows=0)


@pytest.mark.parametrize("own_decode", ["own", False], ids=["own_decode", "generate"])
@pytest.mark.parametrize("share_prompt", [False, True], ids=["rows", "shared_prefill"])
def test_greedy_chunks_complete_every_row_as_the_whole_batch_does(own_decode, share_prompt):
    """Greedy tokens depend on nothing but each row's logits: a chunked rollout must give every row the tokens the
    whole batch gives it, padded past its chunk's end, and (own decode) the same log-probs of the live tokens."""
    model = tiny_model("llama", seed=3).eval()
    ids, mask = _prompts(rows=3)  # row 1 left-padded
    eos = _ending_early(model, ids, mask)
    kw = dict(repeats=4, share_prompt=share_prompt, own_decode=own_decode, return_logprobs=True, do_sample=False,
              max_new_tokens=40)  # fmt: skip
    whole, whole_logp = sample_completions(model, ids, mask, PAD, eos, **kw)
    live = _live(whole[:, ids.shape[1] :], eos)
    ends = live.sum(1)
    narrower = 0
    for rows in (1, 3, 4, 8):
        got, logp = sample_completions(model, ids, mask, PAD, eos, rows_at_once=rows, **kw)
        assert torch.equal(got, whole), rows
        if own_decode:
            torch.testing.assert_close(logp[live], whole_logp[live], atol=1e-6, rtol=0)
        else:
            assert logp is None and whole_logp is None  # generate records none
        starts = [first * 4 for first, _, _ in rollout_chunks(3, 4, rows)]
        widths = [int(ends[a : a + n * r].max()) for a, (_, n, r) in zip(starts, rollout_chunks(3, 4, rows))]
        narrower += min(widths) < int(ends.max())
    assert narrower, "the test needs a chunk that ends before the longest row: its padding is what is checked"


def test_sampled_chunks_are_calls_one_after_another():
    """Sampling: each chunk draws from the random stream after the chunk before (the docstring's promise)."""
    model = tiny_model("qwen2", seed=1).eval()
    ids, mask = _prompts(rows=2)
    kw = dict(share_prompt=True, own_decode="own", return_logprobs=True, do_sample=True, temperature=0.7,
              max_new_tokens=12)  # fmt: skip
    torch.manual_seed(4)
    got, logp = sample_completions(model, ids, mask, PAD, [EOS], repeats=3, rows_at_once=2, **kw)
    torch.manual_seed(4)
    parts = [
        sample_completions(model, ids[i : i + n], mask[i : i + n], PAD, [EOS], repeats=r, **kw)
        for i, n, r in rollout_chunks(2, 3, 2)
    ]
    width = got.shape[1]
    for (seq, lp), start in zip(parts, (0, 2, 3, 5), strict=True):
        rows = slice(start, start + seq.shape[0])
        assert torch.equal(got[rows, : seq.shape[1]], seq) and (got[rows, seq.shape[1] :] == PAD).all()
        new = seq.shape[1] - ids.shape[1]
        assert torch.equal(logp[rows, :new], lp) and (logp[rows, new:] == 0).all()
    assert width == max(seq.shape[1] for seq, _ in parts)


def test_grpo_rollout_rows_lowers_the_measured_rollout_peak_as_predicted(capture_logger, tmp_path):
    """The MemoryProfiler's measured rollout peak and the estimator's prediction of the same step, with and without
    chunks: equal, and lower with chunks (the KV cache of 2 rows instead of 8)."""
    from lit_rl.callbacks import MemoryProfiler

    peaks = {}
    for rows in (None, 2):
        torch.manual_seed(0)
        method = _method(rollout_rows=rows, max_new_tokens=24)
        trainer = _trainer(logger=capture_logger, callbacks=[MemoryProfiler()], default_root_dir=tmp_path, steps=1)
        trainer.fit(method, _data())
        metrics = capture_logger.metrics
        measured, predicted = metrics["memory/rollout/peak_gib"][-1][1], metrics["memory/rollout/predicted_gib"][-1][1]
        assert predicted == pytest.approx(measured, rel=0.02), rows
        peaks[rows] = measured
        assert "reward/mean" in metrics and "loss" in metrics, rows  # the step scored and trained
        capture_logger.metrics.clear()
    assert peaks[2] < peaks[None]
    kv = {}
    for rows in (None, 2):
        estimate = estimate_step(_method(rollout_rows=rows, max_new_tokens=24), batch_size=2, prompt_length=24)
        kv[rows] = estimate.component("KV cache (end of rollout)")
    assert kv[None].bytes == 4 * kv[2].bytes and "[2, " in kv[2].shape  # 8 rows decoded at once, then 2


@pytest.mark.parametrize("rows", [None, 4, 2])
def test_chunked_rollout_flops_equal_the_counted_flops(rows):
    """Each chunk prefills its prompt (shared by its completions) and decodes its rows: torch's count of the whole
    rollout equals the roofline's; fewer rows at once read the weights more often."""
    model = _model(attention="eager").eval()
    shape = ModelShape.from_config(model.config)
    p, c = 7, 5
    ids, mask = torch.randint(3, 96, (2, p)), torch.ones(2, p, dtype=torch.long)
    settings = StepSettings(prompts=2, generations=4, prompt_length=p, new_tokens=c, share_prompt=True,
                            rollout_rows=rows)  # fmt: skip
    work = phase_work(shape, settings)["rollout"]
    counted = _counted(
        lambda: sample_completions(model, ids, mask, PAD, [EOS], repeats=4, share_prompt=True, own_decode="own",
                                   do_sample=False, max_new_tokens=c, min_new_tokens=c, rows_at_once=rows)
    )  # fmt: skip
    assert counted == sum(w.flops for w in work)
    chunks = rollout_chunks(2, 4, rows)
    assert sum(w.decode for w in work) == len(chunks) * c
    whole = phase_work(shape, StepSettings(**{**settings.__dict__, "rollout_rows": None}))["rollout"]
    # every extra chunk reads the weights once more in its prefill and at each decode step; the KV cache read and
    # written is the same, but for the prompts prefilled once per chunk instead of once in all
    w, hv, kv = shape.trunk_weights * 4, shape.head_weights * 4, shape.cache_values_per_token * 4
    prefilled = sum(n for _, n, _ in chunks)
    extra = (len(chunks) - 1) * (c * (w + hv) + w) + (prefilled - 2) * (p - 1) * kv
    assert sum(x.bytes for x in work) - sum(x.bytes for x in whole) == extra


def test_the_planner_cuts_the_rollout_when_its_kv_cache_does_not_fit():
    """A budget below the rollout's own peak that the update can meet: the plan decodes fewer rows at once (the most
    that fit), and writes it as the method's setting."""
    method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=8, max_new_tokens=64)
    shape = dict(batch_size=2, prompt_length=24)
    config = estimate_step(method, **shape)
    lean = estimate_step(method, **shape, micro_batch_tokens=88, micro_batch_size=None, activation_checkpointing=1)
    update = max(v for k, v in lean.phases.items() if k != "rollout")
    rollout = config.phases["rollout"]
    assert update < rollout, "the test needs an update that fits below the rollout's peak"
    budget = (update + rollout) // 2
    best, found, base = plan(method, budget, rates=RATES, **shape)
    assert base.estimate.phases["rollout"] > budget and best is not None and best.peak <= budget
    cut = best.overrides["rollout_rows"]
    assert 1 <= cut < 16 and best.estimate.phases["rollout"] <= budget
    assert plan_fragment(best)["model"]["init_args"]["rollout_rows"] == cut and f"rollout_rows {cut}" in describe(best)
    cuts = [c.overrides["rollout_rows"] for c in found if "rollout_rows" in c.overrides]
    assert cuts[0] >= cut and cuts == sorted(cuts, reverse=True)  # the first guess, then halves until it fits
