"""Group-relative advantages: each completion's reward against its group's (GRPO, DeepSeekMath arXiv 2402.03300)."""

from __future__ import annotations

import torch
from torch import Tensor

SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")


def _check_groups(rewards: Tensor, num_generations: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * num_generations], got shape {tuple(rewards.shape)}")
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2 for group-relative advantages, got {num_generations}")
    if rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of num_generations={num_generations}; "
            "pass num_prompts * num_generations rewards"
        )


def group_advantages(
    rewards: Tensor,
    num_generations: int,
    *,
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> Tensor:
    """Group-relative advantages (GRPO, DeepSeekMath arXiv 2402.03300; Dr. GRPO arXiv 2503.20783).

    Completions ``[i * num_generations, (i + 1) * num_generations)`` answer prompt ``i``. Each
    advantage is the reward minus its group's mean, then optionally divided by a std. The std is
    ``torch.std``'s default, the *unbiased* (Bessel-corrected, ``N - 1``) estimate, as in TRL.

    Args:
        rewards: ``[B]`` rewards, ``B = num_prompts * num_generations``, groups consecutive.
        num_generations: completions per prompt (>= 2).
        scale_rewards: ``"group"`` divides by ``std_group + eps`` (GRPO); ``"batch"`` divides by the
            std of the whole batch ``+ eps`` (the mean stays per group); ``"none"`` does not divide
            (Dr. GRPO: the std division favours prompts that are too easy or too hard).
        eps: added to the std so a zero-std group gives zero advantages, not ``NaN``.

    Returns:
        ``[B]`` advantages, float.

    Raises:
        ValueError: ``scale_rewards`` is unknown, ``rewards`` is not 1-D, ``num_generations < 2`` or
            ``B`` is not a multiple of ``num_generations``.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    _check_groups(rewards, num_generations)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    grouped = rewards.view(-1, num_generations)  # [P, G]
    advantages = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)  # [P, G]
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + eps)  # [P, G]
    return advantages.reshape(-1)  # [B]


def frac_zero_std(rewards: Tensor, num_generations: int) -> float:
    """Fraction of groups whose rewards all agree (zero std), so that give no learning signal.

    Args:
        rewards: ``[B]`` rewards, groups of ``num_generations`` consecutive completions.
        num_generations: completions per prompt (>= 2).

    Returns:
        A python float in ``[0, 1]``.
    """
    _check_groups(rewards, num_generations)
    std = rewards.float().view(-1, num_generations).std(dim=1)  # [P]
    return torch.isclose(std, torch.zeros_like(std)).float().mean().item()
