"""lit-rl's decode loop against transformers' ``generate``: the same tokens, greedy and sampled, on tiny models.

The filters are checked against transformers' own logits warpers on random scores; the loop against
``generate`` with left padding, rows that end early, a shared-prompt prefill, every sampling setting the loop
implements, and temperature != 1. Models and settings the loop cannot follow fall back to ``generate``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, MistralConfig
from transformers.generation import (
    MinNewTokensLengthLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lit_rl.models import sample_completions
from lit_rl.models.decode import (
    PreallocatedLayer,
    decode,
    decode_unsupported,
    min_new_tokens_filter,
    sampling_settings,
    top_k_filter,
    top_p_filter,
)
from lit_rl.models.shared_prompt import shared_prefill
from lit_rl.models.tiny import tiny_model

EOS = 2
PAD = 0


def _prompts(rows: int = 3, length: int = 7, vocab: int = 128, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    ids = ids.masked_fill(mask == 0, PAD)
    return ids, mask


def _generate(model, ids, mask, seed: int, eos=(EOS,), cache=None, **config):
    torch.manual_seed(seed)
    config = GenerationConfig(pad_token_id=PAD, eos_token_id=list(eos), use_cache=True, **config)
    return model.eval().generate(input_ids=ids, attention_mask=mask, generation_config=config, past_key_values=cache)


def _decode(model, ids, mask, seed: int, cache=None, **config):
    torch.manual_seed(seed)
    settings, reason = sampling_settings(model, GenerationConfig(pad_token_id=PAD, eos_token_id=[EOS], **config))
    assert reason is None
    return decode(model.eval(), ids, mask, eos=[EOS], pad_id=PAD, cache=cache, **settings)


# ---------------------------------------------------------------------------------------------- filters
@pytest.mark.parametrize("k", [1, 5, 127, 128, 500])
def test_top_k_filter_equals_transformers_warper(k):
    scores = torch.randn(4, 128, generator=torch.Generator().manual_seed(k))
    scores[0, :10] = 1.5  # ties at the k-th value stay, as transformers keeps them
    expected = TopKLogitsWarper(top_k=k)(None, scores.clone())
    assert torch.equal(top_k_filter(scores, k), expected)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_filter_equals_transformers_warper(p):
    scores = 3 * torch.randn(5, 131, generator=torch.Generator().manual_seed(int(p * 1000)))
    scores[1] = 0.0  # a flat row: ties everywhere
    expected = TopPLogitsWarper(top_p=p)(None, scores.clone())
    got = top_p_filter(scores, p)
    assert torch.equal(got, expected)
    assert (got > float("-inf")).any(1).all()  # at least one token kept per row


@pytest.mark.parametrize("produced", [0, 2, 3])
def test_min_new_tokens_filter_equals_transformers_processor(produced):
    scores = torch.randn(3, 50)
    eos = torch.tensor([2, 7])
    processor = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=4, min_new_tokens=3, eos_token_id=[2, 7])
    expected = processor(torch.zeros(3, 4 + produced, dtype=torch.long), scores.clone())
    assert torch.equal(min_new_tokens_filter(scores, eos, produced, 3), expected)


def test_temperature_is_transformers_division():
    scores = torch.randn(2, 40)
    assert torch.equal(TemperatureLogitsWarper(0.7)(None, scores.clone()), scores / 0.7)


# ---------------------------------------------------------------------------------------------- the loop
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_tokens_equal_generate(arch):
    model = tiny_model(arch, seed=1)
    ids, mask = _prompts()
    expected = _generate(model, ids, mask, 0, do_sample=False, max_new_tokens=9)
    assert torch.equal(_decode(model, ids, mask, 0, do_sample=False, max_new_tokens=9), expected)


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1.0, top_p=1.0, top_k=0),
        dict(temperature=0.6, top_p=0.8, top_k=0),
        dict(temperature=1.3, top_p=1.0, top_k=5, min_new_tokens=4),
        dict(temperature=0.9, top_p=0.5, top_k=20, min_new_tokens=11),
    ],
)
def test_sampled_tokens_equal_generate_for_the_same_noise(settings):
    model = tiny_model("llama", seed=2)
    ids, mask = _prompts(rows=4)
    for seed in range(3):
        expected = _generate(model, ids, mask, seed, do_sample=True, max_new_tokens=11, **settings)
        got = _decode(model, ids, mask, seed, do_sample=True, max_new_tokens=11, **settings)
        assert torch.equal(got, expected), (seed, settings)


def test_rows_that_end_early_are_padded_and_the_loop_exits_when_all_ended():
    model = tiny_model("llama", seed=3).eval()
    ids, mask = _prompts(rows=6)
    sampling = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
    first_run = _generate(model, ids, mask, 5, max_new_tokens=30, **sampling)[:, ids.shape[1] :]
    counts = torch.bincount(first_run.flatten(), minlength=128)
    counts[[PAD, EOS]] = 0
    eos = counts.topk(8).indices.tolist()  # the most frequent tokens end rows early as EOS ids
    config = GenerationConfig(pad_token_id=PAD, eos_token_id=eos, max_new_tokens=60, **sampling)
    torch.manual_seed(5)
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    torch.manual_seed(5)
    settings, _ = sampling_settings(model, config)
    got = decode(model, ids, mask, eos=eos, pad_id=PAD, **settings)
    assert torch.equal(got, expected)
    completion = got[:, ids.shape[1] :]
    is_eos = torch.isin(completion, torch.tensor(eos))
    assert is_eos.any(1).all() and completion.shape[1] < 60, "the test needs every row to end early"
    first = is_eos.int().argmax(1)
    assert len(set(first.tolist())) > 1, "the test needs rows that end at different steps"
    after = torch.arange(completion.shape[1])[None] > first[:, None]
    assert (completion[after] == PAD).all()


def test_shared_prefill_gives_generate_tokens():
    model = tiny_model("llama", seed=4).eval()
    ids, mask = _prompts(rows=2)
    rows, rows_mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    config = dict(do_sample=True, max_new_tokens=8, temperature=0.8, top_k=0, top_p=1.0)
    expected = _generate(model, rows, rows_mask, 7, cache=shared_prefill(model, ids, mask, 3), **config)
    got = _decode(model, rows, rows_mask, 7, cache=shared_prefill(model, ids, mask, 3), **config)
    assert torch.equal(got, expected)


def test_logits_of_every_step_equal_generate():
    """Not just the argmax: the attention over the preallocated cache's views sees the same numbers."""
    model = tiny_model("qwen2", seed=5).eval()
    ids, mask = _prompts()
    config = GenerationConfig(
        do_sample=False, max_new_tokens=6, pad_token_id=PAD, eos_token_id=[EOS], output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    expected = torch.stack(model.generate(input_ids=ids, attention_mask=mask, generation_config=config).logits, 1)
    seen = []
    forward = model.forward

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append(out.logits[:, -1].float())
        return out

    model.forward = spy
    decode(model, ids, mask, eos=[EOS], pad_id=PAD, max_new_tokens=6, do_sample=False)
    assert torch.equal(torch.stack(seen, 1), expected)


def test_preallocated_layer_writes_in_place_and_refuses_overflow():
    keys, values = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 7)
    layer = PreallocatedLayer(keys, values, capacity=6)
    k, v = layer.update(torch.ones(2, 3, 2, 5), torch.ones(2, 3, 2, 7))
    assert k.shape == (2, 3, 6, 5) and v.shape == (2, 3, 6, 7)
    assert torch.equal(k[:, :, :4], keys) and (k[:, :, 4:] == 1).all()
    assert k.untyped_storage().data_ptr() == layer._keys.untyped_storage().data_ptr()  # a view, no copy
    with pytest.raises(RuntimeError, match="holds 6 positions"):
        layer.update(torch.ones(2, 3, 1, 5), torch.ones(2, 3, 1, 7))


