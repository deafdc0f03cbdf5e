"""The run's optimizer from ``--optimizer``: built with the method's learning rate and decay, refused in one line when
wrong, and charged by the estimator at its real state bytes (bitsandbytes' 8-bit AdamW against a real step)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from lit_rl.cli import main, parse_fit_config
from lit_rl.memory.estimate import estimate_step
from lit_rl.methods import RefCachedGRPO
from lit_rl.models import build_optimizer, optimizers

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/grpo_tiny.yaml")
# the tiny model's weights are all under bitsandbytes' default min_8bit_size (4096 values), which keep fp32 moments
ADAMW8BIT = {"class_path": "bitsandbytes.optim.AdamW8bit", "init_args": {"min_8bit_size": 256}}


def _params():
    return [torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(7))]


def test_the_optimizer_gets_the_methods_learning_rate_and_weight_decay():
    spec = {"class_path": "torch.optim.SGD", "init_args": {"momentum": 0.9}}
    optimizer = build_optimizer(spec, _params(), lr=0.25, weight_decay=0.01)
    assert isinstance(optimizer, torch.optim.SGD)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["momentum"]) == (0.25, 0.01, 0.9)


@pytest.mark.parametrize(
    ("spec", "weight_decay", "message"),
    [
        ({"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}, 0.0, "optimizer.init_args.lr: the method sets"),
        ({"class_path": "nope.Missing"}, 0.0, "optimizer.class_path: cannot import 'nope.Missing'"),
        ({"class_path": "torch.nn.Linear"}, 0.0, "'torch.nn.Linear' is not a torch.optim.Optimizer subclass"),
        ({"class_path": "torch.optim.Rprop"}, 0.1, "model.weight_decay: Rprop has no weight decay"),
    ],
)
def test_a_wrong_optimizer_is_refused_in_one_line(spec, weight_decay, message):
    with pytest.raises(ValueError, match=message) as err:
        build_optimizer(spec, _params(), lr=1e-3, weight_decay=weight_decay)
    assert "\n" not in str(err.value)


def test_the_cli_passes_optimizer_to_the_method_and_saves_it_as_plain_data():
    module, _, _ = parse_fit_config(["--config", TINY, "--optimizer", "bitsandbytes.optim.AdamW8bit",
                                     "--optimizer.betas", "[0.9, 0.95]"])  # fmt: skip
    spec = module.hparams.optimizer
    assert spec["class_path"] == "bitsandbytes.optim.AdamW8bit"
    assert list(spec["init_args"]["betas"]) == [0.9, 0.95] and "lr" not in spec["init_args"]
    module.setup("fit")
    module.configure_model()
    optimizer = module.configure_optimizers()
    assert type(optimizer).__name__ == "AdamW8bit"
    assert optimizer.param_groups[0]["lr"] == module.hparams.learning_rate
    plain, _, _ = parse_fit_config(["--config", TINY])
    assert plain.hparams.optimizer is None  # no --optimizer: the fused AdamW of every method


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.1"],
         "optimizer.lr: the method sets it; use --model.init_args.learning_rate instead"),
        (["--optimizer", "torch.nn.Linear"], "optimizer: 'torch.nn.Linear' is not a subclass of Optimizer"),
        (["--optimizer", "nope.Missing"], "optimizer.class_path: cannot import 'nope.Missing'"),
    ],
)  # fmt: skip
def test_the_cli_refuses_a_wrong_optimizer_in_one_line(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", TINY, "--trainer.default_root_dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith(f"error: {message}") and "\n" not in err
    assert not (tmp_path / "run").exists()  # nothing written


def test_the_estimate_charges_the_8bit_state_that_a_real_step_creates():
    method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=2, max_new_tokens=4)
    adamw = estimate_step(method, batch_size=1, prompt_length=5)
    eight = estimate_step(method, batch_size=1, prompt_length=5, optimizer=ADAMW8BIT)
    row = next(c for c in eight.components if c.name.startswith("optimizer state"))
    assert row.name == "optimizer state (AdamW8bit)" and "uint8" in row.shape
    # the same method with real weights: its optimizer's state bytes after one step
    real_method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=2, max_new_tokens=4, optimizer=ADAMW8BIT)
    real_method.setup("fit")
    real_method.configure_model()
    real = real_method.configure_optimizers()
    for p in real_method.policy.parameters():
        p.grad = torch.randn_like(p) if p.requires_grad else None
    real.step()
    state = [t for s in real.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert row.bytes == sum(t.untyped_storage().nbytes() for t in state)
    fp32 = next(c for c in adamw.components if c.name.startswith("optimizer state"))
    assert row.bytes < fp32.bytes / 2  # tensors under min_8bit_size keep fp32 moments, the rest 8 bits
    assert eight.phases["optimizer"] < adamw.phases["optimizer"]


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion8bit"])
def test_a_cpu_8bit_step_in_slices_is_bitwise_the_whole_tensors_step(name, monkeypatch):
    """Slices of whole 256-value blocks (the last one partial: 70 x 73 values) give bitsandbytes' own step exactly,
    and no call of its operator sees more than one slice."""
    bnb_optim = pytest.importorskip("bitsandbytes.optim")
    monkeypatch.setattr(optimizers, "SLICE_VALUES", 1024)
    functional = pytest.importorskip("bitsandbytes.functional")
    sizes = []
    update = functional.optimizer_update_8bit_blockwise
    monkeypatch.setattr(
        functional, "optimizer_update_8bit_blockwise", lambda *a, **k: sizes.append(a[2].numel()) or update(*a, **k)
    )
    torch.manual_seed(0)
    start = [torch.randn(70, 73), torch.randn(5000), torch.randn(900)]
    spec = {"class_path": f"bitsandbytes.optim.{name}", "init_args": {"min_8bit_size": 1000}}
    ours = [torch.nn.Parameter(w.clone()) for w in start]
    theirs = [torch.nn.Parameter(w.clone()) for w in start]
    sliced = build_optimizer(spec, ours, lr=1e-2, weight_decay=0.1)
    whole = getattr(bnb_optim, name)(theirs, lr=1e-2, weight_decay=0.1, min_8bit_size=1000)
    assert type(sliced).__name__ == name and isinstance(sliced, getattr(bnb_optim, name))
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        sliced.step()
        whole.step()
    for a, b, w in zip(ours, theirs, start):
        assert torch.equal(a, b) and not torch.equal(a, w)
        for key, value in whole.state[b].items():
            assert torch.equal(torch.as_tensor(sliced.state[a][key]), torch.as_tensor(value)), key
    sliced_sizes = [n for n in sizes if n <= 1024]
    assert max(sizes) == 5110 and sliced_sizes and max(sliced_sizes) == 1024  # the unsliced step saw whole tensors
    assert sorted(set(sliced_sizes)) == [5000 - 4 * 1024, 5110 - 4 * 1024, 1024]


def _lowbias32(value: int) -> int:
    """The hash-prospector's ``lowbias32`` in Python integers (no wrapping to trust), as a signed int32."""
    value &= 0xFFFFFFFF
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, 1)):
        value = ((value ^ (value >> shift)) * multiplier) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


