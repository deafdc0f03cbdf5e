"""The lit-rl command: help, config printing, overrides, and the error for a bad value."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit_rl.cli import LitRLCLI, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a CLI subprocess
def test_module_entry_point_prints_help():
    out = subprocess.run([sys.executable, "-m", "lit_rl", "--help"], capture_output=True, text=True, check=True)
    assert "fit" in out.stdout and "validate" in out.stdout


def test_model_help_lists_options_with_memory_effect(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--model.help", "RefCachedGRPO"])
    text = " ".join(capsys.readouterr().out.split())  # help text is wrapped to the terminal width
    assert "--model.loss.beta BETA" in text and "skips the reference pass entirely" in text


def test_print_config_applies_overrides(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs/grpo.yaml"), "--model.init_args.loss.beta", "0", "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["class_path"] == "lit_rl.methods.RefCachedGRPO"
    assert config["model"]["init_args"]["loss"]["beta"] == 0
    assert config["model"]["init_args"]["loss"]["epsilon_high"] == 0.28  # the rest of the config's group stays
    assert config["data"]["class_path"] == "lit_rl.data.PromptDataModule"


@pytest.mark.parametrize("config", ["grpo", "intuitor", "gumbel_topk"])
def test_every_callback_fragment_composes_through_the_command(config, capsys):
    # `callbacks+:` in a fragment appends to the config's list; the command's own checks must take it too
    fragments = sorted((ROOT / "callbacks").glob("*.yaml"))
    args = ["fit", "--config", str(ROOT / f"configs/{config}.yaml")]
    for fragment in fragments:
        args += ["--config", str(fragment)]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--print_config"])
    assert exit_.value.code in (0, None), capsys.readouterr().err
    callbacks = yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
    added = {c["class_path"].rsplit(".", 1)[-1] for c in callbacks}
    for fragment in fragments:
        wanted = yaml.safe_load(fragment.read_text())["trainer"]["callbacks+"]
        assert {c["class_path"].rsplit(".", 1)[-1] for c in wanted} <= added, fragment.name


def test_bad_value_fails_before_training():
    with pytest.raises(ValueError, match="num_generations: must be >= 2"):
        LitRLCLI(
            args=["--config", str(ROOT / "configs/grpo_tiny.yaml"), "--model.init_args.num_generations", "1"], run=False
        )


def test_embed_writes_the_cache_that_training_reuses_and_refuses_when_stale(tmp_path, monkeypatch):
    import json

    import lit_rl.data.density.pipeline as density  # where the pipeline looks embed_prompts up

    cache = tmp_path / "emb"
    data = ["--data.init_args.sampler", "density", "--data.init_args.density_cache_dir", str(cache),
            "--data.init_args.density_k", "3", "--data.init_args.num_prompts", "24",
            "--data.init_args.val_size", "0"]  # every prompt trains: the cache holds all 24  # fmt: skip
    main(["embed", "--config", str(ROOT / "configs/grpo_tiny.yaml"), *data])
    meta = json.loads((cache / "embeddings.json").read_text())
    assert meta["count"] == 24 and meta["pooling"] == "hidden" and (cache / "embeddings.npy").exists()

    def no_embedding(*args, **kwargs):
        raise AssertionError("the cached embeddings should have been reused")

    monkeypatch.setattr(density, "embed_prompts", no_embedding)
    fit = ["fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), *data, "--trainer.max_steps", "1",
           "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]  # fmt: skip
    cli = LitRLCLI(args=fit)
    assert cli.trainer.global_step == 1 and cli.datamodule.density_weights.shape == (24,)
    with pytest.raises(ValueError, match="lit-rl embed"):  # other prompts, same cache: stale, and says how to fix
        LitRLCLI(args=[*fit, "--data.init_args.difficulty", "3"])


def test_embed_rebuilds_a_stale_cache_and_fit_names_the_exact_rebuild_command(
    tmp_path, monkeypatch, lightning_log, capsys
):
    import json
    import shlex

    import lit_rl.data.density.pipeline as density  # where the pipeline looks embed_prompts up
    from lit_rl.data.density import StaleEmbeddingCacheError

    cache, config = tmp_path / "emb", str(ROOT / "configs/grpo_tiny.yaml")
    data = ["--data.init_args.sampler", "density", "--data.init_args.density_cache_dir", str(cache),
            "--data.init_args.density_k", "3", "--data.init_args.val_size", "0"]  # fmt: skip
    main(["embed", "--config", config, *data, "--data.init_args.num_prompts", "24"])

    # other prompts: `lit-rl embed` replaces the stale cache and says why, in one line
    main(["embed", "--config", config, *data, "--data.init_args.num_prompts", "32"])
    said = lightning_log.matching("stale embedding cache")
    assert len(said) == 1 and "count: cached 24 != expected 32" in said[0]
    assert json.loads((cache / "embeddings.json").read_text())["count"] == 32

    # `lit-rl fit` trains on the rebuilt cache without embedding again
    embed_prompts = density.embed_prompts

    def no_embedding(*args, **kwargs):
        raise AssertionError("the cached embeddings should have been reused")

    monkeypatch.setattr(density, "embed_prompts", no_embedding)
    fit = ["fit", "--config", config, *data, "--data.init_args.num_prompts", "32", "--trainer.max_steps", "1",
           "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false"]  # fmt: skip
    main(fit)
    assert list((tmp_path / "runs").rglob("events.out.tfevents.*")), "the fit run trained and logged"

    # a stale cache again: `lit-rl fit` refuses it with the command that rebuilds it, and that command works
    stale_fit = [*fit, "--data.init_args.difficulty", "3", "--ckpt_path", "null"]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/lit-rl", *stale_fit])
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:  # the console script answers in one line
        main()
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert stop.value.code == 2 and len(said) == 1 and "dataset_fingerprint" in said[0]
    assert said[0].startswith("error: data.density_cache_dir: the embedding cache ")
    command = said[0].split("rebuild it with: ")[1]
    with pytest.raises(StaleEmbeddingCacheError, match="dataset_fingerprint"):  # --debug lets the exception through
        main(["--debug", *stale_fit])
    expected = ["lit-rl", "embed", *stale_fit[1:-2]]  # `fit` -> `embed`, without the option embed does not take
    assert shlex.split(command) == expected
    monkeypatch.setattr(density, "embed_prompts", embed_prompts)
    before = json.loads((cache / "embeddings.json").read_text())["dataset_fingerprint"]
    main(shlex.split(command)[1:])
    assert json.loads((cache / "embeddings.json").read_text())["dataset_fingerprint"] != before


def test_enable_checkpointing_false_leaves_out_the_configs_model_checkpoint(tmp_path, lightning_log):
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True}}  # fmt: skip
    (tmp_path / "ckpt.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": [checkpoint]}}))
    main(["fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), "--config", str(tmp_path / "ckpt.yaml"),
          "--trainer.enable_checkpointing", "false", "--trainer.max_steps", "1", "--trainer.logger", "false",
          "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    said = lightning_log.matching("ModelCheckpoint")
    assert said == [
        "trainer.enable_checkpointing is false: the ModelCheckpoint callback of the config is left out; "
        "no checkpoint is written"
    ]
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.slow  # a CLI subprocess that trains a step
def test_a_run_prints_no_lightning_banner_advert_or_deprecation_notice(tmp_path):
    """Lightning's accelerator banner, its litlogger advert and torch's LeafSpec notice are not lit-rl's to print."""
    # with LoRA, peft imports bitsandbytes where it is installed, which logs a notice about an optional package; its
    # AdamW8bit (what the planner chooses) has an untyped tuple default that jsonargparse warns about when it writes
    # the run's config.yaml
    args = [sys.executable, "-m", "lit_rl", "fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"),
            "--model.init_args.lora", '{"r": 4}', "--optimizer", "bitsandbytes.optim.AdamW8bit",
            "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    run = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    # and no deprecation a library raises against another (transformers >= 5.24: `past_key_values`, and peft reading
    # `is_gradient_checkpointing`)
    noises = (
        "GPU available",
        "TPU available",
        "litlogger",
        "LeafSpec",
        "kernels-community",
        "FutureWarning",
        "round-trip",
    )
    for noise in noises:
        assert noise not in output, output
    assert "run finished after 1 steps" in output  # lit-rl's own lines stay


