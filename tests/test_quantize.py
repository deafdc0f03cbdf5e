"""The 4-bit NF4 frozen base (lit_rl.models.quantize): one layer against float64, the whole model, the bytes."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from lit_rl.models import LoraSettings, apply_lora, head_spec, trunk_hidden
from lit_rl.models.quantize import (
    check_quantize_base,
    dequantize_base,
    dequantize_weight,
    is_nf4,
    nf4_bytes_per_param,
    nf4_linear,
    quantize_base_nf4,
    quantized_bytes,
)
from lit_rl.models.tiny import tiny_model
from lit_rl.ops import token_stats

pytest.importorskip(
    "bitsandbytes", reason="model.quantize_base: nf4 needs bitsandbytes; `pip install bitsandbytes` to run these"
)

B, T = 3, 7
# half the widest gap between NF4 levels (-1 and -0.6962), as a fraction of a block's absmax
NF4_HALF_GAP = 0.5 * (1.0 - 0.6961928009986877)


def _lora_on(layer: torch.nn.Module, r: int = 4, seed: int = 0) -> torch.nn.Module:
    """``layer`` under peft's LoRA, adapters random (B = 0 at peft's default init would hide the adapter path)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"], init_lora_weights=False)
    return get_peft_model(torch.nn.Sequential(layer), config)


def _randomize_lora(model: torch.nn.Module, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _leaf64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().double().requires_grad_()


@pytest.mark.parametrize("double_quant", [True, False], ids=["double-quant", "fp32-scales"])
@pytest.mark.parametrize(("d_in", "d_out"), [(72, 40), (73, 41)], ids=["72x40", "73x41-partial-block"])
def test_nf4_linear_matches_float64_reference(d_in, d_out, double_quant):
    gen = torch.Generator().manual_seed(0)
    dense = torch.nn.Linear(d_in, d_out)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(d_out, d_in, generator=gen) / d_in**0.5)  # [out, in]
    layer = nf4_linear(dense, block_size=64, double_quant=double_quant)
    assert is_nf4(layer) and not layer.weight.requires_grad and not layer.bias.requires_grad
    w_deq = dequantize_weight(layer)  # [out, in]
    assert w_deq.shape == (d_out, d_in) and w_deq.dtype == torch.float32

    # it is NF4: every weight within half a level gap of its block's absmax (blocks run over the flat weight)
    flat = dense.weight.detach().flatten()  # [out * in]
    pad = -flat.numel() % 64
    absmax = torch.nn.functional.pad(flat.abs(), (0, pad)).view(-1, 64).amax(-1)  # [blocks]
    bound = NF4_HALF_GAP * absmax.repeat_interleave(64)[: flat.numel()] * (1.01 if double_quant else 1.0) + 1e-6
    assert ((w_deq.flatten() - flat).abs() <= bound).all()

    model = _lora_on(layer)
    lora = model.base_model.model[0]
    a, b_up, s = lora.lora_A["default"].weight, lora.lora_B["default"].weight, lora.scaling["default"]
    x = torch.randn(B, T, d_in, generator=gen).requires_grad_()  # [B, T, in]
    up = torch.randn(B, T, d_out, generator=gen)  # upstream gradient  [B, T, out]
    y = model(x)  # [B, T, out]
    y.backward(up)

    x64, a64, b64 = _leaf64(x), _leaf64(a), _leaf64(b_up)
    y64 = x64 @ w_deq.double().T + layer.bias.double() + s * (x64 @ a64.T) @ b64.T  # [B, T, out]
    y64.backward(up.double())
    torch.testing.assert_close(y.double(), y64, atol=1e-5, rtol=1e-5)
    for got, ref in ((x, x64), (a, a64), (b_up, b64)):
        assert got.grad is not None and got.grad.dtype == torch.float32
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-5, rtol=1e-5)
    assert layer.weight.grad is None


