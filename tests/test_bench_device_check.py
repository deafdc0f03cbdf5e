"""bench/device_check.py --quick runs end to end on a CPU, so the GPU check cannot rot before a GPU is at hand.

At tiny shapes the figures mean nothing; what is checked is that every part runs, that each one that needs CUDA says
so instead of failing silently, and that the table is rendered from the JSON the run wrote. On a CPU the profiler's
tensor accounting and the estimator count the same tensors, so the predicted peaks agree closely there too.
"""

from __future__ import annotations

import json
import os

import pytest
from bench_loader import load_bench

pytestmark = [pytest.mark.bench, pytest.mark.slow]


LEAKED: dict[str, str] = {}  # environment variables the run left behind


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check") / "gpu.md"
    before = dict(os.environ)
    with load_bench("device_check.py") as module:
        results = module.main(["--quick", "--out", str(out), "--workdir", str(out.parent / "runs")])
        rendered = module.render(json.loads(out.with_suffix(".json").read_text()))
    LEAKED.update({k: v for k, v in os.environ.items() if before.get(k) != v})
    return results, out, rendered


def test_every_part_ran_and_the_run_finished(run):
    results, out, rendered = run
    assert results["finished"] is True
    assert out.read_text() == rendered  # the table is the JSON's, so --render rebuilds it exactly
    assert "stopped before it finished" not in rendered
    assert set(results["peaks"]) == {f"{m} / {c}" for m in ("grpo", "intuitor", "gumbel_topk")
                                     for c in ("tiny full FT fp32", "tiny LoRA bf16", "tiny LoRA NF4")}  # fmt: skip


def test_the_devices_rates_are_saved_as_a_file_the_planner_reads(run):
    results, out, rendered = run
    entry = results["rates"]["cpu"]  # a CPU run measures the CPU's: a GPU run's are the cuda ones
    path = out.with_name("gpu_rates.json")
    assert entry["file"] == path.name and path.is_file() and f"saved as `{path.name}`" in rendered
    rates = json.loads(path.read_text())
    assert rates["device"] == "cpu" and set(rates["dtypes"]) == {"float32", "bfloat16"}
    assert rates["bandwidth_bytes_per_s"] > 0 and any("GB/s" in line for line in entry["lines"])


def test_peaks_have_every_phase_measured_and_predicted(run):
    results, _, _ = run
    for key, entry in results["peaks"].items():
        assert "phases" in entry, (key, entry)
        phases = {row["phase"] for row in entry["phases"]}
        expected = {"generate", "reward", "backward", "optimizer"} if key.startswith("gumbel_topk") else {
            "rollout", "reference", "policy_forward", "backward", "optimizer"}  # fmt: skip
        assert phases == expected, key
        if not key.startswith("gumbel_topk"):  # the sampled methods log the sampler's gap every step
            assert len(entry["sampler_gap"]) == 2 and "rollout/sampler_k3" in entry["sampler_gap"][0], key
        for row in entry["phases"]:
            assert row["allocated_gib"] > 0 and row["predicted_gib"] > 0, (key, row)
            assert abs(row["error_pct"]) < 10, (key, row)


def test_decode_tactics_and_oom_report_what_needs_cuda(run):
    results, _, rendered = run
    decode = results["decode"]["tiny:qwen2 bfloat16"]
    for side in ("generate", "own", "compiled", "lean"):
        assert decode["lengths"]["8"][side]["tokens_per_s"] > 0, side
    assert results["decode"]["bandwidth"]["copy_bytes_per_s"] > 0
    tactics = results["tactics"]
    assert "phases" in tactics["grpo / tiny LoRA bf16 / none"]
    assert "phases" in tactics["grpo / tiny LoRA bf16 / EmptyCache"]
    assert "GPU" in tactics["grpo / tiny LoRA bf16 / ActivationOffloading"]["error"]  # refused on a CPU, in one line
    assert len(tactics) == 3  # host memory for the weights and AdamW state is FSDP2's cpu_offload: the fsdp2 part
    assert results["oom"]["oversized step"] == {"skipped": "needs CUDA (set_per_process_memory_fraction)"}
    assert "## The OOM report" in rendered and "## The sampler against the trainer" in rendered


