"""One GRPO rollout batch (:class:`Rollout`): the completions, their masks and rewards, and the cached log-probs."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from lit_rl.methods.token_budget import group_order, reorder_rows


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
    row_tokens: list[int] | None = None  # prompt + completion tokens per row, with micro_batch_tokens only
    sampler_logp: torch.Tensor | None = None  # [B, C] the decode loop's log-probs of its tokens (None: generate)
    trainer_logp: torch.Tensor | None = None  # [B, C] the trainer's, before the update (its first pass fills it)

    def sort_by_length(self, group: int) -> None:
        """The groups of ``group`` rows reordered longest first (:mod:`lit_rl.methods.token_budget`)."""
        rows = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "prompt_length"}
        for name, value in reorder_rows(rows, group_order(self.row_tokens, group)).items():
            setattr(self, name, value)

    def width(self, sl: slice) -> int:
        """Completion columns micro-batch ``sl`` needs: to its longest completion with a token budget, else all."""
        if self.row_tokens is None:
            return self.completion_mask.shape[1]
        return max(self.row_tokens[sl]) - self.prompt_length

    def to(self, device: torch.device) -> Rollout:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                setattr(self, f.name, value.to(device))
        return self

    def __len__(self) -> int:
        return self.input_ids.shape[0]
