"""Whether a step fits a device, and how much each memory tactic would save: the estimator run again per tactic.

:func:`choose_checkpointing` finds the least activation checkpointing (the largest ``every_n_layers``) that fits.
"""

from __future__ import annotations

import math
from typing import Any

from lit_rl.memory.estimate import Estimate, estimate_step
from lit_rl.memory.tactics import TACTICS
from lit_rl.memory.units import format_bytes


def estimate_savings(module, baseline: Estimate | None = None, **settings: Any) -> dict[str, int]:
    """Predicted saving of each memory tactic that is not on yet: tactic -> bytes off the step peak.

    Each tactic of :data:`~lit_rl.memory.tactics.TACTICS` that the estimator can predict is estimated by
    re-running :func:`estimate_step` with it applied: ``activation_checkpointing`` (every layer),
    ``micro_batch`` (half the current micro-batch), ``adamw8bit`` (bitsandbytes' 8-bit AdamW), ``lora`` (r=16 on all linear layers; also drops the
    frozen reference copy), ``bf16`` (``bf16-true``), ``rollout_layers`` (sharded runs) and, on an accelerator,
    ``host_offload`` (FSDP2's ``cpu_offload``).

    Args:
        module: as for :func:`estimate_step`.
        baseline: the estimate without the tactics (computed if not given).
        **settings: the keyword arguments of :func:`estimate_step`.
    """
    baseline = baseline or estimate_step(module, **settings)
    return {name: saved for name, (saved, _) in _tactic_estimates(module, baseline, settings).items()}


def checkpointed_layers(num_layers: int, every_n_layers: int) -> int:
    """How many of ``num_layers`` decoder layers ``every_n_layers`` checkpoints: transformers checkpoints the layers
    whose index is a multiple of it (0, k, 2k, ...), so ``ceil(num_layers / k)``; 0 for ``every_n_layers = 0`` (off)."""
    return math.ceil(num_layers / every_n_layers) if every_n_layers else 0


def choose_checkpointing(module, device_bytes: int, baseline: Estimate | None = None, **settings: Any) -> int | None:
    """The least activation checkpointing whose step fits in ``device_bytes``: an ``every_n_layers``, 0 or ``None``.

    Checkpointing a layer trades its saved activations for one more forward of it in the backward, so the answer is
    the largest ``every_n_layers`` (the fewest checkpointed layers, the least recompute) whose predicted step peak
    (:func:`estimate_step` with ``activation_checkpointing=k``) is at most ``device_bytes``.

    Convention: ``0`` when the step fits without checkpointing (``estimate_step``'s "off"); ``None`` when it does not
    fit even with every layer checkpointed (``k = 1``); otherwise ``k >= 1``. Several ``k`` checkpoint the same number
    of layers, ``ceil(L / k)`` (:func:`checkpointed_layers`); of those the smallest is returned, whose checkpointed
    layers are spread evenly (15, not 29, for two of 30 layers: the recompute of a layer near the top then runs
    while fewer activations below it are held).

    The search assumes what the estimator shows (``tests/test_choose_checkpointing.py`` checks it): checkpointing
    fewer layers never lowers the predicted peak. It searches the distinct layer counts (about ``2 sqrt(L)`` of
    them) for the boundary, first at the count a straight line between the estimates without checkpointing and with
    every layer puts it, then at its neighbour across it, then by halves. An answer takes those two estimates and
    two more where the line is right (the saved activations are nearly linear in the checkpointed layers), and,
    as every other probe after those halves the range, at most about twice a bisection's ``log2(2 sqrt(L))`` where
    it is not; each is a run of the method's step on fake tensors.

    Args:
        module: as for :func:`estimate_step`.
        device_bytes: the budget for the step's peak (tensor bytes; leave headroom on a GPU, see
            :mod:`lit_rl.memory.estimate`).
        baseline: an estimate already made at these ``settings`` (with or without checkpointing), reused.
        **settings: the keyword arguments of :func:`estimate_step`; their ``activation_checkpointing`` is replaced.
    """
    return least_checkpointing(module, device_bytes, settings, _seed(baseline))[0]


def _seed(baseline: Estimate | None) -> dict[int, Estimate]:
    return {} if baseline is None else {baseline.settings["activation_checkpointing"]: baseline}


