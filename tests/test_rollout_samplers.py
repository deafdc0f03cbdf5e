"""The faster samplers: rows dropped as they end, the one-uniform draw, LoRA merged for the rollout.

Dropping rows keeps ``generate``'s tokens (the draw stays full-size); the one-uniform draw is checked as a
distribution (frequencies against the probabilities, never a token of probability 0, the edges of the uniform);
its log-probs against a float64 full forward over the finished sequences. The merged LoRA sampler against the
adapters' own forward in float64, with every weight bitwise restored afterwards; and through a GRPO step: the gap
logged, the merged copy predicted by the profiler as it is measured.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from peft import LoraConfig, get_peft_model
from test_decode import EOS, PAD, _prompts
from test_grpo import _data, _method, _trainer
from transformers import GenerationConfig

from lit_rl.models import LoraSettings, sample_completions
from lit_rl.models.decode import decode, inverse_cdf_draw, sampling_settings
from lit_rl.models.merged_lora import lora_merged
from lit_rl.models.shared_prompt import shared_prefill
from lit_rl.models.tiny import tiny_model

SAMPLING = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0)


def _ending_early(model, ids, mask):
    """EOS ids that end rows at different steps: the most frequent tokens of a first run."""
    torch.manual_seed(5)
    config = GenerationConfig(pad_token_id=PAD, eos_token_id=[EOS], max_new_tokens=30, **SAMPLING)
    first = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]
    counts = torch.bincount(first.flatten(), minlength=128)
    counts[[PAD, EOS]] = 0
    return counts.topk(8).indices.tolist()


def _live(completion: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """[B, C] True up to and including each row's first EOS."""
    is_eos = torch.isin(completion, torch.tensor(eos))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.shape[1])
    return torch.arange(completion.shape[1])[None] <= first[:, None]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shared", [False, True], ids=["rows", "shared_prefill"])
def test_dropping_ended_rows_keeps_generates_tokens(arch, shared):
    model = tiny_model(arch, seed=3).eval()
    prompts, prompt_mask = _prompts(rows=3)
    ids, mask = prompts.repeat_interleave(2, 0), prompt_mask.repeat_interleave(2, 0)  # [6, P], rows 2-3 padded
    eos = _ending_early(model, ids, mask)
    config = GenerationConfig(pad_token_id=PAD, eos_token_id=eos, max_new_tokens=60, **SAMPLING)
    settings, _ = sampling_settings(model, config)
    batches = []

    ended_apart = 0
    for seed in range(4):
        torch.manual_seed(seed)
        expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        cache = shared_prefill(model, prompts, prompt_mask, 2) if shared else None
        torch.manual_seed(seed)
        full, full_logp = decode(model, ids, mask, eos=eos, pad_id=PAD, return_logprobs=True, cache=cache, **settings)
        cache = shared_prefill(model, prompts, prompt_mask, 2) if shared else None
        batches.clear()
        hook = model.register_forward_pre_hook(
            lambda module, args, kwargs: batches.append(kwargs["input_ids"].shape[0]), with_kwargs=True
        )
        try:
            torch.manual_seed(seed)
            got, logp = decode(
                model, ids, mask, eos=eos, pad_id=PAD, return_logprobs=True, cache=cache, drop_ended=True, **settings
            )
        finally:
            hook.remove()
        assert torch.equal(got, expected), seed
        live = _live(got[:, ids.shape[1] :], eos)
        torch.testing.assert_close(logp[live], full_logp[live], atol=1e-5, rtol=0)
        assert (logp[~live] == 0).all()
        ends = live.sum(1)
        if len(set(ends.tolist())) > 1 and int(ends.max()) > int(ends.min()) + 1:
            ended_apart += 1
            # every forward after a row ended ran on the rows still decoding only
            assert batches[0] == 6 and min(batches) < 6 and batches == sorted(batches, reverse=True)
            assert batches[-1] == int((ends == ends.max()).sum())
    assert ended_apart >= 2, "the test needs rows that end at different steps"


