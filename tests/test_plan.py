"""The memory planner: the fastest fitting setting of the tactics, the plan file that applies it, and one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from lit_rl import planner
from lit_rl.cli import estimate_from_args, main
from lit_rl.memory import fit
from lit_rl.memory.estimate import copy_method
from lit_rl.memory.units import format_bytes
from lit_rl.methods import RefCachedGRPO
from lit_rl.models import LoraSettings
from lit_rl.plan_file import plan_fragment
from lit_rl.planner import (
    _candidate,
    _floor_before,
    _leanest,
    _micro_batch,
    describe,
    plan,
    plan_table,
    unreachable_line,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/grpo_tiny.yaml")
# fixed machine rates: the plan does not depend on this machine's load
RATES = {
    "device": "cpu",
    "dtypes": {
        "float32": {"matmul_flops_per_s": 1e11, "skinny_matmul_flops_per_s": 2e10},
        "bfloat16": {"matmul_flops_per_s": 2e11, "skinny_matmul_flops_per_s": 4e10},
    },
    "bandwidth_bytes_per_s": 2e10,
}
SHAPE = dict(batch_size=2, prompt_length=24)


@pytest.fixture(scope="module")
def method():
    return RefCachedGRPO(name_or_path="tiny:llama", num_generations=4, max_new_tokens=16)


@pytest.fixture(scope="module")
def tight(method):
    """A budget between the smallest peak the kept-arithmetic tactics reach and the config's own, and its plan."""
    _, found, base = plan(method, 10**12, rates=RATES, **SHAPE)  # every candidate fits: only the config is tried
    assert [c.overrides for c in found] == [{"activation_checkpointing": 0}]
    budget = int(0.7 * base.peak)
    return budget, plan(method, budget, rates=RATES, **SHAPE)


def test_a_config_that_fits_is_kept_as_it_is(method):
    best, found, base = plan(method, 10**12, rates=RATES, **SHAPE)
    assert best is base and plan_fragment(best) == {} and describe(best) == "the config as it is"


def test_the_plan_is_the_fastest_candidate_that_fits(tight):
    budget, (best, found, base) = tight
    assert base.peak > budget and best is not None and best.peak <= budget
    fitting = [c for c in found if c.peak <= budget]
    assert all(best.seconds <= c.seconds for c in fitting)
    assert any(c.peak > budget for c in found)  # the search saw candidates that do not fit
    assert not best.allowed and all(not c.allowed for c in found)  # nothing changes the arithmetic unless allowed
    assert "micro_batch_tokens" in best.overrides or best.every_n_layers  # a smaller micro-batch or checkpointing


def test_a_plan_is_timed_at_the_rates_of_its_own_device_or_not_at_all(method, tight, monkeypatch):
    """A CPU's rates would rank a GPU step's candidates wrongly (compute against bandwidth differs several-fold):
    they are refused; with no rates for the device on this machine every candidate is untimed and the fewest passes
    win, as for a step the roofline does not model."""
    budget, _ = tight
    with pytest.raises(ValueError, match=r"^--rates: measured on cpu \(unknown\), but the step runs on cuda; measure "
                       r"the rates there: lit-rl rates --device cuda --out FILE$"):  # fmt: skip
        plan(method, budget, rates=RATES, device_type="cuda", **SHAPE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    best, found, base = plan(method, budget, device_type="cuda", **SHAPE)
    assert best is not None and best.peak <= budget and len(found) > 1
    assert all(c.seconds is None for c in found)
    assert best.passes == min(c.passes for c in found if c.peak <= budget)
    rows = plan_table(best, found, base, budget).splitlines()[2:-1]
    assert len(rows) == len(found) and all(" n/m " in row for row in rows)


def test_rates_of_another_device_are_refused_in_one_line(tmp_path, capsys):
    rates, plan_file = tmp_path / "rates.json", tmp_path / "plan.yaml"
    rates.write_text(json.dumps({**RATES, "machine": "AMD EPYC, 2 cores"}))
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--config", TINY, "--device", "cuda", "--device-memory", "1GiB", "--plan", str(plan_file),
              "--rates", str(rates)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1] == (
        "error: --rates: measured on cpu (AMD EPYC, 2 cores), but the step runs on cuda; measure the rates there: "
        "lit-rl rates --device cuda --out FILE"
    )
    assert not plan_file.exists()


