"""QLoRA (``model.quantize_base: nf4``) against LoRA on a dense base: learning, memory per phase, estimates at scale.

Three parts, each unit in a fresh process, each unit's numbers saved as ``<out>/json/<part>-<unit>.json`` so that
``qlora.md`` is always written from every unit measured so far (a partial rerun redoes only what it names):

1. **learning**: ``lit-rl fit --config configs/grpo_lora.yaml`` (dense base) and ``--config configs/grpo_qlora.yaml``
   (NF4 base), which differ only in ``quantize_base`` once both load the embedded SmolLM2-135M-Instruct
   (``grpo_lora.yaml`` names the 1.5B hub model; this machine has no network, and the comparison needs one base).
   Both run on the CPU in the configs' own ``bf16-true``, on the default config's task (single-digit sums) with a
   LoRA learning rate, the same smaller shapes and step count (``LEARN``: the configs' 500 steps of 64 completions of
   256 tokens take days on a CPU). From the TensorBoard scalars:
   ``reward/mean`` over the first and last 10 steps, ``val/correct_answer`` at each held-out evaluation, the mean
   step time (the sum of the logged ``time/*_s`` phases per step; evaluation left out) and the last step's KL.
2. **memory**: short runs (``--memory-steps``) of both configs with ``callbacks/memory_profiler.yaml`` in float32
   and in bfloat16; the profiler's ``memory_summary.json`` gives each phase's measured peak (tensor accounting, the
   steady-state steps, so step 0 without AdamW state is left out) beside its own prediction for the step's shapes
   (the estimator on fake tensors). Plus the weight bytes of the base: the trunk's linear weights dense, and as NF4
   codes + scales after :func:`lit_rl.models.quantize.quantize_base_nf4` (:func:`~lit_rl.models.quantize.nf4_memory`).
3. **estimates** (``--skip-estimates`` leaves them out): ``lit-rl estimate`` of the LoRA configs at scale, dense base
   and NF4 base: GRPO on a Qwen2.5-7B-shaped policy (8 completions of 4096 tokens, activation checkpointing; the
   config's micro-batch of 8 and, ``grpo-7b-mb1``, one completion per micro-batch) and
   GumbelTopK on a Qwen3-4B-shaped policy and reward model; the step peak and each phase's peak from its table.
   Each takes about 10-12 minutes on one CPU core (the step runs on fake tensors).

Known gap between predicted and measured (part 2): bitsandbytes decodes the NF4 weight to a dense temporary inside
its ``gemm_4bit`` custom op, where the CPU profiler's tensor accounting does not look; the estimator's
``NF4StandIn`` allocates it, so an NF4 phase can be predicted up to one layer's dense weight above what is measured.
Nor does it count the 8-bit absmax scales, which live in the weight's ``quant_state`` (no parameter, no buffer):
every NF4 phase is then measured one byte per 64 quantized weights below the prediction.

Times depend on the machine and its load (the load average is written beside them); bytes do not.

Run from the repository root, one thread per run (on shared cores a second torch thread mostly waits)::

    nice -n 5 python bench/bench_qlora.py                                   # all three parts, writes bench/results/qlora.md
    nice -n 5 python bench/bench_qlora.py --only learning memory            # parts 1 and 2
    nice -n 5 python bench/bench_qlora.py --only estimates --units grpo-7b-none grpo-7b-nf4
    python bench/bench_qlora.py --reuse                                     # rebuild qlora.md from the saved JSON
    python bench/bench_qlora.py --quick                                     # tiny random model: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
from harness import mean, read_scalar_events, training_seconds
from harness import run_fit as fit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

VERSIONED = ("torch", "bitsandbytes", "peft", "transformers", "lightning")  # the packages the header names
CONFIGS = {"lora": "configs/grpo_lora.yaml", "qlora": "configs/grpo_qlora.yaml"}
# every fit on this machine: the CPU, and one base for both configs (grpo_lora.yaml names a hub model)
CPU = ["--trainer.accelerator", "cpu", "--model.init_args.name_or_path", "embedded"]
# the configs' 8 prompts x 8 completions of up to 256 tokens take minutes per step on one CPU thread: 2 prompts x 8
# completions of up to 32 tokens, the same for both configs
SHAPES = ["--data.init_args.batch_size", "2", "--model.init_args.max_new_tokens", "32"]
# learning: the default config's task (single-digit sums, 12 new tokens), where the 135M model has signal to learn
# from (its configs' difficulty 5 gives 1-2 right answers in 20), at a LoRA learning rate (the configs' 1e-5 is
# for 500 steps of a 1.5B model); equal for both configs
LEARN = [
    "--data.init_args.difficulty", "1", "--model.init_args.max_new_tokens", "12", "--model.init_args.learning_rate",
    "2.0e-4", "--trainer.max_steps", "40", "--trainer.val_check_interval", "10",
]  # fmt: skip
QUICK_CPU = ["--trainer.accelerator", "cpu", "--model.init_args.name_or_path", "tiny:llama"]
QUICK_SHAPES = [
    "--data.init_args.batch_size", "1", "--model.init_args.max_new_tokens", "4", "--model.init_args.num_generations",
    "2", "--model.init_args.micro_batch_size", "2",
]  # fmt: skip
QUICK_LEARN = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "1", "--data.init_args.val_size", "2"]
PRECISION = {
    "fp32": ["--trainer.precision", "32-true", "--model.init_args.dtype", "float32"],
    "bf16": ["--trainer.precision", "bf16-true", "--model.init_args.dtype", "bfloat16"],
}
# memory units: (config, precision)
MEMORY = {"fp32": ("lora", "fp32"), "bf16": ("lora", "bf16"), "nf4-fp32": ("qlora", "fp32"),
          "nf4-bf16": ("qlora", "bf16")}  # fmt: skip
ESTIMATES = {
    "grpo-7b": [
        "--config", "configs/grpo_lora.yaml", "--config", "callbacks/activation_checkpointing.yaml",
        "--model-config", "shape:qwen2.5-7b", "--batch-size", "1", "--prompt-length", "128",
        "--model.init_args.num_generations", "8", "--model.init_args.max_new_tokens", "4096",
    ],
    "gumbel-4b": [
        "--config", "configs/gumbel_topk_lora.yaml", "--model-config", "shape:qwen3-4b",
        "--reward-model-config", "shape:qwen3-4b",
    ],
}  # fmt: skip
# the same 7B GRPO step one completion per micro-batch: activations small, the base's weights the largest block
ESTIMATES["grpo-7b-mb1"] = [*ESTIMATES["grpo-7b"], "--model.init_args.micro_batch_size", "1"]
QUICK_ESTIMATES = {
    "grpo-7b": [
        "--config", "configs/grpo_lora.yaml", "--model.init_args.name_or_path", "tiny:llama", "--batch-size", "1",
        "--prompt-length", "16", "--model.init_args.num_generations", "2", "--model.init_args.max_new_tokens", "8",
    ],
    "gumbel-4b": [
        "--config", "configs/gumbel_topk_lora.yaml", "--model.init_args.name_or_path", "tiny:llama",
        "--model.init_args.reward_model", "tiny:llama", "--batch-size", "1", "--prompt-length", "16",
        "--model.init_args.max_new_tokens", "4", "--model.init_args.gumbel_topk", "8",
    ],
}  # fmt: skip
QUICK_ESTIMATES["grpo-7b-mb1"] = [*QUICK_ESTIMATES["grpo-7b"], "--model.init_args.micro_batch_size", "1"]
ESTIMATE_TAIL = ["--device-memory", "80GiB", "--no-tactics"]
UNITS = {
    "learning": list(CONFIGS),
    "memory": [*MEMORY, "weights"],
    "estimates": [f"{case}-{q}" for case in ESTIMATES for q in ("none", "nf4")],
}
WINDOW = 10
UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}  # lit-rl estimate's human-readable sizes


# ------------------------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=list(UNITS), help="run these parts only (default: all)")
    p.add_argument("--units", nargs="+", metavar="NAME",
                   help="run these units only, of: " + ", ".join(u for us in UNITS.values() for u in us))  # fmt: skip
    p.add_argument("--skip-estimates", action="store_true", help="leave part 3 (lit-rl estimate at scale) out")
    p.add_argument("--memory-steps", type=int, default=3, help="steps of each profiled run (default 3; --quick 2)")
    p.add_argument("--out", help="runs and per-unit JSON (default runs/qlora)")
    p.add_argument("--results", help="folder for qlora.md (default bench/results)")
    p.add_argument("--reuse", action="store_true", help="read a unit already saved in --out instead of rerunning")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run (OMP_NUM_THREADS)")
    p.add_argument("--quick", action="store_true", help="tiny random model, 2 steps, tiny estimates, temporary folders")
    args = p.parse_args(argv)
    known = {u for us in UNITS.values() for u in us}
    unknown = [u for u in args.units or [] if u not in known]
    if unknown:
        p.error(f"--units: unknown {', '.join(unknown)}; use some of {', '.join(sorted(known))}")
    parts = args.only or [part for part in UNITS if not (part == "estimates" and args.skip_estimates)]
    args.todo = [(part, u) for part in parts for u in UNITS[part] if not args.units or u in args.units]
    if args.quick:
        args.memory_steps = 2
    scratch = tempfile.mkdtemp(prefix="lit_rl_qlora_") if args.quick and not (args.out and args.results) else None
    args.out = Path(args.out or (Path(scratch) / "runs" if scratch else ROOT / "runs" / "qlora"))
    args.results = Path(args.results or (scratch if scratch else ROOT / "bench" / "results"))
    return args


# ------------------------------------------------------------------------------------------------ part 1
def learning(args: argparse.Namespace, name: str) -> dict:
    """One config's training run: reward, held-out accuracy, step time, KL."""
    extra = [*CPU, *SHAPES[:2], *LEARN] if not args.quick else [*QUICK_CPU, *QUICK_SHAPES, *QUICK_LEARN]
    folder = args.out / "learning" / name
    shutil.rmtree(folder, ignore_errors=True)
    run, info = fit(CONFIGS[name], folder, extra)
    for ckpt in folder.rglob("*.ckpt"):  # LoRA adapters and AdamW state: not needed for the table
        ckpt.unlink()
    events = read_scalar_events(str(run), ["reward/mean", "val/correct_answer"])
    events.update(read_scalar_events(str(run), ["kl/mean"], optional=True))
    reward = [e.value for e in events["reward/mean"]]
    accuracy = events["val/correct_answer"]
    seconds = training_seconds(run)
    return {
        "command": shlex.join(["lit-rl", "fit", "--config", CONFIGS[name], *extra]),
        "steps": len(reward),
        "reward": [mean(reward[:WINDOW]), mean(reward[-WINDOW:])],
        # the evaluation before training is logged at step 0, the one after step k's update at k - 1
        "eval_steps": [0] + [e.step + 1 for e in accuracy[1:]],
        "accuracy": [e.value for e in accuracy],
        "step_s": max(seconds.values()) / max(len(reward), 1),
        "kl": events["kl/mean"][-1].value if events.get("kl/mean") else None,
        **info,
    }


