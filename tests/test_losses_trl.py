"""lit_rl.losses against TRL's own loss computation, option by option, on the same random tensors.

TRL's ``GRPOTrainer._compute_loss`` is called unchanged on a stand-in for the trainer that holds only what it
reads: the options, a one-process accelerator and a forward pass that returns the test's log-probs and
entropies. Both sides then see identical log-probs, old and reference log-probs, advantages and masks (odd sizes,
ragged padding), and the losses and gradients into the log-probs (and the entropies, for the entropy bonus) must
agree. Skipped where TRL is not installed; the README's test command installs it (the ``dev`` extra).
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lit_rl.losses import (
    GLOBAL_TOKEN_LOSS_TYPES,
    LOSS_TYPES,
    entropy_bonus,
    grpo_loss,
    high_entropy_mask,
    sampler_weights,
)

trl_grpo = pytest.importorskip(
    "trl.trainer.grpo_trainer", reason="TRL is not installed: pip install -e '.[dev]' installs it"
)
GRPOTrainer = trl_grpo.GRPOTrainer

B, T = 5, 7  # odd sizes
MAX_COMPLETION_LENGTH = 9


def _inputs(seed: int, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 1, 5, 6])  # ragged; every completion has at least one token
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # [B, T]
    logp = -torch.rand(B, T, generator=gen, dtype=dtype) * 3  # [B, T] in (-3, 0]
    old = logp + 0.4 * torch.randn(B, T, generator=gen, dtype=dtype)  # ratios from about e^-1 to e^1
    ref = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=dtype)
    adv = torch.randn(B, generator=gen, dtype=dtype)
    adv[2] = 0.0  # A = 0 takes SAPO's and VESPO's non-positive branch
    # float32 as token_stats gives them in training: TRL takes the quantile of float32 entropies, and from float64
    # ones its float32 threshold can round above the largest entropy and keep no token at all
    entropy = torch.rand(B, T, generator=gen, dtype=torch.float32) * 4
    sampler = old + 0.5 * torch.randn(B, T, generator=gen, dtype=dtype)  # a sampler that is not the trainer
    sampler[1, 0] = float("nan")  # a token the sampler could not score: TRL counts it as ratio 1
    return {"logp": logp, "old": old, "ref": ref, "adv": adv, "mask": mask, "entropy": entropy, "sampler": sampler}


def _trl_sampling_ratio(data: dict[str, torch.Tensor], mode: str, clip_min, clip_max) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling ratio, as ``GRPOTrainer._generate_and_score_completions`` computes it
    (it cannot be called alone: this is that code, transcribed, on the old and the sampler's log-probs)."""
    diff = torch.nan_to_num((data["old"] - data["sampler"]) * data["mask"], nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)


class _Accelerator:
    """One process: gathers, reductions and padding are the identity."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def _trl_loss(data: dict[str, torch.Tensor], options: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's loss on ``data``, and its gradients into the log-probs and the entropies."""
    logp = data["logp"].clone().requires_grad_(True)
    entropy = data["entropy"].clone().requires_grad_(True)
    args = SimpleNamespace(
        use_bias_correction_kl=options.get("use_bias_correction_kl", False),
        delta=options.get("delta"),
        sapo_temperature_pos=options.get("sapo_temperature_pos", 1.0),
        sapo_temperature_neg=options.get("sapo_temperature_neg", 1.05),
        vespo_k_pos=options.get("vespo_k_pos", 2.0),
        vespo_lambda_pos=options.get("vespo_lambda_pos", 3.0),
        vespo_k_neg=options.get("vespo_k_neg", 3.0),
        vespo_lambda_neg=options.get("vespo_lambda_neg", 2.0),
        steps_per_generation=1,
    )
    coef = options.get("entropy_coef", 0.0)
    trainer = SimpleNamespace(
        args=args,
        accelerator=_Accelerator(),
        model=SimpleNamespace(training=True),
        loss_type=options["loss_type"],
        importance_sampling_level=options.get("importance_sampling_level", "token"),
        epsilon_low=options.get("epsilon_low", 0.2),
        epsilon_high=options.get("epsilon_high", 0.2),
        beta=options.get("beta", 0.0),
        top_entropy_quantile=options.get("top_entropy_quantile", 1.0),
        off_policy_mask_threshold=options.get("off_policy_mask_threshold"),
        max_completion_length=MAX_COMPLETION_LENGTH,
        current_gradient_accumulation_steps=1,
        use_vllm="sampler" in options,
        vllm_importance_sampling_correction="sampler" in options,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=coef != 0.0,
        entropy_coef=coef,
        use_adaptive_entropy=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None),
    )
    trainer.get_high_entropy_mask = lambda e, m, q: GRPOTrainer.get_high_entropy_mask(trainer, e, m, q)
    mask = data["mask"]
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": data["adv"],
        "old_per_token_logps": data["old"] if options.get("off_policy", True) else None,
        "ref_per_token_logps": data["ref"],
        "num_items_in_batch": mask.sum().to(data["logp"].dtype),
    }
    if "sampler" in options:
        inputs["importance_sampling_ratio"] = _trl_sampling_ratio(data, *options["sampler"])
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    d_logp, d_entropy = torch.autograd.grad(loss, (logp, entropy), allow_unused=True)
    return loss.detach(), d_logp, d_entropy


