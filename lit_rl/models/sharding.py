"""FSDP2 (torch's ``fully_shard``) for the models a method runs, as :class:`lit_rl.strategies.FSDP2Strategy` applies it.

**The units.** Each decoder layer (a class the model names in ``_no_split_modules``, as accelerate and TRL wrap) is
its own unit: its weights are gathered for its forward and backward and sharded again after. The trunk (the module
that owns the input embedding, :func:`lit_rl.models.head.trunk`) is the root unit and holds everything else: the
embedding, the final norm and, adopted as an extra child of the trunk, whatever the model keeps beside the trunk
(the LM head, a reward model's score head, a pre-head transform). The trunk's forward is the first to run in every
pass, so it is FSDP's root, and its weights stay gathered from its first forward of a step until the optimizer
step (not only until its backward, FSDP's rule for a root: GumbelTopK runs the trunk once per token).

That is what the logits-free ops need: they read the head's weight outside any module's forward
(:func:`lit_rl.models.head.head_spec`), in chunks, and again in the backward. With the head in the root unit the
weight they read is the gathered one for the whole pass, its gradient lands where FSDP reduce-scatters it, and a
head tied to the embedding stays one parameter (both modules are in the unit). Cost per rank: the root's weights
(embedding, head, norm) stay gathered from the first forward of a step to its optimizer step.

**The rollout** (:func:`gathered`): decoding runs one forward per token, which would gather every layer once per
token. While the gathered model fits, every unit is gathered once for the whole rollout and sharded after.

**Gradients** are averaged over ranks, as DDP does. On gloo the average is done as a sum and a division
(``set_force_sum_reduction_for_comms``): torch's gloo reduce-scatter computed AVG wrongly in some releases
(pytorch/pytorch#162338); tests/test_fsdp2.py compares every gradient with one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from lit_rl.models.head import ADOPTED, base_model, trunk


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of the classes its ``_no_split_modules`` names, outermost first."""
    hf = base_model(model)
    names = set(getattr(hf, "_no_split_modules", None) or [])
    layers, inside = [], set()
    for module in hf.modules():
        if type(module).__name__ in names and id(module) not in inside:
            layers.append(module)
            inside.update(id(m) for m in module.modules())
    return layers


def beside_trunk(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules with parameters that are neither in the trunk nor above it (the LM head, a score head)."""
    hf = base_model(model)
    body = trunk(hf)
    found, parent = [], hf
    while parent is not body:
        onward = None
        for child in parent.children():
            if any(m is body for m in child.modules()):
                onward = child
            elif any(True for _ in child.parameters()):
                found.append(child)
        if onward is None:
            break
        parent = onward
    return found


def is_sharded(model: torch.nn.Module | None) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return model is not None and isinstance(trunk(base_model(model)), FSDPModule)


def shard_model(
    model: torch.nn.Module, mesh, *, offload: bool = False, mixed_precision=None
) -> tuple[torch.nn.Module, int]:
    """``fully_shard`` every decoder layer of ``model`` and its trunk (the root, holding the modules beside it).

    Returns the root and the number of units. ``offload``: parameters, gradients and optimizer state in host memory
    (``CPUOffloadPolicy``). ``mixed_precision``: a ``MixedPrecisionPolicy`` or ``None``.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    hf = base_model(model)
    layers = decoder_layers(hf)
    if not layers:
        names = getattr(hf, "_no_split_modules", None)
        raise ValueError(
            f"{type(hf).__name__}: no decoder layers to shard (its _no_split_modules is {names!r}); "
            "lit-rl shards models that name their layer class there, as transformers' causal LMs do"
        )
    body = trunk(hf)
    extra = beside_trunk(hf)
    if extra:
        body.add_module(ADOPTED, torch.nn.ModuleList(extra))  # still hf's children too: one module, two names
    options = {"mesh": mesh, "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
    if mixed_precision is not None:
        options["mp_policy"] = mixed_precision
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(body, **options)
    for unit in [*layers, body]:
        unit.set_force_sum_reduction_for_comms(True)
    # a step may run the trunk many times (GumbelTopK: once per token) and read the head between, in the forward
    # and in the backward: the root stays gathered until the optimizer step (FSDP2Strategy shards it again there)
    body.set_reshard_after_backward(False, recurse=False)
    return body, len(layers) + 1


def state_key_aliases(model: torch.nn.Module, prefix: str = "") -> set[str]:
    """State-dict keys under the trunk's adopted child: second names of modules the model already names."""
    return {key for key in base_model(model).state_dict(prefix=prefix) if f".{ADOPTED}." in key}


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Every unit of a sharded ``model`` gathered once for the block (the rollout), and sharded again after.

    No effect on a model that is not sharded.
    """
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    root = trunk(base_model(model))
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    layers = [m for m in units if m is not root]  # the root keeps FSDP's own rule (gathered until its backward)
    for unit in units:
        unit.unshard()
    for layer in layers:
        layer.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for layer in layers:
            layer.set_reshard_after_forward(True, recurse=False)
        for unit in units:
            unit.reshard()
