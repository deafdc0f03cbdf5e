"""GumbelTopK memory: one step's per-phase peak, measured and predicted, legacy vs top-k vs top-k + checkpointing.

The memory-efficient design (top-k Gumbel-softmax, online KL, a KV-cached reference, sparse reward gather,
per-step checkpointing) is expected to peak 3-4x lower than the naive one (dense soft tokens over the full
vocabulary, stored reference logits), and top-256 tokens to keep > 99.9 % of the probability mass. This bench
measures both instead of assuming them.

For each vocabulary (49,152: SmolLM2's; 151,936: Qwen's), completion length and path (``legacy``:
:class:`gumbel_legacy.LegacyGumbelTopK`, the full-vocabulary baseline in ``bench/gumbel_legacy.py``; ``top-k``:
``GumbelTopK`` with ``gumbel_topk: 256``; ``top-k + ckpt``: the same with ``checkpoint_steps: true``), two real
steps run on CPU, the second (the steady state, optimizer state allocated) under the
:class:`~lit_rl.callbacks.MemoryProfiler` (exact tensor accounting), and it is compared with
:func:`~lit_rl.memory.estimate_step` for the same settings. The models are random (nothing is downloaded): a
``LlamaForCausalLM`` policy and a ``LlamaForSequenceClassification`` reward model with the same small
:func:`~lit_rl.models.tiny_config` trunk (hidden 256, 4 layers), saved beside the character-level test tokenizer
so that GumbelTopK loads them by path. Full fine-tuning with ``beta > 0``: the reference is a frozen copy.

Both sides describe the same step: ``eos_ids`` is an id outside the vocabulary, so every rollout has
``max_new_tokens`` tokens, and the estimate gets the measured batch's prompt width and padding. A config whose
*predicted* peak exceeds ``--max-gib`` is not run (its prediction is shown, marked "not measured"), so the legacy
path cannot take the shared machine down.

The top-k mass is ``gumbel/topk_mass`` of the measured steps: a random model's next-token distribution is nearly
uniform, so the full run adds the same quantity for the trained SmolLM2-135M-Instruct (the embedded model, if
installed) sampling with top-256 at temperature 1.

Run (77 minutes for the full grid on 2 cores shared with other jobs; the quick case 2.5-5.5 minutes, depending on
the load; tensor bytes do not depend on it, the wall times do)::

    python bench/bench_gumbel_topk.py              # writes bench/results/gumbel_topk.md and gumbel_topk_peak_vs_length.png
    python bench/bench_gumbel_topk.py --quick      # vocab 49,152, 32 new tokens, the three paths; prints only

``lit_rl`` must be importable (``pip install -e .``); ``gumbel_legacy`` is found beside this script.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import logging
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import harness
import lightning as L
import torch
from gumbel_legacy import LegacyGumbelTopK
from harness import markdown_table
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lit_rl.callbacks import MemoryProfiler
from lit_rl.data import PromptDataModule
from lit_rl.memory import CATEGORIES, estimate_step
from lit_rl.methods import GumbelTopK
from lit_rl.models import tiny_config, tiny_tokenizer

MIB, GIB = 2**20, 2**30

VOCABS = (49_152, 151_936)
TOKENS = (32, 64, 128)
TOPK = 256
# path name -> (class, its settings)
PATHS = {
    "legacy": (LegacyGumbelTopK, {}),
    "top-k": (GumbelTopK, dict(gumbel_topk=TOPK)),
    "top-k + ckpt": (GumbelTopK, dict(gumbel_topk=TOPK, checkpoint_steps=True)),
}
PHASES = ("generate", "reward", "backward", "optimizer")
TRUNK = dict(hidden_size=256, num_layers=4)  # tiny_config: intermediate 2 x hidden, 4 heads, 2 KV heads, tied
BATCH = 2  # prompts per step, 1 generation each
METHOD = dict(num_generations=1, beta=0.05, tau=0.5, hard=True, learning_rate=1e-5)
RESULTS = harness.ROOT / "bench" / "results"


@dataclass
class Case:
    """One (vocabulary, length, path) configuration and what was measured and predicted for it."""

    vocab: int
    tokens: int
    path: str
    predicted: dict[str, int] = field(default_factory=dict)  # steady-state phase -> bytes
    measured: dict[str, int] = field(default_factory=dict)  # step 1 phase -> bytes ({} when not run)
    step_peak: int = 0  # measured step 1 peak
    rss_peak: int = 0  # measured step 1 process peak RSS
    breakdown: dict[str, int] = field(default_factory=dict)  # measured step 1, per category at the step peak
    estimate: object = None
    shapes: list[tuple[int, bool]] = field(default_factory=list)  # per measured step: prompt width, padded
    mass: list[float] = field(default_factory=list)  # gumbel/topk_mass per measured step
    skipped: str = ""

    @property
    def predicted_peak(self) -> int:
        return max(self.predicted.values())

    def at(self, phase: str | None = None) -> tuple[int, int]:
        """(predicted, measured) bytes of one phase, or of the step peak (``None``)."""
        if phase is None:
            return self.predicted_peak, self.step_peak
        return self.predicted.get(phase, 0), self.measured.get(phase, 0)

    def error(self, phase: str | None = None) -> float:
        """(predicted - measured) / measured in %, of one phase or of the step peak."""
        p, m = self.at(phase)
        return 100.0 * (p - m) / m if m else float("nan")


# ------------------------------------------------------------------------------------------------ models and data


def build_models(folder: Path, vocab: int) -> tuple[str, str]:
    """Random policy and reward model of vocabulary ``vocab``, saved with the tokenizer; returns their folders."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    policy_dir, reward_dir = folder / f"policy-{vocab}", folder / f"reward-{vocab}"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama", vocab_size=vocab, **TRUNK)).save_pretrained(policy_dir)
    torch.manual_seed(1)
    reward = LlamaForSequenceClassification(tiny_config("llama", vocab_size=vocab, num_labels=1, **TRUNK))
    reward.save_pretrained(reward_dir)  # pad_token_id = 0 (<pad>) comes with tiny_config
    for path in (policy_dir, reward_dir):
        tiny_tokenizer().save_pretrained(path)
    return str(policy_dir), str(reward_dir)


