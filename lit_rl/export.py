"""``lit-rl export``: a training checkpoint as a Hugging Face folder that ``from_pretrained`` loads.

A Lightning checkpoint holds what trains (the policy's weights, or only its LoRA adapters) plus the
optimizer state and the method's hyper-parameters; it is for resuming, not for using the model. Export
rebuilds the method from those hyper-parameters (the base weights come from ``name_or_path`` as in
training; nothing else is downloaded), loads the checkpoint into it and writes:

- **merged** (default): the policy with any LoRA adapters merged into the weights (a 4-bit NF4 base is
  decoded to the training dtype first, see :func:`lit_rl.models.quantize.dequantize_base`), as a plain
  ``...ForCausalLM`` folder (``config.json``, ``model.safetensors``, ``generation_config.json``) and the
  tokenizer: ``AutoModelForCausalLM.from_pretrained(DIR)``;
- **adapter** (``--adapter``, LoRA runs only): the peft adapter folder (``adapter_config.json``,
  ``adapter_model.safetensors``, a few MiB) and the tokenizer: ``PeftModel.from_pretrained(base, DIR)``.

``lit-rl export --ckpt_path runs/grpo/lightning_logs/version_0/checkpoints/last.ckpt --out grpo-arith``
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_rl.cli_errors import OptionParser, check_checkpoint
from lit_rl.models.quantize import dequantize_base


def load_method(ckpt_path: str | Path):
    """The method a checkpoint was trained with, its models built and the checkpoint's weights loaded (eval mode).

    Raises:
        UsageError: no such file, or not a torch checkpoint (:func:`~lit_rl.cli_errors.check_checkpoint`).
        ValueError: the checkpoint does not name its method (no ``_class_path`` in its hyper-parameters).
    """
    path = Path(ckpt_path).expanduser()
    check_checkpoint(path, "--ckpt_path")
    sharded = path.is_dir()  # FSDP2Strategy's checkpoint: a folder of shards, the rest in meta.pt
    checkpoint = torch.load(path / "meta.pt" if sharded else path, map_location="cpu", weights_only=True)
    hparams: dict[str, Any] = dict(checkpoint.get("hyper_parameters", {}))
    class_path = hparams.get("_class_path")
    if not class_path:
        raise ValueError(
            f"--ckpt_path: {path} does not name the method it trained (no _class_path in its hyper-parameters); "
            "export checkpoints written by `lit-rl fit`"
        )
    module_name, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    method = cls(**{k: v for k, v in hparams.items() if not k.startswith("_")})
    method.setup("export")  # the tokenizer
    method.configure_model()  # the base weights from name_or_path (and the LoRA adapters to load into)
    if sharded:  # the trained weights, read from the shards into this one process's whole tensors
        import torch.distributed.checkpoint as dcp

        checkpoint["state_dict"] = method.state_dict()
        dcp.load({"state_dict": checkpoint["state_dict"]}, checkpoint_id=path)
    method.load_state_dict(checkpoint["state_dict"])
    method.eval()
    return method


def export(ckpt_path: str | Path, out: str | Path, *, adapter: bool = False) -> Path:
    """Write the checkpoint's policy to ``out`` as a Hugging Face folder (merged, or the LoRA adapter); returns ``out``.

    Raises:
        ValueError: ``adapter=True`` for a checkpoint without LoRA, or ``out`` exists and is not an empty folder.
    """
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out: {out} exists and is not empty; give a new folder")
    method = load_method(ckpt_path)
    policy = method.policy
    if adapter and not method.uses_lora:
        raise ValueError("--adapter: this checkpoint trained every weight (no LoRA); export it without --adapter")
    if method.uses_lora and not adapter:
        # a 4-bit base (model.quantize_base: nf4) is decoded first: the adapters were trained against the decoded
        # weights, and a plain folder needs dense ones
        policy = dequantize_base(policy).merge_and_unload()  # W + B @ A * alpha / r, a plain ...ForCausalLM
    out.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(out)
    method.tokenizer.save_pretrained(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    kind = "LoRA adapter (load with peft's PeftModel.from_pretrained)" if adapter else "merged weights"
    rank_zero_info(f"exported {kind} of {ckpt_path} to {out} ({size / 2**20:.1f} MiB)")
    return out


def main(args: list[str]) -> None:
    """``lit-rl export --ckpt_path FILE --out DIR [--adapter]``."""
    parser = OptionParser(
        prog="lit-rl export",
        description="Write a training checkpoint's policy as a Hugging Face folder: merged weights "
        "(AutoModelForCausalLM.from_pretrained) or, with --adapter, the LoRA adapter (peft).",
    )
    parser.add_argument("--ckpt_path", required=True, help="a .ckpt file (or sharded .ckpt folder) written by lit-rl fit")
    parser.add_argument("--out", required=True, help="a new folder to write")
    parser.add_argument("--adapter", action="store_true", help="LoRA runs: write the adapter only, not merged weights")
    options = parser.parse_args(args)
    export(options.ckpt_path, options.out, adapter=options.adapter)
