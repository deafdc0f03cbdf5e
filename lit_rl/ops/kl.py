"""Exact full-vocabulary KL(policy || reference) per token, from the two models' hidden states.

For each row, ``p = softmax(zp)`` and ``q = softmax(zq)`` with ``zp = (hidden_p @ weight_p.T + bias_p) / T``
and ``zq = (hidden_q @ weight_q.T + bias_q) / T`` (each model's own LM head, one shared vocabulary, each with
its own logit scale and softcap if it has them, see :mod:`lit_rl.ops.head`), and the result is ``KL(p || q) = sum_v p_v (log p_v - log q_v)``, exactly, over the whole vocabulary.

Why: GumbelTopK penalises the policy's drift from the reference at every step of a differentiable rollout.
A naive implementation stores the reference logits ``[B, T, V]`` and computes the KL at the end; a
better one computes it per step from the two ``[B, V]`` logits rows (outside the reference's
``torch.no_grad()`` block, or it would also cut the policy's gradient). Here the KL is computed online, one vocabulary block at a time, from the two hidden
states, so neither ``[B, T, V]`` nor ``[B, V]`` logits exist, and it is the exact KL with its exact
gradient, not the k3 estimator on the sampled token that GRPO uses (a sampled token means little when the
rollout feeds soft tokens, and the exact value costs one more pass over blocks the head reads anyway).

How, in one pass over vocabulary blocks: running maxima and sums give ``logsumexp(zp)`` and
``logsumexp(zq)`` (online logsumexp), and a running sum of ``exp(zp - max) * (zp - zq)`` gives
``E_p[zp - zq]``; then ``KL = E_p[zp - zq] - logsumexp(zp) + logsumexp(zq)``. Backward recomputes each
block and applies ``dKL/dzp_v = p_v * ((log p_v - log q_v) - KL) = p_v * ((zp_v - zq_v) - E_p[zp - zq])``
(the logits are not normalised, so the shift is ``E_p[zp - zq]``, not the KL) and ``dKL/dzq_v = q_v - p_v``,
each taken through ``T`` (and the side's scale and softcap) on the way to hidden state, weight and bias. Gradients go to every input that
requires grad, the reference side included (it normally needs none, and then none is computed for it).

What is saved for backward: the two hidden states and references to the two weights and biases (tensors
autograd or the model holds anyway), plus three float32 per-row vectors ``[N]`` (``N`` rows, all leading
dimensions flattened): both log-normalisers and ``E_p[zp - zq]``. Nothing of size ``V`` per row is kept.

Memory bound (beyond inputs and outputs): the chunk plan of :mod:`lit_rl.ops.token_math` with a third of
its budget per float32 ``[tokens, vocab]`` block, since three such blocks are alive at once (the two logits
blocks and ``zp - zq``, or ``q``, in backward), plus float32 copies of one block of weight rows per head
when the inputs are bf16/fp16. Backward adds float32 accumulators ``[N, H]`` for the hidden-state
gradients (vocabulary blocks outside, so each weight block's gradient is summed once).

Dtypes and limits: blocks are computed in float32 (float64 for double inputs), autocast is off inside,
the KL is float32 (float64), gradients come back in the inputs' dtypes. The KL is non-negative up to
rounding and exactly 0 when both sides are the same tensors; it is not clamped, to keep the gradient
exact. Logits must be finite (a ``-inf`` bias gives NaN). Double backward is not supported.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lit_rl.ops import token_math
from lit_rl.ops.gradient_sink import GradientSink
from lit_rl.ops.head import chain_, check_transform, softcap_slope
from lit_rl.ops.token_math import block_logits, block_starts, plan_chunks

# float32 [tokens, vocab] blocks alive at once: the two logits blocks and a third (zp - zq, or q)
_LIVE_BLOCKS = 3


def _online_logsumexp_step(m: Tensor, s: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    """One block of an online logsumexp: updates the running max ``m`` and sum ``s`` (``[tc]`` views) in place.

    Returns ``exp(z - m_new)`` (written into ``z``'s storage) and the factor that rescaled the old sums,
    which any other running sum weighted by ``exp(z - m)`` needs too.
    """
    m_new = torch.maximum(m, z.amax(dim=-1))  # [tc]
    scale = torch.exp(m - m_new)  # [tc], 0 on the first block
    e = z.sub_(m_new[:, None]).exp_()  # [tc, vc]
    s.mul_(scale).add_(e.sum(dim=-1))
    m.copy_(m_new)
    return e, scale


def _head_rows(
    weight: Tensor, bias: Tensor | None, v0: int, v1: int, cdtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """Weight rows ``[vc, H]`` and bias entries ``[vc]`` of the vocabulary block ``[v0, v1)`` in the compute dtype."""
    return weight[v0:v1].to(cdtype), (bias[v0:v1].to(cdtype) if bias is not None else None)


class _HeadGrads:
    """Gradient accumulators of one side (hidden state, weight, bias), filled one vocabulary block at a time."""

    def __init__(
        self, hidden: Tensor, weight: Tensor, bias: Tensor | None, needs, cdtype: torch.dtype, sink=None
    ) -> None:
        need_h, need_w, need_b = needs
        dev = hidden.device
        # a weight in the compute dtype accumulates straight into its gradient; others through a float32 block
        self.direct = weight.dtype == cdtype
        self.sink = sink  # a GradientSink: the weight's gradient is added into its buffer, not returned
        self.gh = torch.zeros(hidden.shape, dtype=cdtype, device=dev) if need_h else None  # [N, H]
        if sink is not None:
            self.gw = sink.buffer()  # [V, H]
        else:
            self.gw = (torch.zeros_like(weight) if self.direct else torch.empty_like(weight)) if need_w else None
        self.gb = torch.zeros(weight.shape[0], dtype=cdtype, device=dev) if need_b else None  # [V]
        self.block = None

    def open(self, v0: int, v1: int, w: Tensor) -> None:
        """Start the vocabulary block ``[v0, v1)`` whose weight rows are ``w``."""
        if self.gw is not None:
            self.block = self.gw[v0:v1] if self.direct else torch.zeros_like(w)  # [vc, H]

    def add(self, t0: int, t1: int, v0: int, v1: int, dz: Tensor, h: Tensor, w: Tensor) -> None:
        """Add the contribution of ``dz = dloss/dz`` ``[tc, vc]`` of token rows ``[t0, t1)``."""
        if self.block is not None:
            self.block.addmm_(dz.T, h)
        if self.gh is not None:
            self.gh[t0:t1].addmm_(dz, w)
        if self.gb is not None:
            self.gb[v0:v1] += dz.sum(dim=0)

    def close(self, v0: int, v1: int) -> None:
        """Write the finished weight block's gradient."""
        if self.gw is not None and not self.direct:
            if self.sink is not None:
                self.gw[v0:v1] += self.block
            else:
                self.gw[v0:v1] = self.block
        self.block = None

    def result(self, hidden: Tensor, bias: Tensor | None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(grad_hidden, grad_weight, grad_bias)`` in the inputs' dtypes, ``None`` where not needed."""
        gh = self.gh.to(hidden.dtype) if self.gh is not None else None
        gb = self.gb.to(bias.dtype) if self.gb is not None else None
        return gh, (self.gw if self.sink is None else None), gb


class _KLFn(torch.autograd.Function):
    """Chunked forward/backward over flattened rows; see the module docstring for what is saved."""

    @staticmethod
    def forward(
        ctx,
        hidden_p: Tensor,  # [N, H]
        weight_p: Tensor,  # [V, H]
        bias_p: Tensor | None,  # [V]
        hidden_q: Tensor,  # [N, H']
        weight_q: Tensor,  # [V, H']
        bias_q: Tensor | None,  # [V]
        temperature: float,
        tc: int,
        vc: int,
        head_p: tuple[float, float | None],  # (scale, softcap)
        head_q: tuple[float, float | None],
        sink_p=None,  # a GradientSink of weight_p (then weight_p is its detached weight)
        anchor: Tensor | None = None,  # the sink's anchor, so that the sink's backward waits for this one
    ) -> Tensor:
        n, v = hidden_p.shape[0], weight_p.shape[0]
        cdtype = torch.float32
        for t in (hidden_p, weight_p, hidden_q, weight_q):
            cdtype = torch.promote_types(cdtype, t.dtype)
        dev = hidden_p.device
        m_p = torch.full((n,), -math.inf, dtype=cdtype, device=dev)  # running max of zp  [N]
        s_p = torch.zeros(n, dtype=cdtype, device=dev)  # sum exp(zp - m_p)  [N]
        m_q = torch.full((n,), -math.inf, dtype=cdtype, device=dev)  # running max of zq  [N]
        s_q = torch.zeros(n, dtype=cdtype, device=dev)  # sum exp(zq - m_q)  [N]
        a = torch.zeros(n, dtype=cdtype, device=dev)  # sum exp(zp - m_p) * (zp - zq)  [N]

        with torch.autocast(dev.type, enabled=False):
            for v0 in block_starts(v, vc):
                v1 = min(v, v0 + vc)
                wp, bp = _head_rows(weight_p, bias_p, v0, v1, cdtype)  # [vc, H], [vc]
                wq, bq = _head_rows(weight_q, bias_q, v0, v1, cdtype)  # [vc, H'], [vc]
                for t0 in block_starts(n, tc):
                    t1 = min(n, t0 + tc)
                    zp = block_logits(hidden_p[t0:t1].to(cdtype), wp, bp, temperature, *head_p)  # [tc, vc]
                    zq = block_logits(hidden_q[t0:t1].to(cdtype), wq, bq, temperature, *head_q)  # [tc, vc]
                    d = zp - zq  # [tc, vc]
                    ep, scale_p = _online_logsumexp_step(m_p[t0:t1], s_p[t0:t1], zp)  # [tc, vc], [tc]
                    a[t0:t1] = a[t0:t1] * scale_p + d.mul_(ep).sum(dim=-1)
                    _online_logsumexp_step(m_q[t0:t1], s_q[t0:t1], zq)
                    del zp, zq, d, ep  # free this block before the next is allocated

        lse_p = m_p + torch.log(s_p)  # [N]
        lse_q = m_q + torch.log(s_q)  # [N]
        mean_d = a / s_p  # [N], E_p[zp - zq]
        kl = mean_d + (lse_q - lse_p)  # [N]

        ctx.save_for_backward(hidden_p, weight_p, bias_p, hidden_q, weight_q, bias_q, lse_p, lse_q, mean_d)
        ctx.temperature, ctx.tc, ctx.vc, ctx.head_p, ctx.head_q = temperature, tc, vc, head_p, head_q
        ctx.sink_p = sink_p
        return kl

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kl: Tensor | None):
        hidden_p, weight_p, bias_p, hidden_q, weight_q, bias_q, lse_p, lse_q, mean_d = ctx.saved_tensors
        temperature, tc, vc, (scale_p, cap_p), (scale_q, cap_q) = (
            ctx.temperature,
            ctx.tc,
            ctx.vc,
            ctx.head_p,
            ctx.head_q,
        )
        sink = ctx.sink_p
        needs = ctx.needs_input_grad
        need_p, need_q = any(needs[0:3]) or sink is not None, any(needs[3:6])
        anchor_grad = grad_kl.new_zeros(0) if sink is not None and grad_kl is not None else None
        if grad_kl is None or not (need_p or need_q):
            return (None,) * 12 + (anchor_grad,)

        n, v = hidden_p.shape[0], weight_p.shape[0]
        cdtype = lse_p.dtype
        g = grad_kl.to(cdtype)  # [N]; chain_ takes each block through temperature, scale and softcap
        acc_p = _HeadGrads(hidden_p, weight_p, bias_p, needs[0:3], cdtype, sink)
        acc_q = _HeadGrads(hidden_q, weight_q, bias_q, needs[3:6], cdtype)
        with torch.autocast(hidden_p.device.type, enabled=False):
            for v0 in block_starts(v, vc):
                v1 = min(v, v0 + vc)
                wp, bp = _head_rows(weight_p, bias_p, v0, v1, cdtype)  # [vc, H], [vc]
                wq, bq = _head_rows(weight_q, bias_q, v0, v1, cdtype)  # [vc, H'], [vc]
                acc_p.open(v0, v1, wp)
                acc_q.open(v0, v1, wq)
                for t0 in block_starts(n, tc):
                    t1 = min(n, t0 + tc)
                    hp, hq = hidden_p[t0:t1].to(cdtype), hidden_q[t0:t1].to(cdtype)  # [tc, H], [tc, H']
                    zp = block_logits(hp, wp, bp, temperature, scale_p, cap_p)  # [tc, vc]
                    zq = block_logits(hq, wq, bq, temperature, scale_q, cap_q)  # [tc, vc]
                    slope_p = softcap_slope(zp, cap_p, temperature) if need_p else None  # [tc, vc] or None
                    slope_q = softcap_slope(zq, cap_q, temperature) if need_q else None  # [tc, vc] or None
                    q = (zq - lse_q[t0:t1, None]).exp_() if need_q else None  # [tc, vc]
                    d = zq.neg_().add_(zp)  # [tc, vc], zp - zq in zq's storage
                    p = zp.sub_(lse_p[t0:t1, None]).exp_()  # [tc, vc]
                    dzp = dzq = None
                    if need_p:
                        dzp = d.sub_(mean_d[t0:t1, None]).mul_(p).mul_(g[t0:t1, None])  # [tc, vc], p (log p/q - KL)
                        chain_(dzp, slope_p, scale_p, temperature)
                        acc_p.add(t0, t1, v0, v1, dzp, hp, wp)
                    if need_q:
                        dzq = q.sub_(p).mul_(g[t0:t1, None])  # [tc, vc], q - p
                        chain_(dzq, slope_q, scale_q, temperature)
                        acc_q.add(t0, t1, v0, v1, dzq, hq, wq)
                    del zp, zq, p, d, q, dzp, dzq, slope_p, slope_q  # free this block before the next is allocated
                acc_p.close(v0, v1)
                acc_q.close(v0, v1)
        gp, gq = acc_p.result(hidden_p, bias_p), acc_q.result(hidden_q, bias_q)
        return *gp, *gq, None, None, None, None, None, None, anchor_grad


def kl_divergence(
    hidden_p: Tensor,
    weight_p: Tensor,
    hidden_q: Tensor,
    weight_q: Tensor,
    *,
    temperature: float = 1.0,
    bias_p: Tensor | None = None,
    bias_q: Tensor | None = None,
    scale_p: float = 1.0,
    softcap_p: float | None = None,
    scale_q: float = 1.0,
    softcap_q: float | None = None,
    chunk_size: int | None = None,
    sink_p: GradientSink | None = None,
    _vocab_chunk: int | None = None,
) -> Tensor:
    """Per-row full-vocabulary KL(p || q) from two hidden states and LM heads, without materialising logits.

    ``p = softmax(softcap_p(scale_p * (hidden_p @ weight_p.T + bias_p)) / temperature)``, ``q`` likewise from
    the ``_q`` inputs (see :mod:`lit_rl.ops.head`); differentiable w.r.t. every tensor input that requires grad.

    Args:
        hidden_p: policy hidden states ``[..., H]``, any float dtype.
        weight_p: policy LM-head weight ``[V, H]``.
        hidden_q: reference hidden states ``[..., H']``, the same leading shape as ``hidden_p``.
        weight_q: reference LM-head weight ``[V, H']``, the same vocabulary as ``weight_p``.
        temperature: both sides' logits are divided by it, must be positive.
        bias_p: optional policy LM-head bias ``[V]``.
        bias_q: optional reference LM-head bias ``[V]``.
        scale_p: the policy's raw logits are multiplied by it.
        softcap_p: ``c`` of the policy head's final ``c * tanh(z / c)``, or ``None``; each softcap keeps one more
            block alive in backward, which the automatic plan accounts for.
        scale_q: as ``scale_p``, for the reference.
        softcap_q: as ``softcap_p``, for the reference.
        chunk_size: rows (tokens) per block; ``None`` chooses token and vocabulary blocks so that the three
            live float32 blocks stay within token_math's 64 MiB budget. Given, the vocabulary block is chosen
            to keep that budget.
        sink_p: a :class:`~lit_rl.ops.gradient_sink.GradientSink` of the policy head's weight; then ``weight_p`` is
            ``sink_p.weight`` and its gradient is added into the sink instead of returned (a rollout that reads
            the head at every token sums the weight's gradient in one buffer).
        _vocab_chunk: vocabulary rows per block (tests); ``None`` chooses it from the budget.

    Returns:
        KL per row ``[...]``, float32 (float64 for double inputs).

    Raises:
        ValueError: on mismatched shapes or a non-positive temperature or chunk size.
    """
    for name, hidden, weight in (("p", hidden_p, weight_p), ("q", hidden_q, weight_q)):
        if weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
            raise ValueError(
                f"hidden_{name} [..., H] and weight_{name} [V, H] disagree: "
                f"{tuple(hidden.shape)} vs {tuple(weight.shape)}"
            )
    if weight_p.shape[0] != weight_q.shape[0]:
        raise ValueError(f"the two heads have different vocabularies: {weight_p.shape[0]} vs {weight_q.shape[0]} rows")
    if hidden_p.shape[:-1] != hidden_q.shape[:-1]:
        raise ValueError(
            f"hidden_p {tuple(hidden_p.shape)} and hidden_q {tuple(hidden_q.shape)} must share their leading shape"
        )
    for name, bias in (("bias_p", bias_p), ("bias_q", bias_q)):
        if bias is not None and bias.shape != weight_p.shape[:1]:
            raise ValueError(f"{name} {tuple(bias.shape)} must be [V] = [{weight_p.shape[0]}]")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    check_transform(scale_p, softcap_p)
    check_transform(scale_q, softcap_q)
    lead = hidden_p.shape[:-1]
    flat_p = hidden_p.reshape(-1, hidden_p.shape[-1])  # [N, H]
    flat_q = hidden_q.reshape(-1, hidden_q.shape[-1])  # [N, H']
    n, v, h = flat_p.shape[0], weight_p.shape[0], max(flat_p.shape[1], flat_q.shape[1])
    live = _LIVE_BLOCKS + (softcap_p is not None) + (softcap_q is not None)  # a softcap's slope is one more block
    budget = token_math.LOGITS_BUDGET_BYTES // live  # read at each call, like token_math
    tc, vc = plan_chunks(n, v, h, chunk_size, _vocab_chunk, budget)
    head_p = (float(scale_p), None if softcap_p is None else float(softcap_p))
    head_q = (float(scale_q), None if softcap_q is None else float(softcap_q))
    if sink_p is not None and weight_p is not sink_p.weight:
        raise ValueError("sink_p: weight_p must be sink_p.weight, the weight the sink collects the gradient of")
    anchor = sink_p.anchor if sink_p is not None else None
    kl = _KLFn.apply(
        flat_p, weight_p, bias_p, flat_q, weight_q, bias_q, float(temperature), tc, vc, head_p, head_q, sink_p, anchor
    )
    return kl.reshape(lead)
