"""lit_rl.ops.kl_divergence against a plain float64 full-logits reference: values, gradients, memory."""

from __future__ import annotations

import pytest
import torch

from lit_rl.ops import kl_divergence, token_math

H, HQ, V = 5, 7, 37  # odd sizes; the reference head has another hidden size than the policy's


def _inputs(lead=(2, 3, 5), bias=False, dtype=torch.float32, seed=0, h=H, hq=HQ, v=V):
    """Policy and reference inputs, every one requiring grad: ``(hp, wp, bp, hq, wq, bq)``."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype).requires_grad_()

    hp, wp = leaf(*lead, h), leaf(v, h, scale=0.7)  # [..., H], [V, H]
    hq_, wq = leaf(*lead, hq), leaf(v, hq, scale=0.7)  # [..., H'], [V, H']
    bp, bq = (leaf(v), leaf(v)) if bias else (None, None)  # [V], [V]
    return hp, wp, bp, hq_, wq, bq


def _leaf64(x):
    return None if x is None else x.detach().double().requires_grad_(x.requires_grad)


def _reference(hp, wp, bp, hq, wq, bq, temperature=1.0):
    """Float64 KL(p || q) ``[...]`` from full logits: sum p (log p - log q)."""
    zp = hp @ wp.T + (bp if bp is not None else 0)  # [..., V]
    zq = hq @ wq.T + (bq if bq is not None else 0)  # [..., V]
    logp = torch.log_softmax(zp / temperature, dim=-1)  # [..., V]
    logq = torch.log_softmax(zq / temperature, dim=-1)  # [..., V]
    return (logp.exp() * (logp - logq)).sum(-1)  # [...]


def _kl(inputs, **kw):
    hp, wp, bp, hq, wq, bq = inputs
    return kl_divergence(hp, wp, hq, wq, bias_p=bp, bias_q=bq, **kw)


def _assert_grads(got_inputs, ref_inputs, atol=1e-5, rtol=1e-4):
    for got, ref in zip(got_inputs, ref_inputs, strict=True):
        if got is None:
            continue
        if not got.requires_grad:
            assert got.grad is None
            continue
        assert got.grad is not None and got.grad.dtype == got.dtype
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(
    ("lead", "chunk_size", "vocab_chunk"),
    [((2, 3, 5), None, None), ((2, 3, 5), 8, 8), ((4,), 3, 10), ((3, 1, 2, 2), 1, 1)],
    ids=["auto", "tokens8-vocab8", "rows4-tokens3-vocab10", "4dims-tokens1-vocab1"],
)
def test_kl_matches_float64_reference(lead, chunk_size, vocab_chunk, bias, temperature):
    inputs = _inputs(lead=lead, bias=bias)
    ref_inputs = [_leaf64(x) for x in inputs]
    up = torch.randn(lead, generator=torch.Generator().manual_seed(1))  # upstream grad  [...]

    kl = _kl(inputs, temperature=temperature, chunk_size=chunk_size, _vocab_chunk=vocab_chunk)
    ref = _reference(*ref_inputs, temperature=temperature)
    assert kl.shape == lead and kl.dtype == torch.float32
    assert (ref > 0).all()
    torch.testing.assert_close(kl.double(), ref, atol=1e-5, rtol=1e-5)

    (kl * up).sum().backward()
    (ref * up.double()).sum().backward()
    _assert_grads(inputs, ref_inputs)


@pytest.mark.parametrize("frozen", ["reference", "reference-and-policy-head"])
def test_frozen_inputs_get_no_gradient(frozen):
    inputs = _inputs(bias=True)
    hp, wp, bp, hq, wq, bq = inputs
    for t in (hq, wq, bq) if frozen == "reference" else (hq, wq, bq, wp, bp):
        t.requires_grad_(False)
    ref_inputs = [_leaf64(x) for x in inputs]
    _kl(inputs, temperature=0.7, chunk_size=4, _vocab_chunk=9).sum().backward()
    _reference(*ref_inputs, temperature=0.7).sum().backward()
    _assert_grads(inputs, ref_inputs)
    assert hq.grad is None and wq.grad is None and bq.grad is None


def test_gradcheck_every_input():
    inputs = _inputs(lead=(2, 3), bias=True, dtype=torch.double, h=4, hq=3, v=11)

    def fn(hp, wp, bp, hq, wq, bq):
        return kl_divergence(hp, wp, hq, wq, bias_p=bp, bias_q=bq, temperature=1.3, chunk_size=4, _vocab_chunk=4)

    assert torch.autograd.gradcheck(fn, inputs)
    kl = fn(*inputs)
    assert kl.dtype == torch.float64
    torch.testing.assert_close(kl, _reference(*inputs, temperature=1.3), atol=1e-12, rtol=1e-10)


def test_kl_of_a_distribution_with_itself_is_zero():
    hp, wp, bp, _, _, _ = _inputs(bias=True)
    kl = kl_divergence(hp, wp, hp, wp, bias_p=bp, bias_q=bp, temperature=0.7, chunk_size=4, _vocab_chunk=8)
    assert torch.equal(kl, torch.zeros_like(kl))
    kl.sum().backward()  # p = q: dKL/dzp = p (log p/q - KL) = 0 and dKL/dzq = q - p = 0
    for t in (hp, wp, bp):
        assert torch.equal(t.grad, torch.zeros_like(t))
    # equal values held by another model (a frozen copy) give 0 too
    kl = kl_divergence(hp, wp, hp.detach().clone(), wp.detach().clone(), bias_p=bp, bias_q=bp.detach().clone())
    assert torch.equal(kl, torch.zeros_like(kl))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_padding_rows_give_finite_values_and_gradients(bias):
    inputs = _inputs(bias=bias)
    hp, wp, bp, hq, wq, bq = inputs
    with torch.no_grad():
        hp[0, 1:] = 0  # padding in the policy and the reference
        hq[0, 1:] = 0
        hp[1, 0] = 0  # padding in the policy only
    ref_inputs = [_leaf64(x) for x in inputs]
    kl = _kl(inputs, chunk_size=4, _vocab_chunk=8)
    assert torch.isfinite(kl).all()
    if not bias:  # both rows uniform
        assert torch.equal(kl[0, 1:], torch.zeros_like(kl[0, 1:]))
    ref = _reference(*ref_inputs)
    torch.testing.assert_close(kl.double(), ref, atol=1e-5, rtol=1e-5)
    kl.sum().backward()
    ref.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in inputs if t is not None)
    _assert_grads(inputs, ref_inputs)


def test_bf16_inputs_give_float32_values_close_to_reference():
    inputs = _inputs(bias=True, dtype=torch.bfloat16)
    ref_inputs = [_leaf64(x) for x in inputs]  # the same bf16-rounded values: only accumulation error remains
    kl = _kl(inputs, temperature=0.7, chunk_size=4, _vocab_chunk=10)
    assert kl.dtype == torch.float32
    ref = _reference(*ref_inputs, temperature=0.7)
    torch.testing.assert_close(kl.double(), ref, atol=1e-4, rtol=1e-4)
    kl.sum().backward()
    ref.sum().backward()
    for got, exp in zip(inputs, ref_inputs, strict=True):
        assert got.grad.dtype == torch.bfloat16
        torch.testing.assert_close(got.grad.double(), exp.grad, atol=2e-2, rtol=2e-2)  # bf16 rounding of the grad


def test_no_grad_pass_and_empty_batch():
    inputs = _inputs()
    with torch.no_grad():
        kl = _kl(inputs)
    assert not kl.requires_grad and kl.shape == (2, 3, 5)
    hp, wp, _, hq, wq, _ = inputs
    assert kl_divergence(hp[:0], wp, hq[:0], wq).shape == (0, 3, 5)


def test_invalid_arguments_raise():
    hp, wp, bp, hq, wq, bq = _inputs(bias=True)
    with pytest.raises(ValueError, match="hidden_p .* disagree"):
        kl_divergence(hp, wp[:, :3], hq, wq)
    with pytest.raises(ValueError, match="hidden_q .* disagree"):
        kl_divergence(hp, wp, hq, wq[:, :3])
    with pytest.raises(ValueError, match="vocabularies"):
        kl_divergence(hp, wp, hq, wq[:30])
    with pytest.raises(ValueError, match="leading shape"):
        kl_divergence(hp, wp, hq[:1], wq)
    with pytest.raises(ValueError, match="bias_q"):
        kl_divergence(hp, wp, hq, wq, bias_p=bp, bias_q=bq[:5])
    with pytest.raises(ValueError, match="temperature"):
        kl_divergence(hp, wp, hq, wq, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        kl_divergence(hp, wp, hq, wq, chunk_size=0)


# --- memory: what is saved for backward, and how big any intermediate gets -------------------------------


def test_backward_saves_no_row_by_vocab_tensor():
    lead, v = (4, 8), 5000
    n = 4 * 8
    inputs = _inputs(lead=lead, bias=True, v=v)
    saved: list[tuple[int, ...]] = []

    def pack(x):
        saved.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        kl = _kl(inputs)
    assert max(s.numel() for s in map(torch.Size, saved)) < n * v
    # the two hidden states, the two heads (references), and three [N] vectors: log-normalisers and E_p[zp - zq]
    expected = [(n, H), (v, H), (v,), (n, HQ), (v, HQ), (v,), (n,), (n,), (n,)]
    assert sorted(saved) == sorted(expected)
    kl.sum().backward()


@pytest.mark.parametrize("frozen_reference", [True, False])
def test_at_most_three_logits_blocks_are_alive_at_once(frozen_reference):
    from lit_rl.memory.tracker import TensorMemoryTracker

    n, h, v, tc, vc = 256, 16, 4096, 64, 1024
    gen = torch.Generator().manual_seed(0)
    hp, wp = torch.randn(n, h, generator=gen).requires_grad_(), torch.randn(v, h, generator=gen).requires_grad_()
    hq, wq = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen)
    hq.requires_grad_(not frozen_reference)
    wq.requires_grad_(not frozen_reference)
    block = tc * vc * 4  # one float32 logits block
    with TensorMemoryTracker() as tracker:
        kl = kl_divergence(hp, wp, hq, wq, chunk_size=tc, _vocab_chunk=vc)
        forward_peak = tracker.peak_bytes
        tracker.reset_peak()
        kl.sum().backward()
        backward_peak = tracker.peak_bytes
    small = 64 * n * 4  # the per-row [N] accumulators and outputs
    assert forward_peak <= 3 * block + small, forward_peak / block
    grads = (hp.numel() + wp.numel()) * 4 * (1 if frozen_reference else 2)
    # a frozen reference needs no q block in backward: zp and zq (reused for p and zp - zq) only
    live = 2 if frozen_reference else 3
    assert backward_peak <= live * block + grads + small, backward_peak / block


def test_automatic_plan_keeps_the_three_blocks_within_token_maths_budget(monkeypatch):
    from lit_rl.memory.tracker import TensorMemoryTracker

    budget_bytes = 48 * 1024
    monkeypatch.setattr(token_math, "LOGITS_BUDGET_BYTES", budget_bytes)
    inputs = _inputs(lead=(64,), v=3000)
    with TensorMemoryTracker() as tracker:
        kl = _kl(inputs)
        forward_peak = tracker.peak_bytes
    assert forward_peak <= budget_bytes + 64 * 64 * 4, forward_peak / budget_bytes
    torch.testing.assert_close(kl.double(), _reference(*[_leaf64(x) for x in inputs]), atol=1e-5, rtol=1e-5)
