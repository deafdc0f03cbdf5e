"""A 4-bit NF4 frozen base: bitsandbytes or torchao, measured on this machine.

``model.quantize_base: nf4`` holds the frozen Linear weights of the policy's trunk in 4-bit NormalFloat with
one scale per block of 64 weights (QLoRA, Dettmers et al. 2023, arXiv 2305.14314), dequantized in the forward;
the LoRA adapters stay in the training dtype. Two maintained libraries implement the format:

- **bitsandbytes** (``bnb.nn.Linear4bit`` / ``bnb.functional.quantize_4bit``), the QLoRA authors' library:
  a module that replaces ``nn.Linear``; scales optionally quantized again (double quantization); C kernels
  for CPU, CUDA kernels on GPUs; peft has a LoRA layer for it.
- **torchao** (``torchao.quantization.NF4Tensor``, as torchtune's QLoRA uses it): a tensor subclass put in
  place of ``nn.Linear.weight``; always double-quantized (int8 block scales); dequantized with plain PyTorch.

For each backend this script checks what a QLoRA policy needs (odd shapes that are not a multiple of the
block, peft's LoRA wrapping, the gradient after an eval-mode no-grad pass -- the rollout and reference pass
run that way before every update --, ``deepcopy``, ``model.to(dtype)``) and measures, per dtype (float32,
bfloat16) and shape, the forward + backward of one LoRA-wrapped linear (rank 16; gradient into the adapter and
the input, base frozen), the no-grad forward, the error against a float64 reference of the *dequantized*
weights (the quantization itself is exact by construction; what is checked is the arithmetic around it) and
the bytes per parameter of the stored weight including its scales.

Shapes: SmolLM2-135M's MLP (``[2048 x 576] @ [576 -> 1536]``, 2048 tokens) and its attention projection
(``576 -> 576``).

Run (about 20 seconds on one core of a 2-core machine)::

    OMP_NUM_THREADS=1 python bench/bench_quantize.py           # writes bench/results/quantize.md
    OMP_NUM_THREADS=1 python bench/bench_quantize.py --quick   # small shapes, 2 repeats; prints only
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import harness
import torch

RESULTS = harness.ROOT / "bench" / "results"
BLOCK = 64  # weights per absmax scale, QLoRA's choice
SCALER_BLOCK = 256  # scales per second-level scale (double quantization), QLoRA's choice
RANK = 16
SHAPES = ((2048, 576, 1536), (2048, 576, 576))  # (tokens, in, out)
QUICK_SHAPES = ((64, 128, 192),)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COLUMNS = (
    "backend | dtype | tokens x in -> out | fwd+bwd ms | vs dense | no-grad fwd ms | vs dense | value err | grad err "
    "| bytes / param"
).split(" | ")


# ---------------------------------------------------------------------------------------------- backends
@dataclass
class Backend:
    """One way of holding a frozen ``[out, in]`` weight: how to build the layer and read back what it stores."""

    name: str
    package: str | None  # distribution name, None for the dense baseline
    build: Callable[[torch.Tensor], torch.nn.Module]  # weight [out, in] in the compute dtype -> layer
    dequantized: Callable[[torch.nn.Module], torch.Tensor]  # layer -> the weight its forward uses [out, in]
    stored_bytes: Callable[[torch.nn.Module], int]  # bytes of the weight and everything needed to decode it


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _dense() -> Backend:
    def build(w):
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
        layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        return layer

    return Backend("dense (no quantization)", None, build, lambda m: m.weight.detach(), lambda m: _nbytes(m.weight))


def _bnb(double_quant: bool, cpu_repack: bool = False) -> Backend:
    import bitsandbytes as bnb

    def build(w):
        layer = bnb.nn.Linear4bit(
            w.shape[1], w.shape[0], bias=False, compute_dtype=w.dtype, compress_statistics=double_quant,
            quant_type="nf4", device="meta",
        )  # fmt: skip
        layer.weight = bnb.nn.Params4bit(
            w.clone(), requires_grad=False, blocksize=BLOCK, compress_statistics=double_quant, quant_type="nf4"
        )
        layer = layer.to(w.device)  # quantizes here
        # on a CPU with AVX512-BF16, Linear4bit repacks its weight for a bf16 inference kernel at the first eval-mode
        # no-grad forward; the repacked weight is then also used in training, without a backward
        layer.support_avx512bf16_for_cpu = layer.support_avx512bf16_for_cpu and cpu_repack
        return layer

    def dequantized(m):
        return bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)

    def stored(m):
        qs = m.weight.quant_state
        total = _nbytes(m.weight.data, qs.absmax, qs.code)
        if qs.nested:
            total += _nbytes(qs.state2.absmax, qs.state2.code, qs.offset)
        return total

    name = f"bitsandbytes nf4{' + double quant' if double_quant else ''}{', CPU repack on (default)' if cpu_repack else ''}"
    return Backend(name, "bitsandbytes", build, dequantized, stored)


def _largest_divisor(n: int, at_most: int) -> int:
    return next(d for d in range(min(n, at_most), 0, -1) if n % d == 0)


def _torchao() -> Backend:
    from torchao.quantization import to_nf4

    def build(w):
        # torchao needs numel % BLOCK == 0 and the block count to be a multiple of the scaler block:
        # 576 x 576 has 5184 blocks, not a multiple of 256, so take the largest divisor up to 256
        scaler_block = _largest_divisor(w.numel() // BLOCK, SCALER_BLOCK)
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
        layer.weight = torch.nn.Parameter(to_nf4(w.clone(), BLOCK, scaler_block), requires_grad=False)
        return layer

    def stored(m):
        t = m.weight
        return _nbytes(t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4)

    return Backend("torchao NF4Tensor", "torchao", build, lambda m: m.weight.get_original_weight(), stored)


BACKENDS: dict[str, Callable[[], Backend]] = {
    "dense": _dense,
    "bnb": lambda: _bnb(double_quant=False),
    "bnb-dq": lambda: _bnb(double_quant=True),
    "bnb-dq-repack": lambda: _bnb(double_quant=True, cpu_repack=True),
    "torchao": _torchao,
}


def load_backends() -> tuple[list[Backend], dict[str, str]]:
    """The importable backends and, for the others, why not."""
    found, missing = [], {}
    for key, make in BACKENDS.items():
        try:
            found.append(make())
        except Exception as exc:  # an import error, or a wheel that does not load against this torch
            missing[key] = f"{type(exc).__name__}: {exc}"
    return found, missing


# ---------------------------------------------------------------------------------------------- checks
def _try(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception as exc:
        return f"no: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"


def _lora(layer: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``layer`` under peft's LoRA (rank 16), adapters initialised randomly so that both paths carry signal."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["0"], init_lora_weights=False)
    model = get_peft_model(torch.nn.Sequential(layer), config)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(dtype)
    return model


def checks(backend: Backend) -> dict[str, str]:
    """What a QLoRA policy needs of the backend, each ``yes`` or why not."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, str] = {}
    out["odd shape 41 x 73 (not a multiple of 64)"] = _try(
        lambda: "yes" if backend.build(torch.randn(41, 73, generator=gen)) is not None else "no"
    )

    def peft_layer() -> str:
        wrapped = type(_lora(backend.build(torch.randn(64, 128, generator=gen)), torch.float32).base_model.model[0])
        return f"yes ({wrapped.__module__.split('.')[-1]}.{wrapped.__name__})"

    out["peft LoRA wraps it"] = _try(peft_layer)

    def eval_then_train() -> str:
        model = _lora(backend.build(torch.randn(64, 128, generator=gen)), torch.float32)
        x = torch.randn(5, 128, generator=gen)
        model.train()
        xa = x.clone().requires_grad_()
        ya = model(xa)
        ya.sum().backward()
        model.eval()
        with torch.no_grad():
            y_eval = model(x)
        model.train()
        xb = x.clone().requires_grad_()
        model(xb).sum().backward()
        if xb.grad is None:
            return "no: input gradient lost after an eval no-grad pass"
        same = (y_eval - ya.detach()).abs().max().item()
        grad = (xb.grad - xa.grad).abs().max().item()
        return "yes" if max(same, grad) < 1e-5 else f"no: eval output off by {same:.1e}, input grad by {grad:.1e}"

    out["train after an eval no-grad pass (same output, input grad)"] = _try(eval_then_train)

    def deepcopies() -> str:
        layer = backend.build(torch.randn(64, 128, generator=gen))
        twin = copy.deepcopy(layer)
        return "yes" if torch.equal(backend.dequantized(twin), backend.dequantized(layer)) else "no: values changed"

    out["deepcopy"] = _try(deepcopies)

    def to_bf16() -> str:
        layer = backend.build(torch.randn(64, 128, generator=gen))
        before = backend.stored_bytes(layer)
        layer = layer.to(torch.bfloat16)
        after = _try(lambda: str(backend.stored_bytes(layer)))
        return "yes (stays 4-bit)" if after == str(before) else "no: dequantized to a dense weight"

    out["module.to(bfloat16)"] = _try(to_bf16) if backend.package else "yes"
    return out


