"""Which 8-bit AdamW: state bytes, step time and drift from fp32 AdamW, on the trainable weights of a real model.

Each optimizer steps the same copy of the model's weights with the same seeded random gradients for ``--steps``
steps; what it holds afterwards is its state (bytes counted from the state tensors' storages, which do not depend
on the machine), its step time is the median over the steps after the first (the first also allocates the state,
and torchao compiles its step there; it is given separately), and its drift is how far its weights ended from
fp32 AdamW's, relative to how far fp32 AdamW moved them: ``|w - w_adamw| / |w_adamw - w_0|`` over all weights.

    nice -n 10 python bench/bench_optimizer.py            # embedded SmolLM2-135M, full fine-tuning, 20 steps
    python bench/bench_optimizer.py --quick               # tiny random model, 3 steps: a smoke test

torchao's ``AdamW8bit`` is measured where torchao is installed (it is no dependency of lit-rl); bitsandbytes' is
what ``--optimizer bitsandbytes.optim.AdamW8bit`` runs (the ``qlora`` extra). Writes
``bench/results/optimizer.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import time

import harness
import torch

from lit_rl.memory import read_peak_rss, read_rss, reset_peak_rss
from lit_rl.models import build_optimizer, load_causal_lm

CANDIDATES = {  # name: (import path, keyword arguments); lit-rl's rows are built as `lit-rl fit --optimizer` builds
    "torch AdamW (fused, fp32 state)": ("torch.optim.AdamW", {"fused": True}),
    "bitsandbytes AdamW8bit, whole tensors": ("bitsandbytes.optim.AdamW8bit", {}),
    "bitsandbytes AdamW8bit as lit-rl steps it": ("lit-rl:bitsandbytes.optim.AdamW8bit", {}),
    "torchao AdamW8bit": ("torchao.optim.AdamW8bit", {}),
}
RESULTS = harness.ROOT / "bench" / "results"


def _import(path: str):
    if path.startswith("lit-rl:"):  # what --optimizer builds: on a CPU, bitsandbytes' 8-bit step in slices
        spec = {"class_path": path.removeprefix("lit-rl:")}
        return None if _import(spec["class_path"]) is None else functools.partial(_built, spec)
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def _built(spec: dict, params, *, lr: float, weight_decay: float, **kwargs) -> torch.optim.Optimizer:
    return build_optimizer({**spec, "init_args": kwargs}, params, lr=lr, weight_decay=weight_decay)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    tensors = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    seen, total = set(), 0
    for t in tensors:  # torchao's state is a tensor subclass holding codes and scales: count what it holds
        parts = [getattr(t, name) for name in getattr(t, "__tensor_flatten__", lambda: ([], None))()[0]] or [t]
        for part in parts:
            storage = part.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def measure(cls, kwargs: dict, start: list[torch.Tensor], steps: int, lr: float) -> dict:
    params = [torch.nn.Parameter(w.clone()) for w in start]
    optimizer = cls(params, lr=lr, weight_decay=0.0, **kwargs)
    generator = torch.Generator().manual_seed(0)
    times, scratch = [], []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator) * 1e-3
        before = read_rss() if reset_peak_rss() else None
        began = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - began)
        if before is not None:  # what the step held beyond what was resident when it began
            scratch.append(read_peak_rss("vmhwm") - before)
    return {
        "step_scratch_bytes": max(scratch[1:]) if len(scratch) > 1 else None,
        "weights": [p.detach() for p in params],
        "state_bytes": _state_bytes(optimizer),
        "first_step_s": times[0],
        "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--quick", action="store_true", help="tiny random model, 3 steps, results not written")
    args = parser.parse_args()
    model, steps = ("tiny:llama", 3) if args.quick else (args.model, args.steps)
    torch.manual_seed(0)
    start = [p.detach().clone() for p in load_causal_lm(model, dtype="float32").parameters() if p.requires_grad]
    n = sum(w.numel() for w in start)
    loads, rows = [harness.load_average()], []
    reference = None
    for name, (path, kwargs) in CANDIDATES.items():
        cls = _import(path)
        if cls is None:
            rows.append({"optimizer": name, "class_path": path, "installed": False})
            continue
        result = measure(cls, kwargs, start, steps, args.lr)
        weights = result.pop("weights")
        if reference is None:
            reference = weights
        moved = sum((r - w0).double().square().sum() for r, w0 in zip(reference, start)).sqrt()
        off = sum((w - r).double().square().sum() for w, r in zip(weights, reference)).sqrt()
        rows.append({"optimizer": name, "class_path": path, "installed": True,
                     "bytes_per_weight": result["state_bytes"] / n, "drift": float(off / moved), **result})  # fmt: skip
    loads.append(harness.load_average())
    lines = harness.header_lines(
        "8-bit AdamW: state bytes, step time and drift from fp32 AdamW",
        "nice -n 10 python bench/bench_optimizer.py",
        dists=("torch", "bitsandbytes", "torchao"),
        loads=loads,
    )
    lines += [
        f"Model `{model}`, full fine-tuning: {n:,} trained weights, {steps} steps of seeded random gradients (std "
        f"1e-3), lr {args.lr}. Tensor bytes do not depend on the machine; times do. Drift: distance of the weights "
        "from fp32 AdamW's after the steps, relative to the distance fp32 AdamW moved them. Step scratch: the most "
        "a step after the first raised peak RSS above the RSS it began with (the kernel's high-water mark, reset "
        "before each step): memory an operator allocates inside, which tensor accounting cannot see; it does not "
        "depend on load.",
        "",
        "| optimizer | `--optimizer` | state (MiB) | bytes / weight | step scratch (MiB) | first step (s) "
        "| step (s, median) | drift |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if not r["installed"]:
            lines.append(f"| {r['optimizer']} | `{r['class_path']}` | not installed | | | | | |")
            continue
        scratch = "n/a" if r["step_scratch_bytes"] is None else f"{r['step_scratch_bytes'] / 2**20:.0f}"
        lines.append(
            f"| {r['optimizer']} | `{r['class_path'].removeprefix('lit-rl:')}` | {r['state_bytes'] / 2**20:.1f} "
            f"| {r['bytes_per_weight']:.3f} | {scratch} | {r['first_step_s']:.3f} | {r['step_s']:.3f} | {r['drift']:.4f} |"
        )
    print("\n".join(lines))
    if not args.quick:
        (RESULTS / "optimizer.md").write_text("\n".join(lines) + "\n")
        (RESULTS / "optimizer.json").write_text(json.dumps({"model": model, "weights": n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
