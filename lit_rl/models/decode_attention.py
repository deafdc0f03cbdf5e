"""A decode step's attention with its query heads packed per key-value head: one call of torch's CPU attention
kernel over ``[B, KV heads, group, D]`` queries instead of ``enable_gqa`` over ``[B, heads, 1, D]``.

Why: with grouped-query attention (several query heads per key-value head, SmolLM2 and Qwen2.5 among the models
we train) and no attention mask (prompts without padding), transformers' ``sdpa`` attention passes
``enable_gqa=True`` for a one-token query. On a CPU in bfloat16, torch's flash-attention kernel is then several
times slower than the same kernel given the group's query heads as a query of ``group`` tokens, each against the
same keys, and the gap grows with the keys (``bench/results/decode_attention.md``, SmolLM2-135M's heads).
transformers already packs this way when a mask is passed (``pack_gqa``); this packs every one-token query.

Where: :func:`lit_rl.models.sampling.sample_completions` (every rollout and held-out completion, the own loops and
``generate`` alike) attends through :func:`packed_sdpa_forward`, which packs a one-token query of grouped heads in
bfloat16 or float16 on a CPU (a float32 query under a bf16 or fp16 CPU autocast included: the attention runs in
autocast's dtype) and hands everything else to transformers' ``sdpa_attention_forward`` unchanged: float32 (where
packing gains little, and the own loop keeps ``generate``'s kernels and so its tokens), a GPU, prefill and other
multi-token queries, models without grouped heads, a position bias or a soft cap.

Exactness: the packed call attends each query head over its own key-value head as the grouped call does; the
kernel's blocking differs, so an output can differ from ``enable_gqa``'s in its last bit (a bf16 unit in the last
place). The own loop and ``generate`` both run it, so they still draw the same tokens; the trainer's passes over
whole sequences never did run this kernel (the sampler's gap to them is logged each step).
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
    ``([B, Q, H, D], None)``. A one-token query of grouped heads in bfloat16 or float16 on a CPU runs packed (module
    docstring), and so does a float32 one under a bf16 or fp16 CPU autocast (bf16-mixed, the bf16 sampler: RoPE's
    float32 tables make the query float32, and autocast runs the attention in its dtype); anything else goes to
    ``sdpa_attention_forward``."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    plain = kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or dropout
    on_cpu = query.device.type == "cpu"
    runs_in = query.dtype  # under CPU autocast a float32 query (after float32 RoPE) attends in autocast's dtype
    if on_cpu and runs_in == torch.float32 and torch.is_autocast_enabled("cpu"):
        runs_in = torch.get_autocast_dtype("cpu")
    half_on_cpu = on_cpu and runs_in in (torch.bfloat16, torch.float16)
    per_head_mask = attention_mask is not None and attention_mask.shape[1] != 1
    if length != 1 or kv_heads == heads or plain or per_head_mask or not half_on_cpu:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return _packed(query, key, value, attention_mask, scaling), None


def _packed(query, key, value, mask, scaling) -> torch.Tensor:
    """``[B, 1, H, D]``: the attention of a one-token ``query [B, H, 1, D]`` with each key-value head's query heads
    as one query of that many tokens (``[B, KV, group, D]``)."""
    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, key.shape[1], heads // key.shape[1], dim)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous()


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