def test_fsdp2_in_one_process_trains_what_the_run_without_a_strategy_trains(run):
    """On a CPU, gloo in one process: the same weights after the same steps, bitwise, and the update is not zero
    (the comparison would prove nothing if nothing moved); cpu_offload is refused on a CPU run."""
    results, _, rendered = run
    fsdp2 = results["fsdp2"]
    plain, sharded = fsdp2["grpo / tiny full FT fp32 / one device"], fsdp2["grpo / tiny full FT fp32 / FSDP2"]
    assert plain["max_abs_update"] > 0 and sharded["max_abs_update"] == plain["max_abs_update"]
    assert sharded["max_abs_weight_diff"] == 0.0
    assert "accelerator" in fsdp2["grpo / tiny full FT fp32 / FSDP2 cpu_offload"]["skipped"]
    assert "## FSDP2 in one process against no strategy" in rendered
    # Lightning's process group set MASTER_PORT in this process: a later child inheriting it bound a taken port
    distributed = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"}
    assert not distributed & set(LEAKED), LEAKED


def test_worker_predictions_are_the_profilers_own(tmp_path):
    """The check predicts beside the GPU, in worker processes; what it computes must be what the profiler computes
    for the same step inside the training loop."""
    import lightning as L

    from lit_rl.callbacks import MemoryProfiler

    with load_bench("device_check.py") as module:
        case, sizes = module.QUICK[0], module.QUICK_SIZES
        profiler, shapes = MemoryProfiler(every_n_steps=1), module.StepShapes()
        trainer = L.Trainer(
            accelerator="cpu", precision=case.precision, max_steps=2, logger=False, callbacks=[profiler, shapes],
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            num_sanity_val_steps=0, default_root_dir=str(tmp_path),
        )  # fmt: skip
        trainer.fit(module._method("grpo", case, sizes), module._data(sizes))
        assert profiler.last_record["step"] == 1 and len(shapes.shapes) == 2
        assert module.predict("grpo", case, sizes, None, shapes.shapes[-1], "cpu") == profiler.last_record["predicted"]


def test_trl_side_by_side_runs_both_sides(run):
    pytest.importorskip("trl", reason="TRL is not installed: pip install -e '.[dev]' installs it")
    results, _, rendered = run
    entry = results["vs_trl"]["tiny LoRA, 4 tokens, fp32"]
    for side in ("lit-rl", "trl", "lit-rl planned"):
        assert entry[side]["step_s"] > 0, (side, entry)
    assert "## lit-rl against TRL's GRPOTrainer, equal work" in rendered
    # the planner's run: on a CPU its budget is half TRL's peak RSS, far above the tiny model's tensors, so every
    # candidate fits and the plan is the fastest at this machine's rates: the config as it is, or a faster setting
    # (bf16 where the CPU has bf16 matrix instructions), and the fit with the plan file applied trains
    plan = entry["plan"]
    assert plan["budget_from"] == "peak_rss_gib" and plan["budget_gib"] == entry["trl"]["peak_rss_gib"] / 2
    assert (plan["plan"] == "the config as it is") == (plan["time"] == "1.00x"), plan
    assert plan["time"] == "n/m" or float(plan["time"].removesuffix("x")) <= 1.0, plan  # n/m: a 4-bit base
    assert "### lit-rl planned for half of TRL's peak" in rendered
    assert (
        f"| tiny LoRA, 4 tokens, fp32 | {plan['budget_gib']:.3f} | {plan['plan']} | {plan['predicted']} |" in rendered
    )


def test_predictions_a_stopped_run_missed_are_made_from_its_json(run, tmp_path):
    """A run whose time limit fell in the wait for its workers keeps its measurements; ``--render --predict-missing``
    makes the same predictions later, from the recorded shapes, and says so in the table."""
    _, out, _ = run
    results = json.loads(out.with_suffix(".json").read_text())
    chosen = [("peaks", "intuitor / tiny LoRA bf16"), ("tactics", "grpo / tiny LoRA bf16 / EmptyCache")]
    expected = {}
    for part, key in chosen:
        for row in results[part][key]["phases"]:
            expected[part, key, row["phase"]] = row["predicted_gib"]
            row["predicted_gib"] = row["error_pct"] = None
    results["finished"] = False
    stopped = tmp_path / "stopped.json"
    stopped.write_text(json.dumps(results))
    with load_bench("device_check.py") as module:
        module.main(["--quick", "--render", str(stopped), "--predict-missing", "--workers", "1",
                     "--out", str(tmp_path / "gpu.md")])  # fmt: skip
    filled = json.loads(stopped.read_text())
    assert filled["predicted_later"]["entries"] == [key for _, key in chosen]
    for (part, key, phase), value in expected.items():
        row = next(r for r in filled[part][key]["phases"] if r["phase"] == phase)
        assert value > 0 and row["predicted_gib"] == pytest.approx(value, rel=1e-12), (part, key, phase)
    assert "Predicted later" in (tmp_path / "gpu.md").read_text()
