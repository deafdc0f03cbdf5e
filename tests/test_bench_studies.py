"""Every study in bench/studies/ runs end to end in its quick mode, so no study can rot.

Each study's ``--quick`` trains its tiny config, or its own configs on ``tiny:llama`` (a random model built in
memory), for 1-2 steps per arm in a subprocess, exactly as ``python bench/study.py <study> --quick`` does; the numbers
mean nothing. Checked: the results file has the study's columns in order, a row per quick arm, the cells of the
scalars the study requires are filled, the columns are those of the committed full-run results file (where this
runner wrote it), the study's own checks (``CHECKS``), and ``--reuse`` rebuilds the table without rerunning.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "bench" / "study.py"
STUDIES = sorted(p.stem for p in (ROOT / "bench" / "studies").glob("*.yaml"))


def _study(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(STUDY), *args], cwd=ROOT, capture_output=True, text=True, timeout=1800)


def _first_table(text: str) -> tuple[list[str], list[list[str]]]:
    """Header cells and body rows (lists of stripped cells) of the first markdown table in ``text``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| "))
    rows = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows[0], rows[2:]


def _columns(headers: list[str]) -> list[str]:
    # a header may name the steps it was evaluated at ("after batches 0, 10, 20"): the steps differ, the column not
    return [re.sub(r"\d+(, \d+)+", "<steps>", h) for h in headers]


def test_every_study_parses_and_names_known_cells():
    assert STUDIES, "bench/studies/ has no study"
    for name in STUDIES:
        study = yaml.safe_load((ROOT / "bench" / "studies" / f"{name}.yaml").read_text())
        assert {"title", "config", "arms", "columns", "quick"} <= study.keys(), name
        assert set(study["quick"].get("arms", study["arms"])) <= set(study["arms"]), name
        # quick mode trains a tiny random model: a tiny config, or the study's configs on tiny:llama
        quick = study["quick"]
        tiny = "tiny:llama" in [*quick.get("base", []), *quick.get("overrides", [])]
        assert quick.get("config", "").endswith("_tiny.yaml") or tiny, name


def _checkpointing(column: dict[str, tuple[str, ...]], arms: list[str], text: str) -> None:
    """More checkpointed layers hold fewer bytes, the estimator predicts them, and one unprofiled step is timed."""
    layers = dict(zip(arms, map(int, column["checkpointed layers"])))
    assert layers["off"] == 0 and layers["1"] >= layers["2"] > 0, layers
    peaks = dict(zip(arms, map(float, column["tensor peak (MiB)"])))
    predicted = dict(zip(arms, map(float, column["predicted (MiB)"])))
    assert peaks["1"] <= peaks["2"] <= peaks["off"] and peaks["1"] < peaks["off"], peaks
    for arm, peak in peaks.items():
        assert predicted[arm] == pytest.approx(peak, rel=0.25), arm
    assert all(float(s) > 0 for s in column["step (s)"]) and set(column["steps timed"]) == {"1"}, column


def _roofline(column: dict[str, tuple[str, ...]], arms: list[str], text: str) -> None:
    """Each run's phases sum to a measured step with a floor below it; a phase table per run, the rates table."""
    assert arms == ["default", "lora256", "qlora256", "gumbel_topk"]  # a 4-bit base modelled too
    assert all(float(s) > float(f) > 0 for s, f in zip(column["measured step s"], column["floor s"])), column
    assert text.count("| phase | measured s |") == 4 and "| bfloat16 | " in text
    for phase in ("rollout", "reference", "policy_forward"):
        assert text.count(f"| {phase} | ") == 3, phase
    for phase in ("generate", "reward"):  # GumbelTopK's differentiable rollout, modelled too
        assert text.count(f"| {phase} | ") == 1, phase
    for phase in ("backward", "optimizer"):
        assert text.count(f"| {phase} | ") == 4, phase