# ---------------------------------------------------------------------------------------------- fallbacks
def test_sliding_window_models_are_refused_at_load():
    config = MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    reason = decode_unsupported(model)
    assert reason is not None and "sliding" in reason.lower()
    assert decode_unsupported(tiny_model("llama")) is None


def test_a_checkpoint_setting_the_loop_lacks_falls_back_to_generate():
    model = tiny_model("llama", seed=6)
    model.generation_config.repetition_penalty = 1.3  # generate merges it into a fresh config
    ids, mask = _prompts()
    settings, reason = sampling_settings(model, GenerationConfig(do_sample=False, max_new_tokens=5))
    assert settings is None and "RepetitionPenalty" in reason
    torch.manual_seed(0)
    got = sample_completions(model, ids, mask, PAD, [EOS], own_decode=True, do_sample=False, max_new_tokens=5)
    expected = _generate(model, ids, mask, 0, do_sample=False, max_new_tokens=5)
    assert torch.equal(got, expected)


def test_checkpoint_sampling_defaults_are_followed():
    """A value the caller leaves unset comes from the model's generation config, as in generate."""
    model = tiny_model("llama", seed=7)
    model.generation_config.temperature = 0.5
    model.generation_config.top_k = 7
    settings, reason = sampling_settings(model, GenerationConfig(do_sample=True, max_new_tokens=4, top_p=0.9))
    assert reason is None
    assert (settings["temperature"], settings["top_k"], settings["top_p"]) == (0.5, 7, 0.9)
    ids, mask = _prompts()
    for seed in range(2):
        expected = _generate(model, ids, mask, seed, do_sample=True, max_new_tokens=4, top_p=0.9)
        assert torch.equal(_decode(model, ids, mask, seed, do_sample=True, max_new_tokens=4, top_p=0.9), expected)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_sample_completions_own_decode_equals_generate(share_prompt):
    model = tiny_model("llama", seed=8)
    ids, mask = _prompts(rows=2)
    config = dict(do_sample=True, temperature=0.9, top_p=0.95, top_k=0, max_new_tokens=7, min_new_tokens=2)
    out = {}
    for own in (False, True):
        torch.manual_seed(3)
        out[own] = sample_completions(
            model, ids, mask, PAD, [EOS], repeats=3, share_prompt=share_prompt, own_decode=own, **config
        )
    assert torch.equal(out[True], out[False])
    assert model.training  # restored