def test_a_step_bounded_run_draws_steps_not_epoch_minus_two_and_no_zero_flops_summary(tmp_path):
    from lightning.pytorch.callbacks import RichProgressBar

    from lit_rl.callbacks import StepProgressBar

    base = ["--config", str(ROOT / "configs/grpo_tiny.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    cli = LitRLCLI(args=base, run=False)
    bar = cli.trainer.progress_bar_callback
    assert type(bar) is StepProgressBar
    bar.setup(cli.trainer, cli.model, "fit")  # as Lightning does; during fit a step-bounded run has max_epochs -1
    cli.trainer.fit_loop.max_epochs = -1
    assert bar._get_train_description(0).strip() == "epoch 0, max_steps 3"
    assert not any(type(c).__name__.endswith("ModelSummary") for c in cli.trainer.callbacks)  # its FLOPs are all 0

    # a bar the config names is kept; an epoch-bounded run keeps Lightning's wording; no bar stays no bar
    named = LitRLCLI(args=[*base, "--trainer.callbacks+", "lightning.pytorch.callbacks.RichProgressBar"], run=False)
    assert type(named.trainer.progress_bar_callback) is RichProgressBar
    epochs = LitRLCLI(args=[*base, "--trainer.max_steps", "-1", "--trainer.max_epochs", "2"], run=False)
    epochs.trainer.progress_bar_callback.setup(epochs.trainer, epochs.model, "fit")
    assert epochs.trainer.progress_bar_callback._get_train_description(0).strip() == "Epoch 0/1"
    off = LitRLCLI(args=[*base, "--trainer.enable_progress_bar", "false"], run=False)
    assert off.trainer.progress_bar_callback is None
