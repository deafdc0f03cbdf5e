"""The decode step's packed attention (lit_rl/models/decode_attention.py) against a float64 reference and against
transformers' own sdpa attention, and sample_completions, which decodes through it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lit_rl.models import sample_completions
from lit_rl.models.cache_keyword import cache_kwargs, output_cache
from lit_rl.models.decode_attention import PACKED_SDPA, packed_decode_attention, packed_sdpa_forward
from lit_rl.models.tiny import tiny_model


class _Heads(torch.nn.Module):
    """What transformers' attention functions read from the attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _reference(query, key, value, mask, scale):
    """Attention in float64, every query head against its key-value head: softmax(q k^T * scale, masked) v."""
    q, k, v = (t.double() for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return (scores.softmax(-1) @ v).transpose(1, 2)  # [B, Q, H, D]


def _inputs(batch, heads, kv_heads, keys, dim, dtype, padded, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, 1, dim, generator=g).to(dtype)
    key = (2 * torch.randn(batch, kv_heads, keys, dim, generator=g)).to(dtype)
    value = torch.randn(batch, kv_heads, keys, dim, generator=g).to(dtype)
    mask = None
    if padded:  # left padding: row i has its first i keys masked, as sdpa_mask gives them ([B, 1, 1, K], True: attend)
        mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
        for row in range(batch):
            mask[row, ..., : min(row, keys - 1)] = False
    return query, key, value, mask


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 2), (6, 1)])
@pytest.mark.parametrize("keys", [1, 7, 131])
@pytest.mark.parametrize("padded", [False, True])
def test_packed_attention_equals_float64_reference_and_sdpa(dtype, tolerance, heads, kv_heads, keys, padded):
    query, key, value, mask = _inputs(3, heads, kv_heads, keys, 16, dtype, padded)
    scale = 0.37  # not 1/sqrt(D): the scaling is passed through
    module = _Heads(heads // kv_heads)
    out, weights = packed_sdpa_forward(module, query, key, value, mask, scaling=scale)
    assert weights is None and out.shape == (3, 1, heads, 16) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), _reference(query, key, value, mask, scale), atol=tolerance, rtol=0)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scale)
    torch.testing.assert_close(out, theirs, atol=tolerance, rtol=0)
    assert torch.equal(out, theirs) or dtype != torch.float32  # float32 is transformers' call itself


def test_packed_attention_gradient_equals_float64_reference():
    query, key, value, mask = _inputs(2, 6, 2, 13, 8, torch.float32, padded=True, seed=1)
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    out, _ = packed_sdpa_forward(_Heads(3), *leaves, mask, scaling=0.5)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    doubles = [t.double().requires_grad_() for t in (query, key, value)]
    expected = torch.autograd.grad((_reference(*doubles, mask, 0.5) * weights.double()).sum(), doubles)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["several queries", "no grouped heads"])
def test_other_shapes_are_sdpa_attention_forward_unchanged(case):
    length, kv_heads = (5, 2) if case == "several queries" else (1, 4)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(2, 4, length, 8, generator=g, dtype=torch.float32).to(torch.bfloat16)
    key, value = (torch.randn(2, kv_heads, 9, 8, generator=g).to(torch.bfloat16) for _ in range(2))
    module = _Heads(4 // kv_heads)
    ours, _ = packed_sdpa_forward(module, query, key, value, None, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.3)
    assert torch.equal(ours, theirs)


def test_packed_decode_attention_switches_sdpa_models_and_restores():
    model = tiny_model("llama", attn_implementation="sdpa")
    with packed_decode_attention(model) as packed:
        assert packed and model.config._attn_implementation == PACKED_SDPA
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), packed_decode_attention(model):
        raise RuntimeError("a failing rollout")
    assert model.config._attn_implementation == "sdpa"
    eager = tiny_model("llama", attn_implementation="eager")
    with packed_decode_attention(eager) as packed:
        assert not packed and eager.config._attn_implementation == "eager"


def _packed_calls(monkeypatch) -> list[tuple[int, ...]]:
    """The query shapes of the packed path's calls, recorded."""
    import lit_rl.models.decode_attention as module

    shapes, packed = [], module._packed

    def recording(query, *args):
        shapes.append(tuple(query.shape))
        return packed(query, *args)

    monkeypatch.setattr(module, "_packed", recording)
    return shapes


def test_a_half_precision_decode_step_attends_packed_with_sdpas_logits(monkeypatch):
    """A bf16 decode step inside packed_decode_attention runs the packed kernel call ([B, KV, group, D] queries)
    and gives the logits of sdpa's grouped call within bf16 rounding."""
    model = tiny_model("llama", attn_implementation="sdpa", hidden_size=64).to(torch.bfloat16).eval()
    ids = torch.randint(3, 128, (4, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        prefill = model(ids, use_cache=True)
        token = prefill.logits[:, -1:].argmax(-1)
        cache = output_cache(prefill)
        plain = model(token, **cache_kwargs(model, copy.deepcopy(cache))).logits.float()
        shapes = _packed_calls(monkeypatch)
        with packed_decode_attention(model):
            packed = model(token, **cache_kwargs(model, cache)).logits.float()
    assert shapes == [(4, 4, 1, 16)] * 2  # both layers, a one-token query of 4 heads (over 2 key-value heads)
    torch.testing.assert_close(packed, plain, atol=0.02, rtol=0)
    assert packed.abs().max() > 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bf16 autocast"])
def test_sample_completions_packs_half_precision_decode_steps_and_own_loop_stays_generates(monkeypatch, dtype):
    """sample_completions attends packed in bf16 and under bf16 autocast of float32 weights (bf16-mixed, the bf16
    sampler: the query arrives float32 there), only the one-token steps, float32 never; for the own loop and
    generate alike, so the own loop still draws generate's tokens; the attention is restored afterwards."""
    model = tiny_model("llama", seed=8, attn_implementation="sdpa")
    model = model.to(torch.bfloat16) if dtype == "bfloat16" else model
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=dtype == "bf16 autocast")
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(5))
    config = dict(do_sample=True, temperature=0.9, top_p=1.0, top_k=0, max_new_tokens=6, min_new_tokens=6)
    out, calls = {}, {}
    for own in (False, True):
        shapes = _packed_calls(monkeypatch)
        torch.manual_seed(3)
        with autocast:
            out[own] = sample_completions(model, ids, torch.ones_like(ids), 0, [2], repeats=2, own_decode=own, **config)
        calls[own] = list(shapes)
        monkeypatch.undo()
    assert torch.equal(out[True], out[False])
    assert model.config._attn_implementation == "sdpa" and model.training
    packed = [(4, 4, 1, 8)] * (2 * 5)  # 2 layers x the 5 steps after the prefill, 4 rows
    for own in (False, True):
        assert calls[own] == ([] if dtype == "float32" else packed)


@pytest.mark.bench
@pytest.mark.slow
def test_bench_decode_attention_quick_table(capsys):
    """bench/bench_decode_attention.py --quick: one row per dtype and key count, both calls within their dtype's
    rounding of float64."""
    from bench_loader import load_bench

    with load_bench("bench_decode_attention.py") as bench:
        text = bench.main(["--quick"])
    assert text in capsys.readouterr().out
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| float32") or line.startswith("| bf")]
    assert [(r[0].strip("| "), r[1]) for r in rows] == [(d, k) for d in ("float32", "bfloat16") for k in ("8", "40")]
    for row in rows:
        tolerance = 1e-5 if row[0].endswith("float32") else 2e-2
        assert float(row[5]) < tolerance and float(row[6]) < tolerance
