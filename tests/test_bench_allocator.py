"""bench/bench_allocator.py: the environment and allocator check of each option (fast), and --quick end to end (fresh
subprocesses, one per option), so it cannot rot."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from bench_loader import load_bench

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_allocator.py"


@pytest.fixture(scope="module")
def bench():
    with load_bench("bench_allocator.py") as module:
        yield module


def installed(allocator: str) -> bool:
    with load_bench("bench_allocator.py") as module:
        return module.find_library(allocator)[0] is not None


MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 131 /usr/bin/python3.11
7f1c2a000000-7f1c2a021000 rw-p 00000000 00:00 0
7f1c2b000000-7f1c2b00c000 r-xp 0000c000 08:01 262 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2
7f1c2c000000-7f1c2c010000 r-xp 00000000 08:01 263 /usr/lib/x86_64-linux-gnu/libc.so.6
7ffd1a000000-7ffd1a021000 rw-p 00000000 00:00 0                          [stack]
"""


def test_maps_show_which_allocator_is_loaded(bench):
    assert bench.mapped_libraries(MAPS) == {"jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}
    tcmalloc = MAPS.replace("libjemalloc.so.2", "libtcmalloc_minimal.so.4.5.10")
    assert bench.mapped_libraries(tcmalloc) == {"tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10"}
    assert bench.mapped_libraries(MAPS.replace("libjemalloc", "libfoo")) == {}


def test_child_env_preloads_the_library_and_drops_inherited_allocator_settings(bench, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/somewhere/libtcmalloc.so.4")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    monkeypatch.setenv("MALLOC_CONF", "narenas:1")
    monkeypatch.setenv("KEEP_ME", "1")
    lib = Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    none = bench.child_env("none")
    assert not {"LD_PRELOAD", "MALLOC_ARENA_MAX", "MALLOC_CONF"} & set(none) and none["KEEP_ME"] == "1"
    assert none["PYTHONPATH"].split(os.pathsep)[0] == str(BENCH.parents[1])
    env64 = bench.child_env("env 64K")
    assert env64["MALLOC_MMAP_THRESHOLD_"] == env64["MALLOC_TRIM_THRESHOLD_"] == "65536" and "LD_PRELOAD" not in env64
    jemalloc = bench.child_env("jemalloc", lib)
    assert jemalloc["LD_PRELOAD"] == str(lib) and "MALLOC_CONF" not in jemalloc
    variant = bench.child_env("jemalloc decay 1s", lib)
    assert variant["LD_PRELOAD"] == str(lib) and "dirty_decay_ms:1000" in variant["MALLOC_CONF"]
    assert (
        bench.child_env("tcmalloc", Path("/x/libtcmalloc_minimal.so.4"))["LD_PRELOAD"] == "/x/libtcmalloc_minimal.so.4"
    )
    with pytest.raises(ValueError, match="pass its library"):
        bench.child_env("jemalloc")


def test_find_library_searches_the_folders_and_honours_the_override(bench, tmp_path, monkeypatch):
    monkeypatch.delenv("LIT_RL_JEMALLOC", raising=False)
    monkeypatch.setattr(bench, "library_dirs", lambda: [tmp_path / "empty", tmp_path])
    assert bench.find_library("jemalloc") == (None, "not installed (apt-get install libjemalloc2)")
    assert bench.find_library("tcmalloc") == (None, "not installed (apt-get install libtcmalloc-minimal4)")
    (tmp_path / "libjemalloc.so.2").write_bytes(b"")
    assert bench.find_library("jemalloc") == (tmp_path / "libjemalloc.so.2", "")
    monkeypatch.setenv("LIT_RL_JEMALLOC", str(tmp_path / "missing.so"))
    path, why = bench.find_library("jemalloc")
    assert path is None and why.startswith("not found: LIT_RL_JEMALLOC=") and "missing.so" in why


def test_allocator_problem_rejects_a_silent_fallback_and_an_ignored_conf(bench):
    glibc = {"name": "glibc", "version": "2.36"}
    jemalloc = {"name": "jemalloc", "path": "/l/libjemalloc.so.2", "version": "5.3.0-0-gabc"}
    defaults = jemalloc | {"settings": {"background_thread": False, "dirty_decay_ms": 10000, "muzzy_decay_ms": 0}}
    tuned = jemalloc | {"settings": {"background_thread": True, "dirty_decay_ms": 1000, "muzzy_decay_ms": 0}}
    assert bench.allocator_problem("none", glibc) == bench.allocator_problem("jemalloc", defaults) == ""
    assert bench.allocator_problem("jemalloc", glibc) == "runs on glibc, not jemalloc"
    assert bench.allocator_problem("none", defaults) == "runs on jemalloc, not glibc"
    assert bench.allocator_problem("jemalloc decay 1s", tuned) == ""
    assert "background_thread:true not applied" in bench.allocator_problem("jemalloc decay 1s", defaults)
    assert bench.allocator_label(defaults) == "jemalloc 5.3.0"
    assert bench.allocator_label({"name": "tcmalloc", "version": "gperftools 2.10"}) == "tcmalloc 2.10"


def fake_run(workload, option, profile=False, library=None):
    """What a child reports, without a fit: the allocator is what the option asks for."""
    name = "glibc" if option not in {"jemalloc", "jemalloc decay 1s", "tcmalloc"} else option.split()[0]
    allocator = {"name": name, "version": "1.0"} | ({"path": str(library)} if library else {})
    rec = {"times": [2.0, 1.0], "cpu": [2.0, 1.0], "sys": [0.1, 0.1], "rss_start": 2**30, "tensors_start": 2**29}
    rec |= {"allocator": allocator, "peak_rss": 2 * 2**30, "wall": 1.0, "load": (1.0, 1.0)}
    return rec | ({"tensor_peak": 1.0} if profile else {})


def test_a_missing_library_is_a_row_that_says_so_not_a_measurement(bench, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "run_child", lambda w, o, **kw: calls.append(o) or fake_run(w, o, **kw))  # no fits
    monkeypatch.setattr(bench, "library_dirs", lambda: [tmp_path])  # nothing installed there
    monkeypatch.delenv("LIT_RL_JEMALLOC", raising=False)
    (tmp_path / "t.so").write_bytes(b"")
    monkeypatch.setenv("LIT_RL_TCMALLOC", str(tmp_path / "t.so"))
    real_probe = bench.probe  # jemalloc: the real one, which stops at the missing library
    loaded = {"name": "tcmalloc", "version": "1.0", "path": str(tmp_path / "t.so")}
    monkeypatch.setattr(bench, "probe", lambda o: (loaded, "") if o == "tcmalloc" else real_probe(o))
    text = bench.main(["--workloads", "tiny", "--rounds", "1", "--options", "none,jemalloc,tcmalloc"])
    rows = {
        r[0]: r
        for r in ([c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines() if ln.startswith("| "))
    }
    assert rows["jemalloc"][1] == "not installed (apt-get install libjemalloc2)" and len(rows["jemalloc"]) == 14
    assert rows["tcmalloc"][-1] == "tcmalloc 1.0" and rows["none"][-1] == "glibc 1.0"
    assert f"`tcmalloc`: `LD_PRELOAD={tmp_path / 't.so'}`" in text
    assert sorted(calls) == ["none", "none", "tcmalloc"]  # a round of each available option and the profile run


@pytest.mark.skipif(not installed("jemalloc"), reason="apt-get install libjemalloc2")
def test_probe_finds_jemalloc_loaded_with_the_variant_settings(bench, monkeypatch):
    monkeypatch.delenv("LIT_RL_JEMALLOC", raising=False)
    found, why = bench.probe("jemalloc decay 1s")
    assert why == "" and found["name"] == "jemalloc" and Path(found["path"]).name.startswith("libjemalloc")
    assert found["settings"]["dirty_decay_ms"] == 1000 and found["settings"]["background_thread"] is True


def test_probe_reports_a_preload_the_loader_ignored(bench, tmp_path, monkeypatch):
    not_a_library = tmp_path / "libjemalloc.so.2"
    not_a_library.write_text("not an ELF file\n")
    monkeypatch.setenv("LIT_RL_JEMALLOC", str(not_a_library))
    found, why = bench.probe("jemalloc")
    assert found is None and why.startswith("not loaded: runs on glibc, not jemalloc"), why


@pytest.mark.bench
def test_quick_bench_prints_a_row_per_option_and_resumes(bench, tmp_path, capsys):
    results = tmp_path / "runs.jsonl"
    text = bench.main(["--quick", "--results", str(results)])
    assert text in capsys.readouterr().out
    assert "This file: `python bench/bench_allocator.py --quick" in text
    body = text.split("### tiny", 1)[1].splitlines()[4:]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in body if ln.startswith("|")]
    assert [r[0] for r in rows] == ["none", "trim", "env 64K"]
    for option, rss, _spread, _tensor, baseline, ratio, *_ in rows:
        assert float(rss) > 0 and float(baseline) > 0 and float(ratio.rstrip("x")) > 0, option
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert {(r["option"], r["run"]) for r in records} == {
        ("none", "0"),
        ("trim", "0"),
        ("env 64K", "0"),
        ("none", "profile"),
    }
    assert all(r["peak_rss"] > 0 and r["times"] and len(r["cpu"]) == len(r["times"]) for r in records)
    # a second call with the same results file measures nothing again: the same table
    assert bench.main(["--quick", "--results", str(results)]).split("\n", 2)[2] == text.split("\n", 2)[2]
