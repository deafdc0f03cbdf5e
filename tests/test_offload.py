"""Activation offloading: the backward gets exactly what the forward saved (the hooks in their copy mode on CPU), the
estimator counts only what stays on the device, and a CPU run is refused in one line before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lit_rl.cli import main
from lit_rl.memory.estimate import estimate_step
from lit_rl.methods import GumbelTopK, RefCachedGRPO
from lit_rl.methods.grpo import Rollout
from lit_rl.models import enable_activation_checkpointing
from lit_rl.models.offload import OffloadSavedTensors

ROOT = Path(__file__).resolve().parents[1]
G, P, C = 2, 6, 5


def _method(**kw):
    method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=G, max_new_tokens=C, **kw)
    method.setup("fit")
    method.configure_model()
    return method


def _rollout() -> Rollout:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 90, (2, P), generator=gen).repeat_interleave(G, 0)  # G completions per prompt
    ids = torch.cat([prompts, torch.randint(3, 90, (2 * G, C), generator=gen)], 1)
    mask = torch.ones_like(ids)
    completion_mask = torch.ones(2 * G, C)
    completion_mask[1, 3:] = 0
    return Rollout(ids, mask, completion_mask, P, torch.zeros(2 * G), torch.randn(2 * G, generator=gen))


def _gradients(method, offload: bool):
    method.zero_grad(set_to_none=True)
    hooks = OffloadSavedTensors(method.policy, "copy", min_bytes=0)
    rollout = _rollout()
    rollout.ref_logp = method.reference_logp(rollout)
    for sl in method.micro_batches(len(rollout)):
        with hooks if offload else torch.enable_grad():
            loss, _ = method.policy_loss(rollout, sl, float(rollout.completion_mask.sum()))
        loss.backward()
    return {n: p.grad.clone() for n, p in method.policy.named_parameters() if p.grad is not None}, hooks


@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloaded_saved_tensors_give_bitwise_equal_gradients(checkpointing):
    method = _method(micro_batch_size=2)
    if checkpointing:
        enable_activation_checkpointing(method.policy, 1)
    plain, _ = _gradients(method, offload=False)
    offloaded, hooks = _gradients(method, offload=True)
    assert hooks.offloaded_bytes > 0  # the hooks did move tensors, so the comparison can fail
    assert plain.keys() == offloaded.keys() and plain
    assert all(torch.equal(plain[k], offloaded[k]) for k in plain)


def test_weights_are_never_offloaded():
    method = _method()
    hooks = OffloadSavedTensors(method.policy, "copy", min_bytes=0)
    weight = next(method.policy.parameters())
    transposed = weight.t()  # a view of the weight, as a linear layer saves it
    assert hooks._pack(weight) is weight and hooks._pack(transposed) is transposed
    assert hooks.offloaded_bytes == 0


def test_weights_are_never_offloaded_by_the_estimators_hooks():
    """The meta mode returns a fresh tensor at the backward; for a saved weight that would count a copy of it (on
    a GPU, bench/results/gpu_part3.md: a tied LM head's 0.43 GiB on a 1.5B LoRA step's predicted backward)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        policy = torch.nn.Linear(8, 16)
        hooks = OffloadSavedTensors(policy, "meta", min_bytes=0)
        transposed = policy.weight.t()
        assert hooks._pack(policy.weight) is policy.weight and hooks._pack(transposed) is transposed
        activation = mode.from_tensor(torch.randn(4, 8))
        assert hooks._pack(activation) is not activation  # an activation does leave
    assert hooks.offloaded_bytes == 4 * 8 * 4


@pytest.mark.parametrize("lora", [False, True])
def test_offloading_lowers_no_phase_of_the_estimate_above_none(lora):
    method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=G, max_new_tokens=C,
                           lora={"r": 4} if lora else None)  # fmt: skip
    kept = estimate_step(method, batch_size=2, prompt_length=P)
    offloaded = estimate_step(method, batch_size=2, prompt_length=P, offload_activations=0)
    assert all(offloaded.phases[k] <= kept.phases[k] for k in kept.phases), (kept.phases, offloaded.phases)
    assert offloaded.phases["backward"] < kept.phases["backward"]


@pytest.mark.parametrize("cls", [RefCachedGRPO, GumbelTopK])
def test_the_estimate_counts_only_what_stays_on_the_device(cls):
    kw = dict(name_or_path="tiny:llama", num_generations=G, max_new_tokens=C)
    if cls is GumbelTopK:
        kw["reward_model"] = "tiny:llama"
    method = cls(**kw)
    kept = estimate_step(method, batch_size=2, prompt_length=P)
    offloaded = estimate_step(method, batch_size=2, prompt_length=P, offload_activations=0)
    saved = next(c for c in kept.components if c.name.startswith("saved activations"))
    left = next(c for c in offloaded.components if c.name.startswith("saved activations"))
    assert left.bytes < saved.bytes / 2
    forward = method.phase_names[method.phase_names.index("backward") - 1]  # the update's own forward
    assert offloaded.phases[forward] < kept.phases[forward]


def test_a_cpu_run_is_refused_before_it_writes_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), "--config",
              str(ROOT / "callbacks/activation_offloading.yaml"), "--trainer.default_root_dir", str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err
    assert err.startswith("error: ActivationOffloading: moves saved activations from a GPU to host memory")
    assert not (tmp_path / "run").exists()
