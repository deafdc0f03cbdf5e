"""The ``lit-rl`` command: LightningCLI's ``fit / validate / test / predict`` plus ``estimate`` and ``embed``.

lit-rl fit --config configs/grpo.yaml
lit-rl fit --config configs/grpo.yaml --config callbacks/memory_profiler.yaml --trainer.max_steps 5
lit-rl fit --model.help RefCachedGRPO
lit-rl embed --config configs/grpo_density.yaml      # offline embedding cache for density sampling
"""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.cli import LightningCLI

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

    def policy():
        module.configure_model()
        return module.policy

    data.connect(module.tokenizer, embed_model=policy, model_id=module.name_or_path)
    data.build_density_cache()


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "embed":
        _embed(args[1:])
        return
    if args and args[0] == "estimate":
        from lit_rl.memory.estimate import main as estimate_main

        estimate_main(args[1:])
        return
    LitRLCLI(args=argv)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    main()
