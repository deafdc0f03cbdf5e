"""Shared-prompt passes: log-probs and gradients equal the plain path, in float64, for every way a batch is cut."""

from __future__ import annotations

import pytest
import torch

from lit_rl.losses import LossSettings
from lit_rl.methods import Intuitor, RefCachedGRPO
from lit_rl.methods.grpo import Rollout
from lit_rl.models import (
    LoraSettings,
    enable_activation_checkpointing,
    load_causal_lm,
    sample_completions,
    trunk_hidden,
)
from lit_rl.models.shared_prompt import group_runs, shared_prompt_hidden, shared_prompt_unsupported

G, P, C = 4, 7, 5  # completions per prompt, prompt and completion lengths


def test_group_runs_cut_groups_at_micro_batch_edges():
    assert group_runs(0, 8, 4) == [4, 4]
    assert group_runs(3, 9, 4) == [1, 4, 1]
    assert group_runs(5, 6, 4) == [1]
    assert group_runs(0, 3, 1) == [1, 1, 1]


def _rollout(vocab: int = 90, groups: int = 3, seed: int = 0) -> Rollout:
    """``groups`` prompts x ``G`` completions; two prompts left-padded, completion masks ending early."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (groups, P), generator=gen)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[1, :3] = 0
    prompt_mask[2 % groups, :1] = 0
    prompts[prompt_mask == 0] = 0
    ids = torch.cat([prompts.repeat_interleave(G, 0), torch.randint(3, vocab, (groups * G, C), generator=gen)], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(G, 0), torch.ones(groups * G, C, dtype=torch.long)], 1)
    completion_mask = (torch.rand(groups * G, C, generator=gen) < 0.8).float().cummin(1).values
    completion_mask[:, 0] = 1
    advantages = torch.randn(groups * G, generator=gen)
    return Rollout(ids, mask, completion_mask, P, torch.zeros(groups * G), advantages)


def _method(cls=RefCachedGRPO, model: str = "tiny:llama", **kw):
    args = dict(name_or_path=model, num_generations=G, max_new_tokens=C, learning_rate=1e-2, temperature=0.7)
    args.update(kw)
    method = cls(**args)
    method.setup("fit")
    method.configure_model()
    method.double()
    return method


def _update(method, rollout: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The micro-batched loss, the gradient of every trainable weight, and the cached reference log-probs."""
    method.zero_grad(set_to_none=True)
    ref = method.reference_logp(rollout)  # [B, C] no grad, micro-batched
    rollout.ref_logp = ref
    rollout.old_logp = None
    total, logps = 0.0, []
    for sl in method.micro_batches(len(rollout)):
        loss, _ = method.policy_loss(rollout, sl, float(rollout.completion_mask.sum()))
        loss.backward()
        total = total + loss.detach()
        logps.append(method._stats(method.policy, rollout, sl, entropy=False).logp.detach())
    grads = {n: p.grad.clone() for n, p in method.policy.named_parameters() if p.requires_grad and p.grad is not None}
    return total, grads, ref, torch.cat(logps)


# RMSNorm (Llama, Qwen2) computes in float32 whatever the model dtype, so those models agree to float32
# roundoff of the gradient sums; GPT-2's LayerNorm stays in float64
TOLERANCE = {"tiny:gpt2": 1e-9, "tiny:llama": 2e-6, "tiny:qwen2": 2e-6}