# ------------------------------------------------------------------------------------------------ part 2
def memory(args: argparse.Namespace, name: str) -> dict:
    """One profiled run: each phase's measured peak and the profiler's own prediction (GiB, steady state)."""
    config, precision = MEMORY[name]
    shapes = [*CPU, *SHAPES] if not args.quick else [*QUICK_CPU, *QUICK_SHAPES]
    extra = ["--config", "callbacks/memory_profiler.yaml", *shapes, *PRECISION[precision],
             "--trainer.max_steps", str(args.memory_steps), "--data.init_args.val_size", "0"]  # fmt: skip
    folder = args.out / "memory" / name
    shutil.rmtree(folder, ignore_errors=True)
    run, info = fit(CONFIGS[config], folder, extra)
    for ckpt in folder.rglob("*.ckpt"):
        ckpt.unlink()
    summary = json.loads((run / "memory_summary.json").read_text())
    phases = {}
    for phase, stats in [*summary["phases"].items(), ("step", summary["step"])]:
        phases[phase] = {"measured": stats["peak_gib"]["steady"], "predicted": stats.get("predicted_gib")}
    return {
        "command": shlex.join(["lit-rl", "fit", "--config", CONFIGS[config], *extra]),
        "measurement": summary["measurement"],
        "steady_state_steps": summary["steady_state_steps"],
        "phases": phases,
        **info,
    }


