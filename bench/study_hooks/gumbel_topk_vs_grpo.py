"""What the GumbelTopK-vs-GRPO study needs beyond logged scalars: held-out scores by step, by a reward model too, at
equal wall time; each arm's peak memory per phase from its profiled twin; completions before and after; the plot.

Each run writes its held-out completions to ``heldout/val_step*.jsonl`` (with the lexicon judges' scores and text
statistics per completion); the study's ``scorer`` (the shipped reward model, as
:class:`lit_rl.reward_model.RewardModelScore` reads it) scores the same completions for every arm alike after
the runs.
Training seconds are the sum of the logged phase times (``harness.training_seconds``), evaluation left out; at equal
wall time each arm is read at its last evaluation within the training seconds the fastest arm took in all.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from harness import mean, read_scalar_events, training_seconds
from heldout_examples import examples

from lit_rl.reward_model import RewardModelScore

# per held-out completion in a run's heldout/*.jsonl: the judges, then text statistics
HELD_OUT = ("vader_positive", "afinn_positive", "vader_compound", "completions/distinct_bigrams",
            "completions/mean_length")  # fmt: skip
COLUMNS = ("vader_positive", "afinn_positive", "vader_compound", "rm", "rm_positive", "completions/distinct_bigrams",
           "completions/mean_length")  # fmt: skip
BATCH = 32  # completions per reward-model forward


# ------------------------------------------------------------------------------------------------ cells
def step_seconds(arm) -> str:
    seconds = training_seconds(arm.run_dir)
    return f"{max(seconds.values()) / max(max(seconds), 1):.1f}"


def _phase_names(run_dir: Path) -> tuple[str, ...]:
    """The phases of the method the run in ``run_dir`` trained (from its saved config)."""
    import lit_rl.methods

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return getattr(lit_rl.methods, config["model"]["class_path"].rsplit(".", 1)[1]).phase_names


def memory(arm) -> str:
    """The highest tensor peak (GiB) the memory profiler logged for each of the method's phases in the twin run."""
    twin = arm.others.get(arm.spec.get("profiled"))
    if twin is None:
        return "not measured"
    keys = [f"memory/{p}/peak_gib" for p in _phase_names(twin.run_dir)]
    events = read_scalar_events(str(twin.run_dir), keys, optional=True)
    return ", ".join(f"{k.split('/')[1]} {max(e.value for e in v):.2f}" for k, v in events.items()) or "not measured"


def phase_seconds(arm) -> str:
    """The median seconds of each of the method's phases over the steps after the first (the logged ``time/``)."""
    import statistics

    keys = [f"time/{p}_s" for p in _phase_names(arm.run_dir)]
    events = read_scalar_events(str(arm.run_dir), keys, optional=True)
    return ", ".join(f"{k.split('/')[1][:-2]} {statistics.median(e.value for e in v[1:] or v):.2f}"
                     for k, v in events.items()) or "not logged"  # fmt: skip


def gradient_noise(arm) -> str:
    """The gradient twin's figures (lit_rl/callbacks/gradient_noise.py): relative variance and agreement of the
    step's gradient drawn again for the same prompts, before the first step."""
    twin = arm.others.get(arm.spec.get("gradients"))
    if twin is None:
        return "not measured"
    keys = ["grad/relative_variance", "grad/agreement", "grad/mean_norm"]
    events = read_scalar_events(str(twin.run_dir), keys, optional=True)
    if len(events) < 3:
        return "not measured"
    if events[keys[2]][0].value == 0:
        return "zero gradient (every draw)"
    return f"{events[keys[0]][0].value:.2f}, {events[keys[1]][0].value:.3f}"


cells = {"step_seconds": step_seconds, "phase_seconds": phase_seconds, "memory": memory,
         "gradient_noise": gradient_noise}  # fmt: skip


