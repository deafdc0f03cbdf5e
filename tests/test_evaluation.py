"""Held-out evaluation: the split, pass@k, val/ metrics before and during training, and validate/test from the CLI."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lit_rl.cli import LitRLCLI
from lit_rl.data import PromptDataModule
from lit_rl.data.heldout import split_held_out
from lit_rl.data.tasks import arithmetic_prompts
from lit_rl.methods import RefCachedGRPO
from lit_rl.methods.evaluation import EvalSettings, pass_at_k, pass_ks

ROOT = Path(__file__).resolve().parents[1]


def test_pass_at_k_is_the_unbiased_estimator():
    c = torch.tensor([0, 1, 2, 4])
    assert pass_at_k(4, c, 1).tolist() == pytest.approx([0, 0.25, 0.5, 1])  # k = 1: the mean
    assert pass_at_k(4, c, 2).tolist() == pytest.approx([0, 1 - 3 / 6, 1 - 1 / 6, 1])  # 1 - C(n-c, k) / C(n, k)
    assert pass_at_k(4, c, 4).tolist() == [0, 1, 1, 1]  # k = n: any sample passed
    assert pass_ks(1) == [] and pass_ks(4) == [2, 4] and pass_ks(6) == [2, 4, 6]
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, c, 3)


def test_held_out_split_is_disjoint_by_prompt_text_and_deterministic():
    records = arithmetic_prompts(500, difficulty=1, seed=0)  # single-digit addition: 81 distinct questions
    train, held = split_held_out(records, 20, seed=0)
    assert len(held) == len({r["prompt"] for r in held}) == 20
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}, "no held-out question is trained on"
    assert len(train) + sum(1 for r in records if r["prompt"] in {h["prompt"] for h in held}) == len(records)
    assert split_held_out(records, 20, seed=0) == (train, held)
    with pytest.raises(ValueError, match="only 81 distinct prompts"):
        split_held_out(records, 81)


def test_eval_settings_refuse_k_identical_greedy_samples():
    with pytest.raises(ValueError, match="temperature > 0"):
        EvalSettings(num_samples=4, temperature=0.0)
    with pytest.raises(ValueError, match="set one of them"):
        PromptDataModule(val_size=4, val_source="held_out.jsonl")


def test_held_out_scores_before_and_during_training(capture_logger, quiet_trainer):
    method = RefCachedGRPO(
        name_or_path="tiny:llama", num_generations=2, max_new_tokens=4,
        metric_funcs=["lit_rl.data.rewards.number_only"],
        evaluation=EvalSettings(num_samples=4, temperature=1.0),
    )  # fmt: skip
    data = PromptDataModule(num_prompts=64, batch_size=2, max_prompt_length=64, val_size=6, val_batch_size=4)
    trainer = quiet_trainer(max_steps=3, val_check_interval=2, check_val_every_n_epoch=None, logger=capture_logger)
    trainer.fit(method, data)
    logged = capture_logger.metrics
    for name in ("correct_answer", "number_only"):
        steps = [s for s, _ in logged[f"val/{name}"]]
        assert steps == [0, 1], "before the first step, and after step 2 (logged with that step's metrics)"
        for k in (2, 4):
            pass_k = [v for _, v in logged[f"val/{name}/pass@{k}"]]
            mean = [v for _, v in logged[f"val/{name}"]]
            assert all(p >= m - 1e-6 for p, m in zip(pass_k, mean)), "pass@k is at least the mean score"
    lengths = [v for _, v in logged["val/completions/mean_length"]]
    assert all(1 <= v <= 4 for v in lengths)
    held = {r["prompt"] for r in data.held_out_records()}
    assert len(held) == 6 and not held & {r["prompt"] for r in data.records}


@pytest.mark.parametrize("config", ["grpo_tiny", "intuitor_tiny", "gumbel_topk_tiny"])
def test_every_method_validates_and_tests_from_the_cli(config, tmp_path):
    args = [
        "--config", str(ROOT / "configs" / f"{config}.yaml"),
        "--model.init_args.max_new_tokens", "3",
        "--data.init_args.val_size", "3", "--data.init_args.val_batch_size", "3",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    for subcommand, prefix in (("validate", "val"), ("test", "test")):
        cli = LitRLCLI(args=[subcommand, *args])
        scores = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith(f"{prefix}/")}
        assert f"{prefix}/correct_answer" in scores, scores
        assert all(math.isfinite(v) for v in scores.values())