def weights(args: argparse.Namespace) -> dict:
    """Bytes of the trunk's linear weights of the loaded policy: dense (float32, bfloat16) and NF4 (codes + scales)."""
    import torch

    from lit_rl.models import load_causal_lm, trunk
    from lit_rl.models.quantize import nf4_memory, quantize_base_nf4

    name = "tiny:llama" if args.quick else "embedded"
    model = load_causal_lm(name, dtype="float32")
    linears = [m for m in trunk(model).modules() if isinstance(m, torch.nn.Linear)]
    numel = sum(m.weight.numel() for m in linears)
    every = sum(p.numel() for p in model.parameters())
    quantize_base_nf4(model)
    quantized, nbytes, largest = nf4_memory(model)
    return {
        "command": f"load_causal_lm({name!r}, dtype='float32'); quantize_base_nf4; nf4_memory",
        "model": name,
        "parameters": every,
        "linear_weights": numel,
        "quantized_weights": quantized,
        "dense_fp32": 4 * numel,
        "dense_bf16": 2 * numel,
        "nf4": nbytes,
        "largest": list(largest[:2]) if largest else None,
    }


# ------------------------------------------------------------------------------------------------ part 3
def estimate(args: argparse.Namespace, name: str) -> dict:
    """``lit-rl estimate`` of one case with ``quantize_base`` none or nf4: its component and phase tables."""
    case, quantize = name.rsplit("-", 1)
    cmd = ["--model.init_args.quantize_base", quantize, *ESTIMATE_TAIL]
    cmd = [*(QUICK_ESTIMATES if args.quick else ESTIMATES)[case], *cmd]
    full = [sys.executable, "-m", "lit_rl", "estimate", *cmd]
    print(f"+ {shlex.join(full)}", file=sys.stderr, flush=True)
    load, start = os.getloadavg()[0], time.perf_counter()
    done = subprocess.run(full, cwd=ROOT, capture_output=True, text=True)
    folder = args.out / "estimates"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"error: {name}: `{shlex.join(full)}` failed ({done.returncode}); see {folder}/{name}.log")
    return {
        "command": shlex.join(["lit-rl", "estimate", *cmd]),
        **parse_estimate(done.stdout),
        "wall": time.perf_counter() - start,
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }


