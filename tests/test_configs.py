"""Every YAML in configs/ parses and trains one step with a tiny model swapped in; fragments compose."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from gsm8k_data import save_gsm8k

from lit_rl.cli import LitRLCLI

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
FRAGMENTS = sorted((ROOT / "callbacks").glob("*.yaml"))


def _tiny_overrides(config: Path, tmp_path: Path) -> list[str]:
    text = config.read_text()
    arch = "qwen2" if "qwen" in text.lower() else "llama"
    reward = ["--model.init_args.reward_model", f"tiny:{arch}"] if "reward_model:" in text else []
    source = yaml.safe_load(text)["data"]["init_args"].get("source", "arithmetic")
    if source not in ("arithmetic", "reviews"):  # a hub dataset: a saved copy of its shape, nothing downloaded
        pytest.importorskip("datasets", reason="a config on a Hugging Face dataset needs `pip install datasets`")
        reward += ["--data.init_args.source", str(save_gsm8k(tmp_path / "dataset", n=24))]
    return [*reward,
        "--model.init_args.name_or_path", f"tiny:{arch}",
        "--model.init_args.dtype", "float32",
        "--model.init_args.max_new_tokens", "4",
        "--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.max_steps", "1",
        "--trainer.devices", "1", "--trainer.strategy", "auto",  # the multi-GPU configs, as one CPU process
        "--trainer.enable_progress_bar", "false",
        *([] if "ModelCheckpoint" in text else ["--trainer.enable_checkpointing", "false"]),
        "--trainer.default_root_dir", str(tmp_path),  # moves logs, config and checkpoints
        *(["--trainer.logger.init_args.save_dir", str(tmp_path)] if "save_dir:" in text else []),
        "--data.init_args.batch_size", "2",
        "--data.init_args.density_cache_dir", str(tmp_path / "embeddings"),
    ]  # fmt: skip


def test_there_is_a_config_per_method():
    names = {c.stem for c in CONFIGS}
    assert {"grpo", "grpo_tiny", "grpo_lora", "grpo_density", "intuitor", "intuitor_tiny"} <= names
    assert {"gumbel_topk", "gumbel_topk_tiny", "gumbel_topk_lora"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_opens_with_its_command(config):
    head = config.read_text().splitlines()[:6]
    assert head[0].startswith("# "), "a config opens with a comment saying what it is for"
    assert any(f"--config configs/{config.name}" in line for line in head), "and the exact command that runs it"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_trains_one_step_with_a_tiny_model(config, tmp_path):
    cli = LitRLCLI(args=["fit", "--config", str(config), *_tiny_overrides(config, tmp_path)])
    assert cli.trainer.global_step == 1
    assert list(tmp_path.rglob("events.out.tfevents.*")), "TensorBoard event files are written"


def test_unknown_key_is_rejected_before_training(capsys):
    with pytest.raises(SystemExit):
        LitRLCLI(args=["fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), "--model.init_args.nope", "1"])
    assert "nope" in capsys.readouterr().err


def test_two_callback_fragments_compose(tmp_path):
    if len(FRAGMENTS) < 2:
        pytest.skip("fewer than two callback fragments")
    args = ["--config", str(ROOT / "configs/grpo_tiny.yaml")]
    for fragment in FRAGMENTS[:2]:
        args += ["--config", str(fragment)]
    cli = LitRLCLI(args=args, run=False)
    names = {type(cb).__name__ for cb in cli.trainer.callbacks}
    wanted = set()
    for fragment in FRAGMENTS[:2]:
        wanted |= {line.split(".")[-1].strip() for line in fragment.read_text().splitlines() if "class_path:" in line}
    assert wanted <= names, (wanted, names)
