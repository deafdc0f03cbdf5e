"""EmptyCache on CPU: glibc's freed heap pages go back to the OS at phase ends, its settings, a tiny GRPO fit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lit_rl.callbacks import EmptyCache, MemoryProfiler
from lit_rl.callbacks import empty_cache as empty_cache_module
from lit_rl.data import PromptDataModule
from lit_rl.memory.host_allocator import glibc, malloc_library, malloc_trim
from lit_rl.memory.phases import PhaseTracker
from lit_rl.memory.rss import read_rss
from lit_rl.methods import RefCachedGRPO

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
PHASES = ("rollout", "reference", "policy_forward", "backward", "optimizer")
needs_glibc = pytest.mark.skipif(glibc() is None or read_rss() is None, reason="malloc_trim is glibc's; VmRSS Linux's")


def longer_is_better(completions, **_):
    return [float(len(c)) for c in completions]


def _fragmented_heap(total_mib: int = 400) -> list[torch.Tensor]:
    """Allocate ``total_mib`` of 16 KiB tensors (below any mmap threshold: heap) and free 9 in 10.

    The survivors pin the heap, so glibc cannot shrink its top on free: without malloc_trim the freed
    pages stay in the process.
    """
    blocks = [torch.ones(4096) for _ in range(total_mib * MIB // (4096 * 4))]  # 16 KiB each, every page touched
    return blocks[::10]


def _cpu_run(callback: EmptyCache):
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), loggers=[], global_step=0)
    logged = []
    trainer.loggers.append(SimpleNamespace(log_metrics=lambda metrics, step=None: logged.append((step, metrics))))
    module = SimpleNamespace(phases=PhaseTracker(PHASES))
    callback.setup(trainer, module, "fit")
    return trainer, module, logged


@needs_glibc
def test_malloc_trim_returns_freed_heap_pages():
    malloc_trim()
    survivors = _fragmented_heap(400)
    before = read_rss()
    malloc_trim()
    after = read_rss()
    assert before - after > 250 * MIB, (before / MIB, after / MIB)  # 360 MiB were freed
    del survivors


@needs_glibc
def test_trim_at_phase_end_lowers_rss_and_logs_it():
    empty = EmptyCache(phases=["rollout"], when="end")
    trainer, module, logged = _cpu_run(empty)
    malloc_trim()
    with module.phases("rollout"):
        survivors = _fragmented_heap(400)
        held = read_rss()
    assert held - read_rss() > 250 * MIB  # released when the phase ended
    with module.phases("reference"):  # not in `phases`: nothing released, nothing counted
        pass
    trainer.global_step = 3
    empty.on_train_batch_end(trainer, module, None, None, 0)
    ((step, metrics),) = logged
    assert step == 3 and metrics["memory/empty_cache/freed_gib"] > 250 * MIB / 2**30
    del survivors


_THRESHOLD_SCRIPT = """
import sys, torch
from lit_rl.memory.host_allocator import set_malloc_thresholds
from lit_rl.memory.rss import read_rss
if sys.argv[1] == "mallopt":
    set_malloc_thresholds(65536, 65536)
