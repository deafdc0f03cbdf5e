"""Logits-free token math: selected-token log-probs, entropy and self-certainty from hidden states.

A policy update needs, per token, a handful of scalars that depend on the whole vocabulary row of
logits ``z = softcap(scale * (h @ W.T + b)) / temperature`` (the head transforms of :mod:`lit_rl.ops.head`):
the log-normaliser ``logsumexp(z)``, the selected logit ``z[target]``, the mean logit and ``E_p[z]``. Materialising ``z`` for a batch costs ``B * T * V * 4``
bytes (8 GiB for 8 x 1024 tokens and a 256k vocabulary), and autograd would keep it, plus the
softmax, until backward. Here ``z`` is computed one block at a time — a block of tokens (``B * T``
flattened) by a block of vocabulary rows — and reduced on the fly with an online logsumexp, so the
``[B, T, V]`` tensor never exists.

What is saved for backward: the inputs (``hidden``, ``weight``, ``bias``, ``targets``, which
autograd holds anyway), the per-token log-normaliser ``[N]`` and, when entropy is requested, the
per-token entropy ``[N]`` (both float32, ``N = B * T``). Nothing of size ``V`` per token is kept;
backward recomputes each block of logits and turns it into gradients straight away.

Memory bound (beyond inputs and outputs): one float32 logits block ``[tokens, vocab]`` of at most
``LOGITS_BUDGET_BYTES`` (64 MiB), about two such blocks live at a time, plus float32 copies of one
hidden chunk and one weight chunk when the inputs are bf16/fp16 (the automatic plan keeps those
within the budget too). A softcap keeps a third block alive in backward (its slope), so then each block
gets two thirds of the budget. Backward adds one float32 gradient accumulator: ``[N, H]`` for the hidden
states when the weight needs a gradient (loop over vocabulary blocks outside, so each weight
block's gradient is summed once in float32 and written once), else only ``[tokens, H]`` (loop over
token blocks outside).

Dtypes: every block is computed in float32 (float64 for double inputs) by casting the hidden chunk
and weight rows before the matmul, never by rounding bf16 logits, so outputs are float32 whatever
the input dtype and the sums accumulate in float32. Autocast is switched off inside. Gradients are
returned in the dtypes of the inputs. Double backward is not supported.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lit_rl.ops.head import chain_, check_transform, softcap_slope, transform_block_

# Byte budget of one float32 logits block when the chunk sizes are chosen automatically (read at each call).
LOGITS_BUDGET_BYTES = 64 * 2**20


class TokenStats(NamedTuple):
    """Per-token statistics from :func:`token_stats`, each ``[B, T]`` float32; unrequested ones are ``None``.

    Attributes:
        logp: log p(target).
        entropy: entropy of softmax(z).
        self_certainty: KL(U || p) = logsumexp(z) - mean(z) - log V.
    """

    logp: Tensor | None
    entropy: Tensor | None
    self_certainty: Tensor | None


def plan_chunks(
    n: int, v: int, h: int, chunk_size: int | None, vocab_chunk: int | None, budget_bytes: int
) -> tuple[int, int]:
    """Token and vocabulary block sizes so that one float32 logits block stays within ``budget_bytes``.

    With nothing given, the vocabulary block is bounded so that a float32 copy of the weight rows
    ``[vc, H]`` also fits, the blocks are evened out, and the token block fills the rest of the budget.

    Args:
        n: number of tokens (rows of the flattened hidden states).
        v: vocabulary size (rows of the LM-head weight).
        h: hidden size.
        chunk_size: tokens per block, or ``None`` to choose it from the budget.
        vocab_chunk: vocabulary rows per block, or ``None`` to choose it from the budget.
        budget_bytes: byte budget of one float32 ``[tokens, vocab]`` block (``LOGITS_BUDGET_BYTES`` by default
            in the ops).

    Returns:
        ``(tc, vc)``: tokens and vocabulary rows per block, each at least 1.

    Raises:
        ValueError: if ``chunk_size`` or ``vocab_chunk`` is given and not positive.
    """
    budget = max(1, budget_bytes // 4)  # float32 elements
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    if vocab_chunk is None:
        rows = chunk_size if chunk_size is not None else 1
        vc = max(1, min(v, budget // max(rows, h)))
        vc = -(-v // -(-v // vc))  # even blocks: ceil(v / n_blocks), never larger than before
    else:
        if vocab_chunk < 1:
            raise ValueError(f"vocabulary chunk must be positive, got {vocab_chunk}")
        vc = min(v, vocab_chunk)
    tc = chunk_size if chunk_size is not None else max(1, min(budget // vc, budget // max(h, 1)))
    return max(1, min(n, tc)), max(1, vc)


_PEAK_BLOCKS_ONLY = contextvars.ContextVar("peak_blocks_only", default=False)


@contextlib.contextmanager
def peak_blocks_only() -> Iterator[None]:
    """Within it, every block loop of this module and :mod:`lit_rl.ops.kl` runs its first, second and last block
    only: for the memory estimator, whose fake tensors hold no values.

    Every full block allocates the same temporaries and writes into buffers allocated before the loop; the second
    block is where a block's inputs (the previous weight rows, hidden chunk) are still held while the next are made,
    and the last is the only smaller one. So these three reach every peak the whole loop reaches (a test compares
    the peaks of both), in seconds where 8 x 20K tokens against a 152K vocabulary take thousands of blocks.
    """
    token = _PEAK_BLOCKS_ONLY.set(True)
    try:
        yield
    finally:
        _PEAK_BLOCKS_ONLY.reset(token)


def block_starts(n: int, size: int) -> Sequence[int]:
    """Where the blocks of ``size`` over ``n`` rows start: all of them, or under :func:`peak_blocks_only` the
    first, second and last."""
    starts = range(0, n, size)
    if len(starts) > 3 and _PEAK_BLOCKS_ONLY.get():
        return (starts[0], starts[1], starts[-1])
    return starts


def block_logits(
    h: Tensor, w: Tensor, b: Tensor | None, temperature: float, scale: float = 1.0, softcap: float | None = None
) -> Tensor:
    """Float32 logits ``softcap(scale * (h @ w.T + b)) / temperature`` of one block (see :mod:`lit_rl.ops.head`).

    Args:
        h: hidden rows of the block ``[tc, H]``, already in the compute dtype.
        w: LM-head weight rows of the block ``[vc, H]``, already in the compute dtype.
        b: bias entries of the block ``[vc]``, or ``None``.
        temperature: logits are divided by it.
        scale: raw logits are multiplied by it.
        softcap: ``c`` of ``c * tanh(z / c)``, or ``None``.

    Returns:
        The ``[tc, vc]`` logits block (a new tensor: callers may modify it in place).
    """
    z = h @ w.T  # [tc, vc]
    if b is not None:
        z += b
    return transform_block_(z, scale, softcap, temperature)


class _TokenStatsFn(torch.autograd.Function):
    """Chunked forward/backward over flattened tokens; see the module docstring for what is saved."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,  # [N, H]
        weight: Tensor,  # [V, H]
        bias: Tensor | None,  # [V]
        targets: Tensor | None,  # [N]
        temperature: float,
        tc: int,
        vc: int,
        want_entropy: bool,
        want_sc: bool,
        scale: float,
        softcap: float | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        n, v = hidden.shape[0], weight.shape[0]
        cdtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        dev = hidden.device
        m = torch.full((n,), -math.inf, dtype=cdtype, device=dev)  # running max  [N]
        s = torch.zeros(n, dtype=cdtype, device=dev)  # sum exp(z - m)  [N]
        ez = torch.zeros(n, dtype=cdtype, device=dev) if want_entropy else None  # sum exp(z - m) * z  [N]
        zsum = torch.zeros(n, dtype=cdtype, device=dev) if want_sc else None  # sum z  [N]
        sel = torch.zeros(n, dtype=cdtype, device=dev) if targets is not None else None  # z[target]  [N]

        with torch.autocast(dev.type, enabled=False):
            for v0 in block_starts(v, vc):
                v1 = min(v, v0 + vc)
                w = weight[v0:v1].to(cdtype)  # [vc, H]
                b = bias[v0:v1].to(cdtype) if bias is not None else None  # [vc]
                for t0 in block_starts(n, tc):
                    t1 = min(n, t0 + tc)
                    z = block_logits(hidden[t0:t1].to(cdtype), w, b, temperature, scale, softcap)  # [tc, vc]
                    m_old = m[t0:t1]
                    m_new = torch.maximum(m_old, z.amax(dim=-1))  # [tc]
                    rescale = torch.exp(m_old - m_new)  # [tc], 0 on the first block
                    e = (z - m_new[:, None]).exp_()  # [tc, vc], in place: no third block
                    s[t0:t1] = s[t0:t1] * rescale + e.sum(dim=-1)
                    if ez is not None:
                        ez[t0:t1] = ez[t0:t1] * rescale + e.mul_(z).sum(dim=-1)
                    if zsum is not None:
                        zsum[t0:t1] += z.sum(dim=-1)
                    if sel is not None:
                        local, inside = _local_targets(targets[t0:t1], v0, v1)  # [tc, 1], [tc]
                        sel[t0:t1] += torch.where(inside, z.gather(1, local).squeeze(1), 0.0)
                    m[t0:t1] = m_new
                    del z, e  # free this block before the next is allocated: two blocks live at most

        lse = m + torch.log(s)  # [N]
        logp = sel - lse if sel is not None else None  # [N]
        ent = lse - ez / s if ez is not None else None  # [N]
        sc = lse - zsum / v - math.log(v) if zsum is not None else None  # [N]

        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.temperature, ctx.tc, ctx.vc, ctx.scale, ctx.softcap = temperature, tc, vc, scale, softcap
        # unrequested outputs: distinct empty placeholders, no gradient
        placeholders = [hidden.new_empty(0, dtype=cdtype) for t in (logp, ent, sc) if t is None]
        if placeholders:
            ctx.mark_non_differentiable(*placeholders)
        it = iter(placeholders)
        logp, ent, sc = (t if t is not None else next(it) for t in (logp, ent, sc))
        ctx.set_materialize_grads(False)
        return logp, ent, sc

    @staticmethod
    @once_differentiable
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None, g_sc: Tensor | None):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        temperature, tc, vc, scale, softcap = ctx.temperature, ctx.tc, ctx.vc, ctx.scale, ctx.softcap
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if targets is None or g_logp is None or g_logp.numel() == 0:
            g_logp = None
        if ent is None or g_ent is None or g_ent.numel() == 0:
            g_ent = None
        if g_sc is None or g_sc.numel() == 0:
            g_sc = None
        if (g_logp is None and g_ent is None and g_sc is None) or not (need_h or need_w or need_b):
            return (None,) * 11

        n, v = hidden.shape[0], weight.shape[0]
        cdtype = lse.dtype
        # coefficient of p in dz: dlogp/dz = onehot - p, dsc/dz = p - 1/V, dH/dz = -p * (z - lse + H)
        a = torch.zeros_like(lse)  # [N]
        if g_sc is not None:
            a += g_sc
        if g_logp is not None:
            a -= g_logp
        shift = lse - ent if g_ent is not None else None  # [N], lse - H = E_p[z]

        def block_grad(t0: int, t1: int, v0: int, v1: int, h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            """d(loss)/d(h @ w.T + b) for one block: through the temperature, the scale and the softcap."""
            z = block_logits(h, w, b, temperature, scale, softcap)  # [tc, vc]
            slope = softcap_slope(z, softcap, temperature)  # [tc, vc] or None
            p = (z - lse[t0:t1, None]).exp_()  # [tc, vc]
            if g_ent is not None:
                dz = z.sub_(shift[t0:t1, None]).mul_(-g_ent[t0:t1, None]).add_(a[t0:t1, None]).mul_(p)  # [tc, vc]
            else:
                dz = p.mul_(a[t0:t1, None])  # [tc, vc]
            if g_sc is not None:
                dz -= g_sc[t0:t1, None] / v
            if g_logp is not None:
                local, inside = _local_targets(targets[t0:t1], v0, v1)  # [tc, 1], [tc]
                dz.scatter_add_(1, local, torch.where(inside, g_logp[t0:t1], 0.0)[:, None])
            return chain_(dz, slope, scale, temperature)

        dev = hidden.device
        grad_h = grad_w = grad_b = None
        with torch.autocast(dev.type, enabled=False):
            if need_w:
                # vocabulary blocks outside: each weight block's gradient is summed in float32 once
                # a float32 weight accumulates straight into its gradient; others through a float32 block
                direct = weight.dtype == cdtype
                grad_w = torch.zeros_like(weight) if direct else torch.empty_like(weight)
                gh = torch.zeros(n, hidden.shape[1], dtype=cdtype, device=dev) if need_h else None  # [N, H]
                gb = torch.zeros(v, dtype=cdtype, device=dev) if need_b else None  # [V]
                for v0 in block_starts(v, vc):
                    v1 = min(v, v0 + vc)
                    w = weight[v0:v1].to(cdtype)  # [vc, H]
                    b = bias[v0:v1].to(cdtype) if bias is not None else None  # [vc]
                    gw = grad_w[v0:v1] if direct else torch.zeros_like(w)  # [vc, H]
                    for t0 in block_starts(n, tc):
                        t1 = min(n, t0 + tc)
                        h = hidden[t0:t1].to(cdtype)  # [tc, H]
                        dz = block_grad(t0, t1, v0, v1, h, w, b)  # [tc, vc]
                        gw.addmm_(dz.T, h)
                        if gh is not None:
                            gh[t0:t1].addmm_(dz, w)
                        if gb is not None:
                            gb[v0:v1] += dz.sum(dim=0)
                        del dz
                    if not direct:
                        grad_w[v0:v1] = gw
            else:
                # token blocks outside: only a [tc, H] float32 accumulator for the hidden gradient
                gh = torch.empty(n, hidden.shape[1], dtype=hidden.dtype, device=dev) if need_h else None  # [N, H]
                gb = torch.zeros(v, dtype=cdtype, device=dev) if need_b else None  # [V]
                for t0 in block_starts(n, tc):
                    t1 = min(n, t0 + tc)
                    h = hidden[t0:t1].to(cdtype)  # [tc, H]
                    acc = torch.zeros_like(h) if gh is not None else None  # [tc, H]
                    for v0 in block_starts(v, vc):
                        v1 = min(v, v0 + vc)
                        w = weight[v0:v1].to(cdtype)  # [vc, H]
                        b = bias[v0:v1].to(cdtype) if bias is not None else None  # [vc]
                        dz = block_grad(t0, t1, v0, v1, h, w, b)  # [tc, vc]
                        if acc is not None:
                            acc.addmm_(dz, w)
                        if gb is not None:
                            gb[v0:v1] += dz.sum(dim=0)
                        del dz
                    if gh is not None:
                        gh[t0:t1] = acc
            if need_h:
                grad_h = gh.to(hidden.dtype)
            if need_b:
                grad_b = gb.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def _local_targets(targets: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
    """Target columns inside the vocabulary block ``[v0, v1)`` (clamped) and which targets fall there."""
    local = targets - v0  # [tc]
    inside = (local >= 0) & (local < v1 - v0)  # [tc]
    return local.clamp(0, v1 - v0 - 1)[:, None], inside


def token_stats(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor | None,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    bias: Tensor | None = None,
    scale: float = 1.0,
    softcap: float | None = None,
    entropy: bool = True,
    self_certainty: bool = False,
    _vocab_chunk: int | None = None,
) -> TokenStats:
    """Selected-token log-probs, entropy and self-certainty in one chunked pass over the LM head.

    Each block of logits ``z = softcap(scale * (hidden @ weight.T + bias)) / temperature`` is read once and
    gives the log-normaliser, the selected logit, the mean logit and ``E_p[z]``; all outputs are
    differentiable w.r.t. ``hidden``, ``weight`` and ``bias`` (those that require grad), and backward
    recomputes the blocks. :class:`~lit_rl.ops.head.HeadSpec` ``.op_kwargs`` gives ``bias``, ``scale`` and
    ``softcap`` of a model's head.

    Args:
        hidden: hidden states ``[B, T, H]`` (any leading shape), any float dtype.
        weight: LM-head weight ``[V, H]``; with ``requires_grad=False`` no gradient is computed for it.
        targets: token ids ``[B, T]`` (long), or ``None`` to skip ``logp``. Ids outside ``[0, V)``
            give a meaningless ``logp`` and no gradient; mask those positions.
        temperature: logits are divided by it (sampling temperature), must be positive.
        chunk_size: tokens per block; ``None`` chooses token and vocabulary blocks so that one float32
            logits block stays within 64 MiB. Given, the vocabulary block is chosen to keep that budget.
        bias: optional LM-head bias ``[V]``.
        scale: raw logits are multiplied by it (Cohere's ``logit_scale``, 1 / Granite's ``logits_scaling``).
        softcap: ``c`` of a final ``c * tanh(z / c)`` (Gemma 2), or ``None``. It keeps one more block alive in
            backward, so the automatic plan gives each block two thirds of the budget.
        entropy: compute the entropy of softmax(z).
        self_certainty: compute KL(U || p) = logsumexp(z) - mean(z) - log V.
        _vocab_chunk: vocabulary rows per block (tests); ``None`` chooses it from the budget.

    Returns:
        :class:`TokenStats` of ``[B, T]`` float32 tensors (float64 for double inputs); unrequested ones ``None``.

    Raises:
        ValueError: on mismatched shapes, a non-positive temperature or chunk size, or an unusable scale / softcap.
    """
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden [..., H] and weight [V, H] disagree: {tuple(hidden.shape)} vs {tuple(weight.shape)}")
    if targets is not None and targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must match hidden[..., :-1] {tuple(hidden.shape[:-1])}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias {tuple(bias.shape)} must be [V] = [{weight.shape[0]}]")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    check_transform(scale, softcap)
    lead, h_dim = hidden.shape[:-1], hidden.shape[-1]
    flat_h = hidden.reshape(-1, h_dim)  # [N, H]
    flat_t = targets.reshape(-1) if targets is not None else None  # [N]
    budget = LOGITS_BUDGET_BYTES if softcap is None else LOGITS_BUDGET_BYTES * 2 // 3  # the slope is a third block
    tc, vc = plan_chunks(flat_h.shape[0], weight.shape[0], h_dim, chunk_size, _vocab_chunk, budget)
    logp, ent, sc = _TokenStatsFn.apply(
        flat_h, weight, bias, flat_t, float(temperature), tc, vc, bool(entropy), bool(self_certainty),
        float(scale), None if softcap is None else float(softcap),
    )  # fmt: skip
    return TokenStats(
        logp=logp.reshape(lead) if targets is not None else None,
        entropy=ent.reshape(lead) if entropy else None,
        self_certainty=sc.reshape(lead) if self_certainty else None,
    )


def selective_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor, **kwargs) -> Tensor:
    """Float32 log p(target) ``[B, T]`` from hidden states, without materialising ``[B, T, V]`` logits.

    Args:
        hidden: hidden states ``[B, T, H]``, any float dtype.
        weight: LM-head weight ``[V, H]``.
        targets: token ids ``[B, T]`` (long).
        **kwargs: ``temperature``, ``chunk_size``, ``bias``, ``scale``, ``softcap`` (and ``_vocab_chunk``), as in
            :func:`token_stats`.
    """
    return token_stats(hidden, weight, targets, entropy=False, self_certainty=False, **kwargs).logp


def entropy(hidden: Tensor, weight: Tensor, **kwargs) -> Tensor:
    """Float32 per-token entropy ``[B, T]`` of softmax(logits), differentiable.

    Args:
        hidden: hidden states ``[B, T, H]``, any float dtype.
        weight: LM-head weight ``[V, H]``.
        **kwargs: ``temperature``, ``chunk_size``, ``bias``, ``scale``, ``softcap`` (and ``_vocab_chunk``), as in
            :func:`token_stats`.
    """
    return token_stats(hidden, weight, None, entropy=True, self_certainty=False, **kwargs).entropy


def self_certainty(hidden: Tensor, weight: Tensor, **kwargs) -> Tensor:
    """Float32 per-token self-certainty ``[B, T]``: KL(U || p) = logsumexp(z) - mean(z) - log V.

    Non-negative up to float32 rounding (not clamped, to keep the gradient exact). Its gradient
    w.r.t. ``z`` is ``softmax(z) - 1/V``, divided by ``temperature`` on the way to the logits.
    Intuitor (Zhao et al., 2025, "Learning to Reason without External Rewards") uses it as reward.

    Args:
        hidden: hidden states ``[B, T, H]``, any float dtype.
        weight: LM-head weight ``[V, H]``.
        **kwargs: ``temperature``, ``chunk_size``, ``bias``, ``scale``, ``softcap`` (and ``_vocab_chunk``), as in
            :func:`token_stats`.
    """
    return token_stats(hidden, weight, None, entropy=False, self_certainty=True, **kwargs).self_certainty
