"""RefCachedGRPO's loss options on a tiny model: what the method computes for a rollout is lit_rl.losses applied to
the log-probs and entropies of the model's own full logits; every loss type trains; bad settings are one line.

The losses themselves are checked against float64 formulas (tests/test_loss_options.py) and against TRL
(tests/test_losses_trl.py); here the wiring: the options reach the loss, the entropy mask uses the entropy of the
same pass, and the micro-batches of a step add up to the loss of the whole rollout.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from test_grpo import _data, _method, _ready, _trainer

from lit_rl.losses import GLOBAL_TOKEN_LOSS_TYPES, LOSS_TYPES, LossSettings, entropy_bonus, grpo_loss, high_entropy_mask
from lit_rl.methods import Intuitor, RefCachedGRPO
from lit_rl.methods.grpo import Rollout

OPTIONS = {
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0, beta=0.1, use_bias_correction_kl=True),
    "sapo": dict(loss_type="sapo", sapo_temperature_neg=1.5),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "dapo-everything": dict(
        loss_type="dapo", delta=1.5, top_entropy_quantile=0.3, entropy_coef=0.01, off_policy_mask_threshold=0.2,
        beta=0.05,
    ),
    "dr_grpo-entropy": dict(loss_type="dr_grpo", top_entropy_quantile=0.5),
}  # fmt: skip


def _rollout(method, seed: int = 0) -> Rollout:
    gen = torch.Generator().manual_seed(seed)
    b, p, c = 8, 5, 6
    ids = torch.randint(3, 90, (b, p + c), generator=gen)
    ids[4:, :p] = ids[4, :p]  # two groups of four completions sharing their prompt
    ids[:4, :p] = ids[0, :p]
    mask = torch.ones(b, c)
    mask[1, 3:] = 0  # ragged completions
    mask[6, 1:] = 0
    rollout = Rollout(
        input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=mask, prompt_length=p,
        rewards=torch.zeros(b), advantages=torch.randn(b, generator=gen),
    )  # fmt: skip
    rollout.ref_logp = method.reference_logp(rollout) + 0.1 * torch.randn(b, c, generator=gen)
    rollout.old_logp = method.micro_batched_stats(method.policy, rollout)[0] + 0.2 * torch.randn(b, c, generator=gen)
    return rollout


def _full_logits_stats(method, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the completion tokens from the model's whole logits, in float64."""
    p = rollout.prompt_length
    logits = method.policy(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits.double()
    logprobs = torch.log_softmax(logits[:, p - 1 : -1] / method.hparams.temperature, -1)  # [B, C, V]
    logp = logprobs.gather(-1, rollout.input_ids[:, p:, None]).squeeze(-1)  # [B, C]
    entropy = -(logprobs.exp() * logprobs).sum(-1)  # [B, C]
    return logp, entropy


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_step_loss_is_the_loss_of_the_models_own_logits(name):
    torch.manual_seed(0)
    options = OPTIONS[name]
    settings = LossSettings(**{"beta": 0.04, **options})  # the method's default KL coefficient unless set
    method = _ready(_method(micro_batch_size=3, temperature=0.8, loss=settings))  # micro-batches of 3, 3 and 2
    rollout = _rollout(method)
    num_items = float(rollout.completion_mask.sum())
    total = sum(method.policy_loss(rollout, sl, num_items)[0] for sl in method.micro_batches(len(rollout)))

    logp, entropy = _full_logits_stats(method, rollout)
    expected = 0.0
    for sl in method.micro_batches(len(rollout)):  # the entropy quantile is taken per micro-batch, as in TRL
        mask = rollout.completion_mask[sl]
        # the mask is chosen from the chunked pass's float32 entropies, which are the full logits' ones: the first
        # completion token of a group ties across its rows, and rounding may break a tie at the threshold otherwise
        # (padding-free passes give the tokens after EOS zero statistics: only the counted ones are compared)
        own = method._stats(method.policy, rollout, sl, entropy=True).entropy.detach()
        counted = mask.bool()
        torch.testing.assert_close(own.double()[counted], entropy[sl].detach()[counted], rtol=1e-5, atol=1e-5)
        rho = options.get("top_entropy_quantile", 1.0)
        token_mask = high_entropy_mask(own, mask, rho) if rho < 1 else None
        kw = {k: v for k, v in options.items() if k not in ("top_entropy_quantile", "entropy_coef")}
        kw.setdefault("beta", settings.beta)
        loss, _ = grpo_loss(
            logp[sl], rollout.old_logp[sl].double(), rollout.ref_logp[sl].double(), rollout.advantages[sl].double(),
            mask, max_completion_length=method.hparams.max_new_tokens, num_items_in_batch=num_items,
            token_mask=token_mask, **kw,
        )  # fmt: skip
        share = mask.shape[0] / len(rollout)
        if options["loss_type"] not in GLOBAL_TOKEN_LOSS_TYPES:
            loss = loss * share
        if options.get("entropy_coef"):
            loss = loss - options["entropy_coef"] * share * entropy_bonus(entropy[sl], mask, token_mask)
        expected = expected + loss
    assert total.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_trains_and_logs_its_statistics(loss_type):
    extra = {"cispo": dict(epsilon_high=5.0), "luspo": dict(importance_sampling_level="sequence")}.get(loss_type, {})
    settings = LossSettings(loss_type=loss_type, beta=0.04, top_entropy_quantile=0.5, **extra)
    method = _method(loss=settings, num_iterations=2)
    before = {n: p.detach().clone() for n, p in _ready(method).policy.named_parameters()}
    _trainer(steps=2).fit(method, _data())
    metrics = method.last_metrics
    expected = {"cispo": {"cispo_clip_ratio"}, "vespo": {"vespo/phi_seq_mean"}, "sapo": {"kl/mean"}}.get(
        loss_type, {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
    )
    assert expected <= set(metrics), sorted(metrics)
    assert math.isfinite(metrics["loss"]) and metrics["train/nonfinite_steps"] == 0
    changed = [n for n, p in method.policy.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "no weight moved"


def test_intuitor_takes_the_same_options():
    method = Intuitor(
        name_or_path="tiny:llama", loss=LossSettings(loss_type="cispo", epsilon_high=5.0, top_entropy_quantile=0.2)
    )
    assert (method.loss.loss_type, method.loss.top_entropy_quantile) == ("cispo", 0.2)
    assert Intuitor(name_or_path="tiny:llama").loss.beta == 0.005  # its own default, the paper's


def test_loss_settings_come_back_from_a_checkpoints_dict():
    """A checkpoint's hyper-parameters hold the group as a dict (what LightningCLI saves): the method rebuilds it."""
    settings = LossSettings(loss_type="sapo", beta=0.1, sapo_temperature_neg=1.5)
    method = _method(loss=dataclasses.asdict(settings))
    assert method.loss == settings and method.needs_reference


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(loss_type="cispo"), r"model.loss.epsilon_high: 0.2 under loss_type cispo caps the importance weight"),
        (dict(importance_sampling_level="batch"), "model.loss.importance_sampling_level: 'batch' is not one of"),
        (dict(delta=0.9), r"model.loss.delta: must be > 1"),
        (dict(sapo_temperature_pos=0.0), "model.loss.sapo_temperature_pos: must be > 0"),
        (dict(top_entropy_quantile=1.2), r"model.loss.top_entropy_quantile: must be in \[0, 1\]"),
        (dict(entropy_coef=-0.1), "model.loss.entropy_coef: must be >= 0"),
        (dict(off_policy_mask_threshold=-1.0), "model.loss.off_policy_mask_threshold: must be >= 0"),
        (dict(beta=-0.1), "model.loss.beta: must be >= 0"),
        (dict(epsilon_low=1.0, epsilon_high=1.0), r"model.loss.epsilon_low: must be in \[0, 1\)"),
    ],
)
def test_bad_loss_settings_fail_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        _method(loss=LossSettings(**kw))


def test_the_loss_options_are_written_once():
    """Every loss option is a field of LossSettings only: neither a flat option of a method nor a keyword of grpo_loss;
    each method's default group differs from LossSettings' defaults in beta alone (the method's KL coefficient)."""
    names = {f.name for f in dataclasses.fields(LossSettings)}
    assert names.isdisjoint(inspect.signature(grpo_loss).parameters)
    for cls, beta in ((RefCachedGRPO, 0.04), (Intuitor, 0.005)):
        params = inspect.signature(cls.__init__).parameters
        assert names.isdisjoint(params), cls
        default = params["loss"].default
        assert dataclasses.replace(default, beta=0.0) == LossSettings() and default.beta == beta, cls
