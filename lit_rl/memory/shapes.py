"""Model configs without weights: built-in shapes (``shape:<name>``) and the config behind any ``name_or_path``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from lit_rl.models.shapes import BUILTIN_SHAPES, SHAPE_PREFIX, shape_config


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
        return shape_config(source)
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
