"""``lit-rl estimate`` on MoE, hybrid / recurrent and MLA architectures, in any dtype, or one line saying why not."""

from __future__ import annotations

import pytest
import torch
import transformers

from lit_rl.memory import fake
from lit_rl.memory.estimate import estimate_step
from lit_rl.methods import RefCachedGRPO

V = 128
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
MLA = dict(SMALL, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=8)  # fmt: skip
CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2
    ),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    "granitemoe": lambda: transformers.GraniteMoeConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    "recurrent_gemma": lambda: transformers.RecurrentGemmaConfig(
        **{k: v for k, v in SMALL.items() if k != "max_position_embeddings"}, lru_width=32, attention_window_size=16,
        block_types=["recurrent", "attention"],
    ),  # fmt: skip
    "minicpm3": lambda: transformers.MiniCPM3Config(**MLA),  # keys and values of different head sizes
    "falcon_h1": lambda: transformers.FalconH1Config(
        **SMALL, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8,
        mamba_expand=1,
    ),  # fmt: skip
}


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_estimate_runs_on_moe_recurrent_and_mla_models(name, precision):
    method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=2, max_new_tokens=5)  # 5: decode steps skipped
    estimate = estimate_step(method, batch_size=2, prompt_length=8, model_config=CONFIGS[name](), precision=precision)
    assert list(estimate.phases) == ["rollout", "reference", "policy_forward", "backward", "optimizer"]
    assert all(peak > 0 for peak in estimate.phases.values())
    cache = estimate.component("KV cache (end of rollout)")
    assert cache is not None and cache.bytes > 0, name


def test_grouped_expert_matmul_result_has_the_real_kernels_shape():
    offs = torch.tensor([4, 8, 16], dtype=torch.int32)  # 3 experts over 16 tokens sorted by expert
    cases = [
        (torch.randn(16, 8), torch.randn(3, 8, 4), offs),  # forward: tokens x per-expert weights -> [16, 4]
        (torch.randn(4, 16), torch.randn(16, 8), offs),  # weight gradient, jagged over tokens -> [3, 4, 8]
        (torch.randn(3, 4, 8), torch.randn(3, 8, 4), None),  # batched -> [3, 4, 4]
    ]
    for a, b, o in cases:
        assert fake.grouped_mm_result(a, b, offs=o).shape == torch._grouped_mm(a, b, offs=o).shape


@pytest.mark.parametrize("error", [RuntimeError, NotImplementedError])  # torch raises both for a missing kernel
def test_a_step_that_cannot_run_on_fake_tensors_is_one_line(monkeypatch, error):
    def broken(*args, **kwargs):
        raise error("no meta kernel for this op\nsecond line")

    monkeypatch.setattr(fake, "grouped_mm_result", broken)
    method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=2, max_new_tokens=2)
    with pytest.raises(fake.UnpredictableStep) as err:
        estimate_step(method, batch_size=1, prompt_length=8, model_config=CONFIGS["qwen3_moe"](), precision="32-true")
    message = str(err.value)
    assert "\n" not in message and "cannot predict" in message and "no meta kernel" in message
    assert "MemoryProfiler" in message
