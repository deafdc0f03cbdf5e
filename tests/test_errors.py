"""Every mistake in a run's settings, files or functions is answered by the real command in one line,
``error: <field>: <what is wrong>; <the fix>``, with exit status 2, and leaves what earlier runs wrote as it was."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from gsm8k_data import hub_layout, save_gsm8k

from lit_rl.cli import main

ROOT = Path(__file__).resolve().parents[1]
GRPO, GUMBEL = ROOT / "configs/grpo_tiny.yaml", ROOT / "configs/gumbel_topk_tiny.yaml"


def raises(completions, **_):
    raise ZeroDivisionError("bad reward")


def too_few(completions, **_):
    return [1.0]


def nan(completions, **_):
    return [float("nan")] * len(completions)


@pytest.fixture(scope="module")
def earlier(tmp_path_factory) -> Path:
    """A folder holding what an earlier run wrote: its logs and checkpoints, which no failed run may touch."""
    folder = tmp_path_factory.mktemp("earlier")
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(folder / "ckpt"), "save_last": True}}  # fmt: skip
    trainer = {"enable_checkpointing": True, "callbacks": [checkpoint], "max_steps": 1, "enable_progress_bar": False}
    (folder / "run.yaml").write_text(yaml.safe_dump({"trainer": trainer}))
    _write_logs(folder / "logs.yaml", folder / "runs")
    main(["fit", "--config", str(GRPO), "--config", str(folder / "run.yaml"), "--config", str(folder / "logs.yaml")])
    (folder / "data").mkdir()
    (folder / "data/empty.jsonl").write_text("")
    (folder / "data/bad_row.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": 2}\n{"prompt": "x",\n')
    long = [json.dumps({"prompt": f"What is {i} + 1? " * 20, "answer": i + 1}) for i in range(8)]
    (folder / "data/long.jsonl").write_text("\n".join(long) + "\n")
    (folder / "data/number.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": 2}\n{"prompt": 3, "answer": 3}\n')
    save_gsm8k(folder / "data/gsm8k", n=8)  # a DatasetDict folder with splits train and test
    hub_layout(folder / "data/gsm8k_repo", n=8)  # subsets main and socratic
    (folder / "bad.yaml").write_text("model:\n  init_args:\n    beta: [0.1\n")
    (folder / "typo.yaml").write_text("trainer:\n  max_stepz: 3\n")
    (folder / "random.ckpt").write_bytes(os.urandom(4096))
    torch.save({"state_dict": {"w": torch.zeros(256)}}, folder / "whole.ckpt")
    whole = (folder / "whole.ckpt").read_bytes()
    (folder / "truncated.ckpt").write_bytes(whole[: len(whole) // 2])  # a copy cut short
    (folder / "foreign_rm").mkdir()
    _foreign_vocabulary_reward_model(folder / "foreign_rm")
    return folder


def _write_logs(path: Path, save_dir: Path) -> None:
    """A config fragment: CSV logs under ``save_dir``, one step, no other callbacks."""
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(save_dir)}}
    trainer = {"logger": logger, "callbacks": [], "max_steps": 1, "enable_progress_bar": False}
    path.write_text(yaml.safe_dump({"trainer": trainer}))


def _foreign_vocabulary_reward_model(path: Path) -> None:
    """A tiny sequence classifier whose tokenizer has one token the policy's has not."""
    from transformers import AutoModelForSequenceClassification

    from lit_rl.models.tiny import tiny_config, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    model = AutoModelForSequenceClassification.from_config(tiny_config(vocab_size=len(tokenizer), num_labels=1))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def _error_line(capsys, args: list[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert stop.value.code == 2, err[-3000:]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


# (id, arguments after `lit-rl fit` with {d} for the earlier run's folder, what the one line must say)
CATALOGUE = [
    ("malformed yaml", ["--config", str(GRPO), "--config", "{d}/bad.yaml"],
     "--config {d}/bad.yaml: not valid YAML at line 4, column 1"),
    ("unknown key", ["--config", str(GRPO), "--model.init_args.num_generationz", "4"],
     "model.num_generationz: not an option of lit_rl.methods.RefCachedGRPO; did you mean num_generations?"),
    ("unknown key in a file", ["--config", str(GRPO), "--config", "{d}/typo.yaml"],
     "trainer.max_stepz (in {d}/typo.yaml): not an option; did you mean trainer.max_steps?"),
    ("wrong type", ["--config", str(GRPO), "--data.init_args.batch_size", "x"],
     "data.batch_size: expected int, got 'x'; give a value of type int"),
    ("not a choice", ["--config", str(GRPO), "--model.init_args.loss.loss_type", "ppo"],
     "model.loss.loss_type: 'ppo' is not one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo', 'vespo'; use one of "
     "them"),
    ("num_generations 1", ["--config", str(GRPO), "--model.init_args.num_generations", "1"],
     "model.num_generations: must be >= 2 (a group needs two completions to compare), got 1; set it to 2 or more"),
    ("batch_size 0", ["--config", str(GRPO), "--data.init_args.batch_size", "0"],
     "data.batch_size: must be >= 1, got 0; set it to 1 or more"),
    ("max_new_tokens 0", ["--config", str(GRPO), "--model.init_args.max_new_tokens", "0"],
     "model.max_new_tokens: must be >= 1, got 0; set it to 1 or more"),
    ("missing data file", ["--config", str(GRPO), "--data.init_args.source", "{d}/data/nope.jsonl"],
     "data.source: {d}/data/nope.jsonl does not exist; give a .jsonl or .parquet file, a dataset folder or hub id, "
     "or 'arithmetic'"),
    ("empty data file", ["--config", str(GRPO), "--data.init_args.source", "{d}/data/empty.jsonl"],
     "data.source: {d}/data/empty.jsonl has no rows"),
    ("malformed row", ["--config", str(GRPO), "--data.init_args.source", "{d}/data/bad_row.jsonl"],
     "data.source: {d}/data/bad_row.jsonl, row 2: not valid JSON"),
    ("prompt neither a string nor messages", ["--config", str(GRPO), "--data.init_args.source", "{d}/data/number.jsonl"],
     "data.prompt_field: {d}/data/number.jsonl, row 2: field 'prompt' holds an int ('3'), neither a string nor a list "
     'of {{"role": ..., "content": ...}} messages; fix the row or set data.prompt_field to the column that holds'),
    ("dataset field", ["--config", str(GRPO), "--data.init_args.source", "{d}/data/gsm8k"],
     "data.prompt_field: {d}/data/gsm8k (split train), row 1: no field 'prompt' (data.prompt_field); the row has "
     "['answer', 'messages', 'question', 'reward_model']; fix the row or set data.prompt_field to the column"),
    ("dataset split", ["--config", str(GRPO), "--data.init_args.source", "{d}/data/gsm8k",
                       "--data.init_args.prompt_field", "question", "--data.init_args.split", "validation"],
     "data.split: {d}/data/gsm8k has no split 'validation'; use one of train, test (data.split)"),
    ("dataset subset", ["--config", str(GRPO), "--data.init_args.source", "{d}/data/gsm8k_repo",
                        "--data.init_args.prompt_field", "question", "--data.init_args.subset", "socratics"],
     "data.subset: {d}/data/gsm8k_repo has no subset 'socratics'; use one of main, socratic (data.subset)"),
    ("prompt over the limit", ["--config", str(GRPO), "--data.init_args.source", "{d}/data/long.jsonl",
                               "--data.init_args.batch_size", "1", "--data.init_args.max_prompt_length", "64",
                               "--data.init_args.truncation", "error"],
     "data.max_prompt_length: the prompt of dataset row "),
    ("reward raises", ["--config", str(GRPO), "--model.init_args.reward_funcs", "[test_errors.raises]"],
     "model.reward_funcs: reward function raises raised ZeroDivisionError: bad reward (first sample: prompt="),
    ("reward count", ["--config", str(GRPO), "--model.init_args.reward_funcs", "[test_errors.too_few]"],
     "model.reward_funcs: reward function too_few returned 1 values for "),
    ("reward nan", ["--config", str(GRPO), "--model.init_args.reward_funcs", "[test_errors.nan]"],
     "model.reward_funcs: reward function nan returned nan for sample 0"),
    ("reward path", ["--config", str(GRPO), "--model.init_args.reward_funcs", "[no.such.fn]"],
     "model.reward_funcs[0]: cannot import 'no.such.fn'"),
    ("model path", ["--config", str(GRPO), "--model.init_args.name_or_path", "{d}/no_model"],
     "model.name_or_path: {d}/no_model does not exist; give an existing folder"),
    ("gumbel_topk 0", ["--config", str(GUMBEL), "--model.init_args.gumbel_topk", "0"],
     "model.gumbel_topk: must be >= 1, got 0 (0, the full-vocabulary path, is a benchmark baseline now: "
     "bench/gumbel_legacy.py); set the tokens kept per soft token, e.g. 256"),
    ("reward model vocabulary", ["--config", str(GUMBEL), "--model.init_args.reward_model", "{d}/foreign_rm"],
     "tokens; 1 token->id pairs differ): the soft tokens are policy ids; use a reward model trained on"),
    ("ckpt_path", ["--config", str(GRPO), "--ckpt_path", "{d}/ckpt/nope.ckpt"],
     "ckpt_path: {d}/ckpt/nope.ckpt does not exist; give a checkpoint file, or `last`"),
    ("corrupt ckpt_path", ["--config", str(GRPO), "--ckpt_path", "{d}/random.ckpt"],
     "ckpt_path: {d}/random.ckpt is not a readable checkpoint (truncated, or not written by torch.save); give a .ckpt"),
    ("truncated ckpt_path", ["--config", str(GRPO), "--ckpt_path", "{d}/truncated.ckpt"],
     "ckpt_path: {d}/truncated.ckpt is not a readable checkpoint"),
    ("lora rank 0", ["--config", str(GRPO), "--model.init_args.lora.r", "0"],
     "model.lora.r: must be >= 1, got 0; set the adapter rank to 1 or more"),
    ("lora dropout", ["--config", str(GRPO), "--model.init_args.lora.dropout", "1.5"],
     "model.lora.dropout: must be in [0, 1), got 1.5; use 0 to switch it off"),
    ("loss option outside its group", ["--config", str(GRPO), "--model.init_args.beta", "0"],
     "model.beta: not an option of lit_rl.methods.RefCachedGRPO; did you mean loss.beta?"),
    ("loss delta", ["--config", str(GRPO), "--model.init_args.loss.delta", "0.5"],
     "model.loss.delta: must be > 1 (a cap on the ratio, above 1 + epsilon_high), got 0.5; INTELLECT-2 uses 4.0"),
    ("cispo cap", ["--config", str(GRPO), "--model.init_args.loss.loss_type", "cispo"],
     "model.loss.epsilon_high: 0.2 under loss_type cispo caps the importance weight itself"),
    ("unknown trainer option", ["--config", str(GRPO), "--trainer.max_stepz", "3"],
     "trainer.max_stepz: not an option; did you mean trainer.max_steps?"),
    ("class path", ["--config", str(GRPO), "--model", "no.such.Method"],
     "model.class_path: cannot import 'no.such.Method'; give an importable class, e.g. lit_rl.methods.RefCachedGRPO"),
    ("missing config", ["--config", "{d}/nope.yaml"], "--config: '{d}/nope.yaml' does not exist"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "said"), [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE])
def test_a_mistake_is_one_line_and_leaves_earlier_runs_intact(earlier, capsys, args, said):
    before = _snapshot(earlier)
    d = str(earlier)
    line = _error_line(capsys, ["fit", *[a.format(d=d) for a in args], "--config", f"{d}/logs.yaml"])
    assert said.format(d=d) in line, line
    after = _snapshot(earlier)
    assert {k: after[k] for k in before} == before, "a failed run changed what an earlier run wrote"


def test_a_stale_density_cache_names_the_command_that_rebuilds_it(tmp_path, capsys):
    data = ["--data.init_args.sampler", "density", "--data.init_args.density_cache_dir", str(tmp_path / "emb"),
            "--data.init_args.density_k", "3", "--data.init_args.num_prompts", "24"]  # fmt: skip
    main(["embed", "--config", str(GRPO), *data])
    before = _snapshot(tmp_path)
    _write_logs(tmp_path / "logs.yaml", tmp_path / "runs")
    line = _error_line(capsys, ["fit", "--config", str(GRPO), *data, "--data.init_args.difficulty", "3",
                                "--config", str(tmp_path / "logs.yaml")])  # fmt: skip
    assert line.startswith(f"error: data.density_cache_dir: the embedding cache {tmp_path / 'emb'}/embeddings.npy")
    assert "was built for other prompts or settings (" in line and "; rebuild it with: " in line
    assert {k: v for k, v in _snapshot(tmp_path).items() if k in before} == before


def test_an_unknown_command_is_named(capsys):
    assert _error_line(capsys, ["fitt"]) == (
        "error: fitt: not a command of lit-rl; did you mean fit? use one of fit, validate, test, predict, estimate, embed, "
        "reward-model, export, rates"
    )


@pytest.mark.slow  # three CLI subprocesses
def test_the_console_script_prints_one_line_and_the_traceback_only_in_debug_mode():
    args = [sys.executable, "-m", "lit_rl", "fit", "--config", str(GRPO), "--model.init_args.num_generations", "1"]
    env = {k: v for k, v in os.environ.items() if k != "LIT_RL_DEBUG"}
    plain = subprocess.run(args, capture_output=True, text=True, env=env)
    assert plain.returncode == 2
    assert plain.stderr.strip().splitlines()[-1].startswith("error: model.num_generations: must be >= 2")
    assert "Traceback" not in plain.stderr and "Union subtypes" not in plain.stderr
    debug = subprocess.run(args, capture_output=True, text=True, env={**env, "LIT_RL_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "must be >= 2" in debug.stderr
    flag = subprocess.run([*args, "--debug"], capture_output=True, text=True, env=env)
    assert flag.returncode == 1 and "Traceback" in flag.stderr


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    """An error that no setting explains (here a failing operation inside the step) is not hidden in one line."""
    from lit_rl.methods import RefCachedGRPO

    def broken(self, batch):
        return {}["no such key"]

    monkeypatch.setattr(RefCachedGRPO, "train_step", broken)
    with pytest.raises(KeyError, match="no such key"):
        main(["fit", "--config", str(GRPO), "--trainer.max_steps", "1", "--trainer.logger", "false",
              "--trainer.callbacks", "[]", "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip


def test_a_parse_error_in_wording_lit_rl_cannot_read_is_passed_on_whole_on_one_line():
    import argparse

    from lit_rl.cli_errors import explain_error

    said = explain_error(argparse.ArgumentError(None, "Something new went wrong:\n  with the value 'x'\n  of a field"))
    assert said.startswith("arguments: Something new went wrong: with the value 'x' of a field; ")
    assert "\n" not in said
