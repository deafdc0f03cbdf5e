"""The GPU check: every GPU figure lit-rl predicts, measured on the device in one command, beside the prediction.

On CUDA (about 5 minutes on one H100) it measures, with random-weight models of real architectures
(``shape:<name>``, :mod:`lit_rl.models.shapes`: memory and speed do not depend on the weights' values, and
nothing is downloaded):

- **rates**: ``lit-rl rates --device cuda`` (matmul rates and bandwidth), saved beside the table as
  ``gpu_rates.json``: the rates ``lit-rl estimate --plan --rates`` times a GPU step's candidates with on any machine;
- **peaks**: each method (RefCachedGRPO, Intuitor, GumbelTopK) on Qwen2.5-0.5B full fine-tuning in float32,
  Qwen2.5-1.5B LoRA in bf16 and Qwen2.5-7B LoRA over an NF4 base, micro-batch 1, a few steps under the
  :class:`~lit_rl.callbacks.MemoryProfiler`: per phase the CUDA allocator's ``max_memory_allocated`` and
  ``max_memory_reserved`` against the estimator's prediction at the step's own shapes (what ``lit-rl estimate``
  computes), and each phase's seconds against its roofline floor at the rates measured on the device;
- **decode**: rollout tokens per second of ``generate``, the own loop and the compiled step (CUDA graphs), with the
  floor set by reading every weight once per token at the device's measured copy bandwidth;
- **vs TRL**: lit-rl against TRL's ``GRPOTrainer`` on bench/grpo_vs_trl.yaml's work (LoRA, 256 tokens, bf16-mixed) on
  Qwen2.5-0.5B and 1.5B shapes, each side in its own process: step time and the allocator's peaks (TRL and
  ``datasets`` travel as wheels too); then lit-rl again with the tactics ``lit-rl estimate --plan --allow all``
  chooses for half of TRL's allocated peak, against the aim of at most half TRL's peak;
- **tactics** that act only on an accelerator: activation offloading and ``EmptyCache`` on the 1.5B LoRA step
  (peak and step time against the same step without them), and the OOM report: a step given a memory budget below
  its predicted peak (``torch.cuda.set_per_process_memory_fraction``) must fail in a named phase, write a report
  that names a tactic, and leave the process alive.

On a CPU the same code runs at tiny shapes (``--quick``; ``tests/test_bench_device_check.py`` runs it), so it
cannot rot before a GPU is at hand; its figures there mean nothing. A part that fails is recorded with its error
and the others go on; the JSON and the table are rewritten after every measurement, so a run cut short keeps
what it measured.

Run on a GPU machine (the packages it lacks travel as wheels: docs/benchmarks.md lists them)::

    python bench/device_check.py                  # writes bench/results/gpu.md and gpu.json
    python bench/device_check.py --quick --out /tmp/gpu_quick.md
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import harness
import lightning as L
import torch
import vs_trl
from lightning.pytorch.callbacks import Callback

from lit_rl.callbacks import ActivationOffloading, EmptyCache, MemoryProfiler, OOMReport
from lit_rl.data import PromptDataModule
from lit_rl.memory import estimate_step, settings_from
from lit_rl.methods import GumbelTopK, Intuitor, RefCachedGRPO
from lit_rl.models import LoraSettings, load_causal_lm, load_tokenizer, sample_completions

GIB = 2**30
METHODS = {"grpo": RefCachedGRPO, "intuitor": Intuitor, "gumbel_topk": GumbelTopK}
DISTS = ("torch", "lightning", "transformers", "peft", "bitsandbytes", "jsonargparse", "triton")


@dataclass(frozen=True)
class Case:
    """One model setting the peaks part trains every method in."""

    name: str
    model: str
    dtype: str  # the weights' dtype (model.dtype)
    precision: str  # trainer.precision
    lora: bool
    nf4: bool = False


FULL = (
    Case("0.5B full FT fp32", "shape:qwen2.5-0.5b", "float32", "32-true", lora=False),
    Case("1.5B LoRA bf16", "shape:qwen2.5-1.5b", "bfloat16", "bf16-true", lora=True),
    Case("7B LoRA NF4", "shape:qwen2.5-7b", "bfloat16", "bf16-true", lora=True, nf4=True),
)
QUICK = (
    Case("tiny full FT fp32", "tiny:qwen2", "float32", "32-true", lora=False),
    Case("tiny LoRA bf16", "tiny:qwen2", "bfloat16", "bf16-true", lora=True),
    Case("tiny LoRA NF4", "tiny:qwen2", "bfloat16", "bf16-true", lora=True, nf4=True),
)


@dataclass(frozen=True)
class Sizes:
    """Rollout and run lengths: the full run's on a GPU, tiny ones for ``--quick``."""

    generations: int = 4
    new_tokens: int = 64
    gumbel_tokens: int = 16  # GumbelTopK backpropagates through every soft token: a shorter rollout
    prompt_length: int = 64
    steps: int = 2  # the first warms up (allocations, kernels, AdamW's state); the second is measured
    decode_rows: int = 8
    decode_lengths: tuple[int, ...] = (256,)
    decode_model: str = "shape:qwen2.5-0.5b"
    tactic_case: int = 1  # index into the cases: the 1.5B LoRA step
    oom_case: int = 0


