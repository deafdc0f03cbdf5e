"""What the machine can do: matmul throughput per dtype and memory bandwidth, measured, saved and read back.

The roofline (:mod:`lit_rl.memory.roofline`) divides a phase's FLOPs by a matmul rate and its bytes by a bandwidth;
this module measures both on the device a run trains on, with plain torch calls:

- **matmul**: ``torch.mm`` of two square ``n x n`` matrices (``2 n^3`` FLOPs), the rate large GEMMs reach (the
  compute roof);
- **skinny matmul**: ``F.linear`` of ``[rows, k]`` by a ``[n, k]`` weight, the shape of one decode step's projections
  (a few rows per weight). Its weight stays in cache across repetitions, so this is the rate the library reaches
  on that shape, not a memory-bound rate;
- **bandwidth**: over a large tensor, ``dst.copy_(src)`` (bytes read + written), ``src.sum()`` (bytes read) and
  ``src.mul_(1.0)`` (read + written in place); the best of the three. On CPU the in-place pass is usually the best:
  a copy to another tensor also reads the destination's cache lines before writing them, which is not counted.

Every figure is the fastest of as many timings as fit in a time budget (at least 3), after a warm-up, so a burst of
load from other processes costs a timing, not the figure; a machine loaded throughout still measures low, most of all
in the long timings of large GEMMs. :func:`measure_rates` at its defaults (2 s per figure) is what
``lit-rl rates --out FILE`` writes (``bench/results/machine_rates.json``: ``python bench/study.py roofline``);
``quick=True`` (smaller shapes, 0.12 s per figure, under a second for one dtype) is what the MemoryProfiler measures
at the end of a run when it is given no file.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

#: the shapes :func:`measure_rates` uses: full (the bench) and quick (the profiler's end-of-run measurement)
SIZES = {
    False: dict(gemm=2048, skinny=(8, 576, 1536), copy_mib=512, seconds=2.0),
    True: dict(gemm=1024, skinny=(8, 576, 1536), copy_mib=128, seconds=0.12),
}
_INNER = 5  # decode-shaped calls per timing: one takes tens of microseconds
_MIN_REPEATS = 3


def machine_description(device: torch.device | str = "cpu") -> str:
    """``AMD EPYC, 2 cores (avx512_bf16)``, or the CUDA device's name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name, flags = platform.processor() or platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), name)
        flags = " (avx512_bf16)" if "avx512_bf16" in info else " (avx512)" if "avx512f" in info else ""
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores{flags}"


