"""What a step calls for backward, clipping, the optimizer and reductions, with or without a Trainer.

Under a Trainer these are Lightning's (``manual_backward`` with its precision plugin, ``clip_gradients``, the
strategy's all-reduce); without one (the estimator runs the method's own step on fake tensors, see
:mod:`lit_rl.memory.estimate`) they fall back to plain torch in one process. Mixed into
:class:`~lit_rl.methods.base.RLMethod`, so a method's step never needs to ask which case it is in.
"""

from __future__ import annotations

import torch


class StandaloneStep:
    """Backward, clipping, optimizer and reductions under a Trainer and without one (a LightningModule mixin)."""

    _standalone_optimizer: torch.optim.Optimizer | None = None

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer a step uses when it runs without a Trainer."""
        self._standalone_optimizer = optimizer

    def optimizer(self) -> torch.optim.Optimizer:
        """The Trainer's optimizer, or the attached one without a Trainer."""
        if self._trainer is None:
            if self._standalone_optimizer is None:
                raise RuntimeError("a step without a Trainer needs attach_optimizer(configure_optimizers()) first")
            return self._standalone_optimizer
        return self.optimizers()

    def backward_loss(self, loss: torch.Tensor) -> None:
        """``manual_backward`` under a Trainer (precision plugin, DDP), ``loss.backward()`` without one."""
        if self._trainer is None:
            loss.backward()
        else:
            self.manual_backward(loss)

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: float) -> None:
        """Clip the gradients by global norm (Lightning's ``clip_gradients`` under a Trainer)."""
        if self._trainer is None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            self.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over processes (DDP); the value itself in one process or without a Trainer."""
        return value if self._trainer is None else self.trainer.strategy.reduce(value, reduce_op="sum")

    def gather_ragged(self, values: torch.Tensor) -> torch.Tensor:
        """Every process's 1-D ``values`` (of unequal lengths) concatenated in rank order; ``values`` in one process.

        Two collectives under DDP: the lengths, then the values padded to the longest.
        """
        if self.world_size == 1:
            return values
        lengths = self.all_gather(torch.tensor([values.numel()], device=values.device)).view(-1)  # [W]
        longest = int(lengths.max())
        padded = torch.zeros(longest, dtype=values.dtype, device=values.device)  # [longest]
        padded[: values.numel()] = values
        gathered = self.all_gather(padded).view(-1, longest)  # [W, longest]
        return torch.cat([row[:n] for row, n in zip(gathered, lengths.tolist(), strict=True)])

    @property
    def world_size(self) -> int:
        return 1 if self._trainer is None else self.trainer.world_size

    def finite_everywhere(self, value: torch.Tensor) -> bool:
        """Whether ``value`` is finite on every process (one all-reduce of a scalar under DDP)."""
        # counts the processes where it is finite (a value read on the estimator's fake tensors is 1: finite)
        if hasattr(value, "full_tensor"):  # a norm over FSDP2's sharded gradients: the whole norm, on every rank
            value = value.full_tensor()
        finite = torch.isfinite(value).all().float()
        return self.reduce_sum(finite).item() == self.world_size

    def mean_over_processes(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric's mean over processes (DDP), in one all-reduce; the metrics themselves in one process.

        Every process logs the same keys in a step (the same method and settings), so the values line up;
        ``self.last_metrics`` keeps this process's own values.
        """
        if self.world_size == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=self.device)  # [M]
        means = (self.reduce_sum(values) / self.world_size).tolist()
        return dict(zip(keys, means))