def _qlora(column: dict[str, tuple[str, ...]], arms: list[str], text: str) -> None:
    """Learning rows with two evaluations after the first; the memory table of the profiled runs; NF4 storage
    about a quarter of bf16's; every estimate's NF4 step peak below the dense one."""
    assert arms == ["grpo_lora", "grpo_qlora"]
    assert all(a.endswith("(0, 1, 2)") for a in column["held-out accuracy (steps)"]), column
    header, rows = _first_table(text.split("## Memory per phase", 1)[1])
    assert header == ["phase", "bf16", "nf4-bf16"]  # the quick arms'; the full run adds float32
    assert [r[0] for r in rows] == ["rollout", "reference", "policy_forward", "backward", "optimizer", "step"]
    assert all(" / " in c and "(" in c for r in rows for c in r[1:]), rows
    nf4 = next(r for r in _first_table("| storage |" + text.split("| storage |", 1)[1])[1] if "NF4" in r[0])
    assert 0.5 < float(nf4[2]) < 0.6, nf4
    tables = text.split("| phase | dense base GiB | NF4 base GiB | NF4 / dense |")[1:]
    quick = yaml.safe_load((ROOT / "bench" / "studies" / "qlora.yaml").read_text())["quick"]
    assert len(tables) == len(quick["estimates"]) == 2
    for table in tables:
        step = next(ln for ln in table.splitlines() if ln.startswith("| step |"))
        assert 0 < float(step.split("|")[4]) < 1, step  # NF4 / dense


def _gumbel_topk_vs_grpo(column: dict[str, tuple[str, ...]], arms: list[str], text: str) -> None:
    """Each method's own phases from its profiled twin, the gradient noise from its gradient twin; held-out rows for
    every arm at every evaluation."""
    assert arms == ["GumbelTopK", "GRPO-RM", "GRPO"]
    peaks = column["peak GiB per phase (profiled run)"]
    # the quick run has no twins for GRPO-RM (GRPO's runs with another reward function)
    assert peaks[0].startswith("generate ") and peaks[2].startswith("rollout ") and peaks[1] == "not measured", peaks
    noise = column["gradient noise: relative variance, agreement (16 draws, step 0)"]
    assert noise[0] != "zero gradient (every draw)", noise  # GumbelTopK's reward model always gives a gradient
    assert noise[1] == "not measured", noise
    for cell in noise[::2]:  # tiny GRPO arms may score every completion alike: no gradient to draw
        if cell != "zero gradient (every draw)":
            variance, agreement = (float(x) for x in cell.split(", "))
            assert variance > 0 and -1 <= agreement <= 1, cell
    _, by_step = _first_table(text.split("## Held-out scores by step", 1)[1])
    assert [(r[0], r[1]) for r in by_step] == [(m, s) for m in arms for s in ("0", "1", "2")]
    assert [r[0] for r in _first_table(text.split("## At equal wall time", 1)[1])[1]] == arms


def _checkpoint_save(column: dict[str, tuple[str, ...]], arms: list[str], text: str) -> None:
    """A save was measured in both runs, with Lightning's IO and with the streaming one."""
    assert [a.split()[1] for a in arms] == ["TorchCheckpointIO", "StreamingCheckpointIO"], arms
    overall, before = column["overall peak"], column["peak RSS before the first save"]
    assert all(float(o) >= float(b) > 0 for o, b in zip(overall, before)), column


def _shared_prompt(column: dict[str, tuple[str, ...]], arms: list[str], text: str) -> None:
    """The runs are seeded: every variant, the code of an earlier commit too, samples the same rewards."""
    assert len(set(column["reward/mean per step"])) == 1, column["reward/mean per step"]
    assert column["step vs the first row"][0] == "1.00x"


def _allocator(column: dict[str, tuple[str, ...]], arms: list[str], text: str) -> None:
    """Each run found itself on glibc, and the runtime's baseline and the ratio are measured."""
    assert all(a.startswith("glibc") for a in column["allocator"]), column["allocator"]
    assert all(float(b) > 0 for b in column["baseline (GiB)"]), column
    assert all(float(r.rstrip("x")) > 0 for r in column["RSS / (tensor peak + baseline)"]), column


def _bf16_cpu(column: dict[str, tuple[str, ...]], arms: list[str], text: str) -> None:
    """Held-out accuracy before the first step and after each of the two; the probes' columns are filled."""
    assert all(len(a.split(" → ")) == 3 for a in column["held-out accuracy (steps 0, 1, 2)"]), column
    assert all(w.endswith("%") for w in column["weights moved"]) and all(float(s) > 0 for s in column["CPU s"])


