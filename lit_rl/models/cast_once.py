"""Mixed-precision rollouts that cast each weight once, not at every decoded token.

Why: Lightning's mixed precision runs ``training_step`` under ``torch.autocast(..., cache_enabled=False)``, so every
matmul casts its float32 weight to bf16 (or fp16) again. In a forward over a whole batch that is one cast per
weight; in a rollout it is one cast per weight *per new token*: a 135M-parameter model reads 540 MB and writes
270 MB of casts for each token step, more than the bf16 matmuls themselves move. (Autocast's own cache would not
help a LoRA base either: it keeps only casts of leaf tensors that require grad.)

:func:`linear_weights_cast_once` casts the weight (and bias) of every plain ``nn.Linear`` once, when the rollout
starts, and runs those layers on the casts until it ends. The numbers are the same: autocast casts an ``nn.Linear``'s
float32 arguments with the same ``.to(dtype)`` and calls the same kernel, so each layer's output is bitwise what it
would have been (``tests/test_cast_once.py`` compares logits and tokens). The cost is memory: the casts are held for
the rollout, half the float32 bytes of the casted layers, which the estimator counts in the rollout phase
(:func:`lit_rl.memory.fake.fake_generate` runs under the same context). ``model.decode: generate`` leaves it off.

On a CPU whose bf16 matmuls run on oneDNN (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512), each
bf16 cast is also packed once into oneDNN's weight layout (``torch.ops.mkldnn._reorder_linear_weight``, what
inductor's freezing pass does to a CPU linear's constant weight, ``torch/_inductor/fx_passes/mkldnn_fusion.py``) and
the layer calls oneDNN's linear on it (``torch.ops.mkldnn._linear_pointwise``). The output is bitwise ``F.linear``'s
on the cast (``tests/test_cast_once.py`` checks SmolLM2's layer shapes, LoRA adapters, odd sizes and a tiny model's
logits); on a decode step of a few rows it is faster, because ``F.linear`` hands oneDNN the plain weight at every
call (``python bench/bench_packed_linear.py`` measures both, ``bench/results/packed_linear.md``). The packed copy
replaces the cast, with the same bytes for dimensions that are multiples of 16. Fake tensors (the estimator) and
other devices keep plain casts.

**A float32 sampler on packed weights** (``model.rollout_linear: packed``, :func:`float32_weights_packed`): outside
autocast the float32 weights are packed the same way. A frozen weight that only its layer reads (a LoRA base) lends its
storage to its packed copy: the parameter holds no data until the rollout ends, when it is unpacked again, bitwise what
it was, so the rollout holds no more than before. A trained or tied weight (full fine-tuning, a head tied to the
embedding) gets a copy held through the rollout. The estimator charges either (its fake tensors do the same with plain
copies), for a run on a CPU only (:func:`weights_meant_for`: on a GPU the setting has no effect). oneDNN's float32
linear sums in another order than ``F.linear``'s (MKL on this project's CPU), so this one is not bitwise: a layer's
output differs by float32 rounding (``tests/test_cast_once.py`` bounds it against a float64 reference), and the
sampler's log-probs differ from the trainer's by about what the exact decode loop's already do (the rollout is an
incremental decode, the trainer a full forward; both are logged as ``rollout/sampler_*``). It is faster on decode steps
of a few rows, where ``F.linear`` reads float32 weights slowly (``python bench/bench_packed_linear.py --float32``,
``bench/results/packed_linear_float32.md``).

Only exact ``nn.Linear`` modules are cast (a LoRA layer's base layer and adapters are; an NF4 layer, a GPT-2
``Conv1D``, a module whose ``forward`` someone else has replaced on the instance, and a layer whose weight is an
FSDP2 shard outside its forward (``rollout_gather: layers``) are not, and stay as they were). Under FSDP2 no weight
lends its storage: FSDP2 frees and refills its unsharded parameters' storage itself.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["float32_packing_unsupported", "float32_weights_packed", "linear_weights_cast_once", "weights_meant_for"]

_FLOAT32_PACKED: contextvars.ContextVar[bool] = contextvars.ContextVar("float32_packed", default=False)
_MEANT_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("weights_meant_for", default=None)


@contextlib.contextmanager
def float32_weights_packed() -> Iterator[None]:
    """Within it, :func:`linear_weights_cast_once` also packs float32 weights outside autocast (not bitwise)."""
    token = _FLOAT32_PACKED.set(True)
    try:
        yield
    finally:
        _FLOAT32_PACKED.reset(token)


@contextlib.contextmanager
def weights_meant_for(device_type: str) -> Iterator[None]:
    """Within it, :func:`float32_packing_unsupported` answers for weights on ``device_type``, wherever they are: the
    estimator steps on the CPU's fake tensors a model meant for a GPU, where the packing has no effect."""
    token = _MEANT_FOR.set(device_type)
    try:
        yield
    finally:
        _MEANT_FOR.reset(token)


