"""Reward functions: plain callables, configured by import path, one float per completion.

A reward function is called as ``fn(completions, answers=answers, prompts=prompts)`` with lists of
equal length and returns a list (or 1-D tensor) of floats of that length. Write your own anywhere
importable and name it in the config: ``reward_funcs: [my_pkg.rewards.exact_match]``.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lit_rl.data.answers import gsm8k_final, last_boxed, reference_answer, same_answer, tagged

RewardFn = Callable[..., Sequence[float]]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _last_number(text: str) -> float | None:
    numbers = _NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def correct_answer(completions: list[str], answers: list[Any], **_: Any) -> list[float]:
    """1.0 when the last number in the completion equals the answer, else 0.0."""
    rewards = []
    for completion, answer in zip(completions, answers):
        value = _last_number(completion)
        try:
            target = float(answer)
        except (TypeError, ValueError):
            target = _last_number(str(answer))
        rewards.append(float(value is not None and target is not None and math.isclose(value, target)))
    return rewards


def number_only(completions: list[str], **_: Any) -> list[float]:
    """1.0 when the completion is just a number (what the arithmetic prompt asks for), else 0.0."""
    return [float(_NUMBER.fullmatch(c.strip().rstrip(".").replace(",", "")) is not None) for c in completions]


def gsm8k_answer(completions: list[str], answers: list[Any], **_: Any) -> list[float]:
    """1.0 when the completion's ``#### <number>`` line equals the reference's, else 0.0.

    The reference may be a whole GSM8K solution (``... #### 42``, the ``answer`` field of ``openai/gsm8k``) or the
    number alone; ``$``, thousands commas and a trailing period are dropped on both sides. No such line, or two that
    disagree, scores 0 (:func:`lit_rl.data.answers.gsm8k_final`).
    """
    return [float(same_answer(gsm8k_final(c), reference_answer(a))) for c, a in zip(completions, answers)]


def boxed_answer(completions: list[str], answers: list[Any], **_: Any) -> list[float]:
    r"""1.0 when the completion's last ``\boxed{...}`` equals the reference's final answer (MATH), else 0.0.

    The reference may be a whole MATH solution (its last box is read) or the answer itself; ``\frac{1}{2}``, ``1/2``
    and ``0.5`` agree (:func:`lit_rl.data.answers.same_answer`). No box, an empty box, or boxes that disagree score 0.
    """
    return [float(same_answer(last_boxed(c), reference_answer(a))) for c, a in zip(completions, answers)]


def tagged_answer(completions: list[str], answers: list[Any], **_: Any) -> list[float]:
    """1.0 when the completion's ``<answer>...</answer>`` equals the reference's final answer, else 0.0.

    Compared as :func:`boxed_answer` compares (a box inside the tag is unwrapped); no tag, an empty one, or two that
    disagree score 0.
    """
    return [float(same_answer(tagged(c), reference_answer(a))) for c, a in zip(completions, answers)]


_THINK_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.S)


def think_answer_format(completions: list[str], **_: Any) -> list[float]:
    """1.0 when the completion is ``<think>...</think>`` then ``<answer>...</answer>`` and nothing else, else 0.0.

    The format DeepSeek-R1 (Guo et al. 2025) asks for and TRL's GRPO examples reward: each tag once, both non-empty,
    only white space around them. Whether the answer is right is :func:`tagged_answer`'s job.
    """
    rewards = []
    for c in completions:
        match = _THINK_ANSWER.fullmatch(c)
        once = c.count("<think>") == c.count("<answer>") == 1
        rewards.append(float(bool(match and once and match.group(1).strip() and match.group(2).strip())))
    return rewards


def resolve_reward_fn(path: str, *, field: str = "reward_funcs") -> RewardFn:
    """Import ``package.module.function`` (or ``package.module:function``) and check it is callable."""
    module_name, _, attr = path.replace(":", ".").rpartition(".")
    hint = "give a dotted path to a callable, e.g. lit_rl.data.rewards.correct_answer"
    if not module_name:
        raise ValueError(f"{field}: {path!r} is not an import path; {hint}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{field}: cannot import {path!r} ({type(err).__name__}: {err}); {hint}") from err
    if not callable(fn):
        raise ValueError(f"{field}: {path!r} is a {type(fn).__name__}, not a callable; {hint}")
    return fn


def score(
    fn: RewardFn,
    name: str,
    completions: list[str],
    answers: list[Any],
    prompts: list[str],
    *,
    field: str = "model.reward_funcs",
) -> torch.Tensor:
    """Call one reward function and check what it returns: one finite float per completion.

    Args:
        field: the setting that named the function, for the messages.

    Raises:
        RuntimeError: the function raised; the message names it and the first sample.
        ValueError: not numbers, wrong length or a non-finite value; the message names the function and the sample.
    """
    try:
        out = fn(completions, answers=answers, prompts=prompts)
    except Exception as err:
        raise RuntimeError(
            f"{field}: reward function {name} raised {type(err).__name__}: {err} "
            f"(first sample: prompt={prompts[0]!r}, completion={completions[0]!r}); fix the function or remove it"
        ) from err
    # checked as Python numbers: the values come from Python, and the check must not depend on tensor values
    try:
        values = torch.as_tensor(out, dtype=torch.float64).flatten().tolist()
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"{field}: reward function {name} returned {type(out).__name__} {str(out)[:80]!r}, not numbers; "
            "return one float per completion"
        ) from err
    if len(values) != len(completions):
        raise ValueError(
            f"{field}: reward function {name} returned {len(values)} values for {len(completions)} completions; "
            "return one float per completion"
        )
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        i = bad[0]
        raise ValueError(
            f"{field}: reward function {name} returned {values[i]} for sample {i} "
            f"(prompt={prompts[i]!r}, completion={completions[i]!r}); rewards must be finite"
        )
    return torch.tensor(values, dtype=torch.float32)
