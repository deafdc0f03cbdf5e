"""The ``lit-rl`` command: LightningCLI's ``fit / validate / test / predict`` plus ``estimate``, ``embed``,
``reward-model``, ``export`` and ``rates`` (``lit-rl --help`` lists them all).

lit-rl fit --config configs/grpo.yaml
lit-rl fit --config configs/grpo.yaml --config callbacks/memory_profiler.yaml --trainer.max_steps 5
lit-rl fit --model.help RefCachedGRPO
lit-rl embed --config configs/grpo_density.yaml      # offline embedding cache for density sampling
lit-rl reward-model                                  # refit the built-in sentiment reward model (GumbelTopK)
lit-rl validate --config configs/grpo.yaml --ckpt_path runs/grpo/.../last.ckpt   # held-out scores of a checkpoint
lit-rl export --ckpt_path runs/grpo/.../last.ckpt --out grpo-arith               # a from_pretrained folder
lit-rl rates --out machine_rates.json                # matmul and bandwidth rates for the MemoryProfiler's roofline

A mistake in the settings, files or functions a run is given is answered in one line on stderr,
``error: <field>: <what is wrong>; <the fix>``, with exit status 2; ``--debug`` (or ``LIT_RL_DEBUG=1``)
shows the traceback instead. An error that is not the user's (a bug) keeps its traceback
(:mod:`lit_rl.cli_errors` says which is which).

Every subcommand is parsed the same way: the arguments of a run (``--config`` files, ``--model.*``,
``--data.*``, ``--trainer.*``) are checked by :func:`lit_rl.cli_errors.check_run_arguments` and then read by
:class:`LitRLCLI` (jsonargparse); a subcommand's own options (``estimate``, ``export``) by an
:class:`~lit_rl.cli_errors.OptionParser`, whose mistakes are the same one line.

From Python: :class:`LitRLCLI` is the CLI class (``LitRLCLI(args=[...], run=False)`` builds a run without starting
it), :func:`parse_fit_config` a fit config's method, datamodule and trainer settings without a Trainer (what
``lit-rl estimate`` reads), and :func:`main` the console script.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from lit_rl.callbacks import StepProgressBar
from lit_rl.cli_errors import (
    OptionParser,
    check_checkpoint,
    check_command,
    check_run_arguments,
    config_files,
    explain_error,
)
from lit_rl.cli_noise import quiet_lightning
from lit_rl.memory.estimate import BUILTIN_SHAPES, Estimate, estimate_step, parse_bytes, settings_from
from lit_rl.memory.fit import fit_report
from lit_rl.memory.sharded import sharding_settings
from lit_rl.methods.base import RLMethod
from lit_rl.planner import CHANGES_ARITHMETIC, write_plan

__all__ = ["LitRLCLI", "main", "parse_fit_config"]


class LitRLCLI(LightningCLI):
    """LightningCLI with any :class:`RLMethod` as the model and any DataModule as the data (``class_path``), saving
    checkpoints with :class:`~lit_rl.callbacks.StreamingCheckpointIO` unless ``trainer.plugins`` says otherwise.

    Args:
        raise_parse_errors: raise jsonargparse's ``ArgumentError`` instead of printing the usage and
            exiting, so :func:`main` can answer in one line.
        *args, **kwargs: as for ``LightningCLI``.
    """

    def __init__(self, *args, raise_parse_errors: bool = False, **kwargs) -> None:
        self._raise_parse_errors = raise_parse_errors
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)  # each method configures its own optimizer
        # checkpoints streamed to disk, not built in memory first (lit_rl/callbacks/checkpoint_io.py says why here);
        # unlike a callback in trainer_defaults this is a parser default: --print_config and the saved config show it
        # Lightning's model summary has a FLOPs column that is zero for every RL method (it counts FLOPs only for an
        # example_input_array); RunLog's first line gives the parameter counts instead. --trainer.enable_model_summary
        # true brings it back
        kwargs["trainer_defaults"] = {
            "plugins": [{"class_path": "lit_rl.callbacks.StreamingCheckpointIO"}],
            "enable_model_summary": False,
            **(kwargs.get("trainer_defaults") or {}),
        }
        super().__init__(RLMethod, L.LightningDataModule, *args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_subclass_arguments(
            (torch.optim.Optimizer,), "optimizer", instantiate=False, fail_untyped=False,
            skip={"params", "lr", "weight_decay"}, required=False,
        )  # fmt: skip
        parser.link_arguments("optimizer", "model.init_args.optimizer", compute_fn=_optimizer_spec)

    def init_parser(self, **kwargs: Any):
        if self._raise_parse_errors:
            kwargs["exit_on_error"] = False
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parse, then check a ``ckpt_path`` file before LightningCLI reads its hyper-parameters with ``torch.load``."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        named = ckpt_path in (None, "last", "best", "hpc") or str(ckpt_path).startswith("registry")
        if not named:
            check_checkpoint(ckpt_path)

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """Lightning's Trainer, with :class:`~lit_rl.callbacks.StepProgressBar` in place of Lightning's default rich
        bar (which draws ``Epoch 0/-2`` in a run bounded by steps); a progress bar the config names is kept."""
        # read before Lightning appends its default bar to the same list the config holds
        configured = _configured(self.config_init.get(self.subcommand, self.config_init))
        trainer = super().instantiate_trainer(**kwargs)
        bar = trainer.progress_bar_callback
        if type(bar) is RichProgressBar and not configured:
            trainer.callbacks[trainer.callbacks.index(bar)] = StepProgressBar()
        return trainer

    def before_fit(self) -> None:
        """Checks that need the method, the data and the Trainer together, before the run writes anything."""
        prompt_length = getattr(self.datamodule, "hparams", {}).get("max_prompt_length")
        if prompt_length is not None and hasattr(self.model, "check_micro_batch_tokens"):
            self.model.check_micro_batch_tokens(int(prompt_length))
        for callback in self.trainer.callbacks:  # a callback that cannot work on this device says so now
            check = getattr(callback, "check_trainer", None)
            if callable(check):
                check(self.trainer)

    def before_instantiate_classes(self) -> None:
        # checked before any model is loaded or any log folder is made, so a typo costs nothing
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        if "weights_only" in config and config.get("weights_only") is None:
            # a checkpoint is read as tensors and plain containers, never unpickled code, whatever torch's default
            config["weights_only"] = True
        _drop_checkpoint_callbacks(config.get("trainer"))


def _optimizer_spec(optimizer: Any) -> dict[str, Any] | None:
    return (
        None
        if optimizer is None
        else {"class_path": optimizer.class_path, "init_args": dict(vars(optimizer.init_args))}
    )


def _configured(config: Any) -> bool:
    """Whether the instantiated config's ``trainer.callbacks`` holds a progress bar of the user's."""
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    return any(isinstance(c, ProgressBar) for c in (callbacks if isinstance(callbacks, list) else [callbacks]))


def _drop_checkpoint_callbacks(trainer: Any) -> None:
    """With ``trainer.enable_checkpointing: false``, remove the config's ``ModelCheckpoint`` callbacks, said once.

    ``enable_checkpointing`` is then the one switch that turns checkpoints off: Lightning itself refuses the
    pair (a ModelCheckpoint with checkpointing off), which would make a user edit every config that lists one.

    Args:
        trainer: the ``trainer`` section of the parsed config (a jsonargparse Namespace), or ``None``.
    """
    if trainer is None or trainer.get("enable_checkpointing") is not False:
        return
    callbacks = trainer.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    kept = [c for c in callbacks if not _is_model_checkpoint(c)]
    if len(kept) < len(callbacks):
        trainer["callbacks"] = kept
        rank_zero_info(
            "trainer.enable_checkpointing is false: the ModelCheckpoint callback of the config is left out; "
            "no checkpoint is written"
        )


def _is_model_checkpoint(callback: Any) -> bool:
    """Whether a callback entry of the config (``class_path`` + ``init_args``, or an instance) is a ModelCheckpoint."""
    if isinstance(callback, ModelCheckpoint):
        return True
    module, _, name = str(callback.get("class_path", "") if hasattr(callback, "get") else "").rpartition(".")
    try:
        klass = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False  # jsonargparse has already refused a class path that does not import
    return isinstance(klass, type) and issubclass(klass, ModelCheckpoint)


def _embed(args: list[str]) -> None:
    """``lit-rl embed --config X.yaml``: write the prompt-embedding cache that density sampling reuses.

    Takes the arguments of ``lit-rl fit`` (its --config files and overrides); a cache built for other
    prompts or settings is replaced.
    """
    cli = LitRLCLI(args=args, run=False, raise_parse_errors=True)
    module, data = cli.model, cli.datamodule
    if not hasattr(data, "build_density_cache"):
        raise ValueError(
            f"data.class_path: {type(data).__name__} writes no embedding cache; use lit_rl.data.PromptDataModule"
        )
    if getattr(data.hparams, "density_cache_dir", None) is None:
        raise ValueError("data.density_cache_dir: not set; set it to the folder the embeddings are written to")
    module.setup("fit")  # loads the tokenizer
    data.connect(module.tokenizer, embed_model=module.policy_for_embedding, model_id=module.name_or_path)
    data.build_density_cache()


# ------------------------------------------------------------------------------------------------ estimate


def _option_parser() -> OptionParser:
    parser = OptionParser(
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
        help="which kernels to mirror (an AdamW that is not fused: per tensor on cpu, foreach on cuda) and whose "
        "rates time a plan; default: from trainer.accelerator (auto: cuda where this machine has it)",
    )
    parser.add_argument(
        "--padded",
        choices=("auto", "yes", "no"),
        default="auto",
        help="whether prompts are left-padded, so the [B, 1, q, kv] attention mask is built (auto: batch size > 1)",
    )
    parser.add_argument("--no-tactics", action="store_true", help="with --device-memory: do not estimate tactics")
    parser.add_argument(
        "--plan",
        metavar="FILE",
        help="with --device-memory: search the memory tactics for the fastest setting that fits and write it as a "
        "config fragment (lit-rl fit --config C --config FILE applies it)",
    )
    parser.add_argument(
        "--allow",
        default="",
        help="with --plan: tactics that change the arithmetic the plan may use, comma-separated "
        f"({', '.join(CHANGES_ARITHMETIC)}) or all; by default the plan keeps the config's arithmetic",
    )
    parser.add_argument(
        "--rates",
        metavar="FILE",
        help="with --plan: rates of the step's device for the times (lit-rl rates --device D --out FILE; default: "
        "measured here where this machine has that device, else not timed)",
    )
    return parser


def parse_fit_config(args: list[str]):
    """The method, the datamodule and the trainer settings of a fit config, without building the Trainer."""

    class _NoTrainerCLI(LitRLCLI):
        def instantiate_trainer(self, **kwargs: Any):  # noqa: D102 — the estimate needs no Trainer (or a GPU)
            return None

    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when it is given args and sys.argv has some too
    try:
        cli = _NoTrainerCLI(args=args, run=False, save_config_callback=None, raise_parse_errors=True)
    finally:
        sys.argv = argv
    trainer_config = cli.config_init.get("trainer", {}) or {}
    return cli.model, cli.datamodule, trainer_config


def estimate_from_args(args: list[str]) -> tuple[Estimate, dict[str, Any], Any]:
    """Parse ``lit-rl estimate`` arguments and estimate; returns ``(estimate, settings, module)``."""
    options, rest = _option_parser().parse_known_args(args)
    module, datamodule, trainer_config = parse_fit_config(rest)
    accelerator = str(trainer_config.get("accelerator", "auto"))
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())  # as Lightning's
    device_type = options.device or ("cuda" if gpu else "cpu")
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
        raise ValueError(
            "data: the data module has no batch_size / max_prompt_length; pass --batch-size and --prompt-length"
        )
    if options.model_config is not None:
        settings["model_config"] = options.model_config
    if options.reward_model_config is not None:
        settings["reward_model_config"] = options.reward_model_config
    if options.padded != "auto":
        settings["padded"] = options.padded == "yes"
    settings.update(sharding_settings(trainer_config))  # FSDP2Strategy: the estimate of one process
    module.check_micro_batch_tokens(settings["prompt_length"])
    return estimate_step(module, **settings), settings, module


def _estimate(args: list[str]) -> None:
    """``lit-rl estimate``: print the component table, the per-phase peaks and, with ``--device-memory``, the fit."""
    options, rest = _option_parser().parse_known_args(args)
    if options.help:
        _option_parser().print_help()
        return
    check_run_arguments(rest)
    device_bytes = parse_bytes(options.device_memory) if options.device_memory else None
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices from peft/transformers internals
    estimate, settings, module = estimate_from_args(args)  # bad settings raise; main() answers in one line
    print(estimate.table())
    print(f"\n(estimated in {estimate.seconds:.1f} s on fake tensors; no weights were loaded)")
    if options.plan:
        write_plan(module, settings, device_bytes, options.plan, allow=options.allow, rates=options.rates,
                   args=rest, configs=config_files(rest))  # fmt: skip
    elif device_bytes is not None:
        _, report = fit_report(module, estimate, device_bytes, settings, tactics=not options.no_tactics)
        print("\n" + report)


def main(argv: list[str] | None = None) -> None:
    """The ``lit-rl`` console script; ``argv`` defaults to ``sys.argv[1:]``.

    A user's mistake ends in one line on stderr and ``SystemExit(2)``; ``--debug`` (anywhere in the
    arguments) or ``LIT_RL_DEBUG=1`` lets the exception and its traceback through.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("LIT_RL_DEBUG", "").lower() not in ("", "0", "false", "no")
    args = [a for a in args if a != "--debug"]
    if argv is None:  # the density cache's rebuild hint reads sys.argv: keep it, without --debug
        sys.argv = [sys.argv[0], *args]
    quiet_lightning()
    try:
        _run(args, from_sys_argv=argv is None, debug=debug)
    except Exception as err:
        line = None if debug else explain_error(err)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2) from None
    from lit_rl.strategies import leave_process_group  # imported last: no command starts slower for it

    leave_process_group()  # after a distributed run that ended well