QUICK_SIZES = Sizes(
    generations=2, new_tokens=4, gumbel_tokens=3, steps=2, decode_rows=2, decode_lengths=(8,), decode_model="tiny:qwen2"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run); figures meaningless")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS),
                        help="in this order; the 7B runs (peaks_large) last, as the ones most likely to run long")  # fmt: skip
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--steps", type=int, help="optimizer steps per fit (default 2)")
    parser.add_argument("--new-tokens", type=int, help="completion length of GRPO and Intuitor (default 64)")
    parser.add_argument("--decode-lengths", type=int, nargs="+", help="decode lengths (default 256)")
    parser.add_argument("--decode-dtypes", nargs="+", default=["bfloat16"], choices=["float32", "bfloat16"],
                        help="the decode part's model dtypes (default bfloat16)")  # fmt: skip
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="the tactics part's arms")
    parser.add_argument(
        "--oom-budget-gib",
        type=float,
        help="the OOM part's budget; default: halfway between a probe run's rollout and step peaks",
    )
    parser.add_argument("--workers", type=int, help="processes for the predictions (default: cores - 2, at most 8)")
    parser.add_argument("--render", metavar="JSON", help="rewrite --out's table from a run's JSON; measures nothing")
    parser.add_argument("--predict-missing", action="store_true",
                        help="with --render: make the predictions a run stopped before (on this machine's CPU, at the "
                        "recorded shapes and the run's device type; bytes depend on the shapes, not the machine)")  # fmt: skip
    parser.add_argument("--out", default=str(harness.ROOT / "bench" / "results" / "gpu.md"), help="the table (.md)")
    parser.add_argument("--workdir", default="/tmp/lit_rl_device_check", help="run folders (logs, reports)")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------ one fit


def _method(name: str, case: Case, sizes: Sizes, **extra: Any):
    common = dict(
        name_or_path=case.model, dtype=case.dtype, lora=LoraSettings() if case.lora else None,
        quantize_base="nf4" if case.nf4 else "none", micro_batch_size=1, learning_rate=1e-6,
    )  # fmt: skip
    if name == "gumbel_topk":
        return GumbelTopK(reward_model=case.model, **{"max_new_tokens": sizes.gumbel_tokens, **common, **extra})
    common.update(num_generations=sizes.generations, max_new_tokens=sizes.new_tokens)
    if name == "grpo":  # a length-free reward
        return RefCachedGRPO(**{"reward_funcs": ["lit_rl.data.rewards.number_only"], **common, **extra})
    return Intuitor(**common, **extra)


def letter_share(completions: list[str], **_: Any) -> list[float]:
    """The share of a completion's characters that are letters: a reward that varies over a random-weight model's
    completions, so GRPO's advantages, and with them the update, are not zero."""
    return [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]


def _data(sizes: Sizes) -> PromptDataModule:
    return PromptDataModule(
        source="arithmetic", num_prompts=64, batch_size=1, max_prompt_length=sizes.prompt_length, val_size=0
    )


def _error(err: Exception, limit: int = 300) -> str:
    """An exception in one line: its type and its message's first line, at most ``limit`` characters."""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:limit] if str(err) else ''}"


