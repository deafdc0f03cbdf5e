"""``model.decode: compiled``: the decode loop's one-token step through ``torch.compile``, over a static KV cache.

Why: a decode step is one token's forward, hundreds of small kernels around a few skinny matrix multiplies
(``bench/results/roofline.md``). ``torch.compile`` fuses the elementwise kernels; on a GPU, CUDA graphs (its
``reduce-overhead`` mode) replay the whole step as one launch. A compiled step needs the same shapes at every
token, which :class:`~lit_rl.models.decode.PreallocatedLayer` (views that grow by one position per token) does
not give, so this step runs over transformers' ``StaticCache`` instead, attending over the whole buffer from the
first token. On a CPU the multiplies keep most of the time: the compiled step is faster than the eager loop only
for short completions, slower for long ones, and the first rollout of each shape pays the compilation
(``bench/results/decode.md``). It is the path for a GPU, where CUDA graphs remove the launch of every kernel.

How :func:`compiled_decode` differs from :func:`lit_rl.models.decode.decode`, whose loop it runs (sampling, EOS,
``min_new_tokens``, padding of ended rows and the early exit are that loop's, unchanged):

- **The prefill** is the loop's own (eager, a ``DynamicCache``, a shared-prompt prefill included), so the first
  token's logits are ``generate``'s. The cache is then copied into static buffers of ``capacity`` positions; every
  later step feeds one token and attends over the whole buffer with the rollout's mask (positions not written yet
  lie after the query and are masked as the future), so each step has the same shapes.
- **Logits are close to ``generate``'s, not bitwise equal**: compiled kernels sum in another order and the
  attention runs over the whole buffer. The tests compare the logits at a tight tolerance and the greedy tokens
  for equality; sampled tokens are ``generate``'s for the same random state unless rounding moves a draw across
  a boundary, which the benchmark's check column reports.
- **One compilation per shape**: the step is specialised on (rows, capacity, dtype, device), with the capacity
  ``P + N - 1`` rounded up to a multiple of 64 so that rollouts whose prompts differ by a few tokens share it
  (transformers models read the write position from a tensor in the cache, so the position never recompiles;
  the length itself cannot be marked dynamic: the static cache's mask reads it as a Python number).
  A new shape is compiled in a warm-up call before its first step, outside the sampling's random state, and said
  in one line with its seconds (:func:`compile_seconds`); after ``StaticSteps.max_shapes`` shapes a model's
  further shapes run the eager loop, said once. torch's own recompile limit is left as it is.
- **On CUDA** the mode is ``reduce-overhead`` (CUDA graphs), whose replays need the cache at a fixed address: the
  buffers of each shape are kept between rollouts, so one rollout's KV cache stays allocated through the update
  (the estimate does not count it). Written for GPUs, tested only on CPUs.

Falls back, in one line each: at load time (:func:`choose_decode`) to ``generate`` where the eager loop would
(:func:`~lit_rl.models.decode.decode_unsupported`), and to the eager loop where torch.compile is unavailable, the
cache is not made of plain static layers, or the static step run eagerly does not give ``generate``'s greedy
tokens on random prompts; at the first rollout to the eager loop when compiling the step fails.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from lightning.pytorch.utilities import rank_zero_info
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from lit_rl.models.cache_keyword import cache_kwargs
from lit_rl.models.decode import decode, decode_unsupported, weights_are_real
from lit_rl.models.head import base_model
from lit_rl.models.lean_step import lean_unsupported

__all__ = [
    "StaticSteps",
    "choose_decode",
    "compile_seconds",
    "compile_unsupported",
    "compiled_decode",
    "static_capacity",
]


def static_capacity(positions: int, multiple: int = 64) -> int:
    """The static cache's length for a rollout that feeds ``positions`` tokens: rounded up to ``multiple``."""
    return -(-positions // multiple) * multiple


def _one_token(model, cache, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    out = model(
        input_ids=tokens,  # [B, 1]
        attention_mask=mask,  # [B, capacity]
        position_ids=positions,  # [B, 1]
        **cache_kwargs(model, cache),
        use_cache=True,
        logits_to_keep=1,
        return_dict=True,
    )
    return out.logits[:, -1]  # [B, V]


_compiled: dict[str | None, Any] = {}


def _compiled_step(device: torch.device):
    mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs: one launch per step
    if mode not in _compiled:  # one wrapper: its graphs are reused by every model of the same structure
        _compiled[mode] = torch.compile(_one_token, dynamic=False, fullgraph=True, mode=mode)
    return _compiled[mode]


@dataclass
class _ModelState:
    seconds: dict[tuple, float] = field(default_factory=dict)  # shape -> seconds of its warm-up (compilation)
    caches: dict[tuple, StaticCache] = field(default_factory=dict)  # shape -> buffers kept for CUDA graphs
    failed: str | None = None  # why compiling failed: every later rollout runs the eager loop
    said: set[str] = field(default_factory=set)


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state(model) -> _ModelState:
    if model not in _states:
        _states[model] = _ModelState()
    return _states[model]


def compile_seconds(model) -> dict[tuple, float]:
    """Seconds each shape ``(rows, capacity, dtype, device)`` took to compile (its warm-up call) for ``model``."""
    return dict(_state(model).seconds)


def _say_once(model, message: str) -> None:
    state = _state(model)
    if message not in state.said:
        state.said.add(message)
        rank_zero_info(message)


class StaticSteps:
    """The one-token steps of one rollout over static buffers: the ``step`` of :func:`lit_rl.models.decode.decode`.

    Args:
        model: the causal LM the loop runs.
        compiled: ``False`` runs the same step eagerly (the load-time check).
    """

    #: distinct shapes compiled per model; a rollout of a further shape runs the eager loop
    max_shapes: ClassVar[int] = 8

    def __init__(self, model, compiled: bool = True) -> None:
        self.model, self.compiled = model, compiled
        self.cache: StaticCache | None = None
        self.mask: torch.Tensor | None = None  # [B, capacity]
        self._fn = _one_token

    def start(self, cache, mask: torch.Tensor) -> bool:
        """Move the prefilled ``cache`` into static buffers; ``False``: the eager loop goes on (said why).

        ``mask``: ``[B, P + N]``, the loop's mask for the longest sequence (prompt mask, then ones).
        """
        layers = cache.layers
        b, total = mask.shape
        if total - layers[0].keys.shape[2] < 2:  # one new token: no step after the prefill
            return False
        capacity = static_capacity(total - 1)  # the last token is never fed back
        keys = layers[0].keys
        shape = (b, capacity, keys.dtype, keys.device)
        state = _state(self.model)
        if self.compiled:
            if state.failed is not None:
                return False
            if shape not in state.seconds and len(state.seconds) >= self.max_shapes:
                _say_once(self.model, f"model.decode: the eager loop for rollouts beyond {self.max_shapes} shapes")
                return False
            self._fn = _compiled_step(keys.device)
        static = state.caches.get(shape)  # CUDA graphs: the buffers this shape was recorded with
        if static is None:
            static = StaticCache(config=base_model(self.model).config, max_cache_len=capacity)
        for layer, filled in zip(static.layers, layers):  # layer by layer: each growing tensor dies once copied
            if not layer.is_initialized:
                layer.lazy_initialization(filled.keys, filled.values)  # [B, Hkv, capacity, D] zeros
            n = filled.keys.shape[2]
            layer.keys[:, :, :n].copy_(filled.keys)
            layer.values[:, :, :n].copy_(filled.values)
            layer.cumulative_length.fill_(n)  # where the next step writes
            filled.keys = filled.values = None  # the growing tensors die here, not at the end of the rollout
        self.cache = static
        self.mask = mask.new_ones((b, capacity))  # [B, capacity]; ones after the prompt, as the loop's mask
        width = min(total, capacity)
        self.mask[:, :width] = mask[:, :width]
        if self.compiled and shape not in state.seconds and not self._warm_up(shape, b):
            for layer, filled in zip(static.layers, layers):  # back to the eager loop's cache (views, copied there)
                n = int(layer.cumulative_length)
                filled.keys, filled.values = layer.keys[:, :, :n], layer.values[:, :, :n]
            self.cache = None
            return False
        if self.compiled and keys.device.type == "cuda":
            state.caches[shape] = static
        return True

    def _warm_up(self, shape: tuple, rows: int) -> bool:
        """Compile for ``shape`` with one step on dummy tokens, written where the first real step writes next."""
        state = _state(self.model)
        device = shape[3]
        dummy = torch.zeros((rows, 1), dtype=torch.long, device=device)  # [B, 1]
        written = [int(layer.cumulative_length) for layer in self.cache.layers]
        start = time.perf_counter()
        try:  # compilation may draw random numbers (autotuning); the rollout's samples must not see them
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                self._fn(self.model, self.cache, dummy, self.mask, dummy.clone())
        except Exception as err:  # torch.compile raises many kinds (unsupported ops, graph breaks, no compiler)
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
            state.failed = f"torch.compile failed on its one-token step ({type(err).__name__}: {first_line})"
            name = getattr(base_model(self.model).config, "_name_or_path", "") or type(base_model(self.model)).__name__
            _say_once(self.model, f"model.decode: the eager loop for {name}, {state.failed}")
            return False
        finally:
            for layer, n in zip(self.cache.layers, written):
                layer.cumulative_length.fill_(n)
        state.seconds[shape] = time.perf_counter() - start
        rows, capacity, dtype, _ = shape
        _say_once(
            self.model,
            f"model.decode: compiled the one-token step for {rows} rows x {capacity} positions "
            f"({str(dtype).removeprefix('torch.')}, {device}) "
            f"in {state.seconds[shape]:.1f} s",
        )
        return True

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of the next token after ``tokens [B, 1]`` at ``positions [B, 1]``."""
        # contiguous copies: views of the loop's [B, P + N] tables have strides that change with the rollout
        return self._fn(self.model, self.cache, tokens.clone(), self.mask, positions.clone())


def compiled_decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, **settings: Any):
    """:func:`lit_rl.models.decode.decode` with its steps after the prefill compiled (same arguments and result)."""
    return decode(model, input_ids, attention_mask, step=StaticSteps(model), **settings)


def compile_unsupported(model) -> str | None:
    """Why ``model.decode: compiled`` cannot run for ``model`` (``None`` when it can), decided at load time.

    Compiling itself is tried at the first rollout; this checks what can be checked without it: torch.compile is
    available, the static cache is plain static layers, and the static step, run eagerly, gives ``generate``'s
    greedy tokens on two random prompts (one left-padded).
    """
    try:
        torch._dynamo.eval_frame.check_if_dynamo_supported()
    except Exception as err:  # a Python version or platform torch.compile does not support
        return f"torch.compile is unavailable here ({err})"
    try:
        static = StaticCache(config=base_model(model).config, max_cache_len=8)
    except Exception as err:
        return f"its static cache layout is unknown ({type(err).__name__})"
    kinds = sorted({type(layer).__name__ for layer in static.layers if type(layer) is not StaticLayer})
    if kinds or not static.layers:
        return f"its static cache has {', '.join(kinds) or 'no layers'}"
    if not weights_are_real(model):  # an estimate has no values to compare
        return None
    reason = decode_unsupported(model, step=StaticSteps(model, compiled=False))
    return None if reason is None else f"its static-cache step: {reason}"


def choose_decode(model, requested: str, name: str) -> tuple[str | bool, str | None]:
    """What ``model.decode: requested`` runs for ``model``: ``(False | "own" | "compiled" | "lean", the line saying
    why not)``.

    ``False`` is ``generate``. ``name``: the model's name in the line.
    """
    if requested == "generate":
        return False, None
    reason = decode_unsupported(model)
    if reason is not None:
        return False, f"model.decode: transformers' generate for {name}, {reason}"
    if requested in ("compiled", "lean"):
        reason = compile_unsupported(model) if requested == "compiled" else lean_unsupported(model)
        if reason is not None:
            return "own", f"model.decode: the eager loop for {name}, {reason}"
    return requested, None
