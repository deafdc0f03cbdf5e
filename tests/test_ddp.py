"""Two processes on CPU (``ddp``, gloo) for two steps of each method, launched as a user would (``lit-rl fit`` with
``--trainer.devices 2``): parameters equal on both ranks afterwards, logged metrics the mean over ranks, each rank
its own disjoint draws of the (density-weighted) prompt stream, ``dapo`` normalised by the token count of the whole
step (both ranks), and the entropy-mask threshold taken over both ranks' tokens."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # two DDP ranks on gloo, launched through `lit-rl fit`

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
STEPS = 2


class RankRecorder(Callback):
    """Writes what this rank saw to ``out/rank<r>.pt``: prompt indices, its own metrics, ``dapo``'s normaliser and the
    local completion-token count of each step, and its trainable parameters at the end."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.seen: dict[str, list] = {"indices": [], "rewards": [], "num_items": [], "tokens": [], "pooled": []}

    def setup(self, trainer, pl_module, stage: str) -> None:
        import lit_rl.methods.grpo as grpo

        loss = grpo.grpo_loss

        def recording_loss(logp, old_logp, ref_logp, advantages, mask, **kwargs):
            self.seen["num_items"].append(float(kwargs["num_items_in_batch"]))
            self.seen["tokens"].append(float(mask.sum()))
            return loss(logp, old_logp, ref_logp, advantages, mask, **kwargs)

        grpo.grpo_loss = recording_loss  # this process's copy of the module only
        entropy_mask = grpo.high_entropy_mask

        def recording_mask(entropy, mask, quantile, *, pooled=None):
            self.seen["pooled"].append(None if pooled is None else pooled.numel())
            return entropy_mask(entropy, mask, quantile, pooled=pooled)

        grpo.high_entropy_mask = recording_mask

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen["indices"].append(batch["index"].tolist())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen["rewards"].append(pl_module.last_metrics["reward/mean"])

    def on_train_end(self, trainer, pl_module) -> None:
        params = {n: p.detach().clone() for n, p in pl_module.policy.named_parameters() if p.requires_grad}
        drawn = sum(len(i) for i in self.seen["indices"])
        stream = trainer.train_dataloader.sampler.global_stream(0, drawn * trainer.world_size)  # one process's draws
        torch.save({**self.seen, "params": params, "stream": stream}, self.out / f"rank{trainer.global_rank}.pt")


METHODS = {
    "grpo": (
        "grpo_tiny.yaml",
        [
            "--model.init_args.reward_funcs",
            "[test_resume.vowels]",  # density-weighted prompts
            "--data.init_args.sampler",
            "density",
            "--data.init_args.density_k",
            "3",
        ],
    ),
    # entropy masking takes one threshold over both ranks' tokens
    "intuitor": ("intuitor_tiny.yaml", ["--model.init_args.loss.top_entropy_quantile", "0.5"]),
    "gumbel_topk": ("gumbel_topk_tiny.yaml", []),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_two_processes_train_the_same_weights_on_disjoint_prompts(method, tmp_path):
    config, overrides = METHODS[method]
    recorder = {"class_path": "test_ddp.RankRecorder", "init_args": {"out": str(tmp_path)}}
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}}
    trainer = {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "use_distributed_sampler": False,
               "max_steps": STEPS, "limit_val_batches": 0, "enable_progress_bar": False, "enable_model_summary": False,
               "enable_checkpointing": False, "logger": logger, "callbacks": [recorder]}  # fmt: skip
    (tmp_path / "ddp.yaml").write_text(yaml.safe_dump({"trainer": trainer}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    args = ["fit", "--config", str(ROOT / "configs" / config), *overrides, "--config", str(tmp_path / "ddp.yaml")]
    run = subprocess.run([sys.executable, "-m", "lit_rl", *args], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    first, second = ranks[0]["params"], ranks[1]["params"]
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    # rank r takes draws r, r + 2, r + 4, ... of the one stream: disjoint draws that together are one process's
    drawn = [sum(r["indices"], []) for r in ranks]
    assert torch.equal(ranks[0]["stream"], ranks[1]["stream"]), "the ranks sample different streams"
    assert ranks[0]["stream"].tolist() == [drawn[g % 2][g // 2] for g in range(2 * len(drawn[0]))]
    logged = {}
    for row in csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()):
        if row.get("reward/mean"):
            logged[int(row["step"])] = float(row["reward/mean"])
    expected = {s: (ranks[0]["rewards"][s] + ranks[1]["rewards"][s]) / 2 for s in range(STEPS)}
    assert logged == pytest.approx(expected, rel=1e-6)
    if method != "gumbel_topk":  # dapo: every completion token of the step, on both ranks, weighs the same
        for step in range(STEPS):
            both = ranks[0]["tokens"][step] + ranks[1]["tokens"][step]
            assert ranks[0]["num_items"][step] == ranks[1]["num_items"][step] == both / 2
    if method == "intuitor":  # each micro-batch's entropy threshold came from both ranks' completion tokens
        assert ranks[0]["pooled"] and ranks[0]["pooled"] == ranks[1]["pooled"]
        assert ranks[0]["pooled"] == [a + b for a, b in zip(ranks[0]["tokens"], ranks[1]["tokens"], strict=True)]
