"""The progress bar of a run bounded by steps: the ``max_steps`` bound instead of Lightning's ``Epoch 0/-2``."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, described by optimizer steps when the run is bounded by ``max_steps``.

    Lightning names the bar ``Epoch {e}/{max_epochs - 1}``; a run bounded by ``max_steps`` has ``max_epochs = -1``,
    so every lit-rl run drew ``Epoch 0/-2``. This bar reads ``epoch 0, max_steps 60`` instead; a run bounded by
    epochs keeps Lightning's wording. ``lit-rl fit`` uses it in place of Lightning's default rich bar when the config
    names no progress bar of its own.

    Logged Metrics: none.

    Example::

        trainer:
          callbacks:
            - class_path: lit_rl.callbacks.StepProgressBar
    """

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        if (trainer.max_epochs is not None and trainer.max_epochs >= 0) or trainer.max_steps < 0:
            return super()._get_train_description(current_epoch)
        # Lightning sets the description once per epoch, so it names the bound rather than a running count
        description = f"epoch {current_epoch}, max_steps {trainer.max_steps}"
        return f"{description:{len(self.validation_description)}}"