def _sampler_rollouts(column: dict[str, tuple[str, ...]]) -> None:
    """Every sampler's rollout has seconds, tokens per second and a share of its floor."""
    assert all(float(s) > 0 for s in column["rollout s"]) and all(float(t) > 0 for t in column["tokens/s"]), column
    assert all(share.endswith("%") for share in column["rollout floor / measured"]), column


def _rollout_samplers(column: dict[str, tuple[str, ...]], arms: list[str], text: str) -> None:
    _sampler_rollouts(column)
    assert "rollout_samplers.json" in text


def _rollout_lean(column: dict[str, tuple[str, ...]], arms: list[str], text: str) -> None:
    """The lean step's rollout as every sampler's, beside the loop's, and its log-probs' gap."""
    _sampler_rollouts(column)
    assert "rollout_lean.json" in text and "rollout_lean_rates.json" in text
    assert all(gap != "-" for gap in column["mean abs Δ log p"]), column


def _memory_plan(column: dict[str, tuple[str, ...]], arms: list[str], text: str) -> None:
    """The planned arm fits its budget; the plans at scale are the planner's own tables, with the command."""
    assert column["fits"][arms.index("2GiB")] == "yes", column
    scale = text.split("## Plans at scale (estimated, not run)", 1)[1]
    assert "### tiny at 2 MiB" in scale and "`lit-rl estimate --config configs/grpo_tiny.yaml" in scale
    assert "plan for 2.00 MiB of tensors" in scale and "<- plan" in scale, scale
    assert re.search(r"At commit \w+.*; 1-minute load average [\d.]+ before, [\d.]+ after", scale), scale