def _clear() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class StepShapes(Callback):
    """Each training step's shapes, as the profiler's own predictions take them: prompts, padded width, whether any
    prompt is padded, and the completion length the method reports having generated (``step_shape``)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, int, bool, int | None]] = []
        self.gaps: list[
            dict[str, float]
        ] = []  # each step's rollout/sampler_* metrics (the sampler against the trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        mask = batch["attention_mask"]
        new_tokens = (getattr(pl_module, "step_shape", None) or {}).get("new_tokens")
        self.shapes.append((int(mask.shape[0]), int(mask.shape[1]), bool((mask == 0).any()), new_tokens))
        gap = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rollout/sampler")}
        if gap:
            self.gaps.append(gap)


def predict(method_name: str, case: Case, sizes: Sizes, arm: str | None, shape: tuple, device_type: str,
            sharding: dict | None = None) -> dict:  # fmt: skip
    """The estimator's per-phase steady-state peaks (bytes) for one step shape of a fit; runs in a worker process.

    The same call the MemoryProfiler makes for a measured step (``estimate_step`` with the run's precision, callbacks
    and device type, at the step's own shapes), made here beside the GPU instead of inside the training loop: on a
    0.5-1.5B model it costs 17-55 s of CPU per shape (bench/results/gpu.log), longer than the steps it predicts.
    """
    batch_size, prompt_length, padded, new_tokens = shape
    callbacks = ARMS[arm]() if arm else []
    settings = settings_from(_data(sizes), precision=case.precision, callbacks=callbacks, device_type=device_type)
    settings.update(batch_size=batch_size, prompt_length=prompt_length, padded=padded, **(sharding or {}))
    if new_tokens is not None:
        settings["max_new_tokens"] = max(int(new_tokens), 1)  # every method here names its length max_new_tokens
    return dict(estimate_step(_method(method_name, case, sizes), **settings).phases)


def _one_thread() -> None:
    """A worker's torch runs on one thread: the workers share the machine's cores with each other and the GPU run."""
    torch.set_num_threads(1)


class Predictions:
    """Predictions in a pool of worker processes, while the GPU goes on measuring; joined into the rows at the end."""

    def __init__(self, workers: int) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process that holds CUDA
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_one_thread)
        self.pending: list[tuple[dict, list]] = []

    def submit(self, entry: dict, method_name: str, case: Case, sizes: Sizes, arm: str | None, shapes,
               device_type: str | None = None, sharding: dict | None = None) -> None:  # fmt: skip
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        futures = [self.pool.submit(predict, method_name, case, sizes, arm, shape, device_type, sharding)
                   for shape in sorted(set(shapes), key=str)]  # fmt: skip
        self.pending.append((entry, futures))

    def join(self, save) -> None:
        """Fill each entry's predicted and error columns (per phase, the largest prediction over its step shapes)."""
        for entry, futures in self.pending:
            try:
                predicted = [f.result() for f in futures]
            except Exception as err:  # a failed prediction is that entry's note, not the end of the check
                entry["prediction_error"] = _error(err)
                continue
            for row in entry["phases"]:
                values = [p[row["phase"]] for p in predicted if row["phase"] in p]
                if values:
                    row["predicted_gib"] = max(values) / GIB
                    measured = row["allocated_gib"]
                    row["error_pct"] = 100 * (row["predicted_gib"] - measured) / measured if measured else None
            save()
        self.pool.shutdown()


def _workers(args: argparse.Namespace) -> int:
    """``--workers``, or the machine's cores less two (at most 8, at least 1)."""
    return args.workers or max(1, min(8, (os.cpu_count() or 2) - 2))


def predict_missing(results: dict, cases: tuple, sizes: Sizes, workers: int) -> None:
    """Fill the predictions of the peaks and tactics entries a run measured but stopped before predicting (its time
    limit fell in the wait for the workers). The estimator runs on fake tensors, so it needs no GPU: the same call at
    the recorded shapes and the run's device type, here; the run's JSON says so (``predicted_later``)."""
    predictions, device_type = Predictions(workers), "cuda" if results["environment"]["memory_gib"] else "cpu"
    by_name = {case.name: case for case in cases}
    filled = []
    for part in ("peaks", "tactics", "fsdp2"):
        for key, entry in results.get(part, {}).items():
            if "phases" not in entry or all(r["predicted_gib"] is not None for r in entry["phases"]):
                continue
            if part == "fsdp2":  # the run's saved folder has the config `shape:` builds (load_causal_lm's)
                shapes = [tuple(s) for s in entry["shapes"]]
                predictions.submit(entry, "grpo", cases[0], sizes, None, shapes, device_type,
                                   _sharding(FSDP2_ARMS[entry["arm"]]))  # fmt: skip
                filled.append(key)
                continue
            if part == "peaks":
                method, case, arm = entry["method"], Case(**entry["case"]), None
            else:
                method, case, arm = "grpo", by_name[key.split(" / ")[1]], entry["arm"]
            predictions.submit(entry, method, case, sizes, arm, [tuple(s) for s in entry["shapes"]], device_type)
            filled.append(key)
    predictions.join(lambda: None)
    if filled:
        results["predicted_later"] = {"entries": filled, "torch": torch.__version__, "commit": harness.git_commit()}


def fit(method_name: str, case: Case, sizes: Sizes, root: Path, callbacks: list | None = None, strategy=None,
        **extra: Any) -> dict:  # fmt: skip
    """Train ``sizes.steps`` steps under the MemoryProfiler (no predictions of its own: :class:`Predictions` makes
    them); its summary (per phase: peaks and the roofline) and the steps' shapes."""
    _clear()
    profiler, shapes = MemoryProfiler(every_n_steps=1, predict=False), StepShapes()
    trainer = L.Trainer(
        accelerator="auto", devices=1, strategy=strategy or "auto", precision=case.precision, max_steps=sizes.steps,
        logger=False,
        callbacks=[profiler, shapes, *(callbacks or [])], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(root),
    )  # fmt: skip
    method = _method(method_name, case, sizes, **extra)
    start = time.perf_counter()
    try:
        trainer.fit(method, _data(sizes))
        summary = profiler.summary()
    finally:
        del trainer, method
        _clear()
    summary["wall_s"] = time.perf_counter() - start
    summary["shapes"] = shapes.shapes
    summary["sampler_gap"] = shapes.gaps
    return summary


def phase_rows(summary: dict) -> list[dict]:
    """Per phase: allocated and reserved GiB (the steady state: the steps after the first, where AdamW has its
    state), seconds and floor; predicted GiB and error come from :class:`Predictions`."""
    roofline = summary.get("roofline", {}).get("phases", {})
    rows = []
    for phase, stats in summary["phases"].items():
        time_ = roofline.get(phase, {})
        rows.append({
            "phase": phase, "allocated_gib": (stats.get("peak_gib") or {}).get("steady"),
            "reserved_gib": (stats.get("reserved_gib") or {}).get("steady"), "predicted_gib": None, "error_pct": None,
            "seconds": time_.get("measured_s"), "floor_s": time_.get("floor_s"), "achieved": time_.get("achieved"),
        })  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------------ the parts


def _peaks(args, cases, sizes, record) -> None:
    for case in cases:
        for name in args.methods:
            record("peaks", f"{name} / {case.name}", lambda n=name, c=case: _peaks_entry(n, c, sizes, args))


def part_peaks(args, cases, sizes, record) -> None:
    _peaks(args, cases[:-1], sizes, record)


def part_peaks_large(args, cases, sizes, record) -> None:
    """The last case (7B over an NF4 base), run after the other parts: the one most likely to run long."""
    _peaks(args, cases[-1:], sizes, record)


def _peaks_entry(name: str, case: Case, sizes: Sizes, args) -> dict:
    summary = fit(name, case, sizes, Path(args.workdir) / "peaks" / f"{name}_{case.model.split(':')[-1]}")
    entry = {"case": asdict(case), "method": name, "phases": phase_rows(summary), "wall_s": summary["wall_s"],
             "shapes": summary["shapes"], "sampler_gap": summary["sampler_gap"], "roofline_rates": summary.get("roofline", {}).get("rates"),
             "measurement": summary["measurement"]}  # fmt: skip
    args.predictions.submit(entry, name, case, sizes, None, summary["shapes"])
    return entry


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` over 1 GiB (256 MiB on a CPU), best of five."""
    n = (GIB if device.type == "cuda" else 256 * 2**20) // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(5):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 / best


# each decode side: sample_completions' own_decode; "fast" is the own loop with fast_draw (ended rows dropped, one
# uniform number per token); "lean" the loop with its token step written out (lit_rl/models/lean_step.py)
DECODE_SIDES = {"generate": False, "own": "own", "fast": "own", "compiled": "compiled", "lean": "lean"}


def part_decode(args, cases, sizes, record) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record("decode", "bandwidth", lambda: {"copy_bytes_per_s": copy_bandwidth(device)})
    for dtype in args.decode_dtypes:
        record("decode", f"{sizes.decode_model} {dtype}", lambda d=dtype: _decode_entry(sizes, device, d))


def _decode_entry(sizes: Sizes, device: torch.device, dtype: str) -> dict:
    _clear()
    tokenizer = load_tokenizer(sizes.decode_model)
    with torch.device(device):
        model = load_causal_lm(sizes.decode_model, dtype=dtype)
    model.config.use_cache = True
    data = _data(sizes)
    data.connect(tokenizer)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    repeats = sizes.decode_rows
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(side: str, length: int) -> float:
        torch.manual_seed(1234)
        sync()
        start = time.perf_counter()
        sample_completions(
            model, ids, mask, tokenizer.pad_token_id, [tokenizer.eos_token_id], repeats=repeats, share_prompt=True,
            own_decode=DECODE_SIDES[side], fast_draw=side == "fast", max_new_tokens=length,
            min_new_tokens=length, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
        )  # fmt: skip
        sync()
        return time.perf_counter() - start

    out: dict[str, Any] = {"rows": repeats, "weight_bytes": weight_bytes, "lengths": {}}
    try:
        for length in sizes.decode_lengths:
            row: dict[str, Any] = {}
            for side in DECODE_SIDES:
                first = run(side, length)  # warms (and for the compiled step, compiles and captures the graph)
                best = min(run(side, length) for _ in range(2))
                row[side] = {"first_s": first, "best_s": best, "tokens_per_s": repeats * length / best}
            out["lengths"][str(length)] = row  # JSON keys are strings: the same whether read back or not
    finally:
        model = None  # the closure above holds the name: rebinding frees the weights before _clear
        _clear()
    return out


ARMS = {
    "none": lambda: [],
    "ActivationOffloading": lambda: [ActivationOffloading()],
    "EmptyCache": lambda: [EmptyCache(phases="all")],
}  # weights, gradients and AdamW state in host memory (FSDP2's cpu_offload): the fsdp2 part


def part_tactics(args, cases, sizes, record) -> None:
    case = cases[sizes.tactic_case]
    for arm in args.arms:
        record("tactics", f"grpo / {case.name} / {arm}",
               lambda a=arm: _tactic_entry(a, ARMS[a](), case, sizes, args))  # fmt: skip


def _tactic_entry(arm: str, callbacks: list, case: Case, sizes: Sizes, args) -> dict:
    root = Path(args.workdir) / "tactics" / arm.split("(")[0]
    summary = fit("grpo", case, sizes, root, callbacks=callbacks)
    entry = {"arm": arm, "phases": phase_rows(summary), "wall_s": summary["wall_s"], "shapes": summary["shapes"]}
    args.predictions.submit(entry, "grpo", case, sizes, arm, summary["shapes"])
    return entry


class FinalWeights(Callback):
    """The policy's trainable weights at the end of a fit, on the host (a sharded weight by its local shard: one
    process holds all of it)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.update = 0.0  # the largest change of a weight over the fit: what a difference between runs compares to
        self.steps: list[dict[str, float]] = []  # each step's loss, reward and non-finite metrics

    @staticmethod
    def _read(pl_module) -> dict[str, torch.Tensor]:
        return {
            name: (param.to_local() if hasattr(param, "to_local") else param).detach().to("cpu", torch.float64, copy=True)
            for name, param in pl_module.policy.named_parameters() if param.requires_grad
        }  # fmt: skip

    def on_train_start(self, trainer, pl_module) -> None:
        self.weights, self.steps = self._read(pl_module), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()
                           if v.numel() == 1 and any(w in k for w in ("loss", "reward", "nonfinite", "grad_norm"))})  # fmt: skip

    def on_train_end(self, trainer, pl_module) -> None:
        start, self.weights = self.weights, self._read(pl_module)
        self.update = max((self.weights[k] - w).abs().max().item() for k, w in start.items())


FSDP2_ARMS = {"one device": None, "FSDP2": {}, "FSDP2 cpu_offload": {"cpu_offload": True}}


def _sharding(options: dict | None) -> dict:
    """The estimate's settings for an FSDP2 arm (:func:`lit_rl.memory.sharded.sharding_settings` of its strategy)."""
    if options is None:
        return {}
    return {"shard_processes": 1, "rollout_gather": "auto", "shard_offload": bool(options.get("cpu_offload"))}


def part_fsdp2(args, cases, sizes, record) -> None:
    """GRPO on the full fine-tuning case under :class:`~lit_rl.strategies.FSDP2Strategy` in one process (NCCL on a
    GPU: two processes cannot share one GPU under NCCL), with and without ``cpu_offload``, beside the same seeded run
    without a strategy: per-phase peaks, and the final weights' largest difference from that run."""
    import torch.distributed as dist

    # every arm loads the same saved random weights: a strategy may build and initialise the model its own way
    case, reference = cases[0], {}
    case = replace(case, model=str(_model_folder(case.model, Path(args.workdir) / "models")))
    environment = dict(os.environ)  # Lightning sets MASTER_PORT and friends, which child processes would inherit
    try:
        for arm, options in FSDP2_ARMS.items():
            record("fsdp2", f"grpo / {case.name} / {arm}",
                   lambda a=arm, o=options: _fsdp2_entry(a, o, case, sizes, args, reference))  # fmt: skip
    finally:
        if dist.is_initialized():  # the next fit, or a test in this process, must not find a process group
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)


def _fsdp2_entry(arm: str, options: dict | None, case: Case, sizes: Sizes, args, reference: dict) -> dict:
    from lit_rl.strategies import FSDP2Strategy

    if options and options.get("cpu_offload") and not torch.cuda.is_available():
        return {"skipped": "cpu_offload needs an accelerator (refused on a CPU run)"}
    import torch.distributed as dist

    if dist.is_initialized():  # each arm's strategy sets up its own process group (cpu_offload adds gloo to NCCL)
        dist.destroy_process_group()
    weights = FinalWeights()
    strategy = None if options is None else FSDP2Strategy(**options)
    L.seed_everything(0, verbose=False)  # the same random weights and samples in every arm
    summary = fit("grpo", case, sizes, Path(args.workdir) / "fsdp2" / arm.replace(" ", "_"), callbacks=[weights],
                  strategy=strategy, reward_funcs=["device_check.letter_share"], learning_rate=1e-4)  # fmt: skip
    entry = {"arm": arm, "phases": phase_rows(summary), "wall_s": summary["wall_s"], "shapes": summary["shapes"],
             "max_abs_update": weights.update, "steps": weights.steps}  # fmt: skip
    if options is None:
        reference.update(weights.weights)
    elif reference:
        # by name where both runs name a weight (a tied head is named by the embedding in one, the head in the other)
        diffs = [(weights.weights[k] - w).abs().max().item() for k, w in reference.items() if k in weights.weights]
        entry["max_abs_weight_diff"], entry["weights_compared"] = max(diffs), f"{len(diffs)} of {len(reference)}"
    # the one-process estimate, sharded as the run is
    args.predictions.submit(entry, "grpo", case, sizes, None, summary["shapes"], sharding=_sharding(options))
    return entry


def part_oom(args, cases, sizes, record) -> None:
    record("oom", "oversized step", lambda: _oom_entry(cases[sizes.oom_case], sizes, args))


def _oom_entry(case: Case, sizes: Sizes, args) -> dict:
    """A step whose budget is below its predicted peak: the report must name the phase and a tactic; we live on."""
    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA (set_per_process_memory_fraction)"}
    if args.oom_budget_gib:
        budget, peak = args.oom_budget_gib * GIB, None
    else:
        probe = fit("grpo", case, sizes, Path(args.workdir) / "oom_probe")
        peak = max(s["peak_gib"]["max"] for s in probe["phases"].values() if s.get("peak_gib")) * GIB
        weights = probe["phases"]["rollout"]["peak_gib"]["max"] * GIB  # weights, reference copy and the rollout
        budget = (weights + peak) / 2  # above what loads, below what the step needs
    total = torch.cuda.get_device_properties(0).total_memory
    report = OOMReport()
    torch.cuda.set_per_process_memory_fraction(budget / total)
    error = None
    try:
        fit("grpo", case, sizes, Path(args.workdir) / "oom", callbacks=[report])
    except Exception as err:  # torch.OutOfMemoryError, as Lightning re-raises it
        error = _error(err, 160)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    written = json.loads(Path(report.report_path).read_text()) if report.report_path else None
    return {"budget_gib": budget / GIB, "step_peak_gib": peak and peak / GIB, "error": error, "report": written,
            "alive_after": torch.ones(1, device="cuda").item() == 1.0}  # fmt: skip


# bench/grpo_vs_trl.yaml's work (2 prompts x 4 completions, all forced to the length, dapo, beta 0.04, LoRA r 16 on
# every linear layer, activation checkpointing on both sides) on a random-weight model: {model: vs_trl's setup}
TRL_SETUPS = {
    "shape:qwen2.5-0.5b": vs_trl.Setup(
        "0.5B LoRA, 256 tokens, bf16-mixed", 256, lora=True, checkpointing=True, bf16=True
    ),
    "shape:qwen2.5-1.5b": vs_trl.Setup(
        "1.5B LoRA, 256 tokens, bf16-mixed", 256, lora=True, checkpointing=True, bf16=True
    ),
}
QUICK_TRL_SETUPS = {"tiny:qwen2": vs_trl.Setup("tiny LoRA, 4 tokens, fp32", 4, lora=True, checkpointing=True)}


def part_vs_trl(args, cases, sizes, record) -> None:
    for model, setup in (QUICK_TRL_SETUPS if args.quick else TRL_SETUPS).items():
        record("vs_trl", setup.name, lambda m=model, s=setup: _vs_trl_entry(m, s, args))


def _model_folder(model: str, root: Path) -> Path:
    """``model`` (random weights) saved as a Hugging Face folder with its tokenizer: what TRL loads."""
    folder = root / model.replace(":", "_")
    if not (folder / "config.json").exists():
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        tokenizer = load_tokenizer(model)
        with device:
            lm = load_causal_lm(model, vocab_size=len(tokenizer))  # vocab_size is read by tiny: models only
        lm.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del lm
        _clear()
    return folder


def _vs_trl_entry(model: str, setup: vs_trl.Setup, args) -> dict:
    """Both sides in fresh processes, one after the other, on the same model folder and the same work (bench/vs_trl.py's
    commands, without its roofline), then lit-rl with the planner's tactics for half of TRL's peak."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return {"skipped": "trl is not installed (pip install 'lit-rl[bench]', or carry its wheel)"}
    root, name = Path(args.workdir) / "vs_trl", model.replace(":", "_")
    folder = _model_folder(model, root)
    steps = 2 if args.quick else 4
    lit_rl = ["--model.init_args.name_or_path", str(folder), "--trainer.accelerator", "auto"]
    trl = ["--model", str(folder)] + (["--cuda"] if torch.cuda.is_available() else [])
    own = {"lit-rl": lit_rl, vs_trl.PLANNED: lit_rl, "TRL": trl}
    out: dict[str, Any] = {"model": model, "length": setup.length, "steps": steps}
    for side, key in (("lit-rl", "lit-rl"), ("TRL", "trl"), (vs_trl.PLANNED, "lit-rl planned")):
        record_file, plan = root / f"{key.replace(' ', '_')}_{name}.json", None
        if side == vs_trl.PLANNED:  # the work without the checkpointing callback: the planner chooses its own
            work = [*setup.lit_rl_args(planned=True), *lit_rl]
            out["plan"] = _plan_for_half_of_trl(out.get("trl", {}), work, root / f"plan_{name}.yaml")
            if "plan_file" not in out["plan"]:
                continue
            plan = out["plan"]["plan_file"]
        command = vs_trl.child_command(setup, side, steps, str(record_file), str(root / "runs"), None, plan)
        start = time.perf_counter()
        done = subprocess.run(
            [*command, *own[side]], cwd=harness.ROOT, env=vs_trl.child_env(), capture_output=True, text=True
        )
        if done.returncode != 0:
            out[key] = {"error": f"exit {done.returncode}: {harness.last_line(done)}"}
            continue
        got = json.loads(record_file.read_text())
        out[key] = {"step_s": vs_trl.median_after_first(got["step_s"]), "wall_s": time.perf_counter() - start,
                    "max_allocated_gib": got.get("cuda_max_allocated_bytes", 0) / GIB or None,
                    "max_reserved_gib": got.get("cuda_max_reserved_bytes", 0) / GIB or None,
                    "peak_rss_gib": got["peak_rss_bytes"] / GIB}  # fmt: skip
    return out


def _plan_for_half_of_trl(trl: dict, work: list[str], plan_file: Path) -> dict:
    """``lit-rl estimate --plan`` for half of TRL's peak on the same work, every tactic allowed: the budget is TRL's
    allocated peak on CUDA; on a CPU, which has no allocator, half its peak RSS (a smoke test: the tiny model's tensors
    are far below it). The plan's line of the planner's table, its budget, and the plan file to train with."""
    stat = "max_allocated_gib" if trl.get("max_allocated_gib") else "peak_rss_gib"
    if not trl.get(stat):
        return {"skipped": "TRL did not run: no budget to plan for"}
    planned = {"budget_gib": trl[stat] / 2, "budget_from": stat}
    done = vs_trl.estimate_plan(work, planned["budget_gib"], plan_file)
    if done.returncode != 0:  # exit 2 when no plan fits: its last line names the smallest peak reached
        return planned | {"error": f"exit {done.returncode}: {harness.last_line(done)}"}
    chosen = harness.planner_choice(done.stdout)
    if chosen is None:
        return planned | {"error": f"no plan row in the planner's output: {harness.last_line(done)}"}
    return planned | {"plan_file": str(plan_file), **chosen}


def part_rates(args, cases, sizes, record) -> None:
    """``lit-rl rates`` on the device (full sizes; ``--quick``: quick ones), saved beside the table as
    ``<out>_rates.json``: the file ``lit-rl estimate --plan --rates`` times a GPU's candidates with on a machine
    without one (a CPU's rates are refused for a GPU step)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = Path(args.out).with_name(Path(args.out).stem + "_rates.json")

    def measure() -> dict:
        command = [sys.executable, "-m", "lit_rl", "rates", "--device", device, "--out", str(path)]
        done = subprocess.run([*command, *(["--quick"] if args.quick else [])], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"exit {done.returncode}: {harness.last_line(done)}")
        return {"file": path.name, "lines": done.stdout.strip().splitlines()}

    record("rates", device, measure)


PARTS = {"rates": part_rates, "peaks": part_peaks, "decode": part_decode, "tactics": part_tactics, "oom": part_oom,
         "vs_trl": part_vs_trl, "fsdp2": part_fsdp2, "peaks_large": part_peaks_large}  # fmt: skip


# ------------------------------------------------------------------------------------------------ the results


def environment() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else harness.cpu_model(),
        "memory_gib": torch.cuda.get_device_properties(0).total_memory / GIB if cuda else None,
        "cuda": torch.version.cuda, "python": sys.version.split()[0], "versions": harness.versions(DISTS),
        "commit": os.environ.get("LIT_RL_COMMIT") or harness.git_commit(),  # a device's copy may have no .git
    }  # fmt: skip


def _f(value: Any, fmt: str = ".2f") -> str:
    return "—" if value is None else format(value, fmt)


def _step_cells(phases: list[dict]) -> str:
    """A fit's step as table cells: peak allocated and reserved GiB over its phases, the largest prediction, and the
    summed phase seconds."""
    known = [r["predicted_gib"] for r in phases if r["predicted_gib"] is not None]
    return (
        f"{max((r['allocated_gib'] or 0) for r in phases):.3f} | {max((r['reserved_gib'] or 0) for r in phases):.3f} | "
        f"{_f(max(known) if known else None, '.3f')} | {sum(r['seconds'] or 0 for r in phases):.3f}"
    )


def _planned_vs_trl(trl: dict) -> list[str]:
    """The table of lit-rl trained with the planner's tactics for half of TRL's peak, beside TRL's run."""
    lines = ["", "### lit-rl planned for half of TRL's peak", "",
             "`lit-rl estimate --device-memory <half of TRL's allocated peak> --allow all --plan plan.yaml` on the "
             "same work, then the same fit with `--config plan.yaml` (on a CPU the budget is half TRL's peak RSS: "
             "a smoke test). Aim: allocated ≤ 0.5x TRL's.", "",
             "| setup | budget GiB | plan | predicted | planned time | allocated GiB | vs TRL's | step s | vs TRL's |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for key, entry in trl.items():
        plan, ours, theirs = entry.get("plan", {}), entry.get("lit-rl planned", {}), entry.get("trl", {})
        if "step_s" not in ours or "step_s" not in theirs:
            why = plan.get("skipped") or plan.get("error") or ours.get("error") or entry.get("skipped") or "not run"
            lines.append(f"| {key} | {_f(plan.get('budget_gib'), '.3f')} | {why} | | | | | | |")
            continue
        allocated, trl_allocated = ours["max_allocated_gib"], theirs["max_allocated_gib"]
        ratio = f"{allocated / trl_allocated:.2f}x" if allocated and trl_allocated else "—"
        lines.append(f"| {key} | {plan['budget_gib']:.3f} | {plan['plan']} | {plan['predicted']} | {plan['time']} | "
                     f"{_f(allocated, '.3f')} | {ratio} | {ours['step_s']:.3f} | "
                     f"{ours['step_s'] / theirs['step_s']:.2f}x |")  # fmt: skip
    return lines


def render(results: dict) -> str:
    env = results["environment"]
    lines = [
        "# The GPU check",
        "",
        f"Written by `{results['command']}` (bench/device_check.py) at commit {env['commit']}"
        + (" — **--quick: tiny shapes, figures meaningless**" if results["quick"] else "") + ".",
        f"Device: {env['device']} ({_f(env['memory_gib'], '.1f')} GiB), CUDA {env['cuda']}, Python {env['python']}; "
        + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + ".",
        "Bytes depend on the shapes, not on load; seconds depend on the device and what else ran on it.",
        *([] if results.get("finished") else [
            "",
            f"**This run stopped before it finished** (its time limit): of the parts {', '.join(results['parts'])}, "
            "those without rows below were not reached. Seconds per measurement: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in results.get("seconds", {}).items()) + ".",
        ]),
        *([] if not results.get("predicted_later") else [
            "",
            "Predicted later (`--render JSON --predict-missing`: the estimator at this JSON's recorded shapes, on a CPU, "
            f"at commit {results['predicted_later']['commit']}, torch {results['predicted_later']['torch']}): "
            + ", ".join(results["predicted_later"]["entries"]) + ".",
        ]),
        "",
        "## Per-phase peaks: the CUDA allocator against the estimator",
        "",
        "Allocated is `max_memory_allocated` over the phase ("
        + ("the steady state: the steps after the first, where AdamW has its state" if results.get("allocated_stat")
           == "steady" else "max over the steps")
        + "), reserved the allocator's `max_memory_reserved`; predicted is the estimator's figure at the step's own "
        "shapes (" + ("computed in worker processes, the call the profiler makes" if results.get("allocated_stat")
                      == "steady" else "the profiler's own prediction")
        + "), error = (predicted - allocated) / allocated. Seconds are the median of the steps after the first; the "
        "floor is the phase's roofline at the rates measured on this device at the end of each run.",
        "",
        "| method / setting | phase | allocated GiB | reserved GiB | predicted GiB | error | seconds | floor s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for key, entry in results["peaks"].items():
        if "error" in entry and "phases" not in entry:
            lines.append(f"| {key} | **failed** | {entry['error']} | | | | | |")
            continue
        for row in entry["phases"]:
            lines.append(
                f"| {key} | {row['phase']} | {_f(row['allocated_gib'], '.3f')} | {_f(row['reserved_gib'], '.3f')} | "
                f"{_f(row['predicted_gib'], '.3f')} | {_f(row['error_pct'], '+.1f')}% | {_f(row['seconds'], '.3f')} | "
                f"{_f(row['floor_s'], '.4f')} |"
            )
    rates: dict[str, list] = {}
    for entry in results["peaks"].values():
        got = entry.get("roofline_rates") or {}
        if got.get("matmul_flops_per_s"):
            rates.setdefault(got["dtype"], []).append((got["matmul_flops_per_s"], got["bandwidth_bytes_per_s"]))
    if rates:
        lines += ["", "The rates behind the floors (the roofline's quick measurement at the end of each run): " + "; ".join(
            f"{dtype} matmul {min(r[0] for r in got) / 1e12:.0f}-{max(r[0] for r in got) / 1e12:.0f} TFLOP/s, "
            f"bandwidth {min(r[1] for r in got) / 1e12:.2f}-{max(r[1] for r in got) / 1e12:.2f} TB/s"
            for dtype, got in rates.items()) + ". A dash: the run's roofline gave that phase no floor "
            "(gpu.json keeps what it did give)."]  # fmt: skip
    errors = [abs(r["error_pct"]) for e in results["peaks"].values() for r in e.get("phases", [])
              if r["error_pct"] is not None]  # fmt: skip
    if errors:
        within = sum(e <= 10 for e in errors)
        lines += ["", f"{within} of {len(errors)} phase peaks predicted within 10% (largest error {max(errors):.1f}%)."]
    gaps = {key: e["sampler_gap"] for key, e in results["peaks"].items() if e.get("sampler_gap")}
    if gaps:
        lines += ["", "## The sampler against the trainer", "",
                  "Per step (the largest over the run's steps): the decode loop's log-probs of its own tokens against the "
                  "trainer's (`rollout/sampler_*`, lit_rl/losses/sampler.py); past cap: completions whose ratio is "
                  "above 3.", "",
                  "| method / setting | mean abs Δ log p | max abs Δ log p | k3 per token | past cap |",
                  "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for key, steps in gaps.items():
            top = {k: max(step.get(k, 0.0) for step in steps) for k in steps[0]}
            lines.append(
                f"| {key} | {top['rollout/sampler_logp_diff/mean']:.2e} | {top['rollout/sampler_logp_diff/max']:.2e} | "
                f"{top['rollout/sampler_k3']:.2e} | {top['rollout/sampler_past_cap']:.3f} |"
            )
    lines += ["", "## Rollout decode: tokens per second", ""]
    decode = results["decode"]
    bandwidth = decode.get("bandwidth", {}).get("copy_bytes_per_s")
    lines.append(f"Copy bandwidth measured: {_f(bandwidth and bandwidth / 1e12, '.2f')} TB/s (bytes read + written).")
    lines += ["", "| model | new tokens | rows | generate | own loop | own loop, fast draw | compiled (CUDA graphs) | "
              "lean step | floor |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for key, entry in decode.items():
        if key == "bandwidth":
            continue
        if "lengths" not in entry:
            lines.append(f"| {key} | **failed** | {entry.get('error')} | | | | | | |")
            continue
        for length, row in entry["lengths"].items():
            floor = entry["rows"] * bandwidth / entry["weight_bytes"] if bandwidth else None
            lines.append(
                f"| {key} | {length} | {entry['rows']} | "
                + " | ".join(_f(row.get(s, {}).get("tokens_per_s"), ".0f") for s in DECODE_SIDES)
                + f" | {_f(floor, '.0f')} |"
            )
    lines += [
        "",
        "The floor reads every weight once per token at the copy bandwidth (the KV cache left out: a ceiling"
        " on tokens per second). First-call seconds (compile and graph capture included) are in gpu.json.",
        "",
    ]
    lines += ["## Tactics that act on an accelerator", "",
              "| arm | step peak allocated GiB | step peak reserved GiB | predicted GiB | step seconds |",
              "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for key, entry in results["tactics"].items():
        if "phases" not in entry:
            lines.append(f"| {key} | {entry.get('skipped') or entry.get('error')} | | | |")
            continue
        lines.append(f"| {key} | {_step_cells(entry['phases'])} |")
    trl = results.get("vs_trl", {})
    if trl:
        lines += ["", "## lit-rl against TRL's GRPOTrainer, equal work", "",
                  "bench/grpo_vs_trl.yaml's work on both sides (2 prompts x 4 completions forced to the length, dapo, "
                  "beta 0.04, LoRA r 16 on every linear layer, activation checkpointing), each side in its own process "
                  "on the same random-weight model folder, no vLLM. Step s: the median step after the first; allocated "
                  "and reserved: the allocator's peaks over the whole run.", "",
                  "| setup | lit-rl step s | TRL step s | lit-rl / TRL | lit-rl allocated GiB | TRL allocated GiB | "
                  "lit-rl reserved GiB | TRL reserved GiB |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for key, entry in trl.items():
            ours, theirs = entry.get("lit-rl", {}), entry.get("trl", {})
            if "step_s" not in ours or "step_s" not in theirs:
                why = entry.get("skipped") or entry.get("error") or ours.get("error") or theirs.get("error")
                lines.append(f"| {key} | {why} | | | | | | |")
                continue
            lines.append(
                f"| {key} | {ours['step_s']:.3f} | {theirs['step_s']:.3f} | {ours['step_s'] / theirs['step_s']:.2f}x | "
                f"{_f(ours['max_allocated_gib'], '.3f')} | {_f(theirs['max_allocated_gib'], '.3f')} | "
                f"{_f(ours['max_reserved_gib'], '.3f')} | {_f(theirs['max_reserved_gib'], '.3f')} |"
            )
        lines += _planned_vs_trl(trl)
    fsdp2 = results.get("fsdp2", {})
    if fsdp2:
        lines += ["", "## FSDP2 in one process against no strategy", "",
                  "GRPO, the same seeded run under `FSDP2Strategy` (one process: NCCL refuses two processes on one GPU) "
                  "and without a strategy, every arm from one saved random-weight folder. Predicted: the estimate of "
                  "one process, sharded as the run is (with `cpu_offload`, the device's "
                  "bytes: the shards, their gradients and the optimizer state are in host memory). Weight diff: the "
                  "largest absolute difference of a trained weight from the run without a strategy, beside the largest "
                  "change of a weight over the run (the update).", "",
                  "| arm | step peak allocated GiB | step peak reserved GiB | predicted GiB | step seconds | "
                  "max abs weight diff | max abs update |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for key, entry in fsdp2.items():
            if "phases" not in entry:
                lines.append(f"| {key} | {entry.get('skipped') or entry.get('error')} | | | | | |")
                continue
            lines.append(
                f"| {key} | {_step_cells(entry['phases'])} | {_f(entry.get('max_abs_weight_diff'), '.2e')} | "
                f"{_f(entry.get('max_abs_update'), '.2e')} |"
            )
        lines += ["", "Per phase: allocated (the steady state) against the estimate.", "",
                  "| arm | phase | allocated GiB | predicted GiB | error |", "| --- | --- | ---: | ---: | ---: |"]  # fmt: skip
        for key, entry in fsdp2.items():
            for row in entry.get("phases", []):
                lines.append(
                    f"| {key} | {row['phase']} | {_f(row['allocated_gib'], '.3f')} | {_f(row['predicted_gib'], '.3f')} "
                    f"| {_f(row['error_pct'], '+.1f')}% |"
                )
    lines += ["", "## The OOM report", ""]
    for key, entry in results["oom"].items():
        report = entry.get("report") or {}
        lines.append(f"- {key}: " + json.dumps({k: v for k, v in entry.items() if k != "report"}, default=str))
        if report:
            lines.append("  - report: " + json.dumps(report, default=str)[:1500])
    for device, entry in results.get("rates", {}).items():
        lines += ["", "## The device's rates", "", f"`lit-rl rates --device {device}`, saved as `{entry.get('file')}` "
                  "(the file `lit-rl estimate --plan --rates` times this device's candidates with, anywhere):", "",
                  *[f"    {line}" for line in entry.get("lines", [entry.get("error", "")])]]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cases, sizes = (QUICK, QUICK_SIZES) if args.quick else (FULL, Sizes())
    chosen = {"steps": args.steps, "new_tokens": args.new_tokens,
              "decode_lengths": args.decode_lengths and tuple(args.decode_lengths)}  # fmt: skip
    sizes = replace(sizes, **{k: v for k, v in chosen.items() if v})
    if args.render:
        results = json.loads(Path(args.render).read_text())
        if args.predict_missing:
            predict_missing(results, cases, sizes, _workers(args))
            Path(args.render).write_text(json.dumps(results, indent=1, default=str))
        Path(args.out).write_text(render(results))
        return results
    if not args.quick and not torch.cuda.is_available():
        raise SystemExit(
            "bench/device_check.py: no CUDA device; run it on a GPU machine, or pass --quick for tiny shapes"
        )
    out = Path(args.out)
    command = "python bench/device_check.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    results: dict[str, Any] = {"command": command.strip(), "quick": args.quick, "environment": environment(),
                               "parts": args.parts, "seconds": {}, "finished": False, "allocated_stat": "steady",
                               **{part: {} for part in ("rates", "peaks", "decode", "tactics", "oom", "vs_trl",
                                                        "fsdp2")}}  # fmt: skip

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
        out.write_text(render(results))

    def record(part: str, key: str, measure) -> None:
        start = time.perf_counter()
        print(f"[device_check] {part}: {key} ...", flush=True)
        try:
            results[part][key] = measure()
        except Exception as err:  # one failure is a row, not the end of the check
            traceback.print_exc()
            results[part][key] = {"error": _error(err)}
            _clear()
        results["seconds"][f"{part}: {key}"] = time.perf_counter() - start
        print(f"[device_check] {part}: {key} done in {results['seconds'][f'{part}: {key}']:.1f} s", flush=True)
        save()

    args.predictions = Predictions(_workers(args))
    for part in args.parts:
        PARTS[part](args, cases, sizes, record)
    print("[device_check] waiting for the estimator's predictions ...", flush=True)
    args.predictions.join(save)
    results["finished"] = True
    save()
    print(out.read_text())
    return results


if __name__ == "__main__":
    main()
