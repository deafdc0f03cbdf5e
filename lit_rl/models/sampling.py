"""The training and evaluation sampler: complete prompts with the policy, through our decode loops where they apply.

Methods sample their rollouts with :func:`sample_completions` and held-out evaluation completes its prompts with it:
one call that repeats each prompt for its samples (computing a shared prompt's KV cache once), picks the decode loop
the model passed at load time (:mod:`lit_rl.models.decode`, :mod:`lit_rl.models.compiled_decode`) or
``transformers``' ``generate``, and leaves the policy in the mode it found it in. On a CPU its half-precision decode
steps attend with grouped query heads packed (:mod:`lit_rl.models.decode_attention`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from lit_rl.models.cache_keyword import cache_kwargs
from lit_rl.models.cast_once import float32_packing_unsupported, float32_weights_packed
from lit_rl.models.compiled_decode import compiled_decode
from lit_rl.models.decode import decode, sampling_settings, weights_are_real
from lit_rl.models.decode_attention import packed_decode_attention
from lit_rl.models.lean_step import lean_decode
from lit_rl.models.merged_lora import lora_merged
from lit_rl.models.notices import say_once
from lit_rl.models.sharding import gathered
from lit_rl.models.shared_prompt import shared_prefill


@torch.no_grad()
def sample_completions(
    policy,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pad_id: int,
    eos: list[int],
    *,
    repeats: int = 1,
    share_prompt: bool = False,
    own_decode: bool | str = False,
    return_logprobs: bool = False,
    fast_draw: bool = False,
    rows_at_once: int | None = None,
    **config: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """Complete each prompt ``repeats`` times in eval mode with a fresh ``GenerationConfig(**config)``:
    ``[B * repeats, P + C]`` sequences.

    A fresh config because checkpoint defaults (``top_k=50``, repetition penalties) would bias the samples. Rows
    ``i * repeats ...`` continue prompt ``i``; with ``share_prompt`` the prompts' KV cache is computed once and
    repeated (:func:`lit_rl.models.shared_prompt.shared_prefill`), which draws the same samples as repeating the
    prompts up to floating-point order. With ``own_decode`` (decided per model at load time: ``True`` or ``"own"``)
    the tokens come from :func:`lit_rl.models.decode.decode`, the same tokens as ``policy.generate`` in fewer
    seconds, with ``"compiled"`` from :func:`lit_rl.models.compiled_decode.compiled_decode` (its step compiled,
    logits close to ``generate``'s), with ``"lean"`` from :func:`lit_rl.models.lean_step.lean_decode` (its step
    written out, logits close to ``generate``'s); ``generate`` runs where a setting of the merged generation config
    is not one the loop implements, and on fake tensors (where the estimator stands in for ``generate``).

    ``return_logprobs``: ``(sequences, sampler log-probs [B * repeats, C] or None)``: the decode loops record them
    (:func:`lit_rl.models.decode.decode`); ``generate`` does not (``None``), except on fake tensors, where zeros of
    that shape stand in so an estimate charges the bytes the loop would hold.

    ``fast_draw``: the own loop drops rows as they end and draws each token from one uniform number
    (:func:`lit_rl.models.decode.decode`'s ``drop_ended`` and ``draw="inverse_cdf"``): the same distribution,
    not ``generate``'s tokens for a seed. No effect on the compiled step or ``generate``.

    ``rows_at_once``: at most this many completions are decoded together (``None``: all ``B * repeats``). The rows
    are cut into chunks (:func:`rollout_chunks`), each completed by its own call, so the KV cache and the decode's
    per-row tensors hold one chunk's rows while the others wait; the chunks are padded with ``pad_id`` (log-probs
    with 0) to the longest. Each chunk draws from the random stream after the one before, so a seed gives other
    tokens than one call would (from the same distribution); with ``share_prompt`` each chunk prefills its prompt
    once, so a prompt cut into ``k`` chunks is prefilled ``k`` times.
    """
    chunks = rollout_chunks(input_ids.shape[0], repeats, rows_at_once)
    if len(chunks) > 1:
        chunk = dict(share_prompt=share_prompt, own_decode=own_decode, return_logprobs=True, fast_draw=fast_draw)
        parts = [
            sample_completions(
                policy, input_ids[i : i + n], attention_mask[i : i + n], pad_id, eos, repeats=r, **chunk, **config
            )
            for i, n, r in chunks
        ]
        width = max(seq.shape[1] for seq, _ in parts)
        sequences = torch.cat([F.pad(seq, (0, width - seq.shape[1]), value=pad_id) for seq, _ in parts])  # [B*r, P+C]
        if not return_logprobs:
            return sequences
        logprobs = [lp for _, lp in parts]
        if any(lp is None for lp in logprobs):
            return sequences, None
        new = width - input_ids.shape[1]
        return sequences, torch.cat([F.pad(lp, (0, new - lp.shape[1]), value=0.0) for lp in logprobs])  # [B*r, C]
    config = GenerationConfig(pad_token_id=pad_id, eos_token_id=eos, use_cache=True, **config)
    settings = None
    if own_decode and weights_are_real(policy):
        settings, reason = sampling_settings(policy, config)
        if reason is not None:
            say_once(f"model.decode: transformers' generate for these completions, {reason}")
    was_training = policy.training
    policy.eval()
    with contextlib.ExitStack() as stack:
        stack.callback(policy.train, was_training)
        stack.enter_context(packed_decode_attention(policy))  # half-precision decode steps on a CPU (its docstring)
        cache = None
        if share_prompt and repeats > 1 and input_ids.shape[1] > 1:
            cache = shared_prefill(policy, input_ids, attention_mask, repeats)
        input_ids = input_ids.repeat_interleave(repeats, dim=0)  # [B * repeats, P]
        attention_mask = attention_mask.repeat_interleave(repeats, dim=0)
        if settings is not None:
            run = {"compiled": compiled_decode, "lean": lean_decode}.get(own_decode, decode)
            fast = dict(drop_ended=True, draw="inverse_cdf") if fast_draw and run is not compiled_decode else {}
            return run(
                policy, input_ids, attention_mask, eos=eos, pad_id=pad_id, cache=cache,
                return_logprobs=return_logprobs, **settings, **fast,
            )  # fmt: skip
        sequences = policy.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config, **cache_kwargs(policy, cache)
        )
        if not return_logprobs:
            return sequences
        standing_in = own_decode and not weights_are_real(policy)  # an estimate of a run whose loop records them
        width = sequences.shape[1] - input_ids.shape[1]
        return sequences, sequences.new_zeros((sequences.shape[0], width), dtype=torch.float32) if standing_in else None


def rollout_chunks(prompts: int, repeats: int, rows: int | None) -> list[tuple[int, int, int]]:
    """How :func:`sample_completions` cuts ``prompts x repeats`` completions into chunks of at most ``rows``:
    ``(first prompt, prompts, completions per prompt)`` per chunk, in row order. At ``rows >= repeats`` a chunk
    holds whole groups (``rows // repeats`` prompts, all their completions); below, one prompt's completions are cut
    into runs of ``rows``. ``None`` (or enough rows): one chunk of everything.

    Raises:
        ValueError: ``rows`` below 1.
    """
    if rows is None or rows >= prompts * repeats:
        return [(0, prompts, repeats)]
    if rows < 1:
        raise ValueError(f"rows_at_once: must be >= 1, got {rows}")
    if rows >= repeats:
        k = rows // repeats
        return [(i, min(k, prompts - i), repeats) for i in range(0, prompts, k)]
    return [(i, 1, min(rows, repeats - j)) for i in range(prompts) for j in range(0, repeats, rows)]


@contextlib.contextmanager
def rollout_sampler(policy, *, dtype: str = "same", lora: str = "adapters", linear: str = "plain") -> Iterator[None]:
    """The model a rollout samples with, as one context around :func:`sample_completions`.

    ``dtype="bfloat16"`` with float32 weights: the matmuls run under bf16 autocast (its cast cache off; the decode
    loop casts each weight once, :mod:`lit_rl.models.cast_once`). ``linear="packed"`` with float32 weights and no
    autocast: the decode loop's linear layers run oneDNN on float32 copies packed once
    (:func:`lit_rl.models.cast_once.float32_weights_packed`); where that cannot run it says so once. ``lora="merged"``:
    LoRA layers read merged weights (:func:`lit_rl.models.merged_lora.lora_merged`); a model whose LoRA layers
    cannot merge says so once.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(gathered(policy))  # sharded (FSDP2): each unit gathered once, not once per token
        weight = next(policy.parameters())
        if dtype == "bfloat16" and weight.dtype == torch.float32:
            stack.enter_context(torch.autocast(weight.device.type, dtype=torch.bfloat16, cache_enabled=False))
        if linear == "packed":
            reason = float32_packing_unsupported(weight.device)
            if weight.dtype != torch.float32 or torch.is_autocast_enabled(weight.device.type):
                reason = "the rollout does not compute in float32 (its bf16 casts are packed where that is exact)"
            if reason is None:
                stack.enter_context(float32_weights_packed())
            else:
                say_once(f"model.rollout_linear: packed has no effect: {reason}")
        if lora == "merged":
            merged, left = stack.enter_context(lora_merged(policy))
            if left:
                say_once(
                    f"model.rollout_lora: merged: {left} of {merged + left} LoRA layers run their adapters in the "
                    "rollout (a quantized base, a LoRA variant or an adapter bias has no merged weight here)"
                )
            elif not merged:
                say_once("model.rollout_lora: merged has no effect: the policy has no LoRA layers")
        yield
