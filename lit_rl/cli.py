"""The ``lit-rl`` command: LightningCLI's ``fit / validate / test / predict`` plus ``estimate``, ``embed``,
``reward-model`` and ``export`` (``lit-rl --help`` lists them all).

lit-rl fit --config configs/grpo.yaml
lit-rl fit --config configs/grpo.yaml --config callbacks/memory_profiler.yaml --trainer.max_steps 5
lit-rl fit --model.help RefCachedGRPO
lit-rl embed --config configs/grpo_density.yaml      # offline embedding cache for density sampling
lit-rl reward-model                                  # refit the built-in sentiment reward model (GumbelTopK)
lit-rl validate --config configs/grpo.yaml --ckpt_path runs/grpo/.../last.ckpt   # held-out scores of a checkpoint
lit-rl export --ckpt_path runs/grpo/.../last.ckpt --out grpo-arith               # a from_pretrained folder

A mistake in the settings, files or functions a run is given is answered in one line on stderr,
``error: <field>: <what is wrong>; <the fix>``, with exit status 2; ``--debug`` (or ``LIT_RL_DEBUG=1``)
shows the traceback instead. An error that is not the user's (a bug) keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.cli import LightningCLI

from lit_rl.memory.estimate import BUILTIN_SHAPES, Estimate, estimate_step, parse_bytes, settings_from
from lit_rl.memory.fit import fit_report
from lit_rl.methods.base import RLMethod


class LitRLCLI(LightningCLI):
    """LightningCLI with any :class:`RLMethod` as the model and any DataModule as the data (``class_path``).

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
        super().__init__(RLMethod, L.LightningDataModule, *args, **kwargs)

    def init_parser(self, **kwargs: Any):
        if self._raise_parse_errors:
            kwargs["exit_on_error"] = False
        return super().init_parser(**kwargs)

    def before_instantiate_classes(self) -> None:
        # checked before any model is loaded or any log folder is made, so a typo costs nothing
        config = self.config.get(self.subcommand) if self.subcommand else None
        if config is None:
            return
        ckpt_path = config.get("ckpt_path")
        named = ckpt_path in (None, "last", "best", "hpc") or str(ckpt_path).startswith("registry")
        if not named and not Path(ckpt_path).expanduser().is_file():
            raise FileNotFoundError(
                f"ckpt_path: {ckpt_path} does not exist; give a checkpoint file, or `last` to resume from the newest "
                "checkpoint of trainer.callbacks' ModelCheckpoint"
            )
        if "weights_only" in config and config.get("weights_only") is None:
            # a checkpoint is read as tensors and plain containers, never unpickled code, whatever torch's default
            config["weights_only"] = True


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
        help="which kernels to mirror (an AdamW that is not fused: per tensor on cpu, foreach on cuda); default: from trainer.accelerator",
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
        raise ValueError(
            "data: the data module has no batch_size / max_prompt_length; pass --batch-size and --prompt-length"
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
    estimate, settings, module = estimate_from_args(args)  # bad settings raise; main() answers in one line
    print(estimate.table())
    print(f"\n(estimated in {estimate.seconds:.1f} s on fake tensors; no weights were loaded)")
    if device_bytes is not None:
        _, report = fit_report(module, estimate, device_bytes, settings, tactics=not options.no_tactics)
        print("\n" + report)


# ------------------------------------------------------------------------------------------------ errors

_PACKAGE_DIRS = tuple(str(Path(f).resolve().parent) + os.sep for f in (__file__, L.__file__))  # lit_rl/, lightning/
_NOISE = ("Does not validate against", "Subtypes:", "Errors:", "Given value", "- Expected a <class 'NoneType'>")


def explain_error(err: BaseException, args: list[str]) -> str | None:
    """The one line (without ``error: ``) that answers a user's mistake, or ``None`` for a bug.

    A user's mistake is what jsonargparse refuses while parsing, a file or network error (``OSError``),
    or an exception that lit-rl or Lightning raise on purpose (a ``raise`` statement, which names the
    setting and the fix) anywhere in the chain of causes: jsonargparse wraps a method's refusal in
    "Does not validate against any of the Union subtypes", Lightning re-raises it as it is.
    """
    if isinstance(err, argparse.ArgumentError):
        return _parse_error(str(err), args)
    for cause in _causes(err):
        if isinstance(cause, argparse.ArgumentError):
            return _parse_error(str(cause), args)
        if _raised_on_purpose(cause) or isinstance(cause, OSError):
            return " ".join(str(cause).split()) or type(cause).__name__
    return None


def _causes(err: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def _raised_on_purpose(err: BaseException) -> bool:
    """Whether a ``raise`` statement in lit-rl or Lightning raised ``err`` (not a failing operation or a bug)."""
    import linecache

    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = str(Path(tb.tb_frame.f_code.co_filename).resolve())
    if not filename.startswith(_PACKAGE_DIRS):
        return False
    return linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise ")


def _parse_error(message: str, args: list[str]) -> str:
    """jsonargparse's nested report of a parse error, as ``<field>: <what is wrong>; <the fix>``."""
    import re

    lines = [line.strip().removeprefix("- ") for line in message.strip().splitlines() if line.strip()]
    head = lines[0] if lines else message
    command = re.search(r"invalid choice: '([^']*)'", head)
    if command:
        return f"{command.group(1)}: not a command of lit-rl; use one of {', '.join(_COMMANDS)}"
    if head.startswith("Problems parsing config"):
        return _malformed_config(args) or f"--config: not valid YAML ({' '.join(lines)}); fix the file"
    missing = re.match(r'Parser key "(?:config|.*\.config)": File does not exist: (.*)', head)
    if missing:
        return f"--config: {missing.group(1)} does not exist; give the path of a YAML file, e.g. configs/grpo_tiny.yaml"
    if head.startswith("unrecognized arguments"):
        unknown = [a for a in head.split(":", 1)[1].split() if a.startswith("--")]
        if unknown:
            return _unknown_option(unknown[0].lstrip("-"))
        return _unknown_config_key(args) or f"{head}; `lit-rl fit --help` lists the options"
    refused = re.search(r"does not accept option '([^']+)'", head)
    if refused:
        return _unknown_config_key(args) or f"{refused.group(1)}: not an option; `lit-rl fit --help` lists the options"
    keys = [m.group(1) for line in lines for m in [re.match(r'Parser key "([^"]+)"', line)] if m]
    class_path = next((m.group(1) for line in lines for m in [re.search(r"given class_path '([^']+)'", line)] if m), "")
    details = [line for line in lines if not line.startswith(("Parser key", "Problem with given")) and not any(
        noise in line for noise in _NOISE)]  # fmt: skip
    detail = details[0].lstrip("- ") if details else head
    field = ".".join(keys)
    given = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Given value:")), "")
    accepted = re.match(r"Option '([^']+)' is not accepted", detail)
    if accepted:
        option = accepted.group(1)
        return f"{field}.{option}: not an option of {class_path}; {_suggest(option, class_path, field)}"
    expected = re.match(r"Expected a (.*?)\. Got value: (.*)", detail) or re.match(r"Expected a (.*)", detail)
    if expected:
        kind = re.sub(r"<class '([^']+)'>", r"\1", expected.group(1))
        got = expected.group(2) if expected.lastindex == 2 else given
        choices = re.match(r"typing\.Literal\[(.*)\]", kind)
        if choices:
            return f"{field}: {got!r} is not one of {choices.group(1)}; use one of them"
        return f"{field}: expected {kind}, got {got!r}; give a value of type {kind}"
    if class_path and len(keys) == 1:  # the class itself could not be imported
        return f"{field}.class_path: cannot use {class_path!r} ({detail}); give an importable class, e.g. {_EXAMPLE[field]}"
    return f"{field or 'arguments'}: {detail}; `lit-rl fit --help` lists the options"


_COMMANDS = ("fit", "validate", "test", "predict", "estimate", "embed", "reward-model")
_EXAMPLE = {"model": "lit_rl.methods.RefCachedGRPO", "data": "lit_rl.data.PromptDataModule"}


def _suggest(option: str, class_path: str, section: str) -> str:
    """Close option names of ``class_path`` and where the list is."""
    import difflib
    import importlib
    import inspect

    module, _, name = class_path.rpartition(".")
    names: set[str] = set()
    try:
        for klass in inspect.getmro(getattr(importlib.import_module(module), name)):
            if "__init__" in vars(klass):
                names |= set(inspect.signature(klass.__init__).parameters) - {"self", "args", "kwargs"}
    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    close = difflib.get_close_matches(option, sorted(names), n=1)
    where = f"`lit-rl fit --{section.split('.')[0]}.help {name}` lists the options"
    return f"did you mean {close[0]}? {where}" if close else where


def _unknown_option(option: str) -> str:
    import difflib
    import inspect

    section, _, key = option.rpartition(".")
    known = set(inspect.signature(L.Trainer.__init__).parameters) - {"self"} if section == "trainer" else set()
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f"did you mean {section}.{close[0]}?" if close else "`lit-rl fit --help` lists the options"
    return f"{option}: not an option; {hint}"


def _config_files(args: list[str]) -> list[str]:
    files = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config", "-c")]
    return files + [a.split("=", 1)[1] for a in args if a.startswith("--config=")]


def _malformed_config(args: list[str]) -> str | None:
    """The first --config file that is not valid YAML, with the place yaml names."""
    import yaml

    for path in _config_files(args):
        try:
            yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            return f"--config {path}: not valid YAML{where} ({problem}); fix the file"
        except OSError:
            continue
    return None


def _unknown_config_key(args: list[str]) -> str | None:
    """A top-level or ``trainer`` key of a --config file that ``lit-rl fit`` does not take (jsonargparse names none)."""
    import difflib
    import inspect

    import yaml

    top = {"seed_everything", "trainer", "model", "data", "ckpt_path", "weights_only", "optimizer", "lr_scheduler"}
    trainer = set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}
    for path in _config_files(args):
        try:
            config = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue
        if not isinstance(config, dict):
            return f"--config {path}: expected a mapping of settings, got {type(config).__name__}; fix the file"
        for section, known, keys in (("", top, config), ("trainer.", trainer, config.get("trainer") or {})):
            for key in keys if isinstance(keys, dict) else []:
                if key not in known:
                    close = difflib.get_close_matches(key, sorted(known), n=1)
                    hint = f"did you mean {section}{close[0]}?" if close else "`lit-rl fit --help` lists the options"
                    return f"{section}{key} (in {path}): not an option; {hint}"
    return None


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
    try:
        _run(args, from_sys_argv=argv is None, debug=debug)
    except Exception as err:
        line = None if debug else explain_error(err, args)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


#: the subcommands lit-rl adds to LightningCLI's, with their one-line help (``lit-rl --help`` lists them)
EXTRA_SUBCOMMANDS = {
    "estimate": "predict the per-phase peak memory of a config's step, without loading weights (padded upper bound)",
    "embed": "write the prompt-embedding cache that density sampling reuses",
    "reward-model": "refit the built-in sentiment reward model (GumbelTopK's default reward) and report its agreement",
    "export": "write a checkpoint's policy as a Hugging Face folder (merged weights, or the LoRA adapter)",
}


def _print_help() -> None:
    """LightningCLI's help, then the subcommands lit-rl adds (jsonargparse lists only the Trainer's)."""
    import contextlib
    import io
    import warnings

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args parameter is intended")  # args given on purpose here
        LitRLCLI(args=["--help"])
    print(buffer.getvalue().rstrip())
    print("\nmore subcommands (each takes --help):")
    for name, text in EXTRA_SUBCOMMANDS.items():
        print(f"    {name:<14}{text}")


def _run(args: list[str], *, from_sys_argv: bool, debug: bool) -> None:
    if args and args[0] in ("-h", "--help"):
        _print_help()
        return
    if args and args[0] == "export":
        from lit_rl.export import main as export_main

        export_main(args[1:])
        return
    if args and args[0] == "embed":
        _embed(args[1:])
        return
    if args and args[0] == "estimate":
        _estimate(args[1:])
        return
    if args and args[0] == "reward-model":
        from lit_rl.reward_model.train import main as reward_model_main

        reward_model_main(args[1:])
        return
    # None: LightningCLI reads sys.argv itself (and warns about args given beside a command line)
    LitRLCLI(args=None if from_sys_argv else args, raise_parse_errors=not debug)


if __name__ == "__main__":
    main()
