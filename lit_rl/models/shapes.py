"""Real architectures' shapes built in code (``shape:<name>``): configs without the network, and random weights.

``shape:<name>`` as a ``name_or_path`` builds that architecture with random weights and the character-level tokenizer
of :mod:`lit_rl.models.tiny` (its ids are the vocabulary's first hundred): what a memory or speed measurement needs,
since neither depends on the weights' values (``bench/device_check.py``). The estimator reads the same shapes
(``lit-rl estimate --model-config shape:<name>``).
"""

from __future__ import annotations

from typing import Any

# Model shapes built in code, so a config can be estimated without the network: ``shape:<name>``.
# Values are those of the published config.json files (Qwen2.5-Coder-3B has the 3B's shape).
BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768,
    ),
    "qwen2.5-3b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=32768,
    ),
    "qwen2.5-32b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False, max_position_embeddings=32768,
    ),
    "qwen3-4b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000, bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000, bos_token_id=151643, eos_token_id=151645,
    ),
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    ),
}  # fmt: skip
SHAPE_PREFIX = "shape:"


def shape_config(source: str):
    """The transformers config of ``shape:<name>`` (or ``<name>``), as published (:func:`with_tiny_special_tokens`
    gives it the tiny tokenizer's special ids, for random weights).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    from transformers import AutoConfig

    name = source[len(SHAPE_PREFIX) :] if source.startswith(SHAPE_PREFIX) else source
    if name.lower() not in BUILTIN_SHAPES:
        raise ValueError(
            f"unknown model shape {source!r}; use one of {', '.join(SHAPE_PREFIX + n for n in BUILTIN_SHAPES)}"
        )
    kwargs = dict(BUILTIN_SHAPES[name.lower()])
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def with_tiny_special_tokens(config):
    """``config`` with the tiny tokenizer's pad, bos and eos ids (random weights read that tokenizer's ids)."""
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    return config
