"""What the roofline study needs beyond logged scalars: the machine's rates, and each run's roofline as tables.

``before`` measures the rates with ``lit-rl rates`` into ``<results>/machine_rates.json``, the file every arm's
MemoryProfiler reads (``rates:``), so a run's floors are at the rates measured just before it. Each run's
``memory_summary.json`` holds its roofline (:mod:`lit_rl.memory.roofline`, ``PhaseRoofline.report``): per phase the
median time, FLOPs, bytes, the floors and the share achieved. ``after`` writes the rates table, a phase table per
run and ``<results file>.json`` (every run's roofline section, with the provenance of the runs).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import harness

RATES = "machine_rates.json"


def before(study: dict, results: Path) -> None:
    """``lit-rl rates`` into ``<results>/machine_rates.json`` (or the study's ``rates_file``; quick rates in quick
    mode)."""
    runtime = study["runtime"]
    quick = [str(x) for x in study.get("quick", {}).get("rates", [])] if runtime.quick else []
    results.mkdir(parents=True, exist_ok=True)
    harness.measure_rates(results / study.get("rates_file", RATES), harness.thread_env(runtime.threads), *quick)


def _roofline(arm) -> dict:
    if "roofline" not in arm.extra:
        arm.extra["roofline"] = json.loads((arm.run_dir / "memory_summary.json").read_text())["roofline"]
    return arm.extra["roofline"]


def _totals(arm, show) -> str:
    """``show`` of the sums of the run's phases (measured, floor and decode-shaped seconds), or ``—`` without floors."""
    roof = _roofline(arm)
    if "skipped" in roof:
        return "—"
    phases = roof["phases"].values()
    total = {key: sum(e[key] for e in phases if "floor_s" in e or key == "measured_s")
             for key in ("measured_s", "floor_s", "attainable_s")}  # fmt: skip
    return show(total)


def measured(arm) -> str:
    return _totals(arm, lambda t: f"{t['measured_s']:.3f}")


def floor(arm) -> str:
    return _totals(arm, lambda t: f"{t['floor_s']:.4f}")


def achieved(arm) -> str:
    return _totals(arm, lambda t: f"{100 * t['floor_s'] / t['measured_s']:.1f}%")


def attainable(arm) -> str:
    return _totals(arm, lambda t: f"{t['attainable_s']:.4f}")


def worst(arm) -> str:
    roof = _roofline(arm)
    if "skipped" in roof:
        return f"no floors: {roof['skipped']}"
    gaps = {p: e["measured_s"] - e["floor_s"] for p, e in roof["phases"].items() if "floor_s" in e}
    if not gaps or max(gaps.values()) <= 0:
        return "—"
    phase = max(gaps, key=gaps.get)
    return f"{phase} ({gaps[phase]:.2f} s of {sum(g for g in gaps.values() if g > 0):.2f} s)"


def _rollout(arm) -> dict | None:
    roof = _roofline(arm)
    entry = roof.get("phases", {}).get("rollout")
    return entry if entry and "floor_s" in entry else None


def rollout_s(arm) -> str:
    entry = _rollout(arm)
    return "—" if entry is None else f"{entry['measured_s']:.2f}"


def rollout_floor(arm) -> str:
    """The rollout's floor / measured: the share of this machine's rates its decode reached."""
    entry = _rollout(arm)
    return "—" if entry is None else f"{100 * entry['achieved']:.1f}%"


def rollout_tokens_per_s(arm) -> str:
    """Rows x the step's width (its longest completion) over its rollout seconds, the median over the steps after
    the first: the positions a loop running every row to the width computes per second. Rows that end early are
    counted to the width, so a sampler that drops them shows it as speed."""
    if _rollout(arm) is None:
        return "—"
    rates = sorted(
        s["settings"]["prompts"] * s["settings"]["generations"] * s["settings"]["new_tokens"] / s["times"]["rollout"]
        for s in _measured_steps(arm)
        if s["times"].get("rollout")
    )
    return f"{rates[len(rates) // 2]:.1f}" if rates else "—"


def _measured_steps(arm) -> list[dict]:
    """The roofline's per-step entries from its first measured step on (the steps its medians cover)."""
    roof = _roofline(arm)
    first = roof.get("steps", [0])[0]
    return [s for s in roof.get("per_step", []) if s["step"] >= first]


def widths(arm) -> str:
    """The rollout's width (its longest completion) at each step after the first."""
    return ", ".join(str(s["settings"]["new_tokens"]) for s in _measured_steps(arm)) or "—"


