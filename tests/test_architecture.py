"""The shape of the package: layering, no private imports, file sizes, options, and a new method that the memory
tools measure and predict without any change to them."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lit_rl.callbacks import EmptyCache, MemoryProfiler
from lit_rl.data import PromptDataModule
from lit_rl.memory.estimate import estimate_step
from lit_rl.methods import BACKWARD, OPTIMIZER, RLMethod
from lit_rl.models import lm_head, trunk
from lit_rl.ops import selective_log_probs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lit_rl"
# top to bottom; a module may import only from its own layer's files or the layers below it
LAYERS = {
    "cli": 5, "cli_errors": 5, "cli_noise": 5, "__main__": 5, "__init__": 5, "export": 5, "planner": 5, "plan_file": 5,
    "methods": 4, "callbacks": 4, "strategies": 4,
    "data": 3, "reward_model": 3,
    "memory": 2,
    "models": 1,
    "ops": 0, "losses": 0,
}  # fmt: skip


def _modules() -> list[tuple[str, Path]]:
    return [(".".join(p.relative_to(ROOT).with_suffix("").parts), p) for p in sorted(PACKAGE.rglob("*.py"))]


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else "__init__"]


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported lit_rl module, names taken from it) for every import in the file, lazy ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lit_rl"):
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("lit_rl")]
    return found


def test_every_import_points_down_the_layers_and_takes_no_private_name():
    wrong = []
    for module, path in _modules():
        for target, names in _imports(path):
            if target == "lit_rl.cli" and module not in ("lit_rl.__main__",):
                wrong.append(f"{module} imports lit_rl.cli")
            elif _layer(target) > _layer(module):
                wrong.append(f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})")
            private = [n for n in names if n.startswith("_")]
            if private:
                wrong.append(f"{module} imports private {private} from {target}")
    assert not wrong, "\n".join(wrong)


def _method_options() -> set[str]:
    """Every constructor argument of RLMethod and of each method under lit_rl.methods (found by inspection)."""
    import inspect

    import lit_rl.methods

    found, todo = set(), [RLMethod]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("lit_rl.") and "__init__" in vars(cls):
            params = inspect.signature(vars(cls)["__init__"]).parameters.values()
            found |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    assert {"beta", "num_iterations", "self_certainty_weight", "gumbel_topk"} <= found, lit_rl.methods.__all__
    return found


# where the policy's config is read from, needed before the method loads any model (lit_rl.models.load_causal_lm's
# own argument names; the estimator reads them to build the stand-in tokenizer)
_LOADER_OPTIONS = {"gguf_file", "trust_remote_code"}


def _reads_by_name(tree: ast.AST, options: set[str]) -> list[tuple[int, str]]:
    """``(line, option)`` for every read of a method option by name: through ``hparams`` (``x.hparams.beta``,
    ``hp["beta"]``, ``hp.get("beta")`` where ``hp`` came from ``hparams``), ``"beta" in ...`` or
    ``getattr(x, "beta")`` / ``hasattr(x, "beta")`` on anything."""

    def from_hparams(node: ast.AST, tainted: set[str]) -> bool:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and sub.attr == "hparams":
                return True
            if isinstance(sub, ast.Constant) and sub.value == "hparams":
                return True
            if isinstance(sub, ast.Name) and sub.id in tainted:
                return True
        return False

    tainted: set[str] = set()
    for node in ast.walk(tree):  # names bound from a module's hparams (hp = dict(module.hparams), ...)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and from_hparams(node.value, set()):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            tainted |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "hparams":
            key = node.attr
        elif isinstance(node, ast.Subscript) and from_hparams(node.value, tainted):
            key = node.slice.value if isinstance(node.slice, ast.Constant) else None
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr == "get" and from_hparams(node.func.value, tainted):
                key = node.args[0].value if isinstance(node.args[0], ast.Constant) else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            key = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):
            if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                key = node.left.value
        if isinstance(key, str) and key in options:
            found.append((node.lineno, key))
    return sorted(set(found))


def test_memory_reads_no_method_option_by_name():
    """``memory`` knows a method through its hooks (``rollout_shape()``, ``step_work()``, ``memory_components()``, the
    base's attributes), never through a hyper-parameter's name, so a new method or a renamed option needs no edit
    there. Rebuilding a method from all of its ``hparams`` (the estimator's copy) names none and is allowed."""
    options = _method_options() - _LOADER_OPTIONS
    wrong = [
        f"{module}:{line} reads {key!r}"
        for module, path in _modules()
        if module.startswith("lit_rl.memory.")
        for line, key in _reads_by_name(ast.parse(path.read_text()), options)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_option_scan_finds_each_way_of_reading_an_option():
    code = (
        "hp = dict(getattr(module, 'hparams', {}) or {})\n"
        "a = hp.get('beta', 0) + module.hparams.num_iterations + hp['tau']\n"
        "b = 'self_certainty_weight' in hp or getattr(module, 'share_prompt', False)\n"
        "c = settings['batch_size'] + hp.get('not_an_option')\n"
    )
    options = {"beta", "num_iterations", "tau", "self_certainty_weight", "share_prompt", "other"}
    found = _reads_by_name(ast.parse(code), options)
    assert [k for _, k in found] == ["beta", "num_iterations", "tau", "self_certainty_weight", "share_prompt"]


@pytest.mark.slow  # a fresh interpreter
def test_the_estimator_imports_neither_the_cli_nor_methods_nor_callbacks():
    code = (
        "import sys, lit_rl.memory.estimate\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('lit_rl.cli', 'lit_rl.methods', 'lit_rl.callbacks')))\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_no_file_under_lit_rl_is_over_500_lines():
    sizes = {module: len(path.read_text().splitlines()) for module, path in _modules()}
    assert {m: n for m, n in sizes.items() if n > 500} == {}


@pytest.mark.slow  # a CLI subprocess per method
@pytest.mark.parametrize("method", ["RefCachedGRPO", "Intuitor"])
def test_help_lists_every_option_through_the_constructor_chain(method):
    out = subprocess.run(
        [sys.executable, "-m", "lit_rl", "fit", "--model.help", method], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    # own options, the GRPO options Intuitor forwards, and the base options every method forwards
    for option in ("num_generations", "loss.beta", "loss.loss_type", "name_or_path", "lora", "learning_rate",
                   "micro_batch_size", "max_nonfinite_steps", "metric_funcs"):  # fmt: skip
        assert f"--model.{option} " in out.stdout, option
    own_help = {"RefCachedGRPO": "skips the reference pass entirely", "Intuitor": "0.005 in the paper"}[method]
    assert own_help in " ".join(out.stdout.split())  # the subclass's own docstring, not a copy


# --------------------------------------------------------------------------------------------- a new method


class ToyMethod(RLMethod):
    """Maximises the log-likelihood of the prompts: two phases of its own, nothing like GRPO's step."""

    phase_names: ClassVar[tuple[str, ...]] = ("embed", "score", BACKWARD, OPTIMIZER)

    def train_step(self, batch: dict[str, Any]) -> tuple[dict[str, float], int]:
        ids, mask = batch["input_ids"], batch["attention_mask"]  # [B, P]
        with self.phases("embed"), torch.no_grad():
            weights = mask[:, 1:].float()  # [B, P-1] tokens that count

        def loss_fn(sl: slice):
            with self.phases("score"):
                hidden = trunk(self.policy)(input_ids=ids[sl], attention_mask=mask[sl]).last_hidden_state  # [b, P, H]
                logp = selective_log_probs(hidden[:, :-1], lm_head(self.policy).weight, ids[sl, 1:])  # [b, P-1]
                loss = -(logp * weights[sl]).sum() / weights.sum()
            return loss, {"logp/mean": logp.mean().item()}

        loss, stats = self.update(len(ids), loss_fn)
        return {"loss": loss, "logp/mean": sum(s["logp/mean"] for s in stats) / max(len(stats), 1)}, len(ids)


def _toy(**kw) -> ToyMethod:
    return ToyMethod(name_or_path="tiny:llama", learning_rate=1e-3, **kw)


def test_a_new_method_is_measured_and_predicted_without_changing_the_memory_tools(tmp_path):
    method = _toy(micro_batch_size=2)
    data = PromptDataModule(num_prompts=8, batch_size=4, max_prompt_length=64)
    profiler = MemoryProfiler()
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[profiler, EmptyCache(phases=["embed"])],
    )  # fmt: skip
    trainer.fit(method, data)
    summary = json.loads((tmp_path / "memory_summary.json").read_text())
    assert list(summary["phases"]) == ["embed", "score", "backward", "optimizer"]
    measured = profiler.summary()["steps"][1]["phases"]
    batch = next(iter(data.train_dataloader()))
    padded = bool((batch["attention_mask"] == 0).any())
    estimate = estimate_step(method, batch_size=4, prompt_length=batch["input_ids"].shape[1], padded=padded)
    assert list(estimate.phases) == ["embed", "score", "backward", "optimizer"]
    for name, predicted in estimate.phases.items():
        assert predicted == pytest.approx(measured[name]["peak_bytes"], rel=0.10), (name, predicted, measured)
    assert estimate.component("saved activations (score)").bytes > 0


def test_empty_cache_checks_phase_names_against_the_method():
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False)
    with pytest.raises(MisconfigurationException, match=r"unknown phase\(s\) \['rollout'\].*embed"):
        EmptyCache(phases=["rollout"]).setup(trainer, _toy(), "fit")


def test_a_phase_the_method_did_not_declare_is_refused():
    method = _toy()
    with pytest.raises(ValueError, match="'rollout' is not declared"), method.phases("rollout"):
        pass


# ------------------------------------------------------------------------------------------------ bench/
BENCH = ROOT / "bench"
# the bench modules a bench file may import: the shared harness, the figure helpers, the reader of a run's held-out
# completions (a command of its own too), the legacy GumbelTopK baseline (a method subclass, no main) that
# bench_gumbel_topk.py measures and its test checks, and the TRL side by side, whose setups and child commands the GPU
# check (device_check.py) runs on CUDA rather than writing them again
BENCH_SHARED = {"harness", "plots", "heldout_examples", "gumbel_legacy", "vs_trl"}


def _public_names(module: str) -> set[str] | None:
    """``__all__`` of a lit_rl package (``lit_rl/x/__init__.py``) or top-level module (``lit_rl/x.py``), read
    without importing it; ``None`` when ``module`` is neither (a file inside a package: not an import path users
    are given) or defines no ``__all__``."""
    parts = module.split(".")
    package = ROOT.joinpath(*parts) / "__init__.py"
    path = package if package.exists() else ROOT.joinpath(*parts).with_suffix(".py") if len(parts) == 2 else None
    if path is None or not path.exists():
        return None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def _bench_problems(path: Path) -> list[str]:
    """What ``path`` imports that a user of the package could not, or another bench script."""
    scripts = {p.stem for p in BENCH.rglob("*.py")} | {p.name for p in BENCH.iterdir() if p.is_dir()}
    wrong = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [(node.module, [a.name for a in node.names])]
        elif isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        else:
            continue
        for module, names in targets:
            top = module.split(".")[0]
            if top == "lit_rl" and module != "lit_rl":
                public = _public_names(module)
                if public is None:
                    wrong.append(f"imports {module}: not a package with __all__; import from the package above it")
                elif names is not None and set(names) - public:
                    wrong.append(f"takes {sorted(set(names) - public)} from {module}, not in its __all__")
            elif top in scripts and top not in BENCH_SHARED:
                wrong.append(f"imports the bench script {module}")
    return [f"bench/{path.relative_to(BENCH)}: {w}" for w in wrong]


def test_bench_files_import_only_the_public_api_and_the_shared_bench_modules():
    """A benchmark measures what a user can run: it imports lit_rl names a package exports (``__all__``), and of
    bench/ only the shared modules, so that no script breaks when another one changes."""
    wrong = []
    for path in sorted(BENCH.rglob("*.py")):
        wrong += _bench_problems(path)
    assert not wrong, "\n".join(wrong)


def test_the_bench_import_check_finds_each_kind_of_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "BENCH", tmp_path)
    (tmp_path / "harness.py").write_text("")
    (tmp_path / "other.py").write_text("")
    script = tmp_path / "script.py"
    script.write_text(
        "import harness\nfrom lit_rl.ops import token_stats\n"  # allowed
        "import other\nfrom lit_rl.ops.token_math import block_logits\nfrom lit_rl.ops import block_logits\n"
        "def lazy():\n    import lit_rl.memory.tracker\n"
    )
    problems = _bench_problems(script)
    assert len(problems) == 4, problems
    assert any("bench script other" in p for p in problems)
    assert any("lit_rl.ops.token_math: not a package" in p for p in problems)
    assert any("['block_logits'] from lit_rl.ops" in p for p in problems)
    assert any("lit_rl.memory.tracker" in p for p in problems)
