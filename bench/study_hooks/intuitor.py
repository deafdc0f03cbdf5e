"""What the Intuitor sweep's table needs beyond logged scalars: self-certainty per finished completion, a verdict,
and the plot of held-out accuracy and clipped share against the step.

With ``mask_truncated_completions`` a truncated completion's mask is all zero, so its self-certainty (its reward)
is 0 and ``self_certainty/mean`` averages those zeros in: dividing by the share that finished gives the mean over
the completions that finished; steps where every completion was cut are left out.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from harness import mean

WINDOW = 10  # steps in the first / last window
EARLY, LATE = slice(None, WINDOW), slice(-WINDOW, None)


def _masked(arm) -> bool:
    config = yaml.safe_load((arm.run_dir / "config.yaml").read_text())
    return bool(config["model"]["init_args"].get("mask_truncated_completions", False))


def _scored(arm) -> tuple[float, float]:
    """Self-certainty over the first and last window, per finished completion where truncated ones are masked."""
    certainty = arm.values("self_certainty/mean")
    cut = arm.values("completions/clipped_ratio") if _masked(arm) else [0.0] * len(certainty)
    scored = [[c / (1 - r) for c, r in zip(certainty[w], cut[w]) if r < 1] for w in (EARLY, LATE)]
    return mean(scored[0]), mean(scored[1])


def scored_certainty(arm) -> str:
    if not _masked(arm):
        return "—"
    first, last = _scored(arm)
    return f"{first:.2f} → {last:.2f}"


def verdict(arm) -> str:
    """``holds`` when the last held-out accuracy is not below the first while self-certainty rises; otherwise the
    first evaluation below the start and the last one not below it."""
    acc = arm.values("val/correct_answer")
    logged = arm.series["val/correct_answer"]
    steps = [0] + [s + 1 for s, _ in logged[1:]]
    below = [i for i, v in enumerate(acc) if v < acc[0] - 1e-9]
    first_drop = steps[below[0]] if below else None
    safe_until = steps[below[0] - 1] if below else steps[-1]
    first, last = _scored(arm)
    if acc[-1] >= acc[0] - 1e-9 and last > first:
        return (
            "holds at every evaluation"
            if first_drop is None
            else f"holds at the end; below the start at step {first_drop}"
        )
    if first_drop is None:
        return "holds accuracy; certainty does not rise"
    return f"below the start from step {first_drop} (not before step {safe_until})"


cells = {"scored_certainty": scored_certainty, "verdict": verdict}


def after(study: dict, arms: list, results: Path) -> list[str]:
    """Held-out accuracy and clipped share against the step, a line per arm: ``intuitor_sweep.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(7.5, 6.5), sharex=True)
    for i, arm in enumerate(arms):
        style = dict(marker="o", lw=1.5, color=f"C{i % 10}", ls="-" if i < 10 else "--", label=arm.name)
        if arm.section:
            style.update(color="black", ls=":", marker="s", mfc="none", ms=10, label=f"{arm.name} config, as it is")
        logged = arm.series["val/correct_answer"]
        steps = [0] + [s + 1 for s, _ in logged[1:]]
        axes[0].plot(steps, arm.values("val/correct_answer"), **style)
        axes[1].plot(steps, arm.values("val/completions/clipped_ratio"), **style)
    axes[0].set_ylabel("held-out accuracy (greedy)")
    axes[1].set_ylabel("held-out clipped share")
    axes[1].set_xlabel("optimizer step")
    for ax in axes:
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2, loc="best")
    axes[0].set_title(f"Intuitor on the embedded model: bench/study.py {study['name']}")
    fig.tight_layout()
    results.mkdir(parents=True, exist_ok=True)
    path = results / "intuitor_sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ["", f"Plot: [`{path.name}`]({path.name})."]
