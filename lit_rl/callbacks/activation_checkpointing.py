"""
Activation Checkpointing
========================

Recomputes each decoder layer's activations in the backward pass instead of keeping them from the forward.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_rl.models.checkpointing import checkpointing_refused, enable_activation_checkpointing


class ActivationCheckpointing(Callback):
    r"""Turns on transformers' non-reentrant activation checkpointing for the policy before training starts.

    **Saving**: during the policy update a decoder layer normally keeps a dozen or so tensors of
    size ``batch x seq x hidden`` (or ``x intermediate``) for its backward; with checkpointing it keeps
    only its input, ``batch x seq x hidden``, and recomputes the rest one layer at a time in the backward.
    For a Qwen2.5-3B-shaped policy (36 layers, hidden 2048) at batch 2 x 512 tokens in bf16 the kept
    inputs are 36 x 1024 x 2048 x 2 B = 0.15 GB, against gigabytes of saved activations without it.
    Rollout and reference passes run without grad and are unaffected.

    **Cost**: one extra forward of every checkpointed layer in the backward, about a third more compute for
    the policy update, since a backward costs about two forwards (``every_n_layers = 2`` halves both the saving
    and the cost).
    ``offload = True`` additionally moves the kept layer inputs to pinned host memory (CUDA only):
    less GPU memory, more host memory and a host-device copy each way, so slower steps.

    The model is ``pl_module.<attribute>`` (``policy`` for the lit-rl methods): a transformers
    ``PreTrainedModel``, possibly wrapped in a peft ``PeftModel``. Checkpointing is enabled in ``setup``
    if the model already exists, otherwise in ``on_fit_start`` (after ``configure_model``), before the
    first step either way. With peft the embedding output is made to require grad, so gradients
    reach the LoRA adapters through checkpointed layers whose inputs would otherwise be constant.

    Args:
        every_n_layers: checkpoint every n-th decoder layer (1 = all of them).
        offload: keep the checkpointed layer inputs in pinned CPU memory; CUDA only (ignored, with a
            warning, when training on CPU, where activations already live in host memory).
        attribute: name of the LightningModule attribute that holds the model.

    Raises:
        MisconfigurationException:
            If ``every_n_layers < 1``, the attribute is missing, the model does not support activation
            checkpointing (not a transformers model, or an architecture without checkpointing support), or the
            method's ``layer_checkpointing_refused`` says why its step cannot run with checkpointed layers.

    Example::

        # callbacks/activation_checkpointing.yaml
        trainer:
          callbacks+:
            - class_path: lit_rl.callbacks.ActivationCheckpointing
              init_args: {every_n_layers: 1, offload: false}
    """

    def __init__(self, every_n_layers: int = 1, offload: bool = False, attribute: str = "policy") -> None:
        if every_n_layers < 1:
            raise MisconfigurationException(
                f"ActivationCheckpointing(every_n_layers={every_n_layers}): use 1 (every layer) or more."
            )
        self.every_n_layers = every_n_layers
        self.offload = offload
        self.attribute = attribute
        self._enabled_on: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            _refuse(pl_module)  # before the models are loaded and the logs begin
        if stage == "fit" and getattr(pl_module, self.attribute, None) is not None:
            self._enable(trainer, pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enable(trainer, pl_module)

    def estimate_settings(self) -> dict[str, int]:
        """What the memory estimator must apply to predict a run with this callback."""
        return {"activation_checkpointing": self.every_n_layers}

    def _enable(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = getattr(pl_module, self.attribute, None)
        if model is None:
            raise MisconfigurationException(
                f"ActivationCheckpointing: `{type(pl_module).__name__}.{self.attribute}` does not exist; set "
                "`attribute` to the name of the module attribute that holds the transformers model."
            )
        if self._enabled_on == id(model):
            return
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft PeftModel
        offload = self.offload
        if offload and trainer.strategy.root_device.type != "cuda":
            rank_zero_warn(
                f"ActivationCheckpointing(offload=True) moves activations off an accelerator; training runs on "
                f"{trainer.strategy.root_device}, so offloading is skipped."
            )
            offload = False
        try:
            layers = enable_activation_checkpointing(model, self.every_n_layers, offload)
        except ValueError as err:  # unsupported architecture, or an old transformers
            raise MisconfigurationException(f"ActivationCheckpointing: {err}") from err
        self._enabled_on = id(model)
        rank_zero_info(
            f"ActivationCheckpointing: {layers} module(s) of {type(base).__name__} checkpointed "
            f"(every_n_layers={self.every_n_layers}, offload={offload})."
        )


def _refuse(pl_module: pl.LightningModule) -> None:
    """A method whose step cannot run with checkpointed layers says why (``layer_checkpointing_refused``)."""
    refused = checkpointing_refused(pl_module)
    if refused:
        raise MisconfigurationException(
            f"ActivationCheckpointing: {type(pl_module).__name__} {refused}; leave out callbacks/activation_checkpointing.yaml"
        )
