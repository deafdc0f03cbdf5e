"""Checkpoints streamed to disk: the same file as Lightning's save, written atomically (a failure or a kill during a
save leaves the previous checkpoint whole), without the serialized copy in memory, the default of every ``lit-rl`` run,
shown in its saved config, measured by the MemoryProfiler, and resumed from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import fsspec
import pytest
import torch
import yaml
from csv_logs import logged
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lit_rl.callbacks import StreamingCheckpointIO
from lit_rl.callbacks.checkpoint_io import TEMP_SUFFIX, remove_stale_temp_files
from lit_rl.cli import LitRLCLI, main

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _checkpoint(mib: int = 8, seed: int = 0) -> dict:
    """A checkpoint-shaped dict of about ``mib`` MiB: weights and AdamW-like state, a view, plain values."""
    g = torch.Generator().manual_seed(seed)
    rows = mib * 256 // 12  # 4 weights and their two moments, 4 KiB a row
    weights = {f"layer{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(4)}
    moments = [{"step": torch.tensor(3.0), "exp_avg": w * 0.1, "exp_avg_sq": w.square()} for w in weights.values()]
    state = dict(enumerate(moments))
    tied = weights["layer0.weight"][:8]  # a view: saved as a slice of the same storage
    return {"state_dict": {**weights, "tied": tied}, "optimizer_states": [{"state": state}], "global_step": 7,
            "hyper_parameters": {"name": "tiny", "lr": 1e-3}}  # fmt: skip


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    else:
        assert a == b


def _partial_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f".*{TEMP_SUFFIX}"))


# ------------------------------------------------------------------------------------------ the file written


def test_the_streamed_file_is_the_file_lightning_writes(tmp_path):
    checkpoint = _checkpoint(mib=2)
    TorchCheckpointIO().save_checkpoint(checkpoint, tmp_path / "lightning.ckpt")
    io = StreamingCheckpointIO()
    io.save_checkpoint(checkpoint, tmp_path / "sub" / "streamed.ckpt")  # the folder is made
    streamed = tmp_path / "sub" / "streamed.ckpt"
    assert streamed.read_bytes() == (tmp_path / "lightning.ckpt").read_bytes()
    loaded = io.load_checkpoint(streamed, weights_only=True)
    _assert_same(loaded, TorchCheckpointIO().load_checkpoint(tmp_path / "lightning.ckpt", weights_only=True))
    _assert_same(loaded, checkpoint)
    assert io.last_save.path == str(streamed) and io.last_save.bytes == streamed.stat().st_size
    assert io.last_save.streamed and io.last_save.seconds > 0
    assert _partial_files(tmp_path / "sub") == []
    assert oct(streamed.stat().st_mode & 0o777) == oct((tmp_path / "lightning.ckpt").stat().st_mode & 0o777)


def test_a_remote_url_is_saved_the_lightning_way():
    io = StreamingCheckpointIO()
    io.save_checkpoint(_checkpoint(mib=1), "memory://checkpoints/last.ckpt")
    assert not io.last_save.streamed
    with fsspec.open("memory://checkpoints/last.ckpt", "rb") as f:
        assert torch.load(f, weights_only=True)["global_step"] == 7
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(_checkpoint(mib=1), "unused.ckpt", storage_options={"a": 1})


@pytest.mark.parametrize("io_class", [TorchCheckpointIO, StreamingCheckpointIO])
def test_streaming_holds_no_serialized_copy_in_memory(io_class, tmp_path):
    """Python-heap peak during a save: Lightning's own IO holds the whole serialized checkpoint, the streaming IO
    kilobytes (its tensors' bytes go from their storages straight to the file)."""
    checkpoint = _checkpoint(mib=32)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        io_class().save_checkpoint(checkpoint, tmp_path / "last.ckpt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = (tmp_path / "last.ckpt").stat().st_size
    assert size > 30 * MIB
    if io_class is StreamingCheckpointIO:
        assert peak < size / 50, (peak, size)
    else:  # the measurement can see the copy: what this test guards against
        assert peak >= size, (peak, size)


# ------------------------------------------------------------------------------------------------ atomicity


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def _partial_write_then(error: BaseException):
    """A ``torch.save`` stand-in that writes part of a checkpoint, then fails as a full disk would."""

    def save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04" + b"\0" * MIB)
        raise error

    return save


@pytest.mark.parametrize("failure", ["pickling", "disk full mid-write", "interrupt mid-write", "fsync", "rename"])
def test_a_failed_save_leaves_the_previous_checkpoint_whole(failure, tmp_path, monkeypatch):
    io = StreamingCheckpointIO()
    last = tmp_path / "last.ckpt"
    io.save_checkpoint(_checkpoint(mib=1, seed=0), last)
    before = last.read_bytes()
    checkpoint = _checkpoint(mib=1, seed=1)
    expected: type[BaseException] = OSError
    if failure == "pickling":
        checkpoint["callbacks"] = {"broken": _Unpicklable()}
        expected = RuntimeError
    elif failure == "disk full mid-write":
        monkeypatch.setattr(torch, "save", _partial_write_then(OSError(28, "No space left on device")))
    elif failure == "interrupt mid-write":
        monkeypatch.setattr(torch, "save", _partial_write_then(KeyboardInterrupt()))
        expected = KeyboardInterrupt
    elif failure == "fsync":
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    else:
        monkeypatch.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(18, "Invalid cross-device link")))
    with pytest.raises(expected):
        io.save_checkpoint(checkpoint, last)
    monkeypatch.undo()
    assert last.read_bytes() == before
    assert io.load_checkpoint(last, weights_only=True)["global_step"] == 7
    assert io.last_save is None  # no record of a save that did not happen
    assert _partial_files(tmp_path) == []  # a failure that Python sees cleans its own temporary file


