"""Exact accounting of the bytes held by tensors, on any device, as a ``TorchDispatchMode``.

:class:`TensorMemoryTracker` sees every operator call that reaches the dispatcher while it is active
and counts each *new* untyped storage an operator returns, once (views and in-place results share a
storage and are not counted again). Each counted storage carries a weak reference whose callback
subtracts its bytes when the storage is deallocated, so ``current_bytes`` falls when tensors die,
even after the tracker has been exited. Pre-existing tensors (parameters, gradients, optimizer
state) are added with :meth:`TensorMemoryTracker.track`, so the peak is "bytes held by tensors",
resident weights included.

How it differs from ``torch.distributed._tools.mem_tracker.MemTracker``: no per-module statistics,
no forward/backward state machine, and no gradient hooks on frozen parameters (``MemTracker``
registers a hook on every parameter, which raises on parameters that do not require grad, such as
LoRA base weights). Storages are keyed by the identity of their Python ``UntypedStorage`` object
(which PyTorch preserves for the lifetime of the storage), never by ``data_ptr()``, so the tracker
also runs on fake tensors: enter it *inside* a ``FakeTensorMode`` and it counts
``storage.nbytes()`` of the fake outputs without touching memory.

An opaque oneDNN tensor (a weight packed for oneDNN's linear, :mod:`lit_rl.models.cast_once`) has no storage: the
tensor itself is counted, at its dense bytes.

What it cannot see: memory allocated outside the dispatcher (``torch.from_numpy``, allocator caching
and fragmentation, CUDA workspaces, the Python heap) and growth of untracked storages through
``UntypedStorage.resize_``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")

# factory ops whose input is the freshly created tensor of ``torch.tensor(...)``: count their output
_LIFT_OPS = {torch.ops.aten.lift_fresh.default}
# operators that only read a tensor's metadata (a fake tensor answers ``.device`` through the dispatch modes)
_METADATA_OPS = {torch.ops.prim.device.default}
_SCALARS = (int, float, bool, str, torch.Size, torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Entry:
    __slots__ = ("nbytes", "category", "ref")

    def __init__(self, nbytes: int, category: str, ref: weakref.ref) -> None:
        self.nbytes = nbytes
        self.category = category
        self.ref = ref


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The untyped storages behind ``t``, looking through wrapper subclasses (DTensor and the like)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [st for attr in attrs if isinstance(inner := getattr(t, attr), torch.Tensor) for st in _storages(inner)]
    if t.is_mkldnn:  # oneDNN's opaque layout (a weight packed for its linear): no storage; the tensor stands for it
        return [t]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less layouts
        return []


def _nbytes(st: torch.UntypedStorage | torch.Tensor) -> int:
    """A storage's bytes; an opaque oneDNN tensor's as the dense tensor it packs (equal for dimensions that are
    multiples of 16: ``bench/results/packed_linear.md`` names the measurement)."""
    return st.nbytes() if isinstance(st, torch.UntypedStorage) else st.numel() * st.element_size()


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj``: an operator's arguments and results are tensors in tuples, lists and dicts, walked
    here directly (pytree's walk of every operator's arguments cost an eighth of an estimate); other containers by
    pytree."""
    found, stack = [], [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif type(x) in (tuple, list):
            stack.extend(reversed(x))  # in order, as pytree lists them
        elif type(x) is dict:
            stack.extend(reversed(x.values()))
        elif x is not None and not isinstance(x, _SCALARS):
            leaves = tree_leaves(x)  # a registered container (a namedtuple, a dataclass) or a leaf: [x]
            if len(leaves) != 1 or leaves[0] is not x:
                stack.extend(reversed(leaves))
    return found


class TensorMemoryTracker(TorchDispatchMode):
    """Counts the bytes of every storage that operators allocate while active, plus registered tensors.

    Storages created by operators are filed under ``default_category`` (``"activations"`` unless
    changed with :meth:`category`); :meth:`track` files parameters under ``"parameters"``, their
    gradients under ``"gradients"`` and optimizer state under ``"optimizer_state"``, and keeps them
    filed there as they are re-created: a gradient produced by the backward pass moves to
    ``"gradients"`` when it is accumulated into ``param.grad`` and new optimizer state moves to
    ``"optimizer_state"`` after ``optimizer.step()``.

    Args:
        device_type: count only tensors on this device type (``"cpu"``, ``"cuda"``); ``None`` counts
            every device except ``meta``.
        default_category: where storages allocated by operators are filed.
        uncounted: categories kept in :meth:`by_category` but left out of ``current_bytes`` and the peak: what
            lives in host memory while the device is counted (FSDP2's ``cpu_offload`` keeps the sharded
            parameters, their gradients and the optimizer state there).

    Example::

        with TensorMemoryTracker() as t:
            t.track(model).track(optimizer)
            loss = model(x).sum()
            loss.backward()
        t.peak_bytes, t.by_category()
        t.close()  # removes the gradient and optimizer hooks that track() installed
    """

    def __init__(
        self, device_type: str | None = None, default_category: str = "activations", uncounted: tuple[str, ...] = ()
    ) -> None:
        super().__init__()
        for name in (default_category, *uncounted):
            _check_category(name)
        self.uncounted = frozenset(uncounted)
        self.device_type = device_type
        self.default_category = default_category
        self._lock = threading.RLock()
        self._live: dict[int, _Entry] = {}  # id(UntypedStorage) -> entry; removed by the weakref callback
        self._by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._current = 0
        self._peak = 0
        self._peak_by_category: dict[str, int] = dict(self._by_category)
        self._hooks: list[Any] = []
        self._seen_hooked: set[int] = set()

    # ----------------------------------------------------------------------------------------- reading

    @property
    def current_bytes(self) -> int:
        """Bytes held right now by the storages this tracker knows about."""
        return self._current

    @property
    def peak_bytes(self) -> int:
        """Highest ``current_bytes`` since construction or the last :meth:`reset_peak`."""
        return self._peak

    def reset_peak(self) -> None:
        """Start a new peak window at the current level."""
        with self._lock:
            self._peak = self._current
            self._peak_by_category = dict(self._by_category)

    def by_category(self) -> dict[str, int]:
        """Current bytes per category (every category in :data:`CATEGORIES`, zeros included)."""
        return dict(self._by_category)

    def peak_by_category(self) -> dict[str, int]:
        """Bytes per category at the moment :attr:`peak_bytes` was reached."""
        return dict(self._peak_by_category)

    @contextmanager
    def category(self, name: str) -> Iterator[None]:
        """File the storages allocated inside the block under ``name``."""
        _check_category(name)
        previous, self.default_category = self.default_category, name
        try:
            yield
        finally:
            self.default_category = previous

    # ------------------------------------------------------------------------------------- registering

    def track(self, obj: Any, category: str | None = None) -> TensorMemoryTracker:
        """Register pre-existing tensors so they count towards the current and peak bytes.

        Args:
            obj: an ``nn.Module`` (parameters, their gradients, buffers), an optimizer (its state; a
                Lightning optimizer wrapper is unwrapped), a tensor, or an iterable of any of these.
            category: file everything under this category instead of the defaults above.

        Returns:
            The tracker, so calls chain.
        """
        if category is not None:
            _check_category(category)
        if isinstance(obj, torch.nn.Module):
            self._track_module(obj, category)
        elif _as_optimizer(obj) is not None:
            self._track_optimizer(_as_optimizer(obj), category)
        elif isinstance(obj, torch.Tensor):
            self._file(obj, category or "other")
        elif isinstance(obj, Iterable) and not isinstance(obj, (str, bytes)):
            for item in obj:
                self.track(item, category)
        else:
            raise TypeError(f"cannot track {type(obj).__name__}; pass a module, an optimizer or tensors")
        return self

    def close(self) -> None:
        """Remove the hooks that :meth:`track` installed. The byte counts stay readable."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._seen_hooked.clear()

    def _track_module(self, module: torch.nn.Module, category: str | None) -> None:
        for p in module.parameters():
            self._file(p, category or "parameters")
            if p.grad is not None:
                self._file(p.grad, category or "gradients")
            # frozen parameters (LoRA base weights, a reference copy) get no hook: none is allowed on them
            if p.requires_grad and id(p) not in self._seen_hooked:
                self._seen_hooked.add(id(p))
                self._hooks.append(p.register_post_accumulate_grad_hook(_grad_hook(self, category or "gradients")))
        for b in module.buffers():
            self._file(b, category or "other")

    def _track_optimizer(self, optimizer: torch.optim.Optimizer, category: str | None) -> None:
        self._file_optimizer_state(optimizer, category or "optimizer_state")
        if id(optimizer) not in self._seen_hooked:
            self._seen_hooked.add(id(optimizer))
            self._hooks.append(optimizer.register_step_post_hook(_step_hook(self, category or "optimizer_state")))

    def _file_optimizer_state(self, optimizer: torch.optim.Optimizer, category: str) -> None:
        for state in optimizer.state.values():
            for t in _tensors(state):
                self._file(t, category)

    def _file(self, t: torch.Tensor, category: str) -> None:
        """Count ``t``'s storage under ``category``, or move it there if already counted."""
        if not self._counts_device(t):
            return
        for st in _storages(t):
            with self._lock:
                entry = self._live.get(id(st))
                if entry is None:
                    self._add(st, category)
                elif entry.category != category:
                    self._by_category[entry.category] -= entry.nbytes
                    self._by_category[category] += entry.nbytes
                    self._current += entry.nbytes * (self._counted(category) - self._counted(entry.category))
                    entry.category = category
                    self._bump_peak()

    def __enter__(self):
        _watch_storage_resizes(self)
        return super().__enter__()

    def __exit__(self, *exc: Any):
        _RESIZE_WATCHERS.discard(self)
        return super().__exit__(*exc)

    def _storage_resized(self, st: torch.UntypedStorage) -> None:
        with self._lock:
            entry = self._live.get(id(st))
            if entry is not None and entry.nbytes != st.nbytes():
                self._resize(entry, st.nbytes())
            elif entry is None and st.nbytes() > 0 and self._counts_storage(st):
                # allocated before this tracker (FSDP2 keeps a gathered weight's storage from step to step at 0
                # bytes): counted from the moment it holds bytes again
                self._add(st, self.default_category)

    # ---------------------------------------------------------------------------------------- counting

    def _counts_device(self, t: torch.Tensor) -> bool:
        return self._counts_storage(t)  # a fake tensor reports the device it pretends to be on

    def _counts_storage(self, t: torch.Tensor | torch.UntypedStorage) -> bool:
        if self.device_type is not None:
            return t.device.type == self.device_type
        return t.device.type != "meta"

    def _counted(self, category: str) -> int:
        return int(category not in self.uncounted)

    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        key = id(st)
        nbytes = _nbytes(st)
        self._live[key] = _Entry(nbytes, category, weakref.ref(st, partial(_on_free, weakref.ref(self), key)))
        self._by_category[category] += nbytes
        self._current += nbytes * self._counted(category)
        self._bump_peak()

    def _resize(self, entry: _Entry, nbytes: int) -> None:
        delta = nbytes - entry.nbytes
        entry.nbytes = nbytes
        self._by_category[entry.category] += delta
        self._current += delta * self._counted(entry.category)
        self._bump_peak()

    def _remove(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self._by_category[entry.category] -= entry.nbytes
                self._current -= entry.nbytes * self._counted(entry.category)

    def _bump_peak(self) -> None:
        if self._current > self._peak:
            self._peak = self._current
            self._peak_by_category = dict(self._by_category)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_OPS:  # allocate nothing; more than half of a fake step's operators (autograd asks)
            return func(*args, **kwargs)
        # storages the op received cannot be new allocations (views, in-place and out= results)
        inputs = {} if func in _LIFT_OPS else {id(st): st for t in _tensors((args, kwargs)) for st in _storages(t)}
        out = func(*args, **kwargs)
        for t in _tensors(out):
            if not self._counts_device(t):
                continue
            for st in _storages(t):
                key = id(st)
                with self._lock:
                    entry = self._live.get(key)
                    if entry is not None:
                        if entry.nbytes != _nbytes(st):  # resize_, out= ops that grew their output
                            self._resize(entry, _nbytes(st))
                    elif key not in inputs:
                        self._add(st, self.default_category)
        return out


# trackers told of storage resizes: FSDP2 frees a gathered weight by resizing its storage to 0 bytes and gathers it
# again into the same storage, neither of which is an operator a dispatch mode sees
_RESIZE_WATCHERS: weakref.WeakSet = weakref.WeakSet()
_PLAIN_RESIZE = torch.UntypedStorage.resize_


def _resize_watched(storage: torch.UntypedStorage, size: int):
    result = _PLAIN_RESIZE(storage, size)
    for tracker in list(_RESIZE_WATCHERS):
        tracker._storage_resized(storage)
    return result


def _watch_storage_resizes(tracker: TensorMemoryTracker) -> None:
    if torch.UntypedStorage.resize_ is not _resize_watched:  # installed once, by the first tracker entered
        torch.UntypedStorage.resize_ = _resize_watched
    _RESIZE_WATCHERS.add(tracker)


def _check_category(name: str) -> None:
    if name not in CATEGORIES:
        raise ValueError(f"unknown memory category {name!r}; use one of {', '.join(CATEGORIES)}")


def _as_optimizer(obj: Any) -> torch.optim.Optimizer | None:
    if isinstance(obj, torch.optim.Optimizer):
        return obj
    if isinstance(obj, LightningOptimizer):  # Lightning's wrapper of the optimizer a module steps
        return obj.optimizer
    return None


# The hooks and the free-callback hold the tracker weakly: a model outliving its tracker keeps no tracker alive.


def _on_free(tracker_ref: weakref.ref, key: int, _storage_ref: weakref.ref) -> None:
    tracker = tracker_ref()
    if tracker is not None:
        tracker._remove(key)


def _grad_hook(tracker: TensorMemoryTracker, category: str):
    tracker_ref = weakref.ref(tracker)

    def hook(param: torch.Tensor) -> None:
        t = tracker_ref()
        if t is not None and param.grad is not None:
            t._file(param.grad, category)

    return hook


def _step_hook(tracker: TensorMemoryTracker, category: str):
    tracker_ref = weakref.ref(tracker)

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        t = tracker_ref()
        if t is not None:
            t._file_optimizer_state(optimizer, category)

    return hook
