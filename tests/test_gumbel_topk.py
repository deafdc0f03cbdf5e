"""GumbelTopK on tiny models: the gradient of the whole differentiable rollout, checkpointing, truncation, the sparse
path against a plain float64 full-vocabulary reference, a real training step, and bad settings."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lit_rl.callbacks import MemoryProfiler
from lit_rl.data import PromptDataModule
from lit_rl.memory.estimate import estimate_step
from lit_rl.methods import GumbelTopK
from lit_rl.models import LoraSettings

RUN = dict(name_or_path="tiny:llama", reward_model="tiny:llama", max_new_tokens=3, learning_rate=1e-2)
ALL = 10**6  # a k above the vocabulary keeps all of it


def _method(**kw) -> GumbelTopK:
    method = GumbelTopK(**{**RUN, **kw})
    method.setup("fit")
    method.configure_model()
    return method


def _prompts(method: GumbelTopK, n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(3, 90, (n, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    ids[mask == 0] = method.tokenizer.pad_token_id
    return ids, mask


def _loss(method: GumbelTopK, ids, mask, seed: int = 0) -> torch.Tensor:
    """The method's loss for these prompts, with the Gumbel noise fixed by the seed."""
    torch.manual_seed(seed)
    rollout = method.soft_rollout(ids, mask, method.tau_at(0))
    reward = method.score(ids, mask, rollout)  # [b]
    return (method.hparams.beta * rollout.kl.sum(1) - reward).mean()


def _double(method: GumbelTopK) -> GumbelTopK:
    method.double()
    return method


@pytest.fixture
def float64_rmsnorm(monkeypatch):
    """transformers' LlamaRMSNorm computes in float32 whatever the input dtype, which makes float64 finite
    differences meaningless (rounding at 1e-7); the same formula in the input's dtype, for these tests only."""
    from transformers.models.llama import modeling_llama

    def forward(self, hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


@pytest.mark.parametrize("temperature", [1.0, 1.3])
@pytest.mark.parametrize("k", [5, ALL])
def test_rollout_gradient_matches_finite_differences(temperature, k, float64_rmsnorm):
    # the soft path (hard=False) is differentiable everywhere the top-k set and the tokens do not change
    method = _double(_method(hard=False, gumbel_topk=k, tau=0.7, beta=0.1, temperature=temperature))
    ids, mask = _prompts(method)
    weight = method.policy.model.layers[0].self_attn.q_proj.weight
    direction = torch.randn_like(weight)
    loss = _loss(method, ids, mask)
    (grad,) = torch.autograd.grad(loss, weight)
    eps = 1e-6
    with torch.no_grad():
        weight += eps * direction
        up = _loss(method, ids, mask)
        weight -= 2 * eps * direction
        down = _loss(method, ids, mask)
        weight += eps * direction
    numeric = (up - down) / (2 * eps)
    assert (grad * direction).sum().item() == pytest.approx(numeric.item(), rel=1e-5, abs=1e-9)


def test_checkpointed_steps_give_the_same_loss_and_gradients():
    grads = []
    for checkpointed in (False, True):
        method = _double(_method(gumbel_topk=5, beta=0.1, checkpoint_steps=checkpointed, max_new_tokens=4))
        ids, mask = _prompts(method)
        loss = _loss(method, ids, mask)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in method.policy.named_parameters()}))
    (loss_a, a), (loss_b, b) = grads
    assert torch.equal(loss_a, loss_b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-12, atol=1e-14, msg=name)


def test_truncated_backpropagation_cuts_the_early_steps_only():
    full = _double(_method(gumbel_topk=5, beta=0.1, max_new_tokens=4))
    window_all = _double(_method(gumbel_topk=5, beta=0.1, max_new_tokens=4, bptt_window=4))
    window_one = _double(_method(gumbel_topk=5, beta=0.1, max_new_tokens=4, bptt_window=1))
    ids, mask = _prompts(full)
    out = []
    for method in (full, window_all, window_one):
        loss = _loss(method, ids, mask)
        loss.backward()
        out.append((loss.detach(), method.policy.model.embed_tokens.weight.grad.clone()))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][0], out[2][0])  # same forward
    torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-12, atol=1e-14)  # a window of all steps is no cut
    assert not torch.allclose(out[0][1], out[2][1])  # one step: the early steps' gradient is gone


