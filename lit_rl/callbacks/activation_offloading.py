"""
Activation Offloading
=====================

Keeps the policy update's saved activations in pinned host memory between its forward and its backward.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from typing_extensions import override

from lit_rl.models.offload import OffloadSavedTensors


class ActivationOffloading(Callback):
    r"""Offloads what each update micro-batch's forward saves for its backward to pinned host memory (CUDA only).

    **Saving**: the saved activations of the update's micro-batch leave the device as the forward makes them and
    come back one by one as the backward needs them (:class:`lit_rl.models.offload.OffloadSavedTensors`), for every
    method (the hooks wrap each micro-batch's forward in :meth:`~lit_rl.methods.RLMethod.update`), with or without
    :class:`~lit_rl.callbacks.ActivationCheckpointing` (with it, only the checkpointed layers' inputs are saved, and
    those are offloaded). ``lit-rl estimate`` with this fragment counts only what stays on the device.

    **Cost**: every offloaded byte crosses the host link twice; the copies to host run on a side stream, at most
    ``max_in_flight`` at a time, and overlap the forward where the link keeps up. Host memory: the saved
    activations of one micro-batch, pinned.

    On a CPU run activations already live in host memory: the run is refused before it starts, in one line.

    Args:
        max_in_flight: copies to host outstanding before the next waits for the oldest.
        min_bytes: saved tensors smaller than this stay on the device.

    Example::

        lit-rl fit --config configs/grpo.yaml --config callbacks/activation_offloading.yaml
    """

    def __init__(self, max_in_flight: int = 5, min_bytes: int = 2**20) -> None:
        if max_in_flight < 1:
            raise ValueError(f"ActivationOffloading.max_in_flight: must be >= 1, got {max_in_flight}")
        self.max_in_flight, self.min_bytes = max_in_flight, min_bytes
        self._hooks: OffloadSavedTensors | None = None

    def check_trainer(self, trainer: pl.Trainer) -> None:
        """Refuse a run that is not on CUDA (called before the run writes anything).

        Raises:
            ValueError: one line with the reason and the fix.
        """
        device = trainer.strategy.root_device
        if device.type != "cuda":
            raise ValueError(
                f"ActivationOffloading: moves saved activations from a GPU to host memory, but this run trains on "
                f"{device.type}, where they are in host memory already; remove callbacks/activation_offloading.yaml"
            )

    def estimate_settings(self) -> dict[str, int]:
        """For the estimator: the update's saved activations of ``min_bytes`` or more do not stay on the device."""
        return {"offload_activations": self.min_bytes}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.check_trainer(trainer)
        pl_module.update_forward = lambda: self._hooks_for(pl_module)

    def _hooks_for(self, pl_module: pl.LightningModule) -> OffloadSavedTensors:
        if self._hooks is None:  # once the policy exists (configure_model runs after setup)
            self._hooks = OffloadSavedTensors(
                pl_module.policy, "pinned", max_in_flight=self.max_in_flight, min_bytes=self.min_bytes
            )
        return self._hooks
