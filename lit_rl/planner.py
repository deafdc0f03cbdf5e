"""The memory planner: the fastest setting of the memory tactics whose predicted step peak fits a budget.

``lit-rl estimate --config C --device-memory X --plan plan.yaml [--allow NAMES | --allow all]``

Each candidate is the config with some tactics turned on, predicted by the estimator (the method's own step on
fake tensors, :mod:`lit_rl.memory.estimate`) and timed by the roofline (:mod:`lit_rl.memory.roofline`: the step's
floor at the rates of the device it runs on, ``--device`` or ``trainer.accelerator``: a rates file's, ``--rates``,
which must have been measured on such a device, else measured here where this machine has one; a plan for a GPU made
on a machine without one is not timed, and its candidates rank by their passes). The tactics:

- kept arithmetic (always searched): fewer completions decoded together (``rollout_rows``) when the rollout's own
  peak (its KV cache) does not fit, the most that fit; smaller update micro-batches, as a token budget
  (``micro_batch_tokens`` = rows x the longest row, so short completions still share a pass) for the methods that
  pass their rows' lengths, else as ``micro_batch_size``; activation checkpointing of every k-th decoder layer (the
  largest k that fits, as :func:`~lit_rl.memory.fit.choose_checkpointing` finds it), or, for a method that refuses
  checkpointed layers, its own recomputation (``recomputation_settings``: GumbelTopK's ``checkpoint_steps``) at each
  micro-batch that does not fit without it.
- changed arithmetic (searched only when allowed, marked in the table): ``adamw8bit`` (bitsandbytes' 8-bit AdamW
  moments), ``bf16`` (``trainer.precision: bf16-true``), ``nf4`` (a 4-bit frozen base; LoRA runs only),
  ``reference_bf16`` (the full fine-tuning reference copy in bfloat16). Under an optimizer that rounds bf16 weights
  to nearest (losing each update below half a weight's bf16 spacing: most at a learning rate of 1e-5), ``bf16``
  comes only beside ``adamw8bit``; the default optimizer and the 8-bit step round stochastically.

For every allowed combination of the changed-arithmetic tactics that does not fit at the config's micro-batch even with
every layer checkpointed, its leanest setting (micro-batches of one row, every layer checkpointed) is estimated next; if
even that does not fit, the combination is skipped. Otherwise micro-batches shrink by halves from the config's until one
fits without checkpointing, or until halving lowers the peak by less than 1% of the budget (then the peak is weights,
gradients and optimizer state, which no micro-batch changes); each size that fits only with checkpointing is a candidate
at its least checkpointing. A candidate whose roofline floor (computed before its estimate, from the config's) is above
that of one that fits already is not estimated, nor are the smaller micro-batches after it, nor, once a modelled one
fits, one the roofline does not model, which ranks after it. A 4-bit base, the slowest by the floor (it decodes its
weights in every pass), is searched last. The fastest candidate by the roofline's floor wins (where the roofline does
not model the step, a method whose phases it does not know, the fewest passes and least recompute win instead, and the
table says so). The plan is written as a config fragment for ``lit-rl fit --config C --config plan.yaml``, headed by the
config it was made for, which the fit checks (:mod:`lit_rl.plan_file`).
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lit_rl.memory.estimate import Estimate, copy_method, estimate_step
from lit_rl.memory.fit import checkpointed_layers, layer_count, least_checkpointing
from lit_rl.memory.machine_rates import load_rates, rates_for
from lit_rl.memory.rollout import rollout_shape
from lit_rl.memory.units import format_bytes
from lit_rl.memory.work import ModelShape, StepSettings, floor, floor_rates, phase_work
from lit_rl.models import checkpointing_refused, keeps_bf16_updates, nf4_bytes_per_param, own_recomputation
from lit_rl.models.sampling import rollout_chunks
from lit_rl.plan_file import plan_fragment, plan_header

#: tactics that change the numbers a step computes, searched only when ``--allow`` names them
CHANGES_ARITHMETIC = {
    "adamw8bit": "AdamW moments in 8 bits (bitsandbytes), about a quarter of the optimizer state",
    "bf16": "bf16 weights, gradients and activations (trainer.precision bf16-true)",
    "nf4": "the frozen base in 4-bit NF4 (LoRA runs only)",
    "reference_bf16": "the full fine-tuning reference copy in bfloat16 (full fine-tuning with a KL term only)",
}
_MIXED = ("bf16-mixed", "16-mixed")
_WEIGHT_BYTES = {"bf16-true": 2, "16-true": 2}  # per weight, gradient and optimizer value by precision; else 4


@dataclass
class Candidate:
    """One setting of the tactics, its estimate and its predicted time."""

    rows: int  # update micro-batch rows (every row at its longest)
    every_n_layers: int  # activation checkpointing, 0 off
    allowed: tuple[str, ...]  # changed-arithmetic tactics on
    estimate: Estimate
    seconds: float | None  # the roofline's step floor; None where it does not model the step
    passes: float = 0.0  # micro-batches x (1 + checkpointed share, or 1 recomputing): the order where seconds is None
    overrides: dict[str, Any] = field(default_factory=dict)  # estimate_step keywords
    recomputation: dict[str, Any] = field(default_factory=dict)  # the method's own recomputation, turned on
    rollout_rows: int | None = None  # completions decoded together, where the plan cuts the rollout

    @property
    def peak(self) -> int:
        return self.estimate.peak_bytes


def plan(
    module,
    device_bytes: int,
    *,
    allow: tuple[str, ...] = (),
    rates: dict[str, Any] | None = None,
    progress: bool = False,
    **settings: Any,
) -> tuple[Candidate | None, list[Candidate], Candidate]:
    """Search the tactics for the fastest candidate whose predicted peak is at most ``device_bytes``.

    Args:
        module: as for :func:`~lit_rl.memory.estimate.estimate_step`.
        device_bytes: the budget for the step's tensor peak.
        allow: names of :data:`CHANGES_ARITHMETIC` the search may turn on.
        rates: rates of the device the step runs on (:func:`~lit_rl.memory.machine_rates.load_rates`); if
            ``None``, measured here (quick) where this machine has such a device, else no candidate is timed.
        progress: print a line to stderr per candidate estimated (each is a run of the step on fake tensors).
        **settings: the keyword arguments of ``estimate_step`` (the config's own).

    Returns:
        ``(the chosen candidate or None, every candidate estimated, the config as it is)``.

    Raises:
        ValueError: an unknown ``allow`` name, ``nf4`` allowed without LoRA alone (it is then skipped, not
            refused, when other names are allowed too), or ``rates`` measured on another kind of device.
    """
    unknown = sorted(set(allow) - set(CHANGES_ARITHMETIC))
    if unknown:
        raise ValueError(f"--allow: unknown tactic {unknown[0]!r}; use names of {sorted(CHANGES_ARITHMETIC)} or all")
    if settings.get("activation_checkpointing"):
        raise ValueError(
            "--plan: the config already checkpoints activations; remove its ActivationCheckpointing callback and "
            "let the plan choose every_n_layers"
        )
    rates = rates_for(settings.get("device_type", "cpu"), rates)  # None: no rates for that device here
    base = _candidate(module, rates, settings, {}, ())
    found: list[Candidate] = []

    def add(candidate: Candidate) -> None:
        found.append(candidate)
        if progress:
            line = f"  estimated {describe(candidate)}: {format_bytes(candidate.peak)}"
            print(f"{line} ({candidate.estimate.seconds:.0f} s)", file=sys.stderr, flush=True)  # the search's time

    add(base)
    choices = [name for name in CHANGES_ARITHMETIC if name in allow]
    if "nf4" in choices and not module.uses_lora:
        choices.remove("nf4")  # needs LoRA: a full fine-tuning config cannot use it
    if "adamw8bit" in choices and settings.get("rollout_gather") is not None:  # sharded (FSDP2)
        choices.remove("adamw8bit")  # bitsandbytes' 8-bit AdamW does not step sharded (FSDP2) weights
    bf16_config = settings.get("precision") == "bf16-true"  # bf16 would repeat the config; its reference is bf16
    choices = [c for c in choices if not (bf16_config and c in ("bf16", "reference_bf16"))]
    if "reference_bf16" in choices and (module.uses_lora or not module.needs_reference):
        choices.remove("reference_bf16")  # LoRA's reference is the base itself: there is no copy
    prompt_row = base.estimate.settings["sequence_length"]
    own = own_recomputation(module)  # a method's own recomputation, where it refuses checkpointed layers
    if all(module.hparams.get(k) == v for k, v in own.items()):
        own = {}  # the config already recomputes
    nearest = _rounds_bf16_to_nearest(module)  # then bf16 comes only beside adamw8bit: most small updates lost
    combos = [c for n in range(len(choices) + 1) for c in itertools.combinations(choices, n)]
    for combo in sorted(combos, key=lambda c: "nf4" in c):  # the 4-bit base last: the slowest by the floor
        if "bf16" in combo and ("reference_bf16" in combo or (nearest and "adamw8bit" not in combo)):
            continue  # bf16 weights' reference copy is bf16 already; (nearest) most small updates lost
        changes = _changes(combo, settings)
        rows = start = base.estimate.settings["micro_batch_size"]
        last = lean = None  # lean: the leanest setting, once estimated and fitting
        while rows >= 1:  # the config's micro-batch, then halves of it
            overrides = {**changes, **(_micro_batch(module, rows, prompt_row) if rows < start else {})}
            fastest = min((c.seconds for c in found if c.peak <= device_bytes and c.seconds is not None), default=None)
            bound = _floor_before(module, base, rates, overrides) if fastest is not None else None
            if fastest is not None and (bound is None or bound > fastest):  # unmodelled: ranked after (_order)
                break  # slower than a candidate that fits, as is every smaller or checkpointed micro-batch
            plain = _candidate(module, rates, settings, overrides, combo) if (combo or rows < start) else base
            if plain is not base:
                add(plain)
            if rows == start:  # the rollout's own peak, which no update setting lowers: fewer rows decoded at once
                plain, cut = _rollout_fitted(module, rates, settings, overrides, combo, plain, device_bytes, add)
                changes.update(cut)
                overrides.update(cut)
            if plain.peak <= device_bytes:
                break  # smaller micro-batches fit too, and are slower
            if last is not None and last - plain.peak < 0.01 * device_bytes:
                if lean is not None:  # the leanest setting fits where halving stopped lowering the peak
                    add(lean)
                break  # halving no longer lowers the peak (weights, gradients and state fill it): stop here
            every, known, recomputed = 0, {}, None
            leanest = lean if rows == 1 else None  # one row: the leanest setting is this micro-batch's, estimated
            if not checkpointing_refused(module):
                every, known = least_checkpointing(
                    module, device_bytes, {**settings, **overrides},
                    {0: plain.estimate, **({1: leanest.estimate} if leanest else {})},
                )  # fmt: skip
            elif own:  # GumbelTopK recomputes its own steps instead (plain does not fit: it would have broken)
                recomputed = leanest or _candidate(module, rates, settings, {**overrides, **own}, combo)
                add(recomputed)
            if every:
                add(_candidate(module, rates, settings, overrides, combo, every, known[every]))
            fitted = every or (recomputed is not None and recomputed.peak <= device_bytes)
            if rows == start and rows > 1 and not fitted:  # nothing fits at the config's micro-batch: if the
                lean = _leanest(module, rates, settings, changes, combo, rows, prompt_row, own)  # leanest setting
                if lean.peak > device_bytes:  # does not fit either, no smaller micro-batch will
                    add(lean)  # what this combination reaches at best (an unreachable budget's line names it)
                    break  # (one that fits is a candidate when the search reaches one row: not estimated again)
            last, rows = plain.peak, rows // 2 if rows > 1 else 0
    best = min((c for c in found if c.peak <= device_bytes), key=_order, default=None)
    return best, found, base


def _rounds_bf16_to_nearest(module) -> bool:
    """Whether the method's optimizer writes bf16 weights rounded to nearest (see ``keeps_bf16_updates``)."""
    return not keeps_bf16_updates(module.hparams.get("optimizer"))


def _rollout_fitted(module, rates, settings, overrides, combo, plain: Candidate, device_bytes: int, add):
    """``plain`` with fewer completions decoded together (``rollout_rows``) when its rollout phase does not fit:
    ``(the candidate, the override)``, or ``(plain, {})`` when it fits, or the method samples no rollout it can cut.

    Nothing is estimated when the rollout could not fit even if one row's KV cache and decode logits were all that
    scaled with the rows (within 1% of the budget for smaller per-row tensors): weights and state fill its peak. The
    first guess is the most rows at which the rollout's peak, lowered by the KV cache of the rows it leaves out,
    fits; then halves until it fits or one row is left (each a whole estimate). One row
    that does not fit either is kept only if it lowers the rollout's peak by at least 1% of the budget (the
    combination's smallest peak, for the line a budget nothing meets gets).
    """
    shape, e = rollout_shape(module), plain.estimate
    if shape.rows_option is None or e.phases.get("rollout", 0) <= device_bytes:
        return plain, {}
    chunks = rollout_chunks(e.settings["prompts"], e.settings["num_generations"], shape.rows_at_once)
    start = max(n * r for _, n, r in chunks)  # the rows decoded together now
    kv = next((c.bytes for c in e.components if c.name.startswith("KV cache")), 0)
    logits = next((c.bytes for c in e.components if c.name == "generation logits + probs"), 0)
    if start == 1 or not kv or e.phases["rollout"] - (kv + logits) * (start - 1) / start > 1.01 * device_bytes:
        return plain, {}
    per_row = kv / start
    rows = max(1, min(start - 1, int(start - (e.phases["rollout"] - device_bytes) / per_row)))
    while True:
        cut = {shape.rows_option: rows}
        candidate = _candidate(module, rates, settings, {**overrides, **cut}, combo)
        add(candidate)
        peak = candidate.estimate.phases["rollout"]
        if peak <= device_bytes:
            return candidate, cut
        if rows == 1:
            lowered = e.phases["rollout"] - peak >= 0.01 * device_bytes
            return (candidate, cut) if lowered else (plain, {})
        rows //= 2


def _order(c: Candidate) -> tuple:
    return (c.seconds is None, c.seconds if c.seconds is not None else c.passes, len(c.allowed))


def _changes(combo: tuple[str, ...], settings: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "adamw8bit" in combo:
        out["optimizer"] = {"class_path": "bitsandbytes.optim.AdamW8bit", "init_args": {}}
    if "bf16" in combo:
        out["precision"] = "bf16-true"
    if "nf4" in combo:
        out["quantize_base"] = "nf4"
    if "reference_bf16" in combo:
        out["reference_dtype"] = "bfloat16"
    return out


def _micro_batch(module, rows: int, row_tokens: int) -> dict[str, Any]:
    """The micro-batch of ``rows`` rows at their longest: a token budget (rows x the longest row) where the method
    passes its rows' lengths to the update (``uses_token_lengths``), so that short rows still share a pass; else a
    row count."""
    if getattr(type(module), "uses_token_lengths", False):
        return {"micro_batch_tokens": rows * row_tokens, "micro_batch_size": None}
    return {"micro_batch_size": rows}


def _leanest(module, rates, settings, changes, combo, rows: int, row_tokens: int, own: dict[str, Any]) -> Candidate:
    """``combo`` at its smallest setting of the kept-arithmetic tactics: micro-batches of one row and every layer
    checkpointed (or the method's own recomputation). The search assumes, as :func:`least_checkpointing` does, that
    fewer rows and more checkpointing never raise the peak, so a combination whose leanest setting does not fit is
    skipped after one estimate."""
    overrides = {**changes, **(_micro_batch(module, 1, row_tokens) if rows > 1 else {})}
    if not checkpointing_refused(module):
        return _candidate(module, rates, settings, overrides, combo, every=1)
    return _candidate(module, rates, settings, {**overrides, **own}, combo)


def _candidate(module, rates, settings, overrides, combo, every: int = 0, estimate: Estimate | None = None):
    keywords = {**settings, **overrides, "activation_checkpointing": every}
    estimate = estimate or estimate_step(module, **keywords)
    s = estimate.settings
    layers = layer_count(s["config"])
    micro = math.ceil(s["batch"] / max(1, s["micro_batch_size"]))
    own = {k: v for k, v in overrides.items() if k in own_recomputation(module)}  # one more forward of every step
    cut = overrides.get(rollout_shape(module).rows_option or "")  # completions decoded together, where the plan cuts
    chunks = len(rollout_chunks(s["prompts"], s["num_generations"], cut))
    passes = micro * (1 + (1 if own else checkpointed_layers(layers, every) / layers)) + chunks - 1
    return Candidate(s["micro_batch_size"], every, combo, estimate, _floor_seconds(module, estimate, rates, overrides),
                     passes, {k: v for k, v in keywords.items() if k in overrides or k == "activation_checkpointing"},
                     own, cut)  # fmt: skip


def _floor_before(module, base: Candidate, rates: dict[str, Any], overrides: dict[str, Any]) -> float | None:
    """The roofline's floor of a candidate without checkpointing, before it is estimated: the config's estimate's
    settings with the candidate's micro-batch (as the method cuts it) and precision. The search prunes by it, so a
    test checks it equals :func:`_floor_seconds` of the candidate's own estimate."""
    s = dict(base.estimate.settings)
    method = _with_overrides(module, overrides)
    row = s["prompt_length"] + s["max_new_tokens"]
    s.update(
        precision=overrides.get("precision", s["precision"]),
        activation_checkpointing=0,
        hparams={**s["hparams"], **overrides},
        micro_batch_size=method.micro_batches(s["batch"], [row] * s["batch"])[0].stop,
    )
    return _floor(method, s, _trainable(base.estimate), rates)


def _trainable(estimate: Estimate) -> int:
    """Trained weights: the estimate's gradient bytes over the bytes of one weight at its precision."""
    weight_bytes = _WEIGHT_BYTES.get(estimate.settings["precision"], 4)
    return next((c.bytes for c in estimate.components if c.name == "gradients"), 0) // weight_bytes


def _floor_seconds(module, estimate: Estimate, rates: dict[str, Any], overrides: dict[str, Any]) -> float | None:
    """The roofline's floor of the estimated step (every phase it models), or None where it does not model it."""
    return _floor(_with_overrides(module, overrides), estimate.settings, _trainable(estimate), rates)


def _with_overrides(module, overrides: dict[str, Any]):
    """A copy of the method with a candidate's hyper-parameters (precision is the Trainer's, not the method's)."""
    return copy_method(module, {k: v for k, v in overrides.items() if k != "precision"})


def _floor(method, s: dict[str, Any], trainable: int, rates: dict[str, Any] | None) -> float | None:
    """The floor of ``method``'s step (a candidate's copy) with the estimate settings ``s`` and ``trainable`` trained
    weights."""
    if rates is None:  # no rates for the step's device: not timed
        return None
    try:
        shape = ModelShape.from_config(s["config"])
    except ValueError:
        return None
    work = method.step_work()
    if work.differentiable is None and not {"rollout", "reference", "policy_forward"} <= set(type(method).phase_names):
        return None  # the roofline counts the GRPO family's phases and a declared differentiable rollout's
    half = s["precision"].split("-")[0] in ("bf16", "16")  # the matmuls in 16 bits (true half: the weights too)
    step = StepSettings.of(
        work,
        trainable=trainable,
        device=s["device_type"],
        prompts=s["prompts"],
        generations=s["num_generations"],
        prompt_length=s["prompt_length"],
        new_tokens=s["max_new_tokens"],
        micro_batch=s["micro_batch_size"],
        weight_bytes=_WEIGHT_BYTES.get(s["precision"], 4),
        cache_bytes=2 if half else 4,
        checkpointed_layers=checkpointed_layers(shape.layers, s["activation_checkpointing"]),
        base_nf4=nf4_bytes_per_param() if s["hparams"].get("quantize_base") == "nf4" else 0.0,  # overrides included
    )
    dtype = "bfloat16" if half else "float32"
    dtype = dtype if dtype in rates["dtypes"] else next(iter(rates["dtypes"]))
    args = floor_rates(rates, dtype)  # with those of a sampler in its own dtype
    return sum(floor(works, *args)["attainable_s"] for works in phase_work(shape, step).values())


# ------------------------------------------------------------------------------------------------ the plan file


def write_plan(
    module,
    settings: dict[str, Any],
    device_bytes: int | None,
    path: str,
    *,
    allow: str,
    rates: str | None,
    args: list[str],
    configs: list[str],
) -> Candidate:
    """``lit-rl estimate ... --plan FILE``: search, print the table, write the fragment; nothing is written when no
    plan fits. ``args`` are the estimate's fit arguments (repeated in the command printed), ``configs`` its
    ``--config`` files (named in the plan's header).

    Raises:
        ValueError: one line: no ``--device-memory``, an unknown ``--allow`` name, or a budget no plan meets.
    """
    if device_bytes is None:
        raise ValueError("--plan: needs --device-memory, the budget to plan for; e.g. --device-memory 2GiB")
    allowed = tuple(CHANGES_ARITHMETIC) if allow == "all" else tuple(a for a in allow.split(",") if a)
    device = settings.get("device_type", "cpu")
    machine = rates_for(device, load_rates(rates) if rates else None)  # refuses another device's rates
    best, found, base = plan(module, device_bytes, allow=allowed, rates=machine, progress=True, **settings)
    print("\n" + plan_table(best, found, base, device_bytes))
    if machine is None:
        print(f"not timed: this machine has no {device} (the candidates are ranked by their passes); measure its rates "
              f"there with `lit-rl rates --device {device} --out FILE` and plan with --rates FILE")  # fmt: skip
    else:
        print(f"times: floors at the rates of {machine.get('machine', device)} ({rates or 'measured now, quick'})")
    if "bf16" in allowed and settings.get("precision") != "bf16-true" and _rounds_bf16_to_nearest(module):
        print("bf16* is searched only beside adamw8bit*: the config's optimizer rounds bf16 weights to nearest, losing "
              "most updates at small learning rates; lit-rl's 8-bit step rounds them stochastically")  # fmt: skip
    if best is None:
        raise ValueError(unreachable_line(found, device_bytes, allowed))
    Path(path).write_text(plan_header(configs, device_bytes) + yaml.safe_dump(plan_fragment(best), sort_keys=False))
    print(f"\nwrote {path}; apply it with: lit-rl fit {' '.join(args)} --config {path}")
    return best


def plan_table(best: Candidate | None, found: list[Candidate], base: Candidate, device_bytes: int) -> str:
    """What the plan turns on, each candidate's peak and time against the config as it is."""
    head = f"plan for {format_bytes(device_bytes)} of tensors (predicted peak, roofline floor against the config's):"
    width = max(len(describe(c)) for c in [base, *found])
    lines = [head, f"  {'tactics':<{width}} {'peak':>11} {'saved':>11} {'time':>8}  fits"]

    def time(c: Candidate) -> str:
        if c.seconds is None or base.seconds is None:
            return "n/m"
        return f"{c.seconds / base.seconds:.2f}x"

    for c in sorted(found, key=lambda c: (c.peak > device_bytes, _order(c))):
        mark = "  <- plan" if c is best else ""
        lines.append(
            f"  {describe(c):<{width}} {format_bytes(c.peak):>11} {format_bytes(base.peak - c.peak):>11} {time(c):>8}  "
            f"{'yes' if c.peak <= device_bytes else 'no'}{mark}"
        )
    lines.append(
        "  * changes the arithmetic (allowed by --allow); n/m: no time (a step the roofline does not model, "
        "or no rates for its device)"
    )
    return "\n".join(lines)


def describe(c: Candidate) -> str:
    parts = [f"{name}*" for name in c.allowed]
    o = c.overrides
    if "micro_batch_tokens" in o:
        parts.append(f"micro_batch_tokens {o['micro_batch_tokens']} ({c.rows} row{'s' if c.rows != 1 else ''})")
    elif "micro_batch_size" in o:
        parts.append(f"micro_batch_size {o['micro_batch_size']}")
    if c.rollout_rows is not None:
        parts.append(f"rollout_rows {c.rollout_rows}")
    if c.every_n_layers:
        parts.append(f"checkpoint every {c.every_n_layers}")
    parts += [f"{k} {v}" for k, v in c.recomputation.items()]
    return ", ".join(parts) or "the config as it is"


def unreachable_line(found: list[Candidate], device_bytes: int, allow: tuple[str, ...]) -> str:
    """One line for a budget no candidate meets: the smallest peak reached and what it took."""
    low = min(found, key=lambda c: c.peak)
    more = sorted(set(CHANGES_ARITHMETIC) - set(allow))
    hint = f"; --allow {','.join(more)} may go lower" if more else "; use fewer prompts per step or shorter sequences"
    return (
        f"--device-memory {format_bytes(device_bytes)}: no plan fits; the smallest predicted peak is "
        f"{format_bytes(low.peak)} ({describe(low)}){hint}"
    )


__all__ = [
    "CHANGES_ARITHMETIC",
    "Candidate",
    "describe",
    "plan",
    "plan_table",
    "unreachable_line",
    "write_plan",
]
