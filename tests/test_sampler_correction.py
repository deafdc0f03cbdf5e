"""The sampler against the trainer: the decode loop's own log-probs, the gap a GRPO step logs, and the correction.

The weights and the logged gap are compared with plain float64 formulas on random inputs (odd sizes, padding, a token
the sampler could not score); the decode loop's log-probs with the trainer's logits-free ones and a float64 full
forward; a GRPO step's logged gap and its correction on a tiny model. TRL's own loss with its vLLM correction is run
against ours in tests/test_losses_trl.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_grpo import _data, _method, _ready, _trainer

from lit_rl.losses import LossSettings, sampler_mismatch, sampler_weights
from lit_rl.models import LoraSettings, sample_completions

B, T = 5, 7


def _logps(seed: int):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor([7, 3, 1, 5, 6])[:, None]).long()  # [B, T] ragged
    trainer = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    sampler = trainer + 0.6 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    sampler[3, 2] = float("nan")  # not scored by the sampler: ratio 1
    trainer[1, 5] = sampler[1, 5] = float("-inf")  # padding may hold anything
    return trainer, sampler, mask


def _reference_weights(trainer, sampler, mask, mode, low, high):
    out = torch.zeros(B, T if mode.startswith("token") else 1, dtype=torch.float64)
    for i in range(B):
        diffs = [0.0 if not mask[i, t] or math.isnan(sampler[i, t]) else float(trainer[i, t] - sampler[i, t])
                 for t in range(T)]  # fmt: skip
        ratios = [math.exp(sum(diffs))] if mode.startswith("sequence") else [math.exp(d) for d in diffs]
        for j, r in enumerate(ratios):
            if mode.endswith("truncate"):
                r = min(max(r, low if low is not None else -math.inf), high if high is not None else math.inf)
            elif (low is not None and r < low) or (high is not None and r > high):
                r = 0.0
            out[i, j] = r
    return out


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0), (0.8, None)], ids=["max", "both", "min"])
def test_weights_are_the_float64_formula(mode, bounds):
    for seed in range(3):
        trainer, sampler, mask = _logps(seed)
        ours = sampler_weights(trainer, sampler, mask, mode=mode, clip_min=bounds[0], clip_max=bounds[1])
        expected = _reference_weights(trainer, sampler, mask, mode, *bounds)
        torch.testing.assert_close(ours, expected, rtol=1e-12, atol=0)
        assert not ours.requires_grad


def test_logged_gap_is_the_float64_definition():
    trainer, sampler, mask = _logps(4)
    gap = sampler_mismatch(trainer, sampler, mask, mode="token_mask", clip_min=0.8, clip_max=1.5)
    d = [float(trainer[i, t] - sampler[i, t]) for i in range(B) for t in range(T)
         if mask[i, t] and not math.isnan(sampler[i, t])]  # fmt: skip
    tokens = int(mask.sum())  # the unscored token counts, with a gap of 0
    assert gap["rollout/sampler_logp_diff/mean"].item() == pytest.approx(sum(abs(x) for x in d) / tokens, rel=1e-12)
    assert gap["rollout/sampler_logp_diff/max"].item() == pytest.approx(max(abs(x) for x in d), rel=1e-12)
    assert gap["rollout/sampler_k3"].item() == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / tokens, rel=1e-12)
    past = sum(not 0.8 <= math.exp(x) <= 1.5 for x in d)
    assert gap["rollout/sampler_past_cap"].item() == pytest.approx(past / tokens, rel=1e-12)
    by_sequence = sampler_mismatch(trainer, sampler, mask, mode="sequence_mask", clip_max=3.0)
    ratios = _reference_weights(trainer, sampler, mask, "sequence_truncate", None, None)[:, 0]
    assert by_sequence["rollout/sampler_past_cap"].item() == pytest.approx(float((ratios > 3.0).double().mean()))


@pytest.mark.parametrize("temperature,top_k,min_new", [(1.0, 0, 0), (0.7, 0, 3), (1.3, 5, 0)])
def test_decode_records_the_log_probs_the_trainer_computes(temperature, top_k, min_new):
    """float32, left padding: the loop's log-probs are the tempered distribution's, before top-k and min_new_tokens,
    which is what the trainer recomputes (and a float64 full forward gives)."""
    method = _ready(_method(temperature=temperature))
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (3, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[mask == 0] = method.tokenizer.pad_token_id
    torch.manual_seed(1)
    sequences, logp = sample_completions(
        method.policy, ids, mask, method.tokenizer.pad_token_id, [method.tokenizer.eos_token_id], repeats=2,
        own_decode="own", do_sample=True, temperature=temperature, top_p=1.0, top_k=top_k, max_new_tokens=9,
        min_new_tokens=min_new, return_logprobs=True,
    )  # fmt: skip
    c = sequences.shape[1] - ids.shape[1]
    assert logp.shape == (6, c) and logp.dtype == torch.float32
    full_mask = torch.cat([mask.repeat_interleave(2, 0), torch.ones(6, c, dtype=torch.long)], 1)
    trainer = method.completion_stats(method.policy, sequences, full_mask, ids.shape[1], temperature=temperature).logp
    position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = method.policy.double()(input_ids=sequences, attention_mask=full_mask, position_ids=position_ids).logits
    method.policy.float()
    expected = torch.log_softmax(logits[:, ids.shape[1] - 1 : -1] / temperature, -1)
    expected = expected.gather(-1, sequences[:, ids.shape[1] :, None]).squeeze(-1)  # [6, C]
    eos = sequences[:, ids.shape[1] :] == method.tokenizer.eos_token_id
    live = ~(eos.cumsum(1) - eos.long()).bool()  # up to and including the first EOS
    torch.testing.assert_close(logp[live].double(), expected[live], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logp[live], trainer[live].float(), atol=2e-5, rtol=1e-5)


def test_generate_gives_no_sampler_log_probs():
    method = _ready(_method())
    ids = torch.randint(3, 90, (2, 4))
    _, logp = sample_completions(
        method.policy, ids, torch.ones_like(ids), method.tokenizer.pad_token_id, [method.tokenizer.eos_token_id],
        own_decode=False, do_sample=True, max_new_tokens=3, return_logprobs=True,
    )  # fmt: skip
    assert logp is None


def test_a_grpo_step_logs_the_gap_and_the_correction_changes_nothing_when_they_agree(capture_logger):
    """float32 on one CPU: the loop and the trainer agree to float32 rounding, so the gap is tiny and every sequence's
    ratio is inside TRL's default bounds; the correction then leaves the loss as it was (same seed, same samples)."""
    losses = {}
    for correction in (False, True):
        torch.manual_seed(0)
        method = _method(loss=LossSettings(beta=0.04, importance_sampling_correction=correction))
        _trainer(logger=capture_logger).fit(method, _data())
        losses[correction] = capture_logger.metrics["loss"][-1][1]
        gap = {k: v[-1][1] for k, v in capture_logger.metrics.items() if k.startswith("rollout/sampler")}
        assert set(gap) == {"rollout/sampler_logp_diff/mean", "rollout/sampler_logp_diff/max", "rollout/sampler_k3",
                            "rollout/sampler_past_cap"}  # fmt: skip
        assert gap["rollout/sampler_logp_diff/max"] < 1e-4 and gap["rollout/sampler_past_cap"] == 0.0
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


