"""``model.quantize_base: nf4`` in the methods: a QLoRA step, the refusal, checkpoints and resume, export, estimates."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from lit_rl.cli import LitRLCLI, main
from lit_rl.data import PromptDataModule
from lit_rl.losses import LossSettings
from lit_rl.memory.estimate import estimate_step
from lit_rl.methods import GumbelTopK, RefCachedGRPO
from lit_rl.models import LoraSettings, head_spec, trunk_hidden
from lit_rl.models.quantize import is_nf4, nf4_bytes_per_param, quantized_bytes
from lit_rl.ops import selective_log_probs

pytest.importorskip(
    "bitsandbytes", reason="model.quantize_base: nf4 needs bitsandbytes; `pip install bitsandbytes` to run these"
)

ROOT = Path(__file__).resolve().parents[1]
LORA = LoraSettings(r=4, alpha=8)


def longer_is_better(completions, **_):
    """A reward every tiny random model can improve on, so advantages are never all zero."""
    return [float(len(c)) for c in completions]


def _grpo(**kw) -> RefCachedGRPO:
    args = dict(name_or_path="tiny:llama", reward_funcs=["test_qlora.longer_is_better"], max_new_tokens=6,
                num_generations=4, learning_rate=1e-2, lora=LORA, quantize_base="nf4", loss=LossSettings(beta=0.1))  # fmt: skip
    return RefCachedGRPO(**{**args, **kw})


def _trainer(steps: int, logger=None) -> L.Trainer:
    return L.Trainer(max_steps=steps, accelerator="cpu", logger=logger or False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)  # fmt: skip


def _state(method) -> dict[str, torch.Tensor]:
    return {n: p.data.clone() for n, p in method.policy.named_parameters()}


def test_qlora_grpo_trains_the_adapters_only_and_starts_at_zero_kl(capture_logger):
    method = _grpo(micro_batch_size=3)
    method.setup("fit")
    method.configure_model()
    quantized = [n for n, m in method.policy.named_modules() if is_nf4(m)]
    assert len(quantized) == 2 * 7  # every trunk linear, under its LoRA wrapper
    before = _state(method)
    _trainer(2, capture_logger).fit(method, PromptDataModule(num_prompts=16, batch_size=2, max_prompt_length=64))
    for name, p in method.policy.named_parameters():
        assert torch.equal(p.data, before[name]) != ("lora_A" in name or "lora_B" in name), name
    assert all(is_nf4(method.policy.get_submodule(n)) for n in quantized)  # still 4-bit after training
    kl = capture_logger.metrics["kl/mean"]
    assert kl[0][1] == pytest.approx(0.0, abs=1e-6), "the reference is the quantized base: same model at step 0"
    # a checkpoint holds the adapters only: no 4-bit codes, no base weights
    assert method.state_dict() and all("lora_" in k for k in method.state_dict())


def test_nf4_without_lora_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"model\.quantize_base: nf4 .*set model\.lora") as info:
        RefCachedGRPO(name_or_path="tiny:llama", quantize_base="nf4")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"model\.quantize_base: 'int4' is not one of"):
        RefCachedGRPO(name_or_path="tiny:llama", lora=LORA, quantize_base="int4")


def test_gumbel_topk_quantizes_the_reward_trunk_not_its_head():
    method = GumbelTopK(name_or_path="tiny:llama", reward_model="tiny:llama", max_new_tokens=3, learning_rate=1e-2,
                        lora=LORA, quantize_base="nf4")  # fmt: skip
    method.setup("fit")
    method.configure_model()
    reward = method.reward_model
    assert sum(is_nf4(m) for m in reward.modules()) == 2 * 7
    assert not is_nf4(reward.score) and reward.score.weight.dtype == torch.float32
    assert not any(p.requires_grad for p in reward.parameters())
    before = _state(method)
    _trainer(1).fit(method, PromptDataModule(num_prompts=8, batch_size=2, max_prompt_length=32))
    changed = {n for n, p in method.policy.named_parameters() if not torch.equal(p.data, before[n])}
    assert changed and all("lora_" in n for n in changed)  # the reward's gradient reached the adapters


def _fit_cli(root: Path, *extra: str):
    return LitRLCLI(
        args=[
            "fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), "--model.init_args.max_new_tokens", "2",
            "--model.init_args.lora.r", "4", "--model.init_args.lora.alpha", "8",
            "--model.init_args.quantize_base", "nf4", "--data.init_args.val_size", "1",
            "--trainer.enable_checkpointing", "true", "--trainer.enable_progress_bar", "false",
            "--trainer.val_check_interval", "1", "--trainer.default_root_dir", str(root), *extra,
        ]
    )  # fmt: skip


@pytest.mark.slow  # three short fits through the CLI
def test_checkpoint_resumes_and_exports_merged_and_adapter(tmp_path):
    from peft import PeftModel

    _fit_cli(tmp_path / "run", "--trainer.max_steps", "1")
    (ckpt,) = (tmp_path / "run").rglob("*.ckpt")
    checkpoint = torch.load(ckpt, weights_only=True)
    assert checkpoint["state_dict"] and all("lora_" in k for k in checkpoint["state_dict"])
    generator = torch.Generator().manual_seed(0)
    for value in checkpoint["state_dict"].values():  # adapters away from peft's zero start, so merging matters
        value.add_(0.05 * torch.randn(value.shape, generator=generator))
    torch.save(checkpoint, ckpt)

    resumed = _fit_cli(tmp_path / "run", "--trainer.max_steps", "2", "--ckpt_path", str(ckpt))
    assert resumed.trainer.global_step == 2

    main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "merged")])
    main(["export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "adapter"), "--adapter"])
    from lit_rl.export import load_method

    method = load_method(ckpt)
    policy = method.policy
    ids = torch.randint(3, 90, (2, 9), generator=generator)  # [B, L]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        spec = head_spec(policy)
        expected = selective_log_probs(spec.features(trunk_hidden(policy, ids, mask)[:, :-1]), spec.weight, ids[:, 1:])
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert not any(is_nf4(m) for m in merged.modules())
        got = torch.log_softmax(merged(input_ids=ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)  # fp32: decoded NF4 + merged adapters
        base = _quantized_base(method)
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        logits = adapted(input_ids=ids).logits[:, :-1].float()
        got = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def _quantized_base(method):
    from lit_rl.models import load_causal_lm
    from lit_rl.models.quantize import quantize_base_nf4

    return quantize_base_nf4(load_causal_lm("tiny:llama", vocab_size=len(method.tokenizer))).eval()


def test_estimate_charges_nf4_bytes_and_the_dequantization_temporary():
    plain = estimate_step(_grpo(quantize_base="none"), batch_size=2, prompt_length=16)
    nf4 = estimate_step(_grpo(), batch_size=2, prompt_length=16)
    row = nf4.component("base weights (NF4)")
    n = int(row.shape.split(" x ")[0].replace(",", ""))
    assert n == 2 * (2 * 32 * 32 + 2 * 16 * 32 + 3 * 32 * 64)  # q, o 32 x 32; k, v 16 x 32 (2 of 4 heads); MLP 32 x 64
    # per layer: codes n / 2, one 8-bit absmax per 64, one float32 per 256 absmax (at least one per layer)
    sizes = 2 * [32 * 32, 32 * 32, 16 * 32, 16 * 32, 32 * 64, 32 * 64, 32 * 64]
    assert row.bytes == sum(k // 2 + k // 64 + 4 * -(-(k // 64) // 256) for k in sizes)
    assert row.bytes == pytest.approx(n * nf4_bytes_per_param(64, True), rel=0.01)
    assert "bytes/param" in row.note
    # what bitsandbytes stores for the same layers, code books and offsets left out of the format's count
    method = _grpo()
    method.setup("fit")
    method.configure_model()
    assert quantized_bytes(method.policy) >= row.bytes
    params = plain.component("parameters (policy)").bytes - nf4.component("parameters (policy)").bytes
    assert params == 4 * n  # the dense trunk linears left the policy's row
    temporary = nf4.component("NF4 dequantization temporary")
    assert temporary.bytes == 64 * 32 * 4 and temporary.shape == "[64, 32] fp32"
    assert all(nf4.phases[p] < plain.phases[p] for p in plain.phases)