# ---------------------------------------------------------------------------------------------- timing
def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: one-off packing, allocator, first-call dispatch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def measure(backend: Backend, dtype: torch.dtype, shape: tuple[int, int, int], repeats: int) -> dict[str, float]:
    """Median milliseconds of the LoRA-wrapped layer's fwd+bwd and no-grad forward, its errors against float64,
    and the stored weight's bytes per parameter."""
    tokens, d_in, d_out = shape
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(d_out, d_in, generator=gen) / d_in**0.5).to(dtype)  # [out, in]
    x = torch.randn(tokens, d_in, generator=gen).to(dtype)  # [N, in]
    upstream = torch.randn(tokens, d_out, generator=gen).to(dtype)  # [N, out]
    layer = backend.build(weight)
    stored = backend.stored_bytes(layer)
    w64 = backend.dequantized(layer).double()  # [out, in] read before any forward can repack the storage
    model = _lora(layer, dtype)
    lora_a = model.base_model.model[0].lora_A["default"].weight  # [r, in]
    lora_b = model.base_model.model[0].lora_B["default"].weight  # [out, r]
    scaling = model.base_model.model[0].scaling["default"]

    def train_step() -> None:
        xi = x.clone().requires_grad_()
        model(xi).backward(upstream)

    train_ms = _median_ms(train_step, repeats)
    model.eval()
    with torch.no_grad():
        nograd_ms = _median_ms(lambda: model(x), repeats)
    model.train()

    # float64 reference with the weights the backend decodes: y = x W^T + s x A^T B^T
    x64 = x.double().requires_grad_()
    a64 = lora_a.detach().double().requires_grad_()
    y64 = x64 @ w64.T + scaling * (x64 @ a64.T) @ lora_b.detach().double().T  # [N, out]
    y64.backward(upstream.double())
    lora_a.grad = None
    xi = x.clone().requires_grad_()
    y = model(xi)
    y.backward(upstream)
    value_err = _rel(y.detach(), y64.detach())
    # nan: no input gradient at all (bitsandbytes' CPU repack)
    grad_err = max(_rel(xi.grad, x64.grad) if xi.grad is not None else float("nan"), _rel(lora_a.grad, a64.grad))
    return {"train_ms": train_ms, "nograd_ms": nograd_ms, "value_err": value_err, "grad_err": grad_err,
            "bytes_per_param": stored / weight.numel()}  # fmt: skip


