"""RunLog: where the run writes, progress lines, held-out lines and the end summary, read back from the log."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lit_rl.callbacks import MemoryProfiler, RunLog
from lit_rl.data import PromptDataModule
from lit_rl.methods import RefCachedGRPO


def test_run_log_says_where_everything_goes_progress_and_summary(tmp_path, lightning_log):
    method = RefCachedGRPO(
        name_or_path="tiny:llama", num_generations=2, max_new_tokens=4, metric_funcs=["lit_rl.data.rewards.number_only"]
    )
    data = PromptDataModule(num_prompts=64, batch_size=2, max_prompt_length=64, val_size=4)
    trainer = Trainer(
        accelerator="cpu", max_steps=3, val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        logger=TensorBoardLogger(tmp_path, name="run"),
        callbacks=[RunLog(every_n_steps=2, progress="always"), MemoryProfiler(predict=False),
                   ModelCheckpoint(save_weights_only=True)],
    )  # fmt: skip
    trainer.fit(method, data)
    text = lightning_log.text
    log_dir = trainer.log_dir
    start = next(m for m in lightning_log if m.startswith("run: 3 steps"))
    assert f"logs         {log_dir}" in start and f"{log_dir}/checkpoints" in start and "memory_summary.json" in start

    progress = [m for m in lightning_log if m.startswith("step ")]
    assert [line.split(" | ")[0] for line in progress] == ["step 1/3", "step 2/3", "step 3/3"]
    for line in progress:
        assert "reward " in line and "kl " in line and " s/step" in line and "(tensors)" in line, line

    held_out = [m for m in lightning_log if m.startswith("held-out after")]
    assert [line.split(":")[0] for line in held_out] == ["held-out after 0 steps", "held-out after 2 steps"]
    assert all("val/correct_answer" in line and "val/number_only" in line for line in held_out)

    summary = text[text.index("run finished after 3 steps") :]
    assert "reward       first" in summary and "held-out     after 0 steps" in summary and "after 2 steps" in summary
    assert "peak GiB     rollout" in summary and "(steady state, tensors)" in summary
    assert "checkpoint   " in summary and ".ckpt (" in summary


def test_run_log_rejects_bad_settings():
    with pytest.raises(MisconfigurationException, match="every_n_steps"):
        RunLog(every_n_steps=0)
    with pytest.raises(MisconfigurationException, match="progress"):
        RunLog(progress="sometimes")