@pytest.mark.parametrize("model", ["tiny:llama", "tiny:qwen2", "tiny:gpt2"])
@pytest.mark.parametrize("micro_batch_size", [None, 3, 5])  # whole batch, micro-batches that split groups
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("padding_free", [False, True])
def test_shared_prompt_update_equals_plain_path_in_float64(model, micro_batch_size, lora, padding_free):
    settings = LoraSettings(r=4, alpha=8, target_modules="all-linear") if lora else None
    plain = _method(model=model, micro_batch_size=micro_batch_size, lora=settings, share_prompt=False,
                    padding_free=False)  # fmt: skip
    shared = _method(model=model, micro_batch_size=micro_batch_size, lora=settings, padding_free=padding_free)
    assert shared.share_prompt and not plain.share_prompt
    with torch.no_grad():  # move the policy away from the reference (peft starts LoRA B at zero)
        for name, p in plain.policy.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * (1.0 if "lora_B" in name else 0.05))
    shared.policy.load_state_dict(plain.policy.state_dict())
    rollout = _rollout()
    loss_a, grads_a, ref_a, logp_a = _update(plain, rollout)
    loss_b, grads_b, ref_b, logp_b = _update(shared, _rollout())
    tol = TOLERANCE[model]
    counted = rollout.completion_mask.bool()  # padding-free: the tokens after EOS did not run (zero hidden states)
    if padding_free:
        assert not counted.all()  # some completions end early, so tokens were dropped
        logp_a, logp_b, ref_a, ref_b = (t * counted for t in (logp_a, logp_b, ref_a, ref_b))
    torch.testing.assert_close(logp_b, logp_a, rtol=tol, atol=tol)
    torch.testing.assert_close(ref_b, ref_a, rtol=tol, atol=tol)
    torch.testing.assert_close(loss_b, loss_a, rtol=tol, atol=tol)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        scale = grads_a[name].abs().max().item()
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=tol, atol=tol * max(1.0, scale), msg=name)
    if lora:
        assert all("lora_" in name for name in grads_a)
    assert not torch.allclose(ref_a, logp_a)  # reference and policy differ, so the comparison can fail


@pytest.mark.parametrize("padding_free", [False, True])
def test_shared_prompt_survives_activation_checkpointing(padding_free):
    """transformers' checkpointing replays each layer with the keyword arguments it saw; the layout is one."""
    model = load_causal_lm("tiny:llama").double()
    rollout = _rollout()
    ids, mask = rollout.input_ids[2:9], rollout.attention_mask[2:9]
    keep = rollout.completion_mask[2:9] if padding_free else None
    runs = group_runs(2, 9, G)
    grads = []
    for checkpointed in (False, True):
        if checkpointed:
            enable_activation_checkpointing(model)
        model.train().zero_grad()
        hidden = shared_prompt_hidden(model, ids, mask, P, runs, keep)
        weights = torch.linspace(-1, 1, hidden.numel(), dtype=hidden.dtype).view_as(hidden)
        (hidden * weights).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)
    plain = trunk_hidden(model, ids, mask)[:, P - 1 : -1]
    counted = keep.bool() if padding_free else torch.ones(hidden.shape[:2], dtype=torch.bool)
    torch.testing.assert_close(hidden[counted], plain[counted], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model", ["tiny:llama", "tiny:gpt2"])
def test_padding_free_runs_only_the_counted_tokens_and_keeps_their_values(model):
    """Against the plain padded path in float64: the same hidden states and gradients where a token counts, zero
    hidden states where it does not, and only the prompts plus the scoring completion tokens through the trunk."""
    net = load_causal_lm(model).double().train()
    rollout = _rollout()
    sl = slice(2, 9)  # splits the first and last group
    ids, mask, keep = rollout.input_ids[sl], rollout.attention_mask[sl], rollout.completion_mask[sl]
    runs = group_runs(sl.start, sl.stop, G)
    lengths = []
    hook = net.get_input_embeddings().register_forward_hook(lambda m, i, o: lengths.append(i[0].shape[-1]))
    results = []
    for kept in (None, keep):
        net.zero_grad()
        lengths.clear()
        hidden = shared_prompt_hidden(net, ids, mask, P, runs, kept)  # [b, C, H]
        weights = torch.linspace(-1, 1, hidden.numel(), dtype=hidden.dtype).view_as(hidden) * keep[..., None]
        (hidden * weights).sum().backward()
        results.append((hidden.detach(), torch.cat([p.grad.flatten() for p in net.parameters()]), lengths[0]))
    hook.remove()
    (padded, grad_padded, n_padded), (free, grad_free, n_free) = results
    assert n_padded == len(runs) * P + keep.shape[0] * C
    assert n_free == len(runs) * P + int((keep.sum(1) - 1).sum())  # a completion's last token scores nothing
    counted = keep.bool()
    torch.testing.assert_close(free[counted], padded[counted], rtol=1e-10, atol=1e-10)
    assert free[~counted].abs().max() == 0 and (~counted).any()
    torch.testing.assert_close(grad_free, grad_padded, rtol=1e-9, atol=1e-9)
    plain = trunk_hidden(net, ids, mask)[:, P - 1 : -1]
    torch.testing.assert_close(free[counted], plain[counted].detach(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="prefix"):
        shared_prompt_hidden(net, ids, mask, P, runs, keep.flip(1))


def test_padding_free_head_on_the_plain_path_skips_padding_exactly():
    """Without shared prompts the trunk runs padded rows, and padding_free still keeps the padding out of the LM head:
    the same log-probs, entropies and gradients where a token counts (float64), zeros elsewhere."""
    rollout = _rollout()
    counted = rollout.completion_mask.bool()
    results = []
    for padding_free in (False, True):
        method = _method(share_prompt=False, padding_free=padding_free)
        method.zero_grad(set_to_none=True)
        stats = method._stats(method.policy, rollout, slice(0, len(rollout)), entropy=True)
        (stats.logp * counted * torch.linspace(-1, 1, counted.numel()).view_as(counted)).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in method.policy.parameters() if p.grad is not None])
        results.append((stats.logp.detach(), stats.entropy.detach(), grads))
    (logp_a, entropy_a, grad_a), (logp_b, entropy_b, grad_b) = results
    torch.testing.assert_close(logp_b[counted], logp_a[counted], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy_b[counted], entropy_a[counted], rtol=1e-6, atol=1e-6)
    assert logp_b[~counted].abs().max() == 0 and entropy_b[~counted].abs().max() == 0 and (~counted).any()
    torch.testing.assert_close(grad_b, grad_a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("padding_free", [False, True])
def test_intuitor_self_certainty_pass_shares_the_prompt_exactly(padding_free):
    rollout = _rollout()
    counted = rollout.completion_mask if padding_free else torch.ones_like(rollout.completion_mask)
    results = []
    for share in (False, True):
        method = _method(Intuitor, micro_batch_size=5, share_prompt=share, padding_free=padding_free,
                         loss=LossSettings(beta=0.0))  # fmt: skip
        logp, certainty = method.micro_batched_stats(method.policy, rollout, self_certainty=True)
        results.append((logp * counted, certainty * counted))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-6)