def measure_rates(
    device: torch.device | str = "cpu", dtypes: tuple[str, ...] = ("float32", "bfloat16"), *, quick: bool = False
) -> dict[str, Any]:
    """Matmul rates (FLOP/s) for each of ``dtypes`` and the memory bandwidth (bytes/s) of ``device``.

    Returns:
        ``{"device", "machine", "torch", "threads", "load_average", "quick", "sizes", "bandwidth_bytes_per_s",
        "dtypes": {dtype: {"matmul_flops_per_s", "skinny_matmul_flops_per_s"}}, "details"}``, the layout
        :func:`load_rates` reads (JSON-serialisable).
    """
    device = torch.device(device)
    sizes = SIZES[quick]
    load = _loadavg()
    out: dict[str, Any] = {
        "device": device.type,
        "machine": machine_description(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "quick": quick,
        "sizes": {**sizes, "skinny": list(sizes["skinny"])},
        "dtypes": {},
        "details": {},
    }
    n, seconds = sizes["gemm"], sizes["seconds"]
    rows, k, cols = sizes["skinny"]
    for name in dtypes:
        dtype = getattr(torch, name)
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        gemm = _best(partial(torch.mm, a, b, out=torch.empty_like(a)), seconds, device)
        x, w = torch.randn(rows, k, device=device, dtype=dtype), torch.randn(cols, k, device=device, dtype=dtype)
        skinny = _best(partial(_linear_calls, x, w), seconds, device) / _INNER
        out["dtypes"][name] = {
            "matmul_flops_per_s": 2 * n**3 / gemm,
            "skinny_matmul_flops_per_s": 2 * rows * k * cols / skinny,
        }
    numel = sizes["copy_mib"] * 2**20 // 4
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    copy = 2 * numel * 4 / _best(lambda: dst.copy_(src), seconds, device)
    read = numel * 4 / _best(lambda: src.sum(), seconds, device)
    in_place = 2 * numel * 4 / _best(lambda: src.mul_(1.0), seconds, device)
    out["bandwidth_bytes_per_s"] = max(copy, read, in_place)
    out["details"] = {"copy_bytes_per_s": copy, "sum_bytes_per_s": read, "in_place_bytes_per_s": in_place}
    out["load_average"] = {"before": load, "after": _loadavg()}
    return out


def best_of(*measured: dict[str, Any]) -> dict[str, Any]:
    """The best of several measurements of one machine, figure by figure: load only ever lowers a rate."""
    out = dict(measured[0])
    out["dtypes"] = {
        name: {key: max(m["dtypes"][name][key] for m in measured if name in m["dtypes"]) for key in values}
        for name, values in measured[0]["dtypes"].items()
    }
    out["details"] = {key: max(m["details"][key] for m in measured) for key in measured[0]["details"]}
    out["bandwidth_bytes_per_s"] = max(m["bandwidth_bytes_per_s"] for m in measured)
    out["load_average"] = [m.get("load_average") for m in measured]
    out["measurements"] = len(measured)
    return out


def rates_for(device_type: str, rates: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The rates to time a step that runs on a ``device_type`` device: ``rates`` (a file's, measured on such a
    device), else measured here (quick) where this machine has one, else ``None``: no time can be given.

    Raises:
        ValueError: ``rates`` measured on another kind of device, naming the command that measures the right ones
            (matmul FLOPs per byte of bandwidth differ about fourfold between this project's CPU and its H100,
            ``bench/results/roofline.md`` and ``bench/results/gpu.md``: candidates would be ranked wrongly).
    """
    if rates is not None:
        if rates["device"] != device_type:
            raise ValueError(
                f"--rates: measured on {rates['device']} ({rates.get('machine', 'unknown')}), but the step runs on "
                f"{device_type}; measure the rates there: lit-rl rates --device {device_type} --out FILE"
            )
        return rates
    if device_type == "cuda" and not torch.cuda.is_available():
        return None
    return measure_rates(device_type, quick=True)


def save_rates(rates: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rates, indent=2) + "\n")
    return path


def load_rates(path: str | Path) -> dict[str, Any]:
    """Rates written by :func:`save_rates`.

    Raises:
        ValueError: when the file is missing or is not such a file (naming the command that writes one).
    """
    try:
        rates = json.loads(Path(path).read_text())
        float(rates["bandwidth_bytes_per_s"]), rates["device"]
        for values in rates["dtypes"].values():
            float(values["matmul_flops_per_s"]), float(values["skinny_matmul_flops_per_s"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"rates: cannot read machine rates from {str(path)!r} ({type(err).__name__}: {err}); write them with "
            "`lit-rl rates --out <file>`"
        ) from err
    return rates


def _linear_calls(x: torch.Tensor, w: torch.Tensor) -> None:
    for _ in range(_INNER):
        F.linear(x, w)


def _best(fn: Callable[[], Any], seconds: float, device: torch.device) -> float:
    """The fastest timing of ``fn`` (seconds) over as many calls as fit in ``seconds`` (at least 3), after a warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    fn()
    sync(device)
    best, calls, end = float("inf"), 0, time.perf_counter() + seconds
    while calls < _MIN_REPEATS or time.perf_counter() < end:
        start = time.perf_counter()
        fn()
        sync(device)
        best, calls = min(best, time.perf_counter() - start), calls + 1
    return best


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not on every platform
        return None