def datamodule() -> PromptDataModule:
    return PromptDataModule(num_prompts=16, batch_size=BATCH, max_prompt_length=256, seed=0)


def shape(batch: dict[str, torch.Tensor]) -> tuple[int, bool]:
    """A prompt batch's width and whether it is padded."""
    return batch["input_ids"].shape[1], bool((batch["attention_mask"] == 0).any())


def planned_shapes(steps: int = 2) -> list[tuple[int, bool]]:
    """The shapes of the first ``steps`` batches (the sampling stream is seeded, so every run sees these), for the
    estimate of a config that is not run."""
    dm = datamodule()
    dm.connect(tiny_tokenizer())
    dm.setup("fit")
    return [shape(batch) for batch, _ in zip(dm.train_dataloader(), range(steps))]


def method(dirs: tuple[str, str], case: Case) -> GumbelTopK:
    cls, settings = PATHS[case.path]
    return cls(name_or_path=dirs[0], reward_model=dirs[1], max_new_tokens=case.tokens, **METHOD, **settings)


# ------------------------------------------------------------------------------------------------ measure, predict


def predict(case: Case, dirs: tuple[str, str], width: int, padded: bool) -> None:
    module = method(dirs, case)
    case.estimate = estimate_step(module, batch_size=BATCH, prompt_length=width, padded=padded, device_type="cpu")
    case.predicted = dict(case.estimate.phases)


class MeasureFromStep(Callback):
    """Adds ``profiler`` to the Trainer once ``step`` optimizer steps are done, so the steps before it run at full
    speed: tensor accounting slows a GumbelTopK step about 3x here, and only the steady state is reported."""

    def __init__(self, profiler: MemoryProfiler, step: int) -> None:
        self.profiler, self.step = profiler, step

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step and self.profiler not in trainer.callbacks:
            self.profiler.setup(trainer, pl_module, "fit")
            trainer.callbacks.append(self.profiler)


