"""A lower-precision frozen reference for full fine-tuning: its bytes, and the error it puts in the KL term.

The default config's method is built twice from the same weights, once with the reference copy in the policy's
float32 (``reference_dtype: same``) and once in bfloat16; both score the same seeded rollout of the default task.
Reported: the reference copy's bytes (from the estimator's component table), the reference log-probs' difference
per completion token (mean and max |Δ log p|), and the KL term (k3, per token, as GRPO's loss computes it) of the
policy against each reference, at the first step (policy = reference: the float32 reference gives exactly 0, so
the bfloat16 one's value is its error floor) and after the policy's weights are moved by seeded noise of relative
size ``--noise`` (a policy some steps into training). Values do not depend on the machine's load.

    nice -n 10 python bench/bench_reference_dtype.py          # writes bench/results/reference_dtype.md
    python bench/bench_reference_dtype.py --quick             # tiny random model: a smoke test, nothing written
"""

from __future__ import annotations

import argparse

import harness
import torch

from lit_rl.cli import parse_fit_config
from lit_rl.losses import masked_mean
from lit_rl.memory import estimate_step

RESULTS = harness.ROOT / "bench" / "results" / "reference_dtype.md"


def _method(config: str, dtype: str):
    module, datamodule, _ = parse_fit_config(["--config", config, "--model.init_args.reference_dtype", dtype])
    module.setup("fit")
    datamodule.connect(module.tokenizer)
    datamodule.setup("fit")
    module.configure_model()
    return module, datamodule


def _k3(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    delta = ref - logp
    return float(masked_mean(delta.exp() - delta - 1, mask))


def measure(config: str, noise: float) -> dict:
    torch.manual_seed(0)
    same, datamodule = _method(config, "same")
    half, _ = _method(config, "bfloat16")
    half.policy.load_state_dict(same.policy.state_dict())
    half.reference.load_state_dict({k: v.to(torch.bfloat16) for k, v in same.reference.state_dict().items()})
    batch = next(iter(datamodule.train_dataloader()))
    torch.manual_seed(0)
    rollout, _ = same.rollout(batch)
    mask = rollout.completion_mask
    with torch.no_grad():
        ref32, ref16 = same.reference_logp(rollout), half.reference_logp(rollout)
        policy = same.micro_batched_stats(same.policy, rollout)[0]
        generator = torch.Generator().manual_seed(1)
        for p in same.policy.parameters():  # a policy some way from the reference
            p.add_(torch.randn(p.shape, generator=generator) * noise * p.abs().mean())
        moved = same.micro_batched_stats(same.policy, rollout)[0]
    diff = (ref16 - ref32).abs()[mask.bool()]
    batch_size, prompt_length = batch["input_ids"].shape
    sizes = {}
    for dtype in ("same", "bfloat16"):
        estimate = estimate_step(same, batch_size=batch_size, prompt_length=prompt_length, reference_dtype=dtype)
        row = next(c for c in estimate.components if c.name == "reference weights")
        sizes[dtype] = (row.bytes, estimate.peak_bytes)
    return {
        "tokens": int(mask.sum()),
        "mean_abs": float(diff.mean()),
        "max_abs": float(diff.max()),
        "kl_start": (_k3(policy, ref32, mask), _k3(policy, ref16, mask)),
        "kl_moved": (_k3(moved, ref32, mask), _k3(moved, ref16, mask)),
        "sizes": sizes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo.yaml")
    parser.add_argument("--noise", type=float, default=0.01)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    config = "configs/grpo_tiny.yaml" if args.quick else args.config
    loads = [harness.load_average()]
    r = measure(str(harness.ROOT / config), args.noise)
    loads.append(harness.load_average())
    (ref32, peak32), (ref16, peak16) = r["sizes"]["same"], r["sizes"]["bfloat16"]
    rel = abs(r["kl_moved"][1] - r["kl_moved"][0]) / r["kl_moved"][0] if r["kl_moved"][0] else float("nan")
    lines = harness.header_lines(
        "A bfloat16 frozen reference for full fine-tuning: bytes and KL error",
        "nice -n 10 python bench/bench_reference_dtype.py",
        loads=loads,
    )
    lines += [
        f"Config `{config}`: one seeded rollout, {r['tokens']} completion tokens, scored by a float32 and a bfloat16 "
        f"copy of the same reference weights. Moved policy: weights plus seeded noise of relative size {args.noise}.",
        "",
        "| reference_dtype | reference copy (MiB) | predicted step peak (GiB) | KL at the start | KL, moved policy |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| same (float32) | {ref32 / 2**20:.1f} | {peak32 / 2**30:.3f} | {r['kl_start'][0]:.2e} | {r['kl_moved'][0]:.4e} |",
        f"| bfloat16 | {ref16 / 2**20:.1f} | {peak16 / 2**30:.3f} | {r['kl_start'][1]:.2e} | {r['kl_moved'][1]:.4e} |",
        "",
        f"Reference log-probs, bfloat16 against float32: mean |Δ log p| {r['mean_abs']:.2e}, max {r['max_abs']:.2e} "
        f"per completion token; relative error of the moved policy's KL: {rel:.1%}.",
    ]
    print("\n".join(lines))
    if not args.quick:
        RESULTS.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
