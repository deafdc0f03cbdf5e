"""The naive full-vocabulary GumbelTopK: the baseline that ``bench_gumbel_topk.py`` measures the method against.

:class:`~lit_rl.methods.GumbelTopK` keeps k tokens per soft token and computes the KL online from hidden states
(``lit_rl/methods/gumbel_topk.py`` says how and why). This subclass is the form it replaced, kept here, outside the
product, so the benchmark can keep measuring what the memory-efficient design saves:

- a soft token is dense: the Gumbel-softmax over all ``V`` tokens (``lit_rl.ops.gumbel_softmax_topk`` with
  ``k = 0``), and its embedding is ``[b, V] @ [V, H]``, in the policy and in the reward model;
- the policy's and the reference's ``[b, V]`` logits are kept for every step (the policy's with their graph), and
  the KL is computed from the stored ``[b, C, V]`` rows at the end.

Everything else is the method's own (the KV-cached :class:`~lit_rl.methods.gumbel_topk.PolicyStepper` and
:class:`~lit_rl.methods.gumbel_topk.ReferenceStepper`, the noise drawn over the whole vocabulary, the stop, the
reward, the loss), so both describe the same step: with the same seed it draws the same tokens as ``GumbelTopK``
with ``gumbel_topk >= V``, and its loss and gradients equal that method's (``tests/test_bench_gumbel_topk.py``).
The ``gumbel_topk`` option is accepted and ignored; ``checkpoint_steps`` and ``bptt_window`` are refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from lit_rl.methods import GumbelTopK, PolicyStepper, ReferenceStepper, SoftRollout
from lit_rl.models import head_spec
from lit_rl.ops import gumbel_softmax_topk


class LegacyGumbelTopK(GumbelTopK):
    """GumbelTopK with dense ``[b, V]`` soft tokens and the KL from stored logits (see the module docstring).

    Its :class:`~lit_rl.methods.gumbel_topk.SoftRollout` has ``weights [b, C, V]`` and ``indices=None`` (all of the
    vocabulary, never materialised).

    Raises:
        ValueError: ``checkpoint_steps`` or ``bptt_window`` set (the dense path has neither).
    """

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("checkpoint_steps") or kwargs.get("bptt_window") is not None:
            raise ValueError(
                "LegacyGumbelTopK: the full-vocabulary path has no checkpoint_steps or bptt_window; "
                "use GumbelTopK for them"
            )
        super().__init__(**kwargs)

    def soft_rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tau: float) -> SoftRollout:
        hp = self.hparams
        b, c = prompt_ids.shape[0], hp.max_new_tokens
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [b, P]
        head = head_spec(self.policy)
        eos = self.eos_tensor(head.weight.shape[0], prompt_ids.device)
        policy = PolicyStepper(self, prompt_ids, prompt_mask, positions, grad=True)
        reference = ReferenceStepper(self, prompt_ids, prompt_mask, positions) if hp.beta > 0 else None
        weights, tokens, masks, masses, policy_rows, reference_rows = [], [], [], [], [], []
        alive = torch.ones(b, dtype=torch.bool, device=prompt_ids.device)  # [b] no EOS emitted yet
        hidden = policy.hidden  # [b, H] predicts the first completion token
        for t in range(c):
            with torch.set_grad_enabled(True):  # as GumbelTopK without bptt_window: every step differentiable
                policy_logits = _at_least_float32(head.logits(hidden)) / hp.temperature  # [b, V] (the KL's)
                logits = policy_logits.index_fill(-1, eos, float("-inf")) if t < hp.min_new_tokens else policy_logits
                # the method's noise: float32, over the whole vocabulary, in the same order
                u = torch.rand(logits.shape, device=logits.device, dtype=torch.float32)  # [b, V]
                u = u.clamp_min(torch.finfo(torch.float32).tiny)
                noise = -torch.log(-torch.log(u))  # [b, V] Gumbel(0, 1)
                w, idx = gumbel_softmax_topk(logits, tau, 0, hard=hp.hard, noise=noise)  # [b, V], arange(V) view
                del u, noise
                token = idx.gather(-1, w.detach().argmax(-1, keepdim=True)).squeeze(-1)  # [b]
                lse = torch.logsumexp(logits.detach(), dim=-1)  # [b]
                masses.append(torch.exp(logits.detach().gather(-1, idx) - lse[:, None]).sum(-1))  # [b]
                masks.append(alive.float())
                if reference is not None:  # keep both logits rows, the KL comes at the end
                    reference_rows.append(reference_logits(reference, hp.temperature))  # [b, V] no grad
                    policy_rows.append(policy_logits)  # [b, V] with grad
                weights.append(w)
                tokens.append(token)
                alive = alive & ~torch.isin(token, eos)
                if t + 1 == c or not alive.any():
                    break
                hidden = policy.step(self.soft_embedding(w, idx))  # [b, H]
            if reference is not None:
                reference.step(token)
        mask = torch.stack(masks, 1)  # [b, C']
        if reference is None:
            kl = torch.zeros_like(mask)
        else:
            kl = dense_kl(torch.stack(policy_rows, 1), torch.stack(reference_rows, 1)) * mask  # [b, C']
        weights = torch.stack(weights, 1)  # [b, C', V]
        return SoftRollout(
            weights=weights,
            indices=None,  # all of the vocabulary
            tokens=torch.stack(tokens, 1),  # [b, C']
            mask=mask,
            kl=kl,
            topk_mass=torch.stack(masses, 1),  # [b, C'] 1: every token is kept
            stop=weights[..., eos].sum(-1),  # [b, C']
        )

    def soft_embedding(self, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``[b, 1, H]``: the dense ``[b, V] @ [V, H]`` product (``indices`` is all of the vocabulary)."""
        table = self.policy.get_input_embeddings()
        return (weights.to(table.weight.dtype) @ table.weight)[:, None]  # [b, 1, H]

    def reward_embeddings(self, rollout: SoftRollout) -> torch.Tensor:
        """``[b, C', H]``: the dense ``[b, C', V] @ [V, H]`` soft tokens in the reward model."""
        embedding = self.reward_model.get_input_embeddings()
        return rollout.weights.to(embedding.weight.dtype) @ embedding.weight


def reference_logits(reference: ReferenceStepper, temperature: float) -> torch.Tensor:
    """``[b, V]``: the reference's logits at its current position, from the head's input it keeps (no grad)."""
    with torch.no_grad():
        z = replace(reference.head, transform=None).logits(reference.features)  # [b, V]
        return _at_least_float32(z) / temperature


def dense_kl(policy_logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    """KL(policy || reference) from stored logits ``[b, C, V]``: sum_v p (log p - log q) per token ``[b, C]``."""
    logp = F.log_softmax(policy_logits, dim=-1)  # [b, C, V]
    logq = F.log_softmax(reference_logits, dim=-1)  # [b, C, V]
    return (logp.exp() * (logp - logq)).sum(-1)  # [b, C]


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision logits, float64 kept (as the method does)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
