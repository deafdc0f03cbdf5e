"""What the allocator study's table needs beyond logged scalars: the workload's tensor peak (from its profiled run),
the runtime's baseline, the ratio of the peak RSS to both, and the allocator each run found itself on.

A workload's arms share a name prefix (``lora_``; none for full-ft) and its profiled run is the sibling run folder
``<out>/<prefix>profile``, so ``--arms`` without it leaves the tensor peak and the ratio out. ``probes.Allocator``
logs the RSS and the tensor bytes at train start and writes ``Allocator: <name> <version> <JSON>`` in the run's
``fit.log``.
"""

from __future__ import annotations

import json
import re

from harness import read_scalar_events

FOUND = re.compile(r"^Allocator: .*?(\{.*\})$", re.M)


def _profile_peak(arm) -> float | None:
    """GiB: the highest phase peak of the workload's profiled run, over its steps."""
    if "tensor_peak" not in arm.extra:
        prefix = "lora_" if arm.name.startswith("lora_") else ""
        runs = sorted((arm.run_dir.parents[2] / f"{prefix}profile" / "lightning_logs").glob("version_*"))
        events = read_scalar_events(str(runs[-1]), None) if runs else {}
        peaks = [e.value for k, v in events.items() if k.startswith("memory/") and k.endswith("/peak_gib") for e in v]
        arm.extra["tensor_peak"] = max(peaks) if peaks else None
    return arm.extra["tensor_peak"]


def _baseline(arm) -> float:
    return arm.values("bench/start/rss_gib")[0] - arm.values("bench/start/tensor_gib")[0]


def _found(arm) -> dict:
    log = arm.run_dir.parents[1] / "fit.log"
    found = FOUND.findall(log.read_text()) if log.exists() else []
    return json.loads(found[-1]) if found else {}


def tensor_peak(arm) -> str:
    peak = _profile_peak(arm)
    return "—" if peak is None else f"{peak:.2f}"


def baseline(arm) -> str:
    return f"{_baseline(arm):.2f}"


def ratio(arm) -> str:
    peak = _profile_peak(arm)
    return "—" if peak is None else f"{arm.record['peak_rss'] / 2**30 / (peak + _baseline(arm)):.2f}x"


def timed(arm) -> str:
    return str(max(len(arm.values("bench/step/wall_s")) - 1, 1))


def allocator(arm) -> str:
    found = _found(arm)
    return " ".join(filter(None, [found.get("name", "not recorded"), found.get("version")]))


cells = {f.__name__: f for f in (tensor_peak, baseline, ratio, timed, allocator)}


def after(study: dict, arms: list, results) -> list[str]:
    """A note of the library each preloading arm ran on and the settings jemalloc read back."""
    notes = []
    for arm in arms:
        found, env = _found(arm), study["arms"][arm.name]["env"]
        if found.get("path"):
            conf = f" `MALLOC_CONF={env['MALLOC_CONF']}`" if "MALLOC_CONF" in env else ""
            settings = found.get("settings")
            read = f" (jemalloc reads back {', '.join(f'{k} {v}' for k, v in settings.items())})" if settings else ""
            notes.append(f"`{arm.name}`: `LD_PRELOAD={found['path']}`{conf}{read}")
    return ["", "Preloaded, and mapped in the run: " + "; ".join(notes) + "."] if notes else []
