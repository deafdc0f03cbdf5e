"""Prompt embeddings: one no-grad pass of the policy over every prompt, mean-pooled over its tokens.

How this differs from embedding prompts by their logits: embeddings are the
mean-pooled **last hidden state** (576 dims for SmolLM2-135M) instead of mean-pooled logits (50,304
dims): 28k prompts take 64 MB in float32 (32 MB in float16) where logits would take 28k x 50,304 x 4 bytes = 5.6 GB.
``pooling="logits"`` keeps the logits definition for parity, and even then no ``[B, T, V]`` logits
tensor is built: the LM head is linear, so the mean of the logits over tokens equals the LM head
applied to the mean hidden state.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lit_rl.data.density.arrays import release_pages
from lit_rl.models import base_model, lm_head, trunk

POOLINGS = ("hidden", "logits")
DTYPES = {"float32": np.float32, "float16": np.float16}


def _exposed_trunk(model: torch.nn.Module) -> torch.nn.Module | None:
    """The transformer without its LM head (``model.model`` / ``model.transformer``), if exposed."""
    try:
        body = trunk(model)
    except AttributeError:  # not a transformers model, or one without a named trunk
        return None
    return body if isinstance(body, torch.nn.Module) and body is not model else None


def _linear_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head when logits are a plain linear map of the last hidden state, else ``None``."""
    head = lm_head(model) if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    if not isinstance(head, torch.nn.Linear):
        return None
    # soft-capping (Gemma 2) or a logit scale (Cohere) would make mean(logits) != head(mean(hidden))
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return None
    return head


def _accepts(module: torch.nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # masked_fill, not a product: fully masked pad rows may hold NaN after attention
    x = x.float().masked_fill(~mask[..., None], 0.0)  # [B, T, D]
    return x.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)  # [B, D]


class _Pooler:
    """One embedding pass per batch, with what it needs (trunk, LM head, signature) resolved once."""

    def __init__(self, model: torch.nn.Module, pooling: str) -> None:
        self.model, self.pooling = model, pooling
        body = _exposed_trunk(model)
        head = _linear_head(model) if pooling == "logits" else None
        # the trunk alone when the LM head is not needed or can be applied after pooling
        self.trunk = body if body is not None and (pooling == "hidden" or head is not None) else None
        self.head_weight = head.weight.float() if self.trunk is not None and head is not None else None  # [V, H]
        self.head_bias = head.bias.float() if self.head_weight is not None and head.bias is not None else None
        self.positions = _accepts(self.trunk if self.trunk is not None else model, "position_ids")

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.bool()  # [B, T]
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
        if self.positions:
            # counted from the first real token, so the amount of left padding never changes a
            # vector (models with absolute position embeddings would otherwise shift with it)
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
        if self.trunk is not None:
            out = self.trunk(**kwargs)
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # [B, T, H]
            pooled = _masked_mean(hidden, mask)  # [B, H]
            if self.head_weight is not None:
                # the mean over tokens commutes with the linear head: no [B, T, V] tensor
                pooled = pooled @ self.head_weight.T  # [B, V]
                if self.head_bias is not None:
                    pooled = pooled + self.head_bias
            return pooled
        # fallback for models whose trunk is not exposed: the full forward (logits are computed)
        out = self.model(**kwargs, output_hidden_states=self.pooling == "hidden")
        states = out.hidden_states[-1] if self.pooling == "hidden" else out.logits  # [B, T, H or V]
        return _masked_mean(states, mask)


def embed_prompts(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    pooling: str = "hidden",
    batch_size: int = 16,
    max_length: int = 256,
    dtype: str = "float32",
    out_path: str | os.PathLike | None = None,
    progress: bool = True,
    sort_by_length: bool = True,
) -> np.ndarray:
    """Embed already-formatted prompt strings with a causal LM, one batch at a time.

    The model runs in eval mode without gradients. ``pooling="hidden"`` mean-pools the last hidden
    state over non-pad tokens through the model's trunk (``model.base_model``), so the LM head never
    runs; ``pooling="logits"`` mean-pools the logits (``D = vocab``) computed
    as ``lm_head(mean hidden)``, which is equal for a linear head and never builds ``[B, T, V]``.
    Position ids count from the first real token, so a prompt's vector does not depend on how much
    padding its batch needed. The training mode of the model is restored afterwards.

    Args:
        model: a transformers causal LM (or a peft model wrapping one).
        tokenizer: its tokenizer; padded on the left; when it has no pad token, EOS is used.
        texts: the prompts, already formatted (chat template applied).
        pooling: ``"hidden"`` (``D = hidden_size``) or ``"logits"`` (``D = vocab_size``).
        batch_size: prompts per forward pass.
        max_length: prompts are truncated to this many tokens.
        dtype: ``"float32"`` or ``"float16"`` (half the storage; distances are still computed in float32).
        out_path: write into an ``.npy`` memmap at this path, row by row, and return it: the matrix
            never has to fit in RAM.
        progress: show a tqdm progress bar.
        sort_by_length: batch prompts of similar length together (less padding); rows are written
            back in the input order.

    Returns:
        ``[N, D]`` array (a ``np.memmap`` when ``out_path`` is given), row ``i`` for ``texts[i]``.

    Raises:
        ValueError: on an unknown ``pooling`` or ``dtype``, or no texts.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r} is not supported; use one of {POOLINGS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {tuple(DTYPES)}")
    n = len(texts)
    if n == 0:
        raise ValueError("embed_prompts got no texts")
    np_dtype = DTYPES[dtype]
    model = base_model(model)  # a peft PeftModel forwards to the causal LM it wraps; adapters stay active
    device = next(model.parameters()).device
    order = sorted(range(n), key=lambda i: len(texts[i])) if sort_by_length else list(range(n))

    saved = (tokenizer.padding_side, tokenizer.pad_token)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    was_training = model.training
    model.eval()
    pooler = _Pooler(model, pooling)
    out: np.ndarray | None = None
    try:
        with tqdm(total=n, desc=f"embed ({pooling})", unit="prompt", disable=not progress) as bar:
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                enc = tokenizer(
                    [texts[i] for i in idx], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
                )
                emb = pooler(enc["input_ids"].to(device), enc["attention_mask"].to(device)).cpu().numpy()  # [b, D]
                if out is None:  # the width is known after the first batch
                    shape = (n, emb.shape[1])
                    if out_path is not None:
                        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
                        out = np.lib.format.open_memmap(os.fspath(out_path), mode="w+", dtype=np_dtype, shape=shape)
                    else:
                        out = np.empty(shape, dtype=np_dtype)
                if sort_by_length:
                    out[np.asarray(idx)] = emb
                else:
                    out[start : start + len(idx)] = emb
                if isinstance(out, np.memmap) and (start // batch_size) % 256 == 255:
                    out.flush()  # written pages leave RSS: millions of rows never sit in memory
                    release_pages(out)
                bar.update(len(idx))
    finally:
        tokenizer.padding_side, tokenizer.pad_token = saved
        model.train(was_training)
    if isinstance(out, np.memmap):
        out.flush()
    return out
