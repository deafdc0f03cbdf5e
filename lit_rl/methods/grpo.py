"""RefCachedGRPO: GRPO whose reference log-probs are computed once per rollout batch and cached.

The step follows DeepSeekMath's GRPO (arXiv 2402.03300) with the loss variants TRL's ``GRPOConfig`` offers,
under the same option names (Dr. GRPO, DAPO, CISPO, SAPO, GSPO, LUSPO, VESPO, two-sided clipping, entropy
masking; see :mod:`lit_rl.losses` and the table in ``docs/methods.md``). How it differs from a textbook implementation, for memory:

- The reference pass runs once per rollout batch, in eval mode without gradients, and keeps only
  the selected-token log-probs ``[B, C]`` (computed without full logits, see below). With LoRA the
  reference is the base model with adapters disabled, so there is no second copy of the weights;
  ``beta = 0`` skips the pass entirely.
- No pass ever materialises ``[B, T, V]`` logits: log-probs come from the trunk's hidden states and
  the LM-head weight through :func:`lit_rl.ops.token_stats`, in chunks.
- The policy update is micro-batched (``micro_batch_size`` completions per forward) with gradient
  accumulation inside the step, so the activation peak is set by the micro-batch, not the rollout.
- Every pass after the rollout runs each group's prompt once (``share_prompt``, see
  :mod:`lit_rl.models.shared_prompt`): a micro-batch of ``b`` completions of ``u`` prompts pushes
  ``u * P + b * C`` tokens through the model instead of ``b * (P + C)``, exactly.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, ClassVar, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lit_rl.losses import (
    GLOBAL_TOKEN_LOSS_TYPES,
    SCALE_REWARDS,
    LossSettings,
    entropy_bonus,
    frac_zero_std,
    group_advantages,
    grpo_loss,
    high_entropy_mask,
    masked_mean,
    sampler_mismatch,
    sampler_weights,
)
from lit_rl.memory.fake import is_fake
from lit_rl.memory.phases import BACKWARD, OPTIMIZER
from lit_rl.memory.rollout import StepWork
from lit_rl.methods.base import RLMethod
from lit_rl.methods.evaluation import distinct_bigrams
from lit_rl.methods.rollout_batch import Rollout
from lit_rl.methods.token_budget import row_tokens
from lit_rl.models import head_spec, rollout_sampler, sample_completions, trunk_hidden
from lit_rl.models.shared_prompt import group_runs, shared_prompt_hidden, shared_prompt_unsupported
from lit_rl.ops import TokenStats, token_stats
from lit_rl.ops.token_math import LOGITS_BUDGET_BYTES, plan_chunks


class RefCachedGRPO(RLMethod):
    """Group Relative Policy Optimization with a cached reference pass and logits-free log-probs.

    **Phases**: ``rollout``, ``reference``, ``policy_forward``, ``backward``, ``optimizer``.

    **Logged Metrics**: ``reward/mean``, ``reward/std``, ``reward/<function>/mean``, ``kl/mean``,
    ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (clipped loss types),
    ``cispo_clip_ratio`` (``cispo``), ``vespo/phi_seq_mean`` (``vespo``), ``entropy/mean``,
    ``completions/mean_length``, ``completions/clipped_ratio``, ``completions/distinct_bigrams``,
    ``frac_reward_zero_std``, ``loss``, ``rollout/sampler_logp_diff/mean`` and ``/max``, ``rollout/sampler_k3``,
    ``rollout/sampler_past_cap`` (the decode loop's log-probs against the trainer's: :mod:`lit_rl.losses.sampler`;
    absent where ``generate`` sampled),
    ``prompts/truncated``, ``train/nonfinite_steps``, ``metric/<function>/mean``, ``time/<phase>_s``.

    Args:
        reward_funcs: import paths of reward functions, each returning one float per completion.
        reward_weights: one weight per reward function (default: all 1).
        num_generations: completions per prompt (the group); at least 2.
        max_new_tokens: generation limit ``C``. Memory: the KV cache and the update's activations grow with it.
        min_new_tokens: EOS is not sampled before this many tokens (0: no constraint). The log-probs stay those
            of the unconstrained policy, so above 0 the update is slightly off-policy; meant for benchmarks that
            force every completion to full length so that two frameworks do equal work.
        temperature: sampling temperature; the log-probs are computed at the same temperature.
        top_p: nucleus sampling; 1.0 samples from the full distribution (what the ratio assumes).
        loss: the loss options, TRL's ``GRPOConfig`` names in one group (``model.init_args.loss``, see
            :class:`~lit_rl.losses.LossSettings`): ``loss_type``, ``beta``, the clip range, GSPO, SAPO, VESPO, the
            KL bias correction, the off-policy and entropy masks, the entropy bonus. ``loss.beta`` defaults to 0.04
            here; ``beta = 0`` skips the reference pass entirely (no reference memory or time). Under ``cispo``,
            ``loss.epsilon_high`` must be above 1. A config that sets some fields keeps these defaults for the
            others; in Python, ``LossSettings(...)`` starts from its own (``beta`` 0).
        scale_rewards: ``group``, ``batch`` or ``none`` (Dr. GRPO).
        num_iterations: optimizer steps per rollout batch; above 1 the old log-probs are cached too.
        mask_truncated_completions: completions that hit ``max_new_tokens`` without EOS get no gradient.
        chunk_size: tokens per logits chunk in the token math; ``null`` picks it from a 64 MiB budget.
        share_prompt: run each group's prompt once in the reference, old-log-prob, self-certainty and update passes,
            its completions attending to it (exact: equal log-probs and gradients up to floating-point order). Time
            and saved activations of those passes scale with ``u * P + b * C`` tokens instead of ``b * (P + C)``.
            Turned off with a one-line message for a model on which it is not exact (checked at load).
        padding_free: a completion's tokens after its EOS leave those passes' LM head and, with ``share_prompt``, the
            whole pass (exact: no counted token reads them): one long completion costs its own tokens, not ``b * C``.
        rollout_dtype: ``same``: the rollout computes as the trainer does; ``bfloat16``: with float32 weights, the
            decode loop's matmuls run in bf16 (autocast, each weight cast once per rollout: a bf16 copy of the linear
            layers held through the rollout, which the estimator charges). Faster where bf16 matmuls are, and the
            sampler is then not the trainer: the gap is logged as ``rollout/sampler_*``, and
            ``loss.importance_sampling_correction`` corrects for it. No effect on bf16 weights.
        rollout_linear: ``plain``: the trainer's matmul kernels; ``packed``: on a CPU, the decode loop's float32
            linear layers run oneDNN on weights packed once per rollout (a LoRA base in its own storage, trained or
            tied weights in a copy held through the rollout, charged by the estimator: :mod:`lit_rl.models.cast_once`).
            Float32 in another order: not exact, a gap of float32 rounding, logged as for ``rollout_dtype``.
        rollout_lora: ``adapters``: LoRA layers run their adapters in the rollout; ``merged``: the rollout reads
            merged weights, one matmul per layer (:mod:`lit_rl.models.merged_lora`: a copy held through the
            rollout, charged by the estimator; not exact, the gap is logged as for ``rollout_dtype``).
        rollout_draw: ``generate``: the decode loop draws ``generate``'s tokens for the same random state, every
            row to the longest; ``fast``: the same distribution with less work (rows that ended leave the batch,
            one uniform number per token instead of one per vocabulary entry: :func:`lit_rl.models.decode.decode`).
        rollout_rows: at most this many completions are decoded together, in the rollout and in held-out
            evaluation (``null``: all ``B * G``). Memory: the KV cache holds one chunk's rows (whole groups, or runs
            of one group's completions below ``num_generations``: :func:`lit_rl.models.sampling.rollout_chunks`),
            so a long-context rollout that cannot hold every completion's cache fits; time: every chunk reads the
            weights at each of its tokens. The same sampler and distribution, other tokens for a seed.
        **kwargs: model, optimizer, micro-batch and metric settings, see :class:`~lit_rl.methods.base.RLMethod`.

    Raises:
        ValueError: at construction, for settings that cannot work (named in the message).

    Example::

        lit-rl fit --config configs/grpo.yaml --model.loss.beta 0 --trainer.max_steps 5
    """

    phase_names: ClassVar[tuple[str, ...]] = ("rollout", "reference", "policy_forward", BACKWARD, OPTIMIZER)
    progress_bar_metrics: ClassVar[tuple[str, ...]] = ("reward/mean",)
    uses_token_lengths: ClassVar[bool] = True  # update() gets the rows' token counts (micro_batch_tokens)

    def __init__(
        self,
        reward_funcs: list[str] | None = None,
        reward_weights: list[float] | None = None,
        num_generations: int = 4,
        max_new_tokens: int = 32,
        min_new_tokens: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        loss: LossSettings = LossSettings(beta=0.04),
        scale_rewards: Literal["group", "batch", "none"] = "group",
        num_iterations: int = 1,
        mask_truncated_completions: bool = False,
        chunk_size: int | None = None,
        share_prompt: bool = True,
        padding_free: bool = True,
        rollout_dtype: Literal["same", "bfloat16"] = "same",
        rollout_linear: Literal["plain", "packed"] = "plain",
        rollout_lora: Literal["adapters", "merged"] = "adapters",
        rollout_draw: Literal["generate", "fast"] = "generate",
        rollout_rows: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # hparams saved in a checkpoint hold the dataclass as a dict
        self.loss = LossSettings(**loss) if isinstance(loss, dict) else loss
        self.hparams["loss"] = asdict(self.loss)  # plain values, as LightningCLI saves them: weights_only loads them
        self._check_settings()
        paths = self._default_rewards() if reward_funcs is None else list(reward_funcs)
        self.reward_names, self.reward_fns = self.resolve_functions(paths, "model.reward_funcs")
        weights = reward_weights if reward_weights is not None else [1.0] * len(paths)
        if len(weights) != len(paths):
            raise ValueError(
                f"model.reward_weights: has {len(weights)} entries for {len(paths)} reward_funcs; give one weight per "
                "reward function"
            )
        self.register_buffer("reward_weights", torch.tensor(weights, dtype=torch.float32), persistent=False)
        self.share_prompt = share_prompt  # confirmed (or turned off) for the loaded model in configure_model

    @staticmethod
    def _default_rewards() -> list[str]:
        return ["lit_rl.data.rewards.correct_answer"]

    def step_work(self) -> StepWork:
        hp = self.hparams  # one more policy pass for the old log-probs (num_iterations > 1), and the sampler's settings
        sampler = dict(rollout_dtype=None if hp.rollout_dtype == "same" else hp.rollout_dtype,
                       rollout_merged=hp.rollout_lora == "merged" and self.uses_lora,
                       rollout_packed=hp.rollout_linear == "packed", rollout_rows=hp.rollout_rows)  # fmt: skip
        return replace(super().step_work(), scoring_passes=int(hp.num_iterations > 1), iterations=hp.num_iterations,
                       **sampler)  # fmt: skip

    @property
    def needs_reference(self) -> bool:
        return self.loss.beta > 0

    def configure_model(self) -> None:
        loaded = self.policy is not None
        super().configure_model()
        if not loaded and self.loss.importance_sampling_correction and not self.own_decode:
            rank_zero_warn(
                "model.loss.importance_sampling_correction: on, but the rollouts come from transformers' generate, "
                "which records no log-probs, so nothing is corrected; use model.decode: own"
            )
        if loaded or not self.share_prompt:
            return
        reason = shared_prompt_unsupported(self.policy)
        if reason is not None:
            rank_zero_info(f"model.share_prompt: off for {self.name_or_path}, {reason}")
            self.share_prompt = False

    def _check_settings(self) -> None:
        hp = self.hparams
        if hp.num_generations < 2:
            raise ValueError(
                f"model.num_generations: must be >= 2 (a group needs two completions to compare), got "
                f"{hp.num_generations}; set it to 2 or more"
            )
        if hp.scale_rewards not in SCALE_REWARDS:
            raise ValueError(
                f"model.scale_rewards: {hp.scale_rewards!r} is not one of {SCALE_REWARDS}; use one of them"
            )
        # LossSettings checked its own fields when built; this is a guard for a run, not for the loss: grpo_loss
        # computes cispo at any cap, as TRL does (tests/test_losses_trl.py), but below 1 every token weighs less
        if self.loss.loss_type == "cispo" and self.loss.epsilon_high <= 1:
            raise ValueError(
                f"model.loss.epsilon_high: {self.loss.epsilon_high} under loss_type cispo caps the importance weight "
                f"itself, so every token would weigh at most {self.loss.epsilon_high}; set it above 1 (ScaleRL uses 5.0)"
            )
        for name in ("num_iterations", "max_new_tokens", "rollout_rows"):  # rollout_rows null: every row at once
            if hp[name] is not None and hp[name] < 1:
                raise ValueError(f"model.{name}: must be >= 1, got {hp[name]}; set it to 1 or more")
        if not 0 <= hp.min_new_tokens <= hp.max_new_tokens:
            raise ValueError(
                f"model.min_new_tokens: must be in [0, max_new_tokens={hp.max_new_tokens}], got {hp.min_new_tokens}; "
                "use 0 for no constraint"
            )
        if not 0 < hp.top_p <= 1:
            raise ValueError(f"model.top_p: must be in (0, 1], got {hp.top_p}; use 1.0 to sample the full distribution")
        if hp.temperature <= 0:
            raise ValueError(f"model.temperature: must be > 0, got {hp.temperature}; use 1.0 for plain sampling")
        for name, choices in (("rollout_dtype", "same bfloat16"), ("rollout_lora", "adapters merged"),
                              ("rollout_draw", "generate fast"), ("rollout_linear", "plain packed")):  # fmt: skip
            if hp[name] not in choices.split():
                raise ValueError(f"model.{name}: {hp[name]!r} is not {' or '.join(choices.split())}; use one of them")

    # ------------------------------------------------------------------ rollout
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, return_logprobs: bool = False):
        """Sample ``num_generations`` completions per prompt with the KV cache.

        Returns:
            ``(sequences [B*G, P + C], completion_mask [B*G, C])``: the mask is 1 up to and including
            the first EOS; with ``return_logprobs`` also the sampler's log-probs ``[B*G, C]`` (``None`` where
            ``generate`` sampled: :func:`lit_rl.models.sample_completions`).
        """
        hp = self.hparams
        eos = self.eos_ids()
        with rollout_sampler(self.policy, dtype=hp.rollout_dtype, lora=hp.rollout_lora, linear=hp.rollout_linear):
            sequences, sampler_logp = sample_completions(
                self.policy, input_ids, attention_mask, self.tokenizer.pad_token_id, eos,
                repeats=hp.num_generations, share_prompt=self.share_prompt, own_decode=self.own_decode,
                fast_draw=hp.rollout_draw == "fast", do_sample=True, temperature=hp.temperature, top_p=hp.top_p,
                top_k=0, max_new_tokens=hp.max_new_tokens, min_new_tokens=hp.min_new_tokens, return_logprobs=True,
                rows_at_once=hp.rollout_rows,
            )  # [B*G, P + C], [B*G, C]  # fmt: skip
        completion = sequences[:, input_ids.shape[1] :]  # [B*G, C]
        is_eos = torch.isin(completion, torch.tensor(eos, device=completion.device))  # [B*G, C]
        first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.shape[1])  # [B*G]
        positions = torch.arange(completion.shape[1], device=completion.device)  # [C]
        completion_mask = (positions[None, :] <= first_eos[:, None]).float()  # [B*G, C]
        return (sequences, completion_mask, sampler_logp) if return_logprobs else (sequences, completion_mask)

    def compute_rewards(self, completions: list[str], batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """Weighted sum of the reward functions ``[B*G]`` and per-function means."""
        per_fn = self.score_functions(
            self.reward_fns, self.reward_names, completions, batch, self.hparams.num_generations
        )  # [B*G, F]
        # [B*G] in float32: bf16-true casts buffers, and a matmul under bf16-mixed autocast would round the rewards
        rewards = (per_fn * self.reward_weights.float().cpu()).sum(dim=1)
        means = {f"reward/{name}/mean": per_fn[:, i].mean().item() for i, name in enumerate(self.reward_names)}
        return rewards, means

    def rollout(self, batch: dict[str, Any]) -> tuple[Rollout, dict[str, float]]:
        """Generate and score with the reward functions: phase ``rollout``."""
        hp = self.hparams
        with self.phases("rollout"):
            sequences, completion_mask, sampler_logp = self.generate(
                batch["input_ids"], batch["attention_mask"], return_logprobs=True
            )
            prompt_length = batch["input_ids"].shape[1]
            completion_ids = sequences[:, prompt_length:]  # [B*G, C]
            self.step_shape = {"prompt_length": prompt_length, "new_tokens": completion_ids.shape[1]}
            lengths = completion_mask.sum(1)  # [B*G]
            completions = self.decode(completion_ids, lengths)
            rewards, metrics = self.compute_rewards(completions, batch)
            metrics.update(self.metric_scores(completions, batch, hp.num_generations))
            rewards = rewards.to(self.device)
            truncated = completion_mask[:, -1].bool() & ~self._ended_with_eos(completion_ids)  # [B*G]
            if hp.mask_truncated_completions:
                completion_mask = completion_mask * (~truncated).float()[:, None]
            if hp.padding_free and not is_fake(completion_mask):  # the tokens the later passes run: the roofline's
                self.step_shape["completion_tokens"] = int(completion_mask.sum())
            prompt_mask = batch["attention_mask"].repeat_interleave(hp.num_generations, dim=0)  # [B*G, P]
            attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)  # [B*G, P + C]
        metrics.update(
            {
                "completions/mean_length": lengths.mean().item(),
                "completions/clipped_ratio": truncated.float().mean().item(),
                "completions/distinct_bigrams": distinct_bigrams(completion_ids, lengths).mean().item(),
                "prompts/truncated": float(batch.get("num_truncated", 0)),
            }
        )
        rollout = Rollout(
            input_ids=sequences, attention_mask=attention_mask, completion_mask=completion_mask,
            prompt_length=prompt_length, rewards=rewards, advantages=torch.zeros_like(rewards), completions=completions,
            sampler_logp=sampler_logp,  # the trainer's own, for the gap and the correction, come with the update
            trainer_logp=None if sampler_logp is None else torch.zeros_like(sampler_logp),
        )  # fmt: skip
        if hp.micro_batch_tokens is not None:  # micro-batches by tokens: groups sorted, each pass cut to its longest
            rollout.row_tokens = row_tokens(lengths, prompt_length, completion_ids.shape[1])
            rollout.sort_by_length(hp.num_generations)
        return rollout, metrics

    def compute_advantages(self, rollout: Rollout) -> dict[str, float]:
        """Group-relative advantages from ``rollout.rewards`` (after the scoring passes, which may add to them)."""
        hp = self.hparams
        rewards = rollout.rewards  # [B*G]
        rollout.advantages = group_advantages(rewards, hp.num_generations, scale_rewards=hp.scale_rewards)  # [B*G]
        return {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item(),
            "frac_reward_zero_std": frac_zero_std(rewards, hp.num_generations),
        }

    def _ended_with_eos(self, completion_ids: torch.Tensor) -> torch.Tensor:
        eos = torch.tensor(self.eos_ids(), device=completion_ids.device)
        return torch.isin(completion_ids, eos).any(1)  # [B*G]

    # ------------------------------------------------------------------ token math
    def completion_stats(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_length: int,
        *,
        temperature: float,
        entropy: bool = True,
        self_certainty: bool = False,
        chunk_size: int | None = None,
        runs: list[int] | None = None,
        keep: torch.Tensor | None = None,
    ) -> TokenStats:
        """Log-probs (and entropy / self-certainty) of the completion tokens, without ``[B, T, V]`` logits.

        ``input_ids`` is prompt + completion ``[B, P + C]``; the hidden state at position ``t`` predicts
        token ``t + 1``, so positions ``P - 1 .. P + C - 2`` score the ``C`` completion tokens. ``runs``: the
        lengths of the consecutive runs of rows that share a prompt, whose prompt then runs once (``None``: every
        row runs whole). ``keep``: the completion mask ``[B, C]`` of the tokens that count; the others get zero
        statistics and skip the LM head, and with ``runs`` the trunk too
        (:func:`~lit_rl.models.shared_prompt.shared_prompt_hidden`). Fake tensors (an estimate) run every token.
        """
        counted = keep.bool() if keep is not None and not is_fake(keep) and not keep.bool().all() else None
        if runs is None:
            hidden = trunk_hidden(model, input_ids, attention_mask)[:, prompt_length - 1 : -1]  # [B, C, H]
        else:
            hidden = shared_prompt_hidden(model, input_ids, attention_mask, prompt_length, runs, counted)  # [B, C, H]
        targets = input_ids[:, prompt_length:]  # [B, C]
        head = head_spec(model)  # weight, bias, logit scale, softcap and pre-head transform of this architecture
        if counted is not None:  # padding-free: the head reads the counted positions only, [1, n, H]
            hidden, targets = hidden[counted][None], targets[counted][None]
        stats = token_stats(head.features(hidden), head.weight, targets, temperature=temperature, chunk_size=chunk_size,
                            entropy=entropy, self_certainty=self_certainty, **head.op_kwargs)  # fmt: skip
        if counted is None:
            return stats
        return TokenStats(*(v if v is None else v.new_zeros(counted.shape).masked_scatter(counted, v) for v in stats))

    def memory_components(self, policy_shape: dict[str, int]) -> list[tuple[str, str, int, str]]:
        s = policy_shape
        b, c, mb = s["batch"], s["new_tokens"], s["micro_batch"]
        seq = s["prompt_length"] + c
        tc, vc = plan_chunks(mb * c, s["vocab"], s["hidden"], self.hparams.chunk_size, None, LOGITS_BUDGET_BYTES)
        caches = [n for n, on in (("reference", self.needs_reference), ("old", self.hparams.num_iterations > 1)) if on]
        rollout = f"ids + mask [{b}, {seq}] int64, completion mask [{b}, {c}] fp32"
        rows = [("rollout tensors", rollout, b * seq * 16 + b * c * 4, "")]
        rows += [
            (f"{name} log-probs cache", f"[{b}, {c}] fp32", b * c * 4, "instead of [B, T, V] logits") for name in caches
        ]
        if self.share_prompt:
            u = max(len(group_runs(sl.start, sl.stop, self.hparams.num_generations)) for sl in self.micro_batches(b))
            tokens = f"{u} x {s['prompt_length']} + {mb} x {c}"
            rows.append(
                ("tokens per pass (shared prompt)", tokens, 0, f"one packed row; {mb} x {seq} with share_prompt false")
            )
        full = f"[{s['micro_batch']}, {s['new_tokens']}, {s['vocab']}] fp32"
        return rows + [
            ("logits chunk (token math)", f"[{tc}, {vc}] fp32", tc * vc * 4, "about two live at a time"),
            ("full logits (never allocated)", full, mb * c * s["vocab"] * 4,
             "what a logits-based loss would hold per micro-batch"),
        ]  # fmt: skip

    # ------------------------------------------------------------------ cached passes
    @torch.no_grad()
    def score_rollout(self, rollout: Rollout) -> dict[str, float] | None:
        """Reference (and old-policy) log-probs, once per rollout batch: phase ``reference``."""
        hp = self.hparams
        if not self.needs_reference and hp.num_iterations == 1:
            return  # nothing to cache: no KL term and the update is on-policy
        with self.phases("reference"):
            if self.needs_reference:
                rollout.ref_logp = self.reference_logp(rollout)
            if hp.num_iterations > 1:
                rollout.old_logp = self.micro_batched_stats(self.policy, rollout)[0]

    def reference_logp(self, rollout: Rollout) -> torch.Tensor:
        """Log-probs ``[B*G, C]`` of the completions under the reference, in micro-batches, without gradient."""
        with self.as_reference() as reference:
            return self.micro_batched_stats(reference, rollout)[0]

    def micro_batched_stats(
        self, model, rollout: Rollout, *, self_certainty: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[B*G, C]`` (and per-token self-certainty) in micro-batches, without gradient."""
        # each micro-batch writes its rows of one output (zeros past a micro-batch cut to its longest completion)
        logps = certainties = None
        for sl in self.micro_batches(len(rollout), rollout.row_tokens):
            stats = self._stats(model, rollout, sl, entropy=False, self_certainty=self_certainty)
            if logps is None:
                logps = stats.logp.new_zeros(rollout.completion_mask.shape)
                certainties = torch.zeros_like(logps) if self_certainty else None
            logps[sl, : stats.logp.shape[1]] = stats.logp
            if self_certainty:
                certainties[sl, : stats.logp.shape[1]] = stats.self_certainty
        return logps, certainties

    def _stats(self, model, rollout: Rollout, sl: slice, **kw) -> TokenStats:
        # rollout rows are groups of num_generations consecutive completions of one prompt
        runs = group_runs(sl.start, sl.stop, self.hparams.num_generations) if self.share_prompt else None
        width = rollout.width(sl)
        end = rollout.prompt_length + width
        keep = rollout.completion_mask[sl, :width] if self.hparams.padding_free else None
        return self.completion_stats(model, rollout.input_ids[sl, :end], rollout.attention_mask[sl, :end],
                                     rollout.prompt_length, temperature=self.hparams.temperature,
                                     chunk_size=self.hparams.chunk_size, runs=runs, keep=keep, **kw)  # fmt: skip

    # ------------------------------------------------------------------ update
    def policy_loss(self, rollout: Rollout, sl: slice, num_items: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch, scaled so the micro-batches of a step add up to the batch loss."""
        settings = self.loss
        stats = self._stats(self.policy, rollout, sl, entropy=True)
        width = rollout.width(sl)  # C, or this micro-batch's longest completion with a token budget
        mask = rollout.completion_mask[sl, :width]  # [b, C]
        token_mask = None
        if settings.top_entropy_quantile < 1:
            # one threshold for every process, as TRL takes it (a boolean index: real runs only, never the estimator)
            pooled = self.gather_ragged(stats.entropy.detach()[mask.bool()]) if self.world_size > 1 else None
            token_mask = high_entropy_mask(stats.entropy, mask, settings.top_entropy_quantile, pooled=pooled)  # [b, C]
        weights = None
        if rollout.sampler_logp is not None:  # the trainer's log-probs before the update, against the sampler's
            before = rollout.old_logp[sl, :width] if rollout.old_logp is not None else stats.logp.detach()
            rollout.trainer_logp[sl, :width] = before
            if settings.importance_sampling_correction:
                weights = sampler_weights(
                    before, rollout.sampler_logp[sl, :width], mask, mode=settings.importance_sampling_mode,
                    clip_min=settings.importance_sampling_clip_min, clip_max=settings.importance_sampling_clip_max,
                )  # fmt: skip
        loss, loss_stats = grpo_loss(
            stats.logp,
            rollout.old_logp[sl, :width] if rollout.old_logp is not None else None,
            rollout.ref_logp[sl, :width] if rollout.ref_logp is not None else None,
            rollout.advantages[sl],
            mask,
            settings=settings,
            max_completion_length=self.hparams.max_new_tokens,
            num_items_in_batch=num_items,
            token_mask=token_mask,
            sampler_weights=weights,
        )
        share = mask.shape[0] / len(rollout)  # this micro-batch's part of the rollout
        if settings.loss_type not in GLOBAL_TOKEN_LOSS_TYPES:  # those already divide by the whole step's token count
            loss = loss * share
        if settings.entropy_coef > 0:  # a mean entropy per micro-batch, added up over the step like the loss
            loss = loss - settings.entropy_coef * share * entropy_bonus(stats.entropy, mask, token_mask)
        loss_stats["entropy/mean"] = masked_mean(stats.entropy.detach(), mask).item()
        return loss, loss_stats

    def train_step(self, batch: dict[str, Any]) -> tuple[dict[str, float], int]:
        rollout, metrics = self.rollout(batch)
        metrics.update(self.score_rollout(rollout) or {})
        metrics.update(self.compute_advantages(rollout))
        # dapo: every completion token of the optimizer step weighs the same, across micro-batches and
        # ranks; DDP averages gradients over ranks, hence the division by world_size
        num_items = float(self.reduce_sum(rollout.completion_mask.sum())) / self.world_size

        def loss_fn(sl: slice) -> tuple[torch.Tensor, dict[str, float]]:
            with self.phases("policy_forward"):
                return self.policy_loss(rollout, sl, num_items)

        step_stats: list[dict[str, float]] = []
        for _ in range(self.hparams.num_iterations):
            metrics["loss"], stats = self.update(len(rollout), loss_fn, rollout.row_tokens)
            step_stats += stats
        for key in step_stats[0] if step_stats else []:
            metrics[key] = sum(s[key] for s in step_stats) / len(step_stats)
        if rollout.sampler_logp is not None:
            s = self.loss
            gap = sampler_mismatch(
                rollout.trainer_logp, rollout.sampler_logp, rollout.completion_mask, mode=s.importance_sampling_mode,
                clip_min=s.importance_sampling_clip_min, clip_max=s.importance_sampling_clip_max,
            )  # fmt: skip
            metrics.update(zip(gap, torch.stack(list(gap.values())).tolist(), strict=True))  # one device sync
        return metrics, len(rollout)
