"""The lit-rl command: help, config printing, overrides, and the error for a bad value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit_rl.cli import LitRLCLI, main

ROOT = Path(__file__).resolve().parents[1]


def test_module_entry_point_prints_help():
    out = subprocess.run([sys.executable, "-m", "lit_rl", "--help"], capture_output=True, text=True, check=True)
    assert "fit" in out.stdout and "validate" in out.stdout


def test_model_help_lists_options_with_memory_effect(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--model.help", "RefCachedGRPO"])
    text = " ".join(capsys.readouterr().out.split())  # help text is wrapped to the terminal width
    assert "--model.beta BETA" in text and "skips the reference pass entirely" in text


def test_print_config_applies_overrides(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs/grpo.yaml"), "--model.init_args.beta", "0", "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["class_path"] == "lit_rl.methods.RefCachedGRPO"
    assert config["model"]["init_args"]["beta"] == 0
    assert config["data"]["class_path"] == "lit_rl.data.PromptDataModule"


def test_bad_value_fails_before_training():
    with pytest.raises(ValueError, match="num_generations must be >= 2"):
        LitRLCLI(
            args=["--config", str(ROOT / "configs/grpo_tiny.yaml"), "--model.init_args.num_generations", "1"], run=False
        )


def test_embed_writes_the_cache_that_training_reuses_and_refuses_when_stale(tmp_path, monkeypatch):
    import json

    import lit_rl.data.density.pipeline as density  # where the pipeline looks embed_prompts up

    cache = tmp_path / "emb"
    data = ["--data.init_args.sampler", "density", "--data.init_args.density_cache_dir", str(cache),
            "--data.init_args.density_k", "3", "--data.init_args.num_prompts", "24"]  # fmt: skip
    main(["embed", "--config", str(ROOT / "configs/grpo_tiny.yaml"), *data])
    meta = json.loads((cache / "embeddings.json").read_text())
    assert meta["count"] == 24 and meta["pooling"] == "hidden" and (cache / "embeddings.npy").exists()

    def no_embedding(*args, **kwargs):
        raise AssertionError("the cached embeddings should have been reused")

    monkeypatch.setattr(density, "embed_prompts", no_embedding)
    fit = ["fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), *data, "--trainer.max_steps", "1",
           "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]  # fmt: skip
    cli = LitRLCLI(args=fit)
    assert cli.trainer.global_step == 1 and cli.datamodule.density_weights.shape == (24,)
    with pytest.raises(ValueError, match="lit-rl embed"):  # other prompts, same cache: stale, and says how to fix
        LitRLCLI(args=[*fit, "--data.init_args.difficulty", "3"])
