"""``model.decode: compiled`` against transformers' ``generate`` on tiny models: logits close, greedy tokens equal.

Compiling a tiny model's step takes seconds, so the compiled tests are few, marked ``slow``, and share their
shapes (6 rows, a 64-position static cache) so that one graph per architecture serves them all. Checked: logits of
every step at a tight tolerance and greedy tokens on llama and qwen2 with left padding; sampled tokens with rows
that end at different steps; a shared-prompt prefill; one compilation per shape, reused across rollouts, models
and in-place updates of LoRA adapters; the eager loop where compiling fails; the load-time choice and its
fallbacks; a bad ``model.decode`` value.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_decode import EOS, PAD, _generate, _prompts
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, GenerationConfig, MistralConfig

from lit_rl.cli import main
from lit_rl.methods import RefCachedGRPO
from lit_rl.models import LoraSettings, load_causal_lm, sample_completions
from lit_rl.models import compiled_decode as compiled_module
from lit_rl.models.compiled_decode import (
    StaticSteps,
    choose_decode,
    compile_seconds,
    compile_unsupported,
    compiled_decode,
    static_capacity,
)
from lit_rl.models.decode import decode, sampling_settings
from lit_rl.models.lean_step import LeanSteps
from lit_rl.models.shared_prompt import shared_prefill
from lit_rl.models.tiny import tiny_model

ROWS = 6  # every compiled test uses 6 rows and a 64-position cache: one graph per architecture


def _compiled(model, ids, mask, seed: int, eos=(EOS,), cache=None, step=None, **config):
    torch.manual_seed(seed)
    config = GenerationConfig(pad_token_id=PAD, eos_token_id=list(eos), **config)
    settings, reason = sampling_settings(model, config)
    assert reason is None
    step = step or StaticSteps(model)
    return decode(model.eval(), ids, mask, eos=list(eos), pad_id=PAD, cache=cache, step=step, **settings)


class _Spy(StaticSteps):
    """Keeps the logits of every compiled step."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.seen: list[torch.Tensor] = []

    def __call__(self, tokens, positions):
        logits = super().__call__(tokens, positions)
        self.seen.append(logits.float().clone())
        return logits


def test_static_capacity_rounds_up_to_a_multiple():
    assert [static_capacity(n) for n in (1, 64, 65, 130)] == [64, 64, 128, 192]
    assert static_capacity(10, multiple=8) == 16


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_logits_are_close_and_greedy_tokens_equal_generate(arch):
    model = tiny_model(arch, seed=5).eval()
    ids, mask = _prompts(ROWS)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=8, pad_token_id=PAD, eos_token_id=[EOS], output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    spy = _Spy(model)
    got = _compiled(model, ids, mask, 0, step=spy, do_sample=False, max_new_tokens=8)
    assert torch.equal(got, expected.sequences)
    assert len(spy.seen) == 7  # the first token's logits come from the eager prefill
    reference = torch.stack(expected.logits[1:], 1)  # [B, 7, V]
    torch.testing.assert_close(torch.stack(spy.seen, 1), reference, rtol=1e-5, atol=1e-5)
    assert compile_unsupported(model) is None


@pytest.mark.slow
def test_sampled_rows_that_end_at_different_steps_equal_generate():
    model = tiny_model("llama", seed=3).eval()
    ids, mask = _prompts(ROWS)
    sampling = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_new_tokens=2)
    first_run = _generate(model, ids, mask, 5, max_new_tokens=30, **sampling)[:, ids.shape[1] :]
    counts = torch.bincount(first_run.flatten(), minlength=128)
    counts[[PAD, EOS]] = 0
    eos = counts.topk(8).indices.tolist()  # the most frequent tokens end rows early as EOS ids
    expected = _generate(model, ids, mask, 5, eos=eos, max_new_tokens=40, **sampling)
    got = _compiled(model, ids, mask, 5, eos=eos, max_new_tokens=40, **sampling)
    assert torch.equal(got, expected)
    completion = got[:, ids.shape[1] :]
    is_eos = torch.isin(completion, torch.tensor(eos))
    assert is_eos.any(1).all() and completion.shape[1] < 40, "the test needs every row to end early"
    assert len(set(is_eos.int().argmax(1).tolist())) > 1, "the test needs rows that end at different steps"


@pytest.mark.slow
def test_shared_prefill_is_copied_into_the_static_cache():
    model = tiny_model("llama", seed=4).eval()
    ids, mask = _prompts(rows=2)
    rows, rows_mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)  # 6 rows
    config = dict(do_sample=True, max_new_tokens=8, temperature=0.8, top_k=0, top_p=1.0)
    expected = _generate(model, rows, rows_mask, 7, cache=shared_prefill(model, ids, mask, 3), **config)
    got = _compiled(model, rows, rows_mask, 7, cache=shared_prefill(model, ids, mask, 3), **config)
    assert torch.equal(got, expected)
    model.train()  # sample_completions switches to eval mode and back
    torch.manual_seed(7)
    through = sample_completions(
        model, ids, mask, PAD, [EOS], repeats=3, share_prompt=True, own_decode="compiled", **config
    )
    assert torch.equal(through, expected)
    assert model.training  # restored