@pytest.mark.parametrize("key", [0, 12345, 2**31 - 5, -(2**31), -7, 2**40 + 3])
def test_random_bits_are_the_hash_of_index_plus_key_in_wrapping_int32(key):
    """Every value against the hash in Python integers: an odd size (a vectorised body and a scalar tail), indices
    that carry past 2^31 (the int32 addition and the multiplications wrap), keys beyond 32 bits taken modulo 2^32."""
    bits = optimizers.random_bits(1037, key)
    assert bits.dtype == torch.int32
    assert bits.tolist() == [_lowbias32(key + i) for i in range(1037)]


def test_random_bits_halves_are_uniform():
    """Each 16-bit half of 2^20 values (one slice's draw: the weight's bits and the second moment's) spreads evenly
    over 256 bins (chi-square, 255 degrees of freedom, below its 0.1% point 330.5), for two keys."""
    for key in (99, optimizers._key(0, 3, 7, 1 << 20)):
        bits = optimizers.random_bits(1 << 20, key)
        for half in (bits & 0xFFFF, (bits >> 16) & 0xFFFF):
            counts = torch.bincount(half >> 8, minlength=256).double()
            expected = (1 << 20) / 256
            assert float(((counts - expected) ** 2 / expected).sum()) < 330.5


def test_stochastic_rounding_picks_a_neighbour_with_the_right_odds():
    """Against float64: every result is one of the two bf16 values around the input (the input itself when it is
    one), and the mean of many draws is the input, within the sampling error of that mean."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(997) * 10.0 ** torch.randint(-6, 3, (997,)), torch.randn(3).bfloat16().float()])
    x64 = x.double()
    draws = torch.stack([optimizers.stochastic_round_bf16(x).double() for _ in range(4000)])
    down = x.bfloat16().double()  # nearest; the other neighbour is one spacing on the input's side of it
    spacing = (torch.frexp(x64).exponent - 8).double().exp2()  # bf16 keeps 8 significant bits
    up = torch.where(down == x64, down, down + torch.sign(x64 - down) * spacing)
    low, high = torch.minimum(down, up), torch.maximum(down, up)
    assert bool(((draws == low) | (draws == high)).all())
    assert bool((draws[:, -3:] == x64[-3:]).all())  # exact bf16 values are kept
    p = ((x64 - low) / (high - low)).where(high > low, 0.0)  # the odds of rounding up
    error = (draws.mean(0) - x64).abs()
    assert bool((error <= 5 * (p * (1 - p) / 4000).sqrt() * (high - low) + 1e-300).all())


@pytest.mark.parametrize("shape", [(3000, 11), (400, 10)], ids=["8-bit moments", "fp32 moments, under min_8bit_size"])
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
)
def test_bf16_weights_keep_learning_under_the_8bit_step_rounded_stochastically(device, shape):
    """Updates far below the bf16 spacing: bitsandbytes' own step leaves the bf16 weights where they were, lit-rl's
    moves them as the float32 weights move on average; the same seeds give the same weights. Also for a tensor small
    enough (a norm's, a bias) that bitsandbytes keeps its moments in fp32."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    start = torch.randn(*shape) * 0.1
    spec = {"class_path": "bitsandbytes.optim.AdamW8bit"}

    def train(dtype, build):
        weight = torch.nn.Parameter(start.to(device, dtype, copy=True))
        optimizer = build([weight])
        generator = torch.Generator().manual_seed(1)
        for _ in range(30):
            weight.grad = (torch.randn(start.shape, generator=generator) + 2.0).to(device, dtype)
            optimizer.step()
        return weight.detach().double().cpu()

    ours = lambda params: build_optimizer(spec, params, lr=1e-5, weight_decay=0.0)  # noqa: E731
    import bitsandbytes.optim

    theirs = lambda params: bitsandbytes.optim.AdamW8bit(params, lr=1e-5, weight_decay=0.0)  # noqa: E731
    fp32, rounded, nearest = train(torch.float32, ours), train(torch.bfloat16, ours), train(torch.bfloat16, theirs)
    moved = (fp32 - start.double()).mean()
    assert moved < -2e-4  # the gradients' mean is positive: every weight moved down by about 30 x lr
    assert abs((nearest - start.bfloat16().double()).mean()) < 0.1 * abs(moved)  # rounded away, but near 0
    assert abs((rounded - start.bfloat16().double()).mean() - moved) < 0.05 * abs(moved)
    assert torch.equal(rounded, train(torch.bfloat16, ours))


def _adamw64(weight, grads, *, lr, decay, betas=(0.9, 0.999), eps=1e-8):
    """Plain float64 AdamW (decoupled weight decay) from ``weight`` over the gradients in ``grads``."""
    w = weight.double().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        w = w * (1 - lr * decay)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        w = w - lr / (1 - betas[0] ** t) * m / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return w, m, v


@pytest.mark.parametrize("size", [(70, 73), (3, 1)])
def test_stochastic_adamw_is_torch_adamw_for_float32_and_float64_adamw_for_bf16(size):
    """float32 weights: bitwise torch's fused AdamW. bf16 weights, one step: each weight one of the two bf16
    neighbours of float64 AdamW's result from the same bf16 start and gradient (odd sizes, weight decay on)."""
    torch.manual_seed(0)
    start, grad = torch.randn(size), torch.randn(size)
    ours = torch.nn.Parameter(start.clone())
    theirs = torch.nn.Parameter(start.clone())
    a = optimizers.StochasticAdamW([ours], lr=1e-2, weight_decay=0.1, fused=True)
    b = torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(3):
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    assert torch.equal(ours, theirs)
    half = torch.nn.Parameter(start.bfloat16())
    half.grad = grad.bfloat16()
    optimizers.StochasticAdamW([half], lr=1e-2, weight_decay=0.1).step()
    ref, _, _ = _adamw64(start.bfloat16(), [grad.bfloat16()], lr=1e-2, decay=0.1)
    spacing = (torch.frexp(ref).exponent - 8).double().exp2()
    assert bool(((half.double() - ref).abs() <= spacing).all())
    assert half.dtype == torch.bfloat16 and a.state[ours]["exp_avg"].dtype == torch.float32


def test_stochastic_adamw_steps_in_float32_whatever_the_default_dtype(monkeypatch):
    """Lightning's bf16-true makes bfloat16 torch's default dtype: the step's float32 slices and its step count
    must not follow it. Several slices (one partial) and 300 steps (past 256, where bf16 stops counting by one):
    the same weights and moments as under the float32 default."""
    monkeypatch.setattr(optimizers, "SLICE_VALUES", 256)
    torch.manual_seed(0)
    start, grads = torch.randn(33, 29) * 0.1, [torch.randn(33, 29) for _ in range(4)]

    def train(default):
        weight = torch.nn.Parameter(start.bfloat16())
        previous = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            optimizer = optimizers.StochasticAdamW([weight], lr=1e-3, weight_decay=0.1)
            for step in range(300):
                weight.grad = grads[step % 4].bfloat16()
                optimizer.step()
        finally:
            torch.set_default_dtype(previous)
        state = optimizer.state[weight]
        return weight.detach(), state["exp_avg"], state["exp_avg_sq"]

    assert all(torch.equal(a, b) for a, b in zip(train(torch.bfloat16), train(torch.float32), strict=True))


def test_stochastic_adamw_keeps_updates_that_torchs_bf16_adamw_rounds_away():
    """lr 1e-5 on weights of size 0.1 (bf16 spacing 2^-10 to 2^-11, far above the update): torch's AdamW leaves the
    bf16 weights where they were; StochasticAdamW moves them as float64 AdamW does on average, its second moment
    follows float64's too, and a step split across slices, or repeated from the same start, draws the same bits."""
    torch.manual_seed(0)
    start = torch.randn(3000, 11) * 0.1
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(start.shape, generator=generator) + 2.0 for _ in range(30)]

    def train(cls, **kwargs):
        weight = torch.nn.Parameter(start.bfloat16())
        optimizer = cls([weight], lr=1e-5, weight_decay=0.0, **kwargs)
        for g in grads:
            weight.grad = g.bfloat16()
            optimizer.step()
        return weight.detach().double(), optimizer.state[weight]["exp_avg_sq"].double()

    ref, _, v64 = _adamw64(start.bfloat16(), [g.bfloat16() for g in grads], lr=1e-5, decay=0.0)
    moved = (ref - start.bfloat16().double()).mean()
    (ours, v), (nearest, _) = train(optimizers.StochasticAdamW), train(torch.optim.AdamW, fused=True)
    assert moved < -2e-4
    assert abs((nearest - start.bfloat16().double()).mean()) < 0.1 * abs(moved)
    assert abs((ours - start.bfloat16().double()).mean() - moved) < 0.05 * abs(moved)
    assert abs(v.mean() / v64.mean() - 1) < 0.01
    assert torch.equal(ours, train(optimizers.StochasticAdamW)[0])


