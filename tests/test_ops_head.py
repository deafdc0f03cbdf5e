"""The head transforms in the logits-free ops (logit scale, final softcap) against a float64 full-logits reference."""

from __future__ import annotations

import math

import pytest
import torch

from lit_rl.ops import HeadSpec, kl_divergence, token_stats

B, T, H, V = 3, 5, 11, 53  # odd sizes


def _leaf(gen, *shape, scale=1.0, dtype=torch.float32):
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).requires_grad_()


def _leaf64(x):
    return None if x is None else x.detach().double().requires_grad_(x.requires_grad)


def _logits64(hidden, weight, bias, scale, softcap, temperature):
    """Float64 logits as the model computes them, then divided by the sampling temperature."""
    z = hidden @ weight.T + (bias if bias is not None else 0)  # [..., V]
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def _reference(hidden, weight, bias, targets, mask, *, scale, softcap, temperature):
    z = _logits64(hidden, weight, bias, scale, softcap, temperature)  # [B, T, V]
    logp_all = torch.log_softmax(z, -1)  # [B, T, V]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # [B, T]
    ent = -(logp_all.exp() * logp_all).sum(-1)  # [B, T]
    sc = torch.logsumexp(z, -1) - z.mean(-1) - math.log(z.shape[-1])  # [B, T]
    return logp * mask, ent * mask, sc * mask


HEADS = [(1.0, None), (0.0625, None), (2.5, None), (1.0, 3.0), (1.7, 5.0), (0.25, 30.0)]
HEAD_IDS = ["plain", "granite-divide", "cohere-scale", "softcap", "scale+softcap", "weak-softcap"]


@pytest.mark.parametrize(("scale", "softcap"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize(("chunk_size", "vocab_chunk"), [(None, None), (4, 7), (1, 1)], ids=["auto", "t4v7", "t1v1"])
def test_token_stats_with_a_transformed_head_match_float64(scale, softcap, temperature, chunk_size, vocab_chunk):
    gen = torch.Generator().manual_seed(3)
    hidden, weight, bias = _leaf(gen, B, T, H, scale=2.0), _leaf(gen, V, H), _leaf(gen, V)  # logits spread ~ +-10
    targets = torch.randint(0, V, (B, T), generator=gen)  # [B, T]
    mask = torch.ones(B, T)
    mask[0, :2] = 0  # left padding: no gradient may come from there
    targets[0, :2] = 0
    ups = [torch.randn(B, T, generator=gen) for _ in range(3)]  # upstream gradients  [B, T]
    h64, w64, b64 = _leaf64(hidden), _leaf64(weight), _leaf64(bias)

    stats = token_stats(
        hidden, weight, targets, bias=bias, scale=scale, softcap=softcap, temperature=temperature,
        chunk_size=chunk_size, entropy=True, self_certainty=True, _vocab_chunk=vocab_chunk,
    )  # fmt: skip
    got = (stats.logp * mask, stats.entropy * mask, stats.self_certainty * mask)
    ref = _reference(h64, w64, b64, targets, mask.double(), scale=scale, softcap=softcap, temperature=temperature)
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-5)
    sum(g.mul(u).sum() for g, u in zip(got, ups)).backward()
    sum(r.mul(u.double()).sum() for r, u in zip(ref, ups)).backward()
    for x, x64 in ((hidden, h64), (weight, w64), (bias, b64)):
        torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-4)
    assert hidden.grad[0, :2].abs().max() == 0  # padding positions get nothing


@pytest.mark.parametrize("temperature", [1.0, 1.3])
@pytest.mark.parametrize(
    ("head_p", "head_q"),
    [((1.0, 4.0), (1.0, 4.0)), ((0.5, None), (2.0, 6.0)), ((3.0, 2.0), (1.0, None))],
    ids=["both-softcap", "scale-vs-softcap", "softcap-vs-plain"],
)
@pytest.mark.parametrize(("chunk_size", "vocab_chunk"), [(None, None), (3, 10), (1, 1)], ids=["auto", "t3v10", "t1v1"])
def test_kl_with_transformed_heads_matches_float64(head_p, head_q, temperature, chunk_size, vocab_chunk):
    gen = torch.Generator().manual_seed(5)
    hp, wp, bp = _leaf(gen, 2, 7, H, scale=2.0), _leaf(gen, V, H), _leaf(gen, V)
    hq, wq, bq = _leaf(gen, 2, 7, H + 2, scale=2.0), _leaf(gen, V, H + 2), _leaf(gen, V)
    inputs = (hp, wp, bp, hq, wq, bq)
    ref_inputs = [_leaf64(x) for x in inputs]
    up = torch.randn(2, 7, generator=gen)  # [2, 7]

    kl = kl_divergence(
        hp, wp, hq, wq, bias_p=bp, bias_q=bq, scale_p=head_p[0], softcap_p=head_p[1], scale_q=head_q[0],
        softcap_q=head_q[1], temperature=temperature, chunk_size=chunk_size, _vocab_chunk=vocab_chunk,
    )  # fmt: skip
    zp = _logits64(*ref_inputs[0:3], *head_p, temperature)  # [2, 7, V]
    zq = _logits64(*ref_inputs[3:6], *head_q, temperature)  # [2, 7, V]
    logp, logq = torch.log_softmax(zp, -1), torch.log_softmax(zq, -1)
    ref = (logp.exp() * (logp - logq)).sum(-1)  # [2, 7]
    torch.testing.assert_close(kl.double(), ref, atol=1e-5, rtol=1e-5)
    (kl * up).sum().backward()
    (ref * up.double()).sum().backward()
    for x, x64 in zip(inputs, ref_inputs, strict=True):
        torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-4)


