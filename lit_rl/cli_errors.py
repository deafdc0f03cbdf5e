"""What ``lit-rl`` answers to a user's mistake: one line on stderr, ``error: <field>: <what is wrong>; <the fix>``.

Most of the line comes from structured checks, never from another library's wording:

- **before parsing**, lit-rl reads what it was given itself (:func:`check_command`, :func:`check_run_arguments`,
  :func:`check_checkpoint`): the subcommand against lit-rl's list, each ``--config`` file with yaml (whose
  errors carry the line and column), its keys and the ``--trainer.*`` options against the Trainer's signature,
  a checkpoint file against the zip layout ``torch.save`` writes;
- **after a failure**, :func:`explain_error` walks the chain of causes for an exception lit-rl or Lightning
  raise on purpose (a ``raise`` statement naming the setting and the fix), an :class:`UsageError`, or a file
  or network error (``OSError``).

What is left is a value jsonargparse refuses while parsing (a wrong type, a value outside a ``Literal``, an
option a class does not take, a class path that does not import). jsonargparse names the field only in the
text of its message, so :func:`read_jsonargparse_message` is the one place that reads that text. The range in
``pyproject.toml`` is the releases ``tests/test_errors.py`` passed on (``constraints.txt`` pins the one CI runs);
on a release whose wording it cannot read, the answer is jsonargparse's own message on one line, so nothing is lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import os
import re
import typing
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import yaml

from lit_rl.models.optimizers import METHOD_OPTIONS
from lit_rl.plan_file import check_plan_files

_PACKAGE_DIRS = tuple(str(Path(f).resolve().parent) + os.sep for f in (__file__, L.__file__))  # lit_rl/, lightning/
_HELP = "`lit-rl fit --help` lists the options"
_EXAMPLE = {
    "model": "lit_rl.methods.RefCachedGRPO",
    "data": "lit_rl.data.PromptDataModule",
    "optimizer": "bitsandbytes.optim.AdamW8bit",
}
#: keys a run's config file may hold besides the Trainer method's own arguments (``ckpt_path``, ``verbose``, ...)
_CONFIG_SECTIONS = {"seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler"}


class UsageError(ValueError):
    """A user's mistake found by lit-rl's own checks; its message is the whole line after ``error: ``."""


class OptionParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` for a subcommand's own options: a bad option raises :class:`UsageError`
    (one line from ``main``) instead of printing the usage and exiting."""

    def error(self, message: str):  # noqa: D102 — argparse's hook for every parse error
        raise UsageError(f"{self.prog}: {message}; `{self.prog} --help` lists the options")


# ------------------------------------------------------------------------------------------------ before parsing


def check_command(args: list[str], commands: tuple[str, ...]) -> None:
    """Refuse a first argument that is neither an option nor one of ``commands``.

    Raises:
        UsageError: an unknown subcommand, with the list of known ones.
    """
    if args and not args[0].startswith("-") and args[0] not in commands:
        close = difflib.get_close_matches(args[0], commands, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(f"{args[0]}: not a command of lit-rl; {hint}use one of {', '.join(commands)}")


def check_run_arguments(args: list[str], command: str = "fit") -> None:
    """Check the ``--config`` files and ``--trainer.*`` options of a run before jsonargparse reads them.

    Args:
        args: the arguments after the subcommand.
        command: the Trainer method the arguments are for (``fit``, ``validate``, ``test``, ``predict``).

    Raises:
        UsageError: a config file that is missing, not valid YAML, not a mapping, or holds a top-level or
            ``trainer`` key the command does not take; a ``--trainer.<name>`` that is not a Trainer argument.
    """
    from lightning.pytorch.cli import LightningCLI

    trainer = set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}
    for arg in args:
        if arg.startswith("--trainer."):
            name = re.split(r"[.=+]", arg.removeprefix("--trainer."), maxsplit=1)[0]
            if name not in trainer and name != "help":
                raise UsageError(f"trainer.{name}: not an option; {_did_you_mean('trainer.', name, trainer)}")
    top = _CONFIG_SECTIONS | set(LightningCLI.subcommands().get(command, ())) - {"datamodule"}
    try:
        check_plan_files([p for p in config_files(args) if Path(p).is_file()])
    except ValueError as err:
        raise UsageError(str(err)) from None
    for path in config_files(args):
        if not Path(path).is_file():
            raise UsageError(
                f"--config: {path!r} does not exist; give the path of a YAML file, e.g. configs/grpo_tiny.yaml"
            )
        try:
            config = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise UsageError(f"--config {path}: not valid YAML{where} ({problem}); fix the file") from err
        if config is None:
            continue
        if not isinstance(config, dict):
            raise UsageError(
                f"--config {path}: expected a mapping of settings, got {type(config).__name__}; fix the file"
            )
        for section, known, keys in (("", top, config), ("trainer.", trainer, config.get("trainer"))):
            for key in keys if isinstance(keys, dict) else []:
                if key.removesuffix("+") not in known:  # `callbacks+:` appends to a list (jsonargparse)
                    raise UsageError(f"{section}{key} (in {path}): not an option; {_did_you_mean(section, key, known)}")


