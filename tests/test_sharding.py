"""FSDP2 units of a causal LM in one process, over processes of torch's fake backend (collectives do nothing):
which modules are units, where the head lives, what the rollout gathers, and the estimate's reading of a config.
tests/test_fsdp2.py checks the numbers on two real processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_rl.memory.sharded import fake_processes, sharding_settings
from lit_rl.models import ADOPTED, gather_trunk, head_spec, trunk
from lit_rl.models.sharding import decoder_layers, gathered, is_sharded, shard_model
from lit_rl.models.tiny import tiny_model


def _sharded(value: torch.Tensor) -> bool:
    return hasattr(value, "to_local")


@pytest.fixture
def mesh():
    with fake_processes(2) as mesh:
        yield mesh


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # a head tied to the embedding, and one of its own
def test_each_layer_is_a_unit_and_the_trunk_the_root_holding_the_head(arch, mesh):
    model = tiny_model(arch, num_layers=3)
    body, tied = model.model, model.lm_head.weight is model.model.embed_tokens.weight
    root, units = shard_model(model, mesh)
    assert root is body and units == 4 and is_sharded(model)
    assert trunk(model) is body, "the adopted head must not hide the trunk"
    assert [n for n, _ in body.named_children()][-1] == ADOPTED
    assert all(_sharded(p) for p in model.parameters())  # every weight is in a unit, none left whole
    gather_trunk(model)  # as a read of the head outside a forward does
    head = head_spec(model).weight
    assert not _sharded(head) and head.shape == (model.config.vocab_size, model.config.hidden_size)
    assert (head is model.model.embed_tokens.weight) == tied, "a tied head stays one parameter"


@pytest.mark.parametrize("mode", ["whole", "layers"])
def test_the_rollout_gathers_the_policy_once_or_layer_by_layer(mode, mesh):
    model = tiny_model("llama", num_layers=2)
    shard_model(model, mesh, rollout_gather=mode)
    weights = [layer.self_attn.q_proj for layer in decoder_layers(model)]
    with gathered(model):
        inside = [_sharded(m.weight) for m in weights]
    assert inside == [mode == "layers"] * 2
    assert all(_sharded(m.weight) for m in weights), "sharded again after the rollout"


@pytest.mark.parametrize("mode", ["whole", "layers"])
@pytest.mark.parametrize("kind", ["bf16 autocast", "float32 packed"])
def test_the_rollouts_cast_once_weights_leave_fsdp2s_storage_alone(mode, kind, mesh):
    """The decode loop's casts of a sharded policy (:mod:`lit_rl.models.cast_once`): gathered whole, the layers
    run on casts made once and no frozen weight lends its storage (FSDP2 frees and refills it); gathered layer by
    layer, the shards are left to FSDP2's own gathering. The logits are those of the per-use casts either way."""
    from lit_rl.models import float32_weights_packed, linear_weights_cast_once

    model = tiny_model("llama", num_layers=2).requires_grad_(False)
    shard_model(model, mesh, rollout_gather=mode)
    ids = torch.randint(3, 50, (2, 5), generator=torch.Generator().manual_seed(0))

    def precision():
        if kind == "bf16 autocast":
            return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
        return float32_weights_packed()

    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    with torch.no_grad(), gathered(model):
        with precision():
            expected = model(input_ids=ids).logits
        whole = {id(m.weight): m.weight.numel() for m in linears if not _sharded(m.weight)}  # the root keeps its head
        with precision(), linear_weights_cast_once(model) as held:
            assert not any(p.numel() == 0 for p in model.parameters())
            got = model(input_ids=ids).logits
    assert len(whole) == (len(linears) if mode == "whole" else 1)
    assert held == sum(whole.values()) * (2 if kind == "bf16 autocast" else 4)  # casts of what is whole only
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if mode == "whole":  # layer by layer, FSDP2's root keeps its own unsharded after a forward, as without the casts
        assert all(_sharded(p) for p in model.parameters()), "sharded again after the rollout"


def test_an_unknown_rollout_gather_is_refused(mesh):
    with pytest.raises(ValueError, match="rollout_gather: 'all' is not one of auto, whole, layers"):
        shard_model(tiny_model("llama"), mesh, rollout_gather="all")


def test_the_estimate_reads_the_sharding_from_the_trainer_config():
    fsdp2 = {"class_path": "lit_rl.strategies.FSDP2Strategy", "init_args": {"rollout_gather": "layers"}}
    assert sharding_settings({"strategy": fsdp2, "devices": 4, "num_nodes": 2}) == {
        "shard_processes": 8,
        "rollout_gather": "layers",
        "shard_offload": False,
    }
    offloaded = {"class_path": "lit_rl.strategies.FSDP2Strategy", "init_args": {"cpu_offload": True}}
    assert sharding_settings({"strategy": offloaded, "devices": 1}) == {
        "shard_processes": 1,
        "rollout_gather": "auto",
        "shard_offload": True,
    }
    assert sharding_settings({"strategy": "ddp", "devices": 4}) == {"shard_processes": 1}
    with pytest.raises(ValueError, match="trainer.devices: 'auto'"):
        sharding_settings({"strategy": fsdp2, "devices": "auto"})


