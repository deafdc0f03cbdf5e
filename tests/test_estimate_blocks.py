"""Two shortcuts of the estimator's fake step (:mod:`lit_rl.memory.fake`) that change nothing it predicts: the block
loops of the logits-free token math run their first, second and last block only (``peak_blocks_only``), and
``.tolist()`` of a fake tensor answers what torch's element-by-element reads answer, in one go."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from lit_rl.memory import fake
from lit_rl.ops import kl, token_math


def test_block_starts_keeps_every_block_outside_the_estimator():
    assert list(token_math.block_starts(10, 3)) == [0, 3, 6, 9]
    with token_math.peak_blocks_only():
        assert list(token_math.block_starts(10, 3)) == [0, 3, 9]  # first, second, last (the short one)
        assert list(token_math.block_starts(9, 3)) == [0, 3, 6]  # three blocks: all of them
        assert list(token_math.block_starts(13, 3)) == [0, 3, 12]
    assert list(token_math.block_starts(13, 3)) == [0, 3, 6, 9, 12]


def test_a_fake_tensors_list_is_what_torchs_own_reads_give():
    original = FakeTensor.tolist
    with fake.fake_mode():
        for dtype in (torch.bool, torch.int64, torch.int32, torch.float32, torch.bfloat16):
            for shape in ((), (5,), (3, 4), (2, 0, 3), (2, 3, 2)):
                t = torch.empty(shape, dtype=dtype)
                assert isinstance(t, FakeTensor)
                got, want = t.tolist(), original(t)
                assert got == want and type(got) is type(want), (dtype, shape)
                if shape == (3, 4):
                    assert type(got[0][0]) is type(want[0][0])
                    got[0][0] = 7
                    assert got[1][0] != 7  # rows are distinct lists, as torch's are
    assert FakeTensor.tolist is original  # restored


def _peaks(op, kw: dict, starts=None) -> tuple[int, int]:
    """Peak tensor bytes of ``op``'s forward and of its backward on fake tensors: every block, or the blocks that
    ``starts`` (a ``block_starts``) picks under :func:`token_math.peak_blocks_only`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lit_rl.memory.tracker import TensorMemoryTracker

    with FakeTensorMode(), contextlib.ExitStack() as stack:
        if starts is not None:
            stack.enter_context(token_math.peak_blocks_only())
            stack.enter_context(_patched(starts))
        inputs = {k: v() if callable(v) else v for k, v in kw.items()}
        with TensorMemoryTracker() as tracker:
            out = op(**inputs)
            outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
            forward = tracker.peak_bytes
            tracker.reset_peak()
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            return forward, tracker.peak_bytes


@contextlib.contextmanager
def _patched(starts):
    saved = token_math.block_starts, kl.block_starts
    token_math.block_starts = kl.block_starts = starts
    try:
        yield
    finally:
        token_math.block_starts, kl.block_starts = saved


def _first_and_last(n, size):
    starts = range(0, n, size)
    return (starts[0], starts[-1]) if len(starts) > 2 else starts


N, V, H = 37, 101, 24  # 5 token blocks of 8 (the last 5), 7 vocabulary blocks of 16 (the last 5)


def _stats_case(dtype, weight_grad, softcap):
    return dict(
        hidden=lambda: torch.empty(N, H, dtype=dtype, requires_grad=True),
        weight=lambda: torch.empty(V, H, dtype=dtype, requires_grad=weight_grad),
        targets=lambda: torch.zeros(N, dtype=torch.long),
        chunk_size=8, _vocab_chunk=16, softcap=softcap, temperature=0.7, self_certainty=True,
    )  # fmt: skip


def _kl_case(dtype):
    return dict(
        hidden_p=lambda: torch.empty(N, H, dtype=dtype, requires_grad=True),
        weight_p=lambda: torch.empty(V, H, dtype=dtype, requires_grad=True),
        hidden_q=lambda: torch.empty(N, H, dtype=dtype),
        weight_q=lambda: torch.empty(V, H, dtype=dtype),
        chunk_size=8, _vocab_chunk=16, temperature=0.7,
    )  # fmt: skip


OPS = [
    pytest.param(token_math.token_stats, _stats_case(dt, wg, cap), id=f"token_stats-{dt}-{wg=}-{cap=}")
    for dt in (torch.float32, torch.bfloat16)
    for wg in (False, True)
    for cap in (None, 30.0)
] + [pytest.param(kl.kl_divergence, _kl_case(dt), id=f"kl-{dt}") for dt in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize(("op", "kw"), OPS)
def test_three_blocks_reach_the_peaks_of_every_block(op, kw):
    assert _peaks(op, kw, token_math.block_starts) == _peaks(op, kw)


def test_the_comparison_sees_a_missing_second_block():
    # without the second block, the step from one full block to the next (the previous weight rows or hidden chunk
    # still held while the next are cast) is never taken: some peak is under-predicted
    lower = [p.id for p in OPS if _peaks(*p.values, _first_and_last) != _peaks(*p.values)]
    assert lower, "the second block changes no peak: the shortcut could run two blocks"
