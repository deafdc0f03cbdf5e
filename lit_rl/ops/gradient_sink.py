"""One weight's gradient from many small uses, summed in place into one buffer.

A differentiable rollout reads the LM head (and, tied or not, the input embedding) once per generated token:
the head's logits for sampling, the KL's vocabulary blocks, the embedding rows of the soft token. Under autograd
each use's backward returns a gradient the size of the whole weight (``[V, H]``: a fresh ``zeros`` for the
embedding's and the KL's, a fresh matmul output for the logits'), which the parameter's accumulator then adds to
its ``.grad``: three new ``[V, H]`` tensors per token, each allocated, zeroed or written whole and added. On the
embedded 135M model (``V = 49152``, ``H = 576``: 113 MB a tensor) that is 48 such tensors for a 16-token rollout,
and on a CPU most of their cost is the kernel faulting in fresh pages.

A :class:`GradientSink` for a weight gives its uses the weight without gradient and an ``anchor``, an empty tensor
computed from the weight. Each use takes the anchor as an input, adds its part of the weight gradient into the
sink's buffer in its backward (an in-place ``addmm_`` or ``index_add_``; the buffer is allocated once per
backward), and returns an empty gradient for the anchor. The anchor's own backward runs after every use's (each
use depends on it) and hands the buffer to the weight as its gradient, once. The values are those of autograd's
own accumulation up to the order of the additions.

Uses: :meth:`GradientSink.linear` (``x @ W.T``), :meth:`GradientSink.embedding` (rows of ``W``, an
``nn.Embedding``'s ``padding_idx`` honoured), and :func:`lit_rl.ops.kl_divergence`'s ``sink_p``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


class GradientSink:
    """The gradient of ``weight`` (a tensor that requires grad) from every use through this sink, summed in place.

    Create one per forward pass (per rollout): the buffer is handed over and dropped in that pass's backward.

    Args:
        weight: the parameter whose gradient the uses share.

    Raises:
        ValueError: when ``weight`` does not require grad (then there is nothing to sum: use it directly).
    """

    def __init__(self, weight: Tensor) -> None:
        if not weight.requires_grad:
            raise ValueError("GradientSink: the weight does not require grad; use it directly")
        self.weight = weight.detach()  # what the uses read
        self._buffer: Tensor | None = None
        self.anchor = _Anchor.apply(weight, self)  # [0], a node every use depends on

    @classmethod
    def of(cls, weight: Tensor) -> GradientSink | None:
        """A sink for ``weight`` when gradients are being recorded and it takes one, else ``None``."""
        return cls(weight) if torch.is_grad_enabled() and weight.requires_grad else None

    def buffer(self) -> Tensor:
        """The running sum ``[*weight.shape]`` in the weight's dtype, allocated (zeroed) at the first use."""
        if self._buffer is None:
            self._buffer = torch.zeros_like(self.weight)
        return self._buffer

    def take(self) -> Tensor | None:
        """The summed gradient (``None`` when no use added any), and the sink empty again."""
        out, self._buffer = self._buffer, None
        return out

    def linear(self, x: Tensor) -> Tensor:
        """``x @ weight.T`` ``[..., V]`` (autocast applies as to ``F.linear``); its weight gradient goes to the sink."""
        return _SinkLinear.apply(x, self.anchor, self)

    def embedding(self, indices: Tensor, padding_idx: int | None = None) -> Tensor:
        """``weight[indices]`` ``[..., H]``; the rows' gradient goes to the sink, none to row ``padding_idx`` (as
        ``nn.Embedding`` does)."""
        return _SinkRows.apply(indices, self.anchor, self, padding_idx)


class _Anchor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: Tensor, sink: GradientSink) -> Tensor:
        ctx.sink = sink
        return weight.new_empty(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, _: Tensor):
        return ctx.sink.take(), None


class _SinkLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor, sink: GradientSink) -> Tensor:
        ctx.sink = sink
        ctx.save_for_backward(x)
        return torch.nn.functional.linear(x, sink.weight)  # [..., V]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        sink = ctx.sink
        w = sink.weight
        flat_g = grad.reshape(-1, grad.shape[-1]).to(w.dtype)  # [N, V]
        gx = (flat_g @ w).to(x.dtype).reshape(x.shape) if ctx.needs_input_grad[0] else None  # [..., H]
        sink.buffer().addmm_(flat_g.T, x.reshape(-1, x.shape[-1]).to(w.dtype))  # [V, H]
        return gx, grad.new_zeros(0), None


class _SinkRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, indices: Tensor, anchor: Tensor, sink: GradientSink, padding_idx: int | None) -> Tensor:
        ctx.sink, ctx.padding_idx = sink, padding_idx
        ctx.save_for_backward(indices)
        return sink.weight[indices]  # [..., H]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (indices,) = ctx.saved_tensors
        buffer = ctx.sink.buffer()
        flat_i = indices.reshape(-1)  # [N]
        flat_g = grad.reshape(-1, grad.shape[-1]).to(buffer.dtype)  # [N, H]
        if ctx.padding_idx is not None:
            flat_g = flat_g * (flat_i != ctx.padding_idx).unsqueeze(-1).to(flat_g.dtype)
        buffer.index_add_(0, flat_i, flat_g)
        return None, grad.new_zeros(0), None, None
