"""A 4-bit NF4 frozen base (QLoRA): the trunk's Linear weights in 4 bits, the adapters in the training dtype.

``model.quantize_base: nf4`` stores every ``nn.Linear`` of the trunk (attention and MLP projections) in
4-bit NormalFloat (NF4) with one absmax scale per block of ``block_size`` consecutive weights, and by default
the scales themselves in 8 bits with one float32 per 256 of them (double quantization) -- both from QLoRA
(Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv 2305.14314, section 3).
Each forward dequantizes the weight of one layer at a time to the input's dtype and runs a dense matmul;
the backward dequantizes it again (nothing but the 4-bit codes is kept for it). LoRA adapters, embeddings,
norms and the LM head stay in the training dtype: the logits-free ops read the head weight directly.

The format and its kernels come from bitsandbytes (the QLoRA authors' library, ``pip install bitsandbytes``;
its C kernels run on CPU too). ``bench/results/quantize.md`` compares it with torchao's ``NF4Tensor`` on this
project's shapes: same bytes per weight, bitsandbytes as fast as the dense layer where torchao's pure-PyTorch
dequantization costs 12-23 %, and only bitsandbytes quantizes shapes whose size is not a multiple of the block
(tiny test models) and survives ``deepcopy``.

How this differs from QLoRA and from ``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))``:

- the weights are quantized after loading, from whatever was loaded (hub, local folder, GGUF, ``embedded``,
  ``tiny:*``), before the LoRA adapters are added (:func:`lit_rl.models.loading.apply_lora`);
- the compute dtype is the training dtype (``model.dtype``, or the dtype ``trainer.precision: bf16-true`` casts the
  model to), not always bfloat16, and no paged optimizer is used;
- only the trunk's ``nn.Linear`` layers are quantized; GPT-2-style ``Conv1D`` layers are refused, not skipped;
- bitsandbytes' CPU inference repacking (a bf16 kernel picked on CPUs with AVX512-BF16 at the first eval-mode
  no-grad forward) is switched off: its output differs from the training path by bf16 rounding and, once the
  weight is repacked, the training forward no longer passes a gradient to its input. The rollout and reference
  passes run in exactly that mode before every update, so the repacked path would change both the reference
  log-probs and the gradients (``bench/results/quantize.md``, row "train after an eval no-grad pass");
- the checkpoint holds no quantization state: like every frozen base weight it is rebuilt from the source
  at load time (:meth:`lit_rl.methods.base.RLMethod.state_dict`).

Cost: less memory for the frozen base (about 0.52 instead of 2 bytes per weight in bfloat16), a forward and
backward about as fast as the dense layer on CPU (each layer dequantizes its weight into a temporary of the
dense size), and the quantization error of NF4 itself: the policy and its reference are the quantized model,
not the checkpoint as released. :func:`dequantize_base` turns the layers back into ``nn.Linear`` (decoded
weights) so that LoRA adapters can be merged for a full-precision export.

Estimates (models built on the meta device, stepped on fake tensors) cannot quantize: :func:`nf4_stand_in` puts
:class:`NF4StandIn` layers in place instead, which hold tensors of the format's shapes and allocate in each forward
and backward what bitsandbytes' kernels allocate (the dense weight of one layer, the decoded scales).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from collections.abc import Iterator

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_rl.models.head import base_model, trunk

#: ``model.quantize_base`` values
QUANTIZE_BASE_CHOICES = ("none", "nf4")
#: block sizes bitsandbytes' 4-bit quantization accepts
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
#: absmax scales per float32 second-level scale under double quantization (QLoRA's, and bitsandbytes' only one)
SCALER_BLOCK = 256


def nf4_bytes_per_param(block_size: int = 64, double_quant: bool = True) -> float:
    """Bytes per weight of the NF4 format, scales included, from the format alone (not measured).

    4 bits per weight, plus one absmax per ``block_size`` weights: a float32 (4 bytes), or, with double
    quantization, an 8-bit code and a float32 per :data:`SCALER_BLOCK` codes (QLoRA, arXiv 2305.14314, section
    3: 4.5 and 4.127 bits per weight for a block of 64). Per-tensor constants (two code books of 16 and 256
    floats, one offset) and the padding of a last partial block are left out: they add under 0.1 % for a
    weight of a million parameters.

    Args:
        block_size: weights per absmax scale.
        double_quant: the absmax scales themselves quantized to 8 bits.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    scales = (1 + 4 / SCALER_BLOCK) / block_size if double_quant else 4 / block_size
    return 0.5 + scales


