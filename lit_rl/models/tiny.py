"""Tiny models and a tokenizer built in memory, for tests, benchmarks and `--model.name_or_path tiny:*`.

Nothing here touches the network: the tokenizer is a character-level vocabulary built with the
``tokenizers`` library and the models are random-weight transformers built from a config.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(pad_token: bool = True) -> PreTrainedTokenizerFast:
    """A character-level tokenizer (about 100 tokens) with a ChatML template.

    Args:
        pad_token: set ``<pad>`` as the pad token; ``False`` leaves it unset, as many base models do.
    """
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<|im_start|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    if pad_token:
        tok.pad_token = "<pad>"
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def tiny_config(arch: str = "llama", vocab_size: int = 128, hidden_size: int = 32, num_layers: int = 2, **kw):
    """A transformers config of a tiny causal LM in one of the shapes we support (llama, qwen2, gpt2)."""
    # llama and qwen2 share every field; they differ in the class and whether the LM head is tied by default
    llama_like = {"llama": (LlamaConfig, True), "qwen2": (Qwen2Config, False)}
    if arch in llama_like:
        config_class, tied = llama_like[arch]
        return config_class(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=kw.pop("tie_word_embeddings", tied),
            pad_token_id=0,
            eos_token_id=2,
            bos_token_id=1,
            **kw,
        )
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=4,
            n_positions=512,
            pad_token_id=0,
            eos_token_id=2,
            bos_token_id=1,
            **kw,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; use llama, qwen2 or gpt2")


def tiny_model(arch: str = "llama", seed: int = 0, **kw) -> torch.nn.Module:
    """A random-weight tiny causal LM, deterministic for a given ``seed``."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **kw))
