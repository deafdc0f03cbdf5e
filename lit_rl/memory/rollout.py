"""What a method's step generates and which passes it makes over it, as the memory tools read them.

Every method answers ``rollout_shape()`` (:meth:`lit_rl.methods.RLMethod.rollout_shape`: a :class:`RolloutShape`)
and ``step_work()`` (:meth:`lit_rl.methods.RLMethod.step_work`: a :class:`StepWork`), whatever its options are
called, so the estimator, the MemoryProfiler's per-step predictions, the roofline and held-out evaluation never read
a method's hyper-parameters by name. The memory tools read them through :func:`rollout_shape` and
:func:`step_work`, which ask the object without importing the methods (the memory layer sits below them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
        rows_option: the constructor argument that sets how many completions are decoded together
            (:func:`lit_rl.models.sampling.rollout_chunks`), through which the planner cuts a rollout whose KV cache
            does not fit; ``None``: the method cannot cut its rollout.
        rows_at_once: that argument's value (``None``: every completion at once).
    """

    completions_per_prompt: int = 1
    max_new_tokens: int = 0
    length_option: str | None = None
    rows_option: str | None = None
    rows_at_once: int | None = None

    def __post_init__(self) -> None:
        if self.completions_per_prompt < 1 or self.max_new_tokens < 0:
            raise ValueError(
                f"RolloutShape: completions_per_prompt must be >= 1 and max_new_tokens >= 0, got "
                f"{self.completions_per_prompt} and {self.max_new_tokens}"
            )


def _declared(method, hook: str, default):
    """``method.<hook>()``, or ``default`` when the object has no such hook."""
    found = getattr(method, hook, None)
    return found() if callable(found) else default


def rollout_shape(method) -> RolloutShape:
    """``method.rollout_shape()``, or the shape of a step that generates nothing when the object has no such hook."""
    return _declared(method, "rollout_shape", RolloutShape())


@dataclass(frozen=True)
class DifferentiableRollout:
    """A rollout the loss is differentiated through (GumbelTopK): soft tokens fed back into the policy and into a
    model that scores them, the reference advancing beside the policy on the hard tokens. Its phases are
    ``generate``, ``reward``, ``backward`` and ``optimizer`` (:mod:`lit_rl.memory.work` counts them).

    Args:
        top_k: embedding rows a soft token mixes.
        scorer: the config of the model that scores the soft completion (its ``num_hidden_layers`` the layers it
            runs), or ``None`` when no model does.
        recompute_steps: each policy step is recomputed in the backward (one more forward of it).
        grad_window: only the last this-many tokens are differentiated; ``None``: all.
    """

    top_k: int
    scorer: Any = field(default=None, compare=False)
    recompute_steps: bool = False
    grad_window: int | None = None


@dataclass(frozen=True)
class StepWork:
    """The passes a training step makes over its rollout, and the settings that size them, for the roofline.

    :mod:`lit_rl.memory.roofline` counts each phase's FLOPs and bytes from the model's shape, the step's lengths
    (:class:`RolloutShape`, the batch) and these fields; a method declares them in ``step_work()`` instead of the
    roofline reading its options. Extra per-token quantities of the chunked head (entropy, self-certainty) ride in
    a pass the step makes anyway and add no pass: the head computes every logit once per token either way.

    Args:
        reference_pass: the step runs the reference over the rollout once, without gradient (phase ``reference``).
        scoring_passes: further no-grad passes of the policy over the rollout in phase ``reference`` (old
            log-probs for several optimizer steps per rollout, or a reward computed from the policy's own
            distribution such as self-certainty); 0 for none.
        iterations: optimizer steps per rollout batch, each a ``policy_forward``, ``backward`` and ``optimizer``.
        micro_batch: completions per forward and backward; ``None``: the whole batch at once.
        share_prompt: the passes after the rollout run each group's prompt once (and the rollout prefills it once).
        adapters: only LoRA adapters train (the frozen base gets no weight gradient).
        clip: the optimizer step clips the gradient norm (one more read and write of the gradients).
        differentiable: the step's rollout is differentiated through (its own phases), or ``None``: a sampled
            rollout scored after it (the GRPO family's phases).
        rollout_dtype: a sampled rollout's matmuls and weights in this dtype (``bfloat16``: a lower-precision sampler
            of float32 weights, cast once per rollout); ``None``: the trainer's.
        rollout_merged: a sampled rollout reads LoRA merged into a copy of the weights (one matmul per layer), made
            once per rollout.
        rollout_packed: a sampled rollout's float32 linear layers read a copy of their weights packed for oneDNN,
            made once per rollout (:func:`lit_rl.models.cast_once.float32_weights_packed`).
        rollout_rows: a sampled rollout decodes at most this many completions together, in chunks that each read
            the weights at every token (:func:`lit_rl.models.sampling.rollout_chunks`); ``None``: all at once.
    """

    reference_pass: bool = False
    scoring_passes: int = 0
    iterations: int = 1
    micro_batch: int | None = None
    share_prompt: bool = False
    adapters: bool = False
    clip: bool = True
    differentiable: DifferentiableRollout | None = None
    rollout_dtype: str | None = None
    rollout_merged: bool = False
    rollout_packed: bool = False
    rollout_rows: int | None = None

    def __post_init__(self) -> None:
        if self.scoring_passes < 0 or self.iterations < 1:
            raise ValueError(
                f"StepWork: scoring_passes must be >= 0 and iterations >= 1, got {self.scoring_passes} and "
                f"{self.iterations}"
            )


def step_work(method) -> StepWork:
    """``method.step_work()``, or a single plain update with no scoring pass when the object has no such hook."""
    return _declared(method, "step_work", StepWork())