def measure(case: Case, module: GumbelTopK, steps: int = 2) -> None:
    """``steps`` real steps, the last one with the MemoryProfiler; fills the steady-state peaks of ``case``."""
    profiler = MemoryProfiler(every_n_steps=1, predict=False)
    train_step = module.train_step

    def recording_train_step(batch):
        case.shapes.append(shape(batch))
        metrics, n = train_step(batch)
        case.mass.append(metrics["gumbel/topk_mass"])
        return metrics, n

    module.train_step = recording_train_step
    # an id outside the vocabulary is never sampled: every rollout runs to max_new_tokens
    module.eos_ids = lambda: [case.vocab]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[MeasureFromStep(profiler, steps - 1)],
            default_root_dir=tmp,
        )
        trainer.fit(module, datamodule())
    record = profiler.summary()["steps"][-1]
    case.measured, total = {p: v["peak_bytes"] for p, v in record["phases"].items()}, record["total"]
    case.step_peak, case.rss_peak = total["peak_bytes"], total.get("rss_peak_bytes", 0)
    case.breakdown = dict(total.get("breakdown", {}))


def run_case(case: Case, dirs: tuple[str, str], planned: list[tuple[int, bool]], max_bytes: float) -> None:
    """Predict ``case``, and measure it too if the prediction fits in ``max_bytes``."""
    predict(case, dirs, *planned[1])
    if case.predicted_peak > max_bytes:
        case.skipped = f"predicted {case.predicted_peak / GIB:.1f} GiB > --max-gib {max_bytes / GIB:g}"
    else:
        measure(case, method(dirs, case))
        if case.shapes[1] != planned[1]:  # the stream is seeded: only if the data module changed
            predict(case, dirs, *case.shapes[1])
    gc.collect()


def trained_topk_mass(k: int = TOPK, prompts: int = 8, new_tokens: int = 32) -> tuple[float, float, int, int] | None:
    """Top-``k`` mass of SmolLM2-135M-Instruct's next-token distribution along its own samples (top-``k`` sampling at
    temperature 1: the tokens a hard top-``k`` Gumbel rollout draws), over ``prompts`` arithmetic prompts, up to and
    including each completion's EOS: ``(mean, minimum, vocabulary, positions)``; ``None`` without the embedded model."""
    from lit_rl.models import load_causal_lm, load_tokenizer

    try:
        tokenizer = load_tokenizer("embedded")
        model = load_causal_lm("embedded").eval()
    except Exception:  # not installed: the random-model numbers stand alone
        return None
    dm = PromptDataModule(num_prompts=prompts, batch_size=prompts, max_prompt_length=256, seed=0)
    dm.connect(tokenizer)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    p = batch["input_ids"].shape[1]
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=True, top_k=k,
            temperature=1.0, max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        eos = out[:, p:] == tokenizer.eos_token_id  # [B, C]
        keep = (eos.cumsum(1) - eos.long()) == 0  # [B, C] up to and including the first EOS
        mask = torch.cat([batch["attention_mask"], keep.long()], 1)  # [B, P + C]
        logits = model(input_ids=out, attention_mask=mask).logits[:, p - 1 : -1].float()  # [B, C, V]
        mass = logits.softmax(-1).topk(k, dim=-1).values.sum(-1)[keep]  # [positions]
    return mass.mean().item(), mass.min().item(), logits.shape[-1], mass.numel()


# ------------------------------------------------------------------------------------------------ report


def mib(b: float) -> str:
    return f"{b / MIB:,.1f}"


def index(cases: list[Case]) -> dict[tuple[int, int, str], Case]:
    return {(c.vocab, c.tokens, c.path): c for c in cases}


def peak_of(c: Case | None) -> tuple[float, bool]:
    """(step peak bytes, measured?): the measured peak, or the prediction of a config that was not run."""
    if c is None:
        return float("nan"), False
    return (c.predicted_peak, False) if c.skipped else (c.step_peak, True)


def phase_table(cases: list[Case]) -> list[str]:
    rows = []
    for c in cases:
        for phase in (*PHASES, None):  # None: the step peak
            predicted, measured = c.at(phase)
            cells = ("not measured", "—") if c.skipped else (mib(measured), f"{c.error(phase):+.2f}")
            rss = mib(c.rss_peak) if phase is None and c.rss_peak else ""
            rows.append([f"{c.vocab:,}", c.tokens, c.path, phase or "**step peak**", mib(predicted), *cells, rss])
    headers = ["vocab", "new tokens", "path", "phase", "predicted MiB", "measured MiB", "error %"]
    return markdown_table([*headers, "process RSS peak MiB"], rows, ["---:", "---:", "---", "---", *["---:"] * 4])