# ------------------------------------------------------------------------------------------------ subcommands


def _export(args: list[str]) -> None:
    from lit_rl.export import main as export_main

    export_main(args)


def _reward_model(args: list[str]) -> None:
    """``lit-rl reward-model [--out DIR] [--base ...]``: the options are ``train_sentiment_reward_model``'s."""
    from lit_rl.reward_model.train import REFIT_OPTIONS, SHIPPED_HEAD_DIR, refit, train_sentiment_reward_model

    parser = OptionParser(
        prog="lit-rl reward-model",
        description="Fit the built-in sentiment reward model (a score head on the frozen embedded SmolLM2) again, "
        "report its agreement with the labeller on held-out openings and how far it is from the shipped head.",
    )
    parser.add_argument(
        "--out", default="runs/reward-model", help=f"folder to write (default: runs/reward-model; {SHIPPED_HEAD_DIR} "
        "replaces the shipped head)",
    )  # fmt: skip
    defaults = inspect.signature(train_sentiment_reward_model).parameters
    for name, text in REFIT_OPTIONS.items():
        default = defaults[name].default
        parser.add_argument(
            "--" + name.replace("_", "-"), type=type(default), default=default, help=f"{text} (default: {default})"
        )
    parser.add_argument(
        "--probe-layers", metavar="FILE.md", help="instead of fitting the head: fit one on each layer of the trunk "
        "and write their held-out agreement to FILE.md (lit_rl/reward_model/probe.py); --out is not written",
    )  # fmt: skip
    settings = vars(parser.parse_args(args))
    table, out = settings.pop("probe_layers"), settings.pop("out")
    if table is not None:
        from lit_rl.reward_model.probe import probe_layers

        for row in probe_layers(table, **settings):
            print(
                f"layer {row['layer']}: held-out AUC {row['auc'] or float('nan'):.3f}, accuracy {row['accuracy']:.3f}"
            )
        print(f"wrote {table}")
        return
    refit(out, **settings)


