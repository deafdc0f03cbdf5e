"""Which AdamW: state bytes, step time and drift from fp32 AdamW, on the trainable weights of a real model.

Each optimizer steps the same copy of the model's weights with the same seeded random gradients for ``--steps``
steps; what it holds afterwards is its state (bytes counted from the state tensors' storages, which do not depend
on the machine), its step time is the median over the steps after the first (the first also allocates the state,
and torchao compiles its step there; it is given separately), and its drift is how far its weights ended from
fp32 AdamW's, relative to how far fp32 AdamW moved them: ``|w - w_adamw| / |w_adamw - w_0|`` over all weights.

    nice -n 10 python bench/bench_optimizer.py            # embedded SmolLM2-135M, full fine-tuning, 20 steps
    nice -n 10 python bench/bench_optimizer.py --dtype bfloat16 --lr 1e-5   # bf16 weights (bf16-true), configs' lr
    python bench/bench_optimizer.py --quick               # tiny random model, 3 steps: a smoke test

With ``--dtype bfloat16`` the weights are bf16, as under ``trainer.precision: bf16-true``, and the drift is from fp32
AdamW stepping float32 copies of the same weights: what each optimizer's rounding loses. The rows are torch's fused
AdamW (bf16 state, weights rounded to nearest), lit-rl's default ``StochasticAdamW`` and the 8-bit step as lit-rl
runs it (both round stochastically); written to ``bench/results/optimizer_bf16.md`` and ``.json``.

torchao's ``AdamW8bit`` is measured where torchao is installed (it is no dependency of lit-rl); bitsandbytes' is
what ``--optimizer bitsandbytes.optim.AdamW8bit`` runs (the ``qlora`` extra). Writes
``bench/results/optimizer.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import harness
import torch

from lit_rl.memory import read_peak_rss, read_rss, reset_peak_rss
from lit_rl.models import build_optimizer, load_causal_lm, optimizer_class

CANDIDATES = {  # name: (import path, keyword arguments); lit-rl's rows are built as `lit-rl fit --optimizer` builds
    "torch AdamW (fused, fp32 state)": ("torch.optim.AdamW", {"fused": True}),
    "bitsandbytes AdamW8bit, whole tensors": ("bitsandbytes.optim.AdamW8bit", {}),
    "bitsandbytes AdamW8bit as lit-rl steps it": ("lit-rl:bitsandbytes.optim.AdamW8bit", {}),
    "torchao AdamW8bit": ("torchao.optim.AdamW8bit", {}),
}
BF16_CANDIDATES = {
    "torch AdamW (fused, rounds to nearest)": ("torch.optim.AdamW", {"fused": True}),
    "StochasticAdamW (lit-rl's default)": ("lit_rl.models.StochasticAdamW", {"fused": True}),
    "bitsandbytes AdamW8bit as lit-rl steps it": ("lit-rl:bitsandbytes.optim.AdamW8bit", {}),
}
RESULTS = harness.ROOT / "bench" / "results"
COLUMNS = (
    "optimizer | `--optimizer` | state (MiB) | bytes / weight | step scratch (MiB) | first step (s) | step (s, median) "
    "| drift | update kept"
).split(" | ")


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


def measure(path: str, kwargs: dict, start: list[torch.Tensor], steps: int, lr: float, dtype=torch.float32) -> dict:
    params = [torch.nn.Parameter(w.to(dtype, copy=True)) for w in start]
    if path.startswith("lit-rl:"):  # what --optimizer builds: on a CPU, bitsandbytes' 8-bit step in slices
        spec = {"class_path": path.removeprefix("lit-rl:"), "init_args": kwargs}
        optimizer = build_optimizer(spec, params, lr=lr, weight_decay=0.0)
    else:
        optimizer = optimizer_class(path)(params, lr=lr, weight_decay=0.0, **kwargs)
    generator = torch.Generator().manual_seed(0)
    times, scratch = [], []
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=generator) * 1e-3).to(dtype)
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


def _cells(r: dict) -> list[str]:
    if not r["installed"]:
        return [r["optimizer"], f"`{r['class_path']}`", "not installed", *[""] * 6]
    scratch = "n/a" if r["step_scratch_bytes"] is None else f"{r['step_scratch_bytes'] / 2**20:.0f}"
    return [
        r["optimizer"],
        f"`{r['class_path'].removeprefix('lit-rl:')}`",
        f"{r['state_bytes'] / 2**20:.1f}",
        f"{r['bytes_per_weight']:.3f}",
        scratch,
        f"{r['first_step_s']:.3f}",
        f"{r['step_s']:.3f}",
        f"{r['drift']:.4f}",
        f"{r['kept']:.3f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the weights' dtype")
    parser.add_argument("--quick", action="store_true", help="tiny random model, 3 steps, results not written")
    args = parser.parse_args()
    dtype, bf16 = getattr(torch, args.dtype), args.dtype == "bfloat16"
    model, steps = ("tiny:llama", 3) if args.quick else (args.model, args.steps)
    torch.manual_seed(0)
    start = [p.detach().clone() for p in load_causal_lm(model, dtype="float32").parameters() if p.requires_grad]
    n = sum(w.numel() for w in start)
    loads, rows = [harness.load_average()], []
    # the drift's reference: fp32 AdamW on float32 weights (the first row of the float32 table)
    reference = measure("torch.optim.AdamW", {"fused": True}, start, steps, args.lr)["weights"] if bf16 else None
    for name, (path, kwargs) in (BF16_CANDIDATES if bf16 else CANDIDATES).items():
        try:
            optimizer_class(path.removeprefix("lit-rl:"))
        except ValueError:  # its package is not installed
            rows.append({"optimizer": name, "class_path": path, "installed": False})
            continue
        result = measure(path, kwargs, start, steps, args.lr, dtype)
        weights = result.pop("weights")
        if reference is None:
            reference = weights
        moved = sum((r - w0).double().square().sum() for r, w0 in zip(reference, start)).sqrt()
        off = sum((w.double() - r.double()).square().sum() for w, r in zip(weights, reference)).sqrt()
        # the share of fp32 AdamW's update each one made, on average over the weights: its update projected on fp32's
        kept = sum(((w.double() - w0.to(dtype).double()) * (r - w0).double()).sum()
                   for w, r, w0 in zip(weights, reference, start)) / moved.square()  # fmt: skip
        rows.append({"optimizer": name, "class_path": path, "installed": True,
                     "bytes_per_weight": result["state_bytes"] / n, "drift": float(off / moved), "kept": float(kept),
                     **result})  # fmt: skip
    loads.append(harness.load_average())
    lines = harness.header_lines(
        f"{'AdamW on bf16 weights' if bf16 else '8-bit AdamW'}: state bytes, step time and drift from fp32 AdamW",
        f"nice -n 10 python bench/bench_optimizer.py{f' --dtype bfloat16 --lr {args.lr:g}' if bf16 else ''}",
        dists=("torch", "bitsandbytes", "torchao"),
        loads=loads,
    )
    lines += [
        f"Model `{model}`, full fine-tuning: {n:,} trained {args.dtype} weights, {steps} steps of seeded random "
        f"gradients (std 1e-3), lr {args.lr:g}. Tensor bytes do not depend on the machine; times do. Drift: distance of the weights "
        "from fp32 AdamW's after the steps, relative to the distance fp32 AdamW moved them. Step scratch: the most "
        "a step after the first raised peak RSS above the RSS it began with (the kernel's high-water mark, reset "
        "before each step): memory an operator allocates inside, which tensor accounting cannot see; it does not "
        "depend on load. Update kept: each optimizer's update projected on fp32 AdamW's, over the square of fp32 "
        "AdamW's: 1 where it moves the weights as far as fp32 AdamW does on average (its noise aside), below 1 where "
        "rounding loses updates.",
        "",
        *harness.markdown_table(COLUMNS, [_cells(r) for r in rows], align=["---", "---"] + ["---:"] * 7),
    ]
    print("\n".join(lines))
    if not args.quick:
        stem = "optimizer_bf16" if bf16 else "optimizer"
        (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
        (RESULTS / f"{stem}.json").write_text(json.dumps({"model": model, "weights": n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