def least_checkpointing(
    module, device_bytes: int, settings: dict[str, Any], known: dict[int, Estimate]
) -> tuple[int | None, dict[int, Estimate]]:
    """:func:`choose_checkpointing` and every estimate it made (``known``: every_n_layers -> estimate, added to, so
    a caller that has some estimates already passes them in)."""

    def fits(k: int) -> bool:
        if k not in known:
            known[k] = estimate_step(module, **{**settings, "activation_checkpointing": k})
        return known[k].peak_bytes <= device_bytes

    if fits(0):
        return 0, known
    if not fits(1):
        return None, known
    # per distinct layer count, fewest first, the smallest k giving it; k = 1 (every layer) last
    layers = layer_count(known[0].settings["config"])
    counts = {checkpointed_layers(layers, k): k for k in range(layers, 0, -1)}
    ordered = sorted(counts)
    options = [counts[c] for c in ordered]
    lo, hi = 0, len(options) - 1  # options[hi] fits (k = 1 does), nothing below lo does
    update = [p for p, b in known[0].phases.items() if known[1].phases.get(p) != b]  # the phases checkpointing lowers
    probe = 0  # the first two probes follow the line (the guess, then its neighbour across the boundary), then every
    while lo < hi:  # other one halves the range, so a bent profile costs at most about twice a bisection
        if probe >= 2 and probe % 2 == 0:
            mid = (lo + hi) // 2
        else:  # where a straight line through the nearest estimates either side of the boundary crosses the budget
            below = (ordered[lo - 1], known[options[lo - 1]]) if lo else (0, known[0])
            above = (ordered[hi], known[options[hi]])
            mid = min(hi - 1, max(lo, _crossing(below, above, update, device_bytes, ordered)))
        if fits(options[mid]):
            hi = mid
        else:
            lo = mid + 1
        probe += 1
    return options[hi], known


def _crossing(
    high: tuple[int, Estimate], low: tuple[int, Estimate], update: list[str], device_bytes: int, counts: list[int]
) -> int:
    """The index in ``counts`` (checkpointed layer counts, ascending) of the fewest layers whose checkpointing fits,
    were the update phases' peak linear in the checkpointed layers between ``high`` (a count and its estimate: fewer
    layers checkpointed, does not fit) and ``low`` (fits): each checkpointed layer keeps its input instead of its
    activations. A guess: a wrong one costs estimates, not the answer."""
    (c_high, high_estimate), (c_low, low_estimate) = high, low
    p_high, p_low = (max((e.phases[p] for p in update), default=e.peak_bytes) for e in (high_estimate, low_estimate))
    if p_high <= p_low or c_low <= c_high:
        return (len(counts) - 1) // 2
    needed = c_high + (c_low - c_high) * (p_high - device_bytes) / (p_high - p_low)
    return next((i for i, c in enumerate(counts) if c >= needed), len(counts) - 1)


def layer_count(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None) or 1)


def _tactic_estimates(module, baseline: Estimate, settings: dict[str, Any]) -> dict[str, tuple[int, Estimate]]:
    out: dict[str, tuple[int, Estimate]] = {}
    for name, change in _tactics(baseline).items():
        estimate = estimate_step(module, **{**settings, **change})
        out[name] = (baseline.peak_bytes - estimate.peak_bytes, estimate)
    return out


