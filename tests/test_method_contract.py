"""The fourth method of docs/adding-a-method.md, run from the page itself: a short fit, the MemoryProfiler's
per-step predictions, the estimator, held-out evaluation and EmptyCache's default, with no change to any of them.

If the documented code stops working with lit-rl (or the contract it is written against changes), this fails.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import LambdaCallback

from lit_rl.callbacks import EmptyCache, MemoryProfiler
from lit_rl.callbacks.empty_cache import default_phases
from lit_rl.data import PromptDataModule
from lit_rl.memory.estimate import estimate_step
from lit_rl.memory.host_allocator import why_not_glibc
from lit_rl.methods import RLMethod

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "adding-a-method.md"
PHASES = ["rollout", "policy_forward", "backward", "optimizer"]


def longer_is_better(completions, **_):
    return [float(len(c)) for c in completions]


def _section(heading: str) -> str:
    text = DOC.read_text()
    assert f"\n{heading}\n" in text, f"{DOC.name} has no {heading!r} section"
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def _blocks(heading: str, language: str) -> list[str]:
    blocks = re.findall(rf"```{language}\n(.*?)```", _section(heading), flags=re.S)
    assert blocks, f"no ```{language} block under {heading!r} in {DOC.name}"
    return blocks


@pytest.fixture(scope="module")
def documented(tmp_path_factory):
    """The page's code saved as ``reinforce_loo.py`` and imported, as the page tells a reader to do."""
    folder = tmp_path_factory.mktemp("documented_method")
    (folder / "reinforce_loo.py").write_text("\n".join(_blocks("## The code", "python")))
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("reinforce_loo"), folder
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("reinforce_loo", None)


def _method(module, **kw) -> RLMethod:
    return module.ReinforceLOO(
        name_or_path="tiny:llama", reward_funcs=["test_method_contract.longer_is_better"], num_samples=2,
        max_new_tokens=6, learning_rate=1e-2, **kw,
    )  # fmt: skip


