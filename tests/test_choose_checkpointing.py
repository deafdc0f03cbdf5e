"""choose_checkpointing: the least activation checkpointing that fits a budget, checked against every every_n_layers
of an 8-layer tiny model and against a real step run with the chosen setting."""

from __future__ import annotations

import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import lit_rl.memory.fit as fit
from lit_rl.callbacks import ActivationCheckpointing, MemoryProfiler
from lit_rl.cli import parse_fit_config
from lit_rl.data import PromptDataModule
from lit_rl.memory.estimate import estimate_step
from lit_rl.memory.fit import checkpointed_layers, choose_checkpointing, fit_report
from lit_rl.methods import RefCachedGRPO
from lit_rl.models import enable_activation_checkpointing
from lit_rl.models.tiny import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 8
SETTINGS = dict(batch_size=2, prompt_length=64)  # the data module's batch_size and max_prompt_length below


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An 8-layer tiny Llama on disk, so the estimate and the real run read the same config."""
    path = tmp_path_factory.mktemp("tiny8")
    tok = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tok), num_layers=LAYERS).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _method(folder: str) -> RefCachedGRPO:
    return RefCachedGRPO(name_or_path=folder, num_generations=4, max_new_tokens=6, learning_rate=1e-3)


@pytest.fixture(scope="module")
def cache():
    return {}  # every_n_layers -> Estimate, shared by the tests (each estimate is a fake-tensor step)


@pytest.fixture
def calls(folder, cache, monkeypatch):
    """choose_checkpointing's estimator, cached across tests; the list holds the every_n_layers it asked for."""
    asked: list[int] = []

    def cached(module, **settings):
        assert {k: settings[k] for k in SETTINGS} == SETTINGS
        k = settings["activation_checkpointing"]
        asked.append(k)
        if k not in cache:
            cache[k] = estimate_step(module, **settings)
        return cache[k]

    monkeypatch.setattr(fit, "estimate_step", cached)
    return asked


@pytest.fixture
def peaks(folder, cache, calls):
    """Predicted step peak for every every_n_layers, 0 (off) to LAYERS."""
    method = _method(folder)
    return {k: fit.estimate_step(method, **SETTINGS, activation_checkpointing=k).peak_bytes for k in range(LAYERS + 1)}


def _smallest_k(count: int) -> int:
    return min(k for k in range(1, LAYERS + 1) if checkpointed_layers(LAYERS, k) == count)


def test_checkpointed_layers_counts_every_kth_layer_from_the_first():
    assert [checkpointed_layers(30, k) for k in (0, 1, 2, 3, 5, 10, 15, 29, 30)] == [0, 30, 15, 10, 6, 3, 2, 2, 1]
    model = tiny_model("llama", num_layers=LAYERS)
    reported = enable_activation_checkpointing(model, every_n_layers=3)
    flags = [layer.gradient_checkpointing for layer in model.model.layers]
    assert flags == [i % 3 == 0 for i in range(LAYERS)] and sum(flags) == checkpointed_layers(LAYERS, 3) == reported


@pytest.mark.slow  # nine estimates
def test_predicted_peak_never_falls_when_fewer_layers_are_checkpointed(peaks):
    by_count = sorted((checkpointed_layers(LAYERS, k), peaks[k]) for k in range(LAYERS + 1))
    for (fewer, higher), (more, lower) in zip(by_count, by_count[1:]):
        assert higher >= lower or fewer == more, by_count
    assert peaks[0] > peaks[1]  # checkpointing saves something at all
    # of the k with the same layer count, the one choose_checkpointing returns (the smallest) is never above the rest
    for k in range(1, LAYERS + 1):
        assert peaks[_smallest_k(checkpointed_layers(LAYERS, k))] <= peaks[k], (k, peaks)


@pytest.mark.slow  # estimates of the tiny model, cached across budgets
def test_chosen_k_fits_and_the_next_fewer_checkpointed_layers_do_not(folder, peaks, calls):
    method = _method(folder)
    counts = sorted({checkpointed_layers(LAYERS, k) for k in range(1, LAYERS + 1)})  # 1, 2, 3, 4, 8
    for count in counts:
        k = _smallest_k(count)
        for budget in (peaks[k], peaks[k] + 1):
            calls.clear()
            chosen = choose_checkpointing(method, budget, **SETTINGS)
            assert chosen is not None and chosen >= 1
            assert peaks[chosen] <= budget
            fewer = [c for c in counts if c < checkpointed_layers(LAYERS, chosen)]
            if fewer:  # the next larger k that checkpoints fewer layers does not fit
                assert peaks[_smallest_k(fewer[-1])] > budget, (budget, chosen, peaks)
            # off, every layer, then at most 3 more over the 5 distinct layer counts
            assert len(calls) <= 2 + 3, calls


def _profile(layers: int, peak_of_count):
    """An estimator whose update phase peaks at ``peak_of_count(checkpointed layers)``, and the k it was asked for."""
    asked: list[int] = []

    def estimate(module, activation_checkpointing: int, **_):
        asked.append(activation_checkpointing)
        count = checkpointed_layers(layers, activation_checkpointing)
        update = peak_of_count(count)
        settings = {
            "config": SimpleNamespace(num_hidden_layers=layers),
            "activation_checkpointing": activation_checkpointing,
        }
        return SimpleNamespace(
            settings=settings, phases={"rollout": 10, "backward": update}, peak_bytes=max(10, update)
        )

    return estimate, asked