def _as_looked_up(embedding: torch.nn.Embedding) -> torch.Tensor:
    """``[V, H]``: the table as a lookup sees it: ``nn.Embedding`` gives its ``padding_idx`` row no gradient, and the
    method's soft tokens are lookups of their k rows."""
    table = embedding.weight
    if embedding.padding_idx is None:
        return table
    pad = torch.zeros(table.shape[0], 1, dtype=torch.bool)
    pad[embedding.padding_idx] = True
    return torch.where(pad, table.detach(), table)


def _dense_reference_loss(method: GumbelTopK, ids, mask, seed: int = 0) -> torch.Tensor:
    """The method's loss written plainly, for ``hard=False``: Gumbel-softmax over the whole vocabulary on the same
    noise, dense soft tokens ``[b, V] @ [V, H]``, the whole sequence run again at every step (no KV cache), the KL
    from both models' full logits rows, and the reward model's score of every prefix read through the soft stop."""
    hp = method.hparams
    policy_table = _as_looked_up(method.policy.get_input_embeddings())  # [V, H]
    reward_table = _as_looked_up(method.reward_model.get_input_embeddings())  # [V, H]
    vocab = policy_table.shape[0]
    eos = [i for i in method.eos_ids() if 0 <= i < vocab]
    b = ids.shape[0]
    policy_soft, reward_soft, tokens, kls, stops = [], [], [], [], []
    alive = torch.ones(b, dtype=torch.bool)  # [b] no hard EOS yet
    torch.manual_seed(seed)
    for t in range(hp.max_new_tokens):
        att = torch.cat([mask, torch.ones(b, t, dtype=mask.dtype)], 1)  # [b, P + t]
        pos = (att.cumsum(-1) - 1).clamp_min(0)  # [b, P + t]
        embeds = torch.cat([method.policy.get_input_embeddings()(ids), *policy_soft], 1)  # [b, P + t, H]
        z = method.policy(inputs_embeds=embeds, attention_mask=att, position_ids=pos).logits[:, -1] / hp.temperature
        sampled = z.clone()  # [b, V]
        if t < hp.min_new_tokens:
            sampled[:, eos] = float("-inf")
        u = torch.rand(z.shape, dtype=torch.float32).clamp_min(torch.finfo(torch.float32).tiny)  # the method's draw
        w = torch.softmax((sampled - torch.log(-torch.log(u)).to(z.dtype)) / method.tau_at(0), -1)  # [b, V]
        token = w.detach().argmax(-1)  # [b]
        with torch.no_grad(), method.as_reference() as reference:
            q = reference(input_ids=torch.cat([ids, *tokens], 1), attention_mask=att, position_ids=pos).logits[:, -1]
        logp, logq = torch.log_softmax(z, -1), torch.log_softmax(q / hp.temperature, -1)  # [b, V]
        kls.append((logp.exp() * (logp - logq)).sum(-1) * alive)  # [b]
        policy_soft.append((w @ policy_table)[:, None])  # [b, 1, H]
        reward_soft.append((w @ reward_table)[:, None])  # [b, 1, H]
        stops.append(w[:, eos].sum(-1))  # [b]
        tokens.append(token[:, None])
        alive = alive & ~torch.isin(token, torch.tensor(eos))
        if not alive.any():
            break
    scores = []  # the reward model's score after each completion token
    for t in range(len(reward_soft)):
        att = torch.cat([mask, torch.ones(b, t + 1, dtype=mask.dtype)], 1)  # [b, P + t + 1]
        embeds = torch.cat([method.reward_model.get_input_embeddings()(ids), *reward_soft[: t + 1]], 1)
        pos = (att.cumsum(-1) - 1).clamp_min(0)
        scores.append(method.reward_model(inputs_embeds=embeds, attention_mask=att, position_ids=pos).logits[:, 0])
    survive = [torch.ones(b, dtype=z.dtype)]  # [b] the weight of still running before token t
    for stop in stops:
        survive.append(survive[-1] * (1 - stop))
    reward = sum((survive[t] - survive[t + 1]) * s for t, s in enumerate(scores)) + survive[-1] * scores[-1]  # [b]
    return (hp.beta * torch.stack(kls, 1).sum(1) - reward).mean()


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_top_k_over_the_whole_vocabulary_equals_a_float64_dense_reference(temperature, float64_rmsnorm):
    method = _double(_method(beta=0.1, max_new_tokens=3, hard=False, gumbel_topk=ALL, temperature=temperature))
    ids, mask = _prompts(method)
    params = [p for p in method.policy.parameters() if p.requires_grad]
    loss = _loss(method, ids, mask)
    grads = torch.autograd.grad(loss, params)
    want = _dense_reference_loss(method, ids, mask)
    want_grads = torch.autograd.grad(want, params)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    for (name, _), got, expected in zip(method.policy.named_parameters(), grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-10, msg=name)