def _tactics(baseline: Estimate) -> dict[str, dict[str, Any]]:
    """The settings change of each estimable tactic that is not on yet."""
    from lit_rl.models import LoraSettings

    s = baseline.settings
    changes: dict[str, dict[str, Any]] = {}
    if s["activation_checkpointing"] != 1:  # off, or every k-th layer: more layers can be checkpointed
        changes["activation_checkpointing"] = {"activation_checkpointing": 1}
    if s["micro_batch_size"] > 1:
        changes["micro_batch"] = {"micro_batch_size": max(1, s["micro_batch_size"] // 2)}
    if s["optimizer"] in ("AdamW", "StochasticAdamW") and s.get("rollout_gather") is None:  # not sharded: bnb cannot
        changes["adamw8bit"] = {"optimizer": {"class_path": "bitsandbytes.optim.AdamW8bit", "init_args": {}}}
    if not s["lora"]:
        changes["lora"] = {"lora": LoraSettings()}
    if s.get("rollout_gather") not in (None, "layers"):  # sharded (FSDP2), gathering the whole policy
        changes["rollout_layers"] = {"rollout_gather": "layers"}
    if s["precision"] in ("32-true", "32"):
        changes["bf16"] = {"precision": "bf16-true"}
    if s["device_type"] == "cuda" and not s.get("shard_offload"):  # a CPU run's memory is host memory already
        changes["host_offload"] = {"rollout_gather": s.get("rollout_gather") or "auto", "shard_offload": True}
    assert set(changes) <= {name for name, t in TACTICS.items() if t.estimated}
    return changes


def fit_report(
    module, estimate: Estimate, device_bytes: int, settings: dict[str, Any], tactics: bool = True
) -> tuple[bool, str]:
    """Whether the step fits in ``device_bytes`` and, if not, which tactics help and by how much (text).

    Activation checkpointing is proposed at the ``every_n_layers`` of :func:`choose_checkpointing` (every layer when
    even that does not fit), with the share of layers it recomputes.
    """
    peak = estimate.peak_bytes
    fits = peak <= device_bytes
    lines = [
        f"device memory {format_bytes(device_bytes)}: predicted step peak {format_bytes(peak)} "
        f"({estimate.peak_phase}) {'fits' if fits else 'does NOT fit'}"
        + (f", {format_bytes(device_bytes - peak)} to spare" if fits else f", {format_bytes(peak - device_bytes)} over")
    ]
    if fits and peak > 0.9 * device_bytes:
        lines.append("  tight: the CUDA context, workspaces and allocator fragmentation are not in the estimate")
    if fits or not tactics:
        return fits, "\n".join(lines)
    results = _tactic_estimates(module, estimate, settings)
    every, current = 1, estimate.settings["activation_checkpointing"]
    if "activation_checkpointing" in results:  # the least checkpointing that fits, rather than every layer
        known = {current: estimate, 1: results["activation_checkpointing"][1]}
        every = least_checkpointing(module, device_bytes, settings, known)[0] or 1
        results["activation_checkpointing"] = (estimate.peak_bytes - known[every].peak_bytes, known[every])
    if not results:
        lines.append("  every tactic the estimator knows is already on; use a smaller batch or shorter sequences")
        return fits, "\n".join(lines)
    lines.append("tactics (each alone, re-estimated):")
    order = sorted(results, key=lambda n: -results[n][0])
    for name in order:
        saved, other = results[name]
        how = TACTICS[name].how.format(value=other.settings["micro_batch_size"])
        verb = "add"
        if name == "activation_checkpointing":
            how = _checkpointing_how(how, every, layer_count(estimate.settings["config"]), current)
            verb = "set" if current else verb
        if saved <= 0:
            lowered = [f"{p} to {format_bytes(v)}" for p, v in other.phases.items() if v < estimate.phases[p]]
            what = f"lowers {', '.join(lowered)} but" if lowered else "no saving,"
            lines.append(f"  - {name}: {what} the peak stays in {other.peak_phase} ({how})")
            continue
        verdict = "fits" if other.peak_bytes <= device_bytes else "still over"
        lines.append(
            f"  - {name}: saves {format_bytes(saved)} -> peak {format_bytes(other.peak_bytes)} "
            f"({other.peak_phase}), {verdict}; {verb} {how}"
        )
    if estimate.settings.get("shard_processes", 1) == 1:  # more devices instead of (or beside) a tactic
        lines.append(_sharding_line(module, device_bytes, settings))
    if any(other.peak_bytes <= device_bytes for _, other in results.values()):
        return fits, "\n".join(lines)
    # no tactic is enough alone (so checkpointing is at every layer): add them up, largest saving first, until it fits
    combined: dict[str, Any] = dict(settings)
    applied: list[str] = []
    # a tactic that lowers another phase than the peak's (the rollout's gather) helps once the peak's phase is lower
    lowers = {n for n, (_, other) in results.items() if any(v < estimate.phases[p] for p, v in other.phases.items())}
    for name in (n for n in order if results[n][0] > 0 or n in lowers):
        combined.update(_tactics(estimate)[name])
        applied.append(name)
        if len(applied) < 2:
            continue
        together = estimate_step(module, **combined)
        verdict = "fits" if together.peak_bytes <= device_bytes else "still over"
        lines.append(f"  - together, {' + '.join(applied)}: peak {format_bytes(together.peak_bytes)}, {verdict}")
        if together.peak_bytes <= device_bytes:
            break
    return fits, "\n".join(lines)


def _sharding_line(module, device_bytes: int, settings: dict[str, Any], most: int = 8) -> str:
    """The fewest devices (2, 4, ... ``most``) over which the step sharded with FSDP2 fits, each device's peak."""
    processes, peak = 1, 0
    while processes < most:
        processes *= 2
        peak = estimate_step(module, **{**settings, "shard_processes": processes}).peak_bytes
        if peak <= device_bytes:
            return (
                f"  - sharded over {processes} devices (FSDP2): peak {format_bytes(peak)} per device, fits; add "
                f"--trainer.strategy lit_rl.strategies.FSDP2Strategy --trainer.devices {processes} "
                "--trainer.use_distributed_sampler false"
            )
    return f"  - sharded over {processes} devices (FSDP2): peak {format_bytes(peak)} per device, still over"


def _checkpointing_how(how: str, every: int, layers: int, current: int = 0) -> str:
    """The fragment with ``every_n_layers`` (the fragment's last callback is the one it adds) and what it costs;
    with checkpointing already on every ``current``-th layer, the value to set on that callback instead."""
    if current:
        how = f"every_n_layers: {every} on the ActivationCheckpointing callback, instead of {current}"
    elif every > 1:
        how += f" --trainer.callbacks.init_args.every_n_layers {every}"
    n = checkpointed_layers(layers, every)
    return (
        f"{how} (recomputes {n} of {layers} layers, {n / layers:.0%}: about {n / layers:.2f} of a policy forward "
        "more in each backward)"
    )