def test_inverse_cdf_draw_follows_the_probabilities():
    probs = torch.tensor(
        [
            [0.0, 0.5, 0.0, 0.25, 0.25, 0.0, 0.0],  # zeros first, between and last
            [1 / 7] * 7,
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
        ],
        dtype=torch.float32,
    )  # [3, 7]
    torch.manual_seed(0)
    n = 20_000
    draws = torch.stack([inverse_cdf_draw(probs) for _ in range(n)], 1)  # [3, n]
    for row in range(3):
        freq = torch.bincount(draws[row], minlength=7).double() / n
        p = probs[row].double()
        assert (freq[p == 0] == 0).all(), row
        sigma = (p * (1 - p) / n).sqrt()
        assert ((freq - p).abs() <= 5 * sigma + 1e-12).all(), (row, freq, p)


@pytest.mark.parametrize("u", [0.0, 1.0 - 2**-24, 0.5])
def test_inverse_cdf_draw_at_the_edges_of_the_uniform(monkeypatch, u):
    """u = 0 takes the first token of positive probability; u just below 1 (rounding up to the total) the last."""
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0], [0.0, 0.0, 0.6, 0.0, 0.4, 0.0]])
    monkeypatch.setattr(torch, "rand_like", lambda t: torch.full_like(t, u))
    tokens = inverse_cdf_draw(probs).tolist()
    expected = {0.0: [1, 2], 1.0 - 2**-24: [3, 4], 0.5: [3, 2]}[u]
    assert tokens == expected


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fast_sampler_log_probs_are_a_full_forwards(temperature):
    """The fast draw (rows dropped, one uniform) records the log-probs a float64 full forward gives its tokens."""
    model = tiny_model("llama", seed=6).eval()
    ids, mask = _prompts(rows=5, length=6)
    eos = _ending_early(model, ids, mask)
    torch.manual_seed(1)
    seqs, logp = decode(
        model, ids, mask, eos=eos, pad_id=PAD, max_new_tokens=25, temperature=temperature, return_logprobs=True,
        drop_ended=True, draw="inverse_cdf",
    )  # fmt: skip
    p = ids.shape[1]
    full_mask = torch.cat([mask, torch.ones_like(seqs[:, p:])], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    model64 = tiny_model("llama", seed=6).double().eval()
    logits = model64(input_ids=seqs, attention_mask=full_mask, position_ids=positions).logits[:, p - 1 : -1]
    expected = torch.log_softmax(logits / temperature, -1).gather(-1, seqs[:, p:, None]).squeeze(-1)
    live = _live(seqs[:, p:], eos)
    assert (~live).any() and live.any()
    torch.testing.assert_close(logp[live].double(), expected[live], atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="draw: 'gumbel' is not multinomial or inverse_cdf"):
        decode(model, ids, mask, eos=eos, pad_id=PAD, max_new_tokens=2, draw="gumbel")


def _lora_model(seed: int = 0, **config):
    model = tiny_model("llama", seed=seed)
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]) | config
    peft_model = get_peft_model(model, LoraConfig(**config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: the merge would change nothing
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return peft_model.eval()


def test_merged_lora_is_the_adapters_forward_and_restores_every_weight():
    model = _lora_model()
    ids, mask = _prompts(rows=3)
    before = {name: (param, param.detach().clone()) for name, param in model.named_parameters()}
    with torch.no_grad():
        adapters = model(input_ids=ids, attention_mask=mask).logits
        model64 = _lora_model().double()
        expected = model64(input_ids=ids, attention_mask=mask).logits
        with lora_merged(model) as (merged, left):
            inside = model(input_ids=ids, attention_mask=mask).logits
            base_weight = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
            assert not any(base_weight is p for p, _ in before.values())  # a merged copy, not the parameter
        after = model(input_ids=ids, attention_mask=mask).logits
    assert (merged, left) == (3 * 2, 0)  # three targets in each of the tiny model's two layers
    torch.testing.assert_close(inside.double(), expected, atol=1e-5, rtol=0)
    assert not torch.equal(inside, adapters)  # another sum order: close, not bitwise
    assert torch.equal(after, adapters)
    for name, param in model.named_parameters():
        assert param is before[name][0] and torch.equal(param, before[name][1]), name  # the same tensors, unwritten


def test_merged_lora_leaves_layers_it_cannot_merge():
    model = _lora_model(lora_bias=True)
    with lora_merged(model) as (merged, left):
        assert (merged, left) == (0, 6)
    with model.disable_adapter(), lora_merged(model) as (merged, left):  # adapters off: nothing to merge
        assert merged == 0


class _NonZeroAdapters(Callback):
    """Seeded non-zero LoRA B matrices before the first step: peft starts them at zero, and whether one step's update
    moves them depends on the sampled rewards differing within a group, which differs between CPUs."""

    def on_fit_start(self, trainer, pl_module) -> None:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in pl_module.policy.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


def test_grpo_with_the_fast_and_merged_samplers_logs_the_gap_and_predicts_the_copy(capture_logger, tmp_path):
    """LoRA merged for the rollout: another sampler (the logged gap), and a merged copy the profiler predicts as it
    measures it. The fast draw: the same sampler (no gap beyond float rounding)."""
    from lit_rl.callbacks import MemoryProfiler

    lora = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    results = {}
    for arm, kw in {
        "adapters": {},
        "merged": dict(rollout_lora="merged"),
        "fast": dict(rollout_draw="fast"),
    }.items():
        torch.manual_seed(0)
        method = _method(lora=lora, learning_rate=5e-2, **kw)
        callbacks = [_NonZeroAdapters(), MemoryProfiler()]
        trainer = _trainer(logger=capture_logger, callbacks=callbacks, default_root_dir=tmp_path, steps=2)
        trainer.fit(method, _data())
        metrics = capture_logger.metrics
        measured, predicted = metrics["memory/rollout/peak_gib"][-1][1], metrics["memory/rollout/predicted_gib"][-1][1]
        assert predicted == pytest.approx(measured, rel=0.02), arm
        gap = metrics["rollout/sampler_logp_diff/max"][-1][1], metrics["rollout/sampler_logp_diff/mean"][-1][1]
        results[arm] = (gap, measured)
        capture_logger.metrics.clear()
    assert results["adapters"][0][0] < 1e-4 and results["fast"][0][0] < 1e-4 and results["merged"][0][0] < 1e-4
    # the adapters are non-zero: merged weights are another sum order, so the gap may move by a few float32 ulps
    # (on an AMD EPYC both its maximum and its mean equal the adapters': no assertion that they differ)
    assert results["merged"][1] > results["adapters"][1]  # the merged copy, held through the rollout
    for name, bad, fix in (("rollout_lora", "fused", "adapters or merged"), ("rollout_draw", "gumbel", "generate or fast")):
        with pytest.raises(ValueError, match=f"model.{name}: '{bad}' is not {fix}; use one of them"):
            _method(**{name: bad})


def test_sample_completions_fast_draw_completes_every_prompt():
    model = tiny_model("llama", seed=7)
    ids, mask = _prompts(rows=2)
    torch.manual_seed(0)
    seqs, logp = sample_completions(
        model, ids, mask, PAD, [EOS], repeats=3, share_prompt=True, own_decode="own", return_logprobs=True,
        fast_draw=True, do_sample=True, max_new_tokens=7,
    )  # fmt: skip
    assert seqs.shape[0] == 6 and logp.shape == (6, seqs.shape[1] - ids.shape[1])
    assert torch.equal(seqs[:, : ids.shape[1]], ids.repeat_interleave(3, 0))


def test_importing_lit_rl_leaves_peft_unimported():
    """peft imports bitsandbytes, which logs a notice at import time; the CLI filters it only once it has started, so
    the package (the merged sampler included) imports peft when it is used, not when lit_rl loads."""
    import subprocess
    import sys

    code = "import sys, lit_rl.cli, lit_rl.methods, lit_rl.models; print('peft' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