CHECKS = {  # a study's own assertions on its quick table (by column) and results file
    "checkpointing": _checkpointing,
    "roofline": _roofline,
    "qlora": _qlora,
    "gumbel_topk_vs_grpo": _gumbel_topk_vs_grpo,
    "checkpoint_save": _checkpoint_save,
    "shared_prompt": _shared_prompt,
    "allocator": _allocator,
    "bf16_cpu": _bf16_cpu,
    "rollout_samplers": _rollout_samplers,
    "rollout_lean": _rollout_lean,
    "memory_plan": _memory_plan,
}


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.parametrize("name", STUDIES)
def test_quick_run_writes_the_columns_and_a_row_per_arm(name, tmp_path):
    study = yaml.safe_load((ROOT / "bench" / "studies" / f"{name}.yaml").read_text())
    out, results = tmp_path / "runs", tmp_path / "results"
    done = _study(name, "--quick", "--out", str(out), "--results", str(results))
    assert done.returncode == 0, done.stderr[-3000:]
    filename = study.get("results", f"{name}.md")
    text = (results / filename).read_text()
    assert text.startswith(f"# {study['title']}\n")
    assert f"Regenerate: `nice -n 10 python bench/study.py {name}`" in text

    headers, rows = _first_table(text)
    # an optional column (a metric only newer code logs) is left out when no arm has it
    columns = [c for c in study["columns"] if not c.get("optional") or c["header"] in headers]
    expected = [c["header"].split("{")[0] for c in columns]
    assert len(headers) == len(expected) and all(h.startswith(e) for h, e in zip(headers, expected)), headers
    arms = list(study["quick"].get("arms", study["arms"]))  # names (a dict's keys: overrides per arm)
    specs = {a: s if isinstance(s, dict) else {"overrides": s} for a, s in study["arms"].items()}
    label = {a: specs[a].get("label", a) for a in arms}
    tabulated = [a for a in arms if specs[a].get("tabulate", True)]  # the others are run for the hook to read
    in_sections = [a for a in tabulated if specs[a].get("section")]
    assert [r[0] for r in rows] == [label[a] for a in tabulated if a not in in_sections]
    for heading in dict.fromkeys(specs[a]["section"] for a in in_sections):
        section = text.split(f"## {heading}", 1)[1]
        inside = [label[a] for a in in_sections if specs[a]["section"] == heading]
        assert [r[0] for r in _first_table(section)[1]] == inside, heading
    required = set(study.get("read", {}).get("required", []))
    for column, i in ((c, i) for i, c in enumerate(columns) if isinstance(c["cell"], dict)):
        kind, key = next(iter(column["cell"].items()))
        if kind in ("window", "series") and key in required:  # a tabulated arm logged what the study requires
            assert all(r[i] not in ("", column.get("missing", "-")) for r in rows), (column["header"], rows)

    committed = ROOT / "bench" / "results" / filename
    if f"Regenerate: `nice -n 10 python bench/study.py {name}`" in (
        committed.read_text() if committed.exists() else ""
    ):
        # the quick run's columns are those of the committed full run's file (once the runner has written it)
        # an optional column's header up to its first placeholder ("held-out accuracy at steps {eval_steps}")
        optional = tuple(c["header"].split("{")[0] for c in study["columns"] if c.get("optional"))
        assert _columns([h for h in headers if not (optional and h.startswith(optional))]) == _columns(
            [h for h in _first_table(committed.read_text())[0] if not (optional and h.startswith(optional))]
        )

    # every arm's overrides reached its run (the config Lightning saved beside its logs)
    quick = study["quick"]
    for arm in arms:
        saved = yaml.safe_load(next((out / arm).rglob("config.yaml")).read_text())
        spec = study["arms"][arm]
        overrides = spec.get("overrides", []) if isinstance(spec, dict) else spec
        later = [
            *quick.get("overrides", []),
            *(quick["arms"].get(arm) or [] if isinstance(quick.get("arms"), dict) else []),
        ]
        for flag, value in zip(overrides[::2], overrides[1::2]):
            # a config fragment (its name is not saved), a callback appended (what it sets is in the saved config,
            # checked by the flags that set its init_args), or a flag set again in quick mode
            if flag == "--config" or flag.endswith("+") or flag in later[::2]:
                continue
            node = saved
            for part in flag.removeprefix("--").split("."):
                node = node[-1] if isinstance(node, list) else node  # `callbacks.init_args`: the last callback's
                node = node[part]
            if isinstance(node, dict) and "class_path" in node:  # `--optimizer X`: saved with X's init_args
                node = node["class_path"]
            assert node == yaml.safe_load(str(value)), (arm, flag, node)
    if name in CHECKS:
        CHECKS[name](dict(zip(headers, zip(*rows))), [r[0] for r in rows], text)

    again = _study(name, "--quick", "--reuse", "--out", str(out), "--results", str(results))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "+ " not in again.stderr  # nothing was run again
    assert _first_table((results / filename).read_text()) == (headers, rows)


def test_unknown_study_and_arm_are_refused():
    done = _study("no_such_study", "--quick")
    assert done.returncode != 0 and "no study 'no_such_study'" in done.stderr
    if STUDIES:
        done = _study(STUDIES[0], "--quick", "--arms", "no_such_arm")
        assert done.returncode != 0 and "unknown no_such_arm" in done.stderr


def test_git_commit_marks_changed_code_but_not_written_results(tmp_path):
    """A study's ``before`` step writes bench/results/ before its first run: that must not mark the run's code as
    changed, while a changed tracked file anywhere else must."""
    from bench_loader import load_bench

    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "rates.json").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "first", "--allow-empty")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "files")
    with load_bench("harness.py") as harness:
        clean = harness.git_commit(cwd=tmp_path)
        (tmp_path / "bench" / "results" / "rates.json").write_text('{"written": "by a run"}\n')
        after_results = harness.git_commit(cwd=tmp_path)
        (tmp_path / "code.py").write_text("x = 2\n")
        after_code = harness.git_commit(cwd=tmp_path)
    assert re.fullmatch(r"[0-9a-f]{7,}", clean)
    assert after_results == clean
    assert after_code == clean + "+changes"


