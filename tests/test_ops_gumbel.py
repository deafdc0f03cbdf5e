"""gumbel_softmax_topk with given noise: the top-k path against the full path and a plain float64 reference.

tests/test_ops.py covers the generator path (sums, reproducibility, k = 0, clamping, errors, gradcheck);
these tests compare the paths on one noise draw, which only the ``noise`` argument makes possible.
"""

from __future__ import annotations

import pytest
import torch

from lit_rl.ops import gumbel_softmax_topk

LEAD, V = (2, 3), 37  # odd vocabulary


def _logits(v=V, seed=0):
    return (2 * torch.randn(*LEAD, v, generator=torch.Generator().manual_seed(seed))).requires_grad_()  # [2, 3, V]


def _noise(v=V, seed=7, dtype=torch.float32):
    """Gumbel(0, 1) noise ``[2, 3, V]`` in vocabulary order, the recipe of the generator path."""
    u = torch.rand(*LEAD, v, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)  # [2, 3, V]
    return -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny))).to(dtype)  # [2, 3, V]


def _reference(logits64, noise64, tau, k):
    """Plain float64 relaxation over the k largest logits, scattered back to vocabulary order ``[2, 3, V]``."""
    kept = logits64.topk(k, dim=-1).indices  # [2, 3, k]
    masked = torch.full_like(logits64, -torch.inf).scatter(-1, kept, logits64.gather(-1, kept))  # [2, 3, V]
    return torch.softmax((masked + noise64) / tau, dim=-1)  # [2, 3, V], 0 outside the kept tokens


def _dense(weights, indices, v=V):
    """Weights ``[..., k]`` at ``indices`` scattered back into vocabulary order ``[..., V]``."""
    return torch.zeros(*weights.shape[:-1], v, dtype=weights.dtype).scatter(-1, indices, weights)


@pytest.mark.parametrize("tau", [0.6, 1.0, 1.7])
@pytest.mark.parametrize("v", [V, 50])
def test_topk_with_k_equal_v_matches_the_full_path_for_the_same_noise(tau, v):
    noise = _noise(v=v)
    up = torch.randn(*LEAD, v, generator=torch.Generator().manual_seed(1))  # upstream grad, vocabulary order
    logits_full, logits_topk = _logits(v=v), _logits(v=v)
    logits64 = logits_full.detach().double().requires_grad_()

    w_full, i_full = gumbel_softmax_topk(logits_full, tau, 0, noise=noise)
    w_topk, i_topk = gumbel_softmax_topk(logits_topk, tau, v, noise=noise)
    ref = _reference(logits64, noise.double(), tau, v)
    assert torch.equal(i_full, torch.arange(v).expand(*LEAD, v))
    assert torch.equal(i_topk.sort(-1).values, i_full)  # the same ids, in decreasing order of logit
    torch.testing.assert_close(w_full.double(), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(_dense(w_topk, i_topk, v).double(), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(_dense(w_topk, i_topk, v), w_full, atol=1e-6, rtol=1e-5)

    (w_full * up).sum().backward()
    (w_topk * up.gather(-1, i_topk)).sum().backward()  # the same loss, read at the top-k ids
    (ref * up.double()).sum().backward()
    torch.testing.assert_close(logits_full.grad.double(), logits64.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(logits_topk.grad.double(), logits64.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tau", [0.5, 1.3])
def test_topk_gathers_the_noise_at_the_kept_ids(tau):
    k = 5
    logits, noise = _logits(), _noise()
    logits64 = logits.detach().double().requires_grad_()
    up = torch.randn(*LEAD, V, generator=torch.Generator().manual_seed(1))  # [2, 3, V]

    weights, indices = gumbel_softmax_topk(logits, tau, k, noise=noise)
    ref = _reference(logits64, noise.double(), tau, k)
    assert weights.shape == indices.shape == (*LEAD, k)
    torch.testing.assert_close(_dense(weights, indices).double(), ref, atol=1e-6, rtol=1e-5)

    (weights * up.gather(-1, indices)).sum().backward()
    (ref * up.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), logits64.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("k", [0, 6, V], ids=["full", "top6", "topV"])
def test_hard_is_one_hot_at_the_gumbel_max_with_the_soft_gradient(k):
    tau = 0.7
    noise = _noise()
    logits_hard, logits_soft = _logits(), _logits()
    hard, i_hard = gumbel_softmax_topk(logits_hard, tau, k, hard=True, noise=noise)
    soft, i_soft = gumbel_softmax_topk(logits_soft, tau, k, noise=noise)
    assert torch.equal(i_hard, i_soft)
    assert ((hard == 0) | (hard == 1)).all() and torch.equal(hard.sum(-1), torch.ones(LEAD))
    # the one-hot sits at the Gumbel-max over the kept tokens: argmax of logits + noise among them
    kept = logits_hard.detach().topk(k or V, dim=-1).indices  # [2, 3, k]
    scores = torch.full((*LEAD, V), -torch.inf).scatter(-1, kept, (logits_hard.detach() + noise).gather(-1, kept))
    assert torch.equal(i_hard.gather(-1, hard.argmax(-1, keepdim=True)).squeeze(-1), scores.argmax(-1))

    up = torch.randn(hard.shape, generator=torch.Generator().manual_seed(1))  # [2, 3, k]
    (hard * up).sum().backward()
    (soft * up).sum().backward()
    assert logits_hard.grad.abs().sum() > 0
    torch.testing.assert_close(logits_hard.grad, logits_soft.grad, atol=0, rtol=0)


def test_noise_follows_the_generator_recipe_in_vocabulary_order():
    # on the full path the generator draws [..., V] uniforms in vocabulary order: the same as passing that noise
    logits = _logits()
    drawn, _ = gumbel_softmax_topk(logits, 0.8, 0, generator=torch.Generator().manual_seed(7))
    given, _ = gumbel_softmax_topk(logits, 0.8, 0, noise=_noise(seed=7))
    assert torch.equal(drawn, given)


def test_double_logits_with_float32_noise():
    logits64 = _logits().detach().double().requires_grad_()
    noise = _noise()
    weights, indices = gumbel_softmax_topk(logits64, 1.3, 9, noise=noise)
    assert weights.dtype == torch.float64
    torch.testing.assert_close(_dense(weights, indices), _reference(logits64, noise.double(), 1.3, 9))


def test_noise_argument_errors():
    logits = _logits()
    with pytest.raises(ValueError, match="not both"):
        gumbel_softmax_topk(logits, 1.0, 4, noise=_noise(), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="shape of logits"):
        gumbel_softmax_topk(logits, 1.0, 4, noise=_noise()[..., :5])
