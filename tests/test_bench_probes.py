"""bench/probes.py without a fit: which allocator a process map shows, and a run on another allocator than its arm
expects fails instead of being measured (the studies' quick runs cover the probes inside a fit)."""

from __future__ import annotations

import pytest
from bench_loader import load_bench
from lightning.pytorch.utilities.exceptions import MisconfigurationException

MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 131 /usr/bin/python3.11
7f1c2a000000-7f1c2a021000 rw-p 00000000 00:00 0
7f1c2b000000-7f1c2b00c000 r-xp 0000c000 08:01 262 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2
7f1c2c000000-7f1c2c010000 r-xp 00000000 08:01 263 /usr/lib/x86_64-linux-gnu/libc.so.6
7ffd1a000000-7ffd1a021000 rw-p 00000000 00:00 0                          [stack]
"""


@pytest.fixture(scope="module")
def probes():
    with load_bench("probes.py") as module:
        yield module


def test_maps_show_which_allocator_is_loaded(probes):
    assert probes.mapped_allocators(MAPS) == {"jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}
    tcmalloc = MAPS.replace("libjemalloc.so.2", "libtcmalloc_minimal.so.4.5.10")
    assert probes.mapped_allocators(tcmalloc) == {"tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10"}
    assert probes.mapped_allocators(MAPS.replace("libjemalloc", "libfoo")) == {}


def test_a_run_on_another_allocator_than_expected_fails(probes, monkeypatch):
    monkeypatch.setattr(probes, "allocator_in_process", lambda: {"name": "glibc", "version": "2.36"})
    with pytest.raises(MisconfigurationException, match="runs on glibc, not jemalloc"):
        probes.Allocator(expect="jemalloc").setup(None, None, "fit")
    probes.Allocator(expect="glibc").setup(None, None, "fit")


def test_a_malloc_conf_jemalloc_did_not_apply_fails(probes, monkeypatch):
    found = {"name": "jemalloc", "path": "/l/libjemalloc.so.2", "version": "5.3.0"}
    found["settings"] = {"background_thread": False, "dirty_decay_ms": 10000, "muzzy_decay_ms": 0}
    monkeypatch.setattr(probes, "allocator_in_process", lambda: found)
    monkeypatch.setenv("MALLOC_CONF", "background_thread:true,dirty_decay_ms:1000")
    with pytest.raises(MisconfigurationException, match="background_thread:true not applied"):
        probes.Allocator(expect="jemalloc").setup(None, None, "fit")
    monkeypatch.setenv("MALLOC_CONF", "background_thread:false,dirty_decay_ms:10000")
    probes.Allocator(expect="jemalloc").setup(None, None, "fit")
