"""Policy-update memory benchmark: logits-free lit-rl against full-logits code, for GRPO and Intuitor.

Measures whether the logits still set the peak of a policy update, with ``lit_rl.memory.TensorMemoryTracker`` (exact
bytes held by CPU tensors, resident weights included; no allocator caching or fragmentation), on a Qwen2-shaped random
model (Qwen2.5-0.5B's hidden size, heads, MLP width and tied embeddings, fewer layers so that it runs on a CPU):

(A) ONE policy update (forward + GRPO loss + backward; no optimizer step) at vocab 32,000 and 151,936, same tokens,
    ``frozen-head`` (LM head and embeddings frozen, trunk trained: what LoRA training looks like to the vocabulary)
    and ``full-ft`` (everything trained, so the tied ``[V, H]`` weight gets a float32 gradient that no implementation
    can avoid; it has its own column). ``lit-rl logits-free``: trunk hidden states -> ``lit_rl.ops.token_stats``
    through ``RefCachedGRPO.completion_stats`` -> ``grpo_loss``; ``full-logits``: ``model(...).logits.float() ->
    log_softmax -> gather -> grpo_loss``, TRL-style, with ``logits_to_keep`` (the fairest form of it).

(B) Intuitor, ``frozen-head``, vocab 151,936. ``lit-rl Intuitor``: a no-grad reference pass, a no-grad policy pass
    giving old log-probs and self-certainty together (``token_stats(..., self_certainty=True)``, as
    ``Intuitor.score_rollout`` does), self-certainty as the reward, then the GRPO update. ``lit-rl RefCachedGRPO``:
    the reference pass, then the same update. ``full-logits Intuitor`` (as open-r1 / verl Intuitor code does it): a
    full-logits reference pass, then an update whose grad-carrying ``[B, C, V]`` float32 logits give both the
    log-probs and the self-certainty (``logsumexp - mean``).

``above resident`` (total peak minus the parameter bytes at the start) is what the update allocates: the weights are
the same for every implementation but grow with the vocabulary, so "the logits no longer set the peak" is judged on
it, total-peak ratios beside it. The reference passes use the policy's own weights under ``no_grad`` in eval mode,
what the LoRA reference (adapters disabled) costs; a full fine-tuning run's frozen copy would add the same resident
bytes to every method.

(S) ``--point``: one point of the vocabulary and length sweeps (``bench/sweeps.py``, whose docstring says what a point
    measures, runs one fresh process per point), printed as one JSON line after ``POINT``.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import harness
import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config

from lit_rl.losses import LossSettings, group_advantages, grpo_loss, masked_mean
from lit_rl.memory import TensorMemoryTracker, estimate_step
from lit_rl.methods import RefCachedGRPO
from lit_rl.models import LoraSettings, apply_lora, lm_head
from lit_rl.ops import LOGITS_BUDGET_BYTES, plan_chunks

MIB = 2**20
POINT_MARK = "POINT "


@dataclass
class BenchConfig:
    """Model shape, rollout shape and loss settings; every run of one bench uses the same ones."""

    hidden: int = 896  # Qwen2.5-0.5B
    intermediate: int = 4864
    heads: int = 14
    kv_heads: int = 2
    layers: int = 2
    vocabs: tuple[int, ...] = (32_000, 151_936)  # Llama 2's, Qwen2.5's
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


@dataclass
class Batch:
    """One rollout batch: prompt + completion ids, masks, advantages, a cached reference."""

    input_ids: torch.Tensor  # [B, P + C]
    attention_mask: torch.Tensor  # [B, P + C]
    completion_mask: torch.Tensor  # [B, C]
    advantages: torch.Tensor  # [B]
    ref_logp: torch.Tensor  # [B, C] stand-in for a cached reference pass (part A only)
    prompt_len: int

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
# Each phase is ``fn(model, batch, cfg, state)``; ``state`` carries a reference pass's log-probs (else the batch's
# stand-in) and Intuitor's advantages (else the batch's) to the update.

# RefCachedGRPO.completion_stats is the code path the GRPO-family methods use (trunk -> token_stats); its
# __init__ loads nothing, so a bare instance gives us exactly that code.
_METHOD = RefCachedGRPO(name_or_path="bench")


def logits_free_stats(model, batch: Batch, cfg: BenchConfig, **kw):
    kw.update(temperature=cfg.temperature, chunk_size=cfg.chunk_size)
    return _METHOD.completion_stats(model, batch.input_ids, batch.attention_mask, batch.prompt_len, **kw)


def full_logits(model, batch: Batch, cfg: BenchConfig) -> torch.Tensor:
    """TRL-style ``[B, C, V]`` float32 logits of the completion positions (``logits_to_keep = C + 1``)."""
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P + C], as completion_stats does
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=position_ids,
        logits_to_keep=cfg.completion_len + 1,
        use_cache=False,
    )
    logits = out.logits.float()[:, :-1]  # [B, C, V]; .float() is a no-op for float32 weights
    return logits / cfg.temperature if cfg.temperature != 1.0 else logits  # [B, C, V]


def full_logits_logp(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    targets = batch.input_ids[:, batch.prompt_len :]  # [B, C]
    return logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)  # [B, C]


def backward(logp: torch.Tensor, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    """The GRPO loss of ``logp``, backward; on-policy (``num_iterations = 1``: no old log-probs)."""
    ref_logp = state.get("ref_logp", batch.ref_logp)
    advantages = state.get("advantages", batch.advantages)
    settings = {"loss_type": cfg.loss_type, "beta": cfg.beta, "max_completion_length": cfg.completion_len}
    grpo_loss(logp, None, ref_logp, advantages, batch.completion_mask, **settings)[0].backward()


@contextmanager
def evaluating(model) -> Iterator[None]:
    """A no-grad pass in eval mode, the model back in train mode after it."""
    model.eval()
    with torch.no_grad():
        yield
    model.train()


def update_logits_free(model, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    """lit-rl's policy update (RefCachedGRPO.policy_loss): log-probs and entropy from one chunked pass."""
    model.train()
    backward(logits_free_stats(model, batch, cfg, entropy=True).logp, batch, cfg, state)


