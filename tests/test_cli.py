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