def check_quantize_base(quantize_base: str, *, lora: bool) -> None:
    """Refuse, at start-up, a ``model.quantize_base`` the run cannot use.

    Args:
        quantize_base: ``none`` or ``nf4``.
        lora: whether the policy gets LoRA adapters (a 4-bit base cannot be trained itself).

    Raises:
        ValueError: an unknown value, ``nf4`` without LoRA, or bitsandbytes not installed.
    """
    if quantize_base not in QUANTIZE_BASE_CHOICES:
        raise ValueError(f"model.quantize_base: {quantize_base!r} is not one of {list(QUANTIZE_BASE_CHOICES)}")
    if quantize_base == "none":
        return
    if not lora:
        raise ValueError(
            "model.quantize_base: nf4 freezes the base weights in 4 bits, so they cannot be trained; "
            "set model.lora (adapters train instead) or model.quantize_base: none"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            "model.quantize_base: nf4 needs bitsandbytes, which is not installed; "
            "`pip install bitsandbytes`, or set model.quantize_base: none"
        )


def _bitsandbytes():
    """``bitsandbytes``, imported quietly, or one line saying how to get it."""
    # on import it looks for an optional CPU kernel package (`kernels`) and logs a warning when it is absent;
    # the kernel it would bring is the inference path this module switches off
    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError as exc:
        raise ValueError(
            f"model.quantize_base: nf4 needs bitsandbytes, which does not import ({exc}); "
            "`pip install bitsandbytes`, or set model.quantize_base: none"
        ) from exc
    finally:
        logger.setLevel(level)
    return bitsandbytes


@contextlib.contextmanager
def float32_default() -> Iterator[None]:
    """float32 as torch's default dtype inside the block (restored after it).

    bitsandbytes builds its 4-bit code table in the default dtype the first time it decodes a layer its fast kernel
    does not take (an odd last dimension, a large block) and caches it for the process. Lightning makes bf16 the
    default dtype while a ``bf16-true`` run builds its model, which is when lit-rl's load-time checks first run an NF4
    layer: every later such layer in the process then encoded and decoded with bf16-rounded levels (seen as a test of a
    float32 layer failing after an NF4 run in the same process). NF4 layers are built and run under this.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@functools.cache
def nf4_linear_class() -> type[torch.nn.Linear]:
    """The layer class holding a frozen NF4 weight: bitsandbytes' ``Linear4bit`` with two lit-rl choices.

    Built on first use so that importing this module does not import bitsandbytes. It is an ``nn.Linear``
    subclass, so peft's ``all-linear`` finds it and its plain ``lora.Linear`` wraps it (the adapter output is
    added to the layer's, in the adapter's dtype).
    """
    bnb = _bitsandbytes()

    class NF4Linear(bnb.nn.Linear4bit):
        """A frozen ``nn.Linear`` whose weight is stored in NF4 and dequantized to the input dtype per forward.

        Differs from ``bnb.nn.Linear4bit`` in two ways: CPU inference repacking is off (the rollout's eval-mode
        no-grad passes would otherwise switch the weight to a bf16 kernel without a backward, see the module
        docstring), and the state dict holds the weight and bias like a plain module, without the quantization
        state (the frozen base is rebuilt from its source when a checkpoint loads).
        """

        lit_rl_nf4 = True  # what is_nf4 looks for, so that it need not import bitsandbytes

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.support_avx512bf16_for_cpu = False

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            with float32_default():
                return super().forward(x, *args, **kwargs)

        def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
            torch.nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)

        def _apply(self, fn, recurse=True):
            super()._apply(fn, recurse)
            _follow_dtype_cast(self, fn, self.weight.quant_state)
            return self

    return NF4Linear


def _follow_dtype_cast(layer, fn, quant_state=None) -> None:
    """After ``module.to(dtype)`` (``trainer.precision: bf16-true`` casts the model after loading), compute in the
    new dtype: the codes are uint8 and no cast reaches them, so without this the layer would keep decoding to the
    load dtype and cast its inputs to it."""
    dtype = fn(torch.empty(0, dtype=layer.compute_dtype)).dtype  # what the cast does to a float tensor
    if dtype != layer.compute_dtype and dtype.is_floating_point:
        layer.compute_dtype = dtype
        if quant_state is not None:
            quant_state.dtype = dtype  # the backward decodes to it


def is_nf4(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a layer made by :func:`quantize_base_nf4` (without importing bitsandbytes)."""
    return getattr(type(module), "lit_rl_nf4", False)


