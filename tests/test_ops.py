"""Numerics of lit_rl.ops against a plain float64 full-logits reference: values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_rl.ops import entropy, gumbel_softmax_topk, selective_log_probs, self_certainty, token_math, token_stats

B, T, H, V = 3, 7, 13, 101  # odd sizes: 21 tokens, a prime-ish vocabulary


def _inputs(dtype=torch.float32, bias=False, seed=0, b=B, t=T, h=H, v=V):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=gen).to(dtype).requires_grad_()  # [B, T, H]
    weight = (torch.randn(v, h, generator=gen) * 0.5).to(dtype).requires_grad_()  # [V, H]
    targets = torch.randint(0, v, (b, t), generator=gen)  # [B, T]
    bias_t = torch.randn(v, generator=gen).to(dtype).requires_grad_() if bias else None  # [V]
    return hidden, weight, targets, bias_t


def _leaf64(x):
    return None if x is None else x.detach().double().requires_grad_(x.requires_grad)


def _reference(hidden, weight, targets, *, temperature=1.0, bias=None):
    """Float64 full-logits reference: (logp, entropy, self_certainty), each [B, T]."""
    z = hidden @ weight.T  # [B, T, V]
    if bias is not None:
        z = z + bias
    z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)  # [B, T, V]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1) if targets is not None else None  # [B, T]
    ent = -(logp_all.exp() * logp_all).sum(-1)  # [B, T]
    sc = torch.logsumexp(z, dim=-1) - z.mean(-1) - math.log(z.shape[-1])  # [B, T]
    return logp, ent, sc


def _assert_grads(pairs, atol=1e-5, rtol=1e-4):
    for got, ref in pairs:
        if ref is None or not ref.requires_grad:
            assert got is None or got.grad is None
            continue
        assert got.grad is not None and got.grad.dtype == got.dtype
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=atol, rtol=rtol)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize(
    ("chunk_size", "vocab_chunk"),
    [(None, None), (5, None), (4, 17), (8, 100), (2, 1)],
    ids=["auto", "tokens5", "tokens4-vocab17", "tokens8-vocab100", "tokens2-vocab1"],
)
def test_selective_log_probs_matches_reference(chunk_size, vocab_chunk, temperature):
    hidden, weight, targets, _ = _inputs()
    h64, w64 = _leaf64(hidden), _leaf64(weight)
    up = torch.randn(B, T, generator=torch.Generator().manual_seed(1))  # upstream grad  [B, T]

    logp = selective_log_probs(
        hidden, weight, targets, temperature=temperature, chunk_size=chunk_size, _vocab_chunk=vocab_chunk
    )
    ref, _, _ = _reference(h64, w64, targets, temperature=temperature)
    assert logp.shape == (B, T) and logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=1e-5)

    (logp * up).sum().backward()
    (ref * up.double()).sum().backward()
    _assert_grads([(hidden, h64), (weight, w64)])


@pytest.mark.parametrize("vocab_chunk", [None, 17])
def test_entropy_and_self_certainty_match_reference(vocab_chunk):
    up = torch.randn(B, T, generator=torch.Generator().manual_seed(1))  # [B, T]
    for which, fn in ((1, entropy), (2, self_certainty)):
        hidden, weight, targets, _ = _inputs()
        h64, w64 = _leaf64(hidden), _leaf64(weight)
        out = fn(hidden, weight, temperature=1.3, chunk_size=4, _vocab_chunk=vocab_chunk)
        ref = _reference(h64, w64, None, temperature=1.3)[which]
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        (out * up).sum().backward()
        (ref * up.double()).sum().backward()
        _assert_grads([(hidden, h64), (weight, w64)])


def test_self_certainty_is_nonnegative_and_its_gradient_is_softmax_minus_uniform():
    # identity LM head: z = hidden / temperature, so d sc / d hidden = (softmax(z) - 1/V) / temperature
    v, temperature = 11, 0.7
    hidden = (3 * torch.randn(2, 5, v, generator=torch.Generator().manual_seed(0))).requires_grad_()  # [2, 5, V]
    weight = torch.eye(v)  # [V, V], frozen
    sc = self_certainty(hidden, weight, temperature=temperature, _vocab_chunk=4)
    assert (sc >= 0).all()
    sc.sum().backward()
    z = hidden.detach().double() / temperature  # [2, 5, V]
    expected = (torch.softmax(z, -1) - 1 / v) / temperature  # [2, 5, V]
    torch.testing.assert_close(hidden.grad.double(), expected, atol=1e-6, rtol=1e-5)
    # uniform logits: p = U exactly, self-certainty 0
    flat = self_certainty(torch.zeros(1, 2, v), weight)
    torch.testing.assert_close(flat, torch.zeros(1, 2), atol=1e-6, rtol=0)


@pytest.mark.parametrize("vocab_chunk", [None, 30])
def test_token_stats_matches_separate_calls_and_combined_gradient(vocab_chunk):
    hidden, weight, targets, bias = _inputs(bias=True)
    kw = dict(temperature=0.7, chunk_size=6, bias=bias, _vocab_chunk=vocab_chunk)
    stats = token_stats(hidden, weight, targets, entropy=True, self_certainty=True, **kw)
    with torch.no_grad():
        torch.testing.assert_close(stats.logp, selective_log_probs(hidden, weight, targets, **kw), atol=0, rtol=0)
        torch.testing.assert_close(stats.entropy, entropy(hidden, weight, **kw), atol=0, rtol=0)
        torch.testing.assert_close(stats.self_certainty, self_certainty(hidden, weight, **kw), atol=0, rtol=0)

    h64, w64, b64 = _leaf64(hidden), _leaf64(weight), _leaf64(bias)
    logp, ent, sc = _reference(h64, w64, targets, temperature=0.7, bias=b64)
    (stats.logp.sum() + 0.3 * stats.self_certainty.sum() + 0.1 * stats.entropy.sum()).backward()
    (logp.sum() + 0.3 * sc.sum() + 0.1 * ent.sum()).backward()
    _assert_grads([(hidden, h64), (weight, w64), (bias, b64)])


def test_token_stats_leaves_unrequested_outputs_none():
    hidden, weight, targets, _ = _inputs()
    stats = token_stats(hidden, weight, targets, entropy=False)
    assert stats.logp is not None and stats.entropy is None and stats.self_certainty is None
    stats = token_stats(hidden, weight, None, entropy=False, self_certainty=True)
    assert stats.logp is None and stats.entropy is None and stats.self_certainty.shape == (B, T)


def test_padding_gets_zero_gradient():
    hidden, weight, targets, _ = _inputs()
    mask = torch.ones(B, T)  # [B, T]
    mask[0, 4:] = 0
    mask[2, :2] = 0
    h64, w64 = _leaf64(hidden), _leaf64(weight)
    logp = selective_log_probs(hidden, weight, targets, chunk_size=4, _vocab_chunk=33)
    (logp * mask).sum().backward()
    ref, _, _ = _reference(h64, w64, targets)
    (ref * mask.double()).sum().backward()
    _assert_grads([(hidden, h64), (weight, w64)])
    assert (hidden.grad[mask == 0] == 0).all()


def test_bf16_inputs_give_float32_outputs_close_to_reference():
    hidden, weight, targets, bias = _inputs(dtype=torch.bfloat16, bias=True)
    # reference on the same bf16-rounded values, so only accumulation error remains
    h64, w64, b64 = _leaf64(hidden), _leaf64(weight), _leaf64(bias)
    stats = token_stats(hidden, weight, targets, bias=bias, self_certainty=True, chunk_size=5, _vocab_chunk=40)
    ref = _reference(h64, w64, targets, bias=b64)
    for got, exp in zip(stats, ref, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exp, atol=1e-4, rtol=1e-4)
    (stats.logp.sum() + stats.self_certainty.sum() + stats.entropy.sum()).backward()
    sum(r.sum() for r in ref).backward()
    for got, exp in ((hidden, h64), (weight, w64), (bias, b64)):
        assert got.grad.dtype == torch.bfloat16
        torch.testing.assert_close(got.grad.double(), exp.grad, atol=2e-2, rtol=2e-2)  # bf16 rounding of the grad


def test_autocast_does_not_lower_the_precision():
    hidden, weight, targets, _ = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = selective_log_probs(hidden, weight, targets, chunk_size=5)
    ref, _, _ = _reference(_leaf64(hidden), _leaf64(weight), targets)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_frozen_weight_gets_no_gradient(bias):
    hidden, weight, targets, bias_t = _inputs(bias=bias)
    weight.requires_grad_(False)
    h64, w64, b64 = _leaf64(hidden), _leaf64(weight), _leaf64(bias_t)
    stats = token_stats(hidden, weight, targets, bias=bias_t, self_certainty=True, chunk_size=4, _vocab_chunk=17)
    (stats.logp.sum() + stats.self_certainty.sum() + 0.5 * stats.entropy.sum()).backward()
    logp, ent, sc = _reference(h64, w64, targets, bias=b64)
    (logp.sum() + sc.sum() + 0.5 * ent.sum()).backward()
    assert weight.grad is None
    _assert_grads([(hidden, h64), (bias_t, b64)])


def test_no_grad_pass_and_empty_batch():
    hidden, weight, targets, _ = _inputs()
    with torch.no_grad():
        logp = selective_log_probs(hidden, weight, targets)
    assert not logp.requires_grad and logp.shape == (B, T)
    empty = selective_log_probs(hidden[:0], weight, targets[:0])
    assert empty.shape == (0, T)


def test_gradcheck_all_outputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 4, dtype=torch.double, generator=gen, requires_grad=True)  # [2, 3, 4]
    weight = torch.randn(9, 4, dtype=torch.double, generator=gen, requires_grad=True)  # [9, 4]
    bias = torch.randn(9, dtype=torch.double, generator=gen, requires_grad=True)  # [9]
    targets = torch.randint(0, 9, (2, 3), generator=gen)  # [2, 3]

    def fn(h, w, b):
        return tuple(
            token_stats(h, w, targets, temperature=0.7, bias=b, chunk_size=4, self_certainty=True, _vocab_chunk=4)
        )

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_invalid_arguments_raise():
    hidden, weight, targets, _ = _inputs()
    with pytest.raises(ValueError, match="disagree"):
        selective_log_probs(hidden, weight[:, :5], targets)
    with pytest.raises(ValueError, match="targets"):
        selective_log_probs(hidden, weight, targets[:, :3])
    with pytest.raises(ValueError, match="temperature"):
        selective_log_probs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        selective_log_probs(hidden, weight, targets, chunk_size=0)


# --- memory: what is saved for backward, and how big any intermediate gets -------------------------------


def test_forward_saves_no_token_by_vocab_tensor():
    b, t, h, v = 2, 16, 8, 5000
    hidden, weight, targets, _ = _inputs(b=b, t=t, h=h, v=v)
    saved: list[int] = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        stats = token_stats(hidden, weight, targets, self_certainty=True)
    assert saved, "the hook saw no saved tensor"
    assert max(saved) < b * t * v
    # hidden, weight, targets, the log-normaliser and the entropy: nothing else
    assert sorted(saved) == sorted([b * t * h, v * h, b * t, b * t, b * t])
    stats.logp.sum().backward()


class _LargeOutputs(TorchDispatchMode):
    """Records the shapes of floating-point tensors above ``limit`` elements that any op produces."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.seen_blocks = False
        self.large: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, tuple | list) else (out,):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                self.seen_blocks |= x.numel() == self.limit
                if x.numel() > self.limit:
                    self.large.add(tuple(x.shape))
        return out


