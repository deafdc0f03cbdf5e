"""What a method's step generates, as the memory tools and held-out evaluation read it: :class:`RolloutShape`.

Every method answers ``rollout_shape()`` (:meth:`lit_rl.methods.RLMethod.rollout_shape`), whatever its options
are called, so the estimator, the MemoryProfiler's per-step predictions and held-out evaluation never read a
method's hyper-parameters by name. The memory tools read it through :func:`rollout_shape`, which asks the object
without importing the methods (the memory layer sits below them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutShape:
    """How many completions a step generates per prompt, and how long they may grow.

    Args:
        completions_per_prompt: sequences the step builds from each prompt (GRPO's group size; 1 for a method
            that generates one completion per prompt or none). The estimator reports ``prompts x this`` as the
            step's batch and sizes the method's component table with it.
        max_new_tokens: the most tokens a completion may have (0: the method generates nothing). The estimator's
            upper bound lets every completion reach it; held-out evaluation generates this many tokens unless
            ``evaluation.max_new_tokens`` says otherwise.
        length_option: the constructor argument that sets ``max_new_tokens``. The MemoryProfiler rebuilds the
            method with it set to the length a measured step really generated (``step_shape["new_tokens"]``)
            to predict that step; ``None``: the length is fixed and every step is predicted at
            ``max_new_tokens``.
    """

    completions_per_prompt: int = 1
    max_new_tokens: int = 0
    length_option: str | None = None

    def __post_init__(self) -> None:
        if self.completions_per_prompt < 1 or self.max_new_tokens < 0:
            raise ValueError(
                f"RolloutShape: completions_per_prompt must be >= 1 and max_new_tokens >= 0, got "
                f"{self.completions_per_prompt} and {self.max_new_tokens}"
            )


def rollout_shape(method) -> RolloutShape:
    """``method.rollout_shape()``, or the shape of a step that generates nothing when the object has no such hook."""
    hook = getattr(method, "rollout_shape", None)
    return hook() if callable(hook) else RolloutShape()