def _check_block_size(block_size: int) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"model.quantize_base: block size {block_size} is not one bitsandbytes supports; use one of {list(BLOCK_SIZES)}"
        )


def nf4_linear(linear: torch.nn.Linear, *, block_size: int = 64, double_quant: bool = True) -> torch.nn.Linear:
    """``linear`` as a frozen :func:`nf4_linear_class` layer: same shape, bias and compute dtype, weight in NF4.

    Args:
        linear: the dense layer; its weight dtype becomes the compute dtype.
        block_size: weights per absmax scale (see :func:`quantize_base_nf4`).
        double_quant: quantize the absmax scales to 8 bits too.

    Raises:
        ValueError: a block size bitsandbytes does not support, or bitsandbytes missing.
    """
    _check_block_size(block_size)
    bnb = _bitsandbytes()
    weight = linear.weight.detach()  # [out, in]
    layer = nf4_linear_class()(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=weight.dtype,  # the training dtype: the forward dequantizes to it
        compress_statistics=double_quant,
        quant_type="nf4",
        device="meta",  # no dense weight is allocated and initialised only to be replaced
    )
    layer.weight = bnb.nn.Params4bit(
        weight, requires_grad=False, blocksize=block_size, compress_statistics=double_quant, quant_type="nf4"
    )
    if linear.bias is not None:
        layer.bias = torch.nn.Parameter(linear.bias.detach(), requires_grad=False)  # [out]
    with float32_default():
        return layer.to(weight.device)  # quantizes: codes [ceil(out * in / 2), 1] uint8, scales per block


def _set_submodule(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def quantize_base_nf4(model, *, block_size: int = 64, double_quant: bool = True):
    """Replace the frozen ``nn.Linear`` layers of ``model``'s trunk with NF4 layers, in place; returns ``model``.

    Call it on the loaded model before LoRA adapters are added (:func:`lit_rl.models.loading.apply_lora`). The
    LM head, the embeddings and the norms are left as they are (the head is outside the trunk; the others are
    not ``nn.Linear``). Any size works, also one that is not a multiple of ``block_size`` (the last block is
    shorter). Every quantized weight is frozen.

    Args:
        model: a causal LM (a transformers model) without adapters, weights on a real device.
        block_size: weights per absmax scale, one of :data:`BLOCK_SIZES` (QLoRA: 64).
        double_quant: quantize the absmax scales to 8 bits too (QLoRA's double quantization; about
            0.047 bytes per weight less at block 64, :func:`nf4_bytes_per_param`).

    Raises:
        ValueError: one line naming ``model.quantize_base`` and the fix: bitsandbytes missing, an unsupported
            block size, adapters already added, weights on the meta device, a trunk without ``nn.Linear`` layers
            (GPT-2's ``Conv1D``), or a device bitsandbytes cannot quantize on.
    """
    _check_block_size(block_size)
    if base_model(model) is not model or any(hasattr(m, "lora_A") for m in model.modules()):
        raise ValueError("model.quantize_base: the model already has adapters; quantize the base before apply_lora")
    body = trunk(model)
    linears = [
        (name, m) for name, m in body.named_modules() if isinstance(m, torch.nn.Linear) and not is_nf4(m)
    ]  # fmt: skip
    if not linears:
        kinds = sorted({type(m).__name__ for m in body.modules() if type(m).__name__ == "Conv1D"})
        raise ValueError(
            f"model.quantize_base: {type(model).__name__}'s trunk has no nn.Linear layer to quantize"
            f"{' (it uses ' + kinds[0] + ')' if kinds else ''}; set model.quantize_base: none for this architecture"
        )
    if any(m.weight.is_meta for _, m in linears):
        raise ValueError(
            "model.quantize_base: the weights are on the meta device (an estimate); estimate with "
            "nf4_bytes_per_param instead of quantizing"
        )
    dense = sum(m.weight.numel() * m.weight.element_size() for _, m in linears)
    for name, linear in linears:
        try:
            layer = nf4_linear(linear, block_size=block_size, double_quant=double_quant)
        except (RuntimeError, NotImplementedError) as exc:
            raise ValueError(
                f"model.quantize_base: bitsandbytes cannot quantize {name} on {linear.weight.device} "
                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); set model.quantize_base: none"
            ) from exc
        _set_submodule(body, name, layer)
    rank_zero_info(
        f"lit-rl: {len(linears)} trunk linear layers in NF4 (block {block_size}"
        f"{', double quant' if double_quant else ''}): {dense / 2**20:.1f} MiB -> "
        f"{quantized_bytes(model) / 2**20:.1f} MiB"
    )
    return model


