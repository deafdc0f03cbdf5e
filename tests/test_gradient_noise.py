"""GradientNoise draws a method's gradient again for the same batch: its figures are the plain float64 statistics of
those draws, and a run with it trains exactly as one without it."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_rl.callbacks import GradientNoise
from lit_rl.callbacks.gradient_noise import measure
from lit_rl.data import PromptDataModule
from lit_rl.methods import GumbelTopK, RefCachedGRPO

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def longer_is_better(completions, **_):
    return [float(len(c)) for c in completions]


def _method(name: str):
    if name == "grpo":
        return RefCachedGRPO(name_or_path="tiny:llama", reward_funcs=["test_gradient_noise.longer_is_better"],
                             num_generations=3, max_new_tokens=4, learning_rate=1e-2)  # fmt: skip
    return GumbelTopK(name_or_path="tiny:llama", reward_model="tiny:llama", max_new_tokens=3, learning_rate=1e-2)


def _batch(method):
    data = PromptDataModule(num_prompts=8, batch_size=2, max_prompt_length=64)
    data.tokenizer = method.tokenizer
    data.setup("fit")
    return next(iter(data.train_dataloader()))


@pytest.mark.parametrize("name", ["grpo", "gumbel_topk"])
def test_the_figures_are_the_statistics_of_the_draws_in_float64(name):
    method = _method(name)
    method.setup("fit")
    method.configure_model()
    method.attach_optimizer(method.configure_optimizers())
    batch = _batch(method)
    weights = {n: p.detach().clone() for n, p in method.named_parameters()}
    state = torch.random.get_rng_state()
    got = measure(method, batch, samples=4, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)  # the run's random state is as it was
    assert all(torch.equal(p, weights[n]) for n, p in method.named_parameters())  # nothing was trained

    draws = []  # the same draws, kept whole
    optimizer = method.optimizer()
    params = [p for p in method.parameters() if p.requires_grad]
    optimizer.step = lambda *a, **k: draws.append(torch.cat([p.grad.double().flatten() for p in params]))
    method.hparams.max_grad_norm = 0.0
    for k in range(4):
        torch.manual_seed(7 + k)
        method.train_step(batch)
    del optimizer.step
    g = torch.stack(draws)  # [K, N]
    mean = g.mean(0)
    assert (g[0] != g[1]).any()  # the draws differ, so the variance can be wrong
    relative_variance = g.var(0, unbiased=True).sum() / mean.pow(2).sum()
    pairs = [g[i] @ g[j] for i in range(4) for j in range(4) if i != j]
    agreement = torch.stack(pairs).mean() / g.pow(2).sum(1).mean()
    assert got["grad/relative_variance"] == pytest.approx(relative_variance.item(), rel=1e-5)
    assert got["grad/agreement"] == pytest.approx(agreement.item(), rel=1e-5, abs=1e-7)
    assert got["grad/mean_norm"] == pytest.approx(mean.norm().item(), rel=1e-5)


@pytest.mark.parametrize("name", ["grpo", "gumbel_topk"])
def test_a_run_with_it_trains_exactly_as_one_without(name, capture_logger, tmp_path):
    def fit(callbacks, logger):
        L.seed_everything(0)
        method = _method(name)
        trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=logger, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                            default_root_dir=tmp_path, callbacks=callbacks)  # fmt: skip
        trainer.fit(method, PromptDataModule(num_prompts=8, batch_size=2, max_prompt_length=64))
        return {n: p.detach().clone() for n, p in method.named_parameters() if p.requires_grad}

    plain = fit([], False)
    measured = fit([GradientNoise(samples=3, every_n_steps=1)], capture_logger)
    assert all(torch.equal(plain[n], measured[n]) for n in plain)
    logged = capture_logger.metrics
    assert [s for s, _ in logged["grad/relative_variance"]] == [0, 1]  # before each of the two steps
    assert all(v > 0 for _, v in logged["grad/relative_variance"])
    assert all(-1 <= v <= 1 for _, v in logged["grad/agreement"])


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="samples: must be >= 2"):
        GradientNoise(samples=1)
    with pytest.raises(ValueError, match="every_n_steps: must be >= 0"):
        GradientNoise(every_n_steps=-1)


def test_a_batch_without_gradient_reports_no_ratios():
    """All rewards equal and no KL yet: every draw is zero, and the ratios say so rather than divide by zero."""
    method = RefCachedGRPO(name_or_path="tiny:llama", reward_funcs=["test_gradient_noise.constant"],
                           num_generations=2, max_new_tokens=3, learning_rate=1e-2)  # fmt: skip
    method.setup("fit")
    method.configure_model()
    method.attach_optimizer(method.configure_optimizers())
    got = measure(method, _batch(method), samples=2, seed=0)
    assert got["grad/mean_norm"] == 0 and all(v != v for k, v in got.items() if k != "grad/mean_norm")


def constant(completions, **_):
    return [1.0] * len(completions)