def _our_loss(data: dict[str, torch.Tensor], options: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = data["logp"].clone().requires_grad_(True)
    entropy = data["entropy"].clone().requires_grad_(True)
    opts = {k: v for k, v in options.items()
            if k not in ("entropy_coef", "top_entropy_quantile", "off_policy", "sampler")}  # fmt: skip
    weights = None
    if "sampler" in options:
        mode, clip_min, clip_max = options["sampler"]
        weights = sampler_weights(data["old"], data["sampler"], data["mask"], mode=mode, clip_min=clip_min,
                                  clip_max=clip_max)  # fmt: skip
    quantile = options.get("top_entropy_quantile", 1.0)
    token_mask = high_entropy_mask(entropy, data["mask"], quantile) if quantile < 1.0 else None
    loss, _ = grpo_loss(
        logp,
        data["old"] if options.get("off_policy", True) else None,
        data["ref"],
        data["adv"],
        data["mask"],
        max_completion_length=MAX_COMPLETION_LENGTH,
        num_items_in_batch=data["mask"].sum() if options["loss_type"] in GLOBAL_TOKEN_LOSS_TYPES else None,
        token_mask=token_mask,
        sampler_weights=weights,
        **opts,
    )
    if options.get("entropy_coef", 0.0):
        loss = loss - options["entropy_coef"] * entropy_bonus(entropy, data["mask"], token_mask)
    d_logp, d_entropy = torch.autograd.grad(loss, (logp, entropy), allow_unused=True)
    return loss.detach(), d_logp, d_entropy


CASES = {f"{name}": {"loss_type": name} for name in LOSS_TYPES}
CASES.update(
    {
        "dapo-kl": {"loss_type": "dapo", "beta": 0.04},
        "dapo-kl-bias-correction": {"loss_type": "dapo", "beta": 0.04, "use_bias_correction_kl": True},
        "grpo-kl-on-policy-bias-correction": {
            "loss_type": "grpo", "beta": 0.1, "use_bias_correction_kl": True, "off_policy": False,
        },
        "dapo-clip-higher": {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.28},
        "dapo-delta": {"loss_type": "dapo", "delta": 1.5},
        "bnpo-delta-kl": {"loss_type": "bnpo", "delta": 1.3, "beta": 0.1},
        "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon_low": 3e-4,
                 "epsilon_high": 4e-4},
        "gspo-dapo-kl": {"loss_type": "dapo", "importance_sampling_level": "sequence", "beta": 0.04,
                         "use_bias_correction_kl": True},
        "luspo-sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
        "sapo-sequence": {"loss_type": "sapo", "importance_sampling_level": "sequence"},
        "sapo-temperatures": {"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0},
        "cispo-cap": {"loss_type": "cispo", "epsilon_high": 1.3, "beta": 0.04},
        "vespo-params": {"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.0,
                         "vespo_lambda_neg": 1.0},
        "dapo-top-entropy": {"loss_type": "dapo", "top_entropy_quantile": 0.2},
        "grpo-top-entropy-kl": {"loss_type": "grpo", "top_entropy_quantile": 0.5, "beta": 0.04},
        "dapo-top-entropy-0": {"loss_type": "dapo", "top_entropy_quantile": 0.0},
        "dapo-off-policy-mask": {"loss_type": "dapo", "off_policy_mask_threshold": 0.05},
        "dapo-entropy-bonus": {"loss_type": "dapo", "entropy_coef": 0.01},
        "grpo-entropy-bonus-top-entropy": {"loss_type": "grpo", "entropy_coef": 0.02, "top_entropy_quantile": 0.3},
        "dapo-sampler-sequence-mask": {"loss_type": "dapo", "sampler": ("sequence_mask", None, 3.0)},
        "grpo-sampler-token-truncate-kl": {"loss_type": "grpo", "beta": 0.04, "sampler": ("token_truncate", 0.5, 2.0)},
        "bnpo-sampler-token-mask": {"loss_type": "bnpo", "sampler": ("token_mask", 0.8, 1.5)},
        "cispo-sampler-sequence-truncate": {"loss_type": "cispo", "epsilon_high": 5.0,
                                            "sampler": ("sequence_truncate", None, 2.0)},
        "sapo-sampler-sequence-mask-min": {"loss_type": "sapo", "sampler": ("sequence_mask", 0.5, None)},
        "luspo-sequence-sampler-token-mask": {"loss_type": "luspo", "importance_sampling_level": "sequence",
                                              "sampler": ("token_mask", None, 1.5)},
        "dr_grpo-everything": {"loss_type": "dr_grpo", "beta": 0.05, "use_bias_correction_kl": True, "delta": 1.4,
                               "top_entropy_quantile": 0.6, "off_policy_mask_threshold": 0.1, "entropy_coef": 0.01},
    }
)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_trl(name, dtype):
    options = CASES[name]
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-7}
    if options["loss_type"] == "sapo":  # TRL builds SAPO's temperatures in float32 (1.05 rounds to 1.0499999523)
        tol = {"rtol": 1e-6, "atol": 1e-8}
    for seed in range(3):
        data = _inputs(seed, dtype)
        theirs, ours = _trl_loss(data, options), _our_loss(data, options)
        torch.testing.assert_close(ours[0], theirs[0], **tol, msg=lambda m, seed=seed: f"{name} seed {seed} loss: {m}")
        torch.testing.assert_close(
            ours[1], theirs[1], **tol, msg=lambda m, seed=seed: f"{name} seed {seed} d/dlogp: {m}"
        )
        if options.get("entropy_coef"):
            torch.testing.assert_close(
                ours[2], theirs[2], **tol, msg=lambda m, seed=seed: f"{name} seed {seed} d/dH: {m}"
            )


def test_the_cases_change_something():
    """Each option moves TRL's loss or gradient away from its base type's on these inputs (no vacuous case)."""
    data = _inputs(0)
    for name, options in CASES.items():
        base = {"loss_type": options["loss_type"]}
        if options == base:
            continue
        with_option, without = _trl_loss(data, options), _trl_loss(data, base)
        differs = not torch.allclose(with_option[0], without[0]) or not torch.allclose(with_option[1], without[1])
        assert differs, f"{name}: the options change nothing on these inputs"


def test_entropy_mask_threshold_is_torch_quantile():
    data = _inputs(1)
    for quantile in (0.0, 0.2, 0.5, 0.9, 1.0):
        trainer = SimpleNamespace(accelerator=_Accelerator())
        theirs = GRPOTrainer.get_high_entropy_mask(trainer, data["entropy"], data["mask"], 1 - quantile)
        ours = high_entropy_mask(data["entropy"], data["mask"], quantile)
        assert torch.equal(ours, theirs), quantile