def quantized_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the NF4 layers' weights: codes, scales, second-level scales and code books (each once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if not is_nf4(module):
            continue
        state = module.weight.quant_state
        tensors = [module.weight.data, state.absmax, state.code]
        if state.nested:
            tensors += [state.state2.absmax, state.state2.code, state.offset]
        for t in tensors:
            if isinstance(t, torch.Tensor):  # storages shared between layers (code books) count once
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class NF4StandIn(torch.nn.Linear):
    """An NF4 layer's memory, for estimates on meta and fake tensors: its tensors and its temporaries, not its values.

    Holds what :func:`nf4_linear` stores: the codes as a frozen ``uint8`` weight ``[ceil(out * in / 2), 1]`` (a
    parameter, as bitsandbytes' ``Params4bit`` is) and the scales as buffers (8-bit absmax per block plus a float32
    per :data:`SCALER_BLOCK` of them and an offset, or float32 absmax without double quantization). Forward and
    backward allocate what bitsandbytes' ``gemm_4bit`` / ``MatMul4Bit`` allocate: the input cast to the compute
    dtype, the decoded scales (float32 per block), the dense weight ``[out, in]`` (one layer at a time, freed after
    its matmul), the output; nothing is saved for the backward but the codes, which are resident anyway. Its
    outputs have the right shapes and dtypes and undefined values: never run it on real weights.

    The forward's dense weight is allocated inside bitsandbytes' ``gemm_4bit`` custom op, where the CPU
    MemoryProfiler's tensor accounting does not look (it counts the op's output only): a measured forward phase can
    read up to one layer's dense weight below this prediction. On CUDA the op decodes the weight the same way for
    more than a few tokens (bitsandbytes' ``_dequant_linear_fallback``); decode steps of a few tokens use a fused
    kernel without it, so the rollout's decode steps are over-predicted by one layer's weight.
    """

    lit_rl_nf4_stand_in = True

    def __init__(self, linear: torch.nn.Linear, *, block_size: int = 64, double_quant: bool = True) -> None:
        super().__init__(
            linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
            dtype=linear.weight.dtype,
        )  # fmt: skip
        device, n = linear.weight.device, linear.weight.numel()
        self.compute_dtype = linear.weight.dtype  # as nf4_linear: the dtype at load time, then any cast's
        self.blocks = -(-n // block_size)
        self.weight = torch.nn.Parameter(torch.empty((n + 1) // 2, 1, dtype=torch.uint8, device=device), False)
        if linear.bias is not None:
            self.bias = torch.nn.Parameter(torch.empty_like(linear.bias, device=device), requires_grad=False)
        self.double_quant = double_quant
        if double_quant:
            self.register_buffer("absmax", torch.empty(self.blocks, dtype=torch.uint8, device=device), False)
            scalers = -(-self.blocks // SCALER_BLOCK)
            self.register_buffer("absmax2", torch.empty(scalers, dtype=torch.float32, device=device), False)
        else:
            self.register_buffer("absmax", torch.empty(self.blocks, dtype=torch.float32, device=device), False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        _follow_dtype_cast(self, fn)
        return self

    def decoded(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The allocations of decoding the weight: ``(weight [out, in] in dtype, scales [blocks] float32)``."""
        device = self.weight.device
        scales = self.absmax
        if self.double_quant:  # dequantize_blockwise(absmax_8bit) + offset: float32 [blocks]
            scales = torch.empty(self.blocks, dtype=torch.float32, device=device) + 1.0
        return torch.empty(self.out_features, self.in_features, dtype=dtype, device=device), scales

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)  # [*, in]
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return _StandInMatmul.apply(x, self.weight, bias, self).to(inp_dtype)  # [*, out]


class _StandInMatmul(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit``'s allocations: decode, matmul, free; decode again in the backward."""

    @staticmethod
    def forward(ctx, x, codes, bias, layer):
        ctx.layer = layer  # the codes are resident: nothing is saved
        weight, scales = layer.decoded(x.dtype)  # [out, in], [blocks]: live until the matmul is done
        return torch.nn.functional.linear(x, weight, bias)  # [*, out]

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        weight, scales = layer.decoded(layer.compute_dtype)  # [out, in], [blocks]
        grad_x = torch.matmul(grad, weight.to(grad.dtype)) if ctx.needs_input_grad[0] else None  # [*, in]
        return grad_x, None, None, None


def is_nf4_stand_in(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an :class:`NF4StandIn` (an estimate's NF4 layer)."""
    return getattr(type(module), "lit_rl_nf4_stand_in", False)


def nf4_stand_in(model, *, block_size: int = 64, double_quant: bool = True):
    """:func:`quantize_base_nf4` for a model built on the meta device (an estimate): :class:`NF4StandIn` layers.

    Same layers as :func:`quantize_base_nf4` (the trunk's ``nn.Linear``), same refusals; returns ``model``.
    """
    _check_block_size(block_size)
    body = trunk(model)
    linears = [(n, m) for n, m in body.named_modules() if type(m) is torch.nn.Linear]
    if not linears:
        raise ValueError(
            f"model.quantize_base: {type(model).__name__}'s trunk has no nn.Linear layer to quantize; "
            "set model.quantize_base: none for this architecture"
        )
    for name, linear in linears:
        _set_submodule(body, name, NF4StandIn(linear, block_size=block_size, double_quant=double_quant))
    return model


def nf4_memory(model: torch.nn.Module) -> tuple[int, int, tuple[int, int, torch.dtype] | None]:
    """``(weights, bytes, largest)`` of the NF4 layers (real or stand-in) of ``model``: quantized weights, their
    bytes with scales (each storage once), and ``(out, in, compute dtype)`` of the largest layer (its dense weight
    is the dequantization temporary), ``None`` without NF4 layers."""
    weights, largest, seen = 0, None, {}
    for module in model.modules():
        if is_nf4_stand_in(module):
            tensors = [module.weight, *module.buffers(recurse=False)]
        elif is_nf4(module):
            state = module.weight.quant_state
            tensors = [module.weight.data, state.absmax] + ([state.state2.absmax] if state.nested else [])
        else:
            continue
        n = module.out_features * module.in_features
        weights += n
        if largest is None or n > largest[0] * largest[1]:
            largest = (module.out_features, module.in_features, module.compute_dtype or module.weight.dtype)
        for t in tensors:
            seen[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    return weights, sum(seen.values()), largest


def dequantize_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight ``[out, in]`` an NF4 layer's forward uses, decoded, in the layer's compute dtype."""
    bnb = _bitsandbytes()
    with float32_default():
        weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)  # [out, in]
    return weight.to(layer.compute_dtype or weight.dtype)


def dequantize_base(model, dtype: torch.dtype | None = None):
    """Replace every NF4 layer of ``model`` (also under peft's LoRA wrappers) with an ``nn.Linear``; in place.

    The new weight is the decoded NF4 weight, i.e. the base the adapters were trained against, so that
    ``merge_and_unload()`` afterwards gives a plain model computing what the policy computed (up to rounding in
    ``dtype``). Frozen, like the layer it replaces. Does nothing to a model without NF4 layers.

    Args:
        model: a model with :func:`quantize_base_nf4` layers, with or without peft adapters.
        dtype: dtype of the decoded weights; ``None`` keeps each layer's compute dtype (the training dtype).

    Returns:
        ``model``.
    """
    for name, module in list(model.named_modules()):
        if not is_nf4(module):
            continue
        weight = dequantize_weight(module)  # [out, in]
        dense = torch.nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta", dtype=weight.dtype
        )
        dense.weight = torch.nn.Parameter(weight.to(dtype or weight.dtype), requires_grad=False)
        if module.bias is not None:
            dense.bias = torch.nn.Parameter(module.bias.detach().to(dtype or weight.dtype), requires_grad=False)
        _set_submodule(model, name, dense)
    return model