def _rates(args: list[str]) -> None:
    """``lit-rl rates [--out FILE] [--device cpu|cuda] [--quick]``: measure this machine's rates and save them."""
    from lit_rl.memory.machine_rates import measure_rates, save_rates

    parser = OptionParser(
        prog="lit-rl rates",
        description="Measure this machine's matmul rates (float32, bfloat16) and memory bandwidth and save them as "
        "the file the MemoryProfiler's `rates:` reads for its roofline (each phase's time beside its floor). "
        "Each figure is the fastest of as many timings as fit in 2 s (0.12 s with --quick); other load lowers it.",
    )
    parser.add_argument("--out", default="machine_rates.json", help="file to write (default: machine_rates.json)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to measure (default: cpu)")
    parser.add_argument("--quick", action="store_true", help="smaller shapes, 0.12 s per figure (a rough figure)")
    options = parser.parse_args(args)
    rates = measure_rates(options.device, ("float32", "bfloat16"), quick=options.quick)
    for dtype, values in rates["dtypes"].items():
        print(f"{dtype}: matmul {values['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, decode-shaped matmul "
              f"{values['skinny_matmul_flops_per_s'] / 1e9:.1f} GFLOP/s")  # fmt: skip
    print(f"memory bandwidth {rates['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s ({rates['machine']})")
    print(f"wrote {save_rates(rates, options.out)}")