def test_stochastic_adamw_resumes_exactly_and_refuses_what_it_does_not_offer(monkeypatch):
    monkeypatch.setattr(optimizers, "SLICE_VALUES", 256)  # several slices, a partial last one
    torch.manual_seed(0)
    start, grads = torch.randn(33, 29).bfloat16(), [torch.randn(33, 29).bfloat16() for _ in range(4)]

    def run(resume_after=None):
        weight = torch.nn.Parameter(start.clone())
        optimizer = optimizers.StochasticAdamW([weight], lr=1e-3, weight_decay=0.01)
        for i, g in enumerate(grads):
            if i == resume_after:
                saved = optimizer.state_dict()
                weight = torch.nn.Parameter(weight.detach().clone())
                optimizer = optimizers.StochasticAdamW([weight], lr=1e-3, weight_decay=0.01)
                optimizer.load_state_dict(saved)
            weight.grad = g
            optimizer.step()
        return weight.detach()

    assert torch.equal(run(), run(resume_after=2))
    with pytest.raises(ValueError, match="amsgrad is not offered by StochasticAdamW; use torch.optim.AdamW"):
        optimizers.StochasticAdamW([torch.nn.Parameter(start.clone())], amsgrad=True)


def test_the_default_optimizer_keeps_bf16_updates_and_others_say_whether_they_do():
    params = [torch.nn.Parameter(torch.zeros(4).bfloat16())]
    assert (
        type(optimizers.default_optimizer(params, lr=1e-5, weight_decay=0.0, mixed=False)) is optimizers.StochasticAdamW
    )
    assert optimizers.keeps_bf16_updates(None)
    assert optimizers.keeps_bf16_updates({"class_path": "lit_rl.models.StochasticAdamW"})
    named = build_optimizer({"class_path": "lit_rl.models.StochasticAdamW"}, params, lr=3e-6, weight_decay=0.5)
    assert (named.defaults["lr"], named.defaults["weight_decay"]) == (3e-6, 0.5)  # the method's, as for any class
    assert not optimizers.keeps_bf16_updates({"class_path": "torch.optim.AdamW"})
    if importlib.util.find_spec("bitsandbytes"):
        assert optimizers.keeps_bf16_updates({"class_path": "bitsandbytes.optim.AdamW8bit"})
        assert optimizers.keeps_bf16_updates({"class_path": "bitsandbytes.optim.Lion8bit"})


DTENSOR_STEP = """
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from lit_rl.models.optimizers import StochasticAdamW
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
start, grad = torch.randn(37, 5).bfloat16(), torch.randn(37, 5).bfloat16()
plain = torch.nn.Parameter(start.clone())
sharded = torch.nn.Parameter(distribute_tensor(start.clone(), mesh, [Shard(0)]))
for p, g in ((plain, grad), (sharded, distribute_tensor(grad, mesh, [Shard(0)]))):
    optimizer = StochasticAdamW([p], lr=1e-3, weight_decay=0.01)
    for _ in range(2):
        p.grad = g
        optimizer.step()
assert not torch.equal(plain.detach(), start)
assert torch.equal(sharded.detach().full_tensor(), plain.detach()), "the shard's step differs"
dist.destroy_process_group()
print("ok")
"""


def test_stochastic_adamw_steps_a_sharded_weight_through_its_local_shard():
    """An FSDP2 weight is a DTensor: the step runs on its local shard (one rank here, so the shard is the whole
    tensor) and must equal the plain tensor's step bit for bit, the write reaching the parameter."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PORT": str(port)}
    run = subprocess.run([sys.executable, "-c", DTENSOR_STEP], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