def test_logits_blocks_stay_within_budget(monkeypatch):
    b, t, h, v = 2, 32, 8, 3072  # N * V = 196608 elements
    budget_bytes = 16 * 1024  # 4096 float32 elements
    monkeypatch.setattr(token_math, "LOGITS_BUDGET_BYTES", budget_bytes)
    hidden, weight, targets, _ = _inputs(b=b, t=t, h=h, v=v, dtype=torch.bfloat16)
    h64, w64 = _leaf64(hidden), _leaf64(weight)
    with _LargeOutputs(budget_bytes // 4) as mode:
        stats = token_stats(hidden, weight, targets, self_certainty=True)
        (stats.logp.sum() + stats.self_certainty.sum() + stats.entropy.sum()).backward()
    # forward and backward ran full [tokens, vocab] blocks of exactly the budget (blocks of 8 x 512)...
    assert mode.seen_blocks
    # ...and nothing bigger but the weight gradient itself (no [N, V] logits, no [N, V] softmax)
    assert mode.large <= {(v, h)}
    ref = _reference(h64, w64, targets)
    torch.testing.assert_close(stats.logp.double(), ref[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("n", "v", "h"), [(8192, 151936, 4096), (8192, 49152, 576), (21, 101, 13)])
def test_automatic_plan_respects_the_budget(n, v, h):
    budget = token_math.LOGITS_BUDGET_BYTES
    tc, vc = token_math.plan_chunks(n, v, h, None, None, budget)
    assert 1 <= tc <= n and 1 <= vc <= v
    assert tc * vc * 4 <= budget and vc * h * 4 <= budget and tc * h * 4 <= budget
    tc, vc = token_math.plan_chunks(n, v, h, 512, None, budget)
    assert tc == min(n, 512) and tc * vc * 4 <= budget


# --- top-k Gumbel-softmax --------------------------------------------------------------------------------


def _gumbel_reference(logits64, tau, k, seed):
    """Float64 reference with the same noise recipe: float32 uniforms from a generator with ``seed``."""
    vals, idx = logits64.topk(k, dim=-1)  # [..., k]
    u = torch.rand(vals.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)  # [..., k]
    g = -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny).double()))  # [..., k]
    return torch.softmax((vals + g) / tau, dim=-1), idx