KILLED_MID_SAVE = textwrap.dedent(
    """
    import os, signal, sys, torch
    from lit_rl.callbacks import StreamingCheckpointIO

    real_save = torch.save

    def save_then_die(obj, f, *args, **kwargs):
        class Dying:  # the process is SIGKILLed once part of the file is written
            written = 0
            def write(self, data):
                f.write(data)
                Dying.written += len(data)
                if Dying.written > 2**20:
                    f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                return len(data)
            def flush(self):
                f.flush()
        real_save(obj, Dying(), *args, **kwargs)

    torch.save = save_then_die
    StreamingCheckpointIO().save_checkpoint({"w": torch.ones(4 * 2**20), "global_step": 8}, sys.argv[1])
    """
)


@pytest.mark.slow  # a subprocess
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_and_a_stale_temp_file_the_next_save_removes(tmp_path):
    last = tmp_path / "last.ckpt"
    io = StreamingCheckpointIO()
    io.save_checkpoint(_checkpoint(mib=1), last)
    before = last.read_bytes()
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(last)], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert last.read_bytes() == before
    (stale,) = _partial_files(tmp_path)
    assert stale.name.startswith(".last.ckpt.") and stale.stat().st_size > MIB  # torn, and obviously a temp file
    io.save_checkpoint(_checkpoint(mib=1, seed=2), tmp_path / "epoch=0-step=9.ckpt")
    assert _partial_files(tmp_path) == []


def test_only_temp_files_of_processes_that_are_gone_are_removed(tmp_path):
    dead = tmp_path / f".last.ckpt.999999999-0123abcd{TEMP_SUFFIX}"  # above any pid Linux gives out
    running = tmp_path / f".last.ckpt.{os.getppid()}-0123abcd{TEMP_SUFFIX}"  # a save in progress elsewhere
    mine = tmp_path / f".step.ckpt.{os.getpid()}-0123abcd{TEMP_SUFFIX}"
    other = tmp_path / f".notes{TEMP_SUFFIX}"  # not a name this IO writes
    for path in (dead, running, mine, other):
        path.write_bytes(b"x")
    assert remove_stale_temp_files(tmp_path) == [dead]
    assert sorted(_partial_files(tmp_path)) == sorted([running, mine, other])


