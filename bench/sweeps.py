"""Vocabulary and length sweeps: lit-rl's logits-free reference pass + policy update against full logits, with
``lit-rl estimate``'s prediction beside each measured lit-rl peak (parts 3 and 4 of ``bench/run.py``).

Each point is one Qwen2-shaped random model (``bench_policy_update.build_model``: Qwen2.5-0.5B's hidden size, heads,
MLP width and tied embeddings) with LoRA r16 on all linear layers (``lit_rl.models.apply_lora``, the settings of
``LoraSettings()``), one batch of 2 prompts x 4 completions (``bench_policy_update.make_batch``: left-padded prompts),
and two phases under one memory measurement: the no-grad ``reference`` pass (adapters disabled in lit-rl's step; here
the same weights under ``no_grad``, which costs the same) and the ``update`` (forward + GRPO loss + backward, no
optimizer step). ``lit-rl logits-free`` runs ``RefCachedGRPO.completion_stats`` (chunked ``lit_rl.ops``) on whole
rows, each completion with its prompt (``share_prompt: false``, so the sweep isolates the logits; the shared-prompt
saving is measured by the ``shared_prompt`` study (``bench/studies/shared_prompt.yaml``) and the TRL part);
``full-logits`` materialises ``[B, C, V]`` float32 logits (TRL-style, with ``logits_to_keep``).

Measured: on CPU, exact bytes held by tensors (``TensorMemoryTracker``, resident weights included); on CUDA,
``torch.cuda.max_memory_allocated`` per phase. Predicted: ``estimate_step`` for ``RefCachedGRPO`` with the same
model config, LoRA, batch, prompt width and completion length, first step (no optimizer state yet, as measured here):
``reference`` against the measured reference phase, ``max(policy_forward, backward)`` against the measured update.
Tensor bytes do not depend on the machine's load; the seconds do.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field, replace

import bench_policy_update as bpu
import torch

IMPLEMENTATIONS = {
    "lit-rl logits-free": (bpu.reference_logits_free, bpu.update_logits_free),
    "full-logits": (bpu.reference_full_logits, bpu.update_full_logits),
}


@dataclass
class Point:
    """One (vocabulary, completion length) point: measured peaks and seconds per implementation, and the estimate."""

    vocab: int
    length: int
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)  # implementation -> phase -> bytes
    seconds: dict[str, float] = field(default_factory=dict)  # implementation -> reference + update seconds
    resident: int = 0
    predicted: dict[str, int] = field(default_factory=dict)  # phase -> bytes (reference, update)

    def peak(self, impl: str) -> int:
        return max(self.peaks[impl].values())

    def error(self, phase: str) -> float:
        """(predicted - measured lit-rl) / measured, in %."""
        measured = self.peaks["lit-rl logits-free"][phase]
        return 100.0 * (self.predicted[phase] - measured) / measured


@dataclass
class SweepConfig:
    """The shape of every point; ``vocabs`` at ``base_length`` and ``lengths`` at ``base_vocab``."""

    shape: bpu.BenchConfig
    vocabs: tuple[int, ...] = (32_000, 64_000, 151_936)
    lengths: tuple[int, ...] = (64, 128, 256, 512)
    base_vocab: int = 32_000
    base_length: int = 128
    device: str = "cpu"
    precision: str = "32-true"

    def points(self) -> list[tuple[int, int]]:
        grid = [(v, self.base_length) for v in self.vocabs] + [(self.base_vocab, c) for c in self.lengths]
        return sorted(set(grid))


def model_config(shape: bpu.BenchConfig, vocab: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(512, shape.prompt_len + shape.completion_len), tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def predict(cfg: SweepConfig, shape: bpu.BenchConfig, vocab: int) -> dict[str, int]:
    """``estimate_step``'s first-step peaks for the reference pass and the update of this point."""
    from lit_rl.losses import LossSettings
    from lit_rl.memory.estimate import estimate_step
    from lit_rl.methods import RefCachedGRPO
    from lit_rl.models import LoraSettings

    method = RefCachedGRPO(
        name_or_path="bench", lora=LoraSettings(), num_generations=shape.num_generations,
        max_new_tokens=shape.completion_len, min_new_tokens=shape.completion_len,
        loss=LossSettings(beta=shape.beta, loss_type=shape.loss_type), temperature=shape.temperature,
        share_prompt=False,
    )  # fmt: skip
    est = estimate_step(
        method, batch_size=shape.num_prompts, prompt_length=shape.prompt_len, model_config=model_config(shape, vocab),
        precision=cfg.precision, padded=True, device_type=cfg.device,
    )  # fmt: skip
    first = est.first_step
    return {"reference": first["reference"], "update": max(first["policy_forward"], first["backward"])}


