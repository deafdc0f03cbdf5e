"""Activation checkpointing of a transformers model, as the callback and the estimator both turn it on."""

from __future__ import annotations

from transformers import PreTrainedModel

from lit_rl.models.head import base_model


def checkpointing_refused(method) -> str | None:
    """Why ``method``'s step cannot run with checkpointed decoder layers (its ``layer_checkpointing_refused``, a
    sentence ending in the fix), or ``None`` when it can: what the callback, the estimator and the planner ask."""
    return getattr(method, "layer_checkpointing_refused", None) or None


def own_recomputation(method) -> dict:
    """The hyper-parameters that turn on ``method``'s own recomputation (its ``recomputation_settings``, e.g.
    GumbelTopK's ``{"checkpoint_steps": True}``), or ``{}``: the planner's tactic for a method that refuses
    checkpointed layers but recomputes in its own way."""
    return dict(getattr(method, "recomputation_settings", None) or {})


def enable_activation_checkpointing(model, every_n_layers: int = 1, offload: bool = False) -> int:
    """Turn on transformers' non-reentrant activation checkpointing; returns the number of checkpointed modules.

    With frozen parameters (LoRA) the embedding output is made to require grad, so gradients reach the
    adapters through checkpointed layers whose inputs would otherwise be constant.

    Raises:
        ValueError: if the architecture does not support it, or ``every_n_layers``/``offload`` need a newer
            transformers; the message names the fix.
    """
    base = base_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(base).__name__} does not support activation checkpointing (it is not a transformers "
            "PreTrainedModel, or its architecture sets `supports_gradient_checkpointing = False`); remove the "
            "callback or use a supported model"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5
        base.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers, offload=offload
        )
    elif every_n_layers == 1 and not offload:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(
            "`every_n_layers` and `offload` need transformers 5 (`activation_checkpointing_enable`); upgrade "
            "transformers or use the defaults"
        )
    if any(not p.requires_grad for p in base.parameters()) and not getattr(base, "_require_grads_hooks", None):
        base.enable_input_require_grads()
    # the decoder's own flag (``model.model.gradient_checkpointing``, which transformers 5 sets too) is not a layer
    return sum(1 for m in base.modules() if getattr(m, "gradient_checkpointing", False)
               and not isinstance(m, PreTrainedModel))  # fmt: skip