def update_full_logits(model, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    model.train()
    backward(full_logits_logp(full_logits(model, batch, cfg), batch), batch, cfg, state)


def reference_logits_free(model, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    """The cached reference pass: no grad, eval mode, only ``[B, C]`` log-probs kept."""
    with evaluating(model):
        state["ref_logp"] = logits_free_stats(model, batch, cfg, entropy=False).logp  # [B, C]


def reference_full_logits(model, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    with evaluating(model):
        state["ref_logp"] = full_logits_logp(full_logits(model, batch, cfg), batch)  # [B, C]


def intuitor_scoring(model, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    """Intuitor.score_rollout: the reference pass, then old log-probs and self-certainty from one no-grad pass."""
    reference_logits_free(model, batch, cfg, state)
    with evaluating(model):
        stats = logits_free_stats(model, batch, cfg, entropy=False, self_certainty=True)
        certainty = masked_mean(stats.self_certainty, batch.completion_mask, dim=1)  # [B]
        state["advantages"] = group_advantages(certainty, cfg.num_generations)  # [B]
        state["old_logp"] = stats.logp  # [B, C], kept as with num_iterations > 1


def update_full_logits_intuitor(model, batch: Batch, cfg: BenchConfig, state: dict) -> None:
    """Reference-code Intuitor: self-certainty and log-probs from the same grad-carrying ``[B, C, V]`` logits."""
    model.train()
    logits = full_logits(model, batch, cfg)  # [B, C, V] with grad
    certainty_tok = logits.logsumexp(-1) - logits.mean(-1) - math.log(logits.shape[-1])  # [B, C]
    certainty = masked_mean(certainty_tok.detach(), batch.completion_mask, dim=1)  # [B]
    state["advantages"] = group_advantages(certainty, cfg.num_generations)  # [B]
    backward(full_logits_logp(logits, batch), batch, cfg, state)


IMPLEMENTATIONS = {  # name: (its reference pass, its update)
    "lit-rl logits-free": (reference_logits_free, update_logits_free),
    "full-logits": (reference_full_logits, update_full_logits),
}


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
    """Run ``phases`` in order under one measurement; each phase's peak window starts where the last ended. On CPU a
    tracker's exact tensor bytes (and the gradients' share at each peak); on CUDA the allocator's
    ``max_memory_allocated``."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    state, peaks, grads = {}, {}, {}
    if cfg.device == "cuda":
        torch.cuda.synchronize()  # before the clock starts: nothing queued earlier is timed
    start = time.perf_counter()
    if cfg.device == "cuda":
        resident = torch.cuda.memory_allocated()
        for name, fn in phases:
            torch.cuda.reset_peak_memory_stats()
            fn(model, batch, cfg, state)
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated()
    else:
        with TensorMemoryTracker(device_type="cpu") as tracker:
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


def judged(value: float, required: str) -> str:
    """A target's verdict: ``value`` against ``required`` ("≤ 0.5", "≥ 4"); "—" for an informational row."""
    if required == "—":
        return "—"
    op, bound = required.split()
    return "yes" if (value <= float(bound) if op == "≤" else value >= float(bound)) else "**no**"


# --------------------------------------------------------------------------------------- parts


def part_a(cfg: BenchConfig) -> tuple[list[str], list[tuple]]:
    rows: dict[tuple[str, int, str], Measurement] = {}
    for vocab in cfg.vocabs:
        model, batch = build_model(cfg, vocab), make_batch(cfg, vocab)
        for setting in ("frozen-head", "full-ft"):
            set_trainable(model, setting)
            for impl, (_, fn) in IMPLEMENTATIONS.items():
                rows[(setting, vocab, impl)] = m = measure(model, batch, [("update", fn)], cfg)
                log(f"A {setting} V={vocab} {impl}: peak {mib(m.peak)} MiB in {m.seconds:.1f}s")
        del model, batch

    headers = (
        "setting | vocab | implementation | resident MiB | total peak MiB | above resident MiB | grads at peak MiB "
        "| [V,H] grad MiB | above resident − [V,H] grad MiB | ratio (above resident) | ratio (total)"
    ).split(" | ")
    cells = []
    for (setting, vocab, impl), m in rows.items():
        ref = rows[(setting, vocab, "full-logits")]
        mibs = [m.resident, m.peak, m.above(), m.grads_at_peak["update"], m.vocab_grad, m.above() - m.vocab_grad]
        ratios = [m.above() / ref.above(), m.peak / ref.peak]
        cells.append([setting, f"{vocab:,}", impl, *map(mib, mibs), *(f"{r:.3f}" for r in ratios)])
    lines = harness.markdown_table(headers, cells, ["---", "---:", "---", *["---:"] * 8])
    lines += [
        "",
        "ratio = this row / full-logits at the same setting and vocab. grads at peak: bytes of finished "
        "`.grad` tensors at the moment of the peak; [V,H] grad: the tied embedding / LM-head weight's "
        "gradient after the update (the part no implementation can avoid in full fine-tuning).",
    ]

    lo, hi = min(cfg.vocabs), max(cfg.vocabs)
    free_lo, free_hi = rows[("frozen-head", lo, "lit-rl logits-free")], rows[("frozen-head", hi, "lit-rl logits-free")]
    full_hi = rows[("frozen-head", hi, "full-logits")]
    targets = [
        (
            f"A1 logits-free, frozen-head: above-resident peak at V={hi:,} / at V={lo:,}",
            free_hi.above() / free_lo.above(),
            "≤ 1.10",
        ),
        ("A1' (same, total peak incl. the [V,H] weight; informational)", free_hi.peak / free_lo.peak, "—"),
        (
            f"A2 logits-free / full-logits at V={hi:,}, frozen-head, above resident",
            free_hi.above() / full_hi.above(),
            "≤ 0.5",
        ),
        (f"A2' logits-free / full-logits at V={hi:,}, frozen-head, total peak", free_hi.peak / full_hi.peak, "≤ 0.5"),
    ]
    return lines, targets


def part_b(cfg: BenchConfig) -> tuple[list[str], list[tuple]]:
    vocab = max(cfg.vocabs)
    model, batch = build_model(cfg, vocab), make_batch(cfg, vocab)
    set_trainable(model, "frozen-head")
    runs = {
        "lit-rl RefCachedGRPO": [("scoring", reference_logits_free), ("update", update_logits_free)],
        "lit-rl Intuitor": [("scoring", intuitor_scoring), ("update", update_logits_free)],
        "full-logits Intuitor": [("scoring", reference_full_logits), ("update", update_full_logits_intuitor)],
    }
    res: dict[str, Measurement] = {}
    for name, phases in runs.items():
        res[name] = m = measure(model, batch, phases, cfg)
        log(f"B {name}: peak MiB {', '.join(f'{k} {mib(v)}' for k, v in m.phases.items())} in {m.seconds:.1f}s")
    del model, batch

    grpo, intu, full = res["lit-rl RefCachedGRPO"], res["lit-rl Intuitor"], res["full-logits Intuitor"]
    headers = (
        "method | no-grad passes | resident MiB | scoring peak MiB | update peak MiB | update above resident MiB "
        "| step peak (scoring + update) MiB | step above resident MiB | ratio vs RefCachedGRPO (step, total)"
    ).split(" | ")
    passes = {
        "lit-rl RefCachedGRPO": "reference log-probs (chunked)",
        "lit-rl Intuitor": "reference log-probs; old log-probs + self-certainty (one chunked pass)",
        "full-logits Intuitor": "reference log-probs (full logits); self-certainty from the update's logits",
    }
    cells = []
    for name, m in res.items():
        mibs = [m.resident, m.phases["scoring"], m.phases["update"], m.above("update"), m.peak, m.above()]
        cells.append([name, passes[name], *map(mib, mibs), f"{m.peak / grpo.peak:.3f}"])
    targets = [
        ("B1 lit-rl Intuitor / RefCachedGRPO, step peak (scoring + update), total", intu.peak / grpo.peak, "≤ 1.05"),
        ("B1' same, above resident", intu.above() / grpo.above(), "≤ 1.05"),
        (
            f"B2 full-logits Intuitor / lit-rl Intuitor, update phase, total peak, V={vocab:,}",
            full.phases["update"] / intu.phases["update"],
            "≥ 4",
        ),
        (f"B2' same, update phase above resident, V={vocab:,}", full.above("update") / intu.above("update"), "≥ 4"),
    ]
    return harness.markdown_table(headers, cells, ["---", "---", *["---:"] * 7]), targets


# --------------------------------------------------------------------------------------- one sweep point


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
        m = measure(model, batch, [("reference", reference), ("update", update)], cfg)
        result["resident"], result["peaks"][impl], result["seconds"][impl] = m.resident, m.phases, m.seconds
        log(f"  V={vocab:,} C={cfg.completion_len} {impl}: peak {mib(m.peak)} MiB, {m.seconds:.1f} s")
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


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test (targets not meaningful)")
    p.add_argument("--parts", default="AB", help="which parts to run: A (one policy update), B (Intuitor) or AB")
    p.add_argument("--vocabs", type=str, help="comma-separated vocab sizes (default 32000,151936)")
    p.add_argument("--layers", type=int, help="decoder layers (default 2)")
    p.add_argument("--completion-len", type=int, help="completion tokens C (default 96)")
    p.add_argument("--point", action="store_true", help="one sweep point (the first of --vocabs), as JSON")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the weights' dtype")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="--point: where it runs (default cpu)")
    p.add_argument("--precision", default="32-true", help="--point: the estimate's trainer.precision")
    p.add_argument("--out", type=Path, help="also write the tables to this results file, with its header")
    a = p.parse_args(argv)
    cfg = BenchConfig(quick=a.quick, parts=tuple(a.parts.upper()), point=a.point, device=a.device,
                      precision=a.precision, dtype=a.dtype, out=a.out)  # fmt: skip
    if a.quick:
        cfg.hidden, cfg.intermediate, cfg.heads, cfg.kv_heads, cfg.layers = 64, 128, 4, 2, 1
        cfg.vocabs, cfg.prompt_len, cfg.completion_len = (512, 2048), 8, 16
    cfg.layers = a.layers or cfg.layers
    cfg.completion_len = a.completion_len or cfg.completion_len
    if a.vocabs:
        cfg.vocabs = tuple(sorted(int(v) for v in a.vocabs.split(",")))
    if len(cfg.vocabs) < 2 and "A" in cfg.parts and not cfg.point:
        p.error("part A compares two vocab sizes: pass --vocabs V1,V2")
    if not set(cfg.parts) <= {"A", "B"}:
        p.error(f"--parts takes A, B or AB, got {a.parts!r}")
    return cfg


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
        out += [f"### B. Intuitor vs RefCachedGRPO vs full-logits Intuitor, frozen-head, V={max(cfg.vocabs):,}", ""]
        out += [*lines, ""]
        targets += t
    rows = [[name, f"{value:.3f}", required, judged(value, required)] for name, value, required in targets]
    out += [f"### Targets{' (quick sizes: not meaningful)' if cfg.quick else ''}", ""]
    out += [*harness.markdown_table(["target", "value", "required", "met"], rows, ["---", "---:", "---:", "---"]), ""]
    out.append(f"Total bench time: {time.perf_counter() - start:.0f} s")
    return "\n".join(out)


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


if __name__ == "__main__":
    main()
