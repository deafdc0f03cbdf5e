"""Policy-update memory benchmark: logits-free lit-rl against full-logits code, for GRPO and Intuitor.

Measures whether the logits still set the peak of a policy update, with
:class:`lit_rl.memory.tracker.TensorMemoryTracker` (exact bytes held by CPU tensors, resident weights included;
no allocator caching or fragmentation):

(A) Peak tensor memory of ONE policy update (forward + GRPO loss + backward; no optimizer
    step) of a Qwen2-shaped model (Qwen2.5-0.5B's hidden size, heads, MLP width and tied embeddings,
    fewer layers so that it runs on a CPU) at vocab 32,000 and 151,936, same tokens, in two settings:

    - ``frozen-head``: LM head and embeddings frozen, trunk trained (what LoRA training looks like
      to the vocabulary: no ``[V, H]`` gradient);
    - ``full-ft``: everything trained, so the tied ``[V, H]`` weight gets a float32 gradient that
      no implementation can avoid; it is reported in its own column.

    Implementations: ``lit-rl logits-free`` (trunk hidden states -> ``lit_rl.ops.token_stats``
    through :meth:`lit_rl.methods.RefCachedGRPO.completion_stats` -> ``grpo_loss``) and
    ``full-logits`` (``model(...).logits.float() -> log_softmax -> gather -> grpo_loss``, TRL-style,
    with ``logits_to_keep`` so only completion positions get logits: the fairest form of it).

(B) Intuitor. ``lit-rl Intuitor``: a no-grad reference pass (log-probs), a no-grad policy
    pass giving old log-probs and self-certainty together (``token_stats(..., self_certainty=True)``,
    as ``Intuitor.score_rollout`` does), self-certainty as the reward, then the GRPO update.
    ``lit-rl RefCachedGRPO``: the no-grad reference pass, then the same update. ``full-logits
    Intuitor`` (the way open-r1 / verl Intuitor code does it): a full-logits no-grad reference pass,
    then an update whose ``[B, C, V]`` float32 logits carry gradient and give both the log-probs and
    the self-certainty (``logsumexp - mean``). Setting ``frozen-head``, vocab 151,936.

Definitions printed with the tables:

- ``resident``: bytes of the parameters when the measurement starts (no gradients yet).
- ``total peak``: highest bytes held by tensors during the phase, resident weights included.
- ``above resident``: ``total peak - resident``: what the update allocates (activations, logits,
  temporaries, gradients). The weights are the same for every implementation and grow with the
  vocabulary (the tied ``[V, H]`` embedding), so "the logits no longer set the peak" is judged on
  this number; total-peak ratios are printed beside it.

The reference passes use the policy's own weights under ``no_grad`` in eval mode, which is what the
LoRA reference (adapters disabled) costs; a full fine-tuning run would hold a frozen copy as well,
the same resident bytes for every method compared here.

(S) ``--point``: one point of the vocabulary and length sweeps (``bench/sweeps.py`` runs one fresh process per
    point): LoRA r16 on all linear layers (``LoraSettings()``), the no-grad ``reference`` pass and the ``update``
    under one measurement, for both implementations, with ``estimate_step``'s first-step prediction for
    ``RefCachedGRPO`` at the same shapes beside them; on CUDA the allocator's ``max_memory_allocated`` per phase.
    Printed as one JSON line after ``POINT``.

Run (prints markdown tables; about 5 minutes on 2 CPU cores; ``--out`` also writes them as a results file)::

    python bench/bench_policy_update.py --out bench/results/policy_update.md
    python bench/bench_policy_update.py --quick           # smoke test, seconds; targets not meaningful
    python bench/bench_policy_update.py --point --vocabs 32000 --completion-len 128
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import harness
import torch

# runnable from a checkout without `pip install -e .`
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config

from lit_rl.losses import LossSettings, group_advantages, grpo_loss, masked_mean
from lit_rl.memory import TensorMemoryTracker, estimate_step
from lit_rl.methods import RefCachedGRPO
from lit_rl.models import LoraSettings, apply_lora, lm_head
from lit_rl.ops import LOGITS_BUDGET_BYTES, plan_chunks

MIB = 2**20
QWEN_VOCAB = 151_936
LLAMA2_VOCAB = 32_000


@dataclass
class BenchConfig:
    """Model shape, rollout shape and loss settings; every run of one bench uses the same ones."""

    hidden: int = 896  # Qwen2.5-0.5B
    intermediate: int = 4864
    heads: int = 14
    kv_heads: int = 2
    layers: int = 2
    vocabs: tuple[int, ...] = (LLAMA2_VOCAB, QWEN_VOCAB)
    num_prompts: int = 2
    num_generations: int = 4
    prompt_len: int = 32
    completion_len: int = 96
    chunk_size: int | None = None  # None: token_stats' automatic plan (64 MiB float32 logits block)
    temperature: float = 1.0
    beta: float = 0.04  # GRPO; Intuitor uses the same value here so that the configs are the same
    loss_type: str = "dapo"
    seed: int = 0
    dtype: str = "float32"
    parts: tuple[str, ...] = ("A", "B")
    quick: bool = False
    out: Path | None = None  # results file
    point: bool = False  # one sweep point (S) instead of parts A and B
    device: str = "cpu"
    precision: str = "32-true"  # the point's estimate

    @property
    def batch(self) -> int:
        return self.num_prompts * self.num_generations


# --------------------------------------------------------------------------------------- model and data


def model_config(cfg: BenchConfig, vocab: int) -> Qwen2Config:
    """A Qwen2 config of the bench's shape (tied embeddings, as Qwen2.5-0.5B/1.5B/3B)."""
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=max(512, cfg.prompt_len + cfg.completion_len),
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_model(cfg: BenchConfig, vocab: int) -> torch.nn.Module:
    """A random-weight Qwen2-shaped causal LM."""
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(model_config(cfg, vocab), dtype=getattr(torch, cfg.dtype))


