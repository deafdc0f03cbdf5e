"""Plot scalars of a lit-rl run from its TensorBoard event files and print first/last window means.

python bench/plot_run.py runs/grpo/version_0 --keys reward/mean kl/mean --out docs/grpo_reward.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import read_scalars


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--keys", nargs="+", default=["reward/mean"])
    parser.add_argument("--window", type=int, default=10, help="steps in the first/last window")
    parser.add_argument("--smooth", type=int, default=5, help="moving-average width drawn over the raw curve")
    parser.add_argument("--title", default=None)
    parser.add_argument("--out", default=None, help="PNG path; omit to only print the table")
    args = parser.parse_args()

    series = read_scalars(args.run_dir, args.keys)
    w = args.window
    print(f"| metric | steps | first {w} mean | last {w} mean |")
    print("| --- | ---: | ---: | ---: |")
    for key, points in series.items():
        values = [v for _, v in points]
        print(
            f"| {key} | {len(values)} | {sum(values[:w]) / len(values[:w]):.3f} | {sum(values[-w:]) / len(values[-w:]):.3f} |"
        )

    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(len(series), 1, figsize=(7, 2.6 * len(series)), sharex=True, squeeze=False)
        for ax, (key, points) in zip(axes[:, 0], series.items()):
            steps, values = zip(*points)
            ax.plot(steps, values, color="0.7", lw=1, label="per step")
            k = max(1, args.smooth)
            smooth = [
                sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1])
                for i in range(len(values))
            ]
            ax.plot(steps, smooth, color="C0", lw=2, label=f"mean of last {k}")
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
            ax.legend(loc="upper left", fontsize=8)
        axes[-1, 0].set_xlabel("optimizer step")
        if args.title:
            axes[0, 0].set_title(args.title)
        fig.tight_layout()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=110)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
