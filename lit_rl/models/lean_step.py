"""``model.decode: lean``: the decode loop with its one-token step written out for Llama-family decoders.

Why: after the prefill a rollout feeds one token per row at a time, and a few rows' token step through
transformers' forward wraps its skinny matmuls in each layer's module calls, keyword plumbing, mask and cache
bookkeeping and a few dozen small kernels. :class:`LeanSteps` runs the same layer as a plain loop over the model's
own modules: per layer two norms, the projections, RoPE, one write of the new key and value into the loop's
preallocated cache and one attention call with the query heads packed per key-value head (a one-token query of
``group`` heads is a ``group``-token query against the same keys: transformers' ``pack_gqa``,
:mod:`lit_rl.models.decode_attention`). It is the step of :func:`lit_rl.models.decode.decode`, so sampling, EOS,
``min_new_tokens``, the fast draw and the log-probs are that loop's, unchanged. ``bench/results/rollout_lean.md``
measures it beside the other samplers on a CPU: it gains on the plain float32 loop and not on the packed float32
or bf16 samplers, whose token step is mostly the projections reading their weights from memory
(``bench/results/packed_linear_float32.md``, its last table). The GPU check (``bench/device_check.py``) puts it
beside the other loops, where kernel launches, not memory, may bound a step.

What it keeps of the model: the norms, the rotary tables and every projection are called through the modules' own
``forward`` (so a packed, cast or merged weight, :mod:`lit_rl.models.cast_once` and
:mod:`lit_rl.models.merged_lora`, is read as the loop reads it, and LoRA adapters that are not merged run), the
attention scale is the module's. What it leaves out: module hooks (a model that has any runs the loop's forward),
dropout (the rollout runs in eval mode).

Exactness: the same operations in the same order on the same numbers, except the attention's blocking (the packed
call, as the half-precision loop already runs) and a boolean mask in place of transformers' own; the logits are close
to the loop's, not bitwise (``tests/test_lean_step.py`` bounds them on random models, and at load time the step must
give ``generate``'s greedy tokens on random prompts). The sampler's log-probs are recorded and compared with the
trainer's as for every sampler (``rollout/sampler_*``).

Which models (:func:`lean_unsupported`, at load time; otherwise the eager loop runs, said in one line): the model
types in :data:`LEAN_MODEL_TYPES`, whose decoder layers are exactly a pre-norm attention block (``q/k/v/o_proj``,
optionally Qwen3's per-head ``q_norm``/``k_norm``) and a SiLU-gated MLP, with no embedding or logit scaling, no soft
cap and no sliding window; not sharded (FSDP2 gathers a layer's weights in its forward hooks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lit_rl.models.decode import decode, decode_unsupported, preallocate, weights_are_real
from lit_rl.models.head import base_model

__all__ = ["LEAN_MODEL_TYPES", "LeanSteps", "lean_decode", "lean_unsupported"]

#: model types whose decoder layer :class:`LeanSteps` writes out (others may share the module names, not the math)
LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_TRUNK = {"embed_tokens", "layers", "norm", "rotary_emb"}
_LAYER = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP = {"gate_proj", "up_proj", "down_proj", "act_fn"}
_NORMS = {"q_norm", "k_norm"}
# configuration that changes the math of a layer the structure above does not show
_SCALINGS = ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attn_logit_softcapping",
             "final_logit_softcapping")  # fmt: skip


def _children(module: torch.nn.Module) -> set[str]:
    return {name for name, _ in module.named_children()}


def _forward(module: torch.nn.Module):
    """What a call of ``module`` runs, without ``Module.__call__``: a LoRA layer whose adapters are off (merged for
    the rollout) is its base layer; a layer whose forward was replaced on the instance (a packed weight) is that."""
    if getattr(module, "disable_adapters", False) and hasattr(module, "base_layer"):
        return _forward(module.base_layer)
    return module.forward


def _has_hooks(model: torch.nn.Module) -> bool:
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs")
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return True
    return any(getattr(m, h, None) for m in model.modules() for h in hooks)


def lean_unsupported(model) -> str | None:
    """Why ``model.decode: lean`` cannot run for ``model`` (``None`` when it can), decided at load time: the model
    type, the layers' structure and configuration (module docstring), and the step's greedy tokens against
    ``generate``'s on random prompts (:func:`lit_rl.models.decode.decode_unsupported`)."""
    hf = base_model(model)
    config = hf.config
    if config.model_type not in LEAN_MODEL_TYPES:
        known = ", ".join(LEAN_MODEL_TYPES)
        return f"its model type {config.model_type!r} is not one the lean step writes out ({known})"
    trunk = getattr(hf, "model", None)
    if trunk is None or _children(trunk) != _TRUNK or hf.get_output_embeddings() is None:
        return "its decoder is not embed_tokens, layers, norm and rotary_emb under an LM head"
    for layer in trunk.layers:
        attention = _children(layer.self_attn)  # the projections, and nothing else or Qwen3's two per-head norms
        if _children(layer) != _LAYER or not _ATTENTION <= attention or attention - _ATTENTION not in (set(), _NORMS):
            return f"its layer {type(layer).__name__} is not a pre-norm attention block and MLP"
        if _children(layer.mlp) != _MLP or config.hidden_act != "silu":
            return f"its MLP is not SiLU-gated (hidden_act {config.hidden_act!r})"
    scaled = [name for name in _SCALINGS if getattr(config, name, None) not in (None, 1, 1.0)]
    windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if scaled or windowed:
        return f"it scales or caps what Llama does not ({', '.join(scaled) or 'a sliding window'})"
    if any(hasattr(p, "to_local") for p in hf.parameters()):
        return "its weights are sharded (FSDP2 gathers each layer in its forward hooks)"
    if not weights_are_real(hf):  # an estimate has no values to compare
        return None
    reason = decode_unsupported(model, step=LeanSteps(model))
    return None if reason is None else f"its lean step: {reason}"