def summary_table(cases: list[Case]) -> list[str]:
    by = index(cases)
    rows = []
    for vocab, tokens in sorted({(c.vocab, c.tokens) for c in cases}):
        row = [by.get((vocab, tokens, p)) for p in PATHS]
        ran = [c for c in row if c is not None and not c.skipped]
        peaks = [peak_of(c) for c in row]
        (lg, _), (tk, _), (ck, _) = peaks
        non_weight = [
            mib(c.breakdown.get("activations", 0) + c.breakdown.get("temporaries", 0)) if c in ran else "—" for c in row
        ]
        errors = [abs(c.error(ph)) for c in ran for ph in PHASES]
        peaks_cells = [f"{mib(b)}{'' if ok else ' (predicted, not run)'}" for b, ok in peaks]
        ratios = [f"{a / b:.2f}x" if a == a and b == b else "—" for a, b in ((lg, tk), (lg, ck), (tk, ck))]
        worst = f"{max(errors):.2f}" if errors else "—"
        rows.append([f"{vocab:,}", tokens, *peaks_cells, *ratios, " / ".join(non_weight), worst])
    ratios = ["legacy / top-k", "legacy / top-k + ckpt", "top-k / top-k + ckpt"]
    headers = ["vocab", "new tokens", *(f"{p} MiB" for p in PATHS), *ratios, "non-weight MiB: legacy / top-k / ckpt"]
    return markdown_table([*headers, "worst phase error %"], rows, ["---:"] * (len(headers) + 1))


def reading(cases: list[Case]) -> str:
    """The summary table in one sentence: the range of each step-peak ratio over the measured configs, and the share
    of the top-k step peaks that is weights, gradients and optimizer state (what top-k does not touch)."""
    by = index(cases)
    ratios: dict[str, list[float]] = {"top-k": [], "top-k + ckpt": []}
    weights = []
    for c in (c for c in cases if not c.skipped):
        legacy = by.get((c.vocab, c.tokens, "legacy"))
        if c.path in ratios and legacy is not None and not legacy.skipped:
            ratios[c.path].append(legacy.step_peak / c.step_peak)
        if c.path == "top-k" and c.breakdown:
            held = sum(c.breakdown.values()) or 1
            weights.append(sum(c.breakdown.get(k, 0) for k in ("parameters", "gradients", "optimizer_state")) / held)
    if not ratios["top-k"]:
        return "(no config measured on both paths: no ratio to read)"
    spans = ", ".join(f"{min(r):.2f}-{max(r):.2f}x lower with {path}" for path, r in ratios.items() if r)
    share = (
        f"; weights, gradients and AdamW state are {100 * min(weights):.0f}-{100 * max(weights):.0f} % of the top-k "
        "step peaks, the part neither path changes (the non-weight column compares the rest)"
        if weights
        else ""
    )
    return f"Over the configs measured on both paths, the step peak is {spans} than on the legacy path{share}."


def growth_table(cases: list[Case]) -> list[str]:
    """MiB of step peak per extra new token between consecutive lengths."""
    lengths = sorted({c.tokens for c in cases})
    if len(lengths) < 2:
        return ["(one length only: no growth to show)"]
    pairs = list(zip(lengths, lengths[1:]))
    by = index(cases)
    rows = []
    for vocab in sorted({c.vocab for c in cases}):
        for path in PATHS:
            cells = []
            for a, b in pairs:
                (pa, oka), (pb, okb) = peak_of(by.get((vocab, a, path))), peak_of(by.get((vocab, b, path)))
                cells.append(f"{(pb - pa) / (b - a) / MIB:,.2f}{'' if oka and okb else ' (predicted)'}")
            rows.append([f"{vocab:,}", path, *cells])
    headers = ["vocab", "path", *(f"MiB / token {a}->{b}" for a, b in pairs)]
    return markdown_table(headers, rows, ["---:", "---", *["---:"] * len(pairs)])


def mass_table(cases: list[Case]) -> list[str]:
    """The mean ``gumbel/topk_mass`` per vocabulary and top-k path, beside k / V (a uniform distribution's)."""
    masses: dict[tuple[int, str], list[float]] = {}
    for c in cases:
        if not c.skipped and c.path != "legacy":
            masses.setdefault((c.vocab, c.path), []).extend(c.mass)
    rows = [[f"{v:,}", p, f"{sum(m) / len(m):.5f}", f"{TOPK / v:.5f}"] for (v, p), m in sorted(masses.items())]
    headers = ["vocab", "path", "mean over the measured steps", "k / V (uniform)"]
    return markdown_table(headers, rows, ["---:", "---", "---:", "---:"])