class Subcommand(NamedTuple):
    """A subcommand lit-rl adds to LightningCLI's: its one-line help and the function given its arguments."""

    help: str
    run: Callable[[list[str]], None]


#: the subcommands lit-rl adds to LightningCLI's (``lit-rl --help`` lists them)
EXTRA_SUBCOMMANDS = {
    "estimate": Subcommand(
        "predict the per-phase peak memory of a config's step, without loading weights (padded upper bound)", _estimate
    ),
    "embed": Subcommand("write the prompt-embedding cache that density sampling reuses", _embed),
    "reward-model": Subcommand(
        "refit the built-in sentiment reward model (GumbelTopK's default reward) and report its agreement",
        _reward_model,
    ),
    "export": Subcommand(
        "write a checkpoint's policy as a Hugging Face folder (merged weights, or the LoRA adapter)", _export
    ),
    "rates": Subcommand(
        "measure this machine's matmul rates and memory bandwidth for the roofline (a JSON file)", _rates
    ),
}
#: every subcommand, the one list that dispatch, help and the unknown-command error read
COMMANDS = (*LightningCLI.subcommands(), *EXTRA_SUBCOMMANDS)
#: subcommands whose arguments are a run's (``--config`` files and ``--model.*`` / ``--data.*`` / ``--trainer.*``)
_RUN_ARGUMENTS = (*LightningCLI.subcommands(), "embed")


def _print_help() -> None:
    """LightningCLI's help, then the subcommands lit-rl adds (jsonargparse lists only the Trainer's)."""
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args parameter is intended")  # args given on purpose here
        LitRLCLI(args=["--help"])
    print(buffer.getvalue().rstrip())
    print("\nmore subcommands (each takes --help):")
    for name, subcommand in EXTRA_SUBCOMMANDS.items():
        print(f"    {name:<14}{subcommand.help}")


def _run(args: list[str], *, from_sys_argv: bool, debug: bool) -> None:
    if args and args[0] in ("-h", "--help"):
        _print_help()
        return
    check_command(args, COMMANDS)
    command = args[0] if args else ""
    if command in _RUN_ARGUMENTS:
        check_run_arguments(args[1:], command if command in LightningCLI.subcommands() else "fit")
    if command in EXTRA_SUBCOMMANDS:
        EXTRA_SUBCOMMANDS[command].run(args[1:])
        return
    # None: LightningCLI reads sys.argv itself (and warns about args given beside a command line)
    LitRLCLI(args=None if from_sys_argv else args, raise_parse_errors=not debug)


if __name__ == "__main__":
    main()
