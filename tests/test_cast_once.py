"""Rollouts under mixed precision cast each weight once (:mod:`lit_rl.models.cast_once`), with the same numbers.

Under ``torch.autocast(..., cache_enabled=False)`` (Lightning's bf16-mixed) the layers' outputs, the model's logits
and the decode loop's tokens must be bitwise what they are when autocast casts every weight at every use; the
layers are restored afterwards, and outside autocast nothing is touched, unless a float32 sampler on packed weights
is asked for (:func:`~lit_rl.models.cast_once.float32_weights_packed`): its layers are float32 rounding away from
a float64 reference, its tokens are a sampler's of the same model, and its copies are counted.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from test_decode import EOS, PAD, _prompts
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GenerationConfig

from lit_rl.models.cast_once import (
    float32_packing_unsupported,
    float32_weights_packed,
    linear_weights_cast_once,
    weights_meant_for,
)
from lit_rl.models.decode import decode, sampling_settings
from lit_rl.models.tiny import tiny_model


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)  # as Lightning's MixedPrecision


ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
ONEDNN = float32_packing_unsupported(torch.device("cpu")) is None


class _Ops(TorchDispatchMode):
    """Records the name of every aten-level op run under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _lora(model):
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, parameter in model.named_parameters():  # adapters that change the output (B starts at zero)
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.5, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_are_bitwise_those_of_per_use_casts(arch, lora):
    model = tiny_model(arch, seed=4, tie_word_embeddings=True).eval()
    model = _lora(model) if lora else model
    ids, mask = _prompts()
    with torch.no_grad(), _autocast():
        expected = model(input_ids=ids, attention_mask=mask).logits
        with linear_weights_cast_once(model) as held:
            got = model(input_ids=ids, attention_mask=mask).logits
    assert expected.dtype == torch.bfloat16  # the head ran under autocast on both sides
    assert torch.equal(got, expected)
    assert held > 0


def test_holds_half_the_float32_bytes_of_the_linear_layers_with_a_tied_head_once():
    model = tiny_model("llama", seed=0, tie_word_embeddings=True)
    linears = {id(m.weight): m.weight for m in model.modules() if type(m) is torch.nn.Linear}
    with torch.no_grad(), _autocast(), linear_weights_cast_once(model) as held:
        pass
    assert held == sum(w.numel() for w in linears.values()) * 2
    assert model.lm_head.weight is model.get_input_embeddings().weight  # the tied head is counted once above


def test_layers_are_restored_and_outside_autocast_nothing_changes():
    model = tiny_model("llama", seed=0)
    linear = model.lm_head
    with torch.no_grad(), _autocast(), linear_weights_cast_once(model):
        assert "forward" in linear.__dict__
    assert not any("forward" in m.__dict__ for m in model.modules())
    with torch.no_grad(), linear_weights_cast_once(model) as held:
        assert held == 0 and "forward" not in linear.__dict__
    with pytest.raises(RuntimeError, match="boom"):  # an error inside still restores the layers
        with torch.no_grad(), _autocast(), linear_weights_cast_once(model):
            raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_forward_replaced_by_someone_else_is_left_alone():
    model = tiny_model("llama", seed=0)
    replaced = model.model.layers[0].mlp.down_proj
    own = replaced.forward  # a bound method, stored on the instance as a hook library would
    replaced.forward = own
    with torch.no_grad(), _autocast(), linear_weights_cast_once(model):
        assert replaced.__dict__["forward"] is own
    assert replaced.__dict__["forward"] is own


@pytest.mark.parametrize("do_sample", [False, True])
def test_the_decode_loop_casts_once_and_draws_generates_tokens(do_sample):
    model = _lora(tiny_model("llama", seed=5, tie_word_embeddings=True)).eval()
    ids, mask = _prompts()
    config = GenerationConfig(
        pad_token_id=PAD, eos_token_id=[EOS], max_new_tokens=9, do_sample=do_sample, temperature=0.8, top_k=0
    )
    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: seen.append("forward" in module.__dict__)
    )
    with torch.no_grad(), _autocast():
        torch.manual_seed(3)
        expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        generate_saw = list(seen)
        settings, reason = sampling_settings(model, config)
        assert reason is None
        torch.manual_seed(3)
        got = decode(model, ids, mask, eos=[EOS], pad_id=PAD, **settings)
    hook.remove()
    assert torch.equal(got, expected)
    assert generate_saw and not any(generate_saw)  # generate: autocast casts at every use
    assert seen[len(generate_saw) :] and all(seen[len(generate_saw) :])  # the loop: every step on the casts