def test_the_documented_method_trains_is_measured_predicted_evaluated_and_emptied(
    documented, quiet_trainer, capture_logger, tmp_path
):
    module, _ = documented
    method = _method(module, micro_batch_size=2)
    assert method.phase_names == tuple(PHASES)
    before = {}
    snapshot = LambdaCallback(
        on_train_start=lambda trainer, m: before.update({n: p.detach().clone() for n, p in m.policy.named_parameters()})
    )
    profiler, empty = MemoryProfiler(), EmptyCache()  # EmptyCache's default phases, as callbacks/empty_cache.yaml
    trainer = quiet_trainer(
        max_steps=2, logger=capture_logger, callbacks=[snapshot, profiler, empty], val_check_interval=2,
        check_val_every_n_epoch=None,
    )  # fmt: skip
    data = PromptDataModule(num_prompts=16, batch_size=2, max_prompt_length=64, val_size=2)
    trainer.fit(method, data)
    logged = capture_logger.metrics

    # it trains: the loss and reward are logged every step, and the update changed the weights
    assert len(logged["reward/mean"]) == 2 and all(torch.isfinite(torch.tensor(v)) for _, v in logged["loss"])
    changed = [n for n, p in method.policy.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "the optimizer step changed no weight"
    assert "reward" in trainer.progress_bar_metrics, "progress_bar_metrics puts reward/mean there as reward"

    # the MemoryProfiler charts its phases and predicts each step at the length it generated (rollout_shape)
    summary = json.loads((tmp_path / "memory_summary.json").read_text())
    assert list(summary["phases"]) == PHASES
    for phase in PHASES:
        predicted = logged[f"memory/{phase}/predicted_gib"][-1][1]
        measured = logged[f"memory/{phase}/peak_gib"][-1][1]
        assert predicted == pytest.approx(measured, rel=0.1), phase

    # held-out evaluation scores its reward function and generates rollout_shape().max_new_tokens tokens at most
    assert len(logged["val/longer_is_better"]) == 2, "before the first step and after step 2"
    assert all(1 <= v <= 6 for _, v in logged["val/completions/mean_length"])

    # EmptyCache's default releases after the phases before the update's forward: here the rollout
    assert default_phases(method.phases.names) == ("rollout",)
    if not why_not_glibc():  # '' where glibc serves malloc
        assert len(logged["memory/empty_cache/freed_gib"]) == 2, "released in each step"


def test_the_estimator_reads_the_documented_methods_rollout_shape(documented):
    module, _ = documented
    method = _method(module)
    estimate = estimate_step(method, batch_size=3, prompt_length=16)
    assert list(estimate.phases) == PHASES
    settings = estimate.settings
    assert (settings["num_generations"], settings["batch"], settings["max_new_tokens"]) == (2, 6, 6)
    assert estimate.component("saved activations (policy forward)").bytes > 0
    shorter = estimate_step(method, batch_size=3, prompt_length=16, max_new_tokens=2)  # what the profiler overrides
    assert shorter.settings["max_new_tokens"] == 2
    assert shorter.phases["policy_forward"] < estimate.phases["policy_forward"]


def test_the_documented_config_composes_with_the_callback_fragments(documented, tmp_path):
    from lit_rl.cli import LitRLCLI

    module, folder = documented
    (config,) = _blocks("## Running it", "yaml")
    path = folder / "rloo.yaml"
    path.write_text(config)
    args = ["--config", str(path)]
    for fragment in ("memory_profiler", "empty_cache"):
        args += ["--config", str(ROOT / "callbacks" / f"{fragment}.yaml")]
    args += ["--model.init_args.name_or_path", "tiny:llama", "--trainer.accelerator", "cpu",
             "--trainer.default_root_dir", str(tmp_path)]  # fmt: skip
    cli = LitRLCLI(args=args, run=False)
    assert type(cli.model).__name__ == "ReinforceLOO" and cli.model.hparams.num_samples == 4
    empty = next(c for c in cli.trainer.callbacks if isinstance(c, EmptyCache))
    empty.setup(cli.trainer, cli.model, "fit")  # the fragment's default phases fit this method too
    empty.teardown(cli.trainer, cli.model, "fit")


def test_the_documented_method_takes_the_contract_from_one_import(documented):
    """The page's code imports the contract from ``lit_rl.methods`` alone (the ops and model helpers from their own
    packages), and its step's passes are the base's default: no reference, no other pass, one update."""
    module, _ = documented
    code = "\n".join(_blocks("## The code", "python"))
    imported = re.findall(r"^from (lit_rl[\w.]*) import", code, flags=re.M)
    assert imported == ["lit_rl.methods", "lit_rl.models", "lit_rl.ops"], imported
    import lit_rl.methods

    assert {"RLMethod", "RolloutShape", "StepWork", "BACKWARD", "OPTIMIZER", "sample_completions"} <= set(
        lit_rl.methods.__all__
    )
    work = _method(module, micro_batch_size=2).step_work()
    assert (work.reference_pass, work.scoring_passes, work.iterations, work.micro_batch) == (False, 0, 1, 2)


def test_the_contract_names_only_what_the_base_has():
    """Every hook the base's docstring promises exists on RLMethod (the text cannot name a removed hook)."""
    doc = RLMethod.__doc__
    for name in ("phase_names", "train_step", "update", "rollout_shape", "step_work", "step_shape", "needs_reference",
                 "frozen_modules", "progress_bar_metrics", "memory_components", "as_reference", "configure_model",
                 "resolve_functions"):  # fmt: skip
        assert name in doc, name
        assert hasattr(RLMethod, name) or name == "step_shape", name
    assert "step_shape" in vars(_bare())


def _bare() -> RLMethod:
    return RLMethod(name_or_path="tiny:llama")