def check_checkpoint(path: str | Path, option: str = "ckpt_path") -> None:
    """Refuse a checkpoint file that is missing or not in the layout ``torch.save`` writes, before anything loads.

    ``torch.save`` writes a zip archive whose directory sits at the end and which holds a ``data.pkl``; reading
    the directory costs a few kilobytes, so a truncated or foreign file is refused before the model is built.

    Args:
        path: the checkpoint file, or a sharded checkpoint's folder (its ``meta.pt`` is checked).
        option: the setting that named it, for the message.

    Raises:
        UsageError: no such file, or not a torch checkpoint.
    """
    path = Path(path).expanduser()
    if path.is_dir() and (path / "meta.pt").is_file():  # a sharded checkpoint (FSDP2Strategy): shards and meta.pt
        path = path / "meta.pt"
    if not path.is_file():
        resume = " or `last` to resume from the newest checkpoint of trainer.callbacks' ModelCheckpoint"
        raise UsageError(
            f"{option}: {path} does not exist; give a checkpoint file{',' + resume if option == 'ckpt_path' else ''}"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            readable = any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        readable = False
    if not readable:
        raise UsageError(
            f"{option}: {path} is not a readable checkpoint (truncated, or not written by torch.save); "
            "give a .ckpt file that lit-rl fit wrote"
        )


def config_files(args: list[str]) -> list[str]:
    files = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config", "-c")]
    return files + [a.split("=", 1)[1] for a in args if a.startswith("--config=")]


def _did_you_mean(section: str, name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f"did you mean {section}{close[0]}?" if close else _HELP


# ------------------------------------------------------------------------------------------------ after a failure


def explain_error(err: BaseException) -> str | None:
    """The one line (without ``error: ``) that answers a user's mistake, or ``None`` for a bug.

    Args:
        err: what the command raised.

    A user's mistake is, anywhere in the chain of causes, a :class:`UsageError`, an exception that lit-rl
    or Lightning raise on purpose (jsonargparse wraps a method's refusal in its own message, Lightning
    re-raises it as it is), what jsonargparse refuses while parsing, or a file or network error.
    """
    chain = _causes(err)
    for cause in chain:
        if isinstance(cause, UsageError) or _raised_on_purpose(cause):
            return " ".join(str(cause).split()) or type(cause).__name__
    for cause in chain:
        if isinstance(cause, argparse.ArgumentError):
            return _parse_error(cause, chain)
    for cause in chain:
        if isinstance(cause, OSError):
            return " ".join(str(cause).split()) or type(cause).__name__
    return None


def _causes(err: BaseException | None) -> list[BaseException]:
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


@dataclass
class JsonargparseReport:
    """What a jsonargparse parse error says, read from its text by :func:`read_jsonargparse_message`.

    Args:
        setting: the dotted setting (``model.loss_type``), ``init_args`` left out.
        class_path: the class whose arguments were parsed, if any.
        option: an option the class or parser does not take.
        expected: the type a value should have had (``int``, ``typing.Literal['a', 'b']``).
        choices: the accepted values, when ``expected`` is a ``Literal`` (``'a', 'b'``).
        got: the value given.
        detail: the message's first line that is not jsonargparse's framing.
    """

    setting: str = ""
    class_path: str = ""
    option: str = ""
    expected: str = ""
    choices: str = ""
    got: str = ""
    detail: str = ""
    unrecognized: list[str] = field(default_factory=list)
    base_class: str = ""  # "Import path does not correspond to a subclass of <base_class>"


#: lines of jsonargparse's Union report that frame the error without saying what is wrong
_FRAMING = ("Parser key", "Problem with given", "Does not validate against", "Subtypes:", "Errors:", "Given value",
            "Expected a <class 'NoneType'>")  # fmt: skip


def read_jsonargparse_message(message: str) -> JsonargparseReport:
    """Read the field, class and problem out of a jsonargparse parse error's text (the one place that does).

    jsonargparse reports a nested refusal as text only: ``Parser key "model": ... Problem with given
    class_path 'X': Parser key "loss_type": Expected a typing.Literal[...]. Got value: ppo``. The wording
    read here is that of the jsonargparse releases ``pyproject.toml`` allows.

    Args:
        message: ``str()`` of the ``ArgumentError`` jsonargparse raised.
    """
    lines = [line.strip().removeprefix("- ") for line in message.strip().splitlines() if line.strip()]
    keys = [m.group(1) for line in lines for m in [re.match(r'Parser key "([^"]+)"', line)] if m]
    report = JsonargparseReport(setting=".".join(k for k in keys if k not in ("init_args", "config")))
    for line in lines:
        if match := re.search(r"does not correspond to a subclass of (\w+)", line):
            report.base_class = match.group(1)
        if match := re.search(r"given class_path '([^']+)'", line):
            report.class_path = report.class_path or match.group(1)
        elif match := re.search(r"Option '([^']+)' is not accepted|does not accept option '([^']+)'", line):
            report.option = report.option or match.group(1) or match.group(2)
        elif match := re.match(r"Expected a (.*?)(?:\. Got value: (.*))?$", line):
            if "NoneType" not in match.group(1) and not report.expected:
                report.expected = re.sub(r"<class '([^']+)'>", r"\1", match.group(1))
                report.got = match.group(2) or ""
                if choices := re.fullmatch(r"typing\.Literal\[(.*)\]", report.expected):
                    report.choices = choices.group(1)
        elif line.startswith("Given value:") and not report.got:
            report.got = line.split(":", 1)[1].strip()
        elif line.startswith("unrecognized arguments:"):
            report.unrecognized = line.split(":", 1)[1].split()
    details = [line for line in lines if not line.startswith(_FRAMING)]
    report.detail = details[0] if details else (lines[0] if lines else message)
    return report


def _parse_error(err: argparse.ArgumentError, chain: list[BaseException]) -> str:
    """A jsonargparse parse error as ``<field>: <what is wrong>; <the fix>``."""
    report = read_jsonargparse_message(str(err))
    setting = report.setting
    if report.class_path and any(isinstance(c, ImportError) for c in chain):
        example = _EXAMPLE.get(setting, "a class's full import path")
        return f"{setting}.class_path: cannot import {report.class_path!r}; give an importable class, e.g. {example}"
    if report.base_class:
        example = _EXAMPLE.get(setting, "a class's full import path")
        return f"{setting}: {report.got!r} is not a subclass of {report.base_class}; give one, e.g. {example}"
    if report.option:
        if setting == "optimizer" and report.option in METHOD_OPTIONS:  # left out of --optimizer on purpose
            option = METHOD_OPTIONS[report.option]
            return f"optimizer.{report.option}: the method sets it; use --model.init_args.{option} instead"
        if report.class_path:
            hint = _suggest(report.option, report.class_path, setting)
            return f"{setting}.{report.option}: not an option of {report.class_path}; {hint}"
        return f"{'.'.join(filter(None, (setting, report.option)))}: not an option; {_HELP}"
    if report.expected:
        if report.choices:
            return f"{setting}: {report.got!r} is not one of {report.choices}; use one of them"
        return f"{setting}: expected {report.expected}, got {report.got!r}; give a value of type {report.expected}"
    if report.unrecognized:
        options = [a for a in report.unrecognized if a.startswith("-")] or report.unrecognized
        return f"{options[0].lstrip('-')}: not an option; {_HELP}"
    if setting:
        return f"{setting}: {report.detail}; {_HELP}"
    return f"arguments: {' '.join(str(err).split())}; {_HELP}"  # wording not read: jsonargparse's whole message


def _suggest(option: str, class_path: str, section: str) -> str:
    """Close option names of ``class_path`` (read from its signatures) and where the list is.

    A field of a dataclass group (``loss.beta``) is suggested for its bare name (``beta``), which is how an option
    read before it moved into the group.
    """
    module, _, name = class_path.rpartition(".")
    names: set[str] = set()
    grouped: dict[str, str] = {}  # field name -> group.field
    try:
        for klass in inspect.getmro(getattr(importlib.import_module(module), name)):
            if "__init__" in vars(klass):
                names |= set(inspect.signature(klass.__init__).parameters) - {"self", "args", "kwargs"}
                for group, hint in typing.get_type_hints(klass.__init__).items():
                    for kind in (hint, *typing.get_args(hint)):
                        if dataclasses.is_dataclass(kind):
                            grouped |= {f.name: f"{group}.{f.name}" for f in dataclasses.fields(kind)}
    except (ImportError, AttributeError, TypeError, ValueError, NameError):
        pass
    close = [grouped[option]] if option in grouped else difflib.get_close_matches(option, sorted(names), n=1)
    where = f"`lit-rl fit --{section.split('.')[0]}.help {name}` lists the options"
    return f"did you mean {close[0]}? {where}" if close else where