def test_a_step_corrects_with_the_weights_the_mode_gives(monkeypatch, capture_logger):
    """A sampler that disagrees (its log-probs shifted for one completion): ``sequence_mask`` gives that completion
    weight 0 and the others their ratios near 1, and the logged share past the cap is that one completion."""
    settings = LossSettings(importance_sampling_correction=True, importance_sampling_mode="sequence_mask")
    method = _method(loss=settings)
    seen = []
    real_generate = type(method).generate

    def doctored(self, ids, mask, return_logprobs=False):
        sequences, completion_mask, logp = real_generate(self, ids, mask, return_logprobs=True)
        logp = logp.clone()
        logp[0] -= 5.0  # row 0's ratio exp(5 per token) is far above 3: masked
        return sequences, completion_mask, logp

    real_loss = type(method).policy_loss

    def spy(self, rollout, sl, num_items):
        seen.append(rollout)
        return real_loss(self, rollout, sl, num_items)

    monkeypatch.setattr(type(method), "generate", doctored)
    monkeypatch.setattr(type(method), "policy_loss", spy)
    torch.manual_seed(0)
    _trainer(logger=capture_logger).fit(method, _data())
    rollout = seen[-1]
    assert capture_logger.metrics["rollout/sampler_past_cap"][-1][1] == pytest.approx(1 / len(rollout))
    weights = sampler_weights(rollout.trainer_logp, rollout.sampler_logp, rollout.completion_mask)
    assert weights[0].item() == 0.0 and torch.allclose(weights[1:], torch.ones_like(weights[1:]), atol=1e-3)