def _logits(shape=(2, 3, 50), seed=0, dtype=torch.float32):
    return (2 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gumbel_topk_weights_sum_to_one_and_indices_are_topk(dtype):
    logits = _logits(dtype=dtype)
    weights, indices = gumbel_softmax_topk(logits, 0.5, 5, generator=torch.Generator().manual_seed(0))
    assert weights.shape == indices.shape == (2, 3, 5) and indices.dtype == torch.long
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3))
    assert torch.equal(indices, logits.float().topk(5, dim=-1).indices)


def test_gumbel_topk_is_reproducible_with_a_generator():
    logits = _logits()
    a = gumbel_softmax_topk(logits, 0.7, 8, generator=torch.Generator().manual_seed(3))[0]
    b = gumbel_softmax_topk(logits, 0.7, 8, generator=torch.Generator().manual_seed(3))[0]
    c = gumbel_softmax_topk(logits, 0.7, 8, generator=torch.Generator().manual_seed(4))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_gumbel_topk_hard_is_one_hot_forward_with_soft_gradient():
    logits = _logits()
    weights, _ = gumbel_softmax_topk(logits, 0.5, 6, hard=True, generator=torch.Generator().manual_seed(0))
    assert ((weights == 0) | (weights == 1)).all() and (weights.sum(-1) == 1).all()
    soft, _ = gumbel_softmax_topk(logits, 0.5, 6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(weights.argmax(-1), soft.argmax(-1))
    up = torch.randn(weights.shape, generator=torch.Generator().manual_seed(1))  # [2, 3, 6]
    (grad_hard,) = torch.autograd.grad((weights * up).sum(), logits)
    (grad_soft,) = torch.autograd.grad((soft * up).sum(), logits)
    assert grad_hard.abs().sum() > 0
    torch.testing.assert_close(grad_hard, grad_soft)


def test_gumbel_topk_k0_is_the_full_vocabulary_and_large_k_is_clamped():
    logits = _logits()
    weights, indices = gumbel_softmax_topk(logits, 1.0, 0)
    assert weights.shape == (2, 3, 50)
    assert torch.equal(indices, torch.arange(50).expand(2, 3, 50))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3))
    weights, indices = gumbel_softmax_topk(logits, 1.0, 80)
    assert weights.shape == indices.shape == (2, 3, 50)
    assert torch.equal(indices.sort(-1).values, torch.arange(50).expand(2, 3, 50))


