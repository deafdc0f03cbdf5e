"""Model configs without weights: built-in shapes (``shape:<name>``) and the config behind any ``name_or_path``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

# Model shapes built in code, so a config can be estimated without the network: ``shape:<name>``.
# Values are those of the published config.json files (Qwen2.5-Coder-3B has the 3B's shape; Qwen3-4B as in
# seed 003's three-model Gumbel run).
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
    "qwen3-4b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000, bos_token_id=151643, eos_token_id=151645,
    ),
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    ),
}  # fmt: skip
SHAPE_PREFIX = "shape:"


def model_config_for(
    name_or_path: str,
    *,
    model_config: Any = None,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
):
    """The transformers config of the policy, read without loading any weight.

    Args:
        name_or_path: the method's ``name_or_path`` (``embedded``, ``tiny:*``, ``shape:*``, a folder, a GGUF file
            or a hub id).
        model_config: overrides it: a ``PretrainedConfig``, ``shape:<name>`` (see :data:`BUILTIN_SHAPES`), or a
            ``config.json`` file or folder holding one.
        gguf_file: as for the method.
        trust_remote_code: as for the method.

    Raises:
        ValueError: when the config cannot be read (a hub id without network), naming ``--model-config``.
    """
    from transformers import AutoConfig, PretrainedConfig

    from lit_rl.models import EMBEDDED, EMBEDDED_NAME, TINY_PREFIX, cache_dir, resolve_source

    source = name_or_path if model_config is None else model_config
    if isinstance(source, PretrainedConfig):
        return copy.deepcopy(source)
    source = str(source)
    if source.startswith(SHAPE_PREFIX):
        name = source[len(SHAPE_PREFIX) :].lower()
        if name not in BUILTIN_SHAPES:
            raise ValueError(
                f"unknown model shape {source!r}; use one of {', '.join(SHAPE_PREFIX + n for n in BUILTIN_SHAPES)}"
            )
        kwargs = dict(BUILTIN_SHAPES[name])
        return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    if source.startswith(TINY_PREFIX):
        from lit_rl.models.tiny import tiny_config, tiny_tokenizer

        # configure_model sizes a tiny model's vocabulary to its tokenizer
        return tiny_config(source[len(TINY_PREFIX) :], vocab_size=len(tiny_tokenizer()))
    if source == EMBEDDED:
        converted = cache_dir() / EMBEDDED_NAME / "config.json"
        if converted.exists():
            return AutoConfig.from_pretrained(converted)
        return model_config_for(EMBEDDED, model_config=SHAPE_PREFIX + "smollm2-135m")
    try:
        if model_config is not None:
            return AutoConfig.from_pretrained(Path(source).expanduser(), trust_remote_code=trust_remote_code)
        path, gguf = resolve_source(source, gguf_file)
        return AutoConfig.from_pretrained(path, gguf_file=gguf, trust_remote_code=trust_remote_code)
    except Exception as err:  # a hub id without network, a folder without config.json, ...
        raise ValueError(
            f"cannot read the model config of {source!r} ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
            f"pass --model-config path/to/config.json or one of {', '.join(SHAPE_PREFIX + n for n in BUILTIN_SHAPES)}"
        ) from err


def config_resolver(policy_config: Any = None, reward_config: Any = None, **kwargs: Any):
    """``(role, name_or_path) -> config`` for :func:`lit_rl.models.build_on_meta`: a role's override, or the config
    :func:`model_config_for` reads for ``name_or_path`` (``kwargs``: ``gguf_file``, ``trust_remote_code``)."""
    overrides = {"policy": policy_config, "reward": reward_config}

    def configs(role: str, name_or_path: str):
        return model_config_for(name_or_path, model_config=overrides.get(role), **kwargs)

    return configs
