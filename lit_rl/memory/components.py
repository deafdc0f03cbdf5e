"""The component table of an estimate: generic lines every method has, then the method's own.

``run`` is what the estimator measured on the step (optimizer state, saved activations); ``record`` is what
the stand-in ``generate`` saw (KV cache, logits), if the method generates.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_rl.memory.fake import GenerateRecord, dtype_name
from lit_rl.memory.report import Component
from lit_rl.memory.units import format_bytes
from lit_rl.models import lm_head
from lit_rl.models.quantize import is_nf4, is_nf4_stand_in, nf4_memory


def _param_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _dense_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The module's parameters other than NF4 codes (which :func:`nf4_memory` counts, scales included)."""
    codes = {id(m.weight) for m in module.modules() if is_nf4(m) or is_nf4_stand_in(m)}
    return [p for p in module.parameters() if id(p) not in codes]


def component_table(method, run, record: GenerateRecord, config, settings: dict[str, Any]) -> list[Component]:
    """The component table: generic lines for every method, then the method's own (``memory_components``)."""
    policy = method.policy
    params = _dense_params(policy)  # the NF4 codes have a row of their own
    trainable = [p for p in params if p.requires_grad]
    dtype = dtype_name(params[0].dtype)
    n_total, n_train = sum(p.numel() for p in params), sum(p.numel() for p in trainable)
    train_dtype = dtype_name(trainable[0].dtype) if trainable else dtype
    tied = "tied input/output embedding counted once" if getattr(config, "tie_word_embeddings", False) else ""
    rows = [Component("parameters (policy)", f"{n_total:,} x {dtype}", _param_bytes(params), tied)]
    n_nf4, nf4_bytes, largest = nf4_memory(policy)
    if n_nf4:
        rows.append(Component("base weights (NF4)", f"{n_nf4:,} x nf4", nf4_bytes,
                              f"{nf4_bytes / n_nf4:.3f} bytes/param with scales"))  # fmt: skip
    if method.reference is not None:
        rows.append(
            Component("reference weights", "frozen copy of the policy", _param_bytes(method.reference.parameters()))
        )
    elif method.needs_reference:
        rows.append(Component("reference weights", "shared: LoRA adapters disabled", 0, "no second copy"))
    else:
        rows.append(Component("reference weights", "none (no KL term)", 0))
    for name in method.frozen_modules:
        module = getattr(method, name, None)
        if name != "reference" and isinstance(module, torch.nn.Module):
            n_q, q_bytes, _ = nf4_memory(module)
            rest = _dense_params(module)
            shape = f"{sum(p.numel() for p in rest):,} x {dtype_name(rest[0].dtype)}"
            shape += f" + {n_q:,} x nf4" if n_q else ""
            rows.append(Component(f"{name} weights (frozen)", shape, _param_bytes(rest) + q_bytes))
    rows.append(Component("gradients", f"{n_train:,} trainable x {train_dtype}", _param_bytes(trainable)))
    rows.append(
        Component(
            f"optimizer state ({run.optimizer_name})",
            " + ".join(f"{n:,} x {dtype}" for dtype, n in sorted(run.state_numel.items(), key=lambda kv: -kv[1])),
            run.state_bytes,
            f"{run.state_tensors} tensors",
        )
    )
    if record.calls:
        rows.append(Component("KV cache (end of rollout)", record.kv_cache_shape, record.kv_cache_bytes))
        rows.append(
            Component(
                "generation logits + probs", f"2 x [{record.batch}, {record.vocab}] fp32", record.logits_bytes,
                "per decode step",
            )
        )  # fmt: skip
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    head = lm_head(policy)
    vocab = head.weight.shape[0] if hasattr(head, "weight") else config.vocab_size
    shape = dict(
        batch=settings["batch"],
        prompt_length=settings["prompt_length"],
        new_tokens=settings["max_new_tokens"],
        micro_batch=settings["micro_batch_size"],
        vocab=vocab,
        hidden=hidden,
    )
    rows += [Component(*row) for row in method.memory_components(shape)]
    if largest is not None:
        out_f, in_f, compute = largest
        rows.append(Component("NF4 dequantization temporary", f"[{out_f}, {in_f}] {dtype_name(compute)}",
                              out_f * in_f * compute.itemsize, "largest layer, one at a time (forward, backward)"))  # fmt: skip
    seq = settings["sequence_length"]
    note = f"{format_bytes(run.saved_activations / max(layers, 1))} per layer" if layers else ""
    if settings["activation_checkpointing"]:
        note += ", checkpointed"
    rows.append(
        Component(
            f"saved activations ({run.saved_phase.replace('_', ' ') or 'none'})",
            f"{layers} layers, micro-batch {settings['micro_batch_size']} x {seq}",
            run.saved_activations,
            note,
        )
    )
    if settings["padded"]:
        mb = settings["micro_batch_size"]
        rows.append(
            Component("attention mask (padded prompts)", f"[{mb}, 1, {seq}, {seq}] bool", mb * seq * seq, "per forward")
        )
    return rows