def test_gradcheck_through_scale_and_softcap():
    gen = torch.Generator().manual_seed(0)
    hidden, weight, bias = (_leaf(gen, *s, dtype=torch.float64) for s in ((2, 3, 4), (9, 4), (9,)))
    targets = torch.randint(0, 9, (2, 3), generator=gen)

    def outputs(h, w, b):
        s = token_stats(h, w, targets, bias=b, scale=1.5, softcap=2.0, temperature=0.8, self_certainty=True,
                        chunk_size=2, _vocab_chunk=4)  # fmt: skip
        return s.logp, s.entropy, s.self_certainty

    assert torch.autograd.gradcheck(outputs, (hidden, weight, bias))
    hq, wq = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64), torch.randn(9, 4, generator=gen).double()
    assert torch.autograd.gradcheck(
        lambda h, w: kl_divergence(h, w, hq, wq, softcap_p=2.0, scale_q=0.5, softcap_q=3.0, chunk_size=2,
                                   _vocab_chunk=4),  # fmt: skip
        (hidden, weight),
    )


def test_head_spec_logits_equal_the_chunked_log_probs():
    gen = torch.Generator().manual_seed(1)
    transform = torch.nn.Sequential(torch.nn.Linear(H, 6), torch.nn.Tanh())  # an ELECTRA-like projection H -> 6
    spec = HeadSpec(weight=torch.randn(V, 6, generator=gen), bias=None, scale=4.0, softcap=7.0, transform=transform)
    hidden = torch.randn(2, 3, H, generator=gen)
    targets = torch.randint(0, V, (2, 3), generator=gen)
    dense = torch.log_softmax(spec.logits(hidden).double(), -1).gather(-1, targets[..., None]).squeeze(-1)  # [2, 3]
    got = token_stats(spec.features(hidden), spec.weight, targets, entropy=False, **spec.op_kwargs).logp
    torch.testing.assert_close(got.double(), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("scale", "softcap"), [(0.0, None), (math.inf, None), (1.0, 0.0), (1.0, -2.0)])
def test_unusable_transforms_are_refused(scale, softcap):
    hidden, weight = torch.randn(1, 2, 3), torch.randn(5, 3)
    with pytest.raises(ValueError, match="scale|softcap"):
        token_stats(hidden, weight, None, scale=scale, softcap=softcap)
    with pytest.raises(ValueError, match="scale|softcap"):
        kl_divergence(hidden, weight, hidden, weight, scale_q=scale, softcap_q=softcap)


def test_softcap_keeps_the_blocks_within_the_budget(monkeypatch):
    from lit_rl.ops import token_math

    monkeypatch.setattr(token_math, "LOGITS_BUDGET_BYTES", 3 * 4 * 40)  # room for three 40-float blocks in all
    seen = []
    original = token_math.plan_chunks
    monkeypatch.setattr(token_math, "plan_chunks", lambda *a: seen.append(original(*a)) or seen[-1])
    hidden, weight = torch.randn(1, 9, 4), torch.randn(30, 4)
    token_stats(hidden, weight, None, softcap=3.0)
    tc, vc = seen[-1]
    assert 3 * tc * vc * 4 <= token_math.LOGITS_BUDGET_BYTES * 2  # z, p and the slope: three blocks of 2/3 budget
    assert tc * vc * 4 <= token_math.LOGITS_BUDGET_BYTES * 2 // 3
    token_stats(hidden, weight, None)
    tc, vc = seen[-1]
    assert tc * vc * 4 > token_math.LOGITS_BUDGET_BYTES * 2 // 3  # without softcap a block may use the whole budget