def test_the_tactics_table_in_the_memory_page_is_the_committed_runs():
    """docs/memory.md's tactics table is written by the tactics study's hook from its runs: every row's tensor peak,
    its ratio, the peak RSS and the held-out curve are the committed results file's cells for the same tactic."""
    page = (ROOT / "docs" / "memory.md").read_text()
    begin = "<!-- tactics table: written by `nice -n 10 python bench/study.py tactics` -->"
    block = page.split(begin, 1)[1].split("<!-- end of tactics -->", 1)[0]
    _, docs_rows = _first_table(block)
    headers, rows = _first_table((ROOT / "bench" / "results" / "tactics.md").read_text())
    results = {r[0]: dict(zip(headers, r)) for r in rows}
    assert [r[0] for r in docs_rows] == list(results)  # every tactic, in the study's order
    for tactic, peak, rss, step, accuracy in docs_rows:
        row = results[tactic]
        assert peak == f"{row['tensor peak GiB']} ({row['vs none']})", tactic
        assert rss == f"{row['peak RSS GiB']} ({row['RSS vs none']})", tactic
        assert step == row["step s (vs none)"], tactic
        held_out = next(v for k, v in row.items() if k.startswith("held-out accuracy"))
        (docs_values, docs_steps), (values, steps) = (_steps_apart(accuracy), _steps_apart(held_out))
        assert [float(x) for x in docs_values.split(" → ")] == [float(x) for x in values.split(" → ")], tactic
        assert docs_steps == steps, tactic  # a run stopped early names its steps in both


def _steps_apart(cell: str) -> tuple[str, str]:
    """A held-out cell's values and the ``(steps ...)`` note of a run that stopped early ("" if none)."""
    values, _, steps = cell.partition(" (steps ")
    return values, steps


def test_a_measured_child_keeps_its_stdout_apart_when_asked(tmp_path):
    """``harness.run_measured`` with ``stderr``: the log holds the child's stdout alone (what a results file quotes,
    as ``bench_estimate.py --at-scale`` quotes the estimate), the other file its stderr; a failure carries both."""
    from bench_loader import load_bench

    child = "import sys; print('table'); print('progress', file=sys.stderr); sys.exit(int(sys.argv[1]))"
    with load_bench("harness.py") as harness:
        out, err = tmp_path / "out.txt", tmp_path / "err.txt"
        done = harness.run_measured([sys.executable, "-c", child, "0"], None, {}, out, stderr=err)
        assert out.read_text() == "table\n" and err.read_text() == "progress\n" and done.peak_rss > 0
        harness.run_measured([sys.executable, "-c", child, "0"], None, {}, out)
        assert sorted(out.read_text().split()) == ["progress", "table"]  # merged, as every other caller wants
        with pytest.raises(harness.ChildFailed) as failed:
            harness.run_measured([sys.executable, "-c", child, "3"], None, {}, out, stderr=err)
        assert failed.value.code == 3 and "table" in failed.value.output and "progress" in failed.value.output


def test_a_run_stopped_early_names_its_evaluation_steps_in_its_row():
    """The header names the longest run's evaluation steps; a run its ``max_time`` stopped earlier (evaluated at steps
    0, 20 and 21) says so in its own cell instead of widening the header to 0, 20, 21, 40, 60."""
    from bench_loader import load_bench

    full = [(0, 0.65), (19, 0.9), (39, 1.0), (59, 0.95)]  # logged at step k - 1 after step k's update
    stopped = [(0, 0.7), (19, 0.85), (20, 0.85)]
    study = {
        "eval_key": "val/correct_answer",
        "columns": [
            {"header": "arm", "cell": "arm"},
            {"header": "held-out accuracy at steps {eval_steps}", "cell": {"series": "val/correct_answer"}},
        ],
    }
    with load_bench("study.py") as study_py:
        arms = [
            study_py.Arm(name, [], [], {}, {"val/correct_answer": series}, Path("."))
            for name, series in (("full", full), ("stopped", stopped), ("none", []))
        ]
        lines = study_py.table(study, arms, hook=None)
    assert lines[0] == "| arm | held-out accuracy at steps 0, 20, 40, 60 |"
    assert lines[2] == "| full | 0.650 → 0.900 → 1.000 → 0.950 |"
    assert lines[3] == "| stopped | 0.700 → 0.850 → 0.850 (steps 0, 20, 21) |"
    assert lines[4] == "| none | - |"