# ------------------------------------------------------------------------------------ the lit-rl default


def vowels(completions, **_):
    """A reward that differs between completions of a random model, so that every step changes the weights."""
    return [sum(ch in "aeiou" for ch in c) / 8 for c in completions]


def _tiny_args(root: Path, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs/grpo_tiny.yaml"), "--trainer.default_root_dir", str(root),
            "--model.init_args.max_new_tokens", "4", "--model.init_args.reward_funcs", "[test_checkpoint_io.vowels]",
            "--trainer.enable_progress_bar", "false", *extra]  # fmt: skip


def test_every_lit_rl_run_saves_with_the_streaming_io_unless_told_otherwise(tmp_path, capsys):
    cli = LitRLCLI(args=_tiny_args(tmp_path), run=False)
    assert type(cli.trainer.strategy.checkpoint_io) is StreamingCheckpointIO
    cli = LitRLCLI(args=_tiny_args(tmp_path, "--trainer.plugins", "null"), run=False)
    assert type(cli.trainer.strategy.checkpoint_io) is TorchCheckpointIO
    with pytest.raises(SystemExit):
        LitRLCLI(args=["fit", *_tiny_args(tmp_path), "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["plugins"] == [{"class_path": "lit_rl.callbacks.StreamingCheckpointIO"}]


@pytest.mark.slow  # two short fits through the CLI
def test_a_run_streams_its_checkpoints_measures_the_saves_and_resumes_from_them(tmp_path):
    every_step = {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 1, "save_last": True}
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": every_step}
    profiler = {"class_path": "lit_rl.callbacks.MemoryProfiler",
                "init_args": {"predict": False, "track_tensors": False}}  # fmt: skip
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
              "init_args": {"save_dir": str(tmp_path), "name": "log", "flush_logs_every_n_steps": 1}}  # fmt: skip
    callbacks = [checkpoint, profiler]
    run = {"trainer": {"max_steps": 2, "enable_checkpointing": True, "logger": logger, "callbacks": callbacks}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    args = ["fit", *_tiny_args(tmp_path, "--config", str(tmp_path / "run.yaml"))]
    main(args)

    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert torch.load(tmp_path / "ckpt" / "epoch=0-step=2.ckpt", weights_only=True)["global_step"] == 2
    assert _partial_files(tmp_path / "ckpt") == []
    (saved_config,) = tmp_path.rglob("config.yaml")
    assert yaml.safe_load(saved_config.read_text())["trainer"]["plugins"] == [
        {"class_path": "lit_rl.callbacks.StreamingCheckpointIO"}
    ]
    # the MemoryProfiler heard every save (a step's checkpoint and last.ckpt are two saves)
    summary = json.loads(next(tmp_path.rglob("memory_summary.json")).read_text())
    saves = summary["saves"]
    assert {Path(s["path"]).name for s in saves} == {"epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"}
    assert all(s["bytes"] > 0 and s["seconds"] > 0 for s in saves)
    if sys.platform.startswith("linux"):
        assert all(s["rss_peak_bytes"] >= s["rss_start_bytes"] > 0 for s in saves)
        assert set(logged(tmp_path, "memory/save/rss_peak_gib")) == {1, 2}
    assert set(logged(tmp_path, "time/save_s")) == {1, 2}  # at the global step of each save
    assert logged(tmp_path, "memory/save/checkpoint_gib")[2] == pytest.approx(last.stat().st_size / 2**30)

    before = torch.load(last, weights_only=True)["state_dict"]
    main([*args, "--trainer.max_steps", "3", "--ckpt_path", "last"])
    resumed = torch.load(last, weights_only=True)
    assert resumed["global_step"] == 3
    assert before.keys() == resumed["state_dict"].keys()
    assert any(not torch.equal(before[k], resumed["state_dict"][k]) for k in before), "the resumed step trained"