# SmolLM2-135M's projections (q/o, k/v, gate/up, down, the head), LoRA adapters of rank 16, and odd sizes
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (16, 576), (576, 16), (7, 13), (1000, 333)]


@pytest.mark.skipif(not ONEDNN_BF16, reason="this CPU's bf16 matmuls do not run on oneDNN: the casts stay plain")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_packed_layers_are_bitwise_f_linear_on_the_cast_at_decode_and_prefill_shapes(out_features, in_features, bias):
    generator = torch.Generator().manual_seed(out_features * 7 + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    torch.nn.init.normal_(linear.weight, generator=generator)
    if bias:
        torch.nn.init.normal_(linear.bias, generator=generator)
    inputs = [torch.randn(*lead, in_features, generator=generator) for lead in [(1,), (8,), (8, 1), (3, 1), (8, 40)]]
    with torch.no_grad(), _autocast():
        expected = [F.linear(x, linear.weight, linear.bias) for x in inputs]  # autocast casts at every use
        with linear_weights_cast_once(linear), _Ops() as ops:
            got = [linear(x) for x in inputs]
            strided = linear(torch.randn(8, 2, in_features, generator=generator)[:, 1])  # a non-contiguous input
    assert "mkldnn._linear_pointwise.default" in ops.names  # packed: oneDNN's linear ran
    assert "aten.linear.default" not in ops.names and "aten.addmm.default" not in ops.names
    for x, y, z in zip(inputs, got, expected, strict=True):
        assert y.dtype == z.dtype == torch.bfloat16 and y.shape == z.shape, x.shape
        assert torch.equal(y, z), x.shape
    assert strided.shape == (8, out_features)


@pytest.mark.skipif(not ONEDNN_BF16, reason="this CPU's bf16 matmuls do not run on oneDNN: the casts stay plain")
def test_the_decode_loop_runs_every_linear_packed_and_the_estimators_fake_tensors_stay_plain():
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _lora(tiny_model("llama", seed=5)).eval()
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    ids, mask = _prompts()
    with torch.no_grad(), _autocast(), linear_weights_cast_once(model), _Ops() as ops:
        model(input_ids=ids, attention_mask=mask)
    assert ops.names.count("mkldnn._linear_pointwise.default") == linears
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(torch.randn(8, 6))
        layer = torch.nn.Linear(6, 4)
        layer.weight = torch.nn.Parameter(mode.from_tensor(layer.weight.detach()))
        layer.bias = torch.nn.Parameter(mode.from_tensor(layer.bias.detach()))
        with torch.no_grad(), _autocast(), linear_weights_cast_once(layer) as held:
            assert layer(fake).shape == (8, 4)
    assert held == (6 * 4 + 4) * 2


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN: float32 weights are not packed")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_float32_packed_layers_are_float32_rounding_from_a_float64_reference(out_features, in_features, bias):
    """Not bitwise ``F.linear`` (another summation order), so each output is held to what float32 rounding allows:
    |y - y64| <= 16 * eps32 * (|x| @ |W|^T + |b|) per element (the bound of a sum of ``in_features`` terms is far
    wider; 16 eps is what a blocked sum of partial sums reaches), and ``F.linear``'s own error is held to it too."""
    generator = torch.Generator().manual_seed(out_features * 5 + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    torch.nn.init.normal_(linear.weight, generator=generator)
    if bias:
        torch.nn.init.normal_(linear.bias, generator=generator)
    weight, b = linear.weight.detach(), linear.bias
    inputs = [torch.randn(*lead, in_features, generator=generator) for lead in [(1,), (8,), (8, 1), (3, 1), (8, 40)]]
    inputs.append(torch.randn(8, 2, in_features, generator=generator)[:, 1])  # a non-contiguous input
    with torch.no_grad(), float32_weights_packed(), linear_weights_cast_once(linear) as held, _Ops() as ops:
        got = [linear(x) for x in inputs]
    assert "mkldnn._linear_pointwise.default" in ops.names and "aten.linear.default" not in ops.names
    assert held == weight.numel() * 4  # the packed copy; the bias is read where it is
    eps = torch.finfo(torch.float32).eps
    for x, y in zip(inputs, got, strict=True):
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        scale = F.linear(x.double().abs(), weight.double().abs(), None if b is None else b.double().abs())
        assert y.dtype == torch.float32 and y.shape == exact.shape, x.shape
        assert ((y.double() - exact).abs() <= 16 * eps * scale).all(), x.shape
        plain = F.linear(x, weight, b)
        assert ((plain.double() - exact).abs() <= 16 * eps * scale).all(), x.shape


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN: float32 weights are not packed")
def test_float32_packing_is_asked_for_runs_every_linear_and_fake_tensors_hold_the_same_bytes():
    """Outside :func:`float32_weights_packed` float32 layers are untouched; inside, every linear of a LoRA model runs
    packed and its logits stay within float32 rounding of the plain ones; fake tensors (the estimator) get plain
    copies of the packed bytes, and a tied head is copied once."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _lora(tiny_model("llama", seed=5, tie_word_embeddings=True)).eval()
    weights = {id(m.weight): m.weight for m in model.modules() if type(m) is torch.nn.Linear}
    copied = [w for w in weights.values() if w.requires_grad or w is model.get_input_embeddings().weight]
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    ids, mask = _prompts()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        with linear_weights_cast_once(model) as held:
            assert held == 0 and not any("forward" in m.__dict__ for m in model.modules())
        with float32_weights_packed(), linear_weights_cast_once(model) as held, _Ops() as ops:
            got = model(input_ids=ids, attention_mask=mask).logits
    assert held == sum(w.numel() for w in copied) * 4  # the adapters and the tied head; the frozen base lent its own
    assert 0 < len(copied) < len(weights)
    assert ops.names.count("mkldnn._linear_pointwise.default") == linears
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # another kernel on the same float32 numbers
    assert not any("forward" in m.__dict__ for m in model.modules())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(torch.randn(8, 6))
        layer = torch.nn.Linear(6, 4)
        layer.weight = torch.nn.Parameter(mode.from_tensor(layer.weight.detach()))
        layer.bias = torch.nn.Parameter(mode.from_tensor(layer.bias.detach()))
        with torch.no_grad(), float32_weights_packed(), linear_weights_cast_once(layer) as held, _Ops() as ops:
            assert layer(fake).shape == (8, 4)
    assert held == 6 * 4 * 4 and "mkldnn._linear_pointwise.default" not in ops.names


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN: float32 weights are not packed")
@pytest.mark.parametrize("tied", [False, True])
def test_a_frozen_float32_weight_lends_its_storage_to_its_packed_copy_and_gets_it_back_bitwise(tied):
    """A frozen weight only its layer reads (a LoRA base) holds no data while its packed copy runs, and afterwards
    has its own values back, bitwise, also after an error; trained weights, and a head the embedding also reads,
    keep theirs throughout. The estimator's fake tensors do the same."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _lora(tiny_model("llama", seed=6, tie_word_embeddings=tied)).eval()
    weights = {name: p for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name}
    before = {name: p.detach().clone() for name, p in weights.items()}
    frozen = {name for name, p in weights.items() if not p.requires_grad and not (tied and "lm_head" in name)}
    assert frozen and frozen != set(weights) and (tied or "base_model.model.lm_head.weight" in frozen)
    ids, mask = _prompts()
    for error in (False, True):
        with contextlib.ExitStack() as outside:
            if error:  # raised inside the context: the weights come back on the way out
                outside.enter_context(pytest.raises(RuntimeError, match="boom"))
            with torch.no_grad(), float32_weights_packed(), linear_weights_cast_once(model) as held:
                assert {name for name, p in weights.items() if p.numel() == 0} == frozen
                tied_head = model.get_input_embeddings().weight.numel() if tied else 0  # copied: the lookup reads it
                assert held == (sum(before[name].numel() for name in set(weights) - frozen) + tied_head) * 4
                model(input_ids=ids, attention_mask=mask)
                if error:
                    raise RuntimeError("boom")
        for name, p in weights.items():
            assert p.shape == before[name].shape and torch.equal(p, before[name]) and p.is_contiguous(), name
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        layer = torch.nn.Linear(6, 4, bias=False).requires_grad_(False)
        layer.weight = torch.nn.Parameter(mode.from_tensor(layer.weight.detach()), requires_grad=False)
        with torch.no_grad(), float32_weights_packed(), linear_weights_cast_once(layer) as held:
            assert (
                held == 0 and layer.weight.numel() == 0 and layer(mode.from_tensor(torch.randn(3, 6))).shape == (3, 4)
            )
        assert layer.weight.shape == (4, 6)


def test_float32_packing_says_why_not_where_it_cannot_run():
    assert "on meta" in float32_packing_unsupported(torch.device("meta"))
    with torch.backends.mkldnn.flags(enabled=False):
        assert "oneDNN" in float32_packing_unsupported(torch.device("cpu"))
    with weights_meant_for("cuda"):  # the estimator's CPU fake tensors, for a step meant for a GPU
        assert "on cuda" in float32_packing_unsupported(torch.device("cpu"))
    assert float32_packing_unsupported(torch.device("cpu")) == float32_packing_unsupported(torch.device("cpu:0"))


def test_the_estimate_charges_packed_copies_only_on_the_device_that_packs():
    """A full fine-tuning rollout's packed copies (its trained weights are copied, not lent) raise the estimated rollout
    peak for a CPU run; for a GPU run, where the setting has no effect, the estimate is the plain sampler's."""
    from lit_rl.memory.estimate import estimate_step
    from lit_rl.methods import RefCachedGRPO

    if float32_packing_unsupported(torch.device("cpu")) is not None:
        pytest.skip("this torch has no oneDNN: float32 weights are not packed")
    peaks = {}
    for linear in ("plain", "packed"):
        method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=2, max_new_tokens=4, rollout_linear=linear)
        for device in ("cpu", "cuda"):
            estimate = estimate_step(method, batch_size=2, prompt_length=8, device_type=device)
            peaks[linear, device] = estimate.phases["rollout"]
    assert peaks["packed", "cpu"] > peaks["plain", "cpu"] == peaks["plain", "cuda"] == peaks["packed", "cuda"]


@pytest.mark.bench
@pytest.mark.slow
def test_bench_packed_linear_quick_table(capsys):
    """bench/bench_packed_linear.py --quick: one row per projection and row count, bitwise where oneDNN packs."""
    from bench_loader import load_bench

    with load_bench("bench_packed_linear.py") as bench:
        text = bench.main(["--quick"])
    assert text in capsys.readouterr().out
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| q") or line.startswith("| k")]
    assert [(r[0].strip("| "), r[2]) for r in rows] == [(p, n) for n in ("8", "32") for p in ("q, o", "k, v")]
    assert all(r[8] == "yes" for r in rows)  # the packed layer's outputs equal F.linear's on the cast
    streamed = text.split("## A whole decode step, every weight read from memory", 1)[1]
    cells = [line.split(" | ") for line in streamed.splitlines() if re.match(r"\| (8|32) \|", line)]
    assert len(cells) == 2 and all(float(c) > 0 for row in cells for c in row[1:-1]), streamed
    with load_bench("bench_packed_linear.py") as bench:
        text = bench.main(["--quick", "--float32"])
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| q") or line.startswith("| k")]
    assert len(rows) == 4 and "F.linear µs" in text
    for row in rows:  # float32: another summation order, each side's error against float64 of float32's size
        errors = [float(e) for e in re.findall(r"(?:F\.linear|packed) ([0-9.e+-]+)", row[8])]
        assert row[8] == "yes" or (row[8].startswith("no: ") and len(errors) == 2 and max(errors) < 1e-4), row