def set_trainable(model: torch.nn.Module, setting: str) -> None:
    model.requires_grad_(True)
    if setting == "frozen-head":
        lm_head(model).weight.requires_grad_(False)  # tied: freezes the embedding too
        model.get_input_embeddings().weight.requires_grad_(False)
    elif setting != "full-ft":
        raise ValueError(f"unknown setting {setting!r}; use frozen-head or full-ft")


@dataclass
class Batch:
    """One rollout batch: prompt + completion ids, masks, advantages, a cached reference."""

    input_ids: torch.Tensor  # [B, P + C]
    attention_mask: torch.Tensor  # [B, P + C]
    completion_mask: torch.Tensor  # [B, C]
    advantages: torch.Tensor  # [B]
    ref_logp: torch.Tensor  # [B, C] stand-in for a cached reference pass (part A only)
    prompt_len: int

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len :]  # [B, C]

    @property
    def position_ids(self) -> torch.Tensor:
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P + C], as completion_stats does

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_ids, self.attention_mask, self.completion_mask, self.advantages, self.ref_logp]


def make_batch(cfg: BenchConfig, vocab: int) -> Batch:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    b, p, c = cfg.batch, cfg.prompt_len, cfg.completion_len
    input_ids = torch.randint(3, vocab, (b, p + c), generator=g)  # [B, P + C]
    attention_mask = torch.ones(b, p + c, dtype=torch.long)  # [B, P + C]
    pad = torch.randint(0, p // 4 + 1, (b,), generator=g)  # left padding of the prompts
    for i, n in enumerate(pad.tolist()):
        attention_mask[i, :n] = 0
        input_ids[i, :n] = 0
    lengths = torch.randint(c // 2, c + 1, (b,), generator=g)  # completions end at EOS or at the limit
    completion_mask = (torch.arange(c)[None, :] < lengths[:, None]).long()  # [B, C]
    advantages = torch.randn(b, generator=g)  # [B]
    ref_logp = -torch.rand(b, c, generator=g) * 5  # [B, C]
    return Batch(input_ids, attention_mask, completion_mask, advantages, ref_logp, p)


# --------------------------------------------------------------------------------------- the computations

# RefCachedGRPO.completion_stats is the code path the GRPO-family methods use (trunk -> token_stats); its
# __init__ loads nothing, so a bare instance gives us exactly that code.
_METHOD = RefCachedGRPO(name_or_path="bench")


def logits_free_stats(model, batch: Batch, cfg: BenchConfig, **kw):
    return _METHOD.completion_stats(
        model,
        batch.input_ids,
        batch.attention_mask,
        batch.prompt_len,
        temperature=cfg.temperature,
        chunk_size=cfg.chunk_size,
        **kw,
    )


def full_logits(model, batch: Batch, cfg: BenchConfig) -> torch.Tensor:
    """TRL-style ``[B, C, V]`` float32 logits of the completion positions (``logits_to_keep = C + 1``)."""
    c = cfg.completion_len
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=c + 1,
        use_cache=False,
    )
    logits = out.logits.float()[:, :-1]  # [B, C, V]; .float() is a no-op for float32 weights
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature  # [B, C, V]
    return logits


def full_logits_logp(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)  # [B, C]


def loss_of(logp: torch.Tensor, batch: Batch, cfg: BenchConfig, ref_logp=None, advantages=None) -> torch.Tensor:
    loss, _ = grpo_loss(
        logp,
        None,  # num_iterations = 1: on-policy
        batch.ref_logp if ref_logp is None else ref_logp,
        batch.advantages if advantages is None else advantages,
        batch.completion_mask,
        loss_type=cfg.loss_type,
        beta=cfg.beta,
        max_completion_length=cfg.completion_len,
    )
    return loss


def update_logits_free(model, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    """lit-rl's policy update (RefCachedGRPO.policy_loss): log-probs and entropy from one chunked pass."""
    model.train()
    stats = logits_free_stats(model, batch, cfg, entropy=True)
    loss_of(stats.logp, batch, cfg, state.get("ref_logp"), state.get("advantages")).backward()


def update_full_logits(model, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    model.train()
    logp = full_logits_logp(full_logits(model, batch, cfg), batch.targets)  # [B, C]
    loss_of(logp, batch, cfg, state.get("ref_logp"), state.get("advantages")).backward()


def reference_logits_free(model, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    """The cached reference pass: no grad, eval mode, only ``[B, C]`` log-probs kept."""
    model.eval()
    with torch.no_grad():
        state["ref_logp"] = logits_free_stats(model, batch, cfg, entropy=False).logp  # [B, C]
    model.train()


def reference_full_logits(model, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    model.eval()
    with torch.no_grad():
        state["ref_logp"] = full_logits_logp(full_logits(model, batch, cfg), batch.targets)  # [B, C]
    model.train()


def intuitor_scoring(model, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    """Intuitor.score_rollout: the reference pass, then old log-probs and self-certainty from one no-grad pass."""
    reference_logits_free(model, batch, cfg, state)
    model.eval()
    with torch.no_grad():
        stats = logits_free_stats(model, batch, cfg, entropy=False, self_certainty=True)
        certainty = masked_mean(stats.self_certainty, batch.completion_mask, dim=1)  # [B]
        state["advantages"] = group_advantages(certainty, cfg.num_generations)  # [B]
        state["old_logp"] = stats.logp  # [B, C], kept as with num_iterations > 1
    model.train()


def update_full_logits_intuitor(model, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    """Reference-code Intuitor: self-certainty and log-probs from the same grad-carrying ``[B, C, V]`` logits."""
    model.train()
    logits = full_logits(model, batch, cfg)  # [B, C, V] with grad
    v = logits.shape[-1]
    certainty_tok = logits.logsumexp(-1) - logits.mean(-1) - math.log(v)  # [B, C]
    logp = full_logits_logp(logits, batch.targets)  # [B, C]
    certainty = masked_mean(certainty_tok.detach(), batch.completion_mask, dim=1)  # [B]
    advantages = group_advantages(certainty, cfg.num_generations)  # [B]
    loss_of(logp, batch, cfg, state.get("ref_logp"), advantages).backward()


# --------------------------------------------------------------------------------------- measuring


@dataclass
class Measurement:
    resident: int  # parameter bytes at the start
    phases: dict[str, int]  # phase -> total peak bytes
    grads_at_peak: dict[str, int]  # phase -> bytes filed as gradients at that peak
    vocab_grad: int  # bytes of the [V, H] weight's gradient after the run (0 when frozen)
    seconds: float

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    def above(self, phase: str | None = None) -> int:
        return (self.peak if phase is None else self.phases[phase]) - self.resident


def measure(model, batch: Batch, phases: list[tuple[str, Callable]], cfg: BenchConfig) -> Measurement:
    """Run ``phases`` in order under one tracker; each phase's peak window starts where the last ended."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    state: dict = {}
    peaks, grads = {}, {}
    start = time.perf_counter()
    tracker = TensorMemoryTracker(device_type="cpu")
    with tracker:
        tracker.track(model)
        resident = tracker.current_bytes
        tracker.track(batch.tensors(), category="other")  # a few KiB of rollout data
        for name, fn in phases:
            tracker.reset_peak()
            fn(model, batch, cfg, state)
            peaks[name] = tracker.peak_bytes
            grads[name] = tracker.peak_by_category()["gradients"]
    tracker.close()
    w = lm_head(model).weight
    vocab_grad = w.grad.untyped_storage().nbytes() if w.grad is not None else 0
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return Measurement(resident, peaks, grads, vocab_grad, seconds)


def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:,.1f}"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------- parts


def part_a(cfg: BenchConfig) -> tuple[list[str], list[tuple]]:
    rows: dict[tuple[str, int, str], Measurement] = {}
    for vocab in cfg.vocabs:
        model = build_model(cfg, vocab)
        batch = make_batch(cfg, vocab)
        for setting in ("frozen-head", "full-ft"):
            set_trainable(model, setting)
            for impl, fn in (("lit-rl logits-free", update_logits_free), ("full-logits", update_full_logits)):
                m = measure(model, batch, [("update", fn)], cfg)
                rows[(setting, vocab, impl)] = m
                log(f"A {setting} V={vocab} {impl}: peak {mib(m.peak)} MiB in {m.seconds:.1f}s")
        del model, batch

    lines = [
        "| setting | vocab | implementation | resident MiB | total peak MiB | above resident MiB "
        "| grads at peak MiB | [V,H] grad MiB | above resident − [V,H] grad MiB | ratio (above resident) "
        "| ratio (total) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (setting, vocab, impl), m in rows.items():
        ref = rows[(setting, vocab, "full-logits")]
        lines.append(
            f"| {setting} | {vocab:,} | {impl} | {mib(m.resident)} | {mib(m.peak)} | {mib(m.above())} "
            f"| {mib(m.grads_at_peak['update'])} | {mib(m.vocab_grad)} | {mib(m.above() - m.vocab_grad)} "
            f"| {m.above() / ref.above():.3f} | {m.peak / ref.peak:.3f} |"
        )
    lines.append("")
    lines.append(
        "ratio = this row / full-logits at the same setting and vocab. grads at peak: bytes of finished "
        "`.grad` tensors at the moment of the peak; [V,H] grad: the tied embedding / LM-head weight's "
        "gradient after the update (the part no implementation can avoid in full fine-tuning)."
    )

    lo, hi = min(cfg.vocabs), max(cfg.vocabs)
    free_lo, free_hi = rows[("frozen-head", lo, "lit-rl logits-free")], rows[("frozen-head", hi, "lit-rl logits-free")]
    full_hi = rows[("frozen-head", hi, "full-logits")]
    targets = [
        (
            f"A1 logits-free, frozen-head: above-resident peak at V={hi:,} / at V={lo:,}",
            free_hi.above() / free_lo.above(),
            "≤ 1.10",
            free_hi.above() / free_lo.above() <= 1.10,
        ),
        (
            "A1' (same, total peak incl. the [V,H] weight; informational)",
            free_hi.peak / free_lo.peak,
            "—",
            None,
        ),
        (
            f"A2 logits-free / full-logits at V={hi:,}, frozen-head, above resident",
            free_hi.above() / full_hi.above(),
            "≤ 0.5",
            free_hi.above() / full_hi.above() <= 0.5,
        ),
        (
            f"A2' logits-free / full-logits at V={hi:,}, frozen-head, total peak",
            free_hi.peak / full_hi.peak,
            "≤ 0.5",
            free_hi.peak / full_hi.peak <= 0.5,
        ),
    ]
    return lines, targets


def part_b(cfg: BenchConfig) -> tuple[list[str], list[tuple]]:
    vocab = max(cfg.vocabs)
    model = build_model(cfg, vocab)
    batch = make_batch(cfg, vocab)
    set_trainable(model, "frozen-head")
    runs = {
        "lit-rl RefCachedGRPO": [("scoring", reference_logits_free), ("update", update_logits_free)],
        "lit-rl Intuitor": [("scoring", intuitor_scoring), ("update", update_logits_free)],
        "full-logits Intuitor": [("scoring", reference_full_logits), ("update", update_full_logits_intuitor)],
    }
    res: dict[str, Measurement] = {}
    for name, phases in runs.items():
        res[name] = m = measure(model, batch, phases, cfg)
        peaks = ", ".join(f"{k} {mib(v)}" for k, v in m.phases.items())
        log(f"B {name}: peak MiB {peaks} in {m.seconds:.1f}s")
    del model, batch

    grpo, intu, full = res["lit-rl RefCachedGRPO"], res["lit-rl Intuitor"], res["full-logits Intuitor"]
    lines = [
        "| method | no-grad passes | resident MiB | scoring peak MiB | update peak MiB | update above resident MiB "
        "| step peak (scoring + update) MiB | step above resident MiB | ratio vs RefCachedGRPO (step, total) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    passes = {
        "lit-rl RefCachedGRPO": "reference log-probs (chunked)",
        "lit-rl Intuitor": "reference log-probs; old log-probs + self-certainty (one chunked pass)",
        "full-logits Intuitor": "reference log-probs (full logits); self-certainty from the update's logits",
    }
    for name, m in res.items():
        lines.append(
            f"| {name} | {passes[name]} | {mib(m.resident)} | {mib(m.phases['scoring'])} | {mib(m.phases['update'])} "
            f"| {mib(m.above('update'))} | {mib(m.peak)} | {mib(m.above())} | {m.peak / grpo.peak:.3f} |"
        )
    targets = [
        (
            "B1 lit-rl Intuitor / RefCachedGRPO, step peak (scoring + update), total",
            intu.peak / grpo.peak,
            "≤ 1.05",
            intu.peak / grpo.peak <= 1.05,
        ),
        (
            "B1' same, above resident",
            intu.above() / grpo.above(),
            "≤ 1.05",
            intu.above() / grpo.above() <= 1.05,
        ),
        (
            f"B2 full-logits Intuitor / lit-rl Intuitor, update phase, total peak, V={vocab:,}",
            full.phases["update"] / intu.phases["update"],
            "≥ 4",
            full.phases["update"] / intu.phases["update"] >= 4,
        ),
        (
            f"B2' same, update phase above resident, V={vocab:,}",
            full.above("update") / intu.above("update"),
            "≥ 4",
            full.above("update") / intu.above("update") >= 4,
        ),
    ]
    return lines, targets


# --------------------------------------------------------------------------------------- one sweep point

POINT_MARK = "POINT "
IMPLEMENTATIONS = {
    "lit-rl logits-free": (reference_logits_free, update_logits_free),
    "full-logits": (reference_full_logits, update_full_logits),
}


def measure_cuda(model, batch: Batch, phases: list[tuple[str, Callable]], cfg: BenchConfig):
    """:func:`measure` on CUDA: ``(resident, {phase: the allocator's peak}, seconds)``."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    state: dict = {}
    peaks = {}
    start = time.perf_counter()
    resident = torch.cuda.memory_allocated()
    for name, fn in phases:
        torch.cuda.reset_peak_memory_stats()
        fn(model, batch, cfg, state)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return resident, peaks, seconds


def predict(cfg: BenchConfig, vocab: int) -> dict[str, int]:
    """``estimate_step``'s first-step peaks (no optimizer state yet, as measured) for the reference pass and the
    update (``max(policy_forward, backward)``) of ``RefCachedGRPO`` at this point's shapes."""
    method = RefCachedGRPO(
        name_or_path="bench", lora=LoraSettings(), num_generations=cfg.num_generations,
        max_new_tokens=cfg.completion_len, min_new_tokens=cfg.completion_len,
        loss=LossSettings(beta=cfg.beta, loss_type=cfg.loss_type), temperature=cfg.temperature, share_prompt=False,
    )  # fmt: skip
    est = estimate_step(
        method, batch_size=cfg.num_prompts, prompt_length=cfg.prompt_len, model_config=model_config(cfg, vocab),
        precision=cfg.precision, padded=True, device_type=cfg.device,
    )  # fmt: skip
    first = est.first_step
    return {"reference": first["reference"], "update": max(first["policy_forward"], first["backward"])}


def point(cfg: BenchConfig) -> dict:
    """Part S: one (vocabulary, completion length) point, measured for both implementations and predicted."""
    vocab = cfg.vocabs[0]
    model = apply_lora(build_model(cfg, vocab), LoraSettings())
    batch = make_batch(cfg, vocab)
    if cfg.device == "cuda":
        model = model.to("cuda")
        batch = Batch(*(t.to("cuda") for t in batch.tensors()), batch.prompt_len)
    shape = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "out"}  # JSON-able settings
    result = {"vocab": vocab, "length": cfg.completion_len, "peaks": {}, "seconds": {}, "config": shape,
              "device_name": torch.cuda.get_device_name(0) if cfg.device == "cuda" else "CPU"}  # fmt: skip
    for impl, (reference, update) in IMPLEMENTATIONS.items():
        phases = [("reference", reference), ("update", update)]
        if cfg.device == "cuda":
            resident, peaks, seconds = measure_cuda(model, batch, phases, cfg)
        else:
            m = measure(model, batch, phases, cfg)
            resident, peaks, seconds = m.resident, m.phases, m.seconds
        result["resident"], result["peaks"][impl], result["seconds"][impl] = resident, peaks, seconds
        log(f"  V={vocab:,} C={cfg.completion_len} {impl}: peak {mib(max(peaks.values()))} MiB, {seconds:.1f} s")
    del model, batch
    gc.collect()
    result["predicted"] = predict(cfg, vocab)
    return result


# --------------------------------------------------------------------------------------- main


def describe(cfg: BenchConfig) -> list[str]:
    n_tok = cfg.batch * cfg.completion_len
    plans = []
    for v in cfg.vocabs:
        tc, vc = plan_chunks(n_tok, v, cfg.hidden, cfg.chunk_size, None, LOGITS_BUDGET_BYTES)
        plans.append(f"V={v:,}: {tc} tokens x {vc:,} vocab rows ({tc * vc * 4 / MIB:.1f} MiB float32 block)")
    chunk = "auto (64 MiB float32 logits-block budget)" if cfg.chunk_size is None else f"{cfg.chunk_size} tokens"
    return [
        f"- model: Qwen2-shaped, random weights, hidden H={cfg.hidden}, intermediate {cfg.intermediate}, "
        f"{cfg.heads} heads / {cfg.kv_heads} KV heads, {cfg.layers} layers, tied embeddings, {cfg.dtype}, "
        "sdpa attention",
        f"- vocab V: {', '.join(f'{v:,}' for v in cfg.vocabs)}",
        f"- batch: B={cfg.batch} completions ({cfg.num_prompts} prompts x {cfg.num_generations} generations), "
        f"prompt P={cfg.prompt_len} (left-padded), completion C={cfg.completion_len} "
        f"(T = P + C = {cfg.prompt_len + cfg.completion_len}); {n_tok} scored tokens; completion masks of "
        f"random length in [C/2, C]",
        f"- loss: grpo_loss loss_type={cfg.loss_type}, beta={cfg.beta}, epsilon 0.2/0.2, on-policy "
        f"(num_iterations=1), temperature={cfg.temperature}",
        f"- token_stats chunking: chunk_size={chunk}; plan: " + "; ".join(plans),
        f"- seed: torch.manual_seed({cfg.seed}); torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.machine()}",
        "- memory: TensorMemoryTracker(device_type='cpu'), exact bytes of live tensor storages",
    ]


def targets_table(targets: list[tuple]) -> list[str]:
    lines = ["| target | value | required | met |", "| --- | ---: | ---: | --- |"]
    for name, value, required, ok in targets:
        met = "—" if ok is None else ("yes" if ok else "**no**")
        lines.append(f"| {name} | {value:.3f} | {required} | {met} |")
    return lines


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes: a smoke test of every part (targets not meaningful)"
    )
    p.add_argument("--parts", default="AB", help="which parts to run: A (one policy update), B (Intuitor) or AB")
    p.add_argument("--layers", type=int, help="decoder layers (default 2)")
    p.add_argument("--hidden", type=int, help="hidden size (default 896, Qwen2.5-0.5B)")
    p.add_argument("--vocabs", type=str, help="comma-separated vocab sizes (default 32000,151936)")
    p.add_argument("--num-prompts", type=int, help="prompts per batch (default 2)")
    p.add_argument("--num-generations", type=int, help="completions per prompt (default 4)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens P (default 32)")
    p.add_argument("--completion-len", type=int, help="completion tokens C (default 96)")
    p.add_argument("--chunk-size", type=int, help="token_stats tokens per block (default: automatic plan)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--point", action="store_true", help="one sweep point at the first of --vocabs and --completion-len, as JSON"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="weights' dtype (default float32)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="--point: where it runs (default cpu)")
    p.add_argument("--precision", default="32-true", help="--point: the estimate's trainer.precision")
    p.add_argument("--out", type=Path, help="also write the tables to this results file, with its header")
    a = p.parse_args(argv)
    cfg = BenchConfig(seed=a.seed, quick=a.quick, parts=tuple(a.parts.upper()), point=a.point, device=a.device,
                      precision=a.precision, dtype=a.dtype or "float32")  # fmt: skip
    if a.quick:
        cfg.hidden, cfg.intermediate, cfg.heads, cfg.kv_heads, cfg.layers = 64, 128, 4, 2, 1
        cfg.vocabs = (512, 2048)
        cfg.prompt_len, cfg.completion_len = 8, 16
    for name in ("layers", "hidden", "num_prompts", "num_generations", "prompt_len", "completion_len", "chunk_size"):
        if getattr(a, name) is not None:
            setattr(cfg, name, getattr(a, name))
    if a.hidden is not None:
        cfg.intermediate = a.hidden * cfg.intermediate // 896 if not a.quick else 2 * a.hidden
    if a.vocabs:
        cfg.vocabs = tuple(sorted(int(v) for v in a.vocabs.split(",")))
    if len(cfg.vocabs) < 2 and "A" in cfg.parts and not cfg.point:
        p.error("part A compares two vocab sizes: pass --vocabs V1,V2")
    if not set(cfg.parts) <= {"A", "B"}:
        p.error(f"--parts takes A, B or AB, got {a.parts!r}")
    cfg.out = a.out
    return cfg


def main(argv: list[str] | None = None) -> str:
    """Run the bench, print the markdown and return it."""
    cfg = parse_args(argv)
    # the imports leave a large heap; frozen, it is skipped by the gc.collect() before each measurement
    gc.collect()
    gc.freeze()
    try:
        if cfg.point:
            result = point(cfg)
            harness.report(POINT_MARK, result)
            return json.dumps(result)
        argv = sys.argv[1:] if argv is None else argv
        loads = [harness.load_average()]
        text = run(cfg, "python bench/bench_policy_update.py " + shlex.join(argv))
        loads.append(harness.load_average())
    finally:
        gc.unfreeze()
    print(text)
    if cfg.out is not None:
        header = harness.header_lines(
            "Policy-update memory: logits-free lit-rl vs full-logits (GRPO and Intuitor)",
            "python bench/bench_policy_update.py --out bench/results/policy_update.md",
            this_file=shlex.join(["python", "bench/bench_policy_update.py", *argv]),
            loads=loads,
            threads=torch.get_num_threads(),
            dists=("torch", "transformers"),
        )
        body = text.split("\n", 2)[2]  # without its Command line: the header has it
        cfg.out.write_text("\n".join([*header, *COMPARED, body]) + "\n")
        log(f"wrote {cfg.out}")
    return text


COMPARED = [
    "Exact bytes held by CPU tensors (`TensorMemoryTracker`), resident weights included; no allocator caching. "
    "**total peak** is the highest tensor bytes during the phase, weights included; **above resident** is total peak "
    "minus the parameter bytes at the start, i.e. what the update itself allocates (activations, logits or logits "
    "blocks, temporaries, gradients). The weights are the same for both implementations but grow with V (the tied "
    '`[V, H]` embedding), so "the logits no longer set the peak" (A1) is judged above resident; both ratios are '
    "printed for A2 and B. The full-logits reference is the generous form: `logits_to_keep = C + 1`, temperature 1 "
    "(no extra `[B, C, V]` copy), float32 weights (`.float()` is a no-op).",
    "",
]


def run(cfg: BenchConfig, cmd: str) -> str:
    torch.manual_seed(cfg.seed)
    out = [f"Command: `{cmd.strip()}`", "", "Configuration:", "", *describe(cfg), ""]
    targets: list[tuple] = []
    start = time.perf_counter()
    if "A" in cfg.parts:
        lines, t = part_a(cfg)
        out += ["### A. One policy update", "", *lines, ""]
        targets += t
    if "B" in cfg.parts:
        lines, t = part_b(cfg)
        out += [f"### B. Intuitor vs RefCachedGRPO vs full-logits Intuitor, frozen-head, V={max(cfg.vocabs):,}"]
        out += ["", *lines, ""]
        targets += t
    note = " (quick sizes: not meaningful)" if cfg.quick else ""
    out += [f"### Targets{note}", "", *targets_table(targets), ""]
    out.append(f"Total bench time: {time.perf_counter() - start:.0f} s")
    return "\n".join(out)


if __name__ == "__main__":
    main()
