"""The loss options of lit_rl.losses against plain float64 formulas written token by token from the papers.

The reference below loops over completions and tokens with scalar arithmetic (no masking tricks, no
broadcasting), so it shares no code path with the vectorised loss; autograd through the loops gives the
reference gradient. Inputs have odd sizes, ragged padding holding garbage, and ratios on both sides of the
clip range. tests/test_losses_trl.py checks the same options against TRL's own code where TRL is installed.
"""

from __future__ import annotations

import math

import pytest
import torch

from lit_rl.losses import (
    GLOBAL_TOKEN_LOSS_TYPES,
    LOSS_TYPES,
    entropy_bonus,
    grpo_loss,
    high_entropy_mask,
    masked_quantile,
)

B, T, L = 5, 7, 9  # odd sizes; L is the generation limit for dr_grpo
LENGTHS = [7, 3, 1, 5, 6]
STEP_TOKENS = 40  # the optimizer step's token count for the global-count types (this micro-batch has 22)


def _data(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()  # [B, T]
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    old = logp + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    garbage = ~mask.bool()
    logp, old = logp.masked_fill(garbage, -math.inf), old.masked_fill(garbage, 7.0)  # padding must not leak
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    adv[2] = 0.0
    entropy = torch.rand(B, T, generator=gen, dtype=torch.float64) * 4
    return {"logp": logp, "old": old, "ref": ref, "adv": adv, "mask": mask, "entropy": entropy}


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile of a list, as numpy's and torch's default."""
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _reference(d: dict, logp: torch.Tensor, entropy: torch.Tensor, o: dict) -> torch.Tensor:
    """The loss, token by token: policy term, masks, KL, normalisation, entropy bonus."""
    lt, level = o["loss_type"], o.get("importance_sampling_level", "token")
    lo, hi, beta, delta = o.get("epsilon_low", 0.2), o.get("epsilon_high", 0.2), o.get("beta", 0.0), o.get("delta")
    old = d["old"] if o.get("off_policy", True) else logp.detach()
    rho = o.get("top_entropy_quantile", 1.0)
    valid_entropies = [float(entropy[i, t]) for i in range(B) for t in range(LENGTHS[i])]
    threshold = _quantile(valid_entropies, 1 - rho)
    seq_terms, all_terms = [], []
    for i in range(B):
        n, a = LENGTHS[i], d["adv"][i]
        log_ratios = [logp[i, t] - old[i, t] for t in range(n)]
        seq_log_ratio = sum(log_ratios) / n
        mean_kl_old = sum(float(old[i, t] - logp[i, t]) for t in range(n)) / n
        keep_seq = 1.0
        if (
            o.get("off_policy_mask_threshold") is not None
            and float(a) < 0
            and mean_kl_old > o["off_policy_mask_threshold"]
        ):
            keep_seq = 0.0
        if lt == "vespo":  # the product of the token ratios, in log space, no gradient
            log_w = min(max(sum(min(max(float(x), -20.0), 20.0) for x in log_ratios), math.log(1e-8)), 20.0)
            k, lam = (o.get("vespo_k_pos", 2.0), o.get("vespo_lambda_pos", 3.0)) if float(a) >= 0 else (
                o.get("vespo_k_neg", 3.0), o.get("vespo_lambda_neg", 2.0))  # fmt: skip
            phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        terms = []
        for t in range(n):
            r = torch.exp(seq_log_ratio if level == "sequence" else log_ratios[t])
            if lt == "cispo":
                term = -min(float(r), hi) * a * logp[i, t]
            elif lt == "sapo":
                tau = o.get("sapo_temperature_pos", 1.0) if float(a) > 0 else o.get("sapo_temperature_neg", 1.05)
                term = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
            elif lt == "vespo":
                term = -phi * a * logp[i, t]
            else:
                capped = torch.clamp(r, max=delta) if delta is not None else r
                term = -torch.minimum(capped * a, torch.clamp(r, 1 - lo, 1 + hi) * a)
            term = term * keep_seq * (1.0 if float(entropy[i, t]) >= threshold else 0.0)
            if beta:
                x = d["ref"][i, t] - logp[i, t]
                kl = torch.exp(x) - x - 1
                term = term + beta * kl * (r if o.get("use_bias_correction_kl") else 1.0)
            terms.append(term)
        seq_terms.append(terms)
        all_terms += terms
    if lt in ("grpo", "sapo"):
        loss = sum(sum(ts) / len(ts) for ts in seq_terms) / B
    elif lt == "luspo":
        loss = sum(sum(ts) for ts in seq_terms) / B
    elif lt == "bnpo":
        loss = sum(all_terms) / len(all_terms)
    elif lt == "dr_grpo":
        loss = sum(all_terms) / (B * L)
    else:
        loss = sum(all_terms) / STEP_TOKENS
    if o.get("entropy_coef"):
        kept = [entropy[i, t] for i in range(B) for t in range(LENGTHS[i]) if float(entropy[i, t]) >= threshold]
        loss = loss - o["entropy_coef"] * sum(kept) / len(kept)
    return loss


def _ours(d: dict, logp: torch.Tensor, entropy: torch.Tensor, o: dict) -> torch.Tensor:
    own = {k: v for k, v in o.items() if k not in ("off_policy", "top_entropy_quantile", "entropy_coef")}
    rho = o.get("top_entropy_quantile", 1.0)
    token_mask = high_entropy_mask(entropy, d["mask"], rho) if rho < 1 else None
    loss, _ = grpo_loss(
        logp, d["old"] if o.get("off_policy", True) else None, d["ref"], d["adv"], d["mask"],
        max_completion_length=L, token_mask=token_mask,
        num_items_in_batch=STEP_TOKENS if o["loss_type"] in GLOBAL_TOKEN_LOSS_TYPES else None, **own,
    )  # fmt: skip
    if o.get("entropy_coef"):
        loss = loss - o["entropy_coef"] * entropy_bonus(entropy, d["mask"], token_mask)
    return loss


CASES = {name: {"loss_type": name} for name in LOSS_TYPES}
CASES.update(
    {
        "cispo-cap-5": {"loss_type": "cispo", "epsilon_high": 5.0},
        "cispo-cap-1.1": {"loss_type": "cispo", "epsilon_high": 1.1},
        "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
        "gspo-bnpo": {"loss_type": "bnpo", "importance_sampling_level": "sequence"},
        "luspo-sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence", "beta": 0.1},
        "sapo-sequence-temperatures": {"loss_type": "sapo", "importance_sampling_level": "sequence",
                                       "sapo_temperature_pos": 0.7, "sapo_temperature_neg": 1.9},
        "vespo-params": {"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.0,
                         "vespo_lambda_neg": 1.0},
        "delta": {"loss_type": "dapo", "delta": 1.3, "epsilon_high": 0.28},
        "kl": {"loss_type": "grpo", "beta": 0.1},
        "kl-bias-correction": {"loss_type": "dapo", "beta": 0.1, "use_bias_correction_kl": True},
        "kl-bias-correction-on-policy": {"loss_type": "bnpo", "beta": 0.1, "use_bias_correction_kl": True,
                                         "off_policy": False},
        "top-entropy-0.2": {"loss_type": "dapo", "top_entropy_quantile": 0.2},
        "top-entropy-0": {"loss_type": "grpo", "top_entropy_quantile": 0.0, "beta": 0.05},
        "off-policy-mask": {"loss_type": "dapo", "off_policy_mask_threshold": 0.05},
        "entropy-bonus": {"loss_type": "sapo", "entropy_coef": 0.03, "top_entropy_quantile": 0.4},
        "dr_grpo-everything": {"loss_type": "dr_grpo", "importance_sampling_level": "sequence", "delta": 1.2,
                               "beta": 0.05, "use_bias_correction_kl": True, "top_entropy_quantile": 0.6,
                               "off_policy_mask_threshold": 0.1, "entropy_coef": 0.01},
    }
)  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_value_and_gradient_against_formula(name):
    o = CASES[name]
    for seed in range(2):
        d = _data(seed)
        grads = []
        for fn in (_reference, _ours):
            logp = d["logp"].clone().requires_grad_(True)
            entropy = d["entropy"].clone().requires_grad_(True)
            loss = fn(d, logp, entropy, o)
            g_logp, g_entropy = torch.autograd.grad(loss, (logp, entropy), allow_unused=True)
            g_logp = torch.where(d["mask"].bool(), g_logp, 0.0)  # the reference never touches padding
            grads.append((loss.detach(), g_logp, g_entropy))
        (ref_loss, ref_g, ref_h), (loss, g, h) = grads
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g, ref_g, rtol=1e-10, atol=1e-12)
        if o.get("entropy_coef"):
            torch.testing.assert_close(torch.where(d["mask"].bool(), h, 0.0), torch.where(d["mask"].bool(), ref_h, 0.0))
        assert torch.isfinite(g).all(), "padding holding -inf leaked into the gradient"


def test_sequence_ratio_gives_every_token_of_a_completion_one_weight():
    # GSPO: with A > 0 and the sequence ratio inside the clip range, d loss / d logp[i, t] = -A * r_i / (n_i * B)
    d = _data(3)
    logp = d["logp"].clone().requires_grad_(True)
    loss, _ = grpo_loss(
        logp, d["old"], None, d["adv"].abs() + 0.1, d["mask"], loss_type="grpo", importance_sampling_level="sequence",
        epsilon_low=0.99, epsilon_high=100.0,
    )  # fmt: skip
    loss.backward()
    for i, n in enumerate(LENGTHS):
        grads = logp.grad[i, :n]
        assert torch.allclose(grads, grads[0].expand(n)), f"row {i}: tokens weigh differently"


def test_cispo_weight_carries_no_gradient():
    # CISPO: d loss / d logp = -min(r, cap) * A / N, the weight itself is constant
    d = _data(4)
    logp = d["logp"].clone().requires_grad_(True)
    loss, stats = grpo_loss(logp, d["old"], None, d["adv"], d["mask"], loss_type="cispo", epsilon_high=1.2)
    loss.backward()
    valid = d["mask"].bool()
    ratio = torch.exp(torch.where(valid, d["logp"] - d["old"], 0.0))
    expected = torch.where(valid, -ratio.clamp(max=1.2) * d["adv"][:, None] / valid.sum(), 0.0)
    torch.testing.assert_close(logp.grad, expected)
    clipped = ((ratio > 1.2) & (d["adv"][:, None] > 0) & valid).sum() / valid.sum()
    assert stats["cispo_clip_ratio"] == pytest.approx(clipped.item())


def test_sapo_gate_slope_is_one_on_policy():
    # SAPO's gate sigmoid(tau * (r - 1)) * 4 / tau has slope 1 at r = 1, so on-policy it is the plain gradient
    d = _data(5)
    for loss_type in ("sapo", "grpo"):
        logp = d["logp"].clone().requires_grad_(True)
        loss, _ = grpo_loss(logp, None, None, d["adv"], d["mask"], loss_type=loss_type)
        loss.backward()
        if loss_type == "sapo":
            sapo = logp.grad
    torch.testing.assert_close(sapo, logp.grad)


@pytest.mark.parametrize("q", [0.0, 0.13, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("n_valid", [1, 2, 17, 35])
def test_masked_quantile_is_torch_quantile(q, n_valid):
    gen = torch.Generator().manual_seed(n_valid)
    x = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = torch.zeros(35, dtype=torch.bool)
    mask[torch.randperm(35, generator=gen)[:n_valid]] = True
    mask = mask.view(5, 7)
    assert masked_quantile(x, mask, q).item() == torch.quantile(x[mask], q).item()


def test_masked_quantile_of_nothing_keeps_no_token():
    x = torch.randn(3, 4)
    assert masked_quantile(x, torch.zeros(3, 4), 0.5).item() == math.inf
    assert not high_entropy_mask(x, torch.zeros(3, 4), 0.2).any()


def test_high_entropy_mask_keeps_the_share_asked_for():
    entropy = torch.arange(20, dtype=torch.float64).view(4, 5)  # distinct values 0..19
    mask = torch.ones(4, 5)
    mask[3, 4] = 0  # 19 valid tokens, values 0..18
    kept = high_entropy_mask(entropy, mask, 0.2)
    # the 0.8 quantile of 0..18 is 14.4: tokens 15..18 are kept, 4 of 19
    assert kept.sum().item() == 4
    assert kept.view(-1)[15:19].all() and not kept[3, 4]
    assert high_entropy_mask(entropy, mask, 1.0).sum().item() == 19
    assert high_entropy_mask(entropy, mask, 0.0).sum().item() == 1


def test_bad_quantile_raises():
    with pytest.raises(ValueError, match="top_entropy_quantile must be in"):
        high_entropy_mask(torch.zeros(2, 2), torch.ones(2, 2), 1.5)
