"""``model.decode: lean`` against the own loop and ``generate`` on tiny models: log-probs close, tokens equal.

The lean step runs the same layer as transformers' forward, written out, so on tiny float32 models its log-probs
of the sampled tokens match the own loop's to float32 rounding and its tokens are the same, greedy and sampled:
on llama, qwen2 and qwen3 (per-head query and key norms) with left padding, a shared-prompt prefill, temperature
!= 1 and top-k, rows that end at different steps and leave the batch (the fast draw), LoRA adapters merged or not,
float32 weights packed for oneDNN, and bf16 weights. Models it does not write out are refused at load time (the
own loop runs, said in one line; a step whose tokens differ from ``generate``'s is refused as the compiled one is, in
tests/test_compiled_decode.py), and a model with forward hooks keeps the loop's forward.
"""

from __future__ import annotations

import pytest
import torch
from test_decode import EOS, PAD, _prompts
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

from lit_rl.methods import RefCachedGRPO
from lit_rl.models import LoraSettings, apply_lora
from lit_rl.models.cast_once import float32_weights_packed
from lit_rl.models.compiled_decode import choose_decode
from lit_rl.models.decode import decode, sampling_settings
from lit_rl.models.lean_step import LeanSteps, lean_unsupported
from lit_rl.models.merged_lora import lora_merged
from lit_rl.models.shared_prompt import shared_prefill
from lit_rl.models.tiny import tiny_model


def _qwen3(seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, pad_token_id=PAD, eos_token_id=EOS,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def _model(arch: str, seed: int = 0):
    return _qwen3(seed) if arch == "qwen3" else tiny_model(arch, seed=seed).eval()


def _run(model, ids, mask, *, lean: bool, seed: int = 0, cache=None, **config):
    """The loop's sequences and log-probs, with the lean step or the model's forward, from the same random state."""
    settings, reason = sampling_settings(model, GenerationConfig(pad_token_id=PAD, eos_token_id=[EOS], **config))
    assert reason is None
    torch.manual_seed(seed)
    step = LeanSteps(model) if lean else None
    out = decode(model, ids, mask, eos=[EOS], pad_id=PAD, cache=cache, step=step, return_logprobs=True, **settings)
    assert not lean or hasattr(step, "blocks"), "the lean step did not take over from the prefill"
    return out


def _same(model, ids, mask, atol: float = 2e-5, **kw):
    (own, own_lp), (lean, lean_lp) = (_run(model, ids, mask, lean=flag, **kw) for flag in (False, True))
    assert torch.equal(own, lean)
    torch.testing.assert_close(lean_lp, own_lp, rtol=0, atol=atol)
    return own


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_and_sampled_tokens_equal_the_own_loop(arch):
    model = _model(arch)
    assert lean_unsupported(model) is None
    ids, mask = _prompts(rows=4)
    _same(model, ids, mask, do_sample=False, max_new_tokens=12)
    _same(model, ids, mask, do_sample=True, max_new_tokens=12, temperature=0.7, top_k=20, seed=3)
    ones = torch.ones_like(mask)  # no padding: the step attends without a mask
    _same(model, ids.clamp(min=3), ones, do_sample=True, max_new_tokens=12, seed=4)


def test_rows_that_end_leave_the_batch_with_the_fast_draw():
    model = _model("llama", seed=2)
    ids, mask = _prompts(rows=6)
    kw = dict(do_sample=True, max_new_tokens=40, temperature=1.5)
    settings, _ = sampling_settings(model, GenerationConfig(pad_token_id=PAD, eos_token_id=[EOS], **kw))
    runs = []
    for step in (None, LeanSteps(model)):
        torch.manual_seed(5)
        runs.append(decode(model, ids, mask, eos=[EOS, 7, 9, 11], pad_id=PAD, step=step, return_logprobs=True,
                           drop_ended=True, draw="inverse_cdf", **settings))  # fmt: skip
    (own, own_lp), (lean, lean_lp) = runs
    assert hasattr(step, "blocks")
    ended = ((own[:, ids.shape[1] :] == PAD).any(dim=1)).sum()
    assert 0 < ended < own.shape[0], "some rows, not all, must end before the limit for rows to leave the batch"
    assert torch.equal(own, lean)
    torch.testing.assert_close(lean_lp, own_lp, rtol=0, atol=2e-5)


def test_a_shared_prompt_prefill_is_taken_over():
    model = _model("qwen2", seed=1)
    ids, mask = _prompts(rows=2)
    repeated, repeated_mask = ids.repeat_interleave(3, dim=0), mask.repeat_interleave(3, dim=0)
    runs = []
    for lean in (False, True):
        cache = shared_prefill(model, ids, mask, 3)
        runs.append(_run(model, repeated, repeated_mask, lean=lean, cache=cache, do_sample=True, max_new_tokens=10))
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=0, atol=2e-5)