def float32_packing_unsupported(device: torch.device) -> str | None:
    """Why float32 weights on ``device`` would not be packed (``None``: they would be)."""
    device_type = _MEANT_FOR.get() or device.type
    if device_type != "cpu":
        return f"oneDNN's packed linear runs on a CPU, the weights are on {device_type}"
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return "this torch has no oneDNN (torch.backends.mkldnn) or it is disabled"
    return None


def _autocast_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype an autocast active on ``model``'s device casts to, or ``None`` when none is active."""
    parameter = next(model.parameters(), None)
    if parameter is None:
        return None
    device_type = parameter.device.type
    if device_type == "meta" or not torch.amp.is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


@contextlib.contextmanager
def linear_weights_cast_once(model: torch.nn.Module) -> Iterator[int]:
    """Under an active autocast, run ``model``'s float32 ``nn.Linear`` layers on casts made once; yields their bytes.

    Outside autocast (or with no such layer) nothing changes and it yields 0, unless :func:`float32_weights_packed`
    is active: then the float32 weights are packed for oneDNN into copies (on fake tensors, plain copies of the same
    bytes). Call it under ``torch.no_grad()``: the casts are detached, so a backward through them would not reach
    the weights.
    """
    dtype = _autocast_dtype(model)
    if dtype is None and _FLOAT32_PACKED.get():
        dtype = torch.float32
    if dtype is None:
        yield 0
        return
    casts: dict[int, torch.Tensor] = {}  # id(parameter) -> its cast (packed for oneDNN where that is bitwise F.linear)
    moved: dict[int, torch.nn.Parameter] = {}  # float32 weights whose storage their packed copy replaced
    uses: collections.Counter = collections.Counter()  # how many modules read each parameter (float32 packing only)
    if dtype == torch.float32 and not _sharded(model):  # FSDP2 frees and refills its parameters' storage: never lent
        uses.update(id(p) for _, p in model.named_parameters(remove_duplicate=False))

    def cast(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        if id(tensor) not in casts:  # tied weights (an LM head) are cast once
            copy = tensor.detach().to(dtype)
            itself = copy.dtype == tensor.dtype  # a float32 "cast" is the parameter itself
            if itself and copy.dim() == 1:
                return copy  # a bias stays as it is: nothing held
            if _packs(copy):
                copy = torch.ops.mkldnn._reorder_linear_weight(copy)
            elif itself:
                copy = copy.clone()  # a fake weight: the packed copy's bytes
            casts[id(tensor)] = copy
            if itself and _movable(tensor, uses):
                tensor.data = tensor.new_empty(0)  # the packed copy stands in for it until the rollout ends
                moved[id(tensor)] = tensor
        return casts[id(tensor)]

    patched: list[torch.nn.Module] = []
    try:
        for module in model.modules():
            if type(module) is not torch.nn.Linear or "forward" in module.__dict__:
                continue
            if module.weight.dtype != torch.float32 or hasattr(module.weight, "to_local"):
                continue  # a DTensor is a shard that FSDP2 gathers in the layer's forward: a cast of it would not do
            weight, bias = cast(module.weight), cast(module.bias)  # a bias stays a plain cast (one dimension)
            module.forward = _packed_forward(weight, bias) if weight.is_mkldnn else _cast_forward(weight, bias)
            patched.append(module)
        # each cast is a fresh dense copy; a packed one (opaque, no storage) holds the same bytes; a moved one
        # replaced its parameter's storage
        yield sum(t.numel() * t.element_size() for key, t in casts.items() if key not in moved)
    finally:
        for module in patched:
            del module.forward
        for key, parameter in moved.items():  # one at a time: one weight's two copies at most
            packed = casts.pop(key)
            parameter.data = packed.to_dense() if packed.is_mkldnn else packed
            del packed
        casts.clear()


def _sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _movable(parameter: torch.Tensor, uses: collections.Counter) -> bool:
    """Whether a float32 weight's storage can give way to its packed copy for the rollout: a frozen parameter (a LoRA
    base) that no other module reads (a head tied to the embedding is read by the embedding lookup)."""
    return isinstance(parameter, torch.nn.Parameter) and not parameter.requires_grad and uses[id(parameter)] == 1


def _packs(cast: torch.Tensor) -> bool:
    """Whether a cast goes into oneDNN's layout: a real CPU weight, bf16 where oneDNN runs bf16 ``F.linear``
    (bitwise the same), float32 where :func:`float32_weights_packed` asked for it (the only way one gets here)."""
    if cast.dim() != 2 or isinstance(cast, FakeTensor) or float32_packing_unsupported(cast.device) is not None:
        return False
    if cast.dtype == torch.float32:
        return _FLOAT32_PACKED.get()
    return cast.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _cast_forward(weight: torch.Tensor, bias: torch.Tensor | None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, bias)

    return forward


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None):
    def forward(x: torch.Tensor) -> torch.Tensor:  # autocast has no rule for this op: cast the input as it would
        return torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, bias, "none", [], "")

    return forward