def parse_estimate(text: str) -> dict:
    """The phase table (``{phase: bytes}``), the components (``{name: bytes}``) and the fit line of an estimate."""
    lines = text.splitlines()
    components, phases, step_phase = {}, {}, None
    start = next(i for i, ln in enumerate(lines) if ln.startswith("component "))
    for ln in lines[start + 1 :]:
        if not ln.strip():
            break
        cells = re.split(r"\s{2,}", ln.strip())
        number = next((c for c in cells[2:] if re.fullmatch(r"[\d,]+", c)), None)
        if number is not None:
            components[cells[0]] = int(number.replace(",", ""))
    start = next(i for i, ln in enumerate(lines) if re.match(r"phase\s+peak GiB", ln))
    for ln in lines[start + 1 :]:
        if not ln.strip():
            break
        cells = ln.split()  # phase, peak GiB (4 decimals), peak (number, unit; 2 decimals), first step GiB, ...
        gib = cells[3] in ("GiB", "TiB")  # the GiB column is the more precise one from 1 GiB on
        phases[cells[0]] = float(cells[1]) * 2**30 if gib else float(cells[2]) * UNIT[cells[3]]
    fits = next((ln for ln in lines if ln.startswith("device memory")), "")
    found = re.search(r"\((\w+)\)", fits)
    step_phase = found.group(1) if found else None
    header = next((ln for ln in lines if " on " in ln and "precision" in ln), "")
    return {"components": components, "phases": phases, "step_phase": step_phase, "fits": fits, "header": header}


