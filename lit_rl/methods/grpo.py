"""RefCachedGRPO: GRPO whose reference log-probs are computed once per rollout batch and cached.

The step follows DeepSeekMath's GRPO (arXiv 2402.03300) with the loss variants of Dr. GRPO and
DAPO (see :mod:`lit_rl.losses`). How it differs from a textbook implementation, for memory:

- The reference pass runs once per rollout batch, in eval mode without gradients, and keeps only
  the selected-token log-probs ``[B, C]`` (the seed analysis 000 kept the same, but computed them
  from full logits). With LoRA the reference is the base model with adapters disabled, so there is
  no second copy of the weights; ``beta = 0`` skips the pass entirely.
- No pass ever materialises ``[B, T, V]`` logits: log-probs come from the trunk's hidden states and
  the LM-head weight through :func:`lit_rl.ops.token_stats`, in chunks.
- The policy update is micro-batched (``micro_batch_size`` completions per forward) with gradient
  accumulation inside the step, so the activation peak is set by the micro-batch, not the rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from transformers import GenerationConfig

from lit_rl.data.rewards import resolve_reward_fn, score
from lit_rl.losses import LOSS_TYPES, SCALE_REWARDS, frac_zero_std, group_advantages, grpo_loss, masked_mean
from lit_rl.methods.base import RLMethod
from lit_rl.models import LoraSettings


@dataclass
class Rollout:
    """One rollout batch: ``B = prompts * num_generations`` completions and what the update needs."""

    input_ids: torch.Tensor  # [B, P + C] prompt + completion
    attention_mask: torch.Tensor  # [B, P + C]
    completion_mask: torch.Tensor  # [B, C] 1 up to and including EOS (0 for truncated ones when masked)
    prompt_length: int
    rewards: torch.Tensor  # [B]
    advantages: torch.Tensor  # [B]
    ref_logp: torch.Tensor | None = None  # [B, C]
    old_logp: torch.Tensor | None = None  # [B, C]
    completions: list[str] = field(default_factory=list)

    def to(self, device: torch.device) -> Rollout:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, value.to(device))
        return self

    def __len__(self) -> int:
        return self.input_ids.shape[0]


class RefCachedGRPO(RLMethod):
    """Group Relative Policy Optimization with a cached reference pass and logits-free log-probs.

    **Logged Metrics**: ``reward/mean``, ``reward/std``, ``reward/<function>/mean``, ``kl/mean``,
    ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``entropy/mean``,
    ``completions/mean_length``, ``completions/clipped_ratio``, ``frac_reward_zero_std``, ``loss``,
    ``prompts/truncated``, ``train/nonfinite_steps``, ``time/<phase>_s``.

    Args:
        reward_funcs: import paths of reward functions, each returning one float per completion.
        reward_weights: one weight per reward function (default: all 1).
        num_generations: completions per prompt (the group); at least 2.
        max_new_tokens: generation limit ``C``. Memory: the KV cache and the update's activations grow with it.
        temperature: sampling temperature; the log-probs are computed at the same temperature.
        top_p: nucleus sampling; 1.0 samples from the full distribution (what the ratio assumes).
        beta: KL coefficient. ``beta = 0`` skips the reference pass entirely (no reference memory or time).
        epsilon_low: lower clip of the ratio.
        epsilon_high: upper clip (DAPO's clip-higher uses 0.28).
        loss_type: ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo``.
        scale_rewards: ``group``, ``batch`` or ``none`` (Dr. GRPO).
        num_iterations: optimizer steps per rollout batch; above 1 the old log-probs are cached too.
        micro_batch_size: completions per policy forward; ``null`` does the whole rollout at once.
            Smaller means a lower activation peak, at more passes per step.
        mask_truncated_completions: completions that hit ``max_new_tokens`` without EOS get no gradient.
        chunk_size: tokens per logits chunk in the token math; ``null`` picks it from a 64 MiB budget.
        max_nonfinite_steps: stop the run after this many non-finite losses in a row (each is skipped).
        **kwargs: model and optimizer settings, see :class:`~lit_rl.methods.base.RLMethod`.

    Raises:
        ValueError: at construction, for settings that cannot work (named in the message).

    Example::

        lit-rl fit --config configs/grpo.yaml --model.beta 0 --trainer.max_steps 5
    """

    def __init__(
        self,
        reward_funcs: list[str] | None = None,
        reward_weights: list[float] | None = None,
        num_generations: int = 4,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        beta: float = 0.04,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo",
        scale_rewards: Literal["group", "batch", "none"] = "group",
        num_iterations: int = 1,
        micro_batch_size: int | None = None,
        mask_truncated_completions: bool = False,
        chunk_size: int | None = None,
        max_nonfinite_steps: int = 3,
        name_or_path: str = "embedded",
        gguf_file: str | None = None,
        dtype: str = "float32",
        trust_remote_code: bool = False,
        lora: LoraSettings | None = None,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
    ) -> None:
        super().__init__(
            name_or_path=name_or_path,
            gguf_file=gguf_file,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            lora=lora,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
        )
        self.save_hyperparameters()
        self._check_settings()
        paths = self._default_rewards() if reward_funcs is None else list(reward_funcs)
        self.reward_names = [p.replace(":", ".").rsplit(".", 1)[-1] for p in paths]
        self.reward_fns = [resolve_reward_fn(p, field=f"model.reward_funcs[{i}]") for i, p in enumerate(paths)]
        weights = reward_weights if reward_weights is not None else [1.0] * len(paths)
        if len(weights) != len(paths):
            raise ValueError(f"model.reward_weights has {len(weights)} entries for {len(paths)} reward_funcs")
        self.register_buffer("reward_weights", torch.tensor(weights, dtype=torch.float32), persistent=False)
        self._nonfinite_in_a_row = 0
        self._nonfinite_total = 0
        self.__dict__["reference"] = None  # a frozen copy for full fine-tuning; kept out of the checkpoint

    @staticmethod
    def _default_rewards() -> list[str]:
        return ["lit_rl.data.rewards.correct_answer"]

    def _check_settings(self) -> None:
        hp = self.hparams
        if hp.num_generations < 2:
            raise ValueError(
                f"model.num_generations must be >= 2 (a group needs two completions to compare), got {hp.num_generations}"
            )
        if hp.loss_type not in LOSS_TYPES:
            raise ValueError(f"model.loss_type: {hp.loss_type!r} is not one of {LOSS_TYPES}")
        if hp.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"model.scale_rewards: {hp.scale_rewards!r} is not one of {SCALE_REWARDS}")
        if hp.epsilon_high < hp.epsilon_low:
            raise ValueError(
                f"model.epsilon_high ({hp.epsilon_high}) < model.epsilon_low ({hp.epsilon_low}); "
                "clip-higher needs epsilon_high >= epsilon_low"
            )
        if hp.beta < 0:
            raise ValueError(f"model.beta must be >= 0, got {hp.beta}")
        if hp.num_iterations < 1 or hp.max_new_tokens < 1 or hp.max_nonfinite_steps < 1:
            raise ValueError("model.num_iterations, model.max_new_tokens and model.max_nonfinite_steps must be >= 1")
        if hp.micro_batch_size is not None and hp.micro_batch_size < 1:
            raise ValueError(f"model.micro_batch_size must be >= 1 or null, got {hp.micro_batch_size}")
        if not 0 < hp.top_p <= 1 or hp.temperature <= 0:
            raise ValueError("model.top_p must be in (0, 1] and model.temperature > 0")

    # ------------------------------------------------------------------ setup
    def configure_model(self) -> None:
        super().configure_model()
        if self.hparams.beta > 0 and not self.uses_lora and self.reference is None:
            self.__dict__["reference"] = self.frozen_copy()

    def on_fit_start(self) -> None:
        if self.reference is not None:
            self.reference.to(self.device, dtype=next(self.policy.parameters()).dtype)

    # ------------------------------------------------------------------ rollout
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``num_generations`` completions per prompt with the KV cache.

        Returns:
            ``(sequences [B*G, P + C], completion_mask [B*G, C])``: the mask is 1 up to and including
            the first EOS.
        """
        hp = self.hparams
        input_ids = input_ids.repeat_interleave(hp.num_generations, dim=0)  # [B*G, P]
        attention_mask = attention_mask.repeat_interleave(hp.num_generations, dim=0)  # [B*G, P]
        eos = self._eos_ids()
        # a fresh config: checkpoint defaults (top_k=50, repetition penalties) would bias the samples
        config = GenerationConfig(
            do_sample=True,
            temperature=hp.temperature,
            top_p=hp.top_p,
            top_k=0,
            max_new_tokens=hp.max_new_tokens,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=eos,
            use_cache=True,
        )
        was_training = self.policy.training
        self.policy.eval()
        try:
            sequences = self.policy.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config
            )  # [B*G, P + C]
        finally:
            self.policy.train(was_training)
        completion = sequences[:, input_ids.shape[1] :]  # [B*G, C]
        is_eos = torch.isin(completion, torch.tensor(eos, device=completion.device))  # [B*G, C]
        first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.shape[1])  # [B*G]
        positions = torch.arange(completion.shape[1], device=completion.device)  # [C]
        completion_mask = (positions[None, :] <= first_eos[:, None]).float()  # [B*G, C]
        return sequences, completion_mask

    def _eos_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        config_eos = getattr(self.policy.generation_config, "eos_token_id", None)
        ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
        return sorted(i for i in ids if i is not None)

    def compute_rewards(self, completions: list[str], batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """Weighted sum of the reward functions ``[B*G]`` and per-function means."""
        per_fn = self.score_functions(self.reward_fns, self.reward_names, completions, batch)  # [B*G, F]
        rewards = per_fn @ self.reward_weights.float().cpu()  # [B*G]; bf16-true casts buffers, rewards stay float32
        means = {f"reward/{name}/mean": per_fn[:, i].mean().item() for i, name in enumerate(self.reward_names)}
        return rewards, means

    def score_functions(self, fns, names, completions: list[str], batch: dict[str, Any]) -> torch.Tensor:
        """Each function's scores, checked, as columns ``[B*G, F]`` (``F`` may be 0)."""
        g = self.hparams.num_generations
        answers = [a for a in batch["answers"] for _ in range(g)]
        prompts = [p for p in batch["prompts"] for _ in range(g)]
        columns = [score(fn, name, completions, answers, prompts) for fn, name in zip(fns, names)]
        return torch.stack(columns, dim=1) if columns else torch.zeros(len(completions), 0)

    def rollout(self, batch: dict[str, Any]) -> tuple[Rollout, dict[str, float]]:
        """Generate and score with the reward functions: phase ``rollout``."""
        hp = self.hparams
        with self.phases("rollout"):
            sequences, completion_mask = self.generate(batch["input_ids"], batch["attention_mask"])
            prompt_length = batch["input_ids"].shape[1]
            completion_ids = sequences[:, prompt_length:]  # [B*G, C]
            lengths = completion_mask.sum(1)  # [B*G]
            completions = [
                self.tokenizer.decode(ids[:n], skip_special_tokens=True)
                for ids, n in zip(completion_ids.tolist(), lengths.long().tolist())
            ]
            rewards, metrics = self.compute_rewards(completions, batch)
            rewards = rewards.to(self.device)
            truncated = completion_mask[:, -1].bool() & ~self._ended_with_eos(completion_ids)  # [B*G]
            if hp.mask_truncated_completions:
                completion_mask = completion_mask * (~truncated).float()[:, None]
            prompt_mask = batch["attention_mask"].repeat_interleave(hp.num_generations, dim=0)  # [B*G, P]
            attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)  # [B*G, P + C]
        metrics.update(
            {
                "completions/mean_length": lengths.mean().item(),
                "completions/clipped_ratio": truncated.float().mean().item(),
                "prompts/truncated": float(batch.get("num_truncated", 0)),
            }
        )
        rollout = Rollout(
            input_ids=sequences,
            attention_mask=attention_mask,
            completion_mask=completion_mask,
            prompt_length=prompt_length,
            rewards=rewards,
            advantages=torch.zeros_like(rewards),
            completions=completions,
        )
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
        eos = torch.tensor(self._eos_ids(), device=completion_ids.device)
        return torch.isin(completion_ids, eos).any(1)  # [B*G]

    # ------------------------------------------------------------------ cached passes
    @torch.no_grad()
    def score_rollout(self, rollout: Rollout) -> dict[str, float] | None:
        """Reference (and old-policy) log-probs, once per rollout batch: phase ``reference``."""
        hp = self.hparams
        if hp.beta == 0 and hp.num_iterations == 1:
            return  # nothing to cache: no KL term and the update is on-policy
        with self.phases("reference"):
            if hp.beta > 0:
                rollout.ref_logp = self._micro_batched_logp(self._reference_model(), rollout)
            if hp.num_iterations > 1:
                rollout.old_logp = self._micro_batched_logp(self.policy, rollout)

    def _reference_model(self):
        """The reference: the base model with LoRA adapters disabled, or the frozen copy."""
        if self.uses_lora:
            return _AdapterDisabled(self.policy)
        return self.reference

    def _micro_batched_logp(self, model, rollout: Rollout) -> torch.Tensor:
        return self._micro_batched_stats(model, rollout)[0]

    def _micro_batched_stats(
        self, model, rollout: Rollout, *, self_certainty: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[B*G, C]`` (and per-token self-certainty) in micro-batches, without gradient."""
        logps, certainties = [], []
        for sl in self._micro_batches(len(rollout)):
            stats = self._stats(model, rollout, sl, entropy=False, self_certainty=self_certainty)
            logps.append(stats.logp)
            certainties.append(stats.self_certainty)
        return torch.cat(logps), torch.cat(certainties) if self_certainty else None

    def _stats(self, model, rollout: Rollout, sl: slice, **kw):
        if isinstance(model, _AdapterDisabled):
            with model.policy.disable_adapter():
                return self.completion_stats(
                    model.policy,
                    rollout.input_ids[sl],
                    rollout.attention_mask[sl],
                    rollout.prompt_length,
                    temperature=self.hparams.temperature,
                    chunk_size=self.hparams.chunk_size,
                    **kw,
                )
        was_training = model.training
        if model is not self.policy:
            model.eval()
        out = self.completion_stats(
            model,
            rollout.input_ids[sl],
            rollout.attention_mask[sl],
            rollout.prompt_length,
            temperature=self.hparams.temperature,
            chunk_size=self.hparams.chunk_size,
            **kw,
        )
        model.train(was_training)
        return out

    def _micro_batches(self, n: int) -> list[slice]:
        size = self.hparams.micro_batch_size or n
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    # ------------------------------------------------------------------ update
    def policy_loss(self, rollout: Rollout, sl: slice, num_items: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch, scaled so the micro-batches of a step add up to the batch loss."""
        hp = self.hparams
        stats = self._stats(self.policy, rollout, sl, entropy=True)
        mask = rollout.completion_mask[sl]  # [b, C]
        loss, loss_stats = grpo_loss(
            stats.logp,
            rollout.old_logp[sl] if rollout.old_logp is not None else None,
            rollout.ref_logp[sl] if rollout.ref_logp is not None else None,
            rollout.advantages[sl],
            mask,
            loss_type=hp.loss_type,
            epsilon_low=hp.epsilon_low,
            epsilon_high=hp.epsilon_high,
            beta=hp.beta,
            max_completion_length=hp.max_new_tokens,
            num_items_in_batch=num_items,
        )
        if hp.loss_type != "dapo":  # dapo already divides by the whole step's token count
            loss = loss * (mask.shape[0] / len(rollout))
        loss_stats["entropy/mean"] = masked_mean(stats.entropy.detach(), mask).item()
        return loss, loss_stats

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        hp = self.hparams
        rollout, metrics = self.rollout(batch)
        metrics.update(self.score_rollout(rollout) or {})
        metrics.update(self.compute_advantages(rollout))
        # dapo: every completion token of the optimizer step weighs the same, across micro-batches and
        # ranks; DDP averages gradients over ranks, hence the division by world_size
        tokens = self.trainer.strategy.reduce(rollout.completion_mask.sum(), reduce_op="sum")
        num_items = float(tokens) / self.trainer.world_size
        optimizer = self.optimizers()
        step_stats: list[dict[str, float]] = []
        for _ in range(hp.num_iterations):
            total = 0.0
            finite = True
            for sl in self._micro_batches(len(rollout)):
                with self.phases("policy_forward"):
                    loss, stats = self.policy_loss(rollout, sl, num_items)
                if not torch.isfinite(loss):
                    finite = False
                    break
                with self.phases("backward"):
                    self.manual_backward(loss)
                total += loss.item()
                step_stats.append(stats)
            with self.phases("optimizer"):
                if finite:
                    if hp.max_grad_norm > 0:
                        self.clip_gradients(
                            optimizer, gradient_clip_val=hp.max_grad_norm, gradient_clip_algorithm="norm"
                        )
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            self._track_nonfinite(finite)
            metrics["loss"] = total if finite else float("nan")
        for key in step_stats[0] if step_stats else []:
            metrics[key] = sum(s[key] for s in step_stats) / len(step_stats)
        metrics["train/nonfinite_steps"] = float(self._nonfinite_total)
        self.log_dict(metrics, on_step=True, prog_bar=False, batch_size=len(rollout))
        self.log("reward", metrics["reward/mean"], prog_bar=True, logger=False, batch_size=len(rollout))
        self.log_phase_times(len(rollout))

    def _track_nonfinite(self, finite: bool) -> None:
        if finite:
            self._nonfinite_in_a_row = 0
            return
        self._nonfinite_in_a_row += 1
        self._nonfinite_total += 1
        rank_zero_warn(
            f"non-finite loss at step {self.global_step}: update skipped ({self._nonfinite_in_a_row} in a row)"
        )
        if self._nonfinite_in_a_row >= self.hparams.max_nonfinite_steps:
            raise FloatingPointError(
                f"{self._nonfinite_in_a_row} non-finite losses in a row (model.max_nonfinite_steps="
                f"{self.hparams.max_nonfinite_steps}); lower model.learning_rate, use trainer.precision: bf16-mixed "
                "instead of 16-bit weights, or raise max_nonfinite_steps"
            )


@dataclass
class _AdapterDisabled:
    """Marks "the policy with its LoRA adapters disabled" as a model to score with."""

    policy: torch.nn.Module
    training: bool = False
