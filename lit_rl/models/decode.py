"""Our own decode loop: a preallocated KV cache, sampling in the loop, the same tokens as ``generate``.

Why: ``transformers``' ``generate`` keeps its KV cache in a ``DynamicCache`` that grows by ``torch.cat`` at every
new token, in every layer, for keys and values: each step copies the whole cache once and allocates a fresh block
for it, a cost that grows with the square of the completion length; around the forward it rebuilds the mask and
positions by concatenation. Measured on this project's CPU rollout (``bench/results/decode.md``), those copies are
a small part of a step: the forward itself (its skinny matrix multiplies and a few hundred small kernels per token)
takes the time, about three times its floor in ``bench/results/roofline.md``, so the loop is about as fast as
``generate`` for short completions and gains with the length. Its steps after the prefill can be replaced
(``step``): :mod:`lit_rl.models.compiled_decode` runs them through ``torch.compile`` over a static cache.

How :func:`decode` differs, and what it keeps:

- **The cache** is a ``DynamicCache`` whose layers are :class:`PreallocatedLayer`: one buffer per layer of
  ``prompt + max_new_tokens`` positions, allocated once; a step writes its key and value into the next slot and the
  attention reads a view of the filled part. The attention therefore sees exactly the keys and values ``generate``
  would pass it, in the same order, so the logits are the same numbers (the tests compare tokens and logits with
  ``generate``'s on random models). A shared-prompt prefill (:func:`lit_rl.models.shared_prompt.shared_prefill`)
  is moved into such a cache once, after it is repeated per completion.
- **Mask and positions** are built once for the longest sequence and sliced per step, numbered as ``generate``
  numbers them (an all-ones prompt mask is dropped, as ``generate`` drops it).
- **Sampling** runs inside the loop on float32 logits in ``generate``'s order: EOS forbidden while fewer than
  ``min_new_tokens`` are out, temperature, top-k, top-p, then ``torch.multinomial`` on the softmax (greedy:
  ``argmax``). Rows that ended get the pad token; the loop exits when every row has ended. With the same random
  state the sampled tokens are the ones ``generate`` draws.
- **Less work, the same distribution** (``model.rollout_draw: fast``): rows that ended can leave the batch
  (``drop_ended``), and each token can come from one uniform number per row (``draw="inverse_cdf"``,
  :func:`inverse_cdf_draw`) instead of ``torch.multinomial``'s exponential number per vocabulary entry.
- **Under mixed precision** (an autocast with its cast cache off, as Lightning runs one) each ``nn.Linear``
  weight is cast once for the whole loop instead of at every token (:mod:`lit_rl.models.cast_once`): the same
  logits, for the casts' memory held through the rollout.
- **Which models.** :func:`decode_unsupported` rules out, at load time, architectures whose cache is not a plain
  list of growing key/value layers (sliding windows, recurrent or linear-attention states) and runs both loops
  greedily on random tokens to compare them. A ``generate`` setting the loop does not implement (a model's own
  repetition penalty, bad-word lists, ...) is found per call by :func:`sampling_settings`; either way the
  caller falls back to ``generate``.

Not here: the compiled step (:mod:`lit_rl.models.compiled_decode`, ``model.decode: compiled``); beam search;
GumbelTopK's differentiable decode, whose cache lives in the autograd graph.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from transformers import DynamicCache, DynamicLayer, GenerationConfig

from lit_rl.models.cache_keyword import cache_keyword
from lit_rl.models.cast_once import linear_weights_cast_once
from lit_rl.models.head import base_model

__all__ = [
    "PreallocatedLayer",
    "decode",
    "decode_unsupported",
    "inverse_cdf_draw",
    "min_new_tokens_filter",
    "preallocate",
    "top_k_filter",
    "sampling_settings",
    "top_p_filter",
    "weights_are_real",
]


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers of ``capacity`` positions; ``keys``/``values`` view the filled part.

    A ``DynamicLayer`` (so ``transformers`` treats it as an attention layer) whose ``update`` writes in place
    instead of concatenating.
    """

    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        super().__init__()
        b, h, n, d = keys.shape  # [B, Hkv, N, D]; values may have another head size (MLA)
        if capacity < n:
            raise ValueError(f"capacity {capacity} is below the {n} positions already cached")
        self._keys = keys.new_empty((b, h, capacity, d))  # [B, Hkv, capacity, D]
        self._values = values.new_empty((b, values.shape[1], capacity, values.shape[3]))
        self._keys[:, :, :n].copy_(keys)
        self._values[:, :, :n].copy_(values)
        self._view(n)
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def _view(self, length: int) -> None:
        self.length = length
        self.keys = self._keys[:, :, :length]  # [B, Hkv, length, D]
        self.values = self._values[:, :, :length]

    @property
    def capacity(self) -> int:
        return self._keys.shape[2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        new = key_states.shape[2]
        if self.length + new > self.capacity:
            raise RuntimeError(f"the preallocated KV cache holds {self.capacity} positions; {self.length + new} needed")
        self._keys[:, :, self.length : self.length + new].copy_(key_states)
        self._values[:, :, self.length : self.length + new].copy_(value_states)
        self._view(self.length + new)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self._view(0)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows [A]`` (indices), in new buffers: the ended rows' memory is freed."""
        self._keys = self._keys.index_select(0, rows)  # [A, Hkv, capacity, D]
        self._values = self._values.index_select(0, rows)
        self._view(self.length)


def _plain_layers(cache) -> bool:
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def preallocate(cache, capacity: int) -> None:
    """Move every layer of ``cache`` (a ``DynamicCache`` of plain layers, filled or not) into buffers of
    ``capacity`` positions, in place."""
    layers = []
    for layer in cache.layers:
        if isinstance(layer, PreallocatedLayer):
            layers.append(layer)
            continue
        keys, values = layer.keys, layer.values
        if keys is None or keys.numel() == 0:
            raise ValueError("preallocate needs a cache that holds at least one position (run the prefill first)")
        layers.append(PreallocatedLayer(keys, values, capacity))
        layer.keys = layer.values = None  # the growing tensors die here, not at the end of the rollout
    cache.layers = layers


def min_new_tokens_filter(scores: torch.Tensor, eos: torch.Tensor, produced: int, min_new_tokens: int):
    """EOS ids get ``-inf`` while fewer than ``min_new_tokens`` tokens are out. ``scores [B, V]`` float32."""
    if produced >= min_new_tokens:
        return scores
    return scores.index_fill(1, eos, float("-inf"))


def top_k_filter(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest scores of each row (ties with the k-th kept), the rest ``-inf``. ``[B, V]``."""
    k = min(k, scores.shape[-1])
    kth = torch.topk(scores, k)[0][..., -1, None]  # [B, 1]
    return scores.masked_fill(scores < kth, float("-inf"))


def top_p_filter(scores: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p`` (at least one). ``[B, V]``."""
    ordered, order = torch.sort(scores, descending=False)  # [B, V] ascending
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    drop = cumulative <= (1 - p)
    drop[..., -1:] = False  # the most likely token always stays
    return scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def sampling_settings(model, config) -> tuple[dict[str, Any] | None, str | None]:
    """``generate``'s sampling settings for ``model`` as :func:`decode` keywords, or why the loop cannot follow them.

    ``config`` is merged with the model's own generation config as ``generate`` merges it (a value left unset
    comes from the checkpoint), and the logits processors ``generate`` would build from it are listed: the loop
    implements the minimum of new tokens, temperature, top-k and top-p. Returns ``(settings, None)`` or
    ``(None, reason)``.
    """
    try:
        from transformers.generation import (
            LogitsProcessorList,
            MinNewTokensLengthLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        merged, _ = model._prepare_generation_config(config)
        model._prepare_special_tokens(merged, True, device="cpu", batch_size=1)  # EOS-based processors need it
        processors = model._get_logits_processor(
            generation_config=merged,
            input_ids_seq_length=1,
            encoder_input_ids=torch.zeros(1, 1, dtype=torch.long),
            logits_processor=LogitsProcessorList(),
            device="cpu",
        )
    except Exception as err:  # a transformers version whose generate internals differ
        return None, f"generate's settings could not be read ({type(err).__name__})"
    known = {
        MinNewTokensLengthLogitsProcessor: "min_new_tokens",
        TemperatureLogitsWarper: "temperature",
        TopKLogitsWarper: "top_k",
        TopPLogitsWarper: "top_p",
    }
    others = sorted({type(p).__name__ for p in processors if type(p) not in known})
    if others:
        return None, f"the generation config asks for {', '.join(others)}"
    if (merged.num_beams or 1) > 1 or (merged.num_return_sequences or 1) > 1:
        return None, "the generation config asks for beams or several sequences per row"
    used = {known[type(p)] for p in processors}
    settings = dict(
        max_new_tokens=merged.max_new_tokens,
        do_sample=bool(merged.do_sample),
        min_new_tokens=merged.min_new_tokens if "min_new_tokens" in used else 0,
        temperature=merged.temperature if "temperature" in used else 1.0,
        top_k=merged.top_k if "top_k" in used else 0,
        top_p=merged.top_p if "top_p" in used else 1.0,
    )
    return settings, None


def weights_are_real(model) -> bool:
    """Whether ``model``'s weights hold values (not meta or fake tensors, as in an estimate)."""
    weight = base_model(model).get_input_embeddings().weight
    weight = weight.to_local() if hasattr(weight, "to_local") else weight  # sharded (FSDP2): this process's share
    return not (weight.is_meta or isinstance(weight, FakeTensor))


def _running(unfinished: torch.Tensor) -> int | None:
    """How many rows are still decoding (one host sync), or ``None`` on fake tensors, where an estimate's rollout
    runs every row to its longest."""
    if isinstance(unfinished, FakeTensor):
        return None
    return int(unfinished.sum())


@torch.no_grad()
def decode(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    eos: list[int],
    pad_id: int,
    max_new_tokens: int,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_new_tokens: int = 0,
    cache=None,
    step=None,
    return_logprobs: bool = False,
    drop_ended: bool = False,
    draw: str = "multinomial",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Complete ``input_ids [B, P]`` (left-padded, ``attention_mask [B, P]``): ``[B, P + C]`` as ``generate`` returns.

    ``C`` is the step at which every row has ended (EOS) or ``max_new_tokens``; rows that ended earlier are padded
    with ``pad_id``. ``cache``: a ``DynamicCache`` holding the first ``P - 1`` or fewer prompt positions (a shared
    prefill), or ``None``. The model runs as it is (the caller sets eval mode). ``step``: what runs every token
    after the prefill in place of the model's forward over the preallocated cache, or ``None``; its
    ``start(cache, mask [B, P + N])`` takes the prefilled cache (``False``: not taken, the forward goes on), a call
    ``step(tokens [B, 1], positions [B, 1])`` returns ``[B, V]`` logits
    (:class:`lit_rl.models.compiled_decode.StaticSteps`, :class:`lit_rl.models.lean_step.LeanSteps`); a step whose
    ``casts_weights`` is true keeps the loop's weight casts around it, one with ``keep_rows(rows [A])`` follows
    ``drop_ended``.

    ``return_logprobs``: also return the sampler's log-prob of each new token, ``[B, C]`` float32: its logit under
    ``temperature`` minus the log-sum-exp of all of them, before ``min_new_tokens``, top-k and top-p (the quantity
    the trainer recomputes; :mod:`lit_rl.losses.sampler` compares the two). Rows that ended hold the log-prob of
    the token drawn for them before it was replaced by the pad (0 with ``drop_ended``).

    ``drop_ended``: rows that ended leave the batch (their cache rows, mask and positions are dropped) and the
    forward runs on the others only, so finished completions cost nothing. The draw stays full-size: the rows
    still decoding are scattered into a ``[B, V]`` table (uniform in the ended rows) before ``torch.multinomial``,
    which draws each row from its own slice of the noise, so the tokens are the ones the full batch would draw as
    long as the forward gives a row the same logits in a smaller batch (batch invariance; on this CPU it does in
    the tests, a GPU's kernels may pick another reduction order per batch size). No effect with a ``step``
    without ``keep_rows`` (static shapes) or on fake tensors (an estimate charges the full batch).

    ``draw``: ``multinomial`` (``generate``'s draw: its tokens for the same random state) or ``inverse_cdf``
    (:func:`inverse_cdf_draw`: the same distribution from one uniform number per row, other tokens than
    ``generate``'s for a seed, and with ``drop_ended`` no full-size table).
    """
    if draw not in ("multinomial", "inverse_cdf"):
        raise ValueError(f"draw: {draw!r} is not multinomial or inverse_cdf; use one of them")
    b, p = input_ids.shape
    total = p + max_new_tokens
    device = input_ids.device
    mask = attention_mask.new_ones((b, total))  # [B, P + N] sliced per step
    mask[:, :p] = attention_mask
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # [B, P + N] as generate numbers them
    keep_mask = isinstance(attention_mask, FakeTensor) or not bool(attention_mask.all())  # generate drops all-ones
    sequences = input_ids.new_full((b, total), pad_id)  # [B, P + N]
    sequences[:, :p] = input_ids
    eos_ids = torch.tensor(eos, dtype=torch.long, device=device)
    if cache is None:
        cache = DynamicCache(config=base_model(model).config)
    cached = cache.get_seq_length()
    cache_key = cache_keyword(model)  # read once, not at every token
    unfinished = torch.ones(b, dtype=torch.long, device=device)  # [B], then [A] once rows are dropped
    logprobs = torch.zeros(b, max_new_tokens, dtype=torch.float32, device=device) if return_logprobs else None
    rows: slice | torch.Tensor = slice(None)  # the rows still decoding: all, or batch indices [A] (drop_ended)
    length = p
    # under mixed precision each weight is cast once for the rollout, not at every token (the same numbers)
    casts = step is None or getattr(step, "casts_weights", False)  # a step that calls the projections keeps them
    with linear_weights_cast_once(model) if casts else contextlib.nullcontext():
        for produced in range(max_new_tokens):
            fed = sequences[rows, cached:length]  # [A, new]
            if produced and step is not None:
                logits = step(fed, positions[:, cached:length])  # [B, V]
            else:
                logits = model(
                    input_ids=fed,
                    attention_mask=mask[:, :length] if keep_mask else None,
                    position_ids=positions[:, cached:length],
                    **{cache_key: cache},
                    use_cache=True,
                    logits_to_keep=1,
                    return_dict=True,
                ).logits[:, -1]  # [A, V]
                if produced == 0 and (step is None or not step.start(cache, mask)):
                    step = None
                    preallocate(cache, total - 1)  # after the prefill; the last token is never fed back
            scores = logits.to(copy=True, dtype=torch.float32)  # [A, V]
            del logits
            if logprobs is not None:  # the normaliser of the tempered distribution, before any filter
                lse = torch.logsumexp(scores / temperature if do_sample and temperature != 1.0 else scores, dim=-1)
            if min_new_tokens:
                scores = min_new_tokens_filter(scores, eos_ids, produced, min_new_tokens)
            if do_sample:
                if temperature != 1.0:
                    scores = scores / temperature
                if top_k:
                    scores = top_k_filter(scores, top_k)
                if top_p < 1.0:
                    scores = top_p_filter(scores, top_p)
                tokens = _draw(scores.softmax(dim=-1), rows, b, draw)  # [A]
            else:
                tokens = scores.argmax(dim=-1)  # [A]
            if logprobs is not None:  # filters only ever set tokens other than the sampled one to -inf
                logprobs[rows, produced] = scores.gather(1, tokens[:, None]).squeeze(1) - lse
            tokens = tokens * unfinished + pad_id * (1 - unfinished)
            sequences[rows, length] = tokens
            cached, length = length, length + 1
            unfinished = unfinished & ~torch.isin(tokens, eos_ids)
            running = _running(unfinished)
            if running == 0:
                break
            if drop_ended and running is not None and running < unfinished.shape[0] and _drops(step):
                keep = unfinished.nonzero().squeeze(1)  # [A'] positions among the rows still decoding
                rows = keep if isinstance(rows, slice) else rows[keep]
                for layer in cache.layers:
                    layer.keep_rows(keep)
                if step is not None:
                    step.keep_rows(keep)
                mask, positions, unfinished = mask[keep], positions[keep], unfinished[keep]
    if logprobs is not None:
        return sequences[:, :length], logprobs[:, : length - p]
    return sequences[:, :length]


def _drops(step) -> bool:
    """Whether rows can leave the batch: the model's own forward, or a step that follows them (``keep_rows``)."""
    return step is None or hasattr(step, "keep_rows")


def inverse_cdf_draw(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [A, V]`` from one uniform number per row: the first token whose cumulative
    probability exceeds it. The same distribution as ``torch.multinomial``, which draws an exponential number per
    token and row (``V`` times the noise: on a CPU at ``V`` = 49,152 about 0.7 ms per row)."""
    cumulative = probs.cumsum(dim=-1)  # [A, V]
    total = cumulative[:, -1:]  # [A, 1] 1 up to rounding
    u = torch.rand_like(total) * total  # [A, 1]
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # strictly below the total
    return torch.searchsorted(cumulative, u, right=True).squeeze(1)  # [A] never a token of probability 0


def _draw(probs: torch.Tensor, rows: slice | torch.Tensor, batch: int, draw: str) -> torch.Tensor:
    """One token per row of ``probs [A, V]``. ``multinomial`` with some rows dropped (``rows`` indices): drawn from a
    full ``[batch, V]`` table (uniform elsewhere) so that each row meets the noise it would meet in the full batch."""
    if draw == "inverse_cdf":
        return inverse_cdf_draw(probs)
    if isinstance(rows, slice):
        return torch.multinomial(probs, num_samples=1).squeeze(1)  # [B]
    full = probs.new_full((batch, probs.shape[1]), 1.0 / probs.shape[1])  # [B, V]
    full[rows] = probs
    return torch.multinomial(full, num_samples=1).squeeze(1)[rows]  # [A]


def decode_unsupported(model, step=None) -> str | None:
    """Why :func:`decode` is not exact for ``model`` (``None`` when it is), decided at load time.

    Rules out caches that are not plain growing key/value layers, then completes two random prompts (one
    left-padded) greedily with both loops and compares the tokens; with ``step`` (see :func:`decode`) the loop
    runs it after the prefill.
    """
    hf = base_model(model)
    try:
        cache = DynamicCache(config=hf.config)
    except Exception as err:  # any architecture whose cache transformers cannot describe
        return f"its cache layout is unknown ({type(err).__name__})"
    if not cache.layers or not _plain_layers(cache):
        kinds = sorted({type(layer).__name__ for layer in cache.layers}) or ["no layers"]
        return f"its cache has {', '.join(kinds)} (sliding-window, recurrent or linear-attention layers)"
    if not weights_are_real(hf):  # an estimate has no values to compare
        return None
    embedding = hf.get_input_embeddings().weight
    vocab = embedding.shape[0]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (2, 6), generator=gen, device="cpu").to(embedding.device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    pad = 0
    was_training = model.training
    model.eval()
    try:
        config = GenerationConfig(do_sample=False, max_new_tokens=5, pad_token_id=pad, eos_token_id=[vocab + 1])
        settings, reason = sampling_settings(model, config)
        if reason is not None:
            return reason
        expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        ours = decode(model, ids, mask, eos=[vocab + 1], pad_id=pad, step=step, **settings)
    except (NotImplementedError, RuntimeError, TypeError, ValueError, AttributeError) as err:
        return f"its forward does not take the preallocated cache ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    if not torch.equal(expected, ours):
        return "its greedy tokens differ from generate's on random prompts"
    return None
