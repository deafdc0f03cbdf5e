"""Checkpoint and resume: a run killed with SIGKILL and resumed with ``--ckpt_path last`` ends where an uninterrupted run
ends (same trainable weights, same logged rewards), for each method; LoRA checkpoints hold the adapters only; non-finite
updates are skipped, then stop the run in one line while the last good checkpoint stays as it was."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from csv_logs import logged
from lightning.pytorch.callbacks import Callback

from lit_rl.cli import main

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
STEPS, KILLED_AT = 4, 2


def vowels(completions, **_):
    """A reward that differs between completions of a random model, so GRPO's advantages are not all zero."""
    return [sum(ch in "aeiou" for ch in c) / 8 for c in completions]


class KillAtStep(Callback):
    """SIGKILLs its own process when step ``step + 1`` starts: the checkpoint of step ``step`` is on disk (Lightning
    runs ModelCheckpoint after the other callbacks at a batch end), nothing of the next step is."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class NaNGradientsFrom(Callback):
    """From optimizer step ``step`` on, every gradient of the policy is NaN (as after an overflow)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for p in pl_module.policy.parameters():
                if p.requires_grad:
                    p.register_hook(lambda g: torch.full_like(g, float("nan")))


METHODS = {
    "grpo": ("grpo_tiny.yaml", ["--model.init_args.reward_funcs", "[test_resume.vowels]"]),
    "intuitor": ("intuitor_tiny.yaml", []),
    # 8-bit AdamW state (min_8bit_size 256: the tiny model's weights are under the default 4096) and a token budget
    "grpo_adamw8bit_tokens": ("grpo_tiny.yaml", ["--model.init_args.reward_funcs", "[test_resume.vowels]",
                                                 "--optimizer", "bitsandbytes.optim.AdamW8bit",
                                                 "--optimizer.min_8bit_size", "256",
                                                 "--model.init_args.micro_batch_tokens", "300"]),
    # a decaying tau, so the schedule's position is part of what must resume
    "gumbel_topk": ("gumbel_topk_tiny.yaml", ["--model.init_args.tau_schedule", "linear",
                                              "--model.init_args.tau_decay_steps", str(STEPS)]),
}  # fmt: skip


def _run_config(tmp_path: Path, name: str, callbacks: list[dict]) -> list[str]:
    """Overrides that checkpoint every step into ``tmp_path/name/ckpt`` and log every step to a CSV file there."""
    out = tmp_path / name
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(out / "ckpt"), "every_n_train_steps": 1, "save_last": True, "save_top_k": -1}}  # fmt: skip
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
              "init_args": {"save_dir": str(out), "name": "log", "flush_logs_every_n_steps": 1}}  # fmt: skip
    trainer = {"max_steps": STEPS, "deterministic": True, "enable_progress_bar": False, "enable_model_summary": False,
               "enable_checkpointing": True, "logger": logger, "callbacks": [checkpoint, *callbacks]}  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"trainer": trainer}))
    return ["--config", str(path)]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.mark.slow  # two whole fits, one a CLI subprocess killed part-way
@pytest.mark.parametrize("method", list(METHODS))
def test_a_killed_run_resumes_to_the_uninterrupted_result(method, tmp_path):
    config, overrides = METHODS[method]
    base = ["fit", "--config", str(ROOT / "configs" / config), *overrides]
    main([*base, *_run_config(tmp_path, "whole", [])])

    kill = {"class_path": "test_resume.KillAtStep", "init_args": {"step": KILLED_AT}}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-m", "lit_rl", *base, *_run_config(tmp_path, "cut", [kill])],
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    last = tmp_path / "cut" / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == KILLED_AT

    main([*base, *_run_config(tmp_path, "cut", []), "--ckpt_path", "last"])

    whole, resumed = _weights(tmp_path / "whole/ckpt/last.ckpt"), _weights(last)
    assert torch.load(last, weights_only=True)["global_step"] == STEPS
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole), "trainable weights differ after the resume"
    start = _weights(tmp_path / "whole" / "ckpt" / f"epoch=0-step={KILLED_AT}.ckpt")
    assert any(not torch.equal(start[k], whole[k]) for k in whole), "the steps after the kill changed the weights"
    rewards = logged(tmp_path / "whole", "reward/mean")
    assert sorted(rewards) == list(range(STEPS)) and len(set(rewards.values())) > 1
    assert logged(tmp_path / "cut", "reward/mean") == rewards
    if method == "gumbel_topk":
        taus = logged(tmp_path / "whole", "gumbel/tau")
        assert len(set(taus.values())) == STEPS and logged(tmp_path / "cut", "gumbel/tau") == taus


def test_lora_checkpoints_hold_the_adapters_and_resume(tmp_path):
    config = str(ROOT / "configs/grpo_tiny.yaml")
    base = ["fit", "--config", config, "--model.init_args.lora", "{r: 4, alpha: 8}"]
    main([*base, *_run_config(tmp_path, "lora", []), "--trainer.max_steps", "2"])
    checkpoint = torch.load(tmp_path / "lora/ckpt/last.ckpt", weights_only=True)
    keys = list(checkpoint["state_dict"])
    assert keys and all("lora_" in k for k in keys), [k for k in keys if "lora_" not in k][:5]
    adapters = sum(v.numel() for v in checkpoint["state_dict"].values())
    moments = sum(v.numel() for s in checkpoint["optimizer_states"][0]["state"].values() for v in s.values() if v.dim())
    assert moments == 2 * adapters  # AdamW's two moments of the adapters, nothing of the frozen base
    main([*base, *_run_config(tmp_path, "lora", []), "--ckpt_path", "last"])  # strict load: the base is rebuilt
    assert torch.load(tmp_path / "lora/ckpt/last.ckpt", weights_only=True)["global_step"] == STEPS


def test_non_finite_gradients_are_skipped_then_stop_the_run_and_keep_the_last_good_checkpoint(tmp_path, capsys):
    nan = {"class_path": "test_resume.NaNGradientsFrom", "init_args": {"step": 2}}
    args = ["fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), *_run_config(tmp_path, "nan", [nan]),
            "--model.init_args.reward_funcs", "[test_resume.vowels]", "--model.init_args.max_nonfinite_steps", "2"]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    assert "2 non-finite updates in a row (the last a gradient at step 3; the last finite step was 2 (loss=" in lines[0]
    assert "reward/mean=" in lines[0] and "lower model.learning_rate" in lines[0]
    last = torch.load(tmp_path / "nan/ckpt/last.ckpt", weights_only=True)
    assert last["global_step"] == 2 and last["lit_rl"]["nonfinite_in_a_row"] == 0
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())
    good = torch.load(tmp_path / "nan/ckpt/epoch=0-step=2.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(good[k], v) for k, v in last["state_dict"].items())
    skipped = logged(tmp_path / "nan", "train/nonfinite_steps")
    assert skipped and max(skipped.values()) == 1.0  # the first skip was logged; the second stopped the run
