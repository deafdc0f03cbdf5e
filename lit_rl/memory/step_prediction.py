"""Predictions for the steps a run actually takes: the estimator at each step's own shapes, one run per shape.

``lit-rl estimate`` answers "will it fit?" before a run, so it pads every prompt to ``data.max_prompt_length``
and lets every completion run to ``max_new_tokens``: an upper bound. A measured step is usually smaller (the
batch is padded to its longest prompt; generation stops when every completion has emitted EOS), so comparing
it with the upper bound says little about the estimator. The profiler therefore asks for a prediction at the
measured step's shapes: the batch's prompt count and padded prompt length, whether it is padded at all, and the
completion length the step really generated (what the method reports in ``step_shape["new_tokens"]``, set
through the constructor argument its ``rollout_shape().length_option`` names; ``max_new_tokens`` when it reports
nothing or has no such option). Shapes repeat (the arithmetic prompts have one or two lengths, completions at
most ``max_new_tokens``), so each distinct shape is estimated once on fake tensors and cached.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from lit_rl.memory.estimate import estimate_for_trainer
from lit_rl.memory.rollout import rollout_shape


@dataclass(frozen=True)
class StepShape:
    """What sets the size of a step's tensors."""

    batch_size: int  # prompts
    prompt_length: int  # the batch's padded width
    padded: bool  # some prompt is shorter than the width (the attention mask is built)
    new_tokens: int | None  # the longest completion of the step; None: the method's max_new_tokens


def step_shape(batch: Any, module) -> StepShape | None:
    """The shape of a collated prompt batch and of what the module last generated; ``None`` for other batches."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        return None
    mask = batch.get("attention_mask")
    b, p = batch["input_ids"].shape[:2]
    padded = bool((mask == 0).any()) if isinstance(mask, torch.Tensor) else b > 1
    reported = getattr(module, "step_shape", None) or {}
    new_tokens = reported.get("new_tokens")
    return StepShape(int(b), int(p), padded, None if new_tokens is None else int(new_tokens))


class StepPredictor:
    """Per-phase predictions (bytes) for :class:`StepShape`\\ s, estimated once per distinct shape.

    Each estimate runs the method's step on fake tensors on the CPU: about a second for a small model, but 17-55 s for
    a 0.5-1.5B one (``bench/results/gpu.log``), longer than the GPU steps it predicts. A run whose completion lengths
    vary has many shapes, so new shapes are predicted only while the estimates' seconds stay within ``budget`` of the
    wall time since the predictor started; a shape past it is measured but not predicted (``skipped`` counts them).
    The first shape is always predicted.

    Args:
        trainer: the run's Trainer (precision, callbacks' tactics, device type come from it).
        module: the method being trained (copied by the estimator, never changed).
        budget: the share of the run's wall time the estimates may take.
    """

    def __init__(self, trainer, module, budget: float = 0.1) -> None:
        self.trainer, self.module = trainer, module
        self.cache: dict[StepShape, tuple[dict[str, int], dict[str, int]]] = {}  # (steady, first step)
        self.seconds = 0.0
        self.budget = budget
        self.skipped = 0  # measured steps of a new shape left unpredicted (over budget)
        self._started = time.perf_counter()

    def predict(self, shape: StepShape, *, optimizer_state: bool = True) -> dict[str, int]:
        """Per-phase peaks of a step of ``shape``; ``optimizer_state=False`` for a step that starts without
        AdamW state (the first step of a fresh run: the state appears inside its ``optimizer.step()``). ``{}`` for a
        new shape past the budget."""
        if shape not in self.cache and self.cache:
            if self.seconds > self.budget * (time.perf_counter() - self._started):
                self.skipped += 1
                return {}
        if shape not in self.cache:
            overrides: dict[str, Any] = dict(
                batch_size=shape.batch_size, prompt_length=shape.prompt_length, padded=shape.padded
            )
            option = rollout_shape(self.module).length_option  # the method's own name for its completion length
            if shape.new_tokens is not None and option is not None:
                overrides[option] = max(shape.new_tokens, 1)
            start = time.perf_counter()
            # the estimate builds and runs a copy of the method on fake tensors: the run's random streams stay untouched
            with torch.random.fork_rng(devices=[]):
                estimate = estimate_for_trainer(self.trainer, self.module, **overrides)
            self.cache[shape] = (dict(estimate.phases), dict(estimate.first_step))
            self.seconds += time.perf_counter() - start
        steady, first = self.cache[shape]
        return steady if optimizer_state else first