@pytest.mark.slow
def test_one_compilation_per_shape_reused_across_rollouts_and_models():
    model = tiny_model("llama", seed=8).eval()
    greedy = dict(eos=[EOS], pad_id=PAD, do_sample=False)
    ids, mask = _prompts(ROWS)
    compiled_decode(model, ids, mask, max_new_tokens=6, **greedy)
    assert list(compile_seconds(model)) == [(ROWS, 64, torch.float32, torch.device("cpu"))]
    graphs = counters["stats"]["unique_graphs"]
    for length, new in ((5, 9), (11, 30), (3, 4)):  # other prompt and completion lengths, the same 64 positions
        ids, mask = _prompts(ROWS, length=length, seed=length)
        expected = _generate(model, ids, mask, 0, max_new_tokens=new, do_sample=False)
        assert torch.equal(compiled_decode(model, ids, mask, max_new_tokens=new, **greedy), expected)
    other = tiny_model("llama", seed=9).eval()  # the same structure: its weights are the graph's inputs
    ids, mask = _prompts(ROWS)
    expected = _generate(other, ids, mask, 0, max_new_tokens=6, do_sample=False)
    assert torch.equal(compiled_decode(other, ids, mask, max_new_tokens=6, **greedy), expected)
    assert counters["stats"]["unique_graphs"] == graphs, "a rollout of a known shape recompiled"
    assert len(compile_seconds(model)) == 1


@pytest.mark.slow
def test_lora_policy_updated_in_place_keeps_its_graph():
    """The training case: a peft model whose adapters an optimizer changes in place between rollouts."""
    model = load_causal_lm("tiny:llama", lora=LoraSettings(r=4, alpha=8))
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        torch.nn.init.normal_(p, std=0.05)  # adapters that change the logits
    model.eval()
    ids, mask = _prompts(ROWS, vocab=90)
    config = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=10)
    graphs = None
    for seed in range(3):
        expected = _generate(model, ids, mask, seed, **config)
        assert torch.equal(_compiled(model, ids, mask, seed, **config), expected), seed
        graphs = graphs or counters["stats"]["unique_graphs"]
        with torch.no_grad():
            for p in trainable:
                p.add_(0.05 * torch.randn_like(p))  # an optimizer step: same tensors, new values
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_a_failing_compile_falls_back_to_the_eager_loop(monkeypatch):
    def broken(fn, **kwargs):
        def raise_(*args, **kw):
            raise RuntimeError("no C++ compiler found\nmore lines")

        return raise_

    monkeypatch.setattr(compiled_module, "_compiled", {})
    monkeypatch.setattr(torch, "compile", broken)
    model = tiny_model("llama", seed=10).eval()
    ids, mask = _prompts(ROWS)
    config = dict(do_sample=True, temperature=0.9, top_k=0, top_p=1.0, max_new_tokens=6)
    expected = _generate(model, ids, mask, 1, **config)
    assert torch.equal(_compiled(model, ids, mask, 1, **config), expected)  # the prefill kept, the RNG untouched
    assert "no C++ compiler found" in compiled_module._state(model).failed
    assert torch.equal(_compiled(model, ids, mask, 1, **config), expected)  # not tried again
    assert compile_seconds(model) == {}


def test_load_time_choice_and_its_fallbacks():
    llama = tiny_model("llama", seed=1)
    assert choose_decode(llama, "compiled", "tiny") == ("compiled", None)
    assert choose_decode(llama, "own", "tiny") == ("own", None)
    assert choose_decode(llama, "generate", "tiny") == (False, None)
    config = MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    mode, line = choose_decode(AutoModelForCausalLM.from_config(config), "compiled", "mistral")
    assert mode is False and line.startswith("model.decode: transformers' generate for mistral, ")


@pytest.mark.parametrize(
    "requested, steps, said", [("compiled", StaticSteps, "its static-cache step"), ("lean", LeanSteps, "its lean step")]
)
def test_a_step_the_eager_check_rejects_keeps_the_eager_loop(monkeypatch, requested, steps, said):
    """A step (static, or the lean one) whose tokens differ from generate's (here: logits shifted by one token) is
    refused at load."""
    llama = tiny_model("llama", seed=1)
    original = steps.__call__
    monkeypatch.setattr(steps, "__call__", lambda self, *a: original(self, *a).roll(1, dims=-1))
    mode, line = choose_decode(llama, requested, "tiny")
    assert mode == "own" and line.startswith(f"model.decode: the eager loop for tiny, {said}: ")


def test_methods_accept_decode_compiled():
    method = RefCachedGRPO(name_or_path="tiny:llama", decode="compiled", num_generations=2, max_new_tokens=4)
    method.setup("fit")
    method.configure_model()
    assert method.own_decode == "compiled"


def test_a_bad_decode_value_is_one_line(capsys):
    config = Path(__file__).resolve().parents[1] / "configs" / "grpo_tiny.yaml"
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(config), "--model.init_args.decode", "compile"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert stop.value.code == 2
    assert lines == [
        "error: model.decode: 'compile' is not one of 'own', 'compiled', 'lean', 'generate'; use one of them"
    ]
