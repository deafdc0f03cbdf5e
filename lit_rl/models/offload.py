"""Activation offloading: the tensors a forward saves for its backward kept in host memory until the backward.

:class:`OffloadSavedTensors` is a pair of ``torch.autograd.graph.saved_tensors_hooks``: each tensor an op saves
(above ``min_bytes``, on the training device, not a weight) is copied to a pinned host buffer on a side stream while
the forward goes on, and copied back on the compute stream when the backward unpacks it. At most ``max_in_flight``
copies are outstanding: the next one waits for the oldest (prime-rl bounds its asynchronous offloading the same
way, at 5). The device memory of an offloaded tensor is released when the forward drops it, once its copy is done
(``record_stream`` tells the caching allocator so). Cost: a device-to-host and a host-to-device copy of every
offloaded byte, overlapped with compute where the interconnect keeps up.

Three ways to hold the host copy, one code path:

- ``pinned`` (CUDA): pinned host buffers, copies on a side stream, bounded in flight;
- ``copy`` (any device, the tests' mode): a plain copy in the same memory, so a CPU run checks that the hooks
  give the backward exactly the tensors the forward saved (gradients bitwise equal);
- ``meta`` (the estimator's fake tensors): nothing is copied; the saved tensor is dropped and an empty one of its
  shape comes back at the backward, so the tracker counts what stays on the device.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

MODES = ("pinned", "copy", "meta")


class OffloadSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Saved activations in host memory between the forward and the backward (see the module docstring).

    Args:
        model: its parameters (and views of them) are never offloaded: they stay on the device anyway.
        mode: ``pinned``, ``copy`` or ``meta``.
        max_in_flight: outstanding copies to host before the next one waits (``pinned``).
        min_bytes: smaller saved tensors stay where they are (the copy would cost more than it frees).
    """

    def __init__(self, model: torch.nn.Module, mode: str = "pinned", *, max_in_flight: int = 5, min_bytes: int = 2**20):
        if mode not in MODES:
            raise ValueError(f"offload mode must be one of {MODES}, got {mode!r}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight: must be >= 1, got {max_in_flight}")
        self.mode, self.max_in_flight, self.min_bytes = mode, max_in_flight, min_bytes
        # A weight's storage, by its StorageImpl (fake tensors have no data pointer): a saved weight stays (the forward
        # keeps it anyway), else the estimator's backward would allocate it afresh, which the real hooks never do.
        self.weights = {p.untyped_storage()._cdata for p in model.parameters()}
        self.stream = torch.cuda.Stream() if mode == "pinned" else None
        self.in_flight: deque = deque()
        self.offloaded_bytes = 0  # since construction: what the hooks moved off the device
        super().__init__(self._pack, self._unpack)

    def _keeps(self, t: torch.Tensor) -> bool:
        if t.numel() * t.element_size() < self.min_bytes or t.layout != torch.strided:
            return True
        if self.mode == "pinned" and t.device.type != "cuda":
            return True
        return t.untyped_storage()._cdata in self.weights

    def _pack(self, t: torch.Tensor) -> Any:
        if self._keeps(t):
            return t
        self.offloaded_bytes += t.numel() * t.element_size()
        if self.mode == "meta":
            return ("meta", t.shape, t.dtype, t.device)
        if self.mode == "copy":
            return ("copy", t.detach().clone(), t.device, None)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written by the compute stream
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        t.record_stream(self.stream)  # its memory is reused only after the copy
        self.in_flight.append(done)
        while len(self.in_flight) > self.max_in_flight:
            self.in_flight.popleft().synchronize()
        return ("pinned", host, t.device, done)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed[0] == "meta":
            _, shape, dtype, device = packed
            return torch.empty(shape, dtype=dtype, device=device)
        _, host, device, done = packed
        if done is not None:
            torch.cuda.current_stream(device).wait_event(done)
        return host.to(device, non_blocking=True) if done is not None else host.clone()


__all__ = ["MODES", "OffloadSavedTensors"]
