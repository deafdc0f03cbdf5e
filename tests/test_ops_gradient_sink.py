"""GradientSink: a weight read many times in one pass (logits, KL blocks, embedding rows) gets the gradient autograd
would give it, summed in one buffer; checked against plain float64 formulas, value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lit_rl.ops import GradientSink, kl_divergence

V, H = 11, 7  # odd sizes: the KL's vocabulary blocks of 4 leave a short last block
PAD = 2


def _dense_kl(hp, wp, hq, wq, temperature):
    """float64 KL(p || q) per row from materialised logits."""
    lp = F.log_softmax((hp @ wp.T) / temperature, dim=-1)
    lq = F.log_softmax((hq @ wq.T) / temperature, dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    x = torch.randn(2, 3, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    hp = torch.randn(5, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    hq = torch.randn(5, H, generator=g, dtype=torch.float64).to(dtype)
    wq = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    idx = torch.tensor([[0, PAD, 4], [PAD, 10, 4], [7, 7, 1], [3, 9, PAD], [5, 6, 8]])  # repeats and padding rows
    c = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in ((2, 3, V), (5, 3, H), (5,))]
    return w, x, hp, hq, wq, idx, c


def _loss(w, x, hp, hq, wq, idx, c, temperature, sink):
    """Each use of ``w`` twice (as a rollout reads the head at every token), through the sink or plainly."""
    total = 0
    for step in range(2):
        if sink is None:
            z, rows = F.linear(x * (step + 1), w), F.embedding(idx, w, padding_idx=PAD)
            kl = kl_divergence(hp * (step + 1), w, hq, wq, temperature=temperature, _vocab_chunk=4)
        else:
            z, rows = sink.linear(x * (step + 1)), sink.embedding(idx, PAD)
            kl = kl_divergence(
                hp * (step + 1), sink.weight, hq, wq, temperature=temperature, sink_p=sink, _vocab_chunk=4
            )
        total = total + (c[0] * z).sum() + (c[1] * rows).sum() + (c[2] * kl).sum()
    return total


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_value_and_gradient_against_float64_formulas(temperature):
    w, x, hp, hq, wq, idx, c = _inputs(torch.float64)
    got = _loss(w, x, hp, hq, wq, idx, c, temperature, GradientSink(w))
    got_grads = torch.autograd.grad(got, (w, x, hp))

    mask = (idx != PAD).unsqueeze(-1).double()  # nn.Embedding gives the padding row no gradient
    want = 0
    for step in range(2):
        z = (x * (step + 1)) @ w.T
        rows = w[idx] * mask + (w[idx] * (1 - mask)).detach()
        kl = _dense_kl(hp * (step + 1), w, hq, wq, temperature)
        want = want + (c[0] * z).sum() + (c[1] * rows).sum() + (c[2] * kl).sum()
    want_grads = torch.autograd.grad(want, (w, x, hp))

    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert got_grads[0][PAD].abs().sum() > 0  # the padding row still gets the logits' and the KL's gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_gives_the_plain_paths_gradient(dtype):
    w, x, hp, hq, wq, idx, c = _inputs(dtype, seed=1)
    plain = torch.autograd.grad(_loss(w, x, hp, hq, wq, idx, c, 0.7, None), (w, x, hp))
    sunk = torch.autograd.grad(_loss(w, x, hp, hq, wq, idx, c, 0.7, GradientSink(w)), (w, x, hp))
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]  # bf16: the sums' order and one rounding differ
    for a, b in zip(sunk, plain):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.float().abs().max().item())


def test_the_sum_joins_other_uses_and_checkpointed_recomputation():
    """Plain uses of the weight beside the sink's add up in ``.grad``; a use recomputed by a non-reentrant checkpoint
    adds its gradient once."""
    w, x, hp, hq, wq, idx, c = _inputs(torch.float64, seed=2)

    def loss(use_sink: bool) -> torch.Tensor:
        sink = GradientSink(w) if use_sink else None
        plain = (c[0] * F.linear(x, w)).sum()  # outside any sink either way
        if sink is None:
            inner = checkpoint(lambda v: (c[0] * F.linear(v, w).tanh()).sum(), x * 2, use_reentrant=False)
        else:
            inner = checkpoint(lambda v: (c[0] * sink.linear(v).tanh()).sum(), x * 2, use_reentrant=False)
        return plain + inner

    loss(False).backward()
    want, w.grad = w.grad.clone(), None
    loss(True).backward()
    torch.testing.assert_close(w.grad, want, rtol=1e-12, atol=1e-12)


def test_a_sink_no_gradient_reaches_leaves_the_weight_without_one():
    w, x, *_ = _inputs(torch.float64)
    sink = GradientSink(w)
    z = sink.linear(x)
    (x * 3).sum().backward()  # the loss does not use z
    assert w.grad is None and sink.take() is None
    assert z.shape == (2, 3, V)


def test_when_there_is_nothing_to_sum():
    w = torch.randn(V, H)
    assert GradientSink.of(w) is None  # takes no gradient
    with torch.no_grad():
        assert GradientSink.of(w.requires_grad_()) is None  # nothing is recorded
    with pytest.raises(ValueError, match="does not require grad"):
        GradientSink(w.detach())
    sink = GradientSink(w)
    with pytest.raises(ValueError, match="weight_p must be sink_p.weight"):
        kl_divergence(torch.randn(3, H), w, torch.randn(3, H), torch.randn(V, H), sink_p=sink)