big = torch.ones(16 * 2**20 // 4); del big  # glibc's dynamic threshold would now rise to 16 MiB
blocks = [torch.ones(2**20 // 4) for _ in range(300)]  # 300 x 1 MiB
before = read_rss()
survivors = blocks[::10]; del blocks
print((before - read_rss()) / 2**20)
"""


@needs_glibc
@pytest.mark.slow  # a fresh interpreter that allocates and frees 300 MiB
@pytest.mark.parametrize("setting", ["default", "mallopt"])
def test_mallopt_thresholds_unmap_blocks_on_free(setting):
    """In a fresh process: with the 64 KiB thresholds freed 1 MiB blocks leave at once; with glibc's they stay."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_THRESHOLD_SCRIPT), setting],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    released_mib = float(done.stdout.strip().splitlines()[-1])
    if setting == "mallopt":
        assert released_mib > 200
    else:
        assert released_mib < 100


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        (dict(mmap_threshold=64 * MIB), r"0 to 33554432 bytes.*e\.g\. 65536, or null"),
        (dict(trim_threshold=-1), r"byte count >= 0.*or null"),
        (dict(when="middle"), r"use 'start' or 'end'"),
        (dict(phases=["rollout", "generate"]), r"unknown phase\(s\) \['generate'\].*or use phases: all"),
    ],
)
def test_settings_errors_name_the_fix(kwargs, fix):
    with pytest.raises(MisconfigurationException, match=fix):
        _cpu_run(EmptyCache(**kwargs))


@needs_glibc
def test_phases_all_means_every_declared_phase(monkeypatch):
    released = []
    empty = EmptyCache(phases="all")
    monkeypatch.setattr(empty, "_release", lambda: released.append(module.phases.current))
    _, module, _ = _cpu_run(empty)
    for name in PHASES:
        with module.phases(name):
            pass
    assert released == list(PHASES)


def test_without_glibc_it_is_a_noop_and_says_why_once(monkeypatch, lightning_log):
    monkeypatch.setattr(empty_cache_module, "why_not_glibc", lambda: "the C library of Darwin is not glibc")
    empty = EmptyCache(phases="all")
    trainer, module, logged = _cpu_run(empty)
    _cpu_run(empty)
    with module.phases("rollout"):
        pass
    empty.on_train_batch_end(trainer, module, None, None, 0)
    assert not logged
    said = [message for message in lightning_log.matching("not glibc") if "no-op" in message]
    assert len(said) == 1, said


LIBS = Path("/usr/lib/x86_64-linux-gnu")  # Debian's libjemalloc2 and libtcmalloc-minimal4
PRELOADS = [path for path in (LIBS / "libjemalloc.so.2", LIBS / "libtcmalloc_minimal.so.4") if path.exists()]


@pytest.mark.skipif(not PRELOADS or glibc() is None, reason="glibc, and libjemalloc2 or libtcmalloc-minimal4")
@pytest.mark.parametrize("library", PRELOADS, ids=lambda path: path.name)
def test_under_a_preloaded_allocator_glibc_is_not_used_and_empty_cache_says_so(library):
    child = textwrap.dedent(
        """
        import logging, torch
        from types import SimpleNamespace
        from lit_rl.callbacks import EmptyCache
        from lit_rl.memory.host_allocator import glibc, malloc_library, why_not_glibc
        from lit_rl.memory.phases import PhaseTracker
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        logging.getLogger("lightning.pytorch").setLevel(logging.INFO)
        trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), loggers=[])
        EmptyCache(phases="all").setup(trainer, SimpleNamespace(phases=PhaseTracker(("rollout",))), "fit")
        print("library", malloc_library(), "glibc", glibc() is not None)
        """
    )
    env = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(library)}
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"library {library.name} glibc False" in out.stdout
    said = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("EmptyCache:")]
    assert len(said) == 1 and f"malloc is {library.name}'s, not glibc's" in said[0] and "no-op" in said[0]


@pytest.mark.skipif(not sys.platform.startswith("linux") or "LD_PRELOAD" in os.environ, reason="Linux, no preload")
def test_malloc_library_finds_the_c_library_without_a_preload():
    assert malloc_library() in ("libc.so.6", "libc.musl-x86_64.so.1", "libc.musl-aarch64.so.1")


@needs_glibc
def test_tiny_grpo_fit_trims_and_the_profiler_still_logs_tensor_peak_beside_rss(tmp_path, capture_logger):
    method = RefCachedGRPO(
        name_or_path="tiny:llama", reward_funcs=["test_empty_cache.longer_is_better"], max_new_tokens=6,
        num_generations=4, learning_rate=1e-2,
    )  # fmt: skip
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=capture_logger, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1, default_root_dir=tmp_path,
        callbacks=[MemoryProfiler(predict=False), EmptyCache(phases="all")],
    )  # fmt: skip
    trainer.fit(method, PromptDataModule(num_prompts=16, batch_size=2, max_prompt_length=64))
    metrics = capture_logger.metrics
    assert [step for step, _ in metrics["memory/empty_cache/freed_gib"]] == [1, 2]
    for key in ("memory/step/peak_gib", "memory/step/rss_peak_gib"):
        assert len(metrics[key]) == 2 and all(v > 0 for _, v in metrics[key]), key
    # RSS holds the interpreter and libraries besides the tensors: it sits above the tensor peak
    assert all(
        rss > peak for (_, rss), (_, peak) in zip(metrics["memory/step/rss_peak_gib"], metrics["memory/step/peak_gib"])
    )


@pytest.mark.parametrize(
    ("config", "released"),
    [("grpo.yaml", ["rollout", "reference"]), ("intuitor.yaml", ["rollout", "reference"]),
     ("gumbel_topk.yaml", ["generate"])],
)  # fmt: skip
def test_the_fragment_composes_with_every_method_config(config, released, tmp_path, monkeypatch):
    """callbacks/empty_cache.yaml's defaults fit each method's own phases: its setup accepts them, and it releases
    after the phases before the update's forward (no fit needed: setup is where a phase list is checked)."""
    from lit_rl.cli import LitRLCLI

    args = [
        "--config", str(ROOT / "configs" / config), "--config", str(ROOT / "callbacks" / "empty_cache.yaml"),
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
        "--trainer.precision", "32-true", "--trainer.default_root_dir", str(tmp_path),
    ]  # fmt: skip
    cli = LitRLCLI(args=args, run=False)
    (empty,) = [c for c in cli.trainer.callbacks if isinstance(c, EmptyCache)]
    method = cli.model
    calls = []
    monkeypatch.setattr(empty, "_release", lambda: calls.append(method.phases.current))
    monkeypatch.setattr(empty_cache_module, "why_not_glibc", lambda: None)  # the same on any C library
    empty.setup(cli.trainer, method, "fit")
    for name in method.phase_names:
        with method.phases(name):
            pass
    empty.teardown(cli.trainer, method, "fit")
    assert calls == released
