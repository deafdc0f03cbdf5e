"""
Activation Checkpointing
========================

Recomputes each decoder layer's activations in the backward pass instead of keeping them from the forward.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override


class ActivationCheckpointing(Callback):
    r"""Turns on transformers' non-reentrant activation checkpointing for the policy before training starts.

    **Saving**: during the policy update a decoder layer normally keeps a dozen or so tensors of
    size ``batch x seq x hidden`` (or ``x intermediate``) for its backward; with checkpointing it keeps
    only its input, ``batch x seq x hidden``, and recomputes the rest one layer at a time in the backward.
    For a Qwen2.5-3B-shaped policy (36 layers, hidden 2048) at batch 2 x 512 tokens in bf16 the kept
    inputs are 36 x 1024 x 2048 x 2 B = 0.15 GB, against gigabytes of saved activations without it.
    Rollout and reference passes run without grad and are unaffected.

    **Cost**: one extra forward of every checkpointed layer in the backward, ~30% more compute for
    the policy update (``every_n_layers = 2`` halves both the saving and the cost).
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
            If ``every_n_layers < 1``, the attribute is missing, or the model does not support activation
            checkpointing (not a transformers model, or an architecture without checkpointing support).

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
        if stage == "fit" and getattr(pl_module, self.attribute, None) is not None:
            self._enable(trainer, pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enable(trainer, pl_module)

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
        if not getattr(base, "supports_gradient_checkpointing", False):
            raise MisconfigurationException(
                f"ActivationCheckpointing: {type(base).__name__} does not support activation checkpointing "
                "(it is not a transformers PreTrainedModel, or its architecture sets "
                "`supports_gradient_checkpointing = False`); remove the callback or use a supported model."
            )
        self._call_enable(base, offload)
        if any(not p.requires_grad for p in base.parameters()) and not getattr(base, "_require_grads_hooks", None):
            # frozen embeddings (LoRA): without this the checkpointed layers see inputs that need no grad
            base.enable_input_require_grads()
        self._enabled_on = id(model)
        layers = sum(1 for m in base.modules() if getattr(m, "gradient_checkpointing", False))
        rank_zero_info(
            f"ActivationCheckpointing: {layers} module(s) of {type(base).__name__} checkpointed "
            f"(every_n_layers={self.every_n_layers}, offload={offload})."
        )

    def _call_enable(self, base: Any, offload: bool) -> None:
        kwargs = {"use_reentrant": False}
        try:
            if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5
                base.activation_checkpointing_enable(
                    activation_checkpointing_kwargs=kwargs, every_n_layers=self.every_n_layers, offload=offload
                )
            elif self.every_n_layers == 1 and not offload:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            else:
                raise MisconfigurationException(
                    "ActivationCheckpointing: `every_n_layers` and `offload` need transformers 5 "
                    "(`activation_checkpointing_enable`); upgrade transformers or use the defaults."
                )
        except ValueError as err:  # transformers' "is not compatible with gradient checkpointing"
            raise MisconfigurationException(f"ActivationCheckpointing: {err}") from err