# ------------------------------------------------------------------------------------------------ report
def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _mib(gib: float | None) -> str:
    return "-" if gib is None else f"{gib * 1024:.1f}"


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def learning_table(saved: dict) -> list[str]:
    rows = {u: saved[f"learning-{u}"] for u in UNITS["learning"] if f"learning-{u}" in saved}
    if not rows:
        return ["Not measured yet (`--only learning`)."]
    first = next(iter(rows.values()))
    lines = [
        f"Each run: `{first['command']}` (and the same with `{CONFIGS['qlora']}`): the configs as they are but on "
        f"the CPU, both on the embedded model (`{CONFIGS['lora']}` names Qwen2.5-1.5B-Instruct from the hub), "
        "with the task, shapes, learning rate and step count of the command, equal for both: the default config's "
        "single-digit sums (the configs' difficulty 5 gives this model 1-2 right answers in 20, nothing to learn "
        "from), a LoRA learning rate, and a few steps (the configs' 8 prompts x 8 completions of up to 256 tokens and "
        "500 steps would take days on this CPU). Reward: `reward/mean` per step (the share of "
        f"sampled completions with the right answer), first and last {WINDOW} steps. Held-out: greedy "
        "`val/correct_answer` on the config's held-out questions (never trained on) after the optimizer steps in "
        "brackets. Mean step s: the sum of the logged `time/*_s` phases per step (evaluation left out); wall s: the "
        "whole process, loading and evaluations included.",
        "",
        f"| base | reward first {WINDOW} → last {WINDOW} | held-out accuracy (steps) | mean step s | KL last step | "
        "wall s | load before, after |",
        "| --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for name, r in rows.items():
        base = "dense bf16 (grpo_lora)" if name == "lora" else "NF4 (grpo_qlora)"
        acc = " → ".join(f"{a:.2f}" for a in r["accuracy"]) + f" ({', '.join(map(str, r['eval_steps']))})"
        kl = f"{r['kl']:.5f}" if r["kl"] is not None else "-"
        lines.append(
            f"| {base} | {r['reward'][0]:.3f} → {r['reward'][1]:.3f} | {acc} | {r['step_s']:.2f} | {kl} | "
            f"{r['wall']:.0f} | {r['load_before']:.2f}, {r['load_after']:.2f} |"
        )
    return lines


def memory_table(saved: dict) -> list[str]:
    rows = {u: saved[f"memory-{u}"] for u in MEMORY if f"memory-{u}" in saved}
    lines = []
    if rows:
        first = next(iter(rows.values()))
        names = list(rows)
        phases = list(dict.fromkeys(p for r in rows.values() for p in r["phases"]))
        lines += [
            f"Each run: `{first['command']}` (config and precision per column). Measured: the MemoryProfiler's "
            f"{first['measurement']}, mean over the steady-state steps "
            f"{first['steady_state_steps']} (step 0 has no AdamW state yet); predicted: the profiler's own prediction "
            "for each measured step's shapes (the estimator on fake tensors). MiB, measured / predicted (ratio "
            "predicted / measured).",
            "",
            "| phase | " + " | ".join(names) + " |",
            "| --- | " + " | ".join("---:" for _ in names) + " |",
        ]
        for phase in phases:
            cells = []
            for n in names:
                m = rows[n]["phases"].get(phase, {})
                measured, predicted = m.get("measured"), m.get("predicted")
                ratio = f" ({predicted / measured:.3f})" if measured and predicted else ""
                cells.append(f"{_mib(measured)} / {_mib(predicted)}{ratio}")
            lines.append(f"| {phase} | " + " | ".join(cells) + " |")
        gaps = []
        for n in names:
            diffs = [(1024 * (m["predicted"] - m["measured"]), phase) for phase, m in rows[n]["phases"].items()
                     if m.get("predicted") is not None and phase != "step"]  # fmt: skip
            if diffs:
                low, high = min(diffs), max(diffs)
                gaps.append(f"{n} {low[0]:+.1f} ({low[1]}) to {high[0]:+.1f} ({high[1]})")
        if gaps:
            lines += [
                "",
                "Predicted minus measured, MiB, smallest to largest over the phases: " + "; ".join(gaps) + ".",
            ]
        lines += ["", "Wall s and load average (1 min) per profiled run: " + "; ".join(
            f"{n} {r['wall']:.0f} s ({r['load_before']:.2f}, {r['load_after']:.2f})" for n, r in rows.items()
        ) + "."]  # fmt: skip
    else:
        lines.append("Not measured yet (`--only memory`).")
    w = saved.get("memory-weights")
    if w:
        lines += [
            "",
            f"Weight bytes of the base ({w['model']}, `{w['command']}`): {w['linear_weights']:,} weights in the trunk's "
            f"linear layers (of {w['parameters']:,} parameters; embeddings, norms and the head stay dense):",
            "",
            "| storage | bytes | bytes / weight |",
            "| --- | ---: | ---: |",
            f"| dense float32 | {_bytes(w['dense_fp32'])} | 4.000 |",
            f"| dense bfloat16 | {_bytes(w['dense_bf16'])} | 2.000 |",
            f"| NF4 codes + scales (double quant, block 64) | {_bytes(w['nf4'])} | "
            f"{w['nf4'] / w['quantized_weights']:.3f} |",
            "",
            f"The largest layer is {w['largest'][0]} x {w['largest'][1]}: its dense weight is the dequantization "
            f"temporary ({_bytes(4 * w['largest'][0] * w['largest'][1])} in float32, "
            f"{_bytes(2 * w['largest'][0] * w['largest'][1])} in bfloat16).",
        ]
        gap = rows.get("nf4-bf16", {}).get("phases", {}).get("optimizer")
        if gap and gap.get("predicted") is not None:  # no dequantization is live in the optimizer phase
            lines += [
                "",
                f"nf4-bf16, optimizer phase: predicted - measured = {1024 * (gap['predicted'] - gap['measured']):.2f} "
                f"MiB; the 8-bit absmax scales (one byte per 64 weights) are {w['quantized_weights'] / 64 / 2**20:.2f} "
                "MiB: bitsandbytes keeps them in the weight's `quant_state`, neither a parameter nor a buffer, "
                "which the profiler's tensor accounting (parameters, gradients, buffers, optimizer state) does not "
                "track, while the estimator's `NF4StandIn` holds them as buffers.",
            ]
    return lines


def estimates_table(saved: dict) -> list[str]:
    lines = [
        "GumbelTopK's `quantize_base: nf4` puts the reward model's trunk in NF4 as well as the policy's base "
        "(`lit_rl/methods/gumbel_topk.py`). Each estimate is an upper bound for its shapes (every prompt padded, "
        "every completion at `max_new_tokens`), in tensor bytes; a GPU adds the CUDA context and allocator slack.",
        "",
    ]
    for case in ESTIMATES:
        pair = {q: saved.get(f"estimates-{case}-{q}") for q in ("none", "nf4")}
        if not any(pair.values()):
            lines += [f"**{case}**: not estimated yet (`--only estimates --units {case}-none {case}-nf4`).", ""]
            continue
        have = {q: r for q, r in pair.items() if r}
        phases = list(dict.fromkeys(p for r in have.values() for p in r["phases"]))
        lines += [f"**{case}**", ""]
        lines += [f"- `{r['command']}` ({r['wall']:.0f} s, load {r['load_before']:.2f}, {r['load_after']:.2f}): "
                  f"{r['fits'] or '-'}" for r in have.values()]  # fmt: skip
        lines += ["", "| phase | dense base GiB | NF4 base GiB | NF4 / dense |", "| --- | ---: | ---: | ---: |"]
        for phase in phases:
            dense, nf4 = (pair[q]["phases"].get(phase) if pair[q] else None for q in ("none", "nf4"))
            ratio = f"{nf4 / dense:.2f}" if dense and nf4 else "-"
            lines.append(f"| {phase} | {_gib(dense and dense / 2**30)} | {_gib(nf4 and nf4 / 2**30)} | {ratio} |")
        weights = [(q, name, n) for q, r in have.items() for name, n in r["components"].items()
                   if name.startswith(("parameters", "base weights", "reward_model weights", "NF4 dequant"))]  # fmt: skip
        if weights:
            lines += ["", "Weights in the component table: " + "; ".join(
                f"{'dense' if q == 'none' else 'NF4'}: {name} {_bytes(n)}" for q, name, n in weights) + "."]  # fmt: skip
        missing = [q for q, r in pair.items() if not r]
        if missing:
            lines += ["", f"Missing: {case}-{missing[0]} (`--only estimates --units {case}-{missing[0]}`)."]
        lines.append("")
    return lines


def markdown(args: argparse.Namespace, argv: list[str], saved: dict) -> str:
    loads = [x for r in saved.values() for x in (r.get("load_before"), r.get("load_after")) if x is not None]
    lines = harness.header_lines(
        "QLoRA: a 4-bit NF4 base under LoRA, against a dense base",
        "nice -n 5 python bench/bench_qlora.py",
        this_file=shlex.join(["python", "bench/bench_qlora.py", *argv]),
        loads=loads,
        threads=args.threads,
        dists=VERSIONED,
    )
    lines += [
        "`nice -n 5 python bench/bench_qlora.py` runs all parts; a part alone with `--only`, then `--reuse`. "
        "Threads per run set by `OMP_NUM_THREADS`.",
        "",
        "## 1. Learning: dense base vs NF4 base",
        "",
        *learning_table(saved),
        "",
        "## 2. Memory per phase, predicted vs measured",
        "",
        *memory_table(saved),
        "",
        "Caveat: on the CPU the profiler's tensor accounting cannot see bitsandbytes' forward dequantization "
        "temporary (the dense weight of one layer, allocated inside its `gemm_4bit` custom op, which is counted by its "
        "output only); the estimator's `NF4StandIn` allocates it, so an NF4 phase may be predicted up to about one "
        "layer's dense weight above the measurement.",
        "",
        "## 3. Estimates at scale (`lit-rl estimate`, fake tensors, predicted for cuda)",
        "",
        *estimates_table(saved),
    ]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    json_dir = args.out / "json"
    json_dir.mkdir(parents=True, exist_ok=True)
    print(f"bench_qlora: runs in {args.out}, qlora.md in {args.results}", file=sys.stderr, flush=True)
    for part, unit in args.todo:
        path = json_dir / f"{part}-{unit}.json"
        if args.reuse and path.exists():
            print(f"{part}-{unit}: reusing {path}", file=sys.stderr, flush=True)
            continue
        print(f"{part}-{unit}: running", file=sys.stderr, flush=True)
        if part == "learning":
            result = learning(args, unit)
        elif part == "memory":
            result = weights(args) if unit == "weights" else memory(args, unit)
        else:
            result = estimate(args, unit)
        path.write_text(json.dumps(result, indent=1) + "\n")
    saved = {p.stem: json.loads(p.read_text()) for p in sorted(json_dir.glob("*.json"))}
    text = markdown(args, argv, saved)
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / "qlora.md"
    tmp = out.with_suffix(f".md.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(out)  # two partial runs side by side: each writes the whole file from every saved unit
    print(text)
    print(f"wrote {out}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
