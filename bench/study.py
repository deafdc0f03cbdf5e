"""Run a study written as data, ``bench/studies/<study>.yaml``, and write its results table.

A study is a set of arms, each ``lit-rl fit --config <config> <base> <arm's overrides>`` in a fresh seeded process
(:func:`harness.run_fit`), and a table with a row per arm whose cells are read from the run's TensorBoard scalars.
The YAML file holds everything that differs between studies:

- ``title``, ``results`` (the file written in ``--results``, default ``<study>.md``), ``description`` (the paragraph
  under the header; ``{config}`` and the study's other top-level scalars are filled in);
- ``config``, ``base`` (overrides every arm starts from), ``threads`` (CPU threads per run), ``arms``
  (``name: [overrides]``, or ``name: {overrides: [...], ...}`` with any of ``label`` (the table's name for it),
  ``config`` (its own), ``base`` (``false``: none; a list: this one instead of the study's), ``env`` (variables set
  in the child's environment before Python starts, e.g. ``LD_PRELOAD``), ``commit`` (run that commit's code and
  config instead of this checkout's), ``section: <heading>`` (tabulated under a heading of its own) and
  ``tabulate: false`` (run for the hook to read, given no row); other keys are the hook's, in ``Arm.spec``),
  ``sections`` (optional, ``<heading>: {description, columns}``: a section's own paragraph and columns, else the
  study's), ``quick`` (``config``, ``base``, ``overrides`` added to every arm, ``arms``: a list of names or
  ``{name: [overrides added to that arm]}``: a tiny smoke test); ``{results}`` in an override is the results
  folder (relative to the repository root when inside it), for a file a hook's ``before`` writes there;
- ``read`` (``required``: of every tabulated arm, and ``optional`` scalar keys), ``eval_key`` (the held-out metric
  whose evaluation steps ``{eval_steps}`` in a column header names);
- ``columns``: ``header``, ``align`` (``right`` for numbers) and ``cell``, one of ``arm``, ``overrides`` (the
  arm's; ``{overrides: with_base}``: the base's too),
  ``{window: key, size: N}`` (first and last N values' means), ``{series: key}`` (every value), ``{last: key or
  [keys]}`` (the first key's last value that the run logged), ``{median: key or [keys], skip: N}`` (the median
  over the steps after the first N of the value, or of the keys' sum per step), ``{max: key}`` (the largest value
  logged), ``{record: wall | peak_rss_mib |
  peak_rss_gib | load}`` (the measured child; ``load``: the load average before and after), ``{hook: name}``;
  with ``format`` (a Python format spec), ``vs: first`` (``last``, ``median`` and ``record`` cells: the ratio to
  the first row of the table, as ``1.23x``), ``missing`` (the cell when absent) and ``optional: true`` (the column
  is left out when no arm has a value for it);
- ``hook`` (optional): a module in ``bench/study_hooks/`` for what data cannot say (a derived column, a plot), with
  ``cells`` (``{name: function(arm) -> str}``), ``before(study, results_dir)`` (run before the arms, not with
  ``--reuse``: what the arms read, such as a rates file) and ``after(study, arms, results_dir) -> list[str]`` (lines
  added to the results file, files written beside it; a hook's own measurements, saved under ``study["runtime"].out``
  so that ``--reuse`` reads them again). ``study["runtime"]`` holds ``out``, ``results``, ``reuse``, ``quick``,
  ``threads`` and ``arms`` (the names this run trains). A study never imports another study.

Run from the repository root::

    nice -n 10 python bench/study.py loss_types                  # every arm, writes bench/results/loss_types.md
    nice -n 10 python bench/study.py loss_types --arms gspo       # some arms only
    python bench/study.py loss_types --reuse                      # the table again from runs already in --out
    python bench/study.py loss_types --quick                      # tiny config, 1-2 steps, temporary folders
    python bench/study.py --list                                  # the studies there are
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import harness
import yaml

STUDIES = Path(__file__).resolve().parent / "studies"
CELL_KINDS = ("arm", "overrides", "window", "series", "last", "median", "max", "record", "hook")


@dataclass
class Arm:
    """One arm's run: its name, overrides, the measured child's record and the scalars read from its logs."""

    name: str
    overrides: list[str]
    base: list[str]
    record: dict
    series: dict[str, list[tuple[int, float]]]
    run_dir: Path
    section: str | None = None  # tabulated under a heading of its own
    spec: dict = field(default_factory=dict)  # the arm's entry in the study, keys of the hook's included
    config: str = ""  # the run's --config
    args: list[str] = field(default_factory=list)  # everything after it: base, overrides, quick additions
    others: dict[str, Arm] = field(default_factory=dict)  # every arm of this run of the study, by name
    label: str | None = None  # the table's name for it (default: its name)
    extra: dict = field(default_factory=dict)  # what a hook computes once and reads in several cells

    def values(self, key: str) -> list[float]:
        return [v for _, v in self.series.get(key, [])]

    def eval_steps(self, key: str) -> list[int]:
        """Optimizer steps done at each evaluation of ``key``: the evaluation before training is logged at step 0,
        one after step k's update at k - 1."""
        logged = self.series.get(key, [])
        return [0] + [s + 1 for s, _ in logged[1:]] if logged else []

    def steps_note(self, key: str, arms: list[Arm]) -> str:
        """``" (steps 0, 20, 21)"`` where this run evaluated ``key`` at other steps than the header of a table of
        ``arms`` names (:func:`table_steps`): a run that its ``max_time`` stopped early, say; else ``""``."""
        own = self.eval_steps(key)
        return f" (steps {', '.join(map(str, own))})" if own and own != table_steps(arms, key) else ""


