"""Hugging Face datasets as data.source (saved folders, a hub id resolved offline from a cache built here, a hub
repository's layout), message-list prompts, nested answer fields, and their one-line errors. Nothing is downloaded."""

from __future__ import annotations

import builtins
import json

import pytest

pytest.importorskip("datasets", reason="data.source as a Hugging Face dataset needs `pip install 'lit-rl[datasets]'`")

from gsm8k_data import cache_as_hub_id, gsm8k_rows, hub_layout, save_gsm8k  # noqa: E402

from lit_rl.data import PromptDataModule  # noqa: E402
from lit_rl.data.rows import field_value  # noqa: E402
from lit_rl.models.tiny import tiny_tokenizer  # noqa: E402


def _module(tokenizer=None, **kw) -> PromptDataModule:
    dm = PromptDataModule(**{"instruction": None, **kw})
    dm.setup("fit")
    dm.connect(tokenizer or tiny_tokenizer())
    return dm


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_gsm8k(tmp_path_factory.mktemp("gsm8k") / "saved", n=12)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """``someone/gsm8k`` in a datasets cache built from a local repository layout, read with the hub switched off."""
    import datasets

    cache = tmp_path / "cache"
    cache_as_hub_id(hub_layout(tmp_path / "gsm8k"), "someone/gsm8k", cache)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return "someone/gsm8k"


def test_a_saved_dataset_dict_trains_on_its_split_with_gsm8k_fields(saved):
    dm = _module(source=str(saved), prompt_field="question", answer_field="answer", batch_size=4)
    assert len(dm.records) == 12 and dm.records[0]["prompt"] == gsm8k_rows(12)[0]["question"]
    batch = next(iter(dm.train_dataloader()))
    assert all(p.endswith("<|im_start|>assistant\n") for p in batch["prompts"])
    assert all("####" in a for a in batch["answers"])
    test = _module(source=str(saved), split="test", prompt_field="question", max_rows=5, subset="main")  # not read
    assert [r["prompt"] for r in test.records] == [r["question"] for r in gsm8k_rows(5, seed=1)]


def test_a_saved_dataset_and_a_val_split(saved, tmp_path):
    one = save_gsm8k(tmp_path / "one", n=6, splits=None)  # one Dataset: no splits, data.split is not read
    assert len(_module(source=str(one), prompt_field="question").records) == 6
    dm = _module(source=str(saved), prompt_field="question", val_source=str(saved), val_split="test")
    assert dm.held_out_records()[0]["prompt"] == gsm8k_rows(1, seed=1)[0]["question"]


def test_a_nested_answer_field(saved):
    dm = _module(source=str(saved), prompt_field="question", answer_field="reward_model.ground_truth")
    assert [r["answer"] for r in dm.records[:3]] == [r["reward_model"]["ground_truth"] for r in gsm8k_rows(3)]
    assert field_value({"a.b": 1, "a": {"b": 2}}, "a.b") == 1, "a column named with a dot comes first"
    assert field_value({"a": {"b": None}}, "a.b.c") is None


def test_message_list_prompts_go_through_the_chat_template_as_they_are(saved):
    dm = _module(source=str(saved), prompt_field="messages", batch_size=2, val_size=2)
    rows = gsm8k_rows(12)
    tok = dm.tokenizer
    expected = tok.apply_chat_template(rows[0]["messages"], add_generation_prompt=True, tokenize=False)
    assert dm.format_prompt(rows[0]["messages"]) == expected
    assert expected.startswith("<|im_start|>system\nReason step by step") and expected.endswith("assistant\n")
    batch = next(iter(dm.train_dataloader()))
    assert all(p.startswith("<|im_start|>system") for p in batch["prompts"])
    assert len(dm.held_out_records()) == 2 and not isinstance(dm.held_out_records()[0]["prompt"], str)


def test_a_plain_string_prompt_is_formatted_as_before():
    dm = _module(num_prompts=4, instruction="Answer with just the number.", system_prompt="Be brief.")
    text = dm.format_prompt("What is 1 + 2?")
    assert text == dm.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 1 + 2? Answer with just the number."},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )


def test_message_lists_need_a_chat_template(saved):
    bare = tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="^data.prompt_field: the prompts are message lists, but the tokenizer has no"):
        _module(bare, source=str(saved), prompt_field="messages")
    with pytest.raises(ValueError, match="^data.chat_template: false, but the prompts are message lists"):
        _module(source=str(saved), prompt_field="messages", chat_template=False)


def test_density_sampling_embeds_the_rendered_conversation(saved, tmp_path):
    import torch

    from lit_rl.models.tiny import tiny_model

    model = tiny_model("llama")
    dm = PromptDataModule(source=str(saved), prompt_field="messages", sampler="density", density_k=3,
                          density_cache_dir=str(tmp_path / "emb"), instruction=None)  # fmt: skip
    dm.setup("fit")
    dm.connect(tiny_tokenizer(), embed_model=lambda: model, model_id="tiny")
    weights = dm.build_density_cache()
    assert weights.shape == (12,) and abs(weights.sum() - 1) < 1e-6 and torch.isfinite(torch.as_tensor(weights)).all()
    assert list((tmp_path / "emb").iterdir()), "the embeddings of the rendered conversations are cached"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"prompt_field": "query"}, r"^data.prompt_field: .*saved \(split train\), row 1: no field 'query' "),
        ({"prompt_field": "query", "answer_field": "solution"},
         r"^data.prompt_field: .*row 1: no field 'query' .*the row has \['answer', 'messages', 'question', 'reward_model'\]"),
        ({"prompt_field": "question", "answer_field": "reward_model.truth"},
         r"^data.answer_field: .*, row 1: no field 'reward_model.truth' \(data.answer_field\); the row has "),
        ({"prompt_field": "question", "split": "validation"},
         r"^data.split: .*saved has no split 'validation'; use one of train, test \(data.split\)$"),
        ({"prompt_field": "reward_model"},
         r"^data.prompt_field: .*row 1: field 'reward_model' holds a dict .*, neither a string nor a list of "),
    ],
)  # fmt: skip
def test_a_bad_saved_dataset_is_one_line(saved, kw, message):
    with pytest.raises(ValueError, match=message) as err:
        _module(source=str(saved), **kw)
    assert "\n" not in str(err.value)


