"""Loading policy, reference and reward models; the trunk and LM-head lookup the logits-free ops rely on.

See :mod:`lit_rl.models.loading` for what ``name_or_path`` accepts and :mod:`lit_rl.models.head` for the
trunk, the head spec and the load-time parity check. Also here: the own decode loop's load-time checks
(:func:`decode_unsupported`, :func:`compile_unsupported`, :func:`lean_unsupported`: why ``model.decode: own``,
``compiled`` or ``lean`` would fall back for a model), the compiled step's compile seconds per shape
(:func:`compile_seconds`), a decode step's attention with its grouped query heads packed
(:func:`packed_sdpa_forward`: what half-precision decoding runs on a CPU), the decode loop's weights cast once per
rollout (:func:`linear_weights_cast_once`, packed for oneDNN where bf16 runs there, and float32 weights packed too
within :func:`float32_weights_packed`), and the tiny random models' parts built in memory for tests
(:func:`tiny_config`, :func:`tiny_tokenizer`).
"""

from lit_rl.models.cache_keyword import cache_keyword, cache_kwargs, output_cache
from lit_rl.models.cast_once import float32_weights_packed, linear_weights_cast_once, weights_meant_for
from lit_rl.models.checkpointing import checkpointing_refused, enable_activation_checkpointing, own_recomputation
from lit_rl.models.compiled_decode import compile_seconds, compile_unsupported
from lit_rl.models.decode import decode_unsupported
from lit_rl.models.decode_attention import packed_sdpa_forward
from lit_rl.models.head import (
    ADOPTED,
    base_model,
    check_head_parity,
    disable_dropout,
    gather_trunk,
    head_spec,
    lm_head,
    trunk,
    trunk_hidden,
)
from lit_rl.models.lean_step import lean_unsupported
from lit_rl.models.loading import (
    DTYPES,
    EMBEDDED,
    EMBEDDED_NAME,
    EMBEDDED_PACKAGE,
    TINY_PREFIX,
    LoraSettings,
    apply_lora,
    build_from_config,
    build_on_meta,
    cache_dir,
    check_supported,
    embedded_default_path,
    embedded_gguf_path,
    load_causal_lm,
    load_tokenizer,
    meta_config,
    resolve_dtype,
    resolve_source,
)
from lit_rl.models.optimizers import (
    StochasticAdamW,
    build_optimizer,
    default_optimizer,
    keeps_bf16_updates,
    optimizer_class,
)
from lit_rl.models.quantize import nf4_bytes_per_param, nf4_memory, quantize_base_nf4
from lit_rl.models.reward import (
    forward_soft_embeds,
    forward_soft_sparse,
    load_reward_model,
    score_every_prefix,
    soft_embeddings,
)
from lit_rl.models.sampling import rollout_sampler, sample_completions
from lit_rl.models.shapes import BUILTIN_SHAPES, SHAPE_PREFIX, shape_config
from lit_rl.models.tiny import tiny_config, tiny_tokenizer

__all__ = [
    "ADOPTED",
    "BUILTIN_SHAPES",
    "DTYPES",
    "EMBEDDED",
    "EMBEDDED_NAME",
    "EMBEDDED_PACKAGE",
    "SHAPE_PREFIX",
    "TINY_PREFIX",
    "LoraSettings",
    "StochasticAdamW",
    "apply_lora",
    "base_model",
    "build_from_config",
    "build_on_meta",
    "build_optimizer",
    "default_optimizer",
    "optimizer_class",
    "cache_dir",
    "cache_keyword",
    "cache_kwargs",
    "check_head_parity",
    "check_supported",
    "checkpointing_refused",
    "compile_seconds",
    "compile_unsupported",
    "decode_unsupported",
    "disable_dropout",
    "embedded_default_path",
    "embedded_gguf_path",
    "enable_activation_checkpointing",
    "float32_weights_packed",
    "forward_soft_embeds",
    "forward_soft_sparse",
    "gather_trunk",
    "head_spec",
    "keeps_bf16_updates",
    "lean_unsupported",
    "linear_weights_cast_once",
    "lm_head",
    "load_causal_lm",
    "load_reward_model",
    "load_tokenizer",
    "meta_config",
    "nf4_bytes_per_param",
    "nf4_memory",
    "output_cache",
    "own_recomputation",
    "packed_sdpa_forward",
    "quantize_base_nf4",
    "resolve_dtype",
    "resolve_source",
    "rollout_sampler",
    "sample_completions",
    "shape_config",
    "score_every_prefix",
    "soft_embeddings",
    "tiny_config",
    "tiny_tokenizer",
    "trunk",
    "trunk_hidden",
    "weights_meant_for",
]
