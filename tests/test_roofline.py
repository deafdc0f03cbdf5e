"""The roofline's FLOP and byte counts against an independent count, and the profiler's time-beside-floor summary.

FLOPs are checked against ``torch.utils.flop_counter.FlopCounterMode`` on real forwards and backwards of tiny
transformers models (eager attention, whose matmuls the counter sees; for the ``sdpa`` path, torch's own SDPA
formula registered for the CPU kernel); bytes against the models' own parameters, KV caches and optimizer state.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import lightning as L
import pytest
import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, DynamicCache

from lit_rl.callbacks import MemoryProfiler, RunLog
from lit_rl.data import PromptDataModule
from lit_rl.losses import LossSettings
from lit_rl.memory.machine_rates import best_of, load_rates, measure_rates, save_rates
from lit_rl.memory.rollout import step_work
from lit_rl.memory.roofline import PhaseRoofline, phase_table, rerate, summary_line
from lit_rl.memory.work import ModelShape, StepSettings, floor, phase_work
from lit_rl.methods import GumbelTopK, Intuitor, RefCachedGRPO
from lit_rl.models import LoraSettings, lm_head, trunk
from lit_rl.models.checkpointing import enable_activation_checkpointing
from lit_rl.models.shared_prompt import shared_prompt_hidden
from lit_rl.models.tiny import tiny_config
from lit_rl.ops import selective_log_probs

aten = torch.ops.aten


def _model(arch: str = "llama", attention: str = "eager", **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(arch, vocab_size=96, hidden_size=64, num_layers=3, **kw)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention)


def _sdpa(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _addmm_(self_shape, a_shape, b_shape, *args, **kwargs) -> int:
    return flop_counter.addmm_flop(self_shape, a_shape, b_shape)


# torch's own formulas for two kernels its counter leaves out: the CPU SDPA kernel (forward only) and the in-place
# addmm_ that the chunked head's backward accumulates its gradients with
MAPPING = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa, aten.addmm_: _addmm_}


def _counted(fn) -> int:
    """FLOPs of ``fn()`` as torch counts them."""
    with FlopCounterMode(display=False, custom_mapping=MAPPING) as fc:
        fn()
    return fc.get_total_flops()


def _settings(**kw) -> StepSettings:
    base = dict(prompts=2, generations=1, prompt_length=9, new_tokens=1, share_prompt=False)
    return StepSettings(**{**base, **kw})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_prefill_and_decode_flops_equal_the_counted_flops(arch):
    model = _model(arch).eval()
    shape = ModelShape.from_config(model.config)
    p = 9
    ids = torch.randint(3, 96, (2, p))
    work = phase_work(shape, _settings())["rollout"]  # the prefill of P - 1 tokens, then one decode step
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        prefill = _counted(lambda: trunk(model)(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True))
        decode = _counted(lambda: model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True))
    assert (prefill, decode) == (work[0].flops, work[1].flops)
    assert len(work) == 2 and work[1].decode and not work[0].decode


def test_decode_bytes_are_the_weights_and_the_kv_cache():
    for tied in (True, False):
        model = _model("qwen2", tie_word_embeddings=tied).eval()
        shape = ModelShape.from_config(model.config)
        ids = torch.randint(3, 96, (2, 9))
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)  # what the decode step leaves: 9 keys a row
        matrices = [p for p in model.parameters() if p.ndim == 2]  # tied: the embedding is the head, counted once
        if not tied:  # an untied embedding is gathered a row at a time, never read whole
            matrices.remove(model.get_input_embeddings().weight)
        weights = sum(p.numel() * p.element_size() for p in matrices)
        cached = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        decode = phase_work(shape, _settings())["rollout"][1]  # reads the 9 keys per row, writes the newest
        assert decode.bytes == weights + cached + cached // 9


def test_shared_prompt_passes_count_u_prompts_and_b_completions():
    model = _model(attention="sdpa").eval()
    shape = ModelShape.from_config(model.config)
    p, c, g = 6, 4, 3
    prompts = torch.randint(3, 96, (2, p)).repeat_interleave(g, 0)
    ids = torch.cat([prompts, torch.randint(3, 96, (2 * g, c))], 1)
    mask = torch.ones_like(ids)
    settings = StepSettings(prompts=2, generations=g, prompt_length=p, new_tokens=c, micro_batch=4, share_prompt=True)
    reference = phase_work(shape, settings)["reference"]  # micro-batches of rows 0-3 and 4-5: runs [3, 1] and [2]
    head = lm_head(model).weight
    for part, (rows, runs) in zip(reference, ((slice(0, 4), [3, 1]), (slice(4, 6), [2])), strict=True):

        def scoring(rows=rows, runs=runs):
            hidden = shared_prompt_hidden(model, ids[rows], mask[rows], p, runs)  # [b, C, H]
            selective_log_probs(hidden, head, ids[rows, p:])

        with torch.no_grad():
            assert _counted(scoring) == part.flops
    plain = phase_work(shape, StepSettings(**{**settings.__dict__, "share_prompt": False}))["reference"]
    assert sum(x.flops for x in plain) > sum(x.flops for x in reference)


def test_padding_free_passes_count_the_counted_completion_tokens():
    """A padding-free pass runs the prompts and each completion's counted tokens but its last through the trunk, the
    counted ones through the head, and attention on the padded blocks: counted FLOPs of the real code."""
    model = _model(attention="sdpa").eval()
    shape = ModelShape.from_config(model.config)
    p, c, g = 6, 4, 3
    ids = torch.cat([torch.randint(3, 96, (2, p)).repeat_interleave(g, 0), torch.randint(3, 96, (2 * g, c))], 1)
    mask = torch.ones_like(ids)
    keep = torch.arange(c) < torch.tensor([4, 2, 3, 1, 4, 2])[:, None]  # [6, C] completions ending early
    settings = StepSettings(prompts=2, generations=g, prompt_length=p, new_tokens=c, completion_tokens=16)
    (part,) = phase_work(shape, settings)["reference"]
    head = lm_head(model).weight

    def scoring():
        hidden = shared_prompt_hidden(model, ids, mask, p, [g, g], keep)  # [6, C, H], zeros where not counted
        selective_log_probs(hidden[keep][None], head, ids[:, p:][keep][None])

    with torch.no_grad():
        assert _counted(scoring) == part.flops
    (padded,) = phase_work(shape, replace(settings, completion_tokens=None))["reference"]
    assert padded.flops > part.flops


def _update_flops(model, ids: torch.Tensor, p: int) -> tuple[int, int]:
    """Counted FLOPs of a scoring forward with gradients (trunk, chunked head) and of its backward."""
    model.train()
    head = lm_head(model).weight
    outputs = {}

    def forward():
        hidden = trunk(model)(input_ids=ids).last_hidden_state[:, p - 1 : -1]
        outputs["loss"] = selective_log_probs(hidden, head, ids[:, p:]).sum()

    return _counted(forward), _counted(lambda: outputs["loss"].backward())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_full_fine_tuning_update_flops_equal_the_counted_flops(checkpointing):
    model = _model()
    if checkpointing:
        enable_activation_checkpointing(model, 1)
    shape = ModelShape.from_config(model.config)
    p, c = 7, 5
    ids = torch.randint(3, 96, (2, p + c))
    trainable = sum(x.numel() for x in model.parameters())
    settings = _settings(prompt_length=p, new_tokens=c, trainable=trainable, checkpointed_layers=3 * checkpointing)
    work = phase_work(shape, settings)
    forward, backward = _update_flops(model, ids, p)
    assert forward == work["policy_forward"][0].flops
    assert backward == work["backward"][0].flops


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_update_skips_the_frozen_weight_gradients(checkpointing):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    if checkpointing:
        enable_activation_checkpointing(model, 1)
    else:
        model.enable_input_require_grads()  # as checkpointing does: the first layer's input gradient is computed too
    shape = ModelShape.from_config(model.config)
    adapters = sum(x.numel() for x in model.parameters() if x.requires_grad)
    p, c = 7, 5
    ids = torch.randint(3, 96, (2, p + c))
    settings = _settings(prompt_length=p, new_tokens=c, adapters=adapters, trainable=adapters)
    work = phase_work(shape, replace(settings, checkpointed_layers=3 * checkpointing))
    forward, backward = _update_flops(model, ids, p)
    assert forward == work["policy_forward"][0].flops
    # the recomputation skips each layer's last adapter matmul (down projection's B: 2 * tokens * H * r), not counted
    skipped = 3 * 2 * ids.numel() * 64 * 4 if checkpointing else 0
    assert backward == work["backward"][0].flops - skipped
    assert work["reference"][0].flops == forward - 2 * ids.numel() * adapters  # the reference runs without adapters


@pytest.mark.parametrize("lora", [False, True])
def test_differentiable_rollout_flops_equal_the_counted_flops(lora):
    """GumbelTopK's generate, reward and backward as torch counts them, against the work its step_work() declares."""
    method = GumbelTopK(
        name_or_path="tiny:llama", reward_model="tiny:llama", max_new_tokens=4, min_new_tokens=4,
        lora=LoraSettings(r=4, alpha=8) if lora else None,
    )  # fmt: skip
    method.setup("fit")
    method.configure_model()
    for model in (method.policy, method.reference, method.reward_model):  # attention as matmuls torch counts
        if model is not None:
            model.set_attn_implementation("eager")
    torch.manual_seed(0)
    b, p = 3, 7
    ids, mask = torch.randint(3, 90, (b, p)), torch.ones(b, p, dtype=torch.long)
    counted = {}
    with FlopCounterMode(display=False, custom_mapping=MAPPING) as fc:
        rollout = method.soft_rollout(ids, mask, 0.5)
    counted["generate"] = fc.get_total_flops()
    with FlopCounterMode(display=False, custom_mapping=MAPPING) as fc:
        reward = method.score(ids, mask, rollout)
    counted["reward"] = fc.get_total_flops()
    loss = (method.hparams.beta * rollout.kl.sum(1) - reward).mean()
    with FlopCounterMode(display=False, custom_mapping=MAPPING) as fc:
        loss.backward()
    counted["backward"] = fc.get_total_flops()

    c = rollout.tokens.shape[1]
    shape = ModelShape.from_config(method.policy.config)
    trainable = sum(x.numel() for x in method.policy.parameters() if x.requires_grad)
    settings = StepSettings.of(
        step_work(method), trainable=trainable, prompts=b, generations=1, prompt_length=p, new_tokens=c
    )
    work = {name: sum(x.flops for x in parts) for name, parts in phase_work(shape, settings).items()}
    assert list(work) == ["generate", "reward", "backward", "optimizer"]
    h, head = shape.hidden, 2 * b * shape.head_weights
    score_head = 2 * b * c * h  # the reward model's score head on the completion tokens: not counted
    # the KL computes the policy's logits again beside the sampling step's (the least work computes them once)
    assert counted["generate"] == work["generate"] + c * head
    assert counted["reward"] == work["reward"] + score_head
    # a LoRA prefill computes no input gradient for the first layer's q, k, v projections (its input is a frozen
    # embedding), which the count includes as a sampled step's backward does; their adapters' neither
    layer = method.policy.base_model.model.model.layers[0] if lora else None
    qkv = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj] if lora else []
    skipped = sum(2 * b * p * (m.base_layer.weight.numel() + m.lora_A["default"].weight.numel()) for m in qkv)
    assert counted["backward"] == work["backward"] - skipped + score_head


