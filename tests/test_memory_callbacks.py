"""Memory callbacks on a tiny manual-optimization module that announces the five phases of a step."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, TensorDataset

from lit_rl.callbacks import ActivationCheckpointing, EmptyCache, MemoryProfiler, OOMReport
from lit_rl.memory.host_allocator import glibc
from lit_rl.memory.phases import PhaseTracker
from lit_rl.memory.tracker import TensorMemoryTracker
from lit_rl.models.tiny import tiny_model

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "reference", "policy_forward", "backward", "optimizer")  # TinyMethod's phases


class CaptureLogger(Logger):
    """Keeps every log_metrics call."""

    def __init__(self, save_dir=None):
        super().__init__()
        self.logged: list[tuple[int, dict]] = []
        self._save_dir = save_dir

    @property
    def name(self):
        return "capture"

    @property
    def version(self):
        return 0

    @property
    def save_dir(self):
        return self._save_dir

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def keys(self) -> set[str]:
        return {k for _, m in self.logged for k in m}

    def values(self, key: str) -> list[float]:
        return [m[key] for _, m in self.logged if key in m]


class TinyMethod(LightningModule):
    """Rollout (no grad), reference (no grad), policy forward, backward, optimizer: one phase each."""

    def __init__(self, num_layers=2, fail_in=None, error=None, predicted=None, in_configure_model=False):
        super().__init__()
        self.automatic_optimization = False
        self.phases = PhaseTracker(PHASES)
        self.num_layers = num_layers
        self.fail_in = fail_in
        self.error = error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.policy = None if in_configure_model else tiny_model(num_layers=num_layers)
        if predicted is not None:
            self.predicted_memory = predicted

    def configure_model(self):
        if self.policy is None:
            self.policy = tiny_model(num_layers=self.num_layers)

    def _maybe_fail(self, name):
        if name == self.fail_in:
            raise self.error

    def training_step(self, batch, batch_idx):
        (prompts,) = batch  # [B, P]
        opt = self.optimizers()
        with self.phases("rollout"):
            self.policy.eval()
            with torch.no_grad():
                seqs = torch.cat([prompts, self.policy(prompts).logits[:, -4:].argmax(-1)], dim=1)  # [B, P+4]
            self._maybe_fail("rollout")
        with self.phases("reference"), torch.no_grad():
            ref = self.policy(seqs).logits.log_softmax(-1).gather(-1, seqs[..., None]).squeeze(-1)  # [B, T]
            self._maybe_fail("reference")
        self.policy.train()
        with self.phases("policy_forward"):
            logp = self.policy(seqs).logits.float().log_softmax(-1).gather(-1, seqs[..., None]).squeeze(-1)
            loss = (logp.exp() * (ref - logp)).mean()
            self._maybe_fail("policy_forward")
        with self.phases("backward"):
            self.manual_backward(loss)
            self._maybe_fail("backward")
        with self.phases("optimizer"):
            opt.step()
            opt.zero_grad()
            self._maybe_fail("optimizer")
        self.log("loss", loss.detach())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.policy.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randint(3, 128, (8, 12))), batch_size=2)


def _trainer(tmp_path, callbacks, logger=None, max_steps=2):
    return Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        limit_train_batches=max_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        logger=logger if logger is not None else CaptureLogger(tmp_path),
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )


# --------------------------------------------------------------------------------------------- profiler


def test_profiler_logs_documented_keys_and_writes_files(tmp_path):
    tb = TensorBoardLogger(tmp_path, name="tb")
    capture = CaptureLogger()
    predicted = {p: (i + 1) * 2**20 for i, p in enumerate(PHASES)}
    model = TinyMethod(predicted=predicted)
    trainer = _trainer(tmp_path, [MemoryProfiler(every_n_steps=1)], logger=[tb, capture])
    trainer.fit(model)

    keys = capture.keys()
    for phase in PHASES:
        for metric in ("peak_gib", "rss_peak_gib", "predicted_gib"):
            values = capture.values(f"memory/{phase}/{metric}")
            assert len(values) == 2 and all(v > 0 for v in values), (phase, metric)
        assert f"memory/{phase}/reserved_gib" not in keys  # CUDA only; never a fake 0 on CPU
    assert all(v > 0 for v in capture.values("memory/step/peak_gib"))
    assert capture.values("memory/step/predicted_gib") == [5 * 2**20 / GIB] * 2
    for category in ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other"):
        assert f"memory/breakdown/{category}_gib" in keys
    # every memory tag of a step is logged at the same step as the step's own metrics
    memory_steps = [s for s, m in capture.logged if "memory/step/peak_gib" in m]
    assert memory_steps == [s for s, m in capture.logged if "loss" in m] == [0, 1]

    # the parameters are counted exactly, and the step peak holds at least weights + grads + Adam state
    params = sum(p.numel() * 4 for p in model.policy.parameters())
    assert capture.values("memory/breakdown/parameters_gib")[-1] * GIB == pytest.approx(params)
    assert capture.values("memory/optimizer/peak_gib")[-1] * GIB >= 4 * params

    log_dir = Path(tb.log_dir)
    summary = json.loads((log_dir / "memory_summary.json").read_text())
    assert summary["method"] == "TinyMethod" and summary["device"] == "cpu" and summary["status"] == "finished"
    assert set(summary["phases"]) == set(PHASES)
    assert summary["phases"]["backward"]["peak_gib"]["max"] > 0
    assert summary["phases"]["rollout"]["predicted_gib"] == 2**20 / GIB
    assert len(summary["steps"]) == 2
    assert (log_dir / "memory_phases.png").stat().st_size > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "images": 0, "scalars": 0}).Reload()
    tags = events.Tags()
    assert "custom_scalars__config__" in tags["tensors"]
    assert "memory/phases" in tags["images"]
    from tensorboard.plugins.custom_scalar import layout_pb2

    layout = layout_pb2.Layout.FromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    titles = {chart.title for cat in layout.category for chart in cat.chart}
    assert set(PHASES) | {"step"} <= titles


def test_profiler_every_n_steps_and_state_dict(tmp_path):
    profiler = MemoryProfiler(every_n_steps=2)
    capture = CaptureLogger(tmp_path)
    _trainer(tmp_path, [profiler], logger=capture, max_steps=3).fit(TinyMethod())
    summary = profiler.summary()
    assert [r["step"] for r in summary["steps"]] == [0, 2]  # measured at global steps 0 and 2 (steps done before)
    assert summary["steady_state_steps"] == [2]  # step 0 runs without AdamW state: not the steady state
    assert len(capture.values("memory/step/peak_gib")) == 2

    resumed = MemoryProfiler(every_n_steps=2)
    resumed.load_state_dict(profiler.state_dict())
    assert resumed.summary()["steps"] == profiler.summary()["steps"]


def test_profiler_rss_only_without_tracking(tmp_path):
    capture = CaptureLogger(tmp_path)
    _trainer(tmp_path, [MemoryProfiler(track_tensors=False)], logger=capture).fit(TinyMethod())
    keys = capture.keys()
    assert "memory/rollout/rss_peak_gib" in keys
    assert not any(k.endswith("/peak_gib") and "rss" not in k for k in keys)
    assert not any(k.startswith("memory/breakdown/") for k in keys)


def test_profiler_falls_back_to_getrusage_and_says_so(tmp_path, monkeypatch):
    import lit_rl.memory.rss as rss

    monkeypatch.setattr(rss, "reset_peak_rss", lambda: False)
    capture = CaptureLogger(tmp_path)
    with pytest.warns(UserWarning, match="getrusage"):
        _trainer(tmp_path, [MemoryProfiler()], logger=capture).fit(TinyMethod())
    assert all(v > 0 for v in capture.values("memory/step/rss_peak_gib"))


def test_profiler_requires_phases_and_valid_args(tmp_path):
    class NoPhases(TinyMethod):
        def __init__(self):
            super().__init__()
            del self.phases

    with pytest.raises(MisconfigurationException, match="PhaseTracker"):
        _trainer(tmp_path, [MemoryProfiler()]).fit(NoPhases())
    with pytest.raises(MisconfigurationException, match="every_n_steps"):
        MemoryProfiler(every_n_steps=0)
    with pytest.raises(MisconfigurationException, match="cuda_snapshot_steps"):
        MemoryProfiler(cuda_snapshot_steps=-1)


def test_profiler_writes_summary_on_exception(tmp_path):
    model = TinyMethod(fail_in="backward")
    with pytest.raises(torch.OutOfMemoryError):
        _trainer(tmp_path, [MemoryProfiler()]).fit(model)
    summary = json.loads((tmp_path / "memory_summary.json").read_text())
    assert summary["status"].startswith("failed: OutOfMemoryError")
    (step,) = summary["steps"]
    assert step["incomplete"] and set(step["phases"]) == {"rollout", "reference", "policy_forward", "backward"}


class FakeAllocator:
    """Stands in for the CUDA allocator counters on a machine without CUDA."""

    def __init__(self, monkeypatch):
        self.allocated = self.reserved = self.max_allocated = self.max_reserved = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: self.reset())
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.max_allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.max_reserved)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.set(self.allocated, self.allocated))

    def reset(self):
        self.max_allocated, self.max_reserved = self.allocated, self.reserved

    def set(self, allocated, reserved):
        self.allocated, self.reserved = allocated, reserved
        self.max_allocated, self.max_reserved = max(self.max_allocated, allocated), max(self.max_reserved, reserved)


def _fake_cuda_run(monkeypatch, callback):
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda", 0)),
        loggers=[CaptureLogger()],
        global_step=0,
        log_dir=None,
        default_root_dir=None,
        optimizers=[],
    )
    module = SimpleNamespace(phases=PhaseTracker(PHASES), predicted_memory={"policy_forward": 4 * GIB})
    alloc = FakeAllocator(monkeypatch)
    callback.setup(trainer, module, "fit")
    return trainer, module, alloc


def test_profiler_reads_the_cuda_allocator_per_phase(monkeypatch):
    profiler = MemoryProfiler()
    trainer, module, alloc = _fake_cuda_run(monkeypatch, profiler)
    profiler.on_train_batch_start(trainer, module, None, 0)
    with module.phases("rollout"):
        alloc.set(1 * GIB, 2 * GIB)
        alloc.set(0, 2 * GIB)
    with module.phases("policy_forward"):
        alloc.set(2 * GIB, 3 * GIB)
        with module.phases("backward"):  # nested: the outer phase keeps what it reached before and during
            alloc.set(5 * GIB, 6 * GIB)
            alloc.set(1 * GIB, 6 * GIB)
    trainer.global_step = 1
    profiler.on_train_batch_end(trainer, module, None, None, 0)
    ((step, metrics),) = trainer.loggers[0].logged
    assert step == 1  # no fit loop in this stand-in: the global step
    assert metrics["memory/rollout/peak_gib"] == 1 and metrics["memory/rollout/reserved_gib"] == 2
    assert metrics["memory/backward/peak_gib"] == 5 and metrics["memory/policy_forward/peak_gib"] == 5
    assert metrics["memory/step/peak_gib"] == 5 and metrics["memory/policy_forward/predicted_gib"] == 4
    assert not any(k.startswith("memory/breakdown/") for k in metrics)


def test_empty_cache_logs_what_it_freed_on_cuda(monkeypatch):
    empty = EmptyCache(phases=["rollout"], when="end")
    trainer, module, alloc = _fake_cuda_run(monkeypatch, empty)
    with module.phases("rollout"):
        alloc.set(3 * GIB, 8 * GIB)
    with module.phases("reference"):  # not in `phases`: untouched
        alloc.set(3 * GIB, 9 * GIB)
    assert alloc.reserved == 9 * GIB
    trainer.global_step = 4
    empty.on_train_batch_end(trainer, module, None, None, 0)
    assert trainer.loggers[0].logged == [(4, {"memory/empty_cache/freed_gib": 5.0})]


# ------------------------------------------------------------------------------------------ empty cache


def test_empty_cache_trims_on_cpu_and_logs_it_each_step(tmp_path):
    if glibc() is None:
        pytest.skip("malloc_trim is glibc's (tests/test_empty_cache.py covers the no-op elsewhere)")
    capture = CaptureLogger(tmp_path)
    _trainer(tmp_path, [EmptyCache()], logger=capture).fit(TinyMethod())
    freed = capture.values("memory/empty_cache/freed_gib")
    assert len(freed) == 2  # one per step: RSS released after rollout and reference


def test_empty_cache_rejects_unknown_phases(tmp_path):
    with pytest.raises(MisconfigurationException, match="rollout.*reference.*policy_forward.*backward.*optimizer"):
        _trainer(tmp_path, [EmptyCache(phases=["rollout", "generate"])]).fit(TinyMethod())


# ------------------------------------------------------------------------------ activation checkpointing


def _forward_backward_peak(model: torch.nn.Module, ids: torch.Tensor) -> int:
    model.train()
    t = TensorMemoryTracker().track(model)
    with t:
        t.reset_peak()
        model(ids, use_cache=False).logits.float().logsumexp(-1).mean().backward()
    t.close()
    return t.peak_bytes - t.by_category()["parameters"] - t.by_category()["gradients"]


def _checkpointed(model, **kwargs):
    module = LightningModule()
    module.policy = model
    ActivationCheckpointing(**kwargs).setup(Trainer(accelerator="cpu", logger=False), module, "fit")
    return model


def test_activation_checkpointing_lowers_activation_peak_with_equal_gradients():
    ids = torch.randint(3, 128, (4, 64))
    plain = tiny_model(num_layers=4, hidden_size=64)
    ckpt = _checkpointed(tiny_model(num_layers=4, hidden_size=64))
    assert sum(getattr(m, "gradient_checkpointing", False) for m in ckpt.model.layers) == 4

    plain_peak = _forward_backward_peak(plain, ids)
    ckpt_peak = _forward_backward_peak(ckpt, ids)
    assert ckpt_peak < 0.8 * plain_peak, (ckpt_peak, plain_peak)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_activation_checkpointing_every_n_layers_and_lora():
    model = _checkpointed(tiny_model(num_layers=4), every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True, False]

    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    plain = peft.get_peft_model(tiny_model(num_layers=2), config)
    ckpt = _checkpointed(peft.get_peft_model(tiny_model(num_layers=2), config))
    ids = torch.randint(3, 128, (2, 16))
    for m in (plain, ckpt):
        m.train()
        m(ids, use_cache=False).logits.float().logsumexp(-1).mean().backward()
    lora = [(n, p) for n, p in plain.named_parameters() if p.requires_grad]
    ckpt_lora = [p for p in ckpt.parameters() if p.requires_grad]
    for (name, p), q in zip(lora, ckpt_lora, strict=True):
        assert q.grad is not None and q.grad.abs().sum() > 0, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_activation_checkpointing_after_configure_model(tmp_path):
    model = TinyMethod(in_configure_model=True)
    _trainer(tmp_path, [ActivationCheckpointing()], max_steps=1).fit(model)
    assert all(layer.gradient_checkpointing for layer in model.policy.model.layers)


def test_activation_checkpointing_unsupported_model_fails_at_setup(tmp_path):
    class LinearPolicy(TinyMethod):
        def __init__(self):
            super().__init__()
            self.policy = torch.nn.Linear(4, 4)

    with pytest.raises(MisconfigurationException, match="does not support activation checkpointing"):
        _trainer(tmp_path, [ActivationCheckpointing()]).fit(LinearPolicy())
    with pytest.raises(MisconfigurationException, match="every_n_layers"):
        ActivationCheckpointing(every_n_layers=0)


# ------------------------------------------------------------------------------------------- OOM report


def test_oom_report_names_phase_breakdown_and_tactics(tmp_path):
    class WithEstimator(TinyMethod):
        def estimate_savings(self):
            return {"activation_checkpointing": 3 * GIB, "bf16": GIB}

    with pytest.raises(torch.OutOfMemoryError), pytest.warns(UserWarning, match="Out of memory in phase"):
        _trainer(tmp_path, [MemoryProfiler(), OOMReport()]).fit(WithEstimator(fail_in="policy_forward"))
    report = json.loads((tmp_path / "oom_report.json").read_text())
    assert report["phase"] == "policy_forward"
    assert report["error"].startswith("OutOfMemoryError")
    assert report["measured"]["phases"]["policy_forward"]["peak_gib"]["max"] > 0
    tactics = {t["tactic"]: t for t in report["tactics"]}
    assert set(tactics) == {"activation_checkpointing", "micro_batch", "bf16", "adamw8bit", "lora", "empty_cache"}
    assert report["tactics"][0]["tactic"] == "activation_checkpointing"  # largest predicted saving first
    assert tactics["activation_checkpointing"]["predicted_saving_gib"] == 3.0
    assert tactics["lora"]["predicted_saving_gib"] is None


def test_oom_report_without_estimator_or_profiler_and_ignores_other_errors(tmp_path):
    oom = torch.OutOfMemoryError("out of memory")
    with pytest.raises(torch.OutOfMemoryError):
        _trainer(tmp_path, [ActivationCheckpointing(), OOMReport()]).fit(TinyMethod(fail_in="backward", error=oom))
    report = json.loads((tmp_path / "oom_report.json").read_text())
    assert report["phase"] == "backward" and "measured" not in report
    assert all(t["predicted_saving_gib"] is None for t in report["tactics"])
    assert {t["tactic"]: t["active"] for t in report["tactics"]}["activation_checkpointing"]

    other = tmp_path / "other"
    with pytest.raises(ValueError):
        _trainer(other, [OOMReport()]).fit(TinyMethod(fail_in="rollout", error=ValueError("bad")))
    assert not (other / "oom_report.json").exists()


# ------------------------------------------------------------------------------------------ YAML fragments


def test_fragments_compose(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    fragments = sorted((ROOT / "callbacks").glob("*.yaml"))
    assert {f.stem for f in fragments} >= {"memory_profiler", "empty_cache", "activation_checkpointing", "oom_report"}
    args = [f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"]
    for f in fragments:
        args += ["--config", str(f)]
    cli = LightningCLI(TinyMethod, run=False, args=args, save_config_kwargs={"overwrite": True})
    found = {type(c).__name__ for c in cli.trainer.callbacks}
    assert {"MemoryProfiler", "EmptyCache", "ActivationCheckpointing", "OOMReport"} <= found
    for f in fragments:
        text = f.read_text()
        assert text.startswith("#") and f"lit-rl fit --config configs/grpo.yaml --config callbacks/{f.name}" in text


def test_profiler_on_grpo_logs_prediction_and_counts_the_frozen_reference(capture_logger, tmp_path):
    from lit_rl.data import PromptDataModule
    from lit_rl.losses import LossSettings
    from lit_rl.methods import RefCachedGRPO

    method = RefCachedGRPO(name_or_path="tiny:llama", num_generations=2, max_new_tokens=4, loss=LossSettings(beta=0.1))
    trainer = Trainer(
        max_steps=1, logger=capture_logger, callbacks=[MemoryProfiler()], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(method, PromptDataModule(num_prompts=4, batch_size=1, max_prompt_length=64))
    assert (tmp_path / "memory_summary.json").exists()
    logged = capture_logger.metrics
    weights = sum(p.numel() * p.element_size() for p in method.policy.parameters())
    measured = logged["memory/rollout/peak_gib"][0][1] * 2**30
    assert measured >= 2 * weights, "policy + frozen reference copy are both resident"
    for phase in method.phase_names:  # predicted at the step's own prompt and completion lengths
        predicted = logged[f"memory/{phase}/predicted_gib"][0][1]
        measured = logged[f"memory/{phase}/peak_gib"][0][1]
        assert predicted == pytest.approx(measured, rel=0.1), phase


def test_predictions_of_new_shapes_stay_within_their_share_of_the_run(monkeypatch):
    """A 0.5-1.5B model takes 17-55 s per estimate (bench/results/gpu.log): new step shapes are predicted only while
    the estimates' seconds stay within the budget's share of the wall time; the first shape always is."""
    import time

    from lit_rl.memory import step_prediction
    from lit_rl.memory.step_prediction import StepPredictor, StepShape

    def slow_estimate(trainer, module, **overrides):
        time.sleep(0.05)
        return SimpleNamespace(phases={"rollout": overrides["prompt_length"]}, first_step={"rollout": 1})

    monkeypatch.setattr(step_prediction, "estimate_for_trainer", slow_estimate)
    monkeypatch.setattr(step_prediction, "rollout_shape", lambda module: SimpleNamespace(length_option=None))
    predictor = StepPredictor(None, None, budget=0.1)
    shape = lambda p: StepShape(batch_size=1, prompt_length=p, padded=False, new_tokens=None)  # noqa: E731
    assert predictor.predict(shape(5)) == {"rollout": 5}  # the first shape, whatever it costs
    assert predictor.predict(shape(6)) == {} and predictor.skipped == 1  # 0.05 s of estimates in about 0.05 s of run
    assert predictor.predict(shape(5)) == {"rollout": 5}  # a cached shape costs nothing
    time.sleep(0.5)  # the run goes on: 0.05 s is now within a tenth of it
    assert predictor.predict(shape(6)) == {"rollout": 6} and predictor.skipped == 1
    with pytest.raises(MisconfigurationException, match="predict_budget=-1"):
        MemoryProfiler(predict_budget=-1)