@pytest.mark.parametrize("merged", [False, True])
def test_lora_adapters_run_or_are_merged_as_in_the_loop(merged):
    model = apply_lora(_model("llama", seed=3), LoraSettings(r=4, alpha=8))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.5)  # adapters that change the tokens
    model.eval()
    ids, mask = _prompts(rows=3)
    with torch.no_grad(), lora_merged(model) if merged else torch.no_grad():
        _same(model, ids, mask, do_sample=True, max_new_tokens=10, seed=6)


def test_float32_weights_packed_for_onednn():
    model = _model("llama", seed=4)
    ids, mask = _prompts(rows=4)
    with float32_weights_packed():
        _same(model, ids, mask, do_sample=True, max_new_tokens=10, seed=7)


def test_bf16_weights_within_bf16_rounding():
    """bf16 weights run the step in bf16 (the float32 tests above are the ones that check its math closely)."""
    model = _model("qwen2", seed=5).to(torch.bfloat16)
    ids, mask = _prompts(rows=3)
    (own, own_lp), (lean, lean_lp) = (
        _run(model, ids, mask, lean=flag, do_sample=False, max_new_tokens=8) for flag in (False, True)
    )
    assert torch.equal(own, lean)
    torch.testing.assert_close(lean_lp, own_lp, rtol=0, atol=5e-3)


def test_a_model_with_forward_hooks_keeps_the_loops_forward():
    model = _model("llama", seed=6)
    calls = []
    model.model.layers[0].register_forward_hook(lambda *args: calls.append(1))
    ids, mask = _prompts(rows=2)
    step = LeanSteps(model)
    _run(model, ids, mask, lean=False, do_sample=False, max_new_tokens=5)
    seen = len(calls)
    settings, _ = sampling_settings(model, GenerationConfig(pad_token_id=PAD, eos_token_id=[EOS], do_sample=False,
                                                            max_new_tokens=5))  # fmt: skip
    decode(model, ids, mask, eos=[EOS], pad_id=PAD, step=step, **settings)
    assert len(calls) == 2 * seen and not hasattr(step, "blocks"), "the hook runs at every step, the step never"


def test_models_it_does_not_write_out_run_the_own_loop():
    gpt2 = tiny_model("gpt2", seed=1)
    assert "model type 'gpt2'" in lean_unsupported(gpt2)
    assert choose_decode(gpt2, "lean", "tiny-gpt2") == (
        "own",
        f"model.decode: the eager loop for tiny-gpt2, {lean_unsupported(gpt2)}",
    )
    assert choose_decode(tiny_model("llama", seed=1), "lean", "tiny") == ("lean", None)
    scaled = tiny_model("llama", seed=1)
    scaled.config.logits_scaling = 2.0  # Granite's; a Llama layer's structure with other math
    assert "logits_scaling" in lean_unsupported(scaled)
    one_norm = _qwen3()
    del one_norm.model.layers[1].self_attn.k_norm  # a query norm without a key norm is not Qwen3's layer
    assert "is not a pre-norm attention block" in lean_unsupported(one_norm)


def test_methods_accept_decode_lean():
    method = RefCachedGRPO(name_or_path="tiny:llama", decode="lean", num_generations=2, max_new_tokens=4)
    method.setup("fit")
    method.configure_model()
    assert method.own_decode == "lean"


def test_the_estimate_charges_the_lean_step_as_the_own_loop():
    """The lean step reads the own loop's cache and weight casts and nothing else: the same estimated peaks, and
    with bf16 weight casts held through the rollout (bf16-mixed) more than ``generate``'s."""
    from lit_rl.memory.estimate import estimate_step

    phases = {}
    for decode_setting in ("own", "lean", "generate"):
        method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=2, max_new_tokens=4, decode=decode_setting)
        phases[decode_setting] = estimate_step(method, batch_size=2, prompt_length=8, precision="bf16-mixed").phases
    assert phases["lean"] == phases["own"]
    assert phases["lean"]["rollout"] > phases["generate"]["rollout"]