def test_gumbel_topk_invalid_arguments_raise():
    logits = _logits()
    with pytest.raises(ValueError, match="k must be"):
        gumbel_softmax_topk(logits, 1.0, -1)
    with pytest.raises(ValueError, match="tau"):
        gumbel_softmax_topk(logits, 0.0, 4)


def test_gumbel_topk_gradient_matches_float64_reference():
    logits = _logits()
    up = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1))  # [2, 3, 7]
    weights, indices = gumbel_softmax_topk(logits, 0.6, 7, generator=torch.Generator().manual_seed(5))
    logits64 = logits.detach().double().requires_grad_()
    ref, ref_idx = _gumbel_reference(logits64, 0.6, 7, seed=5)
    assert torch.equal(indices, ref_idx)
    torch.testing.assert_close(weights.double(), ref, atol=1e-6, rtol=1e-5)
    (weights * up).sum().backward()
    (ref * up.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), logits64.grad, atol=1e-6, rtol=1e-5)
    outside = torch.ones_like(logits, dtype=torch.bool).scatter_(-1, indices, False)  # [2, 3, 50]
    assert (logits.grad[outside] == 0).all()


@pytest.mark.parametrize("k", [0, 4])
def test_gumbel_topk_gradcheck(k):
    logits = torch.randn(2, 9, dtype=torch.double, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def fn(x):  # the same noise on every call
        return gumbel_softmax_topk(x, 0.8, k, generator=torch.Generator().manual_seed(2))[0]

    assert torch.autograd.gradcheck(fn, (logits,))


@pytest.mark.parametrize("need_weight_grad", [False, True])
def test_at_most_two_logits_blocks_are_alive_at_once(need_weight_grad):
    from lit_rl.memory.tracker import TensorMemoryTracker

    n, h, v, tc, vc = 512, 16, 4096, 128, 1024
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=need_weight_grad)
    targets = torch.randint(0, v, (n,))
    block = tc * vc * 4  # one float32 logits block
    with TensorMemoryTracker() as tracker:
        out = token_stats(hidden, weight, targets, chunk_size=tc, _vocab_chunk=vc, entropy=True)
        forward_peak = tracker.peak_bytes
        tracker.reset_peak()
        out.logp.sum().backward()
        backward_peak = tracker.peak_bytes
    small = 64 * n * 4  # the per-token [N] accumulators and outputs
    assert forward_peak <= 2 * block + small, forward_peak / block
    grads = hidden.numel() * 4 + (weight.numel() * 4 if need_weight_grad else 0)
    assert backward_peak <= 3 * block + grads + small, backward_peak / block