@pytest.mark.parametrize("layers", [8, 30, 61])
def test_the_search_finds_the_least_checkpointing_in_few_estimates(layers, monkeypatch):
    # against every k, on profiles the estimator can give: linear in the checkpointed layers (the saved activations),
    # linear with a floor (the recompute's own peak when most layers are checkpointed), and any that never rises
    rng = random.Random(layers)
    steps = sorted((rng.randrange(1, 50) for _ in range(layers + 1)), reverse=True)
    profiles = {
        "linear": lambda c: 1000 - 20 * c,
        "floor": lambda c: max(1000 - 35 * c, 1000 - 35 * layers // 2),
        "random": lambda c: 10 + sum(steps[c:]),
    }
    distinct = len({checkpointed_layers(layers, k) for k in range(1, layers + 1)})
    for name, peak_of_count in profiles.items():
        estimate, asked = _profile(layers, peak_of_count)
        monkeypatch.setattr(fit, "estimate_step", estimate)
        peaks = {k: estimate(None, k).peak_bytes for k in range(layers + 1)}
        for budget in range(min(peaks.values()), peaks[0] + 1):
            asked.clear()
            chosen = choose_checkpointing(None, budget)
            fitting = [k for k in range(1, layers + 1) if peaks[k] <= budget]
            least = min(fitting, key=lambda k: (checkpointed_layers(layers, k), k)) if peaks[0] > budget else 0
            assert chosen == least, (name, budget)
            if name == "linear" and chosen:  # the straight line's first guess is the boundary: then its neighbour
                assert len(asked) <= 2 + 2, (budget, asked)
            assert len(asked) <= 2 + 2 * math.ceil(math.log2(distinct)), (name, budget, asked)


def test_none_when_nothing_fits_and_0_when_the_step_fits_without(folder, calls, cache):
    method = _method(folder)
    off = fit.estimate_step(method, **SETTINGS, activation_checkpointing=0)
    every = fit.estimate_step(method, **SETTINGS, activation_checkpointing=1)
    calls.clear()
    assert choose_checkpointing(method, every.peak_bytes - 1, **SETTINGS) is None
    assert calls == [0, 1]
    assert choose_checkpointing(method, off.peak_bytes, baseline=off, **SETTINGS) == 0
    assert choose_checkpointing(method, 10 * off.peak_bytes, **SETTINGS) == 0


@pytest.mark.slow  # estimates, and the printed arguments parsed by the CLI
def test_fit_report_names_the_chosen_every_n_layers_and_its_recompute(folder, peaks, calls, monkeypatch):
    method = _method(folder)
    budget = (peaks[3] + peaks[4]) // 2  # 3 of 8 layers fit, 2 do not
    estimate = fit.estimate_step(method, **SETTINGS, activation_checkpointing=0)
    fits, text = fit_report(method, estimate, budget, {**SETTINGS, "activation_checkpointing": 0})
    assert not fits
    line = next(ln for ln in text.splitlines() if "- activation_checkpointing:" in ln)
    assert ", fits;" in line and "--trainer.callbacks.init_args.every_n_layers 3" in line
    assert "recomputes 3 of 8 layers, 38%" in line
    # the arguments parse, and set every_n_layers on the callback the fragment adds
    args = line.split("; add ", 1)[1].split(" (recomputes", 1)[0].split()
    monkeypatch.chdir(ROOT)  # the fragment's path is relative to the checkout
    _, _, trainer = parse_fit_config(["--config", "configs/grpo_tiny.yaml", *args])
    checkpointing = [c for c in trainer["callbacks"] if isinstance(c, ActivationCheckpointing)]
    assert [c.every_n_layers for c in checkpointing] == [3]


@pytest.mark.slow  # estimates
def test_with_every_kth_layer_already_checkpointed_the_report_proposes_a_denser_k(folder, peaks, calls):
    method = _method(folder)
    budget = (peaks[3] + peaks[4]) // 2  # on every 4th layer (2 of 8) the step is over; every 3rd fits
    estimate = fit.estimate_step(method, **SETTINGS, activation_checkpointing=4)
    fits, text = fit_report(method, estimate, budget, {**SETTINGS, "activation_checkpointing": 4})
    assert not fits
    line = next(ln for ln in text.splitlines() if "- activation_checkpointing:" in ln)
    assert ", fits; set every_n_layers: 3 on the ActivationCheckpointing callback, instead of 4" in line
    assert "recomputes 3 of 8 layers" in line
    assert f"saves {fit.format_bytes(peaks[4] - peaks[3])}" in line


@pytest.mark.slow  # two real training steps under the memory profiler
def test_a_real_step_with_the_chosen_k_stays_within_the_budget(folder, peaks, calls, quiet_trainer):
    torch.manual_seed(0)
    method = _method(folder)
    budget = (peaks[3] + peaks[4]) // 2
    chosen = choose_checkpointing(method, budget, **SETTINGS)
    assert chosen == 3
    method.eos_ids = lambda: [method.policy.get_output_embeddings().weight.shape[0]]  # never sampled: full length
    profiler = MemoryProfiler(predict=False, rates=None)
    trainer = quiet_trainer(
        max_steps=2,  # the second step holds AdamW's state, the steady state the estimate predicts
        logger=False,
        callbacks=[profiler, ActivationCheckpointing(every_n_layers=chosen)],
    )
    trainer.fit(method, PromptDataModule(num_prompts=16, batch_size=2, max_prompt_length=64))
    steps = profiler.summary()["steps"]
    assert len(steps) == 2
    measured = max(p["peak_bytes"] for step in steps for p in step["phases"].values())
    assert measured <= budget, (measured, budget, peaks)
    # and the setting that checkpoints fewer layers would not have fitted
    assert peaks[4] > budget
