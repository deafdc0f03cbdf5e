"""Micro-batches by token budget for a rollout whose completion lengths are known: ``micro_batch_tokens``.

A rollout is ``B = prompts x G`` rows, each group of ``G`` consecutive rows the completions of one prompt
(which the shared-prompt passes rely on). With a token budget the groups are reordered longest first, so that
the base's :meth:`~lit_rl.methods.base.RLMethod.micro_batches` packs rows of similar length together, and each
micro-batch's pass is cut to its own longest completion: the columns after it are padding in every row, and
under causal attention no earlier position reads them, so the cut changes no value. Without a budget nothing
is reordered or cut.

verl packs the policy update by tokens (``ppo_max_token_len_per_gpu``) and TRL's asynchronous trainer bounds a
batch by a ``token_budget``; this is the same bound for a padded batch: ``rows x longest row <= budget``.
"""

from __future__ import annotations

import torch

from lit_rl.memory.fake import is_fake
from lit_rl.memory.rollout import RolloutShape


def budget_slices(lengths: list[int], size: int, budget: int) -> list[slice]:
    """Consecutive slices of the rows, each of at most ``size`` rows and ``rows x its longest row <= budget``
    tokens; a row longer than the budget is a slice of its own."""
    slices, start, n = [], 0, len(lengths)
    while start < n:
        stop, longest = start + 1, lengths[start]
        while stop < n and stop - start < size and (stop - start + 1) * max(longest, lengths[stop]) <= budget:
            longest = max(longest, lengths[stop])
            stop += 1
        slices.append(slice(start, stop))
        start = stop
    return slices


def check_budget(budget: int | None, prompt_length: int, shape: RolloutShape) -> None:
    """Refuse a budget below one prompt of ``prompt_length`` tokens plus one completion of the most new tokens.

    Raises:
        ValueError: one line with the smallest budget that holds one row.
    """
    row = prompt_length + shape.max_new_tokens
    if budget is not None and budget < row:
        length = f"model.{shape.length_option}" if shape.length_option else "the completion length"
        raise ValueError(
            f"model.micro_batch_tokens: {budget} is below one prompt plus one completion ({prompt_length} + "
            f"{shape.max_new_tokens} tokens: data.max_prompt_length + {length}); set it to at least {row}"
        )


def group_order(row_tokens: list[int], group: int) -> list[int]:
    """The row order that keeps each group's ``group`` consecutive rows together and puts the groups with the
    longest row first (ties keep their order)."""
    n = len(row_tokens)
    starts = sorted(range(0, n, group), key=lambda s: -max(row_tokens[s : s + group]))
    return [row for s in starts for row in range(s, min(s + group, n))]


def row_tokens(lengths: torch.Tensor, prompt_length: int, max_new_tokens: int) -> list[int]:
    """Prompt + completion tokens of each row (``lengths``: completion tokens up to and including EOS). On the
    estimator's fake tensors every completion is taken at ``max_new_tokens``, the longest a step can be."""
    if is_fake(lengths):
        return [prompt_length + max_new_tokens] * lengths.shape[0]
    return [prompt_length + int(n) for n in lengths.tolist()]


def reorder_rows(tensors: dict[str, torch.Tensor | list | None], order: list[int]) -> dict:
    """Every tensor (first dimension) and non-empty list in ``tensors`` in ``order``; the rest as they are."""
    index = torch.tensor(order)
    out = {}
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor):
            out[name] = value.index_select(0, index.to(value.device))
        elif isinstance(value, list) and value:  # an empty list (no texts kept) stays empty
            out[name] = [value[i] for i in order]
        else:
            out[name] = value
    return out


__all__ = ["budget_slices", "check_budget", "group_order", "reorder_rows", "row_tokens"]
