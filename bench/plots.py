"""PNG figures of the sweeps (``bench/sweeps.py``): peak by phase (stacked), peak vs vocabulary, peak and step time
vs completion length. Matplotlib's object API with the Agg canvas only (no pyplot global state).

A point is anything with ``vocab``, ``length``, ``resident``, ``peaks`` (implementation -> phase -> bytes),
``seconds`` (implementation -> seconds), ``predicted`` (phase -> bytes) and ``peak(implementation)``; the
implementations are the keys of :data:`COLORS`, the first being lit-rl's, which the estimate describes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20
COLORS = {"lit-rl logits-free": "tab:blue", "full-logits": "tab:red"}
IMPLEMENTATIONS = tuple(COLORS)
Point = Any  # a sweep point, as described above


def _figure(width: float, height: float, cols: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.subplots(1, cols, squeeze=False)[0]


def peak_by_phase(points: list[Point], png: Path, title: str) -> None:
    """The largest point: per implementation and phase, resident weights and what the phase adds, stacked."""
    p = max(points, key=lambda q: (q.vocab, q.length))
    fig, (ax,) = _figure(6.5, 4.2)
    labels, resident, above, predicted = [], [], [], []
    for impl in IMPLEMENTATIONS:
        for phase, peak in p.peaks[impl].items():
            labels.append(f"{impl}\n{phase}")
            resident.append(p.resident / MIB)
            above.append((peak - p.resident) / MIB)
            predicted.append(p.predicted[phase] / MIB if impl == "lit-rl logits-free" else None)
    xs = range(len(labels))
    ax.bar(xs, resident, color="tab:gray", label="resident weights")
    ax.bar(xs, above, bottom=resident, color=[COLORS[label.split("\n")[0]] for label in labels],
           label="added by the phase (activations, logits, gradients)")  # fmt: skip
    pts = [(x, y) for x, y in zip(xs, predicted) if y is not None]
    ax.scatter([x for x, _ in pts], [y for _, y in pts], marker="_", s=400, color="black", label="lit-rl estimate")
    ax.set_xticks(list(xs), labels, fontsize="small")
    ax.set_ylabel("peak held by tensors, MiB")
    ax.set_title(f"{title}: peak by phase, vocab {p.vocab:,}, {p.length} completion tokens", fontsize="medium")
    ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def peak_vs_vocab(points: list[Point], length: int, png: Path, title: str) -> None:
    pts = sorted((p for p in points if p.length == length), key=lambda p: p.vocab)
    fig, (ax,) = _figure(5.5, 4.0)
    xs = [p.vocab for p in pts]
    for impl in IMPLEMENTATIONS:
        ax.plot(xs, [p.peak(impl) / MIB for p in pts], "o-", color=COLORS[impl], label=f"{impl} (measured)")
    ax.plot(xs, [max(p.predicted.values()) / MIB for p in pts], "x--", color="black", label="lit-rl estimate")
    ax.set_xlabel("vocabulary size")
    ax.set_ylabel("peak held by tensors, MiB")
    ax.set_title(f"{title}: peak vs vocabulary ({length} completion tokens)", fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def peak_and_time_vs_length(points: list[Point], vocab: int, png: Path, title: str) -> None:
    pts = sorted((p for p in points if p.vocab == vocab), key=lambda p: p.length)
    fig, (mem, sec) = _figure(10, 4.0, cols=2)
    xs = [p.length for p in pts]
    for impl in IMPLEMENTATIONS:
        mem.plot(xs, [p.peak(impl) / MIB for p in pts], "o-", color=COLORS[impl], label=impl)
        sec.plot(xs, [p.seconds[impl] for p in pts], "o-", color=COLORS[impl], label=impl)
    mem.plot(xs, [max(p.predicted.values()) / MIB for p in pts], "x--", color="black", label="lit-rl estimate")
    mem.set_ylabel("peak held by tensors, MiB (load-independent)")
    sec.set_ylabel("reference + update, s (depends on machine load)")
    for ax in (mem, sec):
        ax.set_xlabel("completion tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{title}: vocab {vocab:,}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def all_plots(
    points: list[Point], base_vocab: int, base_length: int, folder: Path, prefix: str, title: str
) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / f"{prefix}_peak_by_phase.png", folder / f"{prefix}_peak_vs_vocab.png",
             folder / f"{prefix}_vs_length.png"]  # fmt: skip
    peak_by_phase(points, files[0], title)
    peak_vs_vocab(points, base_length, files[1], title)
    peak_and_time_vs_length(points, base_vocab, files[2], title)
    return files
