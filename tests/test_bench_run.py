"""bench/run.py, the side-by-side suite (lit-rl beside TRL): its parsing and ratio logic, and a --quick run end to end.

The quick run checks the structure of BENCHMARKS.md and that the plots exist; the numbers at quick sizes mean
nothing. The TRL part runs only where trl is installed (the `bench` extra; CI installs without it) and the embedded
model is present; otherwise the file must say why it was not run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench")]

import run as bench_run  # noqa: E402
import vs_trl  # noqa: E402


def _has_embedded() -> bool:
    from lit_rl.models import embedded_gguf_path

    try:
        embedded_gguf_path()
    except FileNotFoundError:
        return False
    return True


HAS_TRL = importlib.util.find_spec("trl") is not None and _has_embedded()


def test_median_drops_the_first_step():
    assert vs_trl.median_after_first([100.0, 2.0, 4.0, 3.0]) == 3.0
    assert vs_trl.median_after_first([100.0, 5.0]) == 5.0
    with pytest.raises(ValueError, match="at least 2"):
        vs_trl.median_after_first([1.0])


def test_ratios_and_verdicts():
    setup = vs_trl.SETUPS[0]
    c = vs_trl.Comparison(setup)
    # two rounds per side: medians of peak RSS and of per-run step times
    c.runs += [
        vs_trl.Run("lit-rl", setup.name, 0, [9.0, 2.0, 2.0], 1 * 2**30, 10.0),
        vs_trl.Run("TRL", setup.name, 0, [9.0, 4.0, 4.0], 4 * 2**30, 10.0),
        vs_trl.Run("lit-rl", setup.name, 1, [9.0, 4.0, 4.0], 3 * 2**30, 10.0),
        vs_trl.Run("TRL", setup.name, 1, [9.0, 6.0, 6.0], 4 * 2**30, 10.0),
    ]
    assert c.rss("lit-rl") == 2 * 2**30 and c.step_time("TRL") == 5.0
    assert c.ratios() == pytest.approx({"peak RSS": 0.5, "step time": 0.6})
    assert vs_trl.verdict(0.5, 0.5) == "met" and vs_trl.verdict(0.61, 0.6) == "not met"
    (row,) = [line for line in vs_trl.tables([c]) if line.startswith(f"| {setup.name} | 2.00")]
    assert "| 0.50 | met |" in row and "| 0.60 | met |" in row


def test_schedule_alternates_the_sides():
    order = vs_trl.schedule(vs_trl.SETUPS[:2], rounds=2)
    assert [side for _, _, side in order] == ["lit-rl", "TRL"] * 4
    assert [(s.name, r) for s, r, _ in order[:4]] == [(vs_trl.SETUPS[0].name, r) for r in (0, 0, 1, 1)]


def test_the_two_sides_get_the_same_settings():
    for s in vs_trl.SETUPS:
        lit, trl = s.lit_rl_args(), s.trl_args()
        assert lit[lit.index("--model.init_args.max_new_tokens") + 1] == str(s.length)
        assert lit[lit.index("--model.init_args.min_new_tokens") + 1] == str(s.length)
        assert trl[trl.index("--length") + 1] == str(s.length)
        assert (
            ("callbacks/activation_checkpointing.yaml" in lit) == s.checkpointing == ("--no-checkpointing" not in trl)
        )
        assert ("--model.init_args.lora.r" in lit) == s.lora == ("--lora" in trl)


def test_bf16_rows_set_the_same_precision_on_both_sides():
    assert any(s.bf16 for s in vs_trl.SETUPS) and any(not s.bf16 for s in vs_trl.SETUPS)
    for s in vs_trl.SETUPS:
        lit, trl = s.lit_rl_args(), s.trl_args()
        assert ("bf16-mixed" in lit) == s.bf16 == ("--bf16" in trl)
        assert ("--trainer.precision" in lit) == s.bf16  # float32 rows keep the config's 32-true


def test_sampler_rows_pass_settings_the_method_accepts():
    """A row with lit-rl's faster sampler sets model.rollout_* to values RefCachedGRPO's signature allows; TRL's side
    is the row without it."""
    import inspect
    import typing

    from lit_rl.methods import RefCachedGRPO

    params = inspect.signature(RefCachedGRPO.__init__).parameters
    rows = [s for s in vs_trl.SETUPS if s.sampler]
    assert rows
    for s in rows:
        lit = s.lit_rl_args()
        for setting in s.sampler:
            name, value = setting.split("=")
            assert value in typing.get_args(typing.get_type_hints(RefCachedGRPO.__init__)[name]), setting
            assert name in params and lit[lit.index(f"--model.init_args.{name}") + 1] == value
        plain = next(p for p in vs_trl.SETUPS if not p.sampler and (p.length, p.lora, p.checkpointing, p.bf16)
                     == (s.length, s.lora, s.checkpointing, s.bf16))  # fmt: skip
        assert s.trl_args() == plain.trl_args()


def test_the_roofline_floor_divides_both_sides(tmp_path):
    setup = vs_trl.SETUPS[0]
    c = vs_trl.Comparison(setup)
    assert c.floor() is None
    c.runs += [vs_trl.Run("lit-rl", setup.name, 0, [9.0, 4.0, 4.0], 2**30, 10.0, floor_s=1.0),
               vs_trl.Run("TRL", setup.name, 0, [9.0, 8.0, 8.0], 2**30, 10.0),
               vs_trl.Run("lit-rl", setup.name, 1, [9.0, 4.0, 4.0], 2**30, 10.0, floor_s=3.0)]  # fmt: skip
    assert c.floor() == 2.0 and c.share("lit-rl") == "50%" and c.share("TRL") == "25%"
    (row,) = [line for line in vs_trl.tables([c]) if line.startswith(f"| {setup.name} | 1.00")]
    assert row.endswith("| 2.0 | 50% | 25% |")
    # the floor of a run: the sum of the modelled phases' floors in the profiler's summary
    summary = {"roofline": {"phases": {"rollout": {"floor_s": 0.5}, "reference": {"floor_s": 0.25},
                                       "reward": {"measured_s": 0.1}}}}  # fmt: skip
    (tmp_path / "version_0").mkdir()
    (tmp_path / "version_0" / "memory_summary.json").write_text(json.dumps(summary))
    assert vs_trl.step_floor(tmp_path) == 0.75
    assert vs_trl.step_floor(tmp_path / "version_0" / "none") is None
    skipped = {"roofline": {"skipped": "not modelled: the batch is not a prompt batch"}}
    (tmp_path / "version_0" / "memory_summary.json").write_text(json.dumps(skipped))
    assert vs_trl.step_floor(tmp_path) is None


# lit-rl estimate's output, as it prints it (the phase table's last rows and a --plan table), shortened
ESTIMATE_TAIL = """phase            peak GiB       peak  first step   at the peak
backward           2.7165   2.72 GiB      1.7143   parameters 1.00 GiB, gradients 405.13 MiB
optimizer          2.5056   2.51 GiB      2.5056   parameters 1.00 GiB, gradients 513.13 MiB
step               2.7165   2.72 GiB      2.5056
"""
PLAN_TABLE = """plan for 1.56 GiB of tensors (predicted peak, roofline floor at this machine's rates):
  tactics                                                           peak       saved     time  fits
  adamw8bit*, bf16*, micro_batch_tokens 768 (4 rows)            1.52 GiB    1.78 GiB   82.71x  yes  <- plan
  bf16*, reference_bf16*, checkpoint every 1                    1.36 GiB    1.94 GiB   94.07x  yes
  the config as it is                                           3.30 GiB         0 B    1.00x  no
"""


def test_the_estimates_printed_tables_are_read():
    import harness

    assert harness.estimated_step_gib(ESTIMATE_TAIL) == 2.7165  # the step row, not a phase's
    assert harness.estimated_step_gib(ESTIMATE_TAIL.replace("step   ", "steps  ")) is None
    assert harness.planner_choice(PLAN_TABLE) == {
        "plan": "adamw8bit*, bf16*, micro_batch_tokens 768 (4 rows)",
        "predicted": "1.52 GiB",
        "time": "82.71x",
    }
    assert harness.planner_choice(PLAN_TABLE.replace("  <- plan", "")) is None  # exit 2: nothing fits
    from lit_rl.memory import parse_bytes  # how the planned table reads the chosen row's predicted peak

    assert [parse_bytes(t) / 2**30 for t in ("1.52 GiB", "512.00 MiB", "0 B")] == pytest.approx([1.52, 0.5, 0.0])


def test_the_planned_budget_leaves_room_for_what_is_not_tensors():
    # TRL 4 GiB: half is 2; lit-rl's process held 3.2 GiB with 2.7 of tensors, so 0.5 GiB beside them
    assert vs_trl.tensor_budget(4 * 2**30, 3.2 * 2**30, 2.7 * 2**30) == pytest.approx(1.5 * 2**30)
    assert all(s.plan == (i < 2) for i, s in enumerate(vs_trl.SETUPS))  # full FT 64 and LoRA 256, float32
    for s in vs_trl.SETUPS[:2]:
        planned = s.lit_rl_args(planned=True)
        assert "callbacks/activation_checkpointing.yaml" not in planned  # the planner refuses it: it chooses its own
        full = s.lit_rl_args()
        at = full.index(vs_trl.CHECKPOINTING)
        assert planned == full[: at - 1] + full[at + 1 :]  # the same work, only the callback's --config pair gone


def test_the_planned_side_runs_after_the_pairs_of_its_setup(monkeypatch, tmp_path):
    calls, gib = [], 2**30
    rss = {"lit-rl": 3 * gib, "TRL": 4 * gib, vs_trl.PLANNED: 1.9 * gib}

    def fake_child(setup, side, rnd, steps, log=print, rates=vs_trl.RATES, plan=None):
        calls.append((setup.name, side, rnd, plan))
        return vs_trl.Run(side, setup.name, rnd, [9.0, 2.0 if side != "TRL" else 4.0], rss[side], 10.0)

    def fake_plan(c, plan_file, rates, log=print):
        assert [r.side for r in c.runs] == ["lit-rl", "TRL"] * 2  # both rounds of this setup first
        return vs_trl.Planned(1.5, 2.5, {"plan": "adamw8bit*", "predicted": "1.40 GiB", "time": "1.20x"}, "p.yaml")

    monkeypatch.setattr(vs_trl, "run_child", fake_child)
    monkeypatch.setattr(vs_trl, "plan_for_half_of_trl", fake_plan)
    one, three = vs_trl.SETUPS[0], vs_trl.SETUPS[2]
    comparisons = vs_trl.run((one, three), rounds=2, steps=2, log=lambda _: None, plans=tmp_path)
    assert [c[1] for c in calls] == ["lit-rl", "TRL"] * 2 + [vs_trl.PLANNED] * 2 + ["lit-rl", "TRL"] * 2
    assert [c[3] for c in calls if c[1] == vs_trl.PLANNED] == ["p.yaml", "p.yaml"]
    assert comparisons[1].planned is None  # not a plan setup
    lines = vs_trl.tables(comparisons)
    (row,) = [ln for ln in lines if ln.startswith(f"| {one.name} | 0.50 | 1.50 | adamw8bit*")]
    # 1.9 / 4 = 0.475 of TRL's peak RSS: met; 2 s against TRL's 4 s
    # 1.9 GiB of RSS, 1.4 of them predicted tensors
    assert row.endswith("| 1.90 | 0.50 | 4.00 | 0.47 | met | 2.0 | 4.0 | 0.50 |"), row
    assert sum(f"| {vs_trl.PLANNED} |" in ln for ln in lines) == 2  # each planned run in the list of runs
    # without --plan's folder (--no-plan), no planned side
    calls.clear()
    vs_trl.run((one,), rounds=1, steps=2, log=lambda _: None)
    assert [c[1] for c in calls] == ["lit-rl", "TRL"]


def test_a_comparison_in_a_file_of_its_own_keeps_its_rates_beside_it():
    assert vs_trl.rates_file(None) == vs_trl.RATES  # bench/BENCHMARKS.md's comparison
    assert vs_trl.rates_file("bench/results/vs_trl_planned.md") == "bench/results/vs_trl_planned_rates.json"


def test_a_setup_nothing_was_planned_for_says_why():
    c = vs_trl.Comparison(vs_trl.SETUPS[0])
    c.runs += [vs_trl.Run("lit-rl", c.setup.name, 0, [9.0, 2.0], 3 * 2**30, 10.0),
               vs_trl.Run("TRL", c.setup.name, 0, [9.0, 4.0], 4 * 2**30, 10.0)]  # fmt: skip
    c.planned = vs_trl.Planned(0.3, 2.5, why="no plan fits in 307.20 MiB: the smallest peak reached is 1.10 GiB")
    (row,) = [ln for ln in vs_trl.planned_table([c]) if ln.startswith(f"| {c.setup.name} |")]
    assert "| 0.50 | 0.30 | not planned: no plan fits in 307.20 MiB" in row
    assert vs_trl.planned_table([vs_trl.Comparison(vs_trl.SETUPS[2])]) == []  # no planned side: no table


def test_a_budget_no_plan_fits_plans_the_smallest_peak_the_planner_names(monkeypatch, tmp_path):
    # the equal-settings lit-rl process held 2.6 GiB beside 0.8 GiB of tensors and TRL 5.4: B = 2.7 - 2.6 = 0.1 GiB;
    # the planner refuses it, naming 258.80 MiB, which is planned instead (a hair above: the size is printed rounded)
    c = vs_trl.Comparison(vs_trl.SETUPS[1])
    c.runs += [vs_trl.Run("lit-rl", c.setup.name, 0, [9.0, 2.0], 3.4 * 2**30, 10.0),
               vs_trl.Run("TRL", c.setup.name, 0, [9.0, 4.0], 5.4 * 2**30, 10.0)]  # fmt: skip
    budgets = []
    refusal = "error: --device-memory 102.40 MiB: no plan fits; the smallest predicted peak is 258.80 MiB (nf4*)"
    table = "  nf4*, checkpoint every 1      258.80 MiB   2.00 GiB      n/m  yes  <- plan"

    def fake_estimate(args, log):
        if "--device-memory" not in args:
            return subprocess.CompletedProcess(args, 0, "step peak (steady state)  0.80 GiB\n", "")
        budgets.append(args[args.index("--device-memory") + 1])
        return subprocess.CompletedProcess(args, 0, table, "") if len(budgets) == 2 else (
            subprocess.CompletedProcess(args, 2, "", refusal))  # fmt: skip

    monkeypatch.setattr(vs_trl, "_estimate", fake_estimate)
    monkeypatch.setattr(vs_trl.harness, "estimated_step_gib", lambda text: 0.8)
    planned = vs_trl.plan_for_half_of_trl(c, tmp_path / "plan.yaml", vs_trl.RATES)
    assert budgets[0] == "0.1000GiB" and float(budgets[1][:-3]) == pytest.approx(258.80 * 1.001 / 1024, abs=1e-4)
    assert planned.choice["plan"].startswith("nf4*") and planned.leanest_gib == pytest.approx(0.2530, abs=1e-3)
    c.runs.append(vs_trl.Run(vs_trl.PLANNED, c.setup.name, 0, [9.0, 2.0], 1.2 * 2**30, 10.0))
    c.planned = planned
    (row,) = [ln for ln in vs_trl.planned_table([c]) if ln.startswith(f"| {c.setup.name} |")]
    assert "| 0.10 (no plan fits; planned for the smallest peak, 0.25) | nf4*" in row and "| 0.22 | met |" in row


def test_a_partial_rerun_keeps_the_other_sections():
    titles = {"trl": "1. A", "baselines": "2. B"}
    saved = "\n".join(["# Benchmarks", "", "Command: `python bench/run.py --out bench`",
                       "Machine: 2 CPU cores (AMD EPYC; avx2), x86_64; 1-minute load average 1.0-2.0 during the runs.",
                       "", "## 1. A", "",
                       "_12 s; load average (1 min) 1.00 before, 2.00 after._", "", "old TRL table", "", "## 2. B", "",
                       "_`python bench/run.py --only baselines` on 2026-01-01: 3 s; load ..._", "", "baselines text",
                       "", "Total: 15 s."])  # fmt: skip
    kept = bench_run.saved_sections(saved, titles)
    amd = "2 CPU cores (AMD EPYC; avx2), x86_64"  # the file's machine ran the file's command: its section says so
    assert (
        kept["trl"][2]
        == f"_`python bench/run.py --out bench`, {amd}: 12 s; load average (1 min) 1.00 before, 2.00 after._"
    )
    assert kept["trl"][4] == "old TRL table" and kept["trl"][-1] == ""
    # kept from an earlier run than the file's: where it ran is not known
    assert (
        kept["baselines"][2]
        == "_`python bench/run.py --only baselines` on 2026-01-01, machine not recorded: 3 s; load ..._"
    )
    # a section that names its machine keeps it
    assert bench_run.with_machine(kept["trl"][2], "elsewhere") == kept["trl"][2]
    assert kept["baselines"][-2:] == ["baselines text", ""]  # the total is not part of a section


def test_parts_are_checked():
    assert bench_run.parse_parts(None) == bench_run.PARTS
    assert bench_run.parse_parts("gpu, trl") == ("trl", "gpu")  # the suite's order
    with pytest.raises(ValueError, match="unknown part"):
        bench_run.parse_parts("trl,nope")
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--only", "nope"])
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--steps", "1"])


def test_setups_are_picked_by_number():
    assert vs_trl.pick(vs_trl.SETUPS, None) == vs_trl.SETUPS
    assert vs_trl.pick(vs_trl.SETUPS, "3,1") == (vs_trl.SETUPS[0], vs_trl.SETUPS[2])
    for bad in ("0", str(len(vs_trl.SETUPS) + 1), "a", ","):
        with pytest.raises(ValueError, match="--setups"):
            vs_trl.pick(vs_trl.SETUPS, bad)
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--setups", str(len(vs_trl.SETUPS) + 1)])


def test_headings_nest_under_the_suite():
    assert bench_run.demote_headings("### A\ntext\n#### B") == "#### A\ntext\n##### B"
    assert bench_run.without_title("# Title\n\nRegenerate: ...\n### A") == "Regenerate: ...\n### A"


@pytest.mark.bench
@pytest.mark.slow
def test_quick_suite_writes_the_report(tmp_path):
    # the baselines part nests bench_policy_update.py and bench_gumbel_topk.py, whose quick runs have their own tests
    only = ["--only", "trl,sweeps,gpu" if HAS_TRL else "sweeps,gpu"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--out", str(tmp_path), *only],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert "This file: `python bench/run.py --quick --out" in md
    assert "CPU cores" in md and "torch 2" in md and "load average (1 min)" in md
    assert "## 3. Vocabulary and length sweeps" in md
    if HAS_TRL:
        assert "## 1. lit-rl vs TRL" in md
        rows = [line for line in md.splitlines() if line.startswith("| LoRA, 8 tokens")]
        assert len(rows) == 3  # the summary row and one row per side
        # quick numbers can earn either verdict: each must be the one its ratio earns (the ratio is printed rounded)
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        verdicts = ((cells[3], cells[4], vs_trl.TARGETS["peak RSS"]), (cells[7], cells[8], vs_trl.TARGETS["step time"]))
        for ratio, said, target in verdicts:
            assert said in ("met", "not met"), rows[0]
            if abs(float(ratio) - target) > 0.005:
                assert said == vs_trl.verdict(float(ratio), target), rows[0]
    import torch

    if not torch.cuda.is_available():
        assert "not run: no CUDA device" in md
    sweep = md.split("## 3.", 1)[1].split("## 4.", 1)[0]
    body = [line for line in sweep.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(body) == 4  # vocabularies 512, 1,024, 2,048 at 16 tokens and 8 tokens at 512
    for line in body:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert abs(float(cells[7])) < 1.0  # the estimate of the update within 1 % at any size
    for name in ("cpu_peak_by_phase.png", "cpu_peak_vs_vocab.png", "cpu_vs_length.png"):
        assert (tmp_path / "results" / name).stat().st_size > 0
