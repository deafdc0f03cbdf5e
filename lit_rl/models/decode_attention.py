"""A decode step's attention with its query heads packed per key-value head: one call of torch's CPU attention
kernel over ``[B, KV heads, group, D]`` queries instead of ``enable_gqa`` over ``[B, heads, 1, D]``.

Why: with grouped-query attention (several query heads per key-value head, SmolLM2 and Qwen2.5 among the models
we train) and no attention mask (prompts without padding), transformers' ``sdpa`` attention passes
``enable_gqa=True`` for a one-token query. On a CPU in bfloat16, torch's flash-attention kernel is then several
times slower than the same kernel given the group's query heads as a query of ``group`` tokens, each against the
same keys, and the gap grows with the keys (``bench/results/decode_attention.md``, SmolLM2-135M's heads); in
float32 the packed call is no slower. transformers already packs this way when a mask is passed (``pack_gqa``);
this packs every one-token query.

The packed call attends each query head over its own key-value head exactly as the grouped call does; the
kernel's blocking differs, so an output can differ in its last bit (a bf16 unit in the last place) from
``enable_gqa``'s. That is why it runs only where the sampler is not the trainer's numbers anyway: the
lower-precision sampler of float32 weights (``model.rollout_dtype: bfloat16``,
:func:`lit_rl.models.sampling.rollout_sampler`), whose log-probs are compared with the trainer's at every step.
Everything else (prefill, several query tokens, no grouped heads, a position bias, a soft cap) is transformers'
``sdpa_attention_forward`` unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lit_rl.models.head import base_model

#: the name this attention is registered under in transformers' attention and mask interfaces
PACKED_SDPA = "lit_rl_packed_sdpa"


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [B, H, Q, D]``, ``key``/``value [B, KV, K, D]``, the
    sdpa mask (boolean, ``True`` where a query attends, broadcast over heads) or ``None``; returns
    ``([B, Q, H, D], None)``. A one-token query of grouped heads runs packed (module docstring); anything else goes
    to ``sdpa_attention_forward``."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    plain = kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or dropout
    if length != 1 or kv_heads == heads or plain or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    packed = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # [B, KV, group, D]: query heads as tokens
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


ALL_ATTENTION_FUNCTIONS.register(PACKED_SDPA, packed_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)  # the masks sdpa takes


@contextlib.contextmanager
def packed_decode_attention(model) -> Iterator[bool]:
    """Within the block, ``model`` (a transformers model, or a LoRA wrapper of one) attends through
    :func:`packed_sdpa_forward` where its attention is ``sdpa``; yields whether it does. Restored on exit."""
    config = base_model(model).config
    before = getattr(config, "_attn_implementation", None)
    if before != "sdpa":
        yield False
        return
    config._attn_implementation = PACKED_SDPA
    try:
        yield True
    finally:
        config._attn_implementation = before


__all__ = ["PACKED_SDPA", "packed_decode_attention", "packed_sdpa_forward"]