def test_the_floor_the_search_prunes_by_is_the_estimated_candidates(method):
    """The search skips a candidate whose floor, computed from the config's estimate before its own, is above a
    fitting one's: that floor must be what the candidate's own estimate gives (micro-batch and precision included)."""
    base = _candidate(method, RATES, SHAPE, {}, ())
    rows, row = base.estimate.settings["micro_batch_size"], base.estimate.settings["sequence_length"]
    eight_bit = {"optimizer": {"class_path": "bitsandbytes.optim.AdamW8bit", "init_args": {}}}
    cases = [{}, _micro_batch(method, rows // 2, row), _micro_batch(method, 1, row), {"precision": "bf16-true"},
             {**eight_bit, **_micro_batch(method, 2, row)}]  # fmt: skip
    floors = []
    for overrides in cases:
        estimated = _candidate(method, RATES, SHAPE, overrides, ("any",) if overrides else ())
        floors.append(_floor_before(method, base, RATES, overrides))
        assert floors[-1] == pytest.approx(estimated.seconds, rel=1e-9), overrides
    assert floors[0] <= floors[1] < floors[2] and floors[3] < floors[0]  # fewer rows per pass never save time


@pytest.mark.slow  # a second search with the 8-bit optimizer
def test_changed_arithmetic_only_when_allowed(method, tight):
    budget, _ = tight
    _, found, _ = plan(method, budget, allow=("adamw8bit",), rates=RATES, **SHAPE)
    assert {c.allowed for c in found} == {(), ("adamw8bit",)}
    eight = next(c for c in found if c.allowed)
    assert plan_fragment(eight)["optimizer"] == {"class_path": "bitsandbytes.optim.AdamW8bit"}
    assert describe(eight).startswith("adamw8bit*")


def test_a_budget_only_the_leanest_setting_meets_plans_it_without_estimating_it_twice(method, monkeypatch):
    base = _candidate(method, RATES, SHAPE, {}, ())
    rows, row = base.estimate.settings["micro_batch_size"], base.estimate.settings["sequence_length"]
    lean = _leanest(method, RATES, SHAPE, {}, (), rows, row, {})  # one row per micro-batch, every layer checkpointed
    estimated = []
    for module in (planner, fit):  # the planner's own estimates and least_checkpointing's
        real = module.estimate_step

        def spy(m, _real=real, **kw):
            estimated.append(repr(sorted(kw.items())))
            return _real(m, **kw)

        monkeypatch.setattr(module, "estimate_step", spy)
    best, found, _ = plan(method, lean.peak, rates=RATES, **SHAPE)
    assert (best.rows, best.every_n_layers) == (1, 1) and best.peak == lean.peak
    assert rows > 1 and len(estimated) == len(set(estimated))  # the leanest setting was estimated once
    assert sum((c.rows, c.every_n_layers) == (1, 1) for c in found) == 1


def test_an_unreachable_budget_names_the_smallest_peak(method):
    best, found, _ = plan(method, 1024, rates=RATES, **SHAPE)
    assert best is None
    # the config, then its leanest setting (one row per micro-batch, every layer checkpointed), which does not fit
    # either: nothing between them is estimated (nor a rollout of fewer rows: its KV cache is far below the gap)
    assert len(found) == 2 and (found[1].rows, found[1].every_n_layers) == (1, 1)
    assert all(c.rollout_rows is None for c in found)
    line = unreachable_line(found, 1024, ())
    low = min(c.peak for c in found)
    assert found[1].peak == low < found[0].peak and format_bytes(low) in line
    assert "no plan fits; the smallest predicted peak is" in line
    assert "--allow adamw8bit,bf16,nf4,reference_bf16" in line and "\n" not in line


def test_bf16_is_not_searched_for_a_config_in_bf16_already(method):
    # nor a bf16 reference copy: under bf16 weights the copy is bf16 already (reference_dtype "same")
    best, found, _ = plan(method, 1024, allow=("bf16", "reference_bf16"), rates=RATES, precision="bf16-true", **SHAPE)
    assert best is None and len(found) == 2 and all(not c.allowed for c in found)  # the config and its leanest
    _, found, _ = plan(method, 1024, allow=("bf16", "reference_bf16"), rates=RATES, **SHAPE)
    assert {c.allowed for c in found} == {(), ("bf16",), ("reference_bf16",)}  # never both


def test_bf16_under_an_optimizer_that_rounds_to_nearest_is_searched_only_beside_the_8_bit_step(method, tight):
    # torch's AdamW writes bf16 weights rounded to nearest (most updates at lr 1e-5 lost, LoRA's initialised A
    # matrices' too); the default StochasticAdamW and the sliced 8-bit step round stochastically
    budget, _ = tight
    torch_adamw = copy_method(method, {"optimizer": {"class_path": "torch.optim.AdamW", "init_args": {}}})
    _, found, _ = plan(torch_adamw, budget, allow=("adamw8bit", "bf16"), rates=RATES, **SHAPE)
    assert {c.allowed for c in found} >= {("adamw8bit",), ("adamw8bit", "bf16")}
    assert ("bf16",) not in {c.allowed for c in found}
    _, found, _ = plan(torch_adamw, budget, allow=("bf16",), rates=RATES, **SHAPE)
    assert {c.allowed for c in found} == {()}  # bf16 alone is never searched without adamw8bit
    for own in (method, copy_method(method, {"optimizer": {"class_path": "bitsandbytes.optim.AdamW8bit"}})):
        _, found, _ = plan(own, budget, allow=("bf16",), rates=RATES, **SHAPE)
        assert ("bf16",) in {c.allowed for c in found}  # the default optimizer, or the 8-bit step already
    lora = RefCachedGRPO(
        name_or_path="tiny:llama",
        num_generations=4,
        max_new_tokens=16,
        lora=LoraSettings(r=4, alpha=8),
        optimizer={"class_path": "torch.optim.AdamW", "init_args": {}},
    )
    _, found, _ = plan(lora, 1024, allow=("adamw8bit", "bf16"), rates=RATES, **SHAPE)
    assert ("adamw8bit", "bf16") in {c.allowed for c in found} and ("bf16",) not in {c.allowed for c in found}


def test_a_4_bit_base_is_timed_with_its_decoding_and_searched_last():
    # the roofline times the 4-bit base's decoding (codes read, the dense weight written and read in every pass), so
    # a 4-bit candidate is slower than the same setting dense; searched last, it is pruned by the floor of a dense
    # candidate that fits, without an estimate
    lora = RefCachedGRPO(name_or_path="tiny:llama", num_generations=4, max_new_tokens=16, lora=LoraSettings(r=4))
    dense = ({"precision": "bf16-true"}, ("bf16",))  # a candidate's overrides and allowed tactics
    nf4 = ({"precision": "bf16-true", "quantize_base": "nf4"}, ("bf16", "nf4"))
    bf16, both = _candidate(lora, RATES, SHAPE, *dense), _candidate(lora, RATES, SHAPE, *nf4)
    assert both.peak < bf16.peak and both.seconds >= bf16.seconds  # at RATES the tiny step is compute-bound
    slow = {**RATES, "bandwidth_bytes_per_s": 1e8}  # memory-bound: the decoding's bytes show
    assert _candidate(lora, slow, SHAPE, *nf4).seconds > _candidate(lora, slow, SHAPE, *dense).seconds
    best, found, base = plan(lora, bf16.peak, allow=("bf16", "nf4"), rates=slow, **SHAPE)
    assert base.peak > bf16.peak and best.seconds is not None and "bf16" in best.allowed
    assert not any("nf4" in c.allowed for c in found)
    best, found, _ = plan(lora, 1024, allow=("bf16", "nf4"), rates=RATES, **SHAPE)  # nothing fits: all searched
    assert best is None and {("nf4",), ("bf16", "nf4")} <= {c.allowed for c in found}
    assert all(c.seconds is not None for c in found) and " n/m " not in plan_table(best, found, base, 1024)
    assert min(found, key=lambda c: c.peak).allowed == ("bf16", "nf4")  # the smallest peak the refusal names


def _estimate_peak(args: list[str]) -> int:
    estimate, _, _ = estimate_from_args(args)
    return estimate.peak_bytes


@pytest.mark.slow  # a plan and two estimates through the CLI
def test_the_written_plan_applies_and_meets_its_budget(tmp_path, capsys):
    base = _estimate_peak(["--config", TINY])
    budget = int(0.6 * base)
    plan_file = tmp_path / "plan.yaml"
    main(["estimate", "--config", TINY, "--device-memory", str(budget), "--plan", str(plan_file)])
    out = capsys.readouterr().out
    assert "<- plan" in out and f"wrote {plan_file}" in out
    text = plan_file.read_text()
    assert text.startswith(f"# lit-rl plan for {TINY}@")
    fragment = yaml.safe_load(text)
    assert fragment and set(fragment) <= {"model", "trainer", "optimizer"}
    assert _estimate_peak(["--config", TINY, "--config", str(plan_file)]) <= budget < base


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["--device-memory", "1KiB"],
            "--device-memory 1.00 KiB: no plan fits; the smallest predicted peak",
            marks=pytest.mark.slow,
        ),  # two estimates and the machine's rates measured: about 15 s
        ([], "--plan: needs --device-memory"),
        (["--device-memory", "1GiB", "--allow", "fp8"], "--allow: unknown tactic 'fp8'"),
    ],
)
def test_a_plan_that_cannot_be_made_is_one_line_and_writes_nothing(args, message, tmp_path, capsys):
    plan_file = tmp_path / "plan.yaml"
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--config", TINY, "--plan", str(plan_file), *args])
    err = capsys.readouterr().err.strip().splitlines()  # start-up and progress lines ("estimated ..."), the error last
    assert exit_.value.code == 2 and err[-1].startswith(f"error: {message}")
    assert not plan_file.exists()