def table_steps(arms: list[Arm], key: str) -> list[int]:
    """The evaluation steps a table's header names: the longest run's (the first of those as long)."""
    return max((arm.eval_steps(key) for arm in arms), key=len, default=[])


def load_study(name: str) -> dict:
    """The study's YAML as a dict, checked: every arm a list of overrides, every cell of a known kind."""
    path = STUDIES / f"{name}.yaml"
    if not path.exists():
        raise SystemExit(f"error: no study {name!r}: {path} does not exist; use one of {', '.join(study_names())}")
    study = yaml.safe_load(path.read_text())
    study["name"] = name
    for arm, spec in study["arms"].items():
        spec = study["arms"][arm] = spec if isinstance(spec, dict) else {"overrides": spec}
        spec["overrides"] = [str(x) for x in spec.get("overrides") or []]
        spec["env"] = {str(k): str(v) for k, v in (spec.get("env") or {}).items()}
        if len(spec["overrides"]) % 2:
            raise SystemExit(f"error: {path}: arm {arm}: overrides must be a list of flag, value pairs")
    sections = study.setdefault("sections", {})
    for column in [*study["columns"], *(c for s in sections.values() for c in s.get("columns", []))]:
        cell = column["cell"]
        kind = cell if isinstance(cell, str) else next(iter(cell))
        if kind not in CELL_KINDS:
            raise SystemExit(f"error: {path}: column {column['header']!r}: unknown cell {kind!r}; use {CELL_KINDS}")
    return study


def study_names() -> list[str]:
    return sorted(p.stem for p in STUDIES.glob("*.yaml"))


def load_hook(study: dict):
    return importlib.import_module(f"study_hooks.{study['hook']}") if study.get("hook") else None


def filled(overrides: list, results: Path) -> list[str]:
    """``overrides`` as strings, ``{results}`` replaced by the results folder (relative to the root when inside it)."""
    return [str(x).replace("{results}", harness.relative(results)) for x in overrides]


def _fmt(value: float | None, spec: str, missing: str) -> str:
    return missing if value is None else format(value, spec)


def value(what: dict, arm: Arm) -> float | None:
    """The number a ``last``, ``median``, ``max`` or ``record`` cell shows."""
    kind, key = next(iter(what.items()))
    keys = [key] if isinstance(key, str) else key
    if kind == "last":
        found = [arm.values(k)[-1] for k in keys if arm.values(k)]
        return found[0] if found else None
    if kind == "max":  # the largest value logged over the run
        found = [v for k in keys for v in arm.values(k)]
        return max(found) if found else None
    if kind == "median":  # per step, the keys' sum; steps where one of them is missing are left out
        per_step = [dict(arm.series.get(k, [])) for k in keys]
        steps = sorted(set.intersection(*(set(s) for s in per_step)))
        sums = [sum(s[step] for s in per_step) for step in steps]
        return statistics.median(sums[what.get("skip", 0) :] or sums) if sums else None
    if key == "peak_rss_mib":
        return arm.record.get("peak_rss", 0) / 2**20
    if key == "peak_rss_gib":
        return arm.record.get("peak_rss", 0) / 2**30
    return arm.record.get(key)