cells = {
    f.__name__: f
    for f in (measured, floor, achieved, attainable, worst, rollout_s, rollout_floor, rollout_tokens_per_s, widths)
}


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _rates_lines(rates: dict, path: str) -> list[str]:
    loads = rates.get("load_average") or []
    loads = [load for load in (loads if isinstance(loads, list) else [loads]) if load]
    shown = " and ".join(f"{load['before'][0]} to {load['after'][0]}" for load in loads) or "unknown"
    lines = [
        "## Machine rates",
        "",
        f"`{path}` (`lit-rl rates`): {rates['machine']}, torch {rates['torch']}, {rates['threads']} threads, 1-minute "
        f"load average {shown} while measuring; each rate the fastest of as many timings as fit in "
        f"{rates['sizes']['seconds']} s.",
        "",
        "| dtype | GEMM {0}^3 | decode-shaped GEMM [{1} x {2}] @ [{2} x {3}] |".format(
            rates["sizes"]["gemm"], *rates["sizes"]["skinny"]
        ),
        "| --- | --- | --- |",
    ]
    for dtype, r in rates["dtypes"].items():
        lines.append(
            f"| {dtype} | {_si(r['matmul_flops_per_s'], 'FLOP/s')} | {_si(r['skinny_matmul_flops_per_s'], 'FLOP/s')} |"
        )
    d = rates["details"]
    lines += ["", f"Memory bandwidth over {rates['sizes']['copy_mib']} MiB: {_si(d['copy_bytes_per_s'], 'B/s')} "
              f"copying it (read + written), {_si(d['sum_bytes_per_s'], 'B/s')} summing it (read), "
              f"{_si(d['in_place_bytes_per_s'], 'B/s')} scaling it in place (read + written); the floors use the "
              "largest."]  # fmt: skip
    return lines


def _command(arm) -> str:
    return "python -m lit_rl fit " + shlex.join(["--config", arm.config, *arm.args])


def _run_lines(arm) -> list[str]:
    roof = _roofline(arm)
    lines = [f"## {arm.spec.get('title', arm.name)}", "", f"Command: `{_command(arm)}`  "]
    if "skipped" in roof:
        return [*lines, f"No floors: {roof['skipped']}.", ""]
    s = roof["settings"]
    what = "LoRA" if s["adapters"] else "full fine-tuning"
    record = arm.record
    lines.append(
        f"{s['prompts']} prompts x {s['generations']} completions, prompt width {s['prompt_length']}, completion "
        f"length {s['new_tokens']} (longest per step), {what} ({s['trainable']:,} trainable), "
        f"{roof['rates']['dtype']}, {s['checkpointed_layers']} checkpointed layers, shared-prompt passes "
        f"{'on' if s['share_prompt'] else 'off'}, {s['reference_passes']} reference pass(es). Median over steps "
        f"{roof['steps'][0]}-{roof['steps'][-1]} (the first step warms up); the run took {record['wall']:.0f} s with "
        f"model loading; 1-minute load average {record['load_before']:.1f} before, {record['load_after']:.1f} after."
    )
    lines += [
        "",
        "| phase | measured s | FLOPs | bytes | compute floor s | memory floor s | floor s | bound | floor / measured "
        "| decode-shaped rate s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for phase, e in roof["phases"].items():
        if "floor_s" not in e:
            lines.append(f"| {phase} | {e['measured_s']:.3f} | not modelled |" + " |" * 7)
            continue
        lines.append(
            f"| {phase} | {e['measured_s']:.3f} | {_si(e['flops'], 'FLOP')} | {_si(e['bytes'], 'B')} | "
            f"{e['compute_s']:.4f} | {e['memory_s']:.4f} | {e['floor_s']:.4f} | {e['bound']} | "
            f"{100 * e['achieved']:.1f}% | {e['attainable_s']:.4f} |"
        )
    lines.append(
        f"| **step** (sum) | **{measured(arm)}** | | | | | **{floor(arm)}** | | **{achieved(arm)}** | "
        f"**{attainable(arm)}** |"
    )
    return [*lines, ""]


def after(study: dict, arms: list, results: Path) -> list[str]:
    """The rates table, a phase table per run, and ``roofline.json`` beside the results file."""
    path = results / study.get("rates_file", RATES)
    rates = json.loads(path.read_text())
    lines = ["", *_rates_lines(rates, harness.relative(path)), ""]
    for arm in arms:
        lines += _run_lines(arm)
    saved = {
        "commit": harness.git_commit(),
        "versions": harness.versions(harness.DISTRIBUTIONS),
        "machine": harness.machine(study["runtime"].threads),
        "runs": {arm.name: {"roofline": _roofline(arm), "command": _command(arm), **arm.record} for arm in arms},
    }
    name = Path(study["results"]).with_suffix(".json").name  # roofline.md: roofline.json
    (results / name).write_text(json.dumps(saved, indent=2) + "\n")
    return [*lines, f"Every run's roofline section: [`{name}`]({name})."]