def test_straight_through_forward_feeds_the_hard_token():
    method = _method(gumbel_topk=4, hard=True)
    ids, mask = _prompts(method)
    torch.manual_seed(0)
    rollout = method.soft_rollout(ids, mask, 0.5)
    assert torch.all((rollout.weights == 0) | (rollout.weights == 1))  # one-hot forward
    chosen = rollout.indices.gather(-1, rollout.weights.argmax(-1, keepdim=True)).squeeze(-1)
    assert torch.equal(chosen, rollout.tokens)
    assert rollout.weights.requires_grad  # the backward goes through the soft weights
    assert torch.all(rollout.topk_mass <= 1 + 1e-6) and torch.all(rollout.topk_mass > 0)


def test_survival_value_and_gradient_against_a_float64_product():
    from lit_rl.methods.gumbel_topk import survival

    g = torch.Generator().manual_seed(3)
    stop = torch.rand(4, 7, generator=g, dtype=torch.float64)  # odd length
    stop[0, 2] = 1.0  # a hard stop: cumprod's gradient would divide by 0 here
    stop[1] = 0.0  # never stops
    stop.requires_grad_(True)
    alive = survival(stop)  # [4, 8]
    reference = [torch.ones(4, dtype=torch.float64)]
    for t in range(7):
        reference.append(torch.prod(1 - stop[:, : t + 1], dim=1))
    reference = torch.stack(reference, 1)
    weights = torch.randn(4, 8, generator=g, dtype=torch.float64)
    torch.testing.assert_close(alive, reference, rtol=0, atol=1e-15)
    (got,) = torch.autograd.grad((alive * weights).sum(), stop, retain_graph=True)
    (want,) = torch.autograd.grad((reference * weights).sum(), stop)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert torch.all(alive[0, 3:] == 0) and torch.all(alive[1] == 1)
    assert torch.isfinite(got).all() and got[0, :2].abs().sum() > 0  # gradient before the hard stop is not lost


@pytest.mark.parametrize("k", [6, ALL])
def test_differentiable_stop_keeps_the_hard_reward_and_adds_the_stop_gradient(k):
    """Hard tokens: the reward read through the EOS weights equals the score at the hard stop (the same
    forward); only the gradient differs, by the stop's own term."""
    out, eos = {}, None
    for stop in (False, True):
        method = _double(_method(gumbel_topk=k, hard=True, beta=0.1, max_new_tokens=4, differentiable_stop=stop))
        ids, mask = _prompts(method, n=6)
        if eos is None:  # as EOS, a token the first step keeps (top-k) but does not choose: its weight has a gradient
            torch.manual_seed(0)
            first = method.soft_rollout(ids, mask, method.tau_at(0))
            eos = int(first.indices[0, 0, 1])
        method.eos_ids = lambda eos=eos: [eos]
        torch.manual_seed(0)
        rollout = method.soft_rollout(ids, mask, method.tau_at(0))
        reward = method.score(ids, mask, rollout)  # [b]
        loss = (method.hparams.beta * rollout.kl.sum(1) - reward).mean()
        weight = method.policy.model.layers[0].mlp.down_proj.weight
        (grad,) = torch.autograd.grad(loss, weight)
        out[stop] = (reward.detach(), rollout.tokens, grad)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-12)
    assert torch.equal(out[True][1], out[False][1])
    assert not torch.allclose(out[True][2], out[False][2])


@pytest.mark.parametrize("k", [3, ALL])
def test_min_new_tokens_forbids_an_early_eos_only(k):
    method = _method(gumbel_topk=k, hard=True, max_new_tokens=4, min_new_tokens=0)
    ids, mask = _prompts(method, n=4)
    torch.manual_seed(0)
    first = method.soft_rollout(ids, mask, 0.5).tokens[:, 0]  # [b] what the first step picks, same noise below
    eos = int(first[0])
    method.eos_ids = lambda: [eos]
    tokens = {}
    for minimum in (0, 1):
        method.hparams.min_new_tokens = minimum
        torch.manual_seed(0)
        rollout = method.soft_rollout(ids, mask, 0.5)
        tokens[minimum] = rollout.tokens
        assert rollout.mask[0, 0] == 1  # the first token always counts
    assert tokens[0][0, 0] == eos and (tokens[0][0] == eos).sum() >= 1  # allowed: row 0 ends at once
    assert tokens[1][0, 0] != eos  # forbidden: another token in its place
    assert tokens[1].shape[1] > 1  # and the rollout goes on


