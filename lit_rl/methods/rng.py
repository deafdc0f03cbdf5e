"""The random generators' states a resumed run restores, as tensors and plain values (``weights_only`` loads them).

A resumed run draws the same completions as the uninterrupted one only if every generator is where it
was: torch's (one stream per process under DDP, since each process samples its own completions), CUDA's,
numpy's and Python's. :class:`~lit_rl.methods.base.RLMethod` saves them in its checkpoint and restores
them right before the first resumed step.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import torch


def rng_states(module: L.LightningModule) -> dict[str, Any]:
    """This process's generator states; under DDP the torch and CUDA ones of every process (a collective)."""
    world_size = module.trainer.world_size if module._trainer is not None else 1
    torch_state = torch.get_rng_state()  # [S] uint8
    cuda_state = torch.cuda.get_rng_state() if module.device.type == "cuda" else None
    if world_size > 1:  # every process samples its own completions: keep each one's stream
        torch_state = module.all_gather(torch_state.to(module.device)).cpu()  # [W, S]
        if cuda_state is not None:
            cuda_state = module.all_gather(cuda_state.to(module.device)).cpu()  # [W, S']
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "world_size": world_size,
        "torch": torch_state,
        "cuda": cuda_state,
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": random.getstate(),
    }


def set_rng_states(module: L.LightningModule, state: dict[str, Any]) -> None:
    """Restore :func:`rng_states`; process ``r`` takes row ``r`` of a per-process state (``r mod W`` if ``W`` changed)."""
    rank = module.global_rank if module._trainer is not None else 0
    per_process = int(state.get("world_size", 1)) > 1

    def own(tensor: torch.Tensor) -> torch.Tensor:
        # a copy: torch.set_rng_state crashes the process (segmentation fault) on a row view past the first
        return (tensor[rank % tensor.shape[0]] if per_process else tensor).to(torch.uint8).cpu().clone()

    torch.set_rng_state(own(state["torch"]))
    if state.get("cuda") is not None and module.device.type == "cuda":
        torch.cuda.set_rng_state(own(state["cuda"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