def test_optimizer_bytes_are_adamw_state_gradients_and_parameters():
    model = _model()
    params = list(model.parameters())
    for x in params:
        x.grad = torch.ones_like(x)
    optimizer = torch.optim.AdamW(params, fused=True)
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.ndim)
    values = sum(x.numel() * x.element_size() for x in params)
    shape = ModelShape.from_config(model.config)
    work = phase_work(shape, _settings(trainable=sum(x.numel() for x in params), clip=True))["optimizer"]
    # AdamW: parameters read and written, gradients read, both moments read and written; then the gradient's finite
    # check (a read) and clipping (a read for the norm, a read and a write to scale)
    assert [w.flops for w in work] == [0]
    assert work[0].bytes == 2 * values + values + 2 * state + 4 * values


def test_floor_takes_the_larger_of_compute_and_memory_per_part():
    works = phase_work(ModelShape(576, 1536, 30, 9, 3, 64, 49152), _settings(prompts=16, new_tokens=12))["rollout"]
    assert len(works) == 13  # the prefill and 12 decode steps
    f = floor(works, matmul=1e11, bandwidth=1e10, skinny=1e10)
    assert f["floor_s"] == pytest.approx(sum(max(w.flops / 1e11, w.bytes / 1e10) for w in works))
    assert max(f["compute_s"], f["memory_s"]) <= f["floor_s"] <= f["compute_s"] + f["memory_s"]
    assert f["attainable_s"] >= f["floor_s"]  # the decode steps at the slower decode-shaped rate
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelShape.from_config(type("Config", (), {"num_local_experts": 8})())


