"""The held-out prompt split: prompts the policy never trains on, from the training source or a file of their own.

A split from the training source holds out *distinct prompt texts*, not rows: the generated arithmetic task
repeats questions (single-digit addition has 81), so holding out rows would leave copies of most held-out
questions in the training set and the held-out score would measure memorisation.
"""

from __future__ import annotations

import json
import random
from typing import Any


def _key(prompt: Any) -> str:
    """A hashable form of a prompt: the string itself, or a message list as canonical JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def split_held_out(
    records: list[dict[str, Any]], size: int, *, seed: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, held_out)``: ``size`` distinct prompts drawn with ``seed``, and every row whose prompt is not one.

    The held-out list has one row per distinct prompt (the first row that has it); the training list keeps the
    remaining rows in their order, so the sampling stream stays deterministic.

    Raises:
        ValueError: ``size`` is negative, or not smaller than the number of distinct prompts (nothing would be
            left to train on); the message gives the number and the fix.
    """
    if size < 0:
        raise ValueError(f"data.val_size must be >= 0, got {size}")
    if size == 0:
        return records, []
    first_row: dict[str, dict[str, Any]] = {}
    for record in records:
        first_row.setdefault(_key(record["prompt"]), record)
    distinct = list(first_row)
    if size >= len(distinct):
        raise ValueError(
            f"data.val_size: {size} held-out prompts requested, but the source has only {len(distinct)} distinct "
            f"prompts; lower val_size, raise num_prompts or difficulty, or give data.val_source"
        )
    held = set(random.Random(seed).sample(distinct, size))
    train = [r for r in records if _key(r["prompt"]) not in held]
    held_out = [first_row[p] for p in distinct if p in held]
    return train, held_out