def measure_cuda(model, batch: bpu.Batch, phases, shape: bpu.BenchConfig) -> tuple[int, dict[str, int], float]:
    """``bench_policy_update.measure`` on CUDA: the allocator's peak per phase (``max_memory_allocated``)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    state: dict = {}
    peaks = {}
    start = time.perf_counter()
    resident = torch.cuda.memory_allocated()
    for name, fn in phases:
        torch.cuda.reset_peak_memory_stats()
        fn(model, batch, shape, state)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return resident, peaks, seconds


def run_point(cfg: SweepConfig, vocab: int, length: int, log=print) -> Point:
    from lit_rl.models import LoraSettings, apply_lora

    shape = replace(cfg.shape, completion_len=length)
    point = Point(vocab, length)
    model = apply_lora(bpu.build_model(shape, vocab), LoraSettings())
    batch = bpu.make_batch(shape, vocab)
    if cfg.device == "cuda":
        model = model.to("cuda")
        batch = bpu.Batch(*(t.to("cuda") for t in batch.tensors()), batch.prompt_len)
    for impl, (reference, update) in IMPLEMENTATIONS.items():
        phases = [("reference", reference), ("update", update)]
        if cfg.device == "cuda":
            point.resident, point.peaks[impl], point.seconds[impl] = measure_cuda(model, batch, phases, shape)
        else:
            m = bpu.measure(model, batch, phases, shape)
            point.resident, point.peaks[impl], point.seconds[impl] = m.resident, m.phases, m.seconds
        log(f"  V={vocab:,} C={length} {impl}: peak {bpu.mib(point.peak(impl))} MiB, {point.seconds[impl]:.1f} s")
    del model, batch
    gc.collect()
    point.predicted = predict(cfg, shape, vocab)
    return point


def run(cfg: SweepConfig, log=print) -> list[Point]:
    return [run_point(cfg, v, c, log) for v, c in cfg.points()]


def table(points: list[Point]) -> list[str]:
    lines = [
        "| vocab | completion tokens | lit-rl reference MiB | predicted | error % | lit-rl update MiB | predicted "
        "| error % | full-logits reference MiB | full-logits update MiB | peak ratio lit-rl / full-logits "
        "| lit-rl s | full-logits s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in points:
        lit, full = p.peaks["lit-rl logits-free"], p.peaks["full-logits"]
        lines.append(
            f"| {p.vocab:,} | {p.length} | {bpu.mib(lit['reference'])} | {bpu.mib(p.predicted['reference'])} "
            f"| {p.error('reference'):+.1f} | {bpu.mib(lit['update'])} | {bpu.mib(p.predicted['update'])} "
            f"| {p.error('update'):+.1f} | {bpu.mib(full['reference'])} | {bpu.mib(full['update'])} "
            f"| {p.peak('lit-rl logits-free') / p.peak('full-logits'):.3f} | {p.seconds['lit-rl logits-free']:.1f} "
            f"| {p.seconds['full-logits']:.1f} |"
        )
    return lines


def describe(cfg: SweepConfig) -> str:
    s = cfg.shape
    return (
        f"Qwen2-shaped random model: hidden {s.hidden}, intermediate {s.intermediate}, {s.heads} heads / {s.kv_heads} "
        f"KV heads, {s.layers} layers, tied embeddings, {s.dtype}, LoRA r16 all-linear; {s.num_prompts} prompts x "
        f"{s.num_generations} completions, prompt {s.prompt_len} tokens (left-padded); vocabulary sweep "
        f"{', '.join(f'{v:,}' for v in cfg.vocabs)} at {cfg.base_length} completion tokens; length sweep "
        f"{', '.join(map(str, cfg.lengths))} at vocabulary {cfg.base_vocab:,}; device {cfg.device}, {cfg.precision}."
    )
