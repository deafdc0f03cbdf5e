"""What the QLoRA study needs beyond logged scalars: held-out accuracy with its steps and the mean step time (the
learning table's cells); the memory table of the profiled arms; the base's weight bytes; estimates at scale.

- **memory**: the arms with no row (``tabulate: false``) ran with the MemoryProfiler; their ``memory_summary.json``
  gives each phase's measured peak (tensor accounting, the steady-state steps: step 0 without AdamW state is left
  out) beside the profiler's own prediction for the step's shapes (the estimator on fake tensors);
- **weight bytes**: the trunk's linear weights of ``weights_model`` dense, and as NF4 codes + scales after
  :func:`lit_rl.models.quantize_base_nf4` (:func:`lit_rl.models.nf4_memory`), computed here in-process;
- **estimates**: ``lit-rl estimate`` of each of the study's ``estimates`` with a dense and an NF4 base, in a fresh
  process each (their output in ``<out>/estimates/<case>-<none|nf4>.log``); the step peak and each phase's peak.

What is measured here is saved under ``<out>`` (``weights.json``, ``estimates/*.json``), so ``--reuse`` reads it.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from functools import partial
from pathlib import Path

import harness
from harness import training_seconds

UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}  # lit-rl estimate's human-readable sizes


# ------------------------------------------------------------------------------------------------ learning cells
def accuracy(arm) -> str:
    """Held-out accuracy at each evaluation, then the optimizer steps done at each, in brackets."""
    logged = arm.series.get("val/correct_answer", [])
    # the evaluation before training is logged at step 0, the one after step k's update at k - 1
    steps = [0] + [s + 1 for s, _ in logged[1:]]
    return " → ".join(f"{v:.2f}" for _, v in logged) + f" ({', '.join(map(str, steps))})"


def step_seconds(arm) -> str:
    """The sum of the logged phase times over the steps, per step (evaluation left out)."""
    steps = len(arm.values("reward/mean"))
    return f"{max(training_seconds(arm.run_dir).values()) / max(steps, 1):.2f}"


cells = {"accuracy": accuracy, "step_seconds": step_seconds}


# ------------------------------------------------------------------------------------------------ memory
def _mib(gib: float | None) -> str:
    return "-" if gib is None else f"{gib * 1024:.1f}"


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _phases(arm) -> tuple[dict, dict]:
    """The profiler's summary and ``{phase: {measured, predicted}}`` (GiB, steady state), the step last."""
    summary = json.loads((arm.run_dir / "memory_summary.json").read_text())
    phases = {}
    for phase, stats in [*summary["phases"].items(), ("step", summary["step"])]:
        phases[phase] = {"measured": stats["peak_gib"]["steady"], "predicted": stats.get("predicted_gib")}
    return summary, phases


def memory_lines(profiled: list) -> list[str]:
    if not profiled:
        return ["Not measured (`--arms` without the profiled runs)."]
    rows = {arm.name: _phases(arm) for arm in profiled}
    first, summary = profiled[0], next(iter(rows.values()))[0]
    names = list(rows)
    phases = list(dict.fromkeys(p for _, r in rows.values() for p in r))
    lines = [
        f"Each run: `python -m lit_rl fit --config {first.config} {shlex.join(first.args)}` (config and precision per "
        f"column). Measured: the MemoryProfiler's {summary['measurement']}, mean over the steady-state steps "
        f"{summary['steady_state_steps']} (step 0 has no AdamW state yet); predicted: the profiler's own prediction "
        "for each measured step's shapes (the estimator on fake tensors). MiB, measured / predicted (ratio "
        "predicted / measured).",
        "",
        "| phase | " + " | ".join(names) + " |",
        "| --- | " + " | ".join("---:" for _ in names) + " |",
    ]
    for phase in phases:
        cells_ = []
        for n in names:
            m = rows[n][1].get(phase, {})
            measured, predicted = m.get("measured"), m.get("predicted")
            ratio = f" ({predicted / measured:.3f})" if measured and predicted else ""
            cells_.append(f"{_mib(measured)} / {_mib(predicted)}{ratio}")
        lines.append(f"| {phase} | " + " | ".join(cells_) + " |")
    gaps = []
    for n in names:
        diffs = [(1024 * (m["predicted"] - m["measured"]), phase) for phase, m in rows[n][1].items()
                 if m.get("predicted") is not None and phase != "step"]  # fmt: skip
        if diffs:
            low, high = min(diffs), max(diffs)
            gaps.append(f"{n} {low[0]:+.1f} ({low[1]}) to {high[0]:+.1f} ({high[1]})")
    if gaps:
        lines += ["", "Predicted minus measured, MiB, smallest to largest over the phases: " + "; ".join(gaps) + "."]
    lines += ["", "Wall s and load average (1 min) per profiled run: " + "; ".join(
        f"{a.name} {a.record['wall']:.0f} s ({a.record['load_before']:.2f}, {a.record['load_after']:.2f})"
        for a in profiled
    ) + "."]  # fmt: skip
    return lines