def test_auto_gathers_the_whole_policy_when_it_fits_and_says_so(mesh, caplog, monkeypatch):
    monkeypatch.setattr("lit_rl.models.notices._said", set())  # said once per process: perhaps by an earlier test
    model = tiny_model("llama", num_layers=2)
    shard_model(model, mesh)  # rollout_gather: auto; a few KiB against the free host memory
    with caplog.at_level("INFO"), gathered(model):
        assert not _sharded(decoder_layers(model)[0].self_attn.q_proj.weight)
    assert "FSDP2 rollout: the policy is gathered once, whole" in caplog.text


def test_a_step_that_does_not_fit_one_device_gets_the_devices_it_would_fit_sharded_over():
    from lit_rl.cli import parse_fit_config
    from lit_rl.memory import estimate_step
    from lit_rl.memory.fit import fit_report

    module, _, _ = parse_fit_config(["--config", str(Path(__file__).resolve().parents[1] / "configs/grpo_tiny.yaml")])
    settings = dict(batch_size=2, prompt_length=64)
    one, two = estimate_step(module, **settings), estimate_step(module, shard_processes=2, **settings)
    assert two.peak_bytes < one.peak_bytes
    budget = (one.peak_bytes + two.peak_bytes) // 2
    fits, report = fit_report(module, one, budget, settings)
    assert not fits
    assert "  - sharded over 2 devices (FSDP2): peak" in report and "per device, fits; add --trainer.strategy" in report


def test_one_process_under_fsdp2_is_estimated_sharded_and_cpu_offload_counts_the_device_alone():
    """FSDP2Strategy on one device still gathers into buffers of its own (the H100 run: the rollout 1.84 GiB above
    the run without a strategy, bench/results/gpu_part6.md), so the estimate shards over one process; with
    ``cpu_offload`` the shards, their gradients and the optimizer state leave the count."""
    from lit_rl.cli import parse_fit_config
    from lit_rl.memory import estimate_step

    module, _, _ = parse_fit_config(["--config", str(Path(__file__).resolve().parents[1] / "configs/grpo_tiny.yaml")])
    settings = dict(batch_size=2, prompt_length=16)
    plain = estimate_step(module, **settings)
    one = estimate_step(module, rollout_gather="whole", **settings)
    offloaded = estimate_step(module, rollout_gather="whole", shard_offload=True, **settings)
    weights = plain.breakdown["rollout"]["parameters"]
    # the whole policy gathered for the rollout beside its one shard: one more copy of the policy's weights
    assert one.phases["rollout"] - plain.phases["rollout"] >= weights // 2
    for phase, peak in offloaded.phases.items():
        host = sum(offloaded.breakdown[phase].get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))
        assert host > 0 and peak < one.phases[phase], phase
        assert peak <= sum(offloaded.breakdown[phase].values()) - host, phase  # what the device holds at the peak
    assert offloaded.settings["shard_offload"] and one.settings["rollout_gather"] == "whole"


def test_cpu_offload_counts_the_shards_copied_to_the_device_for_each_gather(monkeypatch):
    """FSDP2 copies a unit's offloaded shards to the device before gathering them (the H100 run's reference phase
    held the embedding twice, bench/results/gpu_part6.md); the estimate makes that copy. A model whose embedding
    outweighs its activations, so a gather is the peak."""
    import contextlib

    from lit_rl.memory import estimate_step
    from lit_rl.methods import RefCachedGRPO
    from lit_rl.models.tiny import tiny_config

    module = RefCachedGRPO(
        name_or_path="tiny:llama", reward_funcs=["lit_rl.data.rewards.number_only"], num_generations=2, max_new_tokens=2
    )
    settings = dict(model_config=tiny_config("llama", vocab_size=16384), batch_size=1, prompt_length=4,
                    rollout_gather="whole", shard_offload=True)  # fmt: skip
    copied = estimate_step(module, **settings)
    monkeypatch.setattr("lit_rl.memory.estimate.offloaded_gathers", lambda enabled: contextlib.nullcontext())
    without = estimate_step(module, **settings)
    embedding = 16384 * tiny_config("llama").hidden_size * 4  # float32
    more = {phase: copied.phases[phase] - without.phases[phase] for phase in copied.phases}
    assert all(extra >= 0 for extra in more.values()) and more["reference"] > embedding // 2, more
