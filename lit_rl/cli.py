"""The ``lit-rl`` command: LightningCLI's ``fit / validate / test / predict`` plus ``estimate`` and ``embed``.

lit-rl fit --config configs/grpo.yaml
lit-rl fit --config configs/grpo.yaml --config callbacks/memory_profiler.yaml --trainer.max_steps 5
lit-rl fit --model.help RefCachedGRPO
lit-rl embed --config configs/grpo_density.yaml      # offline embedding cache for density sampling
lit-rl reward-model                                  # train the embedded arithmetic reward model (GumbelTopK)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import lightning as L
from lightning.pytorch.cli import LightningCLI

from lit_rl.memory.estimate import BUILTIN_SHAPES, Estimate, estimate_step, parse_bytes, settings_from
from lit_rl.memory.fit import fit_report
from lit_rl.methods.base import RLMethod


class LitRLCLI(LightningCLI):
    """LightningCLI with any :class:`RLMethod` as the model and any DataModule as the data (``class_path``)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)  # each method configures its own optimizer
        super().__init__(RLMethod, L.LightningDataModule, *args, **kwargs)


def _embed(args: list[str]) -> None:
    """``lit-rl embed --config X.yaml``: write the prompt-embedding cache that density sampling reuses.

    Takes the arguments of ``lit-rl fit`` (its --config files and overrides); a cache built for other
    prompts or settings is replaced.
    """
    cli = LitRLCLI(args=args, run=False)
    module, data = cli.model, cli.datamodule
    if not hasattr(data, "build_density_cache"):
        raise SystemExit(f"lit-rl embed: {type(data).__name__} writes no embedding cache; use PromptDataModule")
    if getattr(data.hparams, "density_cache_dir", None) is None:
        raise SystemExit("lit-rl embed: set data.density_cache_dir (where the embeddings are written)")
    module.setup("fit")  # loads the tokenizer
    data.connect(module.tokenizer, embed_model=module.policy_for_embedding, model_id=module.name_or_path)
    data.build_density_cache()


# ------------------------------------------------------------------------------------------------ estimate


def _option_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lit-rl estimate",
        add_help=False,
        description="Predict the per-phase peak memory (tensor bytes) of one training step without loading weights. "
        "Every other option is the fit command's (--config, --model.init_args.*, --data.init_args.*, --trainer.*).",
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    parser.add_argument(
        "--model-config",
        help="the policy's config instead of name_or_path's: a config.json (or its folder), or shape:NAME with NAME "
        f"one of {', '.join(BUILTIN_SHAPES)} (no network)",
    )
    parser.add_argument(
        "--reward-model-config",
        help="the reward model's config (methods that load one): a config.json (or its folder), or shape:NAME",
    )
    parser.add_argument("--prompt-length", type=int, help="prompt tokens (default: data.max_prompt_length)")
    parser.add_argument("--batch-size", type=int, help="prompts per step (default: data.batch_size)")
    parser.add_argument(
        "--device-memory", help="memory of the target device, e.g. 80GiB or 24GB: says whether the step fits"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="which kernels to mirror (AdamW per tensor on cpu, foreach on cuda); default: from trainer.accelerator",
    )
    parser.add_argument(
        "--padded",
        choices=("auto", "yes", "no"),
        default="auto",
        help="whether prompts are left-padded, so the [B, 1, q, kv] attention mask is built (auto: batch size > 1)",
    )
    parser.add_argument("--no-tactics", action="store_true", help="with --device-memory: do not estimate tactics")
    return parser


def parse_fit_config(args: list[str]):
    """The method, the datamodule and the trainer settings of a fit config, without building the Trainer."""

    class _NoTrainerCLI(LitRLCLI):
        def instantiate_trainer(self, **kwargs: Any):  # noqa: D102 — the estimate needs no Trainer (or a GPU)
            return None

    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when it is given args and sys.argv has some too
    try:
        cli = _NoTrainerCLI(args=args, run=False, save_config_callback=None)
    finally:
        sys.argv = argv
    trainer_config = cli.config_init.get("trainer", {}) or {}
    return cli.model, cli.datamodule, trainer_config


def estimate_from_args(args: list[str]) -> tuple[Estimate, dict[str, Any], Any]:
    """Parse ``lit-rl estimate`` arguments and estimate; returns ``(estimate, settings, module)``."""
    options, rest = _option_parser().parse_known_args(args)
    module, datamodule, trainer_config = parse_fit_config(rest)
    accelerator = str(trainer_config.get("accelerator", "auto"))
    device_type = options.device or ("cuda" if accelerator in ("gpu", "cuda") else "cpu")
    settings = settings_from(
        datamodule,
        precision=str(trainer_config.get("precision", "32-true") or "32-true"),
        callbacks=trainer_config.get("callbacks"),
        device_type=device_type,
    )
    if options.prompt_length is not None:
        settings["prompt_length"] = options.prompt_length
    if options.batch_size is not None:
        settings["batch_size"] = options.batch_size
    if "batch_size" not in settings or "prompt_length" not in settings:
        raise SystemExit(
            "lit-rl estimate: the data module has no batch_size / max_prompt_length; pass --batch-size and --prompt-length"
        )
    if options.model_config is not None:
        settings["model_config"] = options.model_config
    if options.reward_model_config is not None:
        settings["reward_model_config"] = options.reward_model_config
    if options.padded != "auto":
        settings["padded"] = options.padded == "yes"
    return estimate_step(module, **settings), settings, module


def _estimate(args: list[str]) -> None:
    """``lit-rl estimate``: print the component table, the per-phase peaks and, with ``--device-memory``, the fit."""
    options, _ = _option_parser().parse_known_args(args)
    if options.help:
        _option_parser().print_help()
        return
    device_bytes = parse_bytes(options.device_memory) if options.device_memory else None
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices from peft/transformers internals
    try:
        estimate, settings, module = estimate_from_args(args)
    except (ValueError, NotImplementedError) as err:  # bad settings: the message names the fix
        raise SystemExit(f"lit-rl estimate: {err}") from err
    print(estimate.table())
    print(f"\n(estimated in {estimate.seconds:.1f} s on fake tensors; no weights were loaded)")
    if device_bytes is not None:
        _, report = fit_report(module, estimate, device_bytes, settings, tactics=not options.no_tactics)
        print("\n" + report)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "embed":
        _embed(args[1:])
        return
    if args and args[0] == "estimate":
        _estimate(args[1:])
        return
    if args and args[0] == "reward-model":
        from lit_rl.data.reward_model import main as reward_model_main

        reward_model_main(args[1:])
        return
    LitRLCLI(args=argv)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    main()