def breakdown_section(cases: list[Case]) -> list[str]:
    """Where the steady-state peak of the largest measured top-k config goes: the profiler's categories at the step
    peak for both top-k paths, then the estimate's component table of the plain top-k path."""
    measured = [c for c in cases if not c.skipped and c.path != "legacy"]
    vocab, tokens = max((c.vocab, c.tokens) for c in measured)
    shown = [c for c in measured if (c.vocab, c.tokens) == (vocab, tokens)]
    rows = []
    for category in (*CATEGORIES, "total"):
        cells = []
        for c in shown:
            total = sum(c.breakdown.values()) or 1
            b = total if category == "total" else c.breakdown.get(category, 0)
            cells += [mib(b), f"{100 * b / total:.1f} %"]
        rows.append([category, *cells])
    at_peak = ", ".join(f"{c.path}: `{max(c.measured, key=c.measured.get)}`" for c in shown)
    return [
        f"#### vocab {vocab:,}, {tokens} new tokens: measured (`memory/breakdown/*` at the steady-state step peak)",
        "",
        *markdown_table(["category", *(h for c in shown for h in (f"{c.path} MiB", "share"))], rows),
        "",
        f"at the peak of phase: {at_peak}",
        "",
        f"Predicted (the estimate's component table, {shown[0].path}):",
        "",
        "```",
        *shown[0].estimate.table().splitlines(),
        "```",
    ]


def plot(cases: list[Case], png: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state, Agg canvas only

    vocabs, lengths = sorted({c.vocab for c in cases}), sorted({c.tokens for c in cases})
    fig = Figure(figsize=(5.5 * len(vocabs), 4.2))
    axes = fig.subplots(1, len(vocabs), squeeze=False)[0]
    by = index(cases)
    for ax, vocab in zip(axes, vocabs):
        for path, color in zip(PATHS, ("tab:red", "tab:blue", "tab:green")):
            points = [(t, *peak_of(by.get((vocab, t, path)))) for t in lengths]  # (new tokens, bytes, measured?)
            linestyle = "-" if all(ok for *_, ok in points) else ":"
            ax.plot(
                [t for t, *_ in points], [b / MIB for _, b, _ in points], color=color, label=path, linestyle=linestyle
            )
            for filled, style in ((True, dict(color=color)), (False, dict(facecolors="none", edgecolors=color))):
                shown = [(t, b / MIB) for t, b, ok in points if ok is filled]
                ax.scatter([t for t, _ in shown], [m for _, m in shown], **style)
        ax.set_xticks(lengths, [str(t) for t in lengths])
        ax.set_xlabel("new tokens (full length, batch 2)")
        ax.set_ylabel("step peak held by tensors, MiB")
        ax.set_title(f"vocab {vocab:,}")
        ax.grid(True, alpha=0.3)  # linear axes: the slope is the MiB per new token of the growth table
        ax.legend(fontsize="small", title="filled: measured; hollow: predicted only", title_fontsize="x-small")
    fig.suptitle("GumbelTopK steady-state step peak (CPU tensor accounting), random 4-layer hidden-256 trunk")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="vocab 49,152, 32 new tokens, the three paths; no files")
    parser.add_argument("--vocab", type=int, default=None, help="with --quick: this vocabulary (default 49,152)")
    parser.add_argument("--new-tokens", type=int, default=None, help="with --quick: this length (default 32)")
    parser.add_argument("--max-gib", type=float, default=10.0, help="run a config only if its predicted peak fits")
    parser.add_argument("--out", type=Path, help="folder for gumbel_topk.md and the PNG (default bench/results)")
    return parser.parse_args(argv)


def run(opts: argparse.Namespace) -> list[Case]:
    """Every config of the grid (the smallest only with ``--quick``), predicted and, where it fits, measured."""
    quick = ((opts.vocab or VOCABS[0],), (opts.new_tokens or TOKENS[0],))
    vocabs, lengths = quick if opts.quick else (VOCABS, TOKENS)
    planned = planned_shapes()
    cases: list[Case] = []
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in vocabs:
            dirs = build_models(Path(tmp), vocab)
            for tokens in lengths:
                for path in PATHS:
                    case, start = Case(vocab, tokens, path), time.perf_counter()
                    with contextlib.redirect_stderr(io.StringIO()):
                        run_case(case, dirs, planned, opts.max_gib * GIB)
                    cases.append(case)
                    status = case.skipped or (
                        f"peak {mib(case.step_peak)} MiB (predicted {mib(case.predicted_peak)}), "
                        f"{time.perf_counter() - start:.0f} s"
                    )
                    print(f"  V={vocab:,} C={tokens} {path}: {status}", file=sys.stderr, flush=True)
    return cases