def cell(column: dict, arm: Arm, hook, first: Arm | None = None) -> str:
    """One table cell of ``arm`` as ``column`` describes it (``first``: the table's first row, for ``vs: first``)."""
    spec, missing = column.get("format", ".3f"), column.get("missing", "-")
    what = column["cell"]
    if what == "arm":
        return arm.label or arm.name
    if what == "overrides":
        return harness.shown(arm.overrides)
    kind, key = next(iter(what.items()))
    if kind == "overrides":  # {overrides: with_base}: what the study's base adds, then the arm's own
        return harness.shown([*arm.base, *arm.overrides])
    spec = what.get("format", spec)
    if kind == "window":
        values, n = arm.values(key), what["size"]
        if not values:
            return missing
        return f"{format(harness.mean(values[:n]), spec)} → {format(harness.mean(values[-n:]), spec)}"
    if kind == "series":
        return " → ".join(format(v, spec) for v in arm.values(key)) or missing
    if kind == "record" and key == "load":
        loads = [arm.record.get(k) for k in ("load_before", "load_after")]
        return missing if None in loads else ", ".join(format(x, spec) for x in loads)
    if kind in ("last", "median", "max", "record"):
        own = value(what, arm)
        if what.get("vs") == "first":
            ref = value(what, first) if first is not None else None
            return f"{own / ref:.2f}x" if own is not None and ref else missing
        return _fmt(own, spec, missing)
    return hook.cells[key](arm)