class LeanSteps:
    """The one-token steps of one rollout, written out (module docstring): the ``step`` of
    :func:`lit_rl.models.decode.decode`, over the loop's own preallocated cache."""

    #: the loop keeps its weight casts (:mod:`lit_rl.models.cast_once`) around this step: it calls the projections
    casts_weights = True

    def __init__(self, model) -> None:
        self.model = model
        self.mask: torch.Tensor | None = None  # [B, 1, 1, P + N] boolean, True where a query attends; None: all

    def start(self, cache, mask: torch.Tensor) -> bool:
        """Take the prefilled ``cache`` (moved into preallocated buffers); ``False``: the loop's forward goes on.

        ``mask``: ``[B, P + N]``, the loop's mask for the longest sequence (prompt mask, then ones).
        """
        b, total = mask.shape
        if total - cache.get_seq_length() < 2 or _has_hooks(self.model):  # one new token, or hooks to honour
            return False
        preallocate(cache, total - 1)  # the last token is never fed back
        self.layers = cache.layers
        self.mask = None if bool(mask.all()) else mask.bool()[:, None, None, :]
        hf = base_model(self.model)
        trunk, config = hf.model, hf.config
        self.embed, self.rotary, self.norm = _forward(trunk.embed_tokens), trunk.rotary_emb, _forward(trunk.norm)
        self.head = _forward(hf.get_output_embeddings())
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.blocks = []
        for layer in trunk.layers:
            a, m = layer.self_attn, layer.mlp
            norms = [_forward(a.q_norm) if hasattr(a, "q_norm") else None,
                     _forward(a.k_norm) if hasattr(a, "k_norm") else None]  # fmt: skip
            self.blocks.append((
                _forward(layer.input_layernorm), _forward(a.q_proj), _forward(a.k_proj), _forward(a.v_proj),
                *norms, _forward(a.o_proj), a.scaling, _forward(layer.post_attention_layernorm),
                _forward(m.gate_proj), _forward(m.up_proj), _forward(m.down_proj), m.act_fn,
            ))  # fmt: skip
        return True

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Rows ``rows [A]`` (indices) go on decoding; the loop drops the others from the cache itself."""
        if self.mask is not None:
            self.mask = self.mask[rows]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of the next token after ``tokens [B, 1]`` at ``positions [B, 1]``."""
        b = tokens.shape[0]
        h = self.embed(tokens)  # [B, 1, H]
        cos, sin = self.rotary(h, positions)  # [B, 1, D]
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, 1, D] over heads
        heads, kv_heads = self.heads, self.kv_heads
        t = self.layers[0].length  # where this token's key and value go
        mask = None if self.mask is None else self.mask[..., : t + 1]  # [B, 1, 1, t + 1]
        for layer, block in zip(self.layers, self.blocks):
            norm1, q_proj, k_proj, v_proj, q_norm, k_norm, o_proj, scaling, norm2, gate, up, down, act = block
            x = norm1(h)
            q = q_proj(x).view(b, heads, -1)  # [B, heads, D]
            k = k_proj(x).view(b, kv_heads, -1)  # [B, kv heads, D]
            v = v_proj(x).view(b, kv_heads, 1, -1)  # [B, kv heads, 1, D]
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            q = _rope(q[:, :, None], cos, sin)  # [B, heads, 1, D]
            k = _rope(k[:, :, None], cos, sin)
            keys, values = layer.update(k, v)  # [B, kv heads, t + 1, D]
            q = q.view(b, kv_heads, heads // kv_heads, -1)  # one kv head's query heads as a query of that many tokens
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)  # [B, kv, group, D]
            h = h + o_proj(o.reshape(b, 1, -1))
            x = norm2(h)
            h = h + down(act(gate(x)) * up(x))
        return self.head(self.norm(h)[:, -1])  # [B, V]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor: ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def lean_decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, **settings: Any):
    """:func:`lit_rl.models.decode.decode` with its steps after the prefill written out (same arguments and result)."""
    return decode(model, input_ids, attention_mask, step=LeanSteps(model), **settings)