def report(
    cases: list[Case], cmd: str, wall: float, mass: tuple[float, float, int, int] | None, loads: list[float]
) -> str:
    worst = max(abs(c.error(p)) for c in cases if not c.skipped for p in (*PHASES, None))
    width, padded = next((c.shapes[-1] for c in cases if c.shapes), (None, None))
    text = [
        *harness.header_lines(
            "GumbelTopK: the memory of one step, measured and predicted",
            "python bench/bench_gumbel_topk.py",
            this_file=cmd,
            loads=loads,
            threads=torch.get_num_threads(),
            dists=("torch", "lightning", "transformers"),
        ),
        f"Total wall time: {wall:.0f} s.",
        "",
        "Models: random `LlamaForCausalLM` policy and `LlamaForSequenceClassification` reward model (num_labels=1), "
        "trunk hidden 256, intermediate 512, 4 layers, 4 heads (2 KV heads), tied embeddings, fp32, full fine-tuning; "
        f"{BATCH} prompts x 1 generation, beta {METHOD['beta']} (frozen reference copy), tau {METHOD['tau']}, hard "
        f"(straight-through), EOS disabled (every rollout has the full length), AdamW. Steady-state batch: prompt "
        f"width {width}, padded {padded}. Two steps per config; the second (optimizer state allocated) is measured "
        f"and compared with `estimate_step`. Not measured: configs whose predicted peak exceeds `--max-gib`.",
        "",
        "### Per-phase peaks of the steady-state step (MiB held by tensors, resident weights included)",
        "",
        *phase_table(cases),
        "",
        "### Step peak: legacy vs top-k vs top-k + checkpointing",
        "",
        "Non-weight = `activations` + `temporaries` of the profiler's breakdown at the step peak (all but "
        "parameters, gradients and optimizer state).",
        "",
        *summary_table(cases),
        "",
        reading(cases),
        "",
        "### Growth of the step peak with the completion length",
        "",
        *growth_table(cases),
        "",
        f"### Top-{TOPK} mass (`gumbel/topk_mass`)",
        "",
        *mass_table(cases),
        "",
        "The policies are random: their next-token distribution is nearly uniform, far flatter than a trained "
        "model's, so this mass is close to k / V and says nothing about the expected > 99.9 % either way.",
    ]
    if mass is not None:
        text += [
            "",
            f"A trained model for comparison: SmolLM2-135M-Instruct (the embedded model, vocab {mass[2]:,}) sampling "
            f"with top-{TOPK} at temperature 1 (the tokens a hard top-{TOPK} Gumbel rollout draws), 8 arithmetic "
            f"prompts, up to 32 new tokens each, {mass[3]} positions up to and including EOS: top-{TOPK} mass mean "
            f"{mass[0]:.5f}, minimum {mass[1]:.5f}.",
        ]
    text += [
        "",
        "### Where the steady-state peak goes",
        "",
        *breakdown_section(cases),
        "",
        f"Worst steady-state error (phases and step peak) over the measured configs: {worst:.2f} %.",
    ]
    return "\n".join(text)


def main(argv: list[str] | None = None) -> str:
    opts = parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    out_dir = opts.out or (None if opts.quick else RESULTS)
    cmd = " ".join(["python bench/bench_gumbel_topk.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"bench_gumbel_topk: {'writing to ' + str(out_dir) if out_dir else 'printing only'}", file=sys.stderr)
    start, load = time.perf_counter(), harness.load_average()
    cases = run(opts)
    mass = None if opts.quick else trained_topk_mass()
    text = report(cases, cmd, time.perf_counter() - start, mass, [load, harness.load_average()])
    print(text)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gumbel_topk.md").write_text(f"{text}\n")
        plot(cases, out_dir / "gumbel_topk_peak_vs_length.png")
        print(f"wrote {out_dir / 'gumbel_topk.md'} and {out_dir / 'gumbel_topk_peak_vs_length.png'}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
