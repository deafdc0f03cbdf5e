"""A bfloat16 frozen reference for full fine-tuning: half the copy's bytes in the estimate, log-probs close to the
float32 copy's but not equal (the error bench/bench_reference_dtype.py measures), and LoRA unaffected."""

from __future__ import annotations

import pytest
import torch

from lit_rl.memory.estimate import estimate_step
from lit_rl.methods import RefCachedGRPO
from lit_rl.methods.grpo import Rollout


def _method(**kw):
    method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=2, max_new_tokens=4, **kw)
    method.setup("fit")
    method.configure_model()
    return method


def test_the_reference_copy_is_bfloat16_and_scores_close_to_the_float32_copy():
    full, half = _method(), _method(reference_dtype="bfloat16")
    half.policy.load_state_dict(full.policy.state_dict())
    half.reference = half.frozen_copy()
    assert {p.dtype for p in half.reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in half.policy.parameters()} == {torch.float32}  # only the copy changes
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (4, 9), generator=gen)
    ids[2:, :5] = ids[:2, :5]  # two prompts of 5 tokens, two completions each
    ids[1], ids[3] = ids[0].clone(), ids[2].clone()
    ids[1, 5:] = torch.randint(3, 90, (4,), generator=gen)
    rollout = Rollout(ids, torch.ones_like(ids), torch.ones(4, 4), 5, torch.zeros(4), torch.zeros(4))
    ref32, ref16 = full.reference_logp(rollout), half.reference_logp(rollout)
    assert ref16.dtype == torch.float32  # the log-prob math stays float32
    assert not torch.equal(ref16, ref32)
    torch.testing.assert_close(ref16, ref32, atol=0.05, rtol=0)


def test_the_estimate_charges_half_the_copy():
    method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=2, max_new_tokens=4)
    rows = {}
    for dtype in ("same", "bfloat16"):
        estimate = estimate_step(method, batch_size=1, prompt_length=5, reference_dtype=dtype)
        rows[dtype] = next(c.bytes for c in estimate.components if c.name == "reference weights")
    assert rows["bfloat16"] * 2 == rows["same"] > 0


def test_lora_keeps_no_copy_whatever_the_reference_dtype():
    from lit_rl.models import LoraSettings

    method = _method(reference_dtype="bfloat16", lora=LoraSettings(r=4, alpha=8))
    assert method.reference is None


@pytest.mark.parametrize("bad", ["float8", "bf16"])
def test_an_unknown_reference_dtype_is_refused_by_the_cli(bad, capsys, tmp_path):
    from pathlib import Path

    from lit_rl.cli import main

    config = str(Path(__file__).resolve().parents[1] / "configs/grpo_tiny.yaml")
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", config, "--model.init_args.reference_dtype", bad])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("error: model.reference_dtype:") and "\n" not in err
