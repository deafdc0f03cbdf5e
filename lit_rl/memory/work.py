"""The least work of each phase of a training step: FLOPs and the bytes that must move, from shapes alone.

:mod:`lit_rl.memory.roofline` puts each phase's measured time beside the floor of this work at a machine's rates,
and :mod:`lit_rl.planner` prices a plan's tactics with it. A phase's floor is, for each part of it (the prefill,
each decode step, each micro-batch's pass), summed over the parts::

    floor = max(FLOPs / matmul rate, bytes / bandwidth)

FLOPs and bytes depend on neither the machine nor its load. Parts marked ``decode`` are few-row matmuls (a decode
step, a differentiable rollout's step and its backward), which :func:`floor`'s ``attainable_s`` puts at the rate of a
decode-shaped GEMM.

Counts, with ``H`` hidden size, ``I`` intermediate size, ``L`` layers, ``nh``/``nkv`` query/key-value heads of size
``d``, ``V`` vocabulary, ``W = L * (2*H*nh*d + 2*H*nkv*d + 3*H*I)`` the trunk's matmul weights (``2*H*I`` for a
plain GPT-2 MLP; biases, norms and embedding gathers not counted) and ``A`` the LoRA adapter weights:

- a token through the trunk costs ``2 * (W + A)`` FLOPs, one through the LM head ``2 * H * V`` (the logits-free
  ops compute every logit, in chunks);
- attention costs ``4 * nh * d * q * k`` per layer for ``q`` queries over ``k`` keys: the whole rectangle a masked
  kernel computes (a causal kernel may skip up to half of it); softmax and element-wise work are not counted;
- bytes: each weight a pass uses is read once per pass (per micro-batch, per decode step), the KV cache is read
  once per decode step and each new entry written once, gradients and optimizer state as below; activations are
  assumed to stay in cache, so bytes are a lower bound.

Phases (``B`` prompts, ``G`` completions per prompt, ``P`` the batch's padded prompt width, ``C`` the step's longest
completion, as :class:`~lit_rl.memory.step_prediction.StepShape` reads them):

- ``rollout``: a prefill of ``P - 1`` tokens per prompt (once per prompt with shared-prompt passes, once per
  completion without; no head), then ``C`` decode steps of ``B * G`` rows, step ``j`` attending over ``P + j - 1``
  keys and running the head; each reads every weight (``W + A + H*V``) and the cache so far. Reward functions and
  text decoding are not counted. A sampler in its own dtype (``StepWork.rollout_dtype``: bfloat16 of float32
  weights) reads weights and cache at that dtype's size, runs at its matmul rate, and first casts the weights once
  (read and written); a merged one (``rollout_merged``) runs no adapter matmul and first writes the merged trunk;
  a packed one (``rollout_packed``, float32 weights in oneDNN's layout) first copies the weights it reads once
  (and under LoRA unpacks the trunk again afterwards).
  A rollout decoded in chunks (``StepWork.rollout_rows``: :func:`~lit_rl.models.sampling.rollout_chunks`) makes
  the prefill and the ``C`` decode steps once per chunk, over its prompts and rows, each step reading every weight.
- ``reference``: a no-grad forward over the rollout per scoring pass, per micro-batch: ``u*P + b*C`` trunk tokens
  for ``b`` completions of ``u`` prompts with shared-prompt passes
  (:func:`~lit_rl.models.shared_prompt.group_runs`), ``b*(P + C)`` without, and the head on the ``b*C`` completion
  tokens. The passes are the ones the method declares in ``step_work()``
  (:class:`~lit_rl.memory.rollout.StepWork`): one for the reference when it runs, plus ``scoring_passes`` of the
  policy (RefCachedGRPO's old log-probs, Intuitor's self-certainty); adapters are not counted here. Padding-free
  passes (``completion_tokens``: the step's counted completion tokens) put that count in place of ``b*C`` in the
  head and, with shared-prompt passes, in the trunk, each micro-batch its share; attention keeps the padded blocks.
- ``policy_forward``: the same forward with adapters, once per micro-batch and per iteration
  (``StepWork.iterations``, optimizer steps per rollout batch).
- ``backward``: full fine-tuning: twice the forward's trunk and attention FLOPs (input and weight gradients) and
  three times its head FLOPs (the chunked head recomputes its logits). LoRA: the frozen weights get no gradient,
  so once the trunk's FLOPs (the first layer's input gradient included, which only checkpointing asks for),
  twice the adapters' and the attention's, twice the head's. Activation checkpointing adds a forward of each
  checkpointed layer but, in full fine-tuning, its MLP's down projection (``H*I``: PyTorch's non-reentrant
  checkpoint stops recomputing once the backward has what it needs; under LoRA only the last, tiny adapter matmul
  is skipped, which is not counted). Bytes: the weights again (and again for the recomputation), the gradients
  written (read too when a later micro-batch adds to them).
- ``optimizer``: no matmul; per trainable value fused AdamW reads the gradient and reads and writes the parameter
  and both moments (7 accesses), the finite-gradient check reads the gradient (1), clipping reads it for the norm
  and reads and writes it to scale (3).

Precision: the matmul rate of the dtype the matmuls run in (bfloat16 or float16 under ``bf16-*``/``16-*``
precision, else the weights' dtype); weights, gradients and optimizer state at the weights' size (float32 master
weights under mixed precision), the KV cache at the compute dtype's.

**A differentiable rollout** (:class:`~lit_rl.memory.rollout.DifferentiableRollout`, GumbelTopK), per micro-batch
of ``b`` rows, ``k`` embedding rows per soft token, ``W_s`` the scorer's trunk weights (its kept layers) and ``g``
the first differentiated token (``max(C - grad_window, 0)``, else 0):

- ``generate``: a prefill of all ``P`` prompt tokens per row (no shared prompt) in the policy and, with a
  reference, in the reference; per token the policy's head and the reference's (sampling and the KL read the same
  logits: once each is the least); ``C - 1`` steps of each trunk over one row-token each, step ``j`` attending over
  ``P + j`` keys, the policy's input a gather of ``k`` embedding rows per row. Every step reads every weight it uses.
- ``reward``: the scorer's trunk over ``P + C`` tokens per row in one causal pass (every prefix scored at once),
  its soft rows gathered; its score head is not counted.
- ``backward``: the scorer's input gradients (its weights are frozen: once its trunk's FLOPs, twice its attention's);
  per differentiated token the sampling head's backward (input gradient, and the weight gradient when the head
  trains) and the KL's (it recomputes both heads' logits, then the input gradient, and the weight gradient when the
  head trains); per differentiated policy step, and the prefill when ``g = 0``, the trunk's backward as in a sampled
  step's (full fine-tuning: twice the forward's trunk and attention FLOPs; LoRA: once the trunk's, twice the
  adapters' and the attention's) plus a forward again with ``recompute_steps``. Bytes: the weights each step reads
  again, and under full fine-tuning each step's weight gradients added into the sums (read and written).
- ``optimizer``: as for a sampled step.

**A 4-bit base** (``StepSettings.base_nf4``: bytes per stored weight, codes and scales, from
:func:`~lit_rl.models.quantize.nf4_bytes_per_param`): every pass that reads the trunk's weights (each decode step,
each micro-batch's forward, the backward and its recomputation, a scorer's) reads the 4-bit codes and scales, writes
the dense weight at the training dtype's size and reads it again for the matmul (bitsandbytes decodes one layer at a
time into a temporary, ``lit_rl/models/quantize.py``): ``base_nf4 + 2 * weight_bytes`` per trunk weight instead of
``weight_bytes``. The decoding's arithmetic is not counted. A sampler's merge, cast and packing leave the 4-bit
layers alone (their adapters keep running; only the head and adapters are cast or packed), and the rollout decodes
them at the training dtype (their matmuls are counted at the rollout's rate).

Not modelled (the roofline reports such phases as not modelled): phases of other names, mixture-of-experts layers,
reward functions and text decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_rl.memory.phases import BACKWARD, OPTIMIZER
from lit_rl.memory.rollout import StepWork
from lit_rl.models.sampling import rollout_chunks
from lit_rl.models.shared_prompt import group_runs

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per value of the dtypes a step computes in


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that set its FLOPs and bytes."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    gated: bool = True  # gate, up and down projections (Llama, Qwen); False: GPT-2's two

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (Llama/Qwen/Mistral-like or GPT-2 field names).

        Raises:
            ValueError: for a mixture-of-experts config or one without these fields.
        """
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if any(getattr(text, n, None) for n in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise ValueError("mixture-of-experts layers are not modelled")

        def get(*names: str) -> Any:
            return next((getattr(text, n) for n in names if getattr(text, n, None) is not None), None)

        hidden, layers, heads = (
            get("hidden_size", "n_embd"),
            get("num_hidden_layers", "n_layer"),
            get("num_attention_heads", "n_head"),
        )
        if not (hidden and layers and heads and getattr(text, "vocab_size", None)):
            raise ValueError(f"{type(text).__name__} has no hidden size, layer count, head count or vocabulary")
        gpt2 = getattr(text, "model_type", "") == "gpt2"
        return cls(
            hidden=hidden,
            intermediate=get("intermediate_size", "n_inner") or 4 * hidden,
            layers=layers,
            heads=heads,
            kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or hidden // heads,
            vocab=text.vocab_size,
            gated=not gpt2,
        )

    @property
    def trunk_weights(self) -> int:
        """``W``: matmul weights of every decoder layer (attention projections and MLP)."""
        h, d = self.hidden, self.head_dim
        attention = 2 * h * self.heads * d + 2 * h * self.kv_heads * d  # q and o, k and v
        return self.layers * (attention + (3 if self.gated else 2) * h * self.intermediate)

    @property
    def head_weights(self) -> int:
        return self.hidden * self.vocab

    def attention_flops(self, pairs: int) -> int:
        """FLOPs of ``pairs`` (query, key) pairs in every layer: ``q @ k`` and ``p @ v``."""
        return 4 * self.heads * self.head_dim * self.layers * pairs

    @property
    def cache_values_per_token(self) -> int:
        """Keys and values one token adds to the KV cache, over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class StepSettings:
    """What, besides the model's shape, sets a step's work (the fields of the phases above)."""

    prompts: int  # B
    generations: int  # G
    prompt_length: int  # P, the padded width
    new_tokens: int  # C, the longest completion
    micro_batch: int | None = None  # completions per forward; None: all at once
    share_prompt: bool = True
    adapters: int = 0  # LoRA adapter weights; 0: full fine-tuning
    trainable: int = 0  # values the optimizer updates
    weight_bytes: int = 4  # per weight, gradient and optimizer value
    cache_bytes: int = 4  # per KV-cache value (the compute dtype)
    reference_passes: int = 1
    iterations: int = 1  # optimizer steps per rollout batch
    checkpointed_layers: int = 0
    clip: bool = True
    # a differentiable rollout (StepWork.differentiable): k rows per soft token (0: a sampled rollout), the scorer's
    # shape, each policy step recomputed in the backward, the differentiated last tokens (None: all)
    soft_topk: int = 0
    scorer: ModelShape | None = None
    recompute_steps: bool = False
    grad_window: int | None = None
    # a sampled rollout's own precision (None: the trainer's) and LoRA merged into the weights it reads
    rollout_dtype: str | None = None
    rollout_merged: bool = False
    rollout_packed: bool = False  # float32 weights copied into oneDNN's layout once per rollout
    rollout_rows: int | None = None  # completions decoded together; None: all B * G
    base_nf4: float = 0.0  # bytes per weight of a 4-bit (NF4) frozen trunk, scales included; 0: a dense trunk
    # the rollout's completion tokens that count (padding-free passes run only these; None: every row at new_tokens)
    completion_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.scorer, dict):  # from asdict(), as a report stores the settings
            object.__setattr__(self, "scorer", ModelShape(**self.scorer))

    @classmethod
    def of(cls, work: StepWork, *, trainable: int, device: str = "cpu", **shapes: Any) -> StepSettings:
        """The settings of a step whose passes ``work`` declares (:func:`~lit_rl.memory.rollout.step_work`), at
        ``shapes``: the other fields (``prompts``, ``generations``, lengths, ``micro_batch``, byte sizes,
        ``checkpointed_layers``, ``base_nf4``). The one constructor the profiler's roofline and the planner share.
        A packed sampler counts only where it packs (:func:`~lit_rl.models.sampling.rollout_sampler`): float32
        compute on a ``device`` of type ``cpu``; elsewhere the run says it has no effect.

        Raises:
            ValueError: a differentiable rollout's scorer whose config :class:`ModelShape` cannot read.
        """
        soft = work.differentiable
        extra = {}
        if soft is not None:
            scorer = ModelShape.from_config(soft.scorer) if soft.scorer is not None else None
            extra = dict(soft_topk=soft.top_k, scorer=scorer, recompute_steps=soft.recompute_steps,
                         grad_window=soft.grad_window)  # fmt: skip
        float32 = shapes.get("weight_bytes", 4) == shapes.get("cache_bytes", 4) == 4  # no autocast, no bf16 weights
        packed = work.rollout_packed and device == "cpu" and work.rollout_dtype is None and float32
        return cls(
            share_prompt=work.share_prompt,
            adapters=trainable if work.adapters else 0,
            trainable=trainable,
            reference_passes=int(work.reference_pass) + work.scoring_passes,
            iterations=work.iterations,
            clip=work.clip,
            rollout_dtype=work.rollout_dtype,
            rollout_merged=work.rollout_merged,
            rollout_packed=packed,
            rollout_rows=work.rollout_rows,
            **extra,
            **shapes,
        )


@dataclass(frozen=True)
class Work:
    """One part of a phase: FLOPs and the least bytes it moves; ``decode``: a decode step's few-row matmuls;
    ``dtype``: its matmuls run in this dtype, not the step's."""

    flops: float
    bytes: float
    decode: bool = False
    dtype: str | None = None


def _micro_batches(s: StepSettings) -> list[tuple[float, float, int]]:
    """``(head tokens, trunk tokens, attention pairs)`` of each micro-batch's forward. Padding-free passes
    (``completion_tokens``) run the counted completion tokens through the head, and through the trunk when the prompt
    is shared, each micro-batch its share of them; attention runs on the padded blocks either way."""
    n = s.prompts * s.generations
    size = s.micro_batch or n
    p, c = s.prompt_length, s.new_tokens
    counted = 1.0 if s.completion_tokens is None else s.completion_tokens / (n * c)  # [0, 1]
    out = []
    for start in range(0, n, size):
        stop = min(start + size, n)
        b = stop - start
        if s.share_prompt:
            u = len(group_runs(start, stop, s.generations))
            dropped = b if counted < 1 else 0  # padding-free, the trunk skips each row's last token: it scores nothing
            out.append((b * c * counted, u * p + b * c * counted - dropped, u * p * p + b * c * (p + c)))
        else:
            out.append((b * c * counted, b * (p + c), b * (p + c) ** 2))
    return out


def phase_work(m: ModelShape, s: StepSettings) -> dict[str, list[Work]]:
    """The parts of each modelled phase of one step (the counts of the module docstring)."""
    if s.soft_topk:
        return _differentiable_work(m, s)
    wb, w, a, hv = s.weight_bytes, m.trunk_weights, s.adapters, m.head_weights
    tb = _trunk_bytes(s)  # per trunk weight and pass
    kv = m.cache_values_per_token * s.cache_bytes  # bytes per cached token
    rd = s.rollout_dtype
    rb = ITEMSIZE[rd] if rd else wb  # the rollout's weights, in its own dtype when it has one
    rtb = tb if s.base_nf4 else rb  # a 4-bit trunk is decoded at the training dtype, whatever the rollout's
    rollout = _sampler(m, s, rb)
    ra, rkv = (0 if _merged(s) else a), (m.cache_values_per_token * rb if rd else kv)
    p = s.prompt_length - 1
    for _, prompts, repeats in rollout_chunks(s.prompts, s.generations, s.rollout_rows):
        rows = prompts * repeats
        prefill_rows = prompts if s.share_prompt and repeats > 1 and p > 0 else rows
        if p > 0:
            tokens = prefill_rows * p
            flops = 2 * tokens * (w + ra) + m.attention_flops(prefill_rows * p * p)
            rollout.append(Work(flops, w * rtb + ra * rb + tokens * rkv, dtype=rd))
        for j in range(1, s.new_tokens + 1):
            keys = s.prompt_length + j - 1
            flops = 2 * rows * (w + ra + hv) + m.attention_flops(rows * keys)
            moved = w * rtb + (ra + hv) * rb + rows * keys * rkv + rows * rkv
            rollout.append(Work(flops, moved, decode=True, dtype=rd))

    def forward(tokens: float, pairs: int, head_tokens: float, adapters: int) -> Work:
        flops = 2 * tokens * (w + adapters) + m.attention_flops(pairs) + 2 * head_tokens * hv
        return Work(flops, w * tb + (adapters + hv) * wb)

    micro = _micro_batches(s)
    reference = [forward(t, q, h, 0) for _ in range(s.reference_passes) for h, t, q in micro]
    policy = [forward(t, q, h, a) for h, t, q in micro] * s.iterations
    # a checkpointed layer runs its forward again until the backward has every tensor it needs (PyTorch's
    # non-reentrant checkpoint stops early): all but the MLP's down projection, whose output is not one of them;
    # under LoRA that projection runs before its adapter, whose input is needed, so only the last adapter is skipped
    share = s.checkpointed_layers / m.layers
    skipped = 0 if a else m.hidden * m.intermediate
    redo_w = s.checkpointed_layers * (w // m.layers - skipped)  # trunk weights the recomputation multiplies by
    redo = redo_w + share * a
    backward = []
    for i, (h, t, q) in enumerate(micro):
        trunk, adapt, attn, head = 2 * t * w, 2 * t * a, m.attention_flops(q), 2 * h * hv
        flops = (trunk + 2 * adapt + 2 * attn + 2 * head) if a else (2 * trunk + 2 * attn + 3 * head)
        flops += 2 * t * redo + share * attn
        grads = s.trainable * wb * (1 if i == 0 else 2)
        backward.append(Work(flops, (w + redo_w) * tb + (a + share * a + hv) * wb + grads))
    optimizer = [_optimizer(s)]
    return {
        "rollout": rollout,
        "reference": reference,
        "policy_forward": policy,
        BACKWARD: backward * s.iterations,
        OPTIMIZER: optimizer * s.iterations,
    }


def _sampler(m: ModelShape, s: StepSettings, rb: int) -> list[Work]:
    """What a sampled rollout does once before its first token, its weights ``rb`` bytes each: LoRA merged into a
    copy of the trunk's weights (the base and adapters read, the copy written in the rollout's dtype), the weights
    left to cast to the rollout's dtype (read and written), and a float32 sampler's packed copy of the weights it
    reads (read and written; under LoRA the trunk, which lent its storage, is unpacked again after the rollout, read
    and written once more, counted here); the merge's own small matmuls are not counted."""
    w, hv, wb = (0 if s.base_nf4 else m.trunk_weights), m.head_weights, s.weight_bytes  # a 4-bit trunk: left alone
    merged = _merged(s) and s.adapters > 0
    moved = 0
    if merged:
        moved += (w + s.adapters) * wb + w * rb
    if rb != wb:
        moved += (hv if merged else w + hv) * (wb + rb)
    elif s.rollout_packed and s.rollout_dtype is None:  # under LoRA the frozen trunk is unpacked again afterwards
        moved += (w + hv + (0 if merged else s.adapters)) * 2 * rb + (w * 2 * rb if s.adapters else 0)
    return [Work(0, moved)] if moved else []


def _merged(s: StepSettings) -> bool:
    """LoRA merged into the weights the sampler reads: none of a 4-bit trunk's (its adapters keep running)."""
    return s.rollout_merged and not s.base_nf4


def _trunk_bytes(s: StepSettings) -> float:
    """Bytes moved per trunk weight by a pass that reads it: the weight, or a 4-bit one's codes and scales read and
    its dense decoding written and read at the training dtype."""
    return s.base_nf4 + 2 * s.weight_bytes if s.base_nf4 else s.weight_bytes


def _optimizer(s: StepSettings) -> Work:
    return Work(0, s.trainable * s.weight_bytes * (7 + 1 + (3 if s.clip else 0)))


def _differentiable_work(m: ModelShape, s: StepSettings) -> dict[str, list[Work]]:
    """``generate``, ``reward``, ``backward`` and ``optimizer`` of a differentiable rollout (module docstring)."""
    wb, w, a, hv, tb = s.weight_bytes, m.trunk_weights, s.adapters, m.head_weights, _trunk_bytes(s)
    kv = m.cache_values_per_token * s.cache_bytes  # bytes per cached token
    p, c, ref = s.prompt_length, s.new_tokens, s.reference_passes > 0
    first = max(c - s.grad_window, 0) if s.grad_window is not None else 0
    n = s.prompts * s.generations
    size = s.micro_batch or n
    full = not a  # full fine-tuning: the trunk and the head take weight gradients
    generate, reward, backward = [], [], []
    for b in [min(size, n - start) for start in range(0, n, size)]:
        sides = 2 if ref else 1  # the policy, and the reference beside it
        prefill = 2 * b * p * (w + a) + m.attention_flops(b * p * p)
        generate.append(
            Work(prefill + (prefill - 2 * b * p * a if ref else 0), sides * w * tb + a * wb + sides * b * p * kv)
        )
        for j in range(c):  # token j: the heads; then the trunk step that feeds it back (none after the last)
            flops, moved = 2 * b * hv * sides, hv * wb * sides
            if j + 1 < c:
                keys = p + j + 1
                flops += sides * (2 * b * w + m.attention_flops(b * keys)) + 2 * b * a
                moved += sides * w * tb + a * wb + sides * b * keys * kv + b * s.soft_topk * m.hidden * wb
            generate.append(Work(flops, moved, decode=True))
        if s.scorer is not None:
            t, ws = b * (p + c), s.scorer.trunk_weights
            attention = s.scorer.attention_flops(b * (p + c) * (p + c))
            reward.append(Work(2 * t * ws + attention, ws * tb + b * c * s.soft_topk * s.scorer.hidden * wb))
            backward.append(Work(2 * t * ws + 2 * attention, ws * tb))
        # the heads of each differentiated token: sampling (input and, when the head trains, weight gradient) and
        # the KL (both logits again, then the same gradients); under full fine-tuning the weight gradients are added
        # into one sum (read and written)
        passes = (2 if full else 1) + ((4 if full else 3) if ref else 0)
        for _ in range(first, c):
            backward.append(Work(2 * b * hv * passes, hv * wb * (2 if ref else 1) + (2 * hv * wb if full else 0),
                                 decode=True))  # fmt: skip
        if first == 0:
            backward.append(_trunk_backward(m, s, b * p, b * p * p, False))
        for j in range(max(first, 1), c):  # the step feeding token j back
            backward.append(_trunk_backward(m, s, b, b * (p + j), s.recompute_steps))
    phases = {"generate": generate, "reward": reward, BACKWARD: backward, OPTIMIZER: [_optimizer(s)]}
    return {name: works for name, works in phases.items() if works}


def _trunk_backward(m: ModelShape, s: StepSettings, tokens: int, pairs: int, recompute: bool) -> Work:
    """One differentiated policy step's trunk backward (module docstring); full fine-tuning adds the step's weight
    gradients into the sums (read and written)."""
    w, a, wb = m.trunk_weights, s.adapters, s.weight_bytes
    matmul = 2 * tokens * w
    flops = (2 * matmul if not a else matmul + 4 * tokens * a) + 2 * m.attention_flops(pairs)
    if recompute:
        flops += matmul + 2 * tokens * a + m.attention_flops(pairs)
    grads = 0 if a else 2 * s.trainable * wb
    return Work(flops, (w * _trunk_bytes(s) + a * wb) * (2 if recompute else 1) + grads, decode=True)


def floor(
    works: list[Work], matmul: float, bandwidth: float, skinny: float | None = None, other: tuple = ()
) -> dict[str, Any]:
    """FLOPs, bytes and the floor of a phase's parts at ``matmul`` FLOP/s and ``bandwidth`` bytes/s.

    ``skinny``: the decode-shaped matmul rate, for ``attainable_s`` (the decode steps at that rate). ``other``:
    ``(dtype, matmul, skinny)`` rates of the dtypes that parts run in instead of the step's (``Work.dtype``).
    """
    by_dtype = {d: (mm, sk or mm) for d, mm, sk in other}
    rates = [by_dtype.get(x.dtype, (matmul, skinny or matmul)) for x in works]  # (square, decode-shaped) per part
    flops, moved = sum(x.flops for x in works), sum(x.bytes for x in works)
    compute_s, memory_s = sum(x.flops / r[0] for x, r in zip(works, rates)), moved / bandwidth
    floor_s = sum(max(x.flops / r[0], x.bytes / bandwidth) for x, r in zip(works, rates))
    attainable_s = sum(max(x.flops / r[x.decode], x.bytes / bandwidth) for x, r in zip(works, rates))
    return {
        "flops": flops,
        "bytes": moved,
        "compute_s": compute_s,
        "memory_s": memory_s,
        "floor_s": floor_s,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "attainable_s": attainable_s,
    }


def floor_rates(rates: dict[str, Any], dtype: str) -> tuple:
    """:func:`floor`'s rates from machine ``rates`` for a step computing in ``dtype``: its matmul rate, the bandwidth,
    its decode-shaped rate, and (``other``) those of every other dtype ``rates`` holds, for parts run in another."""
    values = rates["dtypes"][dtype]
    other = tuple((d, v["matmul_flops_per_s"], v["skinny_matmul_flops_per_s"])
                  for d, v in sorted(rates["dtypes"].items()) if d != dtype)  # fmt: skip
    return values["matmul_flops_per_s"], rates["bandwidth_bytes_per_s"], values["skinny_matmul_flops_per_s"], other