def test_rows_of_a_run_must_share_their_prompt():
    model = load_causal_lm("tiny:llama")
    rollout = _rollout()
    with pytest.raises(ValueError, match="hold different prompts"):
        shared_prompt_hidden(model, rollout.input_ids[2:6], rollout.attention_mask[2:6], P, [4])


def test_models_the_shared_path_cannot_reproduce_are_refused():
    eager = load_causal_lm("tiny:llama")
    eager.set_attn_implementation("eager")
    assert "'eager'" in shared_prompt_unsupported(eager)
    assert shared_prompt_unsupported(load_causal_lm("tiny:llama")) is None

    class Ignores(torch.nn.Module):  # a token mixer that mixes across the packed row: the check must see it
        def __init__(self, attn):
            super().__init__()
            self.attn = attn

        def forward(self, hidden_states, *args, **kwargs):
            out, weights = self.attn(hidden_states, *args, **kwargs)
            return out + hidden_states.cumsum(1) * 1e-2, weights

    mixing = load_causal_lm("tiny:llama")
    mixing.model.layers[0].self_attn = Ignores(mixing.model.layers[0].self_attn)
    assert "differ from the plain path" in shared_prompt_unsupported(mixing)


def test_method_falls_back_to_the_plain_path_with_one_line(monkeypatch, lightning_log):
    monkeypatch.setattr("lit_rl.methods.grpo.shared_prompt_unsupported", lambda model: "its attention is 'eager'")
    method = _method()
    assert not method.share_prompt
    assert lightning_log.matching("model.share_prompt") == [
        "model.share_prompt: off for tiny:llama, its attention is 'eager'"
    ]
    rollout = _rollout()
    method.reference_logp(rollout)  # the plain path takes rows with different prompts in one run


@pytest.mark.parametrize("model", ["tiny:llama", "tiny:gpt2"])
def test_shared_prefill_samples_what_repeated_prompts_sample(model):
    policy = load_causal_lm(model).double()
    rollout = _rollout(groups=3)
    prompts, mask = rollout.input_ids[::G, :P], rollout.attention_mask[::G, :P]  # [3, P], two left-padded
    samples = []
    for share in (False, True):
        torch.manual_seed(7)
        samples.append(
            sample_completions(
                policy, prompts, mask, 0, [1], repeats=G, share_prompt=share,
                do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6,
            )
        )  # fmt: skip
    assert samples[0].shape == (3 * G, P + 6)
    assert torch.equal(samples[1], samples[0])
    assert len({tuple(row) for row in samples[0][:, P:].tolist()}) > 1  # sampled, not one repeated row
