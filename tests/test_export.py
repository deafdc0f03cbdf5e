"""lit-rl export: a checkpoint becomes a folder that from_pretrained (or peft) loads, with the trained weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lit_rl.cli import LitRLCLI, main
from lit_rl.models import load_causal_lm

ROOT = Path(__file__).resolve().parents[1]


def _train(tmp_path: Path, *extra: str):
    """One step of grpo_tiny with a checkpoint, whose trainable weights are then moved away from the start.

    A random tiny model earns no reward in one step (zero advantages, no gradient), so the checkpoint's weights
    are shifted by hand: what is exported must be what the checkpoint holds, not the model training started from.
    """
    cli = LitRLCLI(
        args=[
            "fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), "--model.init_args.max_new_tokens", "2",
            "--trainer.max_steps", "1", "--data.init_args.val_size", "1",
            "--trainer.enable_checkpointing", "true", "--trainer.enable_progress_bar", "false",
            "--trainer.val_check_interval", "1",  # the default ModelCheckpoint saves after each evaluation
            "--trainer.default_root_dir", str(tmp_path / "run"), *extra,
        ]
    )  # fmt: skip
    (ckpt,) = (tmp_path / "run").rglob("*.ckpt")
    checkpoint = torch.load(ckpt, weights_only=True)
    generator = torch.Generator().manual_seed(0)
    for value in checkpoint["state_dict"].values():
        if value.is_floating_point():
            value.add_(0.05 * torch.randn(value.shape, generator=generator))
    torch.save(checkpoint, ckpt)
    cli.model.load_state_dict(checkpoint["state_dict"])
    return cli.model, ckpt


def _untrained(method):
    """The model training started from (tiny:llama is seeded; its vocabulary follows the tokenizer)."""
    return load_causal_lm("tiny:llama", vocab_size=len(method.tokenizer)).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_export_full_fine_tuning_writes_the_trained_weights(tmp_path):
    method, ckpt = _train(tmp_path)
    main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "out")])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.randint(3, 90, (2, 7))
    trained = _logits(method.policy.eval(), ids)
    assert torch.allclose(_logits(exported, ids), trained, atol=1e-5)
    assert not torch.allclose(_logits(_untrained(method), ids), trained, atol=1e-3), "the export holds trained weights"
    assert (tmp_path / "out" / "tokenizer_config.json").exists()
    with pytest.raises(SystemExit):  # not empty: refused in one line
        main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "out")])


def test_export_lora_merged_or_as_adapter(tmp_path):
    from peft import PeftModel

    method, ckpt = _train(tmp_path, "--model.init_args.lora.r", "4", "--model.init_args.lora.alpha", "8")
    ids = torch.randint(3, 90, (2, 7))
    trained = _logits(method.policy.eval(), ids)
    main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "merged")])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(_logits(merged, ids), trained, atol=1e-5)

    main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "adapter"), "--adapter"])
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    adapted = PeftModel.from_pretrained(_untrained(method), tmp_path / "adapter")
    assert torch.allclose(_logits(adapted, ids), trained, atol=1e-5)


def test_help_lists_every_subcommand(capsys):
    from lit_rl.cli import EXTRA_SUBCOMMANDS

    main(["--help"])
    out = capsys.readouterr().out
    for name in ("fit", "validate", "test", "predict", *EXTRA_SUBCOMMANDS):
        assert f"\n    {name} " in out, name
    assert set(EXTRA_SUBCOMMANDS) == {"estimate", "embed", "reward-model", "export", "rates"}