SMOL = ModelShape(576, 1536, 30, 9, 3, 64, 49152)  # SmolLM2-135M


@pytest.mark.parametrize("merged", [False, True])
def test_a_bf16_sampler_reads_half_the_bytes_at_the_bf16_rate_after_one_cast(merged):
    """A bfloat16 sampler of float32 weights: every rollout part reads 2-byte weights and a 2-byte cache and runs at
    bfloat16's rate; one part before it casts the weights (read at 4 bytes, written at 2), or, merged, writes the
    merged trunk at 2 bytes and casts only the head. Merged LoRA runs no adapter matmul in the rollout."""
    lora = _settings(prompts=4, new_tokens=3, adapters=10_000, trainable=10_000)
    plain = phase_work(SMOL, lora)["rollout"]
    sampler = phase_work(SMOL, replace(lora, rollout_dtype="bfloat16", rollout_merged=merged))["rollout"]
    w, hv, a = SMOL.trunk_weights, SMOL.head_weights, 0 if merged else 10_000
    prep, parts = sampler[0], sampler[1:]
    assert prep.flops == 0 and prep.dtype is None
    assert prep.bytes == ((w + 10_000) * 4 + w * 2 + hv * 6 if merged else (w + hv) * 6)
    assert len(parts) == len(plain) and all(x.dtype == "bfloat16" for x in parts)
    keys = 9 + 3 - 1  # the last decode step attends over P + C - 1 keys
    cache = SMOL.cache_values_per_token * 2 * 4 * (keys + 1)
    assert parts[-1].bytes == (w + a + hv) * 2 + cache
    assert parts[-1].flops == plain[-1].flops - (2 * 4 * 10_000 if merged else 0)
    other = (("bfloat16", 4e11, 2e11),)
    fast = floor(parts, matmul=1e11, bandwidth=1e10, skinny=5e10, other=other)
    assert fast["compute_s"] == pytest.approx(sum(x.flops for x in parts) / 4e11)
    assert fast["attainable_s"] == pytest.approx(
        sum(max(x.flops / (2e11 if x.decode else 4e11), x.bytes / 1e10) for x in parts)
    )


