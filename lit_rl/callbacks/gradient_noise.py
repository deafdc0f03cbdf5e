"""
Gradient Noise
==============

How noisy a method's gradient estimate is: the same prompt batch, the same weights, the step's gradient drawn again
under other random states.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from typing_extensions import override


class GradientNoise(Callback):
    r"""Before chosen training steps, the method's gradient for that step's prompts drawn ``samples`` times.

    Each draw runs the method's own ``train_step`` on the batch the step is about to train on, from the same
    weights, under its own seed: new completions for GRPO and Intuitor, new Gumbel noise for GumbelTopK. The
    optimizer step is intercepted (nothing is updated, AdamW keeps no state) and gradient clipping is off, so
    each draw is the method's unclipped gradient estimate :math:`g_k`. Afterwards the random state is restored,
    so the run trains exactly as it would have without the callback; only the time is spent twice.

    The GRADE paper (arXiv 2601.11574) argues that differentiable rollouts train better than policy gradients
    because their gradient estimate varies less; these are that comparison's figures, scale-free so that methods
    with differently scaled losses compare:

    - ``grad/relative_variance``: :math:`\frac{1}{K-1}\sum_k \lVert g_k - \bar g\rVert^2 / \lVert \bar g\rVert^2`,
      the variance of one draw relative to the squared norm of the mean (lower: less noise per step). The mean
      keeps :math:`1/K` of the noise's squared norm, so where the draws share no direction it approaches ``K``;
    - ``grad/agreement``: the mean inner product of two different draws over their mean squared norm,
      :math:`\frac{\lVert\sum_k g_k\rVert^2 - \sum_k\lVert g_k\rVert^2}{(K-1)\sum_k \lVert g_k\rVert^2}` (1: every
      draw the same; 0: unrelated directions): with :math:`\mu` the expected gradient and :math:`\Sigma` the
      draws' covariance, an estimate of :math:`\lVert\mu\rVert^2 / (\lVert\mu\rVert^2 + \operatorname{tr}\Sigma)`,
      the share of a draw's squared norm that is signal;
    - ``grad/mean_norm``: :math:`\lVert\bar g\rVert`.

    Where every draw is zero (all rewards of the batch equal and no KL yet, say), the two ratios are ``nan`` and
    the norm 0.

    Memory: one running sum of the trainable parameters' gradients in float32 besides the step's own.

    Args:
        samples: draws per measured step (at least 2).
        every_n_steps: measure at global steps 0, n, 2n, ...; 0 measures the first step only.
        seed: the draws use seeds ``seed``, ``seed + 1``, ...

    Example::

        lit-rl fit --config configs/gumbel_topk.yaml --config callbacks/gradient_noise.yaml
    """

    def __init__(self, samples: int = 8, every_n_steps: int = 0, seed: int = 1234) -> None:
        if samples < 2:
            raise ValueError(f"GradientNoise.samples: must be >= 2 (a variance needs two draws), got {samples}")
        if every_n_steps < 0:
            raise ValueError(f"GradientNoise.every_n_steps: must be >= 0 (0: the first step only), got {every_n_steps}")
        self.samples, self.every_n_steps, self.seed = samples, every_n_steps, seed
        self.last: dict[str, float] | None = None

    def _due(self, step: int) -> bool:
        return step == 0 if self.every_n_steps == 0 else step % self.every_n_steps == 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if not self._due(trainer.global_step):
            return
        self.last = measure(pl_module, batch, self.samples, self.seed)
        if trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics(self.last, step=trainer.global_step)


def measure(method, batch: dict[str, Any], samples: int, seed: int) -> dict[str, float]:
    """The figures of :class:`GradientNoise` for ``method`` (an ``RLMethod``) on ``batch``; nothing is trained."""
    params = [p for p in method.parameters() if p.requires_grad]
    optimizer = method.optimizer()
    total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    squares: list[float] = []

    def capture(*args: Any, **kwargs: Any) -> None:  # the optimizer step: read the gradient, update nothing
        norm2 = 0.0
        for p, t in zip(params, total):
            if p.grad is not None:
                g = p.grad.float()
                t.add_(g)
                norm2 += float(g.double().pow(2).sum())
        squares.append(norm2)

    cpu_state = torch.random.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    max_norm, was_training = method.hparams.max_grad_norm, method.training
    optimizer.step = capture  # an instance attribute: the class's step stays as it was
    method.hparams.max_grad_norm = 0.0
    try:
        for k in range(samples):
            torch.manual_seed(seed + k)
            method.train_step(batch)
    finally:
        del optimizer.step
        method.hparams.max_grad_norm = max_norm
        method.train(was_training)
        method.phases.pop_times()  # the draws' phase times are not the step's
        torch.random.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)
    if len(squares) < samples:  # a skipped (non-finite) step never reached the optimizer
        raise RuntimeError(f"GradientNoise: {samples - len(squares)} of {samples} draws had a non-finite gradient")
    k = len(squares)
    sum_sq = float(sum(float(t.double().pow(2).sum()) for t in total))  # ||sum g_k||^2
    mean_sq = sum_sq / k**2  # ||mean g||^2
    spread = (sum(squares) - k * mean_sq) / (k - 1)  # (1/(K-1)) sum ||g_k - mean||^2
    if sum(squares) == 0:  # every draw is zero (a batch whose rewards are all equal, say): no direction to compare
        return {"grad/relative_variance": float("nan"), "grad/agreement": float("nan"), "grad/mean_norm": 0.0}
    return {
        "grad/relative_variance": spread / mean_sq if mean_sq > 0 else float("inf"),
        "grad/agreement": (sum_sq - sum(squares)) / ((k - 1) * sum(squares)),
        "grad/mean_norm": mean_sq**0.5,
    }


__all__ = ["GradientNoise", "measure"]
