"""RefCachedGRPO on a tiny model: alignment of log-probs, the cached reference, what a step changes, bad input."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_rl.data import PromptDataModule
from lit_rl.losses import LossSettings
from lit_rl.methods import RefCachedGRPO
from lit_rl.methods.grpo import Rollout
from lit_rl.models import LoraSettings

RUN = dict(max_new_tokens=6, num_generations=4, learning_rate=1e-2)


def longer_is_better(completions, **_):
    """A reward every tiny random model can improve on, so advantages are never all zero."""
    return [float(len(c)) for c in completions]


def _trainer(logger=None, steps=1, **kw) -> L.Trainer:
    return L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=logger or False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        **kw,
    )


def _data(**kw) -> PromptDataModule:
    return PromptDataModule(num_prompts=16, batch_size=2, max_prompt_length=64, **kw)


def _method(**kw) -> RefCachedGRPO:
    args = dict(RUN, name_or_path="tiny:llama", reward_funcs=["test_grpo.longer_is_better"])
    args.update(kw)
    return RefCachedGRPO(**args)


def _ready(method: RefCachedGRPO) -> RefCachedGRPO:
    method.setup("fit")
    method.configure_model()
    return method


def test_completion_log_probs_match_full_logits_with_left_padding():
    method = _ready(_method(temperature=0.7))
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, :1] = 0
    ids[mask == 0] = method.tokenizer.pad_token_id
    prompt = 5
    stats = method.completion_stats(method.policy, ids, mask, prompt, temperature=0.7)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = method.policy(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits.double() / 0.7
    expected = torch.log_softmax(logits[:, prompt - 1 : -1], -1).gather(-1, ids[:, prompt:, None]).squeeze(-1)
    torch.testing.assert_close(stats.logp.double(), expected, atol=1e-5, rtol=1e-5)


def test_generation_mask_stops_after_first_eos():
    method = _ready(_method())
    eos = method.tokenizer.eos_token_id
    completion = torch.tensor([[5, eos, 7, 8], [5, 6, 7, 8]])
    method.generate = lambda ids, am, return_logprobs: (
        torch.cat([ids.repeat_interleave(2, 0)[:2], completion], 1),
        torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]]),
        None,  # as where generate samples: no sampler log-probs
    )
    batch = {
        "input_ids": torch.ones(1, 3, dtype=torch.long),
        "attention_mask": torch.ones(1, 3, dtype=torch.long),
        "prompts": ["p"],
        "answers": [1],
        "num_truncated": 0,
    }
    method.hparams.num_generations = 2
    rollout, metrics = method.rollout(batch)
    assert metrics["completions/mean_length"] == 3.0 and metrics["completions/clipped_ratio"] == 0.5
    method.hparams.mask_truncated_completions = True
    rollout, _ = method.rollout(batch)
    assert rollout.completion_mask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]


def test_real_generation_mask_is_prefix_up_to_eos():
    method = _ready(_method(max_new_tokens=12))
    ids = torch.randint(3, 90, (2, 5))
    seqs, cmask = method.generate(ids, torch.ones_like(ids))
    assert seqs.shape[0] == 8 and cmask.shape == (8, seqs.shape[1] - 5)
    eos = method.tokenizer.eos_token_id
    for row, m in zip(seqs[:, 5:], cmask):
        n = int(m.sum())
        assert torch.all(m[:n] == 1) and torch.all(m[n:] == 0)
        assert eos not in row[: n - 1].tolist()
        assert n == len(row) or row[n - 1] == eos


def test_min_new_tokens_forces_full_length_completions():
    lengths = {}
    for minimum in (0, 7):
        method = _ready(_method(max_new_tokens=7, min_new_tokens=minimum))
        eos = method.tokenizer.eos_token_id

        def favour_eos(module, args, logits, eos=eos):  # EOS is by far the likeliest token everywhere
            logits[..., eos] += 30.0
            return logits

        method.policy.lm_head.register_forward_hook(favour_eos)
        ids = torch.randint(3, 90, (2, 5))
        seqs, cmask = method.generate(ids, torch.ones_like(ids))
        lengths[minimum] = cmask.sum(1).tolist()
    assert lengths[0] == [1.0] * 8  # without the constraint every completion is EOS alone
    assert lengths[7] == [7.0] * 8 and eos not in seqs[:, 5:].tolist()


def test_lora_disabled_reference_is_exactly_the_base_model():
    method = _ready(_method(lora=LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"])))
    with torch.no_grad():  # peft starts B at zero; make the adapters matter
        for name, p in method.policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    base = _ready(_method()).policy  # the same seed builds the same base weights
    ids = torch.randint(3, 90, (4, 8))
    ids[1::2, :5] = ids[::2, :5]  # two groups of two completions (num_generations 2)
    mask = torch.ones_like(ids)
    rollout = Rollout(ids, mask, torch.ones(4, 3), 5, torch.zeros(4), torch.zeros(4))
    method.hparams.num_generations = 2
    ref = method.reference_logp(rollout)  # shares each group's prompt
    # the base model through the same shared-prompt computation: bit for bit what the disabled adapters give
    expected = method.completion_stats(base.eval(), ids, mask, 5, temperature=1.0, runs=[2, 2]).logp
    assert torch.equal(ref, expected)
    adapted = method.completion_stats(method.policy, ids, mask, 5, temperature=1.0).logp
    assert not torch.allclose(adapted, expected)


def _params(module):
    return {n: p.detach().clone() for n, p in module.policy.named_parameters()}


def test_full_finetune_step_changes_every_trainable_weight_that_gets_gradient(capture_logger):
    method = _method(loss=LossSettings(beta=0.1))
    trainer = _trainer(capture_logger)
    method.setup("fit")
    method.configure_model()
    before = _params(method)
    trainer.fit(method, _data())
    changed = {n for n, p in method.policy.named_parameters() if not torch.equal(p, before[n])}
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "model.norm.weight" in changed
    assert len(changed) >= 0.9 * len(before)
    # the frozen reference copy did not move
    ref = dict(method.reference.named_parameters())
    assert all(torch.equal(ref[n], before[n]) for n in ref)
    logged = capture_logger.metrics
    for key in (
        "reward/mean",
        "reward/std",
        "reward/longer_is_better/mean",
        "kl/mean",
        "clip_ratio/high_mean",
        "entropy/mean",
        "completions/mean_length",
        "completions/clipped_ratio",
        "frac_reward_zero_std",
        "time/rollout_s",
        "time/reference_s",
        "time/policy_forward_s",
        "time/backward_s",
        "time/optimizer_s",
    ):
        assert key in logged, key
    assert logged["kl/mean"][0][1] == pytest.approx(0.0, abs=1e-6), "policy == reference before the first update"


def test_lora_step_trains_adapters_and_leaves_base_untouched():
    method = _method(
        lora=LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"]),
        loss=LossSettings(beta=0.1),
        micro_batch_size=3,
    )
    method.setup("fit")
    method.configure_model()
    before = _params(method)
    _trainer(steps=2).fit(method, _data())  # step 1 moves B only: peft starts B at zero, so A's gradient is zero
    for name, p in method.policy.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            assert not torch.equal(p, before[name]), name
        else:
            assert torch.equal(p, before[name]), name


class PhaseLog:
    def __init__(self):
        self.events = []

    def on_phase_start(self, name):
        self.events.append(name)

    def on_phase_end(self, name):
        pass


@pytest.mark.parametrize(("beta", "iterations", "references"), [(0.0, 1, 0), (0.1, 1, 1), (0.0, 2, 1)])
def test_reference_pass_runs_once_per_rollout_batch_or_never(beta, iterations, references):
    method = _method(loss=LossSettings(beta=beta), num_iterations=iterations, micro_batch_size=2)
    listener = PhaseLog()
    method.phases.add_listener(listener)
    _trainer(steps=iterations).fit(method, _data())
    assert listener.events.count("rollout") == 1
    assert listener.events.count("reference") == references
    assert listener.events.count("optimizer") == iterations
    assert listener.events.count("policy_forward") == 4 * iterations  # 8 completions / micro-batch 2
    assert (method.reference is not None) == (beta > 0)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(num_generations=1), "num_generations: must be >= 2"),
        (dict(loss={"loss_type": "ppo"}), "model.loss.loss_type: 'ppo' is not one of"),
        (
            dict(loss={"epsilon_low": 0.3, "epsilon_high": 0.2}),
            r"model.loss.epsilon_high: 0.2 < model.loss.epsilon_low \(0.3\)",
        ),
        (dict(reward_funcs=["no.such.fn"]), r"reward_funcs\[0\]: cannot import 'no.such.fn'"),
        (dict(reward_weights=[1.0, 2.0]), "reward_weights: has 2 entries for 1 reward_funcs"),
        (dict(max_new_tokens=4, min_new_tokens=5), r"min_new_tokens: must be in \[0, max_new_tokens=4\]"),
    ],
)
def test_bad_settings_fail_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        _method(**kw)


def test_non_finite_losses_are_skipped_then_stop_the_run(capture_logger):
    method = _method(max_nonfinite_steps=2)
    method.policy_loss = lambda rollout, sl, n: (torch.tensor(float("nan"), requires_grad=True), {})
    method.setup("fit")
    method.configure_model()
    before = _params(method)
    with pytest.raises(
        FloatingPointError, match=r"2 non-finite updates in a row \(the last a loss at step 1; no step was finite\)"
    ):
        _trainer(capture_logger, steps=5).fit(method, _data())
    assert all(torch.equal(p, before[n]) for n, p in method.policy.named_parameters())
    assert capture_logger.metrics["train/nonfinite_steps"][0][1] == 1.0


def raises(completions, **_):
    raise ZeroDivisionError("bad reward")


def test_reward_function_error_names_function_and_sample():
    with pytest.raises(
        RuntimeError, match=r"reward function raises raised ZeroDivisionError: bad reward \(first sample"
    ):
        _trainer().fit(_method(reward_funcs=["test_grpo.raises"]), _data())


def test_bf16_true_trains_and_keeps_log_prob_math_in_float32():
    method = _method(loss=LossSettings(beta=0.1))
    trainer = _trainer(precision="bf16-true")
    trainer.fit(method, _data())
    assert trainer.global_step == 1
    assert next(method.policy.parameters()).dtype == torch.bfloat16
    ids = torch.randint(3, 90, (2, 8))
    stats = method.completion_stats(method.policy, ids, torch.ones_like(ids), 5, temperature=1.0)
    assert stats.logp.dtype == torch.float32 and stats.entropy.dtype == torch.float32


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_adamw_is_fused_except_where_lightning_cannot_clip_it(precision):
    method = _method(max_grad_norm=1.0)
    trainer = _trainer(precision=precision)
    trainer.fit(method, _data())  # clipping runs every step: a fused optimizer under mixed precision would raise
    assert trainer.global_step == 1
    assert method.optimizer().param_groups[0]["fused"] is (True if precision == "32-true" else None)