@pytest.mark.parametrize("merged", [False, True])
def test_a_packed_float32_sampler_copies_the_weights_it_reads_once_and_reads_them_as_before(merged):
    """A float32 sampler on packed weights: one part before the rollout reads and writes the weights it will read
    (4 bytes each: the trunk and head, the adapters unless merged) and, under LoRA, the trunk once more (unpacked
    after the rollout); every other part is the plain sampler's."""
    lora = _settings(prompts=4, new_tokens=3, adapters=10_000, trainable=10_000)
    plain = phase_work(SMOL, replace(lora, rollout_merged=merged))["rollout"]
    packed = phase_work(SMOL, replace(lora, rollout_merged=merged, rollout_packed=True))["rollout"]
    w, hv = SMOL.trunk_weights, SMOL.head_weights
    assert len(packed) == len(plain) + (not merged)  # merged: one part before the rollout does both
    before = plain[0].bytes if merged else 0
    assert packed[0].flops == 0 and packed[0].bytes - before == (w + hv + 10_000 * (not merged)) * 8 + w * 8
    assert packed[1:] == plain[merged:]


class _Decoded(TorchDispatchMode):
    """Bytes of the dense weights bitsandbytes decodes from 4-bit codes: its ``dequantize_4bit`` outputs (the
    backward), and the weights of its ``gemm_4bit`` (the forward), whose CPU kernel decodes the whole weight in the
    input's dtype before a dense matmul (``_gemm_4bit_default_impl`` in bitsandbytes' ``backends/default/ops.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.name() if func.namespace == "bitsandbytes" else ""
        if name.startswith("bitsandbytes::dequantize_4bit"):
            self.bytes += out.numel() * out.element_size()
        elif name.startswith("bitsandbytes::gemm_4bit"):
            self.bytes += math.prod(args[2]) * args[0].element_size()  # (A, B, shapeB, ...)
        return out


def test_a_4bit_base_reads_its_codes_and_writes_and_reads_its_decoding_in_every_pass():
    """Against a real NF4 model: its stored bytes per weight set ``base_nf4``, and every pass that reads the trunk
    (a training forward and its backward, counted by the ops bitsandbytes runs) decodes every trunk weight once at the
    training dtype. The roofline counts those bytes written and read again on top of the codes, in every part that
    reads the trunk, and leaves FLOPs, the head and the adapters as they are."""
    pytest.importorskip("bitsandbytes")
    from lit_rl.models.quantize import nf4_memory, quantize_base_nf4

    model = quantize_base_nf4(_model("llama"))
    shape = ModelShape.from_config(model.config)
    weights, stored, _ = nf4_memory(model)
    assert weights == shape.trunk_weights
    embeds = model.get_input_embeddings()(torch.randint(3, 96, (2, 9))).detach().requires_grad_()
    with _Decoded() as forward:
        loss = trunk(model)(inputs_embeds=embeds).last_hidden_state.sum()
    with _Decoded() as backward:
        loss.backward()
    assert forward.bytes == backward.bytes == shape.trunk_weights * 4  # one dense float32 decoding per pass

    q, w, hv = stored / weights, SMOL.trunk_weights, SMOL.head_weights  # the tiny model's bytes per weight, at SMOL
    lora = _settings(prompts=4, new_tokens=3, adapters=10_000, trainable=10_000, micro_batch=2)
    for sampler in ({}, {"rollout_dtype": "bfloat16", "rollout_merged": True}, {"rollout_packed": True}):
        dense = phase_work(SMOL, replace(lora, **sampler))
        nf4 = phase_work(SMOL, replace(lora, base_nf4=q, **sampler))
        rb = 2 if sampler.get("rollout_dtype") else 4
        for name in ("reference", "policy_forward", "backward"):
            for x, y in zip(dense[name], nf4[name], strict=True):
                assert (y.flops, y.bytes - x.bytes) == (x.flops, pytest.approx(w * (q + 4))), name
        # the last decode step: the trunk decoded at float32 whatever the sampler's dtype, the adapters (a 4-bit
        # trunk is not merged: they keep running) and head at the sampler's, the cache of 4 rows over 11 + 1 keys
        last, cache = nf4["rollout"][-1], SMOL.cache_values_per_token * rb * 4 * 12
        assert last.bytes == pytest.approx(w * (q + 8) + (10_000 + hv) * rb + cache)
        assert last.flops == phase_work(SMOL, lora)["rollout"][-1].flops
        before = [x for x in nf4["rollout"] if not x.flops]  # the sampler's once-per-rollout pass: head and adapters
        assert sum(x.bytes for x in before) == (hv * 6 if rb == 2 else (hv + 10_000) * 8 if sampler else 0)


def test_grpo_declares_its_sampler_for_the_roofline():
    lora = LoraSettings(r=4, alpha=8, target_modules="all-linear")
    method = RefCachedGRPO(name_or_path="tiny:llama", lora=lora, rollout_dtype="bfloat16", rollout_lora="merged")
    assert (step_work(method).rollout_dtype, step_work(method).rollout_merged) == ("bfloat16", True)
    settings = StepSettings.of(step_work(method), trainable=1, prompts=1, generations=2, prompt_length=4, new_tokens=2)
    assert (settings.rollout_dtype, settings.rollout_merged) == ("bfloat16", True)
    packed = RefCachedGRPO(name_or_path="tiny:llama", rollout_linear="packed")
    settings = StepSettings.of(step_work(packed), trainable=1, prompts=1, generations=2, prompt_length=4, new_tokens=2)
    assert settings.rollout_packed and not step_work(method).rollout_packed
    # counted only where it packs: float32 compute on a CPU (a GPU, bf16 autocast or bf16 weights: no effect)
    for where in (dict(device="cuda"), dict(weight_bytes=4, cache_bytes=2), dict(weight_bytes=2, cache_bytes=2)):
        shapes = dict(prompts=1, generations=2, prompt_length=4, new_tokens=2, **where)
        assert not StepSettings.of(step_work(packed), trainable=1, **shapes).rollout_packed, where
    full = RefCachedGRPO(name_or_path="tiny:llama", rollout_lora="merged")  # no LoRA: nothing to merge
    assert (step_work(full).rollout_dtype, step_work(full).rollout_merged) == (None, False)


def test_rates_round_trip_and_a_bad_file_names_the_command(tmp_path):
    rates = measure_rates("cpu", ("float32",), quick=True)
    assert rates["dtypes"]["float32"]["matmul_flops_per_s"] > 1e8 and rates["bandwidth_bytes_per_s"] > 1e8
    assert load_rates(save_rates(rates, tmp_path / "rates.json")) == json.loads(json.dumps(rates))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="lit-rl rates --out"):
        load_rates(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="no such file"):
        PhaseRoofline(str(tmp_path / "missing.json"))


def _rates(scale: float) -> dict:
    return {"device": "cpu", "bandwidth_bytes_per_s": 1e10 * scale, "details": {"copy_bytes_per_s": 1e10 * scale},
            "dtypes": {"float32": {"matmul_flops_per_s": 1e11 * scale, "skinny_matmul_flops_per_s": 5e10 * scale}}}  # fmt: skip


def test_rerate_puts_the_same_steps_beside_the_best_of_several_rates():
    model = ModelShape(576, 1536, 30, 9, 3, 64, 49152)  # SmolLM2-135M
    settings = StepSettings(prompts=2, generations=8, prompt_length=44, new_tokens=12, trainable=134_515_008)
    names = ("rollout", "reference", "policy_forward", "backward", "optimizer")
    times = {name: 1.0 for name in names}
    report = {"rates": {"dtype": "float32"}, "model": asdict(model), "names": list(names),
              "per_step": [{"step": 2, "times": times, "settings": asdict(settings)}]}  # fmt: skip
    slow = rerate(report, _rates(1.0), "slow")
    assert slow["phases"] == phase_table(model, [{"times": times, "settings": settings}], names, _rates(1.0), "float32")
    best = best_of(_rates(1.0), _rates(2.0))  # a figure measured under load only ever reads low
    assert best["bandwidth_bytes_per_s"] == 2e10 and best["dtypes"]["float32"]["matmul_flops_per_s"] == 2e11
    fast = rerate(report, best, "best")
    assert fast["rates"]["source"] == "best" and fast["rates"]["matmul_flops_per_s"] == 2e11
    for name in names:  # the same FLOPs and bytes: twice the rates, half the floors
        assert fast["phases"][name]["flops"] == slow["phases"][name]["flops"]
        assert fast["phases"][name]["floor_s"] == pytest.approx(slow["phases"][name]["floor_s"] / 2)
    assert slow["phases"]["optimizer"]["floor_s"] == pytest.approx(11 * 4 * 134_515_008 / 1e10)
    with pytest.raises(ValueError, match="no bfloat16"):
        rerate({**report, "rates": {"dtype": "bfloat16"}}, _rates(1.0), "slow")


# ----------------------------------------------------------------------------------------------- the profiler


@pytest.mark.parametrize(
    ("cls", "options", "reference", "scoring", "iterations"),
    [
        (RefCachedGRPO, {}, True, 0, 1),
        (RefCachedGRPO, {"loss": LossSettings(beta=0.0)}, False, 0, 1),
        (RefCachedGRPO, {"loss": LossSettings(beta=0.0), "num_iterations": 3}, False, 1, 3),
        (Intuitor, {}, True, 1, 1),  # self-certainty, in the same policy pass as the old log-probs
        (Intuitor, {"loss": LossSettings(beta=0.0), "num_iterations": 2}, False, 1, 2),
        (GumbelTopK, {}, True, 0, 1),
        (GumbelTopK, {"beta": 0.0}, False, 0, 1),
    ],
)
def test_each_method_declares_the_passes_the_roofline_counts(cls, options, reference, scoring, iterations):
    method = cls(name_or_path="tiny:llama", micro_batch_size=2, max_grad_norm=0.0, **options)
    work = step_work(method)
    assert (work.reference_pass, work.scoring_passes, work.iterations) == (reference, scoring, iterations)
    assert (work.micro_batch, work.adapters, work.clip) == (2, False, False)
    assert work.share_prompt == getattr(method, "share_prompt", False)
    soft = work.differentiable  # GumbelTopK's rollout is differentiated through; its scorer is known once loaded
    assert (soft is not None) == (cls is GumbelTopK)
    if soft is not None:
        assert (soft.top_k, soft.scorer, soft.recompute_steps, soft.grad_window) == (256, None, False, None)


def _fit(tmp_path, rates, method=None):
    method = method or RefCachedGRPO(name_or_path="tiny:llama", num_generations=2, max_new_tokens=4)
    data = PromptDataModule(num_prompts=64, batch_size=2, max_prompt_length=64, val_size=0)
    profiler = MemoryProfiler(predict=False, track_tensors=False, rates=rates)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, enable_progress_bar=False, enable_model_summary=False, logger=False,
        enable_checkpointing=False, limit_val_batches=0, default_root_dir=tmp_path,
        callbacks=[RunLog(progress="never"), profiler],
    )  # fmt: skip
    trainer.fit(method, data)
    return method, json.loads((tmp_path / "memory_summary.json").read_text())["roofline"]


@pytest.mark.slow  # three tiny fits
def test_profiler_summary_puts_each_phase_time_beside_its_floor(tmp_path, lightning_log):
    rates = {"device": "cpu", "bandwidth_bytes_per_s": 1e9,
             "dtypes": {"float32": {"matmul_flops_per_s": 1e9, "skinny_matmul_flops_per_s": 5e8}}}  # fmt: skip
    path = save_rates(rates, tmp_path / "rates.json")
    method, roofline = _fit(tmp_path / "file", str(path))
    assert roofline["rates"]["source"] == str(path) and roofline["steps"] == [2, 3]  # the first step warms up
    phases = roofline["phases"]
    assert list(phases) == ["rollout", "reference", "policy_forward", "backward", "optimizer"]
    for name, entry in phases.items():
        assert entry["measured_s"] > 0 and entry["floor_s"] > 0, name
        assert entry["achieved"] == pytest.approx(entry["floor_s"] / entry["measured_s"])
        assert entry["floor_s"] == pytest.approx(max(entry["flops"], entry["bytes"]) / 1e9, rel=0.5)
    trainable = sum(p.numel() for p in method.policy.parameters())
    assert phases["optimizer"]["bytes"] == 11 * 4 * trainable and phases["optimizer"]["bound"] == "memory"
    text = lightning_log.text
    line = next(ln for ln in text.splitlines() if ln.startswith("  time s "))
    assert "rollout " in line and "(floor " in line and "optimizer " in line and str(path) in line
    assert summary_line(roofline) in line
    assert rerate(roofline, load_rates(path), str(path)) == roofline  # the saved steps are enough to redo the floors

    # a quick measurement without a file; none at all with null; another device's rates are refused
    _, measured = _fit(tmp_path / "measure", "measure")
    assert measured["rates"]["source"].startswith("measured") and measured["phases"]["backward"]["floor_s"] > 0
    _, off = _fit(tmp_path / "off", None)
    assert off == {"skipped": "turned off (rates: null)"}

    # a differentiable rollout's own phases, each beside its floor
    method = GumbelTopK(name_or_path="tiny:llama", reward_model="tiny:llama", max_new_tokens=4)
    _, soft = _fit(tmp_path / "soft", str(path), method)
    assert list(soft["phases"]) == ["generate", "reward", "backward", "optimizer"]
    assert all(e["floor_s"] > 0 and e["achieved"] > 0 for e in soft["phases"].values())
    assert soft["settings"]["soft_topk"] == 256 and soft["settings"]["scorer"]["layers"] == 2
    assert rerate(soft, load_rates(path), str(path)) == soft
    save_rates({**rates, "device": "cuda"}, path)
    _, other = _fit(tmp_path / "cuda", str(path))
    assert "cuda rates" in other["skipped"] and "trains on cpu" in other["skipped"]


def test_profiler_times_a_4bit_base_beside_a_floor_with_its_decoding(tmp_path):
    """A QLoRA fit gets a roofline, not "not modelled": its settings carry the model's own NF4 bytes per weight, and
    each phase that reads the trunk has a floor above the same fit's work on a dense trunk."""
    pytest.importorskip("bitsandbytes")
    from lit_rl.models import nf4_memory

    rates = {"device": "cpu", "bandwidth_bytes_per_s": 1e9,
             "dtypes": {"float32": {"matmul_flops_per_s": 1e9, "skinny_matmul_flops_per_s": 5e8}}}  # fmt: skip
    path = save_rates(rates, tmp_path / "rates.json")
    lora = LoraSettings(r=4, alpha=8, target_modules="all-linear")
    method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=2, max_new_tokens=4, lora=lora,
                           quantize_base="nf4")  # fmt: skip
    method, roofline = _fit(tmp_path, str(path), method)
    weights, stored, _ = nf4_memory(method.policy)
    assert "skipped" not in roofline and roofline["settings"]["base_nf4"] == pytest.approx(stored / weights)
    steps = [{"times": s["times"], "settings": replace(StepSettings(**s["settings"]), base_nf4=0.0)}
             for s in roofline["per_step"]]  # fmt: skip
    names = tuple(roofline["phases"])
    dense = phase_table(ModelShape.from_config(method.policy.config), steps, names, rates, "float32")
    for name in ("rollout", "reference", "policy_forward", "backward"):
        assert roofline["phases"][name]["bytes"] > dense[name]["bytes"] > 0, name


def test_rates_command_writes_a_file_the_profiler_reads(tmp_path, capsys):
    from lit_rl.cli import main

    main(["rates", "--quick", "--out", str(tmp_path / "rates.json")])
    assert f"wrote {tmp_path / 'rates.json'}" in capsys.readouterr().out
    rates = load_rates(tmp_path / "rates.json")
    assert set(rates["dtypes"]) == {"float32", "bfloat16"} and rates["quick"] and rates["device"] == "cpu"
    PhaseRoofline(str(tmp_path / "rates.json"))  # accepted as the profiler's rates: file
