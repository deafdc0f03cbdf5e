"""The optimizer a method trains with, from the run's ``--optimizer`` (a class path and its options).

Every method steps one optimizer over the policy's trainable parameters. Without ``--optimizer`` it is fused
AdamW; with it, any ``torch.optim.Optimizer`` subclass, chosen as in any LightningCLI program::

    lit-rl fit --config configs/grpo.yaml --optimizer bitsandbytes.optim.AdamW8bit
    # or in YAML:  optimizer: {class_path: bitsandbytes.optim.AdamW8bit, init_args: {betas: [0.9, 0.95]}}

The learning rate and weight decay stay the method's (``model.init_args.learning_rate`` / ``weight_decay``), so a
swapped optimizer never falls back to its class's default learning rate; the CLI does not offer ``optimizer.lr``.

What the state costs per trained weight (``lit-rl estimate`` runs the optimizer's own first step on fake tensors,
so it charges each optimizer's real state bytes; ``bench/bench_optimizer.py`` measures them with step time and the
update's drift from fp32 AdamW, ``bench/results/optimizer.md``): AdamW keeps two fp32 moments (8 bytes);
bitsandbytes' ``AdamW8bit`` two 8-bit moments with one fp32 scale per 256 values (tensors under
``min_8bit_size`` = 4096 values keep fp32 moments), blockwise dynamic quantization (Dettmers et al., "8-bit
Optimizers via Block-wise Quantization", arXiv 2110.02861).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any

import torch

#: the method options that the optimizer's own arguments of the same meaning take their values from
METHOD_OPTIONS = {"lr": "learning_rate", "weight_decay": "weight_decay"}


def optimizer_class(class_path: str) -> type[torch.optim.Optimizer]:
    """The class ``class_path`` names, which must be a ``torch.optim.Optimizer`` subclass.

    Raises:
        ValueError: one line naming the option, what is wrong and the fix.
    """
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError) as err:
        hint = " (pip install 'lit-rl[qlora]' installs bitsandbytes)" if class_path.startswith("bitsandbytes") else ""
        raise ValueError(f"optimizer.class_path: cannot import {class_path!r} ({err}){hint}") from err
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(
            f"optimizer.class_path: {class_path!r} is not a torch.optim.Optimizer subclass; "
            "give one, e.g. torch.optim.AdamW or bitsandbytes.optim.AdamW8bit"
        )
    return cls


def build_optimizer(
    spec: dict[str, Any], params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """``spec['class_path'](params, lr=lr, weight_decay=weight_decay, **spec['init_args'])``.

    Args:
        spec: ``{"class_path": ..., "init_args": {...}}`` as LightningCLI's ``--optimizer`` gives it (the method's
            ``optimizer`` option); ``init_args`` must not set ``lr`` or ``weight_decay``.
        params: the trainable parameters.
        lr: the method's ``learning_rate``.
        weight_decay: the method's ``weight_decay``; a nonzero one needs an optimizer that takes ``weight_decay``.

    Raises:
        ValueError: one line for an unknown class, a class that is no optimizer, ``lr`` or ``weight_decay`` among
            the options, or weight decay asked of an optimizer without it.
    """
    cls = optimizer_class(spec["class_path"])
    init_args = dict(spec.get("init_args") or {})
    for key, option in METHOD_OPTIONS.items():
        if key in init_args:
            raise ValueError(
                f"optimizer.init_args.{key}: the method sets it; remove it and set model.init_args.{option} instead"
            )
    accepted = inspect.signature(cls).parameters
    if "lr" in accepted:
        init_args["lr"] = lr
    if "weight_decay" in accepted:
        init_args["weight_decay"] = weight_decay
    elif weight_decay:
        raise ValueError(
            f"model.weight_decay: {cls.__name__} has no weight decay; set model.init_args.weight_decay 0 "
            "or choose an optimizer that has one"
        )
    return cls(params, **init_args)


__all__ = ["METHOD_OPTIONS", "build_optimizer", "optimizer_class"]
