"""PromptDataModule: batch shapes, left padding, truncation, file sources and their errors."""

from __future__ import annotations

import json

import pytest
import torch

from lit_rl.data import PromptDataModule
from lit_rl.data.rewards import correct_answer, number_only, resolve_reward_fn, score
from lit_rl.data.tasks import arithmetic_prompts
from lit_rl.models.tiny import tiny_tokenizer


def _module(**kw) -> PromptDataModule:
    dm = PromptDataModule(**kw)
    dm.connect(tiny_tokenizer())
    dm.setup("fit")
    return dm


def test_arithmetic_is_seeded_and_correct():
    a = arithmetic_prompts(50, difficulty=4, seed=3)
    assert a == arithmetic_prompts(50, difficulty=4, seed=3)
    assert a != arithmetic_prompts(50, difficulty=4, seed=4)
    for r in a:
        x, op, y = r["prompt"].removeprefix("What is ").removesuffix("?").split()
        assert eval(f"{x}{op}{y}") == r["answer"] and r["answer"] >= 0
    with pytest.raises(ValueError, match="data.difficulty"):
        arithmetic_prompts(5, difficulty=9)


def test_batches_are_left_padded_with_answers():
    dm = _module(num_prompts=16, batch_size=4, difficulty=3)
    batch = next(iter(dm.train_dataloader()))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape and ids.shape[0] == 4 and ids.dtype == torch.long
    pad = dm.tokenizer.pad_token_id
    assert torch.all(mask[:, -1] == 1), "left padding: every row ends with a real token"
    assert torch.all(ids[mask == 0] == pad)
    for row, prompt in zip(ids, batch["prompts"]):
        real = row[row != pad].tolist()
        assert dm.tokenizer.decode(real) == prompt
        assert prompt.endswith("<|im_start|>assistant\n") and "Answer with just the number." in prompt
    records = dm.prepare_records()
    assert batch["answers"] == [records[i]["answer"] for i in batch["index"].tolist()]
    assert batch["num_truncated"] == 0


def test_truncation_from_the_left_is_counted_or_rejected():
    dm = _module(num_prompts=8, batch_size=4, max_prompt_length=20)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[1] == 20 and batch["num_truncated"] == 4
    assert batch["prompts"][0].endswith(dm.tokenizer.decode(batch["input_ids"][0][-5:].tolist()))
    dm = _module(num_prompts=8, batch_size=4, max_prompt_length=20, truncation="error")
    with pytest.raises(ValueError, match=r"dataset row \d+ has \d+ tokens > data.max_prompt_length=20"):
        next(iter(dm.train_dataloader()))


def test_uniform_stream_is_reproducible():
    first = [b["index"].tolist() for _, b in zip(range(3), _module(num_prompts=40, seed=1).train_dataloader())]
    again = [b["index"].tolist() for _, b in zip(range(3), _module(num_prompts=40, seed=1).train_dataloader())]
    other = [b["index"].tolist() for _, b in zip(range(3), _module(num_prompts=40, seed=2).train_dataloader())]
    assert first == again and first != other


def test_jsonl_source_and_custom_fields(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"Say {i}", "a": i}) for i in range(6)))
    dm = _module(source=str(path), prompt_field="q", answer_field="a", batch_size=3, instruction=None)
    batch = next(iter(dm.train_dataloader()))
    assert len(batch["prompts"]) == 3 and all("Say" in p for p in batch["prompts"])


def test_parquet_source(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is the optional Parquet reader")
    import pyarrow as pa

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [1, 2]}), path)
    dm = _module(source=str(path), batch_size=2)
    assert len(next(iter(dm.train_dataloader()))["answers"]) == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "has no rows"),
        ('{"prompt": "x", "answer": 1}\n{"prompt": "y"}\n', r"row 2: no field 'answer' \(data.answer_field\)"),
        ('{"question": "x", "answer": 1}\n', r"row 1: no field 'prompt' \(data.prompt_field\)"),
        ('{"prompt": "x", "answer": 1}\nnot json\n', "row 2: not valid JSON"),
    ],
)
def test_bad_files_name_file_row_and_field(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        _module(source=str(path))
    assert str(path) in str(err.value)


def test_missing_file_and_missing_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.source: .*nope.jsonl does not exist"):
        _module(source=str(tmp_path / "nope.jsonl"))
    dm = PromptDataModule(num_prompts=4, batch_size=2)
    dm.setup("fit")
    with pytest.raises(Exception, match=r"datamodule.connect\(tokenizer\)"):
        next(iter(dm.train_dataloader()))


def test_reward_functions():
    assert correct_answer(["The answer is 12.", "12 + 3 = 15", "no", "-4"], [12, 12, 3, -4]) == [1.0, 0.0, 0.0, 1.0]
    assert number_only([" 42.", "It is 42", "7"]) == [1.0, 0.0, 1.0]
    assert resolve_reward_fn("lit_rl.data.rewards:correct_answer") is correct_answer
    for bad in ("nope", "lit_rl.data.rewards.nope", "no_such_pkg.fn", "lit_rl.data.rewards.math"):
        with pytest.raises(ValueError, match="reward_funcs"):
            resolve_reward_fn(bad)


def test_reward_outputs_are_checked():
    c, a, p = ["1", "2"], [1, 2], ["p1", "p2"]
    assert score(correct_answer, "correct_answer", c, a, p).tolist() == [1.0, 1.0]

    def boom(completions, **_):
        raise KeyError("answer")

    with pytest.raises(RuntimeError, match=r"reward function boom raised KeyError.*prompt='p1'"):
        score(boom, "boom", c, a, p)
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        score(lambda completions, **_: [1.0], "short", c, a, p)
    with pytest.raises(ValueError, match=r"returned nan for sample 1 \(prompt='p2'"):
        score(lambda completions, **_: [1.0, float("nan")], "nan", c, a, p)


def test_resumed_run_continues_the_same_prompt_stream(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lit_rl.losses import LossSettings
    from lit_rl.methods import RefCachedGRPO

    class Seen(Callback):
        def __init__(self):
            self.indices = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.indices.append(batch["index"].tolist())

    def run(steps, ckpt=None, save=False):
        seen = Seen()
        every_two = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
        callbacks = [seen] + ([every_two] if save else [])
        trainer = L.Trainer(
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            enable_checkpointing=save,
            default_root_dir=tmp_path,
        )
        method = RefCachedGRPO(
            name_or_path="tiny:llama", num_generations=2, max_new_tokens=3, loss=LossSettings(beta=0.0)
        )
        trainer.fit(method, PromptDataModule(num_prompts=40, batch_size=2, sampler="uniform"), ckpt_path=ckpt)
        return seen.indices

    straight = run(6, save=True)  # checkpoints mid-epoch at steps 2, 4, 6
    resumed = run(6, ckpt=str(tmp_path / "step=2.ckpt"))
    assert resumed == straight[2:]