def test_a_row_whose_prompt_is_not_a_conversation_is_named(tmp_path):
    from datasets import Dataset

    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"},
        {"prompt": [{"role": "user"}], "answer": "2"},
    ]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"row 2: field 'prompt' holds a list whose item .* is not a message"):
        _module(source=str(tmp_path / "d"))
    (tmp_path / "n.jsonl").write_text(json.dumps({"prompt": 7, "answer": 7}) + "\n")
    with pytest.raises(ValueError, match=r"n.jsonl, row 1: field 'prompt' holds an int \('7'\), neither a string nor"):
        _module(source=str(tmp_path / "n.jsonl"))


def test_a_hub_id_reads_its_subset_and_split_from_the_cache_offline(offline_hub):
    dm = _module(source=offline_hub, subset="main", split="test", prompt_field="question", answer_field="answer")
    assert [r["prompt"] for r in dm.records] == [r["question"] for r in gsm8k_rows(16, seed=1)]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"subset": "main", "split": "validation"},
         "data.split: someone/gsm8k (main) has no split 'validation'; use one of train, test (data.split)"),
        ({"subset": "socratics"}, "data.subset: someone/gsm8k has no subset 'socratics'; use one of main (data.subset)"),
    ],
)  # fmt: skip
def test_a_wrong_split_or_subset_of_a_hub_id_lists_the_available_ones(offline_hub, kw, message):
    with pytest.raises(ValueError) as err:
        _module(source=offline_hub, prompt_field="question", **kw)
    assert str(err.value) == message


def test_a_hub_id_neither_cached_nor_reachable(offline_hub):
    with pytest.raises(FileNotFoundError, match=r"^data.source: someone/elsewhere is not a local file or folder, and not "
                       r"in the datasets cache, and offline mode is on"):  # fmt: skip
        _module(source="someone/elsewhere", prompt_field="question")


def test_a_hub_layout_folder_lists_its_subsets_and_streams_when_large(tmp_path, monkeypatch):
    import datasets

    import lit_rl.data.hub as hub

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    repo = hub_layout(tmp_path / "gsm8k", n=16)
    with pytest.raises(ValueError, match=r"^data.subset: .*gsm8k has several subsets; use one of main, socratic"):
        _module(source=str(repo), prompt_field="question")
    monkeypatch.setattr(hub, "STREAM_OVER_BYTES", 4000 * 16 - 1)  # the README says the split is larger
    calls = []
    monkeypatch.setattr(
        "datasets.builder.DatasetBuilder.download_and_prepare", lambda *a, **k: calls.append("download")
    )
    dm = _module(source=str(repo), subset="main", prompt_field="question", max_rows=5)
    assert len(dm.records) == 5 and calls == [], "a large split is streamed, never downloaded whole"
    monkeypatch.undo()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    dm = _module(source=str(repo), subset="main", prompt_field="question", streaming=False)
    assert len(dm.records) == 16


def test_without_datasets_installed_the_line_names_the_extra(saved, monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets" or name.startswith("datasets."):
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(
        ImportError, match=r"^data.source: .*needs the datasets library; `pip install 'lit-rl\[datasets\]'`"
    ):
        _module(source=str(saved))


@pytest.mark.slow  # two whole fits of the tiny model
@pytest.mark.parametrize("prompt_field", ["question", "messages"])
def test_the_gsm8k_config_trains_on_a_saved_dataset_and_scores_held_out_problems(saved, tmp_path, prompt_field):
    from pathlib import Path

    from lit_rl.cli import LitRLCLI

    config = Path(__file__).resolve().parents[1] / "configs/grpo_gsm8k.yaml"
    cli = LitRLCLI(args=[
        "fit", "--config", str(config), "--data.init_args.source", str(saved),
        "--data.init_args.prompt_field", prompt_field, "--data.init_args.val_size", "3",
        *(["--data.init_args.instruction", "null"] if prompt_field == "messages" else []),
        "--model.init_args.name_or_path", "tiny:llama", "--model.init_args.max_new_tokens", "6",
        "--model.init_args.num_generations", "2", "--trainer.accelerator", "cpu", "--trainer.max_steps", "2",
        "--trainer.val_check_interval", "2",  # the config's ModelCheckpoint saves into tmp_path
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
    ])  # fmt: skip
    assert cli.trainer.global_step == 2
    assert "val/gsm8k_answer" in cli.trainer.callback_metrics, sorted(cli.trainer.callback_metrics)
    held = cli.datamodule.held_out_records()
    assert len(held) == 3 and isinstance(held[0]["prompt"], str) == (prompt_field == "question")