# ------------------------------------------------------------------------------------------------ weights
def weights(name: str) -> dict:
    """Bytes of the trunk's linear weights of ``name``: dense (float32, bfloat16) and NF4 (codes + scales)."""
    import torch

    from lit_rl.models import load_causal_lm, nf4_memory, quantize_base_nf4, trunk

    model = load_causal_lm(name, dtype="float32")
    numel = sum(m.weight.numel() for m in trunk(model).modules() if isinstance(m, torch.nn.Linear))
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


def weights_lines(w: dict, profiled: list) -> list[str]:
    out, inner = w["largest"]
    lines = [
        f"Weight bytes of the base ({w['model']}, `{w['command']}`): {w['linear_weights']:,} weights in the trunk's "
        f"linear layers (of {w['parameters']:,} parameters; embeddings, norms and the head stay dense):",
        "",
        "| storage | bytes | bytes / weight |",
        "| --- | ---: | ---: |",
        f"| dense float32 | {_bytes(w['dense_fp32'])} | 4.000 |",
        f"| dense bfloat16 | {_bytes(w['dense_bf16'])} | 2.000 |",
        f"| NF4 codes + scales (double quant, block 64) | {_bytes(w['nf4'])} | {w['nf4'] / w['quantized_weights']:.3f} |",
        "",
        f"The largest layer is {out} x {inner}: its dense weight is the dequantization temporary "
        f"({_bytes(4 * out * inner)} in float32, {_bytes(2 * out * inner)} in bfloat16).",
    ]
    nf4_bf16 = [a for a in profiled if a.name == "nf4-bf16"]
    gap = _phases(nf4_bf16[0])[1].get("optimizer") if nf4_bf16 else None
    if gap and gap.get("predicted") is not None:  # no dequantization is live in the optimizer phase
        lines += [
            "",
            f"nf4-bf16, optimizer phase: predicted - measured = {1024 * (gap['predicted'] - gap['measured']):.2f} "
            f"MiB; the 8-bit absmax scales (one byte per 64 weights) are {w['quantized_weights'] / 64 / 2**20:.2f} "
            "MiB: bitsandbytes keeps them in the weight's `quant_state`, neither a parameter nor a buffer, which the "
            "profiler's tensor accounting (parameters, gradients, buffers, optimizer state) does not track, while "
            "the estimator's `NF4StandIn` holds them as buffers.",
        ]
    return lines


# ------------------------------------------------------------------------------------------------ estimates
def estimate(args: list[str], log: Path, threads: int) -> dict:
    """``lit-rl estimate <args>`` in a fresh process: its tables parsed, its wall seconds and load average."""
    cmd = [sys.executable, "-m", "lit_rl", "estimate", *args]
    print(f"+ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    try:
        done = harness.run_measured(cmd, None, harness.thread_env(threads), log=log)
    except harness.ChildFailed as e:
        raise SystemExit(f"error: `{shlex.join(cmd)}` failed (exit {e.code}); its output is in {log}") from None
    return {
        "command": shlex.join(["lit-rl", "estimate", *args]),
        **parse_estimate(log.read_text()),
        "wall": done.wall,
        "load_before": done.load[0],
        "load_after": done.load[1],
    }


def parse_estimate(text: str) -> dict:
    """The phase table (``{phase: bytes}``), the components (``{name: bytes}``) and the fit line of an estimate."""
    lines = text.splitlines()
    components, phases = {}, {}
    start = next(i for i, ln in enumerate(lines) if ln.startswith("component "))
    for ln in lines[start + 1 :]:
        if not ln.strip():
            break
        cells_ = re.split(r"\s{2,}", ln.strip())
        number = next((c for c in cells_[2:] if re.fullmatch(r"[\d,]+", c)), None)
        if number is not None:
            components[cells_[0]] = int(number.replace(",", ""))
    start = next(i for i, ln in enumerate(lines) if re.match(r"phase\s+peak GiB", ln))
    for ln in lines[start + 1 :]:
        if not ln.strip():
            break
        cells_ = ln.split()  # phase, peak GiB (4 decimals), peak (number, unit; 2 decimals), first step GiB, ...
        gib = cells_[3] in ("GiB", "TiB")  # the GiB column is the more precise one from 1 GiB on
        phases[cells_[0]] = float(cells_[1]) * 2**30 if gib else float(cells_[2]) * UNIT[cells_[3]]
    fits = next((ln for ln in lines if ln.startswith("device memory")), "")
    return {"components": components, "phases": phases, "fits": fits}


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.3f}"


