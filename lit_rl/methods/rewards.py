"""Completion text and reward functions, the same for every method: mixed into :class:`~lit_rl.methods.RLMethod`.

The host provides ``policy``, ``tokenizer``, ``metric_names`` and ``metric_fns`` (the base sets them); methods and
held-out evaluation call these helpers to turn sampled ids into text and score it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lit_rl.data.rewards import resolve_reward_fn, score


class TextAndRewards:
    """EOS ids, decoded completions, and reward-shaped functions named by import path."""

    def eos_ids(self) -> list[int]:
        """End-of-sequence ids: the tokenizer's and the generation config's."""
        ids = {self.tokenizer.eos_token_id}
        config_eos = getattr(getattr(self.policy, "generation_config", None), "eos_token_id", None)
        ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
        return sorted(i for i in ids if i is not None)

    def decode(self, ids: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """Text of each row of ``ids [B, C]`` up to its length ``[B]``, special tokens dropped."""
        return [
            self.tokenizer.decode(row[:n], skip_special_tokens=True)
            for row, n in zip(ids.tolist(), lengths.long().tolist())
        ]

    @staticmethod
    def resolve_functions(paths: list[str], field: str) -> tuple[list[str], list[Callable]]:
        """Names and callables of reward-shaped functions given by import path (``field`` names the setting)."""
        names = [p.replace(":", ".").rsplit(".", 1)[-1] for p in paths]
        fns = [resolve_reward_fn(p, field=f"{field}[{i}]") for i, p in enumerate(paths)]
        return names, fns

    def score_functions(
        self,
        fns: list[Callable],
        names: list[str],
        completions: list[str],
        batch: dict[str, Any],
        repeats: int,
        field: str = "model.reward_funcs",
    ) -> torch.Tensor:
        """Each function's scores, checked, as columns ``[B*repeats, F]`` (``F`` may be 0).

        ``field`` names the setting that lists the functions, for the error messages.
        """
        answers = [a for a in batch["answers"] for _ in range(repeats)]
        prompts = [p for p in batch["prompts"] for _ in range(repeats)]
        columns = [score(fn, name, completions, answers, prompts, field=field) for fn, name in zip(fns, names)]
        return torch.stack(columns, dim=1) if columns else torch.zeros(len(completions), 0)

    def metric_scores(self, completions: list[str], batch: dict[str, Any], repeats: int) -> dict[str, float]:
        """``metric/<name>/mean`` of each ``metric_funcs`` (logged, never rewarded)."""
        if not self.metric_fns:
            return {}
        scores = self.score_functions(
            self.metric_fns, self.metric_names, completions, batch, repeats, field="model.metric_funcs"
        )
        return {f"metric/{n}/mean": scores[:, i].mean().item() for i, n in enumerate(self.metric_names)}
