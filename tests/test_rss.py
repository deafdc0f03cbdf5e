"""Peak RSS: reset and read the kernel's high-water mark, the sources this machine offers, the stage timer."""

from __future__ import annotations

import mmap
import sys

import pytest

from lit_rl.memory.rss import peak_rss_stage, probe_rss_source, read_peak_rss, reset_peak_rss

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux-only")


@linux
def test_reset_then_read_gives_a_positive_peak():
    reset_peak_rss()
    assert read_peak_rss("vmhwm") > 0
    assert read_peak_rss("getrusage") > 0


def test_unknown_or_missing_source_reads_nothing():
    assert read_peak_rss(None) is None
    assert read_peak_rss("psutil") is None
    assert probe_rss_source() in ("vmhwm", "getrusage", None)


@linux
def test_a_touched_200_mb_allocation_raises_the_peak():
    if not reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable here: the peak cannot be reset")
    before = read_peak_rss("vmhwm")
    # 200 MiB of fresh pages, every one written: an anonymous mapping, not malloc, which may hand back pages that an
    # earlier test freed but left resident (the peak would then rightly not move)
    block = mmap.mmap(-1, 200 * 2**20)
    block.write(b"\1" * len(block))
    block.close()
    assert read_peak_rss("vmhwm") - before >= 150 * 2**20
    assert probe_rss_source() == "vmhwm"


def test_stage_times_and_measures_a_block():
    with peak_rss_stage() as small:
        pass
    with peak_rss_stage() as big:
        # fresh pages from an anonymous mapping, for the reason given in the test above: a numpy array may be served
        # from pages that earlier tests freed but left resident, and then the peak rightly does not move
        block = mmap.mmap(-1, 200 * 2**20)
        block.write(b"\1" * len(block))
        block.close()
    assert big.elapsed_s > 0 and big.cpu_s > 0  # writing 200 MiB takes measurable time (0.0 is the unset default)
    if sys.platform.startswith("linux"):
        assert big.peak_rss_gib > 0
    if big.per_stage:
        assert big.peak_rss_gib - small.peak_rss_gib > 0.1