def table(study: dict, arms: list[Arm], hook, columns: list[dict] | None = None) -> list[str]:
    """A markdown table of ``columns`` (the study's by default): its header (``{eval_steps}`` filled in) and a row
    per arm."""
    if not arms:  # every arm run sits in a section
        return []
    columns = columns or study["columns"]
    key = study.get("eval_key", "val/correct_answer")
    cells = {id(c): [cell(c, arm, hook, arms[0]) for arm in arms] for c in columns}
    for c in columns:  # a run that stopped early says at which steps its values were evaluated
        if "{eval_steps}" in c["header"]:
            cells[id(c)] = [x + arm.steps_note(key, arms) for x, arm in zip(cells[id(c)], arms)]
    columns = [
        c for c in columns
        if not c.get("optional") or any(x != c.get("missing", "-") for x in cells[id(c)])
    ]  # fmt: skip
    steps = ", ".join(map(str, table_steps(arms, key)))
    headers = [c["header"].format(eval_steps=steps) for c in columns]
    aligns = ["---:" if c.get("align") == "right" else "---" for c in columns]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(aligns) + " |"]
    for i in range(len(arms)):
        lines.append("| " + " | ".join(cells[id(c)][i] for c in columns) + " |")
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", nargs="?", help="a file name in bench/studies/, without .yaml")
    p.add_argument("--list", action="store_true", help="print the studies there are and exit")
    p.add_argument("--arms", nargs="+", metavar="NAME", help="run these arms only")
    p.add_argument("--out", help="runs folder, a subfolder per arm (default runs/<study>)")
    p.add_argument("--results", help="folder for the results file (default bench/results)")
    p.add_argument("--reuse", action="store_true", help="read an arm already run in --out instead of rerunning it")
    p.add_argument("--threads", type=int, help="CPU threads per run (default: the study's, else 1)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's .ckpt files (deleted by default)")
    p.add_argument("--quick", action="store_true", help="the study's tiny config, 1-2 steps, temporary folders")
    p.add_argument("--note", help="a paragraph under the description: why this file holds some arms only, say")
    args = p.parse_args(argv)
    if args.list:
        return args
    if not args.study:
        p.error(f"a study is needed; one of {', '.join(study_names())}")
    return args


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.list:
        print("\n".join(study_names()))
        return ""
    study = load_study(args.study)
    hook = load_hook(study)
    quick = study.get("quick", {}) if args.quick else {}
    config = quick.get("config", study["config"])
    base = quick.get("base", study.get("base", [])) if args.quick else study.get("base", [])
    names = args.arms or list(quick.get("arms") or study["arms"])
    unknown = [n for n in names if n not in study["arms"]]
    if unknown:
        raise SystemExit(f"error: --arms: unknown {', '.join(unknown)}; use some of {', '.join(study['arms'])}")
    threads = args.threads or study.get("threads", 1)
    scratch = Path(tempfile.mkdtemp(prefix=f"lit_rl_{study['name']}_")) if args.quick else None
    out = Path(args.out) if args.out else (scratch / "runs" if scratch else harness.ROOT / "runs" / study["name"])
    results = Path(args.results) if args.results else (scratch or harness.ROOT / "bench" / "results")
    print(f"runs in {out}, results in {results}", file=sys.stderr, flush=True)
    base = filled(base, results)
    study["runtime"] = argparse.Namespace(
        out=out, results=results, reuse=args.reuse, quick=args.quick, threads=threads, arms=names
    )
    if hook is not None and hasattr(hook, "before") and not args.reuse:
        hook.before(study, results)

    keys = study.get("read", {})
    quick_arms = quick["arms"] if isinstance(quick.get("arms"), dict) else {}
    arms = []
    for i, name in enumerate(names):
        spec = study["arms"][name]
        own_base = spec.get("base", True)
        arm_base = base if own_base is True else [str(x) for x in own_base or []]
        overrides = filled(spec["overrides"], results)
        added = filled([*quick.get("overrides", []), *(quick_arms.get(name) or [])], results)
        extra = [*arm_base, *overrides, *added]
        arm_config = spec.get("config", config)
        run, record = harness.run_fit(arm_config, out / name, extra, reuse=args.reuse, threads=threads,
                                      env=spec["env"], commit=spec.get("commit"))  # fmt: skip
        if not args.keep_checkpoints:  # weights and optimizer state: nothing in a table reads them
            for ckpt in (out / name).rglob("*.ckpt"):
                ckpt.unlink()
        # an arm with no row (run for the hook) need not log what the table requires
        series = harness.read_scalars(str(run), keys.get("required", []), optional=not spec.get("tabulate", True))
        series.update(harness.read_scalars(str(run), keys.get("optional", []), optional=True))
        arms.append(Arm(name, overrides, arm_base, record, series, run, spec.get("section"), spec, arm_config, extra,
                        label=spec.get("label")))  # fmt: skip
        print(f"[{i + 1}/{len(names)}] {name}: {record['wall']:.0f} s", file=sys.stderr, flush=True)
    for arm in arms:
        arm.others = {a.name: a for a in arms}

    command = f"nice -n 10 python bench/study.py {study['name']}"
    this = shlex.join(["python", "bench/study.py", *argv])
    loads = [x for a in arms for x in (a.record.get("load_before"), a.record.get("load_after"))]
    commits = sorted({a.record.get("commit") for a in arms if a.record.get("commit")})
    fill = {k: v for k, v in study.items() if isinstance(v, (str, int, float))} | {"config": config}
    lines = harness.header_lines(
        study["title"], command, this_file=this, commit=", ".join(commits) or None, loads=loads, threads=threads
    )
    own = {n: study["arms"][n]["config"] for n in names if "config" in study["arms"][n]}
    configs = " Each arm's config: " + ", ".join(f"{n} `{c}`" for n, c in own.items()) + "." if own else ""
    lines += [
        f"Each run: `python -m lit_rl fit --config {'<config>' if own else config} {shlex.join(base)} <overrides>` in "
        "a fresh process; each arm's output is in `<out>/<arm>/fit.log`, its wall time, peak RSS and commit in "
        "`bench_run.json`." + configs,
        "",
    ]
    if study.get("description"):
        lines += [" ".join(study["description"].split()).format(**fill), ""]
    if args.note:
        lines += [args.note, ""]
    tabulated = [a for a in arms if a.spec.get("tabulate", True)]
    lines += table(study, [a for a in tabulated if not a.section], hook)
    for section in dict.fromkeys(a.section for a in tabulated if a.section):
        inside = [a for a in tabulated if a.section == section]
        own = study["sections"].get(section, {})
        command = " ".join(filter(None, ["python -m lit_rl fit --config", inside[0].config or config,
                                         shlex.join(inside[0].base)]))  # fmt: skip
        lines += ["", f"## {section}", "", f"Each run: `{command} <overrides>`.", ""]
        if own.get("description"):
            lines += [" ".join(own["description"].split()).format(**fill), ""]
        lines += table(study, inside, hook, own.get("columns"))
    if hook is not None and hasattr(hook, "after"):
        lines += hook.after(study, arms, results)
    text = "\n".join(lines) + "\n"
    results.mkdir(parents=True, exist_ok=True)
    path = results / study.get("results", f"{study['name']}.md")
    path.write_text(text)
    if study.get("json"):
        rows = {a.name: {"overrides": a.overrides, "record": a.record, "series": a.series} for a in arms}
        path.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)
    print(f"wrote {path}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