# ---------------------------------------------------------------------------------------------- report
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 repeats, print only")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per case (median; default 7)")
    parser.add_argument("--out", type=Path, default=None, help="folder for quantize.md (default bench/results)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    opts = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # an optional CPU kernel package it looks for
    logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA-only extensions fail to load on CPU
    cmd = " ".join(["OMP_NUM_THREADS=1 python bench/bench_quantize.py", *(argv if argv is not None else sys.argv[1:])])
    out_dir = opts.out if opts.out is not None else (None if opts.quick else RESULTS)
    repeats = opts.repeats or (2 if opts.quick else 7)
    shapes = QUICK_SHAPES if opts.quick else SHAPES
    print(f"bench_quantize: {'writing to ' + str(out_dir) if out_dir else 'printing only'}", file=sys.stderr)
    load_start = harness.load_average()
    start = time.perf_counter()
    backends, missing = load_backends()
    found_checks = {b.name: checks(b) for b in backends}
    rows = []
    for dtype_name, dtype in DTYPES.items():
        for shape in shapes:
            dense = None
            for b in backends:  # the dense baseline first: the "vs dense" columns divide by its times
                r = measure(b, dtype, shape, repeats)
                dense = dense or r
                print(f"  {b.name} {dtype_name} {shape}: {r['train_ms']:.1f} ms", file=sys.stderr, flush=True)
                rows.append(
                    [
                        b.name,
                        dtype_name,
                        "{} x {} -> {}".format(*shape),
                        f"{r['train_ms']:.1f}",
                        f"{r['train_ms'] / dense['train_ms']:.2f}x",
                        f"{r['nograd_ms']:.1f}",
                        f"{r['nograd_ms'] / dense['nograd_ms']:.2f}x",
                        f"{r['value_err']:.1e}",
                        f"{r['grad_err']:.1e}",
                        f"{r['bytes_per_param']:.4f}",
                    ]
                )
    wall = time.perf_counter() - start
    load_end = harness.load_average()
    names = [b.name for b in backends]
    text = [
        *harness.header_lines(
            "A 4-bit NF4 frozen base: bitsandbytes vs torchao",
            "OMP_NUM_THREADS=1 python bench/bench_quantize.py",
            this_file=cmd,
            loads=[load_start, load_end],
            threads=torch.get_num_threads(),
            dists=("torch", "bitsandbytes", "torchao", "peft", "transformers"),
        ),
        f"Total wall time {wall:.0f} s.",
        "",
        *(f"Not measured: {k}: {why}" for k, why in missing.items()),
        "",
        "### What a QLoRA policy needs",
        "",
        *harness.markdown_table(
            ["check", *names],
            [[q, *(found_checks[n][q] for n in names)] for q in found_checks[names[0]]],
            ["---"] * (len(names) + 1),
        ),
        "",
        f"### Speed, error and size (median of {repeats}; LoRA rank {RANK} through peft, block {BLOCK})",
        "",
        "fwd+bwd: forward and backward of the LoRA-wrapped layer, gradient into the adapters and the input, the "
        "base frozen (the policy update); no-grad fwd: eval mode, no autograd (rollout, reference pass). "
        "value / grad err: largest error relative to the largest value, against float64 with the weights the "
        "backend decodes (output; input and lora_A gradients). bytes / param: the stored weight with its scales "
        "(and second-level scales, code books), per weight.",
        "",
        *harness.markdown_table(COLUMNS, rows, ["---"] * 3 + ["---:"] * 7),
        "",
        "Bytes per parameter from the format (QLoRA, arXiv 2305.14314): 4 bits + a float32 absmax per 64 weights = "
        "0.5625; with double quantization, an 8-bit absmax per 64 weights and a float32 per 256 of those = "
        "0.5159 (4.127 bits). Measured values differ by the small fixed code books.",
    ]
    report = "\n".join(text)
    print(report)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "quantize.md").write_text(f"{report}\n")
        print(f"wrote {out_dir / 'quantize.md'}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
