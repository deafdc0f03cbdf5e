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
token. When the gathered model fits (``rollout_gather: auto``, the default), every unit is gathered once for the
whole rollout and sharded after; otherwise layer by layer, as FSDP does; the run says which.

**Gradients** are averaged over ranks, as DDP does. On gloo the average is done as a sum and a division
(``set_force_sum_reduction_for_comms``): torch's gloo reduce-scatter computed AVG wrongly in some releases
(pytorch/pytorch#162338); tests/test_fsdp2.py compares every gradient with one process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from lit_rl.models.decode import weights_are_real
from lit_rl.models.head import ADOPTED, base_model, beside_the_way, trunk
from lit_rl.models.notices import say_once

ROLLOUT_GATHER = ("auto", "whole", "layers")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of the classes its ``_no_split_modules`` names, outermost first."""
    hf = base_model(model)
    names = set(getattr(hf, "_no_split_modules", None) or [])
    layers, inside = [], set()
    for module in hf.modules():
        # by class name up the MRO: fully_shard gives a unit a subclass of its own (FSDPLlamaDecoderLayer)
        if any(c.__name__ in names for c in type(module).__mro__) and id(module) not in inside:
            layers.append(module)
            inside.update(id(m) for m in module.modules())
    return layers


def beside_trunk(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules with parameters that are neither in the trunk nor above it (the LM head, a score head)."""
    hf = base_model(model)
    return beside_the_way(hf, trunk(hf)) or []


def is_sharded(model: torch.nn.Module | None) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return model is not None and isinstance(trunk(base_model(model)), FSDPModule)


def shard_model(
    model: torch.nn.Module, mesh, *, offload: bool = False, rollout_gather: str = "auto"
) -> tuple[torch.nn.Module, int]:
    """``fully_shard`` every decoder layer of ``model`` and its trunk (the root, holding the modules beside it).

    Returns the root and the number of units. ``offload``: parameters, gradients and optimizer state in host memory
    (``CPUOffloadPolicy``). ``rollout_gather``: how :func:`gathered` gathers the model for a rollout.
    """
    if rollout_gather not in ROLLOUT_GATHER:
        raise ValueError(f"rollout_gather: {rollout_gather!r} is not one of {', '.join(ROLLOUT_GATHER)}")
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
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(body, **options)
    for unit in [*layers, body]:
        unit.set_force_sum_reduction_for_comms(True)
    # a step may run the trunk many times (GumbelTopK: once per token) and read the head between, in the forward
    # and in the backward: the root stays gathered until the optimizer step (FSDP2Strategy shards it again there)
    body.set_reshard_after_backward(False, recurse=False)
    body.lit_rl_rollout_gather = rollout_gather
    return body, len(layers) + 1


def shard_models(
    method, mesh, *, offload: bool = False, rollout_gather: str = "auto"
) -> tuple[list[torch.nn.Module], int]:
    """Shard a method's ``policy`` and each of its ``frozen_modules`` (the reference copy, a reward model) with
    :func:`shard_model`; frozen models do not sample, so they gather layer by layer. Returns the roots and the
    number of units."""
    roots, units = [], 0
    for name in ("policy", *getattr(method, "frozen_modules", ())):
        model = getattr(method, name, None)
        if model is not None:
            gather = rollout_gather if name == "policy" else "layers"
            root, count = shard_model(model, mesh, offload=offload, rollout_gather=gather)
            roots.append(root)
            units += count
    return roots, units


def gathered_extra_bytes(model: torch.nn.Module) -> int:
    """Bytes a process adds to what it holds when every unit of a sharded ``model`` is gathered at once."""
    total = 0
    for p in base_model(model).parameters():
        if hasattr(p, "to_local"):  # a sharded weight: the whole minus this process's share
            total += (p.numel() - p.to_local().numel()) * p.element_size()
    return total


def _least_free_bytes(model: torch.nn.Module) -> float:
    """The free memory of the device the sharded ``model`` gathers to (host memory on a CPU), the least over its
    processes: every process must choose the same way to gather, or their collectives would not match."""
    import torch.distributed as dist

    mesh = next(p.device_mesh for p in base_model(model).parameters() if hasattr(p, "device_mesh"))
    if mesh.device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        free = torch.cuda.mem_get_info(device)[0]
    else:
        device = torch.device("cpu")
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    least = torch.tensor([float(free)], dtype=torch.float64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=mesh.get_group())
    return float(least)


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """A sharded ``model``'s units gathered for the block (the rollout), as ``shard_model``'s ``rollout_gather`` says.

    ``whole``: every unit gathered once, and sharded again after the block (a decode loop runs one forward per
    token, which would otherwise gather every layer once per token). ``layers``: FSDP's own rule, each layer
    gathered for its forward (less memory: one layer at a time). ``auto``: ``whole`` when the gathered weights take
    at most half of the device's free memory (host memory on a CPU; the least over the processes), else ``layers``;
    said once. On the estimate's
    fake tensors ``auto`` is ``whole``, the upper bound. No effect on a model that is not sharded.
    """
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    root = trunk(base_model(model))
    mode = getattr(root, "lit_rl_rollout_gather", "auto")
    if mode == "auto":
        extra = gathered_extra_bytes(model)
        real = weights_are_real(model)
        mode = "whole" if not real or extra <= _least_free_bytes(model) / 2 else "layers"
        if real:  # an estimate predicts whole, the upper bound, and says so in its own table
            say_once(
                f"FSDP2 rollout: the policy is gathered {'once, whole' if mode == 'whole' else 'layer by layer'} "
                f"({extra / 2**30:.2f} GiB more per process when whole; strategy rollout_gather: auto)"
            )
    if mode == "layers":
        yield
        return
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    layers = [m for m in units if m is not root]  # the root keeps its own rule (gathered until the optimizer step)
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