def test_tau_schedules():
    method = GumbelTopK(**RUN, tau=1.0, tau_min=0.1, tau_decay_steps=10, tau_schedule="linear")
    assert [round(method.tau_at(s), 6) for s in (0, 5, 10, 20)] == [1.0, 0.55, 0.1, 0.1]
    method = GumbelTopK(**RUN, tau=1.0, tau_min=0.1, tau_decay_steps=10, tau_schedule="exponential")
    assert method.tau_at(5) == pytest.approx(0.1**0.5) and method.tau_at(30) == pytest.approx(0.1)
    assert GumbelTopK(**RUN, tau=0.3).tau_at(1000) == 0.3


@pytest.mark.slow  # a whole fit
@pytest.mark.parametrize("lora", [False, True])
def test_fit_logs_reward_kl_tau_and_mass_and_changes_the_weights(capture_logger, tmp_path, lora):
    method = _method(
        gumbel_topk=8, beta=0.05, max_new_tokens=4, metric_funcs=["lit_rl.data.rewards.correct_answer"],
        lora=LoraSettings(r=4, alpha=8) if lora else None,
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in method.policy.named_parameters() if p.requires_grad}
    reward_before = {n: p.detach().clone() for n, p in method.reward_model.named_parameters()}
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=capture_logger, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1, default_root_dir=tmp_path, callbacks=[MemoryProfiler()],
    )  # fmt: skip
    trainer.fit(method, PromptDataModule(num_prompts=8, batch_size=2, max_prompt_length=64))
    logged = capture_logger.metrics
    for key in ("reward/mean", "kl/mean", "gumbel/tau", "gumbel/topk_mass", "completions/mean_length",
                "metric/correct_answer/mean", "loss", "time/generate_s", "time/reward_s",
                "memory/generate/peak_gib", "memory/reward/peak_gib", "memory/backward/peak_gib"):  # fmt: skip
        assert key in logged, key
    assert logged["kl/mean"][-1][1] > 0  # the second step's policy has moved away from the reference
    changed = [n for n, p in method.policy.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    assert all(torch.equal(p, reward_before[n]) for n, p in method.reward_model.named_parameters())
    assert not any(k.startswith(("reference.", "reward_model.")) for k in method.state_dict())


@pytest.mark.slow  # the whole method step on fake tensors
def test_estimate_runs_the_method_step_with_its_own_phases():
    method = GumbelTopK(**{**RUN, "max_new_tokens": 4}, gumbel_topk=8, beta=0.05)
    estimate = estimate_step(method, batch_size=2, prompt_length=16)
    assert list(estimate.phases) == ["generate", "reward", "backward", "optimizer"]
    names = [c.name for c in estimate.components]
    assert "reward_model weights (frozen)" in names and "reference weights" in names
    checkpointed = estimate_step(method, batch_size=2, prompt_length=16, checkpoint_steps=True)
    assert checkpointed.phases["reward"] < estimate.phases["reward"]  # fewer saved tensors before the backward


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(tau=0), "tau"),
        (dict(gumbel_topk=-1), "gumbel_topk: must be >= 1"),
        (dict(gumbel_topk=0), r"model.gumbel_topk: must be >= 1, got 0 \(0, the full-vocabulary path, is a benchmark"),
        (dict(tau_schedule="cosine"), "tau_schedule"),
        (dict(min_new_tokens=5, max_new_tokens=4), "min_new_tokens"),
        (dict(bptt_window=0), "bptt_window"),
        (dict(beta=-1.0), "beta"),
    ],
)
def test_bad_settings_fail_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        GumbelTopK(**{**RUN, **kw})


def test_checkpointed_layers_are_refused_in_one_line_and_the_estimate_too(tmp_path):
    """transformers drops the KV cache inside checkpointed layers; the rollout steps the trunk on it, so layer
    checkpointing is refused by the callback and by the estimator, naming checkpoint_steps instead."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lit_rl.callbacks import ActivationCheckpointing

    method = _method()
    trainer = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    with pytest.raises(MisconfigurationException, match=r"GumbelTopK runs its policy .* model.checkpoint_steps: true"):
        ActivationCheckpointing().setup(trainer, method, "fit")
    assert not any(getattr(m, "gradient_checkpointing", False) for m in method.policy.modules())
    with pytest.raises(ValueError, match="activation checkpointing: GumbelTopK runs its policy one token at a time"):
        estimate_step(GumbelTopK(**RUN), batch_size=2, prompt_length=5, activation_checkpointing=1)
