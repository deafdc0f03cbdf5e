"""The memory tactics lit-rl knows: what each saves and costs, how to turn it on, and how the estimator applies it.

One table, read by the estimator (``lit-rl estimate --device-memory``, which re-estimates the step with
each tactic applied) and by the OOM report (which lists them with the predicted saving).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tactic:
    """One memory tactic.

    Attributes:
        name: the key used by the estimator and the OOM report.
        what: what it saves and what it costs.
        how: how to turn it on, as command-line arguments (``{value}`` is filled by the estimator).
        estimated: whether the estimator can predict its saving (``empty_cache`` frees allocator blocks,
            not tensor bytes, so it cannot).
    """

    name: str
    what: str
    how: str
    estimated: bool = True


TACTICS: dict[str, Tactic] = {
    t.name: t
    for t in (
        Tactic(
            "activation_checkpointing",
            "recompute decoder-layer activations in the backward instead of keeping them; one more policy forward",
            "--config callbacks/activation_checkpointing.yaml",
        ),
        Tactic(
            "micro_batch",
            "a smaller update micro-batch (by rows, or by tokens with micro_batch_tokens): saved activations shrink "
            "in proportion; more, smaller passes",
            "--model.init_args.micro_batch_size {value}",
        ),
        Tactic(
            "bf16",
            "bf16 weights and activations, half the bytes of float32 (log-prob math stays float32)",
            "--trainer.precision bf16-true",
        ),
        Tactic(
            "adamw8bit",
            "AdamW's two moments in 8 bits with one fp32 scale per 256 values instead of fp32 (bitsandbytes): about "
            "a quarter of the optimizer state; changes the update slightly (bench/results/optimizer.md)",
            "--optimizer bitsandbytes.optim.AdamW8bit",
        ),
        Tactic(
            "lora",
            "train LoRA adapters only: no gradients or optimizer state for the base weights, which also serve as "
            "the reference model",
            "--model.init_args.lora.r 16 (LoRA on all linear layers)",
        ),
        Tactic(
            "rollout_layers",
            "sharded runs (FSDP2): the rollout gathers one layer at a time instead of the whole policy; every layer "
            "is gathered again for each token (more communication per token)",
            "--trainer.strategy.init_args.rollout_gather layers",
        ),
        Tactic(
            "host_offload",
            "on an accelerator, keep the weights, gradients and AdamW state in host memory (FSDP2's cpu_offload, on "
            "one device or more): the device holds the layers in use, activations and the gathered embedding and "
            "head; every pass copies the layers in and AdamW steps on the CPU, so the step is slower "
            "(bench/results/gpu_part6.md measures both)",
            "--trainer.strategy lit_rl.strategies.FSDP2Strategy --trainer.strategy.init_args.cpu_offload true",
        ),
        Tactic(
            "empty_cache",
            "return the allocator's cached memory at phase ends: CUDA's reserved-but-unused blocks (helps when the "
            "error reports much memory 'reserved but unallocated'; costs a sync and re-allocation stalls), or on CPU "
            "glibc's freed heap pages (malloc_trim; costs page faults when the memory is touched again)",
            "--config callbacks/empty_cache.yaml",
            estimated=False,
        ),
    )
}