# ------------------------------------------------------------------------------------------------ held-out scores
def held_out(arm, scorer: RewardModelScore) -> dict[int, dict[str, float]]:
    """``{steps trained: {score: mean}}`` over each evaluation's completions: the judges and text statistics the run
    wrote, plus ``rm`` (the reward model's mean score) and ``rm_positive`` (the share above 0)."""
    out = {}
    for path in sorted((arm.run_dir / "heldout").glob("val_step*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        scores = scorer.scores([r["completion"] for r in rows], [r["prompt"] for r in rows])  # [N]
        means = {k: mean([row[k] for row in rows]) for k in HELD_OUT}
        means.update(rm=scores.mean().item(), rm_positive=(scores > 0).float().mean().item())
        out[int(path.stem.removeprefix("val_step"))] = means
    return out


def tables(arms: list, scores: dict[str, dict], seconds: dict[str, dict]) -> list[str]:
    lines = [
        "## Held-out scores by step",
        "",
        "| method | step | training s | vader_positive | afinn_positive | vader_compound | RM score | RM positive "
        "| distinct bigrams | length |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arm in arms:
        for step, means in sorted(scores[arm.name].items()):
            spent = seconds[arm.name].get(step, float("nan"))
            lines.append(
                f"| {arm.name} | {step} | {spent:.0f} | " + " | ".join(f"{means[c]:.3f}" for c in COLUMNS) + " |"
            )
    budget = min(max(s.values()) for s in seconds.values())
    lines += [
        "",
        f"## At equal wall time: {budget:.0f} s of training (the shortest run's total)",
        "",
        "| method | last evaluation within the budget (step) | vader_positive | afinn_positive | RM score |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for arm in arms:
        step = max(s for s in scores[arm.name] if seconds[arm.name].get(s, float("inf")) <= budget + 1e-6)
        means = scores[arm.name][step]
        lines.append(f"| {arm.name} | {step} | " + " | ".join(f"{means[c]:.3f}" for c in COLUMNS[:2] + ("rm",)) + " |")
    return lines


def plot(arms: list, scores: dict[str, dict], seconds: dict[str, dict], path: Path) -> None:
    """Held-out scores and training statistics against the step (top) and the training seconds (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("vader_positive", "VADER positive (held-out)", True),
              ("afinn_positive", "AFINN positive (judge, held-out)", True),
              ("rm", "reward-model score (held-out)", True), ("kl/mean", "KL per token (training)", False),
              ("completions/mean_length", "completion length (training)", False),
              ("completions/distinct_bigrams", "distinct bigrams (training)", False)]  # fmt: skip
    fig, axes = plt.subplots(2, len(panels), figsize=(3.2 * len(panels), 5.6), squeeze=False)
    for arm in arms:
        for col, (key, title, is_held_out) in enumerate(panels):
            if is_held_out:
                points = sorted((s, v[key]) for s, v in scores[arm.name].items())
            else:  # by steps trained: step k's metrics are logged at k - 1
                points = [(s + 1, v) for s, v in arm.series.get(key, [])]
            if not points:
                continue
            steps, values = zip(*points)
            spent = [seconds[arm.name].get(s, float("nan")) for s in steps]
            style = "o-" if is_held_out else "-"
            axes[0][col].plot(steps, values, style, label=arm.name, markersize=4)
            axes[1][col].plot(spent, values, style, label=arm.name, markersize=4)
            axes[0][col].set_title(title, fontsize=9)
            axes[0][col].set_xlabel("optimizer step", fontsize=8)
            axes[1][col].set_xlabel("seconds of training", fontsize=8)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def after(study: dict, arms: list, results: Path) -> list[str]:
    """The held-out tables, each arm's completions before and after, and ``gumbel_topk_vs_grpo.png``."""
    runtime = study["runtime"]
    scorer_spec = (study.get("quick", {}) if runtime.quick else study)["scorer"]
    scorer = RewardModelScore(scorer_spec["reward_model"], head=scorer_spec.get("head"), batch_size=BATCH, device="cpu")
    shown = [a for a in arms if a.spec.get("tabulate", True)]
    scores = {a.name: held_out(a, scorer) for a in shown}
    seconds = {a.name: training_seconds(a.run_dir) for a in shown}
    lines = ["", *tables(shown, scores, seconds)]
    for arm in shown:
        lines += ["", f"## {arm.name}: held-out completions before and after", ""]
        lines.append(examples(arm.run_dir, ["vader_compound", "afinn_positive"], 4))
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{study['name']}.png"
    plot(shown, scores, seconds, path)
    return [*lines, "", f"Plot: [`{path.name}`]({path.name})."]
