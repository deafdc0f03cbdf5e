"""What a step on fake tensors needs beyond ``FakeTensorMode``: every substitution the estimator makes, in one place.

The estimator runs a method's own ``training_step`` on fake tensors (shapes, dtypes and devices, no
storage). What fake tensors cannot do, or do too slowly, is substituted here, decided as the real run would
decide it:

- **Reading a value** (``.item()``, ``bool(t)``, ``.tolist()``): every read returns 1 (``True`` for
  booleans). A step's control flow on values (a finite-loss check, a token count) takes the path of a
  normal step; the numbers themselves never change memory. ``.tolist()`` answers the whole list at once
  (torch's own reads each element through the dispatcher: minutes for 8 x 20K completion tokens).
- **Block loops** of the logits-free token math: only the first, second and last block of each loop run
  (:func:`lit_rl.ops.token_math.peak_blocks_only`; the same peaks, thousands of blocks fewer at long context).
- **generate()**: its stopping criteria read values. :func:`fake_generate` runs the prefill and decode
  steps with a ``DynamicCache`` exactly as ``generate`` does (``logits_to_keep=1``, a float32 copy of
  the last logits, softmax, multinomial) and never stops early: every completion runs to
  ``max_new_tokens``. Decode steps differ only in the cache length, which only grows, so by default
  the prefill, the first and the last decode step run and the cache is grown in between (same peak,
  seconds instead of minutes); ``full_decode=True`` runs every step.
- **Text**: :class:`StandInTokenizer` decodes every completion to ``""`` (reward functions still run).
- **Mask skipping**: transformers reads the attention mask to skip building the ``[B, 1, q, kv]``
  boolean mask when nothing is padded; :func:`patches` decides it from whether the batch is padded.
- **Grouped expert matmuls** (``torch._grouped_mm``, the MoE experts of transformers): the fake kernel
  accepts only bf16 inputs (the CUDA kernel's rule), so the output is allocated from the shapes the real
  kernel returns, in any dtype (:func:`grouped_mm_result`).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_rl.models import base_model, cache_kwargs
from lit_rl.models.cast_once import linear_weights_cast_once, weights_meant_for
from lit_rl.models.compiled_decode import static_capacity
from lit_rl.models.decode import preallocate
from lit_rl.ops.token_math import peak_blocks_only

# trainer.precision -> (weight dtype or None to keep the loaded one, autocast dtype or None)
PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "32-true": (None, None),
    "32": (None, None),
    "bf16-true": (torch.bfloat16, None),
    "bf16-mixed": (None, torch.bfloat16),
    "16-true": (torch.float16, None),
    "16-mixed": (None, torch.float16),
}


class _ConstantReads(TorchDispatchMode):
    """Answers every value read of a fake tensor with 1 (``True`` for booleans)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return _read_value(args[0].dtype)
        if func is torch.ops.aten._grouped_mm.default:
            return grouped_mm_result(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _read_value(dtype: torch.dtype) -> bool | float | int:
    """What every value read of a fake tensor of ``dtype`` returns: 1, ``True`` for booleans."""
    return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1


@contextlib.contextmanager
def _constant_lists() -> Iterator[None]:
    """``FakeTensor.tolist()`` answered as :class:`_ConstantReads` answers each element, in one go."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = FakeTensor.tolist

    def tolist(self):
        if not all(isinstance(d, int) for d in self.shape):  # a symbolic size: torch's own, element by element
            return original(self)
        value = _read_value(self.dtype)

        def nest(shape: tuple[int, ...]) -> Any:
            if len(shape) <= 1:
                return [value] * shape[0] if shape else value
            return [nest(shape[1:]) for _ in range(shape[0])]

        return nest(tuple(self.shape))

    FakeTensor.tolist = tolist
    try:
        yield
    finally:
        FakeTensor.tolist = original


def grouped_mm_result(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The tensor ``torch._grouped_mm`` returns (shapes and dtype only): ``[M, N]`` for 2D x 3D (tokens grouped
    by expert) and 3D x 2D, ``[G, M, N]`` for 3D x 3D and for 2D x 2D (the weight gradient, ``G = len(offs)``)."""
    m, n = mat_a.shape[-2], mat_b.shape[-1]
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        shape = (offs.shape[0], m, n)
    elif mat_a.dim() == 3 and mat_b.dim() == 3:
        shape = (mat_a.shape[0], m, n)
    else:
        shape = (m if mat_a.dim() == 2 else mat_a.shape[0] * m, n)
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


class UnpredictableStep(NotImplementedError):
    """A step that cannot run on fake tensors, said in one line by :func:`unpredictable`."""


@contextlib.contextmanager
def fake_mode() -> Iterator[Any]:
    """``FakeTensorMode`` (non-fake inputs allowed: a meta-device model is materialised with ``to_empty``) with
    constant value reads on top.

    Raises:
        UnpredictableStep: one line saying what could not run on fake tensors and where (the model file names
            the architecture), for any failure other than a ``ValueError`` (a setting's own message); a
            ``NotImplementedError`` from torch (an op without a fake kernel) is such a failure too.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(allow_scalar_outputs=True))
    try:
        with mode, _ConstantReads(), _constant_lists(), peak_blocks_only():
            yield mode
    except (ValueError, UnpredictableStep):
        raise
    except Exception as err:  # an architecture whose step cannot run without values: say so, not a traceback
        raise UnpredictableStep(unpredictable(err)) from err


def unpredictable(err: BaseException) -> str:
    """One line for a step that failed on fake tensors: the error and the innermost model-code frame."""
    frames = traceback.extract_tb(err.__traceback__)
    model_frames = [f for f in frames if "/transformers/" in f.filename or "/lit_rl/" in f.filename] or frames
    where = f" in {Path(model_frames[-1].filename).name}:{model_frames[-1].lineno}" if model_frames else ""
    first = (str(err).splitlines() or [""])[0][:200]
    return (
        f"cannot predict this model's memory: its step does not run on fake tensors ({type(err).__name__}{where}: "
        f"{first}); measure a short run with the MemoryProfiler callback instead (callbacks/memory_profiler.yaml)"
    )


@contextlib.contextmanager
def patches(padded: bool, device_type: str = "cpu") -> Iterator[None]:
    """What the real run decides from values or its device, decided as it would: transformers' mask skipping
    (``padded``: prompts are left-padded), and whether the rollout's float32 weights are packed (on ``device_type``,
    not the fake tensors' CPU: :func:`~lit_rl.models.cast_once.weights_meant_for`)."""
    import transformers.masking_utils as masking_utils

    def ignore_causal_mask(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        # transformers reads the mask to skip building it when nothing is padded; a fake mask has no values
        if padded or (local_attention_size is not None and kv_length >= local_attention_size):
            return False
        return q_length == 1 or kv_length == q_length or q_offset == 0

    original = masking_utils._ignore_causal_mask_sdpa
    masking_utils._ignore_causal_mask_sdpa = ignore_causal_mask
    try:
        with weights_meant_for(device_type):
            yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original


@contextlib.contextmanager
def precision(default_dtype: torch.dtype | None, autocast_dtype: torch.dtype | None) -> Iterator[None]:
    """Lightning's precision plugin around ``training_step``: default dtype (true half) or autocast (mixed)."""
    with contextlib.ExitStack() as stack:
        if default_dtype is not None:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(default_dtype)
            stack.callback(torch.set_default_dtype, previous)
        if autocast_dtype is not None:
            # as Lightning's MixedPrecision: no cast cache, so weights are re-cast by every op that uses them
            stack.enter_context(torch.autocast("cpu", dtype=autocast_dtype, cache_enabled=False))
        yield


class StandInTokenizer:
    """What a step asks of a tokenizer, without one: special ids from the model config, ``""`` for any text."""

    def __init__(self, config: Any) -> None:
        eos = getattr(config, "eos_token_id", None)
        self.eos_token_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        pad = getattr(config, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else self.eos_token_id
        self.vocab_size = config.vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return ""

    def batch_decode(self, ids: Any, skip_special_tokens: bool = False) -> list[str]:
        return ["" for _ in ids]


@dataclass
class GenerateRecord:
    """What :func:`fake_generate` saw: the KV cache at the end and one decode step's logits + probabilities."""

    kv_cache_bytes: int = 0
    kv_cache_shape: str = ""
    logits_bytes: int = 0
    batch: int = 0
    vocab: int = 0
    calls: int = 0


def fake_generate(
    policy, record: GenerateRecord, *, padded: bool, full_decode: bool = False, own_decode: bool | str = False
):
    """A stand-in for ``policy.generate`` that allocates what sampling allocates and always runs to the limit.

    With ``own_decode`` the cache is moved into preallocated buffers after the prefill, as
    :func:`lit_rl.models.decode.decode` moves it (the rollout holds the whole completion's KV cache from then on);
    with ``"compiled"`` the buffers have the static cache's rounded-up length, beside its mask. The eager loop's casts
    of the weights under mixed precision (:func:`lit_rl.models.cast_once.linear_weights_cast_once`) are held
    throughout, as there.
    """

    def generate(*args, **kwargs):
        eager_loop = own_decode is True or own_decode in ("own", "lean")  # both hold the casts
        with linear_weights_cast_once(policy) if eager_loop else contextlib.nullcontext():
            return run(*args, **kwargs)

    def run(input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        from transformers import DynamicCache

        max_new = generation_config.max_new_tokens if generation_config is not None else kwargs["max_new_tokens"]
        # generate(): positions from the mask; an all-ones mask is dropped (no 4D mask is built then)
        position_ids = attention_mask.long().cumsum(-1) - 1  # [B, P]
        position_ids = position_ids.masked_fill(attention_mask == 0, 0)
        mask = attention_mask if padded else None
        # a shared prefill: only the uncached prompt tokens run
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None:
            cache = DynamicCache(config=base_model(policy).config)
        cached = cache.get_seq_length()
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.long)  # [B]
        eos = torch.tensor([0])
        sequences = input_ids
        step_ids, step_positions = input_ids[:, cached:], position_ids[:, cached:]
        # the decode loop's own bookkeeping: mask, positions and tokens for the longest sequence, held throughout
        width = input_ids.shape[1] + max_new
        bookkeeping = [input_ids.new_empty((input_ids.shape[0], width)) for _ in range(3 if own_decode else 0)]
        capacity = static_capacity(width - 1) if own_decode == "compiled" else width - 1  # the last token never fed
        if own_decode == "compiled":
            bookkeeping.append(input_ids.new_empty((input_ids.shape[0], capacity)))  # the step's mask
        steps = list(range(max_new)) if full_decode or max_new <= 3 else [0, 1, max_new - 1]
        for i, step in enumerate(steps):
            skipped = step - steps[i - 1] - 1 if i else 0
            if skipped:  # grow the cache to the length the skipped decode steps would have left
                b = sequences.shape[0]
                for layer_idx, layer in enumerate(cache.layers):
                    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
                    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
                        continue  # a recurrent / linear-attention state has the same size at every step
                    # keys and values may have different head sizes (MLA: MiniCPM3, DeepSeek-V3)
                    new_keys = keys.new_zeros((b, keys.shape[1], skipped, keys.shape[3]))
                    new_values = values.new_zeros((b, values.shape[1], skipped, values.shape[3]))
                    del keys, values  # the layer's old tensors die in update(), as a real decode step's do
                    cache.update(new_keys, new_values, layer_idx)
                    del new_keys, new_values
                grown = position_ids[:, -1:] + torch.arange(1, skipped + 1)  # [B, skipped]
                position_ids = torch.cat([position_ids, grown], dim=-1)
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones((b, skipped))], dim=-1)
                sequences = torch.cat([sequences, sequences.new_zeros((b, skipped))], dim=-1)
                step_ids, step_positions = sequences[:, -1:], position_ids[:, -1:]
                del grown
            out = policy(
                input_ids=step_ids.clone(),
                attention_mask=mask,
                position_ids=step_positions.clone(),
                **cache_kwargs(policy, cache),
                use_cache=True,
                logits_to_keep=1,
                return_dict=True,
            )
            if own_decode and step == 0:
                preallocate(cache, capacity)
            step_positions = position_ids[:, -1:] + 1  # [B, 1]
            position_ids = torch.cat([position_ids, step_positions], dim=-1)
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
            logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)  # [B, V]
            held = 2 * logits.untyped_storage().nbytes()  # + probs
            if step == 0 and held >= record.logits_bytes:  # a rollout decoded in chunks: the largest chunk's
                record.logits_bytes = held
                record.batch, record.vocab = logits.shape
            probs = torch.softmax(logits, dim=-1)  # [B, V]
            next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)  # [B]
            next_tokens = next_tokens * unfinished + 0 * (1 - unfinished)
            sequences = torch.cat([sequences, next_tokens[:, None]], dim=-1)  # [B, P + t]
            unfinished = unfinished & ~torch.isin(sequences[:, -1], eos)
            step_ids = sequences[:, -1:]
            del out, logits, probs
        size = cache_size(cache)
        if size[0] >= record.kv_cache_bytes:  # a rollout decoded in chunks: the largest chunk's
            record.kv_cache_bytes, record.kv_cache_shape = size
        record.calls += 1
        del bookkeeping
        return sequences

    return generate


def cache_size(cache) -> tuple[int, str]:
    """Bytes of a transformers cache (keys and values, and the states of recurrent / linear-attention layers), and a
    shape description."""
    all_layers = list(getattr(cache, "layers", []))
    storages = {}
    for layer in all_layers:
        for value in vars(layer).values():
            for t in (
                value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            ):
                if isinstance(t, torch.Tensor):
                    storages[id(t.untyped_storage())] = t.untyped_storage().nbytes()
    layers = [layer for layer in all_layers if isinstance(getattr(layer, "keys", None), torch.Tensor)]
    if not storages:
        return 0, ""
    total = sum(storages.values())
    if not layers:
        return total, f"{len(all_layers)} layers of recurrent states"
    k, v = layers[0].keys, layers[0].values
    kv = f"{list(k.shape)}" if k.shape == v.shape else f"(K {list(k.shape)}, V {list(v.shape)})"
    others = len(all_layers) - len(layers)
    extra = f" + {others} layers of recurrent states" if others else ""
    return total, f"{len(layers)} layers x 2 x {kv} {dtype_name(k.dtype)}{extra}"


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "int64"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (the estimator's), whose value reads all answer 1: a step that sizes
    its work from values (completion lengths) takes the longest case instead."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)