def estimate_lines(saved: dict[str, dict[str, dict]]) -> list[str]:
    lines = [
        "GumbelTopK's `quantize_base: nf4` puts the reward model's trunk in NF4 as well as the policy's base "
        "(`lit_rl/methods/gumbel_topk.py`). Each estimate is an upper bound for its shapes (every prompt padded, "
        "every completion at `max_new_tokens`), in tensor bytes; a GPU adds the CUDA context and allocator slack.",
        "",
    ]
    for case, pair in saved.items():
        phases = list(dict.fromkeys(p for r in pair.values() for p in r["phases"]))
        lines += [f"**{case}**", ""]
        lines += [f"- `{r['command']}` ({r['wall']:.0f} s, load {r['load_before']:.2f}, {r['load_after']:.2f}): "
                  f"{r['fits'] or '-'}" for r in pair.values()]  # fmt: skip
        lines += ["", "| phase | dense base GiB | NF4 base GiB | NF4 / dense |", "| --- | ---: | ---: | ---: |"]
        for phase in phases:
            dense, nf4 = (pair[q]["phases"].get(phase) for q in ("none", "nf4"))
            ratio = f"{nf4 / dense:.2f}" if dense and nf4 else "-"
            lines.append(f"| {phase} | {_gib(dense)} | {_gib(nf4)} | {ratio} |")
        kept = [(q, name, n) for q, r in pair.items() for name, n in r["components"].items()
                if name.startswith(("parameters", "base weights", "reward_model weights", "NF4 dequant"))]  # fmt: skip
        if kept:
            lines += ["", "Weights in the component table: " + "; ".join(
                f"{'dense' if q == 'none' else 'NF4'}: {name} {_bytes(n)}" for q, name, n in kept) + "."]  # fmt: skip
        lines.append("")
    return lines


# ------------------------------------------------------------------------------------------------ the file
def _saved(path: Path, reuse: bool, measure) -> dict:
    """What ``measure()`` returns, saved at ``path``; with ``reuse``, what an earlier run saved there."""
    if not (reuse and path.exists()):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(measure(), indent=1) + "\n")
    return json.loads(path.read_text())


def after(study: dict, arms: list, results: Path) -> list[str]:
    """The memory table, the base's weight bytes and the estimates, each measured once and saved under ``<out>``."""
    runtime = study["runtime"]
    options = study.get("quick", {}) if runtime.quick else study
    profiled = [a for a in arms if not a.spec.get("tabulate", True)]
    w = _saved(runtime.out / "weights.json", runtime.reuse, lambda: weights(options["weights_model"]))
    tail = [str(x) for x in study["estimate_tail"]]
    saved = {}
    for case, args in options["estimates"].items():
        saved[case] = {}
        for q in ("none", "nf4"):
            log = runtime.out / "estimates" / f"{case}-{q}.log"
            cmd = [*(str(x) for x in args), "--model.init_args.quantize_base", q, *tail]
            saved[case][q] = _saved(
                log.with_suffix(".json"), runtime.reuse, partial(estimate, cmd, log, runtime.threads)
            )
    return [
        "",
        "## Memory per phase, predicted vs measured",
        "",
        *memory_lines(profiled),
        "",
        *weights_lines(w, profiled),
        "",
        "Caveat: on the CPU the profiler's tensor accounting cannot see bitsandbytes' forward dequantization "
        "temporary (the dense weight of one layer, allocated inside its `gemm_4bit` custom op, which is counted by its "
        "output only); the estimator's `NF4StandIn` allocates it, so an NF4 phase may be predicted up to about one "
        "layer's dense weight above the measurement.",
        "",
        "## Estimates at scale (`lit-rl estimate`, fake tensors, predicted for cuda)",
        "",
        *estimate_lines(saved),
    ]
