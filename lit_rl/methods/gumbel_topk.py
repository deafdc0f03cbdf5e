"""GumbelTopK: differentiable rollouts, backpropagating a reward model's score into the policy.

The method is GRADE (arXiv 2601.11574, "Replacing Policy Gradients with Backpropagation for LLM Alignment"),
named GumbelTopK everywhere in lit-rl after what it does. It samples
each token as a Gumbel-softmax relaxation, feeds it as a soft embedding to the next policy step and to
a reward model, and backpropagates the reward straight into the policy; its straight-through variant uses the
straight-through estimator (one-hot forward, soft backward). Only the abstract is public, so tau, k,
the KL and their schedules here are our design. How this implementation differs from a naive one, for
memory:

- **Top-k Gumbel-softmax** (:func:`lit_rl.ops.gumbel_softmax_topk`): a soft token is k weights over k
  token ids, and its embedding is a weighted gather of k embedding rows, never a ``[B, V] @ [V, H]``
  product; the reward model reads the completion the same way (``forward_soft_sparse``).
- **Online KL**: the per-token KL(policy || reference) over the **full vocabulary** is computed at each
  step from the two hidden states by :func:`lit_rl.ops.kl_divergence` (exact, vocabulary blocks
  recomputed in backward), instead of storing ``[B, T, V]`` reference logits and computing it at the end.
- **One gradient sum for the head**: the rollout reads the LM head (and the tied input embedding) at every token;
  each read adds its weight gradient into one buffer (:class:`lit_rl.ops.GradientSink`) instead of autograd
  making a new ``[V, H]`` tensor per read and adding it.
- **KV-cached reference**: the reference (the policy with LoRA adapters disabled, or a frozen copy)
  advances on the hard token with its own KV cache, without gradient.
- **Per-step checkpointing** (``checkpoint_steps``): each policy step keeps only its inputs and the new
  key/value slices; without it, every step keeps its attention inputs over the whole cache, so the
  saved memory grows faster than linearly in the length. **Truncated backpropagation**
  (``bptt_window``): only the last ``bptt_window`` steps are differentiable; earlier ones run without
  gradient (their tokens reach the reward model as constants).

The naive full-vocabulary form (dense ``[B, V]`` soft tokens, policy and reference logits stored for every
step, the KL computed from them at the end) is not part of the method: it lives in ``bench/gumbel_legacy.py``,
where ``bench/bench_gumbel_topk.py`` measures it against this one.

The loss of a sequence is ``-reward + beta * sum_t KL_t`` over its completion tokens, averaged over
sequences. Lengths: every sequence is generated for ``max_new_tokens`` steps unless all have emitted
EOS (then the loop stops early); tokens after a sequence's first EOS are masked out of the KL and the
reward model's attention mask, so the reward model reads each completion up to and including its EOS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from lit_rl.memory.phases import BACKWARD, OPTIMIZER
from lit_rl.memory.rollout import DifferentiableRollout, StepWork
from lit_rl.methods.base import RLMethod
from lit_rl.methods.evaluation import distinct_bigrams
from lit_rl.models import (
    cache_keyword,
    forward_soft_embeds,
    gather_trunk,
    head_spec,
    load_reward_model,
    output_cache,
    score_every_prefix,
    soft_embeddings,
    trunk,
)
from lit_rl.ops import GradientSink, gumbel_softmax_topk, kl_divergence
from lit_rl.reward_model import shipped_head_file

EMBEDDED_REWARD = "embedded"


@dataclass
class SoftRollout:
    """What a differentiable rollout produced for ``b`` sequences of up to ``C`` tokens."""

    weights: torch.Tensor  # [b, C, k] soft-token weights, differentiable
    indices: torch.Tensor  # [b, C, k] their token ids
    tokens: torch.Tensor  # [b, C] hard tokens (the argmax of the weights)
    mask: torch.Tensor  # [b, C] 1 up to and including the first EOS
    kl: torch.Tensor  # [b, C] per-token KL(policy || reference), 0 where masked or without reference
    topk_mass: torch.Tensor  # [b, C] probability mass the kept tokens have under the policy (detached)
    stop: torch.Tensor  # [b, C] each soft token's weight on the EOS ids (0 or 1 forward with hard tokens)


class GumbelTopK(RLMethod):
    """Differentiable rollouts with top-k Gumbel-softmax through a frozen reward model.

    **Phases**: ``generate`` (the policy's soft rollout with the reference beside it), ``reward`` (the
    reward model on the soft completion, and the loss), ``backward``, ``optimizer``.

    **Logged Metrics**: ``reward/mean``, ``reward/std``, ``kl/mean`` (per completion token),
    ``gumbel/tau``, ``gumbel/topk_mass``, ``completions/mean_length``, ``completions/clipped_ratio``,
    ``completions/distinct_bigrams``,
    ``metric/<function>/mean`` (the true checkers in ``metric_funcs``, never rewarded), ``loss``,
    ``train/nonfinite_steps``, ``time/<phase>_s``.

    Args:
        reward_model: a ``...ForSequenceClassification`` sharing the policy's vocabulary (folder or hub
            id), or ``embedded``: the built-in sentiment reward model, a score head shipped with lit-rl on the
            embedded SmolLM2 trunk (see :mod:`lit_rl.reward_model.train`); it scores continuations of the
            ``reviews`` task's openings.
        num_generations: rollouts per prompt.
        max_new_tokens: generation steps ``C``. Memory: every step's graph is kept for the backward.
        min_new_tokens: EOS cannot be sampled before this many tokens (as in ``generate``); the default 1
            forbids the empty completion, which a reward model that never saw one may score above a real
            answer (the embedded one does). The KL is of the unconstrained distributions.
        temperature: the policy's logits are divided by it before the Gumbel-softmax and the KL.
        gumbel_topk: ``k``, tokens kept per soft token (at least 1; a ``k`` above the vocabulary keeps all of it).
            Memory: each soft token holds ``k`` weights and ids, and its embedding is a gather of ``k`` rows.
        hard: straight-through: the forward uses the one-hot token, the backward the soft weights.
        tau: Gumbel-softmax temperature at step 0.
        tau_min: the final tau of a decaying schedule.
        tau_schedule: ``constant``, ``linear`` or ``exponential`` decay from ``tau`` to ``tau_min``.
        tau_decay_steps: optimizer steps over which tau decays.
        beta: KL coefficient; ``0`` skips the reference entirely (no reference steps, no KL).
        checkpoint_steps: recompute each policy step in the backward (``use_reentrant=False``): the saved
            memory grows linearly in the length instead of faster; costs about one more forward per step.
        bptt_window: backpropagate through the last this-many steps only (``null``: all of them); earlier
            steps run without gradient, which saves their graphs at the cost of a biased gradient.
        differentiable_stop: read the reward where each completion stops through its EOS weights, so the
            gradient also says whether stopping earlier or later would score better (see :meth:`score`);
            ``false``: the score at the hard stop only, and stopping gets no gradient. Same forward value.
        **kwargs: model, optimizer, micro-batch and metric settings, see :class:`~lit_rl.methods.base.RLMethod`;
            ``quantize_base: nf4`` quantizes the reward model's trunk as well as the policy's base.

    Raises:
        ValueError: at construction, for settings that cannot work (named in the message).

    Example::

        lit-rl fit --config configs/gumbel_topk.yaml
    """

    phase_names: ClassVar[tuple[str, ...]] = ("generate", "reward", BACKWARD, OPTIMIZER)
    frozen_modules: ClassVar[tuple[str, ...]] = ("reference", "reward_model")
    progress_bar_metrics: ClassVar[tuple[str, ...]] = ("reward/mean",)
    # transformers drops the KV cache inside checkpointed layers, and the rollout steps the trunk on its cache
    layer_checkpointing_refused: ClassVar[str] = (
        "runs its policy one token at a time on a KV cache, which transformers turns off in checkpointed layers; "
        "set model.checkpoint_steps: true to recompute each generation step instead"
    )
    recomputation_settings: ClassVar[dict[str, Any]] = {"checkpoint_steps": True}  # the planner's tactic instead

    def __init__(
        self,
        reward_model: str = EMBEDDED_REWARD,
        num_generations: int = 1,
        max_new_tokens: int = 8,
        min_new_tokens: int = 1,
        temperature: float = 1.0,
        gumbel_topk: int = 256,
        hard: bool = True,
        tau: float = 0.5,
        tau_min: float = 0.1,
        tau_schedule: Literal["constant", "linear", "exponential"] = "constant",
        tau_decay_steps: int = 100,
        beta: float = 0.01,
        checkpoint_steps: bool = False,
        bptt_window: int | None = None,
        differentiable_stop: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        for name, value, low in (("num_generations", num_generations, 1), ("max_new_tokens", max_new_tokens, 1),
                                 ("tau_decay_steps", tau_decay_steps, 1),
                                 ("min_new_tokens", min_new_tokens, 0)):  # fmt: skip
            if value < low:
                raise ValueError(f"model.{name}: must be >= {low}, got {value}; set it to {low} or more")
        if gumbel_topk < 1:
            raise ValueError(
                f"model.gumbel_topk: must be >= 1, got {gumbel_topk} (0, the full-vocabulary path, is a benchmark "
                "baseline now: bench/gumbel_legacy.py); set the tokens kept per soft token, e.g. 256"
            )
        if min_new_tokens > max_new_tokens:
            raise ValueError(
                f"model.min_new_tokens: {min_new_tokens} is more than model.max_new_tokens ({max_new_tokens}); "
                "lower it or raise max_new_tokens"
            )
        if not tau > 0 or not tau_min > 0 or temperature <= 0:
            raise ValueError(
                f"model.tau: tau ({tau}), tau_min ({tau_min}) and temperature ({temperature}) must be > 0; "
                "give positive values"
            )
        if tau_schedule not in ("constant", "linear", "exponential"):
            raise ValueError(
                f"model.tau_schedule: {tau_schedule!r} is not one of constant, linear, exponential; use one of them"
            )
        if beta < 0:
            raise ValueError(f"model.beta: must be >= 0, got {beta}; use 0 to skip the reference")
        if bptt_window is not None and bptt_window < 1:
            raise ValueError(f"model.bptt_window: must be >= 1 or null, got {bptt_window}; use null for full backprop")
        self.reward_model: torch.nn.Module | None = None

    # ------------------------------------------------------------------ models
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        super().configure_model()
        embedding = self.policy.get_input_embeddings()
        if type(embedding) is not torch.nn.Embedding:
            raise ValueError(
                f"{self.name_or_path}: the input embedding is a {type(embedding).__name__}, not a plain nn.Embedding; "
                "GumbelTopK mixes embedding rows and cannot reproduce its transform"
            )
        vocab = len(self.tokenizer) if self.tokenizer is not None else None
        source = self.hparams.reward_model
        self.reward_model = load_reward_model(
            source,
            policy_tokenizer=self.tokenizer,
            vocab_size=vocab,
            head_file=shipped_head_file() if source == EMBEDDED_REWARD else None,
            quantize_base=self.hparams.quantize_base,  # its trunk in NF4 too; its score head stays as loaded
        )

    def tau_at(self, step: int) -> float:
        """Tau of the schedule at optimizer step ``step`` (a resumed run continues the schedule)."""
        hp = self.hparams
        frac = min(step / hp.tau_decay_steps, 1.0)
        if hp.tau_schedule == "linear":
            return hp.tau + (hp.tau_min - hp.tau) * frac
        if hp.tau_schedule == "exponential":
            return max(hp.tau_min, hp.tau * math.exp(frac * math.log(hp.tau_min / hp.tau)))
        return hp.tau

    def step_work(self) -> StepWork:
        """The base's passes, and the rollout differentiated through: its phases' work for the roofline."""
        hp = self.hparams
        scorer = self.reward_model.config if self.reward_model is not None else None
        soft = DifferentiableRollout(hp.gumbel_topk, scorer, hp.checkpoint_steps, hp.bptt_window)
        return replace(super().step_work(), differentiable=soft)

    # ------------------------------------------------------------------ the step
    def train_step(self, batch: dict[str, Any]) -> tuple[dict[str, float], int]:
        hp = self.hparams
        g = hp.num_generations
        prompt_ids = batch["input_ids"].repeat_interleave(g, dim=0)  # [B*G, P]
        prompt_mask = batch["attention_mask"].repeat_interleave(g, dim=0)  # [B*G, P]
        n = prompt_ids.shape[0]
        tau = self.tau_at(self.global_step)
        kept: dict[str, torch.Tensor] = {}  # what the step's statistics need, [B*G] or [B*G, C] each
        widths: list[int] = []

        def keep(sl: slice, **stats: torch.Tensor) -> None:
            # each micro-batch writes its rows of one tensor per statistic (zeros past a micro-batch whose rows all
            # stopped early), so nothing else of its rollout outlives its backward
            for name, t in stats.items():
                if name not in kept:
                    kept[name] = t.new_zeros((n, hp.max_new_tokens)[: t.dim()])
                kept[name][(sl, slice(0, t.shape[-1]))[: t.dim()]] = t

        def loss_fn(sl: slice) -> tuple[torch.Tensor, dict[str, float]]:
            with self.phases("generate"):
                rollout = self.soft_rollout(prompt_ids[sl], prompt_mask[sl], tau)
            with self.phases("reward"):
                alive = survival(rollout.stop) if hp.differentiable_stop else None  # [b, C' + 1]
                reward = self.score(prompt_ids[sl], prompt_mask[sl], rollout, alive)  # [b]
                # [b] sequence KL; weighted by alive, stopping earlier also saves the KL of the rest
                kl = rollout.kl.sum(1) if alive is None else (rollout.kl * alive[:, :-1]).sum(1)
                loss = (hp.beta * kl - reward).sum() / n
            keep(sl, reward=reward.detach(), tokens=rollout.tokens, mask=rollout.mask, kl=rollout.kl.detach(),
                 mass=rollout.topk_mass)  # fmt: skip
            widths.append(rollout.tokens.shape[1])
            return loss, {}

        metrics: dict[str, float] = {}
        # a soft rollout's length is known only as it runs: a token budget takes every row at its longest
        metrics["loss"], _ = self.update(n, loss_fn, [prompt_ids.shape[1] + hp.max_new_tokens] * n)
        rewards, mask, tokens, kl, mass = (kept[k] for k in ("reward", "mask", "tokens", "kl", "mass"))
        # the longest soft rollout of the step sets its memory (a micro-batch stops early when all its rows ended)
        self.step_shape = {"prompt_length": prompt_ids.shape[1], "new_tokens": max(widths)}
        lengths = mask.sum(1)  # [B*G]
        count = mask.sum().clamp_min(1)
        eos_ids = torch.tensor(self.eos_ids(), device=tokens.device)
        metrics.update(
            {
                "reward/mean": rewards.mean().item(),
                "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
                "kl/mean": (kl * mask).sum().item() / count.item(),
                "gumbel/tau": tau,
                "gumbel/topk_mass": (mass * mask).sum().item() / count.item(),
                "completions/mean_length": lengths.float().mean().item(),
                "completions/clipped_ratio": (~torch.isin(tokens, eos_ids).any(1)).float().mean().item(),
                "completions/distinct_bigrams": distinct_bigrams(tokens, lengths).mean().item(),
                "prompts/truncated": float(batch.get("num_truncated", 0)),
            }
        )
        metrics.update(self.metric_scores(self.decode(tokens, lengths), batch, g))
        return metrics, n

    def score(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        rollout: SoftRollout,
        alive: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The reward model's score ``[b]`` of the prompt (hard tokens) and the soft completion, read where it stops.

        With ``differentiable_stop`` the reward model scores every prefix in one causal pass (``s_t``, the
        score of the completion cut after token ``t``), and the reward is
        ``sum_t alive_t * e_t * s_t + alive_C * s_(C-1)``, where ``e_t`` is the weight of EOS in soft token
        ``t`` and ``alive_t = prod_(u<t) (1 - e_u)``. With hard (straight-through) tokens the ``e_t`` are
        exactly 0 or 1 in the forward, so the value is the score at the first EOS (or at the last token), the
        same as reading that position alone; the backward adds ``d reward / d e_t = alive_t * (s_t - what
        continuing scores)``: the policy learns to stop where stopping scores better, which the attention
        mask of a hard cut cannot tell it. ``alive`` is ``survival(rollout.stop)`` when the caller has it.
        """
        embeds = self.reward_embeddings(rollout)  # [b, C', H]
        if not self.hparams.differentiable_stop:
            attention_mask = torch.cat([prompt_mask, rollout.mask.to(prompt_mask.dtype)], dim=1)  # [b, P + C']
            return forward_soft_embeds(self.reward_model, prompt_ids, embeds, attention_mask)
        prefix_scores = score_every_prefix(self.reward_model, prompt_ids, embeds, prompt_mask)  # [b, C']
        alive = (survival(rollout.stop) if alive is None else alive).to(prefix_scores.dtype)  # [b, C' + 1]
        stopped_at = alive[:, :-1] - alive[:, 1:]  # [b, C'] alive_t * e_t: the weight of stopping at t
        return (stopped_at * prefix_scores).sum(1) + alive[:, -1] * prefix_scores[:, -1]  # [b]

    def reward_embeddings(self, rollout: SoftRollout) -> torch.Tensor:
        """``[b, C', H]``: the completion's input embeddings in the reward model (k rows per token)."""
        gather_trunk(self.reward_model)  # its embedding is read outside its forward (sharded: gathered first)
        return soft_embeddings(self.reward_model.get_input_embeddings(), rollout.indices, rollout.weights)

    def eos_tensor(self, vocab: int, device: torch.device) -> torch.Tensor:
        """The EOS ids inside the vocabulary, as a long tensor: an id past it (how the benchmarks switch EOS
        off) can never be sampled, so it neither stops a rollout nor needs masking."""
        return torch.tensor([i for i in self.eos_ids() if 0 <= i < vocab], dtype=torch.long, device=device)

    # ------------------------------------------------------------------ the differentiable rollout
    def soft_rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tau: float) -> SoftRollout:
        """Generate ``max_new_tokens`` soft tokens with gradients, the reference advancing beside the policy."""
        hp = self.hparams
        b, c = prompt_ids.shape[0], hp.max_new_tokens
        first_grad = 0 if hp.bptt_window is None else max(c - hp.bptt_window, 0)
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [b, P]
        head = head_spec(self.policy)
        eos = self.eos_tensor(head.weight.shape[0], prompt_ids.device)
        # the head (and the input embedding) is read at every token: each read's weight gradient is summed in one
        # buffer instead of a new [V, H] tensor per read (lit_rl/ops/gradient_sink.py)
        sink = GradientSink.of(head.weight)
        embedding = self.policy.get_input_embeddings()
        if embedding.max_norm is not None or embedding.sparse:  # a lookup the sink's row gather does not reproduce
            embedding_sink = None
        else:
            embedding_sink = sink if embedding.weight is head.weight else GradientSink.of(embedding.weight)
        policy = PolicyStepper(self, prompt_ids, prompt_mask, positions, grad=first_grad == 0)
        reference = ReferenceStepper(self, prompt_ids, prompt_mask, positions) if hp.beta > 0 else None
        weights, indices, tokens, masks, kls, masses = [], [], [], [], [], []
        alive = torch.ones(b, dtype=torch.bool, device=prompt_ids.device)  # [b] no EOS emitted yet
        hidden = policy.hidden  # [b, H] predicts the first completion token
        for t in range(c):
            with torch.set_grad_enabled(t >= first_grad):
                policy_logits = _at_least_float32(head.logits(hidden, sink)) / hp.temperature  # [b, V]
                logits = policy_logits.index_fill(-1, eos, float("-inf")) if t < hp.min_new_tokens else policy_logits
                # the noise is drawn over the whole vocabulary, so top-k with k = V and a full-vocabulary baseline
                # (bench/gumbel_legacy.py, the tests' float64 reference) see the same draw; float32 whatever the
                # default dtype (bf16-true sets bf16, whose few uniform values cap the noise near 5.5 and sharpen
                # the samples)
                u = torch.rand(logits.shape, device=logits.device, dtype=torch.float32)  # [b, V]
                u = u.clamp_min(torch.finfo(torch.float32).tiny)
                noise = -torch.log(-torch.log(u))  # [b, V] Gumbel(0, 1)
                w, idx = gumbel_softmax_topk(logits, tau, hp.gumbel_topk, hard=hp.hard, noise=noise)  # [b, k] x2
                del u, noise
                token = idx.gather(-1, w.detach().argmax(-1, keepdim=True)).squeeze(-1)  # [b]
                lse = torch.logsumexp(logits.detach(), dim=-1)  # [b]
                masses.append(torch.exp(logits.detach().gather(-1, idx) - lse[:, None]).sum(-1))  # [b]
                masks.append(alive.float())
                if reference is not None:
                    ref_head = reference.head
                    kl = kl_divergence(
                        head.features(hidden), head.weight if sink is None else sink.weight, reference.features,
                        ref_head.weight, temperature=hp.temperature, bias_p=head.bias, scale_p=head.scale,
                        softcap_p=head.softcap, bias_q=ref_head.bias, scale_q=ref_head.scale,
                        softcap_q=ref_head.softcap, sink_p=sink,
                    )  # fmt: skip
                    kls.append(kl * alive)  # [b]
                weights.append(w)
                indices.append(idx)
                tokens.append(token)
                alive = alive & ~torch.isin(token, eos)
                if t + 1 == c or not alive.any():
                    break
                policy.grad = t + 1 >= first_grad
                hidden = policy.step(self.soft_embedding(w, idx, embedding_sink))  # [b, H]
            if reference is not None:
                reference.step(token)
        mask = torch.stack(masks, 1)  # [b, C']
        kl = torch.stack(kls, 1) if reference is not None else torch.zeros_like(mask)  # [b, C']
        weights = torch.stack(weights, 1)  # [b, C', k]
        indices = torch.stack(indices, 1)  # [b, C', k]
        return SoftRollout(
            weights=weights,
            indices=indices,
            tokens=torch.stack(tokens, 1),  # [b, C']
            mask=mask,
            kl=kl,
            topk_mass=torch.stack(masses, 1),  # [b, C']
            stop=(weights * torch.isin(indices, eos)).sum(-1),  # [b, C']
        )

    def soft_embedding(
        self, weights: torch.Tensor, indices: torch.Tensor, sink: GradientSink | None = None
    ) -> torch.Tensor:
        """``[b, 1, H]``: a weighted gather of k embedding rows (``weights``, ``indices``: ``[b, k]``); ``sink``: the
        embedding weight's :class:`~lit_rl.ops.GradientSink` (the tied head's), which then takes the rows' gradient
        (steps without gradient read the same rows through it)."""
        gather_trunk(self.policy)  # the embedding is called outside the trunk's forward (sharded: gathered first)
        embedding = self.policy.get_input_embeddings()
        rows = embedding(indices) if sink is None else sink.embedding(indices, embedding.padding_idx)  # [b, k, H]
        return (weights.to(rows.dtype)[..., None] * rows).sum(1, keepdim=True)  # [b, 1, H]