def test_a_plan_file_made_for_another_config_is_refused(tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text(Path(TINY).read_text())
    plan_file = tmp_path / "plan.yaml"
    main(["estimate", "--config", str(config), "--device-memory", "1GiB", "--plan", str(plan_file)])
    capsys.readouterr()
    other = str(ROOT / "configs/intuitor_tiny.yaml")
    for configs in ([other], []):
        with pytest.raises(SystemExit) as exit_:
            main(["fit", *[a for c in configs for a in ("--config", c)], "--config", str(plan_file),
                  "--trainer.default_root_dir", str(tmp_path / "run")])  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and err.startswith(f"error: --config {plan_file}: a plan made for {config}")
    config.write_text(Path(TINY).read_text() + "\n# edited\n")  # the same file, changed since the plan
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), "--config", str(plan_file)])
    assert "as it was then" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # GumbelTopK's step on fake tensors, per candidate
def test_gumbel_topk_is_planned_by_its_own_floor_without_layer_checkpointing():
    """GumbelTopK's trunk runs on a KV cache that checkpointed layers drop: the plan never checkpoints layers, and
    its candidates are timed by the roofline's count of a differentiable rollout."""
    from lit_rl.methods import GumbelTopK

    method = GumbelTopK(name_or_path="tiny:llama", reward_model="tiny:llama", max_new_tokens=6, micro_batch_size=4)
    _, _, config = plan(method, 10**12, rates=RATES, batch_size=4, prompt_length=12)
    best, found, _ = plan(method, int(0.95 * config.peak), rates=RATES, batch_size=4, prompt_length=12)
    assert all(c.every_n_layers == 0 for c in found) and len(found) > 1
    assert all(c.seconds is not None and c.seconds > 0 for c in found)  # the floor, not the count of passes
    assert best is not None and (best.overrides.get("micro_batch_size", 4) < 4 or best.recomputation)
    # its own recomputation instead: recomputed steps keep less, cost one more forward, and the plan file says so
    steps = next(c for c in found if c.recomputation)
    assert steps.recomputation == {"checkpoint_steps": True} and steps.rows == 4
    assert steps.peak < config.peak and steps.seconds > config.seconds
    assert plan_fragment(steps)["model"]["init_args"] == {"checkpoint_steps": True}
    assert "checkpoint_steps True" in describe(steps)