def test_nf4_linear_bfloat16_dequantizes_to_the_training_dtype():
    gen = torch.Generator().manual_seed(0)
    dense = torch.nn.Linear(73, 41, bias=False).to(torch.bfloat16)
    layer = nf4_linear(dense)
    model = _lora_on(layer)
    w_deq = dequantize_weight(layer)  # [out, in]
    assert w_deq.dtype == torch.bfloat16
    x = torch.randn(B, T, 73, generator=gen).to(torch.bfloat16).requires_grad_()  # [B, T, in]
    y = model(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    lora = model.base_model.model[0]
    ref = x.detach().double() @ w_deq.double().T  # [B, T, out] base path only
    with model.disable_adapter():
        base = model(x.detach())
    torch.testing.assert_close(base.double(), ref, atol=0.05, rtol=0.02)  # one bf16 rounding of a sum of 73
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    assert lora.lora_A["default"].weight.grad is not None


def _quantized_llama(seed: int = 0, **kw) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(policy, base): a tiny llama quantized to NF4 with random LoRA adapters, and a copy of its base without."""
    model = quantize_base_nf4(tiny_model("llama", seed=seed, **kw))
    base = copy.deepcopy(model)
    policy = apply_lora(model, LoraSettings(r=4, alpha=8))
    _randomize_lora(policy)
    return policy, base


def _ids(vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(seed))  # [B, L]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    return ids, mask


def test_quantizes_the_trunk_linears_only():
    model = quantize_base_nf4(tiny_model("llama"))
    quantized = [n for n, m in model.named_modules() if is_nf4(m)]
    assert len(quantized) == 2 * 7  # q, k, v, o, gate, up, down in each of the two layers
    assert not is_nf4(model.lm_head) and model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert all(not p.requires_grad for n, m in model.named_modules() if is_nf4(m) for p in m.parameters())
    # what a checkpoint would hold of a layer: weight and bias like a plain module, no quantization state
    keys = [k for k in model.state_dict() if ".q_proj." in k]
    assert keys == ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_free_log_probs_match_the_quantized_model(arch):
    model = quantize_base_nf4(tiny_model(arch))
    policy = apply_lora(model, LoraSettings(r=4, alpha=8))
    _randomize_lora(policy)
    ids, mask = _ids()
    policy.eval()
    with torch.no_grad():
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, L] as trunk_hidden builds them
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, :-1]  # [B, L-1, V]
        hidden = trunk_hidden(policy, ids, mask)[:, :-1]  # [B, L-1, H]
        spec = head_spec(policy)
        stats = token_stats(spec.features(hidden), spec.weight, ids[:, 1:], entropy=True, **spec.op_kwargs)
    logp_all = torch.log_softmax(logits.double(), dim=-1)  # [B, L-1, V]
    ref = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, L-1]
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)  # [B, L-1]
    torch.testing.assert_close(stats.logp.double(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.entropy.double(), ref_ent, atol=1e-5, rtol=0)


def test_disabled_adapters_are_the_quantized_base():
    policy, base = _quantized_llama()
    ids, mask = _ids()
    policy.eval()
    base.eval()
    with torch.no_grad():
        own = base(input_ids=ids, attention_mask=mask).logits  # [B, L, V]
        with policy.disable_adapter():
            reference = policy(input_ids=ids, attention_mask=mask).logits
        adapted = policy(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(reference, own, atol=1e-6, rtol=0)
    assert (adapted - own).abs().max() > 1e-3  # the adapters do act


def test_training_after_an_eval_no_grad_pass_is_unchanged():
    """The rollout and the reference pass run in eval mode without grad before every update; the update after
    them must see the same weights and pass gradients through every quantized layer."""
    ids, mask = _ids()

    def update(policy: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        policy.train()
        policy.zero_grad()
        logits = policy(input_ids=ids, attention_mask=mask).logits  # [B, L, V]
        logits.float().logsumexp(-1).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
        return logits.detach(), grads

    fresh, _ = _quantized_llama()
    fresh_logits, fresh_grads = update(fresh)
    rolled, _ = _quantized_llama()
    rolled.eval()
    with torch.no_grad():
        eval_logits = rolled(input_ids=ids, attention_mask=mask).logits
    logits, grads = update(rolled)
    torch.testing.assert_close(eval_logits, fresh_logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits, fresh_logits, atol=1e-6, rtol=0)
    assert grads.keys() == fresh_grads.keys() and len(grads) == 2 * 7 * 2
    for name, grad in grads.items():  # layer 0's adapters get their gradient through layer 1's quantized base
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grad, fresh_grads[name], atol=1e-6, rtol=1e-5)


def test_dequantize_then_merge_gives_the_policy():
    policy, _ = _quantized_llama()
    ids, mask = _ids()
    policy.eval()
    with torch.no_grad():
        before = policy(input_ids=ids, attention_mask=mask).logits  # [B, L, V]
    merged = dequantize_base(policy).merge_and_unload()
    assert not any(is_nf4(m) for m in merged.modules())
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        after = merged(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


def test_bytes_are_about_a_quarter_of_float16():
    model = tiny_model("llama", hidden_size=256)  # q_proj 256 x 256, MLP 256 x 512: per-tensor constants add ~2.5 %
    linears = [m for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    params = sum(m.weight.numel() for m in linears)
    quantize_base_nf4(model, block_size=64, double_quant=True)
    measured = quantized_bytes(model)
    per_param = nf4_bytes_per_param(64, double_quant=True)
    # the format, plus per-tensor constants: the NF4 code book (16 float32), the second-level code book
    # (256 float32), an offset, at most one padded byte
    constants = len(linears) * (16 * 4 + 256 * 4 + 4 + 1)
    assert params * per_param <= measured <= params * per_param + constants
    fp16 = 2 * params
    assert 0.25 < measured / fp16 < 0.27  # a quarter, plus the scales and constants


def test_bytes_per_param_from_the_format():
    # QLoRA (arXiv 2305.14314), section 3: 32 / 64 = 0.5 bits of scales per weight, 8 / 64 + 32 / (64 * 256) =
    # 0.127 with double quantization
    assert nf4_bytes_per_param(64, double_quant=False) == pytest.approx(4.5 / 8)
    assert nf4_bytes_per_param(64, double_quant=True) == pytest.approx((4 + 8 / 64 + 32 / (64 * 256)) / 8)
    assert nf4_bytes_per_param(64, double_quant=True) * 8 == pytest.approx(4.127, abs=1e-3)
    assert nf4_bytes_per_param(128, double_quant=False) < nf4_bytes_per_param(64, double_quant=False)


def test_refusals_are_one_line_naming_the_field():
    def refused(fn, match):
        with pytest.raises(ValueError, match=match) as info:
            fn()
        assert "model.quantize_base" in str(info.value) and "\n" not in str(info.value)

    refused(lambda: quantize_base_nf4(tiny_model("llama"), block_size=48), "use one of")
    refused(lambda: quantize_base_nf4(tiny_model("gpt2")), "Conv1D.*model.quantize_base: none")
    lora = apply_lora(tiny_model("llama"), LoraSettings(r=2, alpha=4))
    refused(lambda: quantize_base_nf4(lora), "before apply_lora")
    with torch.device("meta"):
        meta = tiny_model("llama")
    refused(lambda: quantize_base_nf4(meta), "meta device")
    refused(lambda: check_quantize_base("int4", lora=True), "not one of")
    refused(lambda: check_quantize_base("nf4", lora=False), "set model.lora")
    check_quantize_base("nf4", lora=True)
    check_quantize_base("none", lora=False)


def test_missing_bitsandbytes_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"model\.quantize_base: nf4 needs bitsandbytes.*pip install bitsandbytes"):
        check_quantize_base("nf4", lora=True)


def test_a_dtype_cast_after_loading_moves_the_compute_dtype():
    """``trainer.precision: bf16-true`` casts the model after it is loaded (and quantized) in float32: the layer must
    then decode to bf16, not keep casting its inputs to float32 (real layers and the estimator's stand-ins alike)."""
    from lit_rl.models.quantize import NF4StandIn

    layer = nf4_linear(torch.nn.Linear(64, 32)).to(torch.bfloat16)
    assert layer.compute_dtype == layer.weight.quant_state.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.uint8 and dequantize_weight(layer).dtype == torch.bfloat16
    x = torch.randn(3, 64).to(torch.bfloat16).requires_grad_()  # [B, in]
    layer(x).float().sum().backward()
    assert x.grad.dtype == torch.bfloat16
    with torch.device("meta"):
        stand_in = NF4StandIn(torch.nn.Linear(64, 32)).to(torch.bfloat16)
    assert stand_in.compute_dtype == torch.bfloat16 and stand_in.weight.dtype == torch.uint8


def test_a_layer_run_first_under_a_bf16_default_leaves_later_layers_exact():
    """bitsandbytes caches its 4-bit code table, for the process, in the default dtype of its first use; Lightning
    makes bf16 the default while a bf16-true run builds its model, when lit-rl's load-time checks run an NF4 layer.
    In a fresh process: an odd-shaped layer run under a bf16 default first, then the float64 reference test."""
    import subprocess
    import sys

    script = (
        "import torch, test_quantize\n"
        "from lit_rl.models.quantize import nf4_linear\n"
        "torch.set_default_dtype(torch.bfloat16)\n"
        "layer = nf4_linear(torch.nn.Linear(73, 41, dtype=torch.float32), block_size=64, double_quant=True)\n"
        "layer(torch.randn(2, 73, dtype=torch.float32))\n"
        "torch.set_default_dtype(torch.float32)\n"
        "test_quantize.test_nf4_linear_matches_float64_reference(73, 41, True)\n"
    )
    tests = str(Path(__file__).resolve().parent)
    done = subprocess.run([sys.executable, "-c", script], cwd=tests, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