def survival(stop: torch.Tensor) -> torch.Tensor:
    """``[b, C + 1]``: ``alive_t = prod_(u<t) (1 - stop_u)``, the weight of still running before token ``t``.

    A loop rather than ``cumprod``, whose gradient divides by the factors and is undefined at a factor of 0
    (a hard stop).
    """
    alive = [torch.ones_like(stop[:, 0])]  # [b]
    for t in range(stop.shape[1]):
        alive.append(alive[-1] * (1 - stop[:, t]))
    return torch.stack(alive, 1)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision logits, float64 kept (the numerics tests run in float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class PolicyStepper:
    """The policy's side of the rollout: a KV cache kept as per-step key/value slices, so a step can be checkpointed
    (its inputs are the small slices, the full cache is rebuilt inside and recomputed in the backward).

    Public, with :class:`ReferenceStepper`, so that the full-vocabulary baseline the benchmarks measure against
    (``bench/gumbel_legacy.py``) steps the models exactly as the method does."""

    def __init__(self, method: GumbelTopK, prompt_ids, prompt_mask, positions, *, grad: bool) -> None:
        self.method, self.model = method, trunk(method.policy)
        self.cache_key = cache_keyword(self.model)  # read once, not at every step
        self.config = method.policy.config
        self.mask, self.position = prompt_mask, positions[:, -1:]  # [b, P], [b, 1]
        self.grad = grad
        with torch.set_grad_enabled(grad):
            out = self.model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True)
        self.slices = [[(layer.keys, layer.values)] for layer in output_cache(out).layers]  # per layer, per step
        self.hidden = out.last_hidden_state[:, -1]  # [b, H]

    def step(self, embeds: torch.Tensor) -> torch.Tensor:
        """Feed one soft input ``[b, 1, H]``; returns the next hidden state ``[b, H]``."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)  # [b, L + 1]
        self.position = self.position + 1  # [b, 1]
        flat = [t for layer in self.slices for kv in layer for t in kv]
        counts = [len(layer) for layer in self.slices]
        with torch.set_grad_enabled(self.grad):
            if self.method.hparams.checkpoint_steps and self.grad:
                outs = checkpoint(self._step, embeds, self.mask, self.position, counts, *flat, use_reentrant=False)
            else:
                outs = self._step(embeds, self.mask, self.position, counts, *flat)
        hidden, new = outs[0], outs[1:]
        for layer, (k, v) in zip(self.slices, zip(new[0::2], new[1::2])):
            layer.append((k, v))
        return hidden

    def _step(self, embeds, mask, position, counts, *flat):
        past, i = [], 0
        for n in counts:  # rebuild each layer's cache from its slices
            pairs = [(flat[i + 2 * j], flat[i + 2 * j + 1]) for j in range(n)]
            past.append((torch.cat([k for k, _ in pairs], dim=2), torch.cat([v for _, v in pairs], dim=2)))
            i += 2 * n
        cache = DynamicCache(ddp_cache_data=past, config=self.config)
        out = self.model(inputs_embeds=embeds, attention_mask=mask, position_ids=position,
                         **{self.cache_key: cache}, use_cache=True)  # fmt: skip
        new = [t for layer in cache.layers for t in (layer.keys[:, :, -1:].clone(), layer.values[:, :, -1:].clone())]
        return (out.last_hidden_state[:, -1], *new)


class ReferenceStepper:
    """The reference's side: its own KV cache, fed the hard tokens, never any gradient; it keeps the head's input
    (``features``, after any pre-head transform, computed while the reference is active: LoRA may adapt it)."""

    def __init__(self, method: GumbelTopK, prompt_ids, prompt_mask, positions) -> None:
        self.method = method
        self.mask, self.position = prompt_mask, positions[:, -1:]
        with torch.no_grad(), method.as_reference() as model:
            self.head = head_spec(model)
            self.cache_key = cache_keyword(trunk(model))  # read once, not at every step
            out = trunk(model)(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True)
            self.features = self.head.features(out.last_hidden_state[:, -1])  # [b, E]
        self.cache = output_cache(out)

    def step(self, token: torch.Tensor) -> None:
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)  # [b, L + 1]
        self.position = self.position + 1
        with torch.no_grad(), self.method.as_reference() as model:
            out = trunk(model)(input_ids=token[:, None], attention_mask=self.mask, position_ids=self.position,
                               **{self.cache_key: self.cache}, use_cache=True)  # fmt: skip
            self.features = self.head.features(out.last_hidden_state[:, -1])  # [b, E]
