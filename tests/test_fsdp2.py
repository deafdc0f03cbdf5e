"""FSDP2 on two CPU processes (gloo) against one process on the same global batch, launched as a user would
(``lit-rl fit`` with ``FSDP2Strategy``): the gradients of the first step and the weights after three steps equal
the one-process run's, for each method, with full fine-tuning and LoRA, bf16 weights and activation checkpointing.

The two runs draw the same completions for a prompt: the test seeds each prompt's rollout from its tokens (the
sampler's random stream is otherwise per process). Everything else is the product's own step. A gradient
averaged wrongly over the ranks (as gloo's reduce-scatter did in some torch releases) fails the comparison.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # two ranks on gloo, launched through `lit-rl fit`

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
STEPS = 3
ALIAS = "lit_rl_beside_trunk"  # the sharded trunk's second name for the LM head (lit_rl.models.head.ADOPTED)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().double().clone()


def seeded_per_prompt(sample):
    """``sample_completions`` drawing each prompt's completions from a seed made of its tokens, so that the same
    prompt gets the same completions whichever process and batch it is in."""

    def sample_each(policy, input_ids, attention_mask, pad_id, eos, **kwargs):
        runs = []
        for ids, mask in zip(input_ids.split(1), attention_mask.split(1), strict=True):
            tokens = ids[mask.bool()]
            seed = int((tokens * torch.arange(1, tokens.numel() + 1)).sum())
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                runs.append(sample(policy, ids, mask, pad_id, eos, **kwargs))
        sequences = [r[0] if isinstance(r, tuple) else r for r in runs]
        width = max(s.shape[1] for s in sequences)
        padded = torch.cat([torch.nn.functional.pad(s, (0, width - s.shape[1]), value=pad_id) for s in sequences])
        if not isinstance(runs[0], tuple):
            return padded
        if runs[0][1] is None:
            return padded, None
        new = width - input_ids.shape[1]
        logp = torch.cat([torch.nn.functional.pad(r[1], (0, new - r[1].shape[1])) for r in runs])
        return padded, logp

    return sample_each


class ShardRecorder(Callback):
    """Seeds each prompt's rollout (see :func:`seeded_per_prompt`) and writes the gradients of the first step and
    the trainable weights at the end, whole (gathered from the shards), to ``out/rank<r>.pt``."""

    def __init__(self, out: str, wrong_average: bool = False) -> None:
        self.out = Path(out)
        self.grads: dict[str, torch.Tensor] = {}
        self.wrong_average = wrong_average  # the negative control: gradients summed over processes, not averaged

    def setup(self, trainer, pl_module, stage: str) -> None:
        import lit_rl.methods.grpo as grpo

        grpo.sample_completions = seeded_per_prompt(grpo.sample_completions)  # this process's module only

    def _named(self, pl_module):
        named = pl_module.policy.named_parameters(remove_duplicate=False)
        return [(n, p) for n, p in named if p.requires_grad and ALIAS not in n.split(".")]

    def on_train_start(self, trainer, pl_module) -> None:
        if self.wrong_average:
            from torch.distributed.fsdp import FSDPModule

            for module in pl_module.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
        self.start = {n: _full(p) for n, p in self._named(pl_module)}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.grads:
            self.grads = {n: _full(p.grad) for n, p in self._named(pl_module) if p.grad is not None}

    def on_train_end(self, trainer, pl_module) -> None:
        params = {n: _full(p) for n, p in self._named(pl_module)}
        torch.save(
            {"grads": self.grads, "params": params, "start": self.start}, self.out / f"rank{trainer.global_rank}.pt"
        )


METHODS = {"grpo": "grpo_tiny.yaml", "intuitor": "intuitor_tiny.yaml", "gumbel_topk": "gumbel_topk_tiny.yaml"}
LORA = ["--model.init_args.lora", "{r: 4, alpha: 8, target_modules: all-linear}"]
# plain SGD: the weights are linear in the gradients, so a gradient scaled wrongly shows in them too (AdamW divides
# a constant factor away, and turns rounding noise in a near-zero gradient into a whole step)
SGD = ["--optimizer", "torch.optim.SGD", "--model.init_args.learning_rate", "0.5"]


def _fit(
    config: str, out: Path, *, processes: int, batch_size: int, extra: list[str], strategy="fsdp2", wrong=False
) -> dict:
    out.mkdir()
    recorder = {"class_path": "test_fsdp2.ShardRecorder", "init_args": {"out": str(out), "wrong_average": wrong}}
    trainer = {"accelerator": "cpu", "devices": processes, "use_distributed_sampler": False, "max_steps": STEPS,
               "limit_val_batches": 0, "enable_progress_bar": False, "enable_model_summary": False,
               "enable_checkpointing": False, "logger": False, "callbacks": [recorder],
               "default_root_dir": str(out)}  # fmt: skip
    if processes > 1:
        trainer["strategy"] = {"class_path": "lit_rl.strategies.FSDP2Strategy"} if strategy == "fsdp2" else strategy
    (out / "trainer.yaml").write_text(yaml.safe_dump({"trainer": trainer}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    args = ["fit", "--config", str(ROOT / "configs" / config), "--config", str(out / "trainer.yaml"),
            "--data.init_args.batch_size", str(batch_size), *SGD, *extra]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "lit_rl", *args], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for noise in ("all_gather is deprecated", "overwriting since"):  # filtered by lit_rl.cli_noise
        assert noise not in run.stderr, f"a sharded run printed {noise!r}"
    return torch.load(out / "rank0.pt", weights_only=True)


def _max_difference(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor]) -> float:
    assert one.keys() == two.keys() and one
    return max(float((one[k] - two[k]).abs().max()) for k in one)


BF16 = ["--trainer.precision", "bf16-true", "--model.init_args.dtype", "bfloat16"]
CHECKPOINTED = ["--config", str(ROOT / "callbacks" / "activation_checkpointing.yaml")]
EXACT, BF16_ROUNDING = (1e-5, 1e-3), (1e-2, 2e-2)  # tolerances of the gradients and the weights, relative to scale
# every method, both ways of training (what is sharded, every weight or the adapters beside a frozen base that is also
# the reference, depends on LoRA, not on the method), bf16 weights both ways (within bf16's 8 bits of mantissa) and
# activation checkpointing: each setting once, on a method that has the others' code paths
CASES = {
    "grpo-full": ("grpo", [], EXACT),
    "grpo-full-bf16": ("grpo", BF16, BF16_ROUNDING),
    "grpo-lora-bf16": ("grpo", [*LORA, *BF16], BF16_ROUNDING),
    "intuitor-lora-checkpointed": ("intuitor", [*LORA, *CHECKPOINTED], EXACT),
    "gumbel_topk-full": ("gumbel_topk", [], EXACT),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_sharded_processes_train_what_one_process_trains(case, tmp_path):
    method, extra, (grad_tolerance, weight_tolerance) = CASES[case]
    if method == "gumbel_topk":  # its noise is drawn per process: the reference is DDP, each rank drawing the same
        one = _fit(METHODS[method], tmp_path / "one", processes=2, batch_size=2, extra=extra, strategy="ddp")
    else:
        one = _fit(METHODS[method], tmp_path / "one", processes=1, batch_size=4, extra=extra)
    two = _fit(METHODS[method], tmp_path / "two", processes=2, batch_size=2, extra=extra)
    scale = max(float(g.abs().max()) for g in one["grads"].values())
    assert scale > 0, "the first step has no gradient: nothing would be compared"
    grads, params = _max_difference(one["grads"], two["grads"]), _max_difference(one["params"], two["params"])
    moved = _max_difference(one["start"], one["params"])  # equal weights at the end mean equal updates if they moved
    print(f"{case}: gradients {grads:.2e} of {scale:.2e}, weights {params:.2e} of {moved:.2e}")
    assert grads <= grad_tolerance * scale
    # rounding, grown by three steps (and Intuitor's per-group std)
    assert moved > 1e-3 and params <= weight_tolerance * moved


def test_a_bf16_mixed_rollout_gathered_layer_by_layer_trains_what_one_process_trains(tmp_path):
    """``rollout_gather: layers`` under bf16-mixed: outside its forward each layer's weight is a shard, which the
    decode loop's casts made once must leave to FSDP2's gathering (lit_rl/models/cast_once.py; this run failed
    with a DTensor error before)."""
    extra = [*LORA, "--trainer.precision", "bf16-mixed"]
    layers = {"class_path": "lit_rl.strategies.FSDP2Strategy", "init_args": {"rollout_gather": "layers"}}
    one = _fit(METHODS["grpo"], tmp_path / "one", processes=1, batch_size=4, extra=extra)
    two = _fit(METHODS["grpo"], tmp_path / "two", processes=2, batch_size=2, extra=extra, strategy=layers)
    scale = max(float(g.abs().max()) for g in one["grads"].values())
    grads, params = _max_difference(one["grads"], two["grads"]), _max_difference(one["params"], two["params"])
    moved = _max_difference(one["start"], one["params"])
    assert scale > 0 and moved > 1e-3
    assert grads <= BF16_ROUNDING[0] * scale and params <= BF16_ROUNDING[1] * moved


def test_the_comparison_fails_when_the_processes_sum_their_gradients(tmp_path):
    """The negative control: a reduction that sums instead of averaging (as a wrong gloo AVG would scale them) is
    caught by the first-step gradients, and by the weights (plain SGD is linear in the gradients)."""
    one = _fit("grpo_tiny.yaml", tmp_path / "one", processes=1, batch_size=4, extra=[])
    two = _fit("grpo_tiny.yaml", tmp_path / "two", processes=2, batch_size=2, extra=[], wrong=True)
    scale = max(float(g.abs().max()) for g in one["grads"].values())
    assert _max_difference(one["grads"], two["grads"]) > 0.5 * scale
    assert _max_difference(one["params"], two["params"]) > 0.1 * _max_difference(one["start"], one["params"])


def test_a_sharded_checkpoint_resumes_exactly_and_exports_to_one_folder(tmp_path):
    """Stop at step 2 and resume to 4 from the sharded checkpoint (a folder, one file per process) = a straight run
    to 4; ``lit-rl export`` of the resumed run's checkpoint is one Hugging Face folder with the trained weights."""
    saving = ["--trainer.enable_checkpointing", "true", "--trainer.callbacks+",
              "lightning.pytorch.callbacks.ModelCheckpoint", "--trainer.callbacks.dirpath", str(tmp_path / "ckpt"),
              "--trainer.callbacks.every_n_train_steps", "2", "--trainer.callbacks.save_last", "true"]  # fmt: skip
    straight = _fit(
        "grpo_fsdp_tiny.yaml", tmp_path / "straight", processes=2, batch_size=2, extra=["--trainer.max_steps", "4"]
    )
    _fit(
        "grpo_fsdp_tiny.yaml",
        tmp_path / "first",
        processes=2,
        batch_size=2,
        extra=["--trainer.max_steps", "2", *saving],
    )
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_dir() and len(list(last.glob("*.distcp"))) == 2, "not one shard per process"
    resumed = _fit("grpo_fsdp_tiny.yaml", tmp_path / "resumed", processes=2, batch_size=2,
                   extra=["--trainer.max_steps", "4", "--ckpt_path", str(last), *saving])  # fmt: skip
    assert straight["params"].keys() == resumed["params"].keys()
    assert all(torch.equal(straight["params"][k], resumed["params"][k]) for k in straight["params"])
    assert _max_difference(straight["start"], straight["params"]) > 1e-3  # the four steps moved the weights

    out = tmp_path / "exported"
    run = subprocess.run([sys.executable, "-m", "lit_rl", "export", "--ckpt_path", str(last), "--out", str(out)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    exported = {n: p.detach().double() for n, p in model.named_parameters(remove_duplicate=False)}
    assert exported.keys() == resumed["params"].keys()
    assert all(torch.equal(exported[k], resumed["params"][k]) for k in exported)


def test_cpu_offload_on_a_cpu_run_is_refused_in_one_line(tmp_path):
    args = ["fit", "--config", str(ROOT / "configs" / "grpo_fsdp_tiny.yaml"), "--trainer.default_root_dir",
            str(tmp_path), "--trainer.strategy.init_args.cpu_offload", "true"]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "lit_rl", *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "error: trainer.strategy.init_args.cpu_offload: the model already lives in host memory on a CPU run; "
        "remove cpu_offload or set trainer.accelerator: gpu"
    )
    assert "Traceback" not in run.stderr and run.stderr.count("error:") == 1, "said once, before any process starts"
    assert not list(tmp_path.iterdir()), "nothing written"


def test_the_estimate_of_one_sharded_process_is_what_each_process_holds(tmp_path):
    """Each process's tensor peak per phase, measured by the MemoryProfiler in a 2-process run, against
    ``estimate_step(shard_processes=2)`` at the shapes the run's steps had (within 10%); its weights and optimizer
    state are half of one process's."""
    import json

    from lit_rl.cli import parse_fit_config
    from lit_rl.memory import estimate_step

    config = str(ROOT / "configs" / "grpo_fsdp_tiny.yaml")
    args = ["fit", "--config", config, "--config", str(ROOT / "callbacks" / "memory_profiler.yaml"),
            "--trainer.default_root_dir", str(tmp_path), "--trainer.limit_val_batches", "0"]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "lit_rl", *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summaries = [json.loads(f.read_text()) for f in sorted(tmp_path.rglob("memory_summary*.json"))]
    assert len(summaries) == 2, "one summary per process"
    shapes = {
        (s["settings"]["prompt_length"], s["settings"]["new_tokens"]) for s in summaries[0]["roofline"]["per_step"]
    }
    assert len(shapes) == 1, f"the steady steps had different shapes {shapes}: no single prediction to compare"
    ((prompt_length, new_tokens),) = shapes
    module, _, _ = parse_fit_config(["--config", config])
    settings = dict(batch_size=2, prompt_length=prompt_length, max_new_tokens=new_tokens)
    sharded = estimate_step(module, shard_processes=2, **settings)
    whole = estimate_step(module, **settings)
    for summary in summaries:
        steady = summary["steps"][-1]["phases"]  # steady state: the optimizer state exists
        for phase, predicted in sharded.phases.items():
            measured = steady[phase]["peak_bytes"]
            assert abs(predicted - measured) <= 0.1 * measured, f"{phase}: predicted {predicted}, measured {measured}"
        held = steady["optimizer"]["breakdown"]
        for category in ("parameters", "optimizer_state"):
            one_process = whole.breakdown["optimizer"][category]
            assert abs(held[category] - one_process / 2) <= 0.05 * one_process, (category, held, one_process)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread states from Linux's /proc")
def test_leaving_waits_until_the_gloo_workers_sleep():
    """A thread named as gloo's workers are, busy and then asleep: the wait sees the first and returns on the second
    (the end of a run waits for gloo's workers to drop their last tensors before the interpreter finalizes)."""
    from lit_rl.strategies import GLOO_WORKERS, _workers_idle

    busy, done = threading.Event(), threading.Event()

    def worker() -> None:
        ctypes.CDLL(None).prctl(15, GLOO_WORKERS[0].encode(), 0, 0, 0)  # PR_SET_NAME: this thread's OS name
        busy.set()
        while not done.is_set():  # running
            pass
        threading.Event().wait(30)  # asleep, as a worker waiting for work

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    busy.wait(10)
    assert _workers_idle(GLOO_WORKERS, timeout=0.3) is False
    done.set()
    assert _workers_idle(GLOO_WORKERS, timeout=10) is True


def test_leaving_destroys_the_group_that_something_still_holds():
    """Under FSDP2 DTensor's caches hold the device mesh and its group past ``destroy_process_group``; leaving still
    ends the group and returns once its workers are idle, and is a no-op without a group."""
    from lit_rl.strategies import leave_process_group

    assert leave_process_group() is True  # no group
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    held = torch.distributed.group.WORLD  # a reference kept past the destruction, as FSDP2's caches keep one
    for _ in range(10):
        torch.distributed.all_reduce(torch.ones(100))  # temporaries, as the end of a fit's collectives are
    assert leave_process_group(timeout=30) is True
    assert not torch.distributed.is_initialized()
    del held