def test_a_bf16_rollout_of_float32_weights_is_another_sampler_and_is_predicted(capture_logger, tmp_path):
    """``rollout_dtype: bfloat16`` decodes float32 weights in bf16: the logged gap grows past float32's, the weights
    stay float32, and the profiler's prediction of the rollout (its bf16 cache and casts) matches what it measures.
    ``rollout_linear: packed`` (where oneDNN runs) decodes them in float32 on packed copies: a gap of float32's
    size, and a peak raised by the copies, predicted as such."""
    from lit_rl.callbacks import MemoryProfiler
    from lit_rl.models.cast_once import float32_packing_unsupported

    settings = {"same": {}, "bfloat16": dict(rollout_dtype="bfloat16"), "packed": dict(rollout_linear="packed")}
    if float32_packing_unsupported(torch.device("cpu")) is not None:
        del settings["packed"]
    gaps, peaks = {}, {}
    for name, setting in settings.items():
        torch.manual_seed(0)
        method = _method(**setting)
        _trainer(logger=capture_logger, callbacks=[MemoryProfiler()], default_root_dir=tmp_path).fit(method, _data())
        gaps[name] = capture_logger.metrics["rollout/sampler_logp_diff/max"][-1][1]
        assert next(method.policy.parameters()).dtype == torch.float32
        measured = capture_logger.metrics["memory/rollout/peak_gib"][-1][1]
        predicted = capture_logger.metrics["memory/rollout/predicted_gib"][-1][1]
        assert predicted == pytest.approx(measured, rel=0.02), name
        peaks[name] = (measured, predicted)
    assert gaps["same"] < 1e-4 < gaps["bfloat16"]
    for name in ("bfloat16", "packed")[: len(settings) - 1]:
        # bf16: a bf16 KV cache and bf16 casts of the linear layers; packed: float32 copies. Both held through the
        # rollout: another peak, predicted as such
        assert abs(peaks[name][0] / peaks["same"][0] - 1) > 0.01, name
        assert (peaks[name][0] - peaks["same"][0]) * (peaks[name][1] - peaks["same"][1]) > 0, name
    if "packed" in gaps:
        assert gaps["packed"] < 1e-4 and peaks["packed"][0] > peaks["bfloat16"][0]
    with pytest.raises(ValueError, match="model.rollout_dtype: 'fp8' is not same or bfloat16"):
        _method(rollout_dtype="fp8")
    with pytest.raises(ValueError, match="model.rollout_linear: 'mkl' is not plain or packed"):
        _method(rollout_linear="mkl")


def test_a_packed_float32_rollout_of_a_lora_model_lends_the_bases_storage_and_is_predicted(capture_logger, tmp_path):
    """``rollout_linear: packed`` under LoRA: the frozen base's packed copies take its storage, so the rollout holds
    about what the plain one does (the adapters' and a tied head's copies more), and the profiler predicts it."""
    from lit_rl.callbacks import MemoryProfiler
    from lit_rl.models.cast_once import float32_packing_unsupported

    if float32_packing_unsupported(torch.device("cpu")) is not None:
        pytest.skip("this torch has no oneDNN: float32 weights are not packed")
    peaks = {}
    for linear in ("plain", "packed"):
        torch.manual_seed(0)
        method = _method(lora=LoraSettings(r=4, alpha=8, target_modules="all-linear"), rollout_linear=linear)
        _trainer(logger=capture_logger, callbacks=[MemoryProfiler()], default_root_dir=tmp_path).fit(method, _data())
        measured = capture_logger.metrics["memory/rollout/peak_gib"][-1][1]
        predicted = capture_logger.metrics["memory/rollout/predicted_gib"][-1][1]
        assert predicted == pytest.approx(measured, rel=0.02), linear
        peaks[linear] = measured * 2**30
    policy = method.policy
    embedding, head = policy.get_input_embeddings().weight, policy.get_output_embeddings().weight
    base = sum(
        p.numel() * 4 for p in policy.parameters() if p.dim() == 2 and not p.requires_grad and p is not embedding
    )
    copies = sum(p.numel() * 4 for p in policy.parameters() if p.dim() == 2 and p.requires_grad)  # the adapters
    copies += head.numel() * 4 if head is embedding else 0  # a tied head: the lookup reads it
    assert 0 < peaks["packed"] - peaks["plain"] < copies + base / 2  # a copy of the base would add all of it
    assert capture_logger.metrics["rollout/sampler_logp_diff/max"][-1][1] < 1e-4


def test_the_correction_under_generate_says_it_corrects_nothing():
    with pytest.warns(UserWarning, match="importance_sampling_correction: on, but the rollouts come from transformers"):
        _ready(_method(decode="generate", loss=LossSettings(importance_sampling_correction=True)))
