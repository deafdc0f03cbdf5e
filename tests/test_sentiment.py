"""The sentiment task: openings and their held-out split, the two lexicons, the shipped reward-model head, the judge
in ``val/`` and the degeneration signal."""

from __future__ import annotations

import json
import random

import pytest
import torch

from lit_rl.data import PromptDataModule
from lit_rl.data.sentiment import (
    afinn_positive,
    afinn_score,
    is_heldout,
    review_openings,
    vader_compound,
    vader_positive,
)
from lit_rl.methods import GumbelTopK, RefCachedGRPO
from lit_rl.methods.evaluation import distinct_bigrams

JUDGES = ["lit_rl.data.sentiment.vader_positive", "lit_rl.data.sentiment.afinn_positive"]


def test_openings_are_a_few_thousand_distinct_texts_of_every_tone_and_the_split_leaks_nothing():
    train, held = review_openings(split="train"), review_openings(split="heldout")
    every = review_openings(split="all")
    assert 2000 <= len(every) == len({r["prompt"] for r in every}) <= 10000
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}, "no held-out opening is trained on"
    assert len(train) + len(held) == len(every) and 0.1 < len(held) / len(every) < 0.3
    assert {r["answer"] for r in train} == {r["answer"] for r in held} == {"positive", "negative", "neutral"}
    assert all(is_heldout(r["prompt"]) for r in held) and not any(is_heldout(r["prompt"]) for r in train)
    assert review_openings(50, seed=3) == review_openings(50, seed=3) != review_openings(50, seed=4)
    with pytest.raises(ValueError, match="the heldout split has"):
        review_openings(len(held) + 1, split="heldout")


def test_the_datamodule_trains_on_no_held_out_opening_and_continues_them_as_text():
    from lit_rl.models.tiny import tiny_tokenizer

    data = PromptDataModule(source="reviews", num_prompts=3000, val_size=40, instruction=None, chat_template=False)
    data.connect(tiny_tokenizer())
    train, held = data.prepare_records(), data.held_out_records()
    assert len(train) == 3000 and len(held) == 40
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    opening = held[0]["prompt"]
    assert data.format_prompt(opening) == opening, "no template, instruction or newline around the opening"


def test_the_lexicons_read_the_sentiment_of_plain_sentences():
    good, bad, flat = "a wonderful, moving film with great acting", "a boring, terrible waste of time", "it is a film"
    assert vader_positive([good, bad, flat]) == [1.0, 0.0, 0.0]
    assert afinn_positive([good, bad, flat]) == [1.0, 0.0, 0.0]
    compound = vader_compound([good, bad, flat])
    assert compound[0] > 0.5 and compound[1] < -0.5 and compound[2] == 0.0
    assert afinn_score(["good good", "good good good good"]) == afinn_score(["good", "good good"]), "per word"


def test_distinct_bigrams_is_the_share_of_distinct_token_pairs():
    gen = random.Random(0)
    ids = torch.tensor([[gen.randrange(6) for _ in range(9)] for _ in range(7)])  # [7, 9], small vocabulary: repeats
    lengths = torch.tensor([9, 5, 2, 1, 0, 9, 7])
    got = distinct_bigrams(ids, lengths)
    for row, n, value in zip(ids.tolist(), lengths.tolist(), got.tolist()):
        pairs = [(row[i], row[i + 1]) for i in range(n - 1)]
        expected = len(set(pairs)) / len(pairs) if pairs else 1.0
        assert value == pytest.approx(expected)
    assert distinct_bigrams(torch.tensor([[3, 4, 3, 4, 3, 4]]), torch.tensor([6])).item() == pytest.approx(2 / 5)


def test_the_judges_and_the_degeneration_signal_reach_val_and_the_completions_file(
    capture_logger, quiet_trainer, tmp_path
):
    method = RefCachedGRPO(
        name_or_path="tiny:llama", num_generations=2, max_new_tokens=4,
        reward_funcs=["lit_rl.data.sentiment.vader_compound"], metric_funcs=JUDGES,
    )  # fmt: skip
    data = PromptDataModule(
        source="reviews", num_prompts=32, batch_size=2, val_size=4, instruction=None, chat_template=False
    )
    trainer = quiet_trainer(max_steps=2, val_check_interval=2, check_val_every_n_epoch=None, logger=capture_logger)
    trainer.fit(method, data)
    logged = capture_logger.metrics
    for key in ("val/vader_positive", "val/afinn_positive", "val/vader_compound", "val/completions/distinct_bigrams"):
        assert len(logged[key]) == 2, f"{key}: before the first step and after step 2"
    assert all(0 <= v <= 1 for _, v in logged["completions/distinct_bigrams"])
    files = sorted(p.name for p in (tmp_path / "heldout").iterdir())
    assert files == ["val_step000000.jsonl", "val_step000002.jsonl"]
    rows = [json.loads(line) for line in (tmp_path / "heldout" / files[-1]).read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in data.held_out_records()]
    for row in rows:  # each completion with the scores the logged means were made of
        assert row["afinn_positive"] == afinn_positive([row["completion"]])[0]
        assert row["vader_positive"] == vader_positive([row["completion"]])[0]
    mean = sum(r["afinn_positive"] for r in rows) / len(rows)
    assert logged["val/afinn_positive"][-1][1] == pytest.approx(mean)


def test_gumbel_topk_logs_the_judges_on_the_sentiment_task(capture_logger, quiet_trainer):
    method = GumbelTopK(
        name_or_path="tiny:llama", reward_model="tiny:llama", max_new_tokens=3, gumbel_topk=4, metric_funcs=JUDGES
    )
    data = PromptDataModule(source="reviews", num_prompts=16, batch_size=2, val_size=2, instruction=None)
    trainer = quiet_trainer(max_steps=1, logger=capture_logger)
    trainer.fit(method, data)
    assert {"metric/afinn_positive/mean", "val/afinn_positive", "completions/distinct_bigrams"} <= set(
        capture_logger.metrics
    )


# ---------------------------------------------------------------- the shipped head on the embedded model
@pytest.fixture(scope="module")
def embedded_reward_model():
    from lit_rl.models import embedded_gguf_path, load_reward_model, load_tokenizer
    from lit_rl.reward_model.train import shipped_head_file

    try:
        embedded_gguf_path()
    except FileNotFoundError as err:  # the README's test command installs it; a bare checkout may not have it
        pytest.skip(str(err))

    tokenizer = load_tokenizer("embedded")
    return load_reward_model("embedded", policy_tokenizer=tokenizer, head_file=shipped_head_file()), tokenizer


def test_the_shipped_head_scores_a_positive_continuation_above_a_negative_one(embedded_reward_model):
    from lit_rl.reward_model.train import score_soft_sparse

    model, tokenizer = embedded_reward_model
    opening = "I watched this film last night, and the acting"
    continuations = (
        " was wonderful. I loved every minute of it and would happily see it again.",
        " was awful. I hated every minute of it and it was a boring waste of time.",
    )
    prompt = tokenizer(opening, add_special_tokens=False)["input_ids"]
    groups = [(prompt, [tokenizer(c, add_special_tokens=False)["input_ids"] for c in continuations])]
    good, bad = score_soft_sparse(model, groups, pad_id=tokenizer.pad_token_id).tolist()
    assert good > bad + 1 and good > 0, (good, bad)  # ranked apart by a clear margin; calibration is in its metrics


def test_the_shipped_heads_metrics_are_the_ones_its_fit_wrote():
    from lit_rl.reward_model.train import META_FILE, SHIPPED_HEAD_DIR

    meta = json.loads((SHIPPED_HEAD_DIR / META_FILE).read_text())
    assert meta["base"] == "embedded" and meta["hidden_size"] == 576
    agreement = meta["heldout"]["agreement"]
    assert agreement["n"] == meta["settings"]["num_heldout_prompts"] * meta["settings"]["per_prompt"]
    assert 0 <= agreement["accuracy"] <= 1 and 0 <= agreement["auc"] <= 1


def test_a_head_of_another_shape_is_refused_in_one_line(tmp_path):
    from safetensors.torch import save_file

    from lit_rl.models import load_reward_model
    from lit_rl.models.tiny import tiny_tokenizer

    save_file({"score.weight": torch.zeros(1, 7)}, tmp_path / "head.safetensors")
    with pytest.raises(ValueError, match=r"holds a weight of shape \(1, 7\), the model's head is \(1, 32\)"):
        load_reward_model("tiny:llama", policy_tokenizer=tiny_tokenizer(), head_file=str(tmp_path / "head.safetensors"))
    save_file({"score.weight": torch.zeros(1, 32)}, tmp_path / "max.safetensors", metadata={"pooling": "max"})
    with pytest.raises(ValueError, match=r"pooling 'max' is not one of last, mean, sum; refit the head"):
        load_reward_model("tiny:llama", policy_tokenizer=tiny_tokenizer(), head_file=str(tmp_path / "max.safetensors"))
    deep = tmp_path / "deep.safetensors"
    save_file({"score.weight": torch.zeros(1, 32)}, deep, metadata={"pooling": "sum", "layers": "9"})
    with pytest.raises(ValueError, match=r"after decoder layer 9, and the trunk \(LlamaModel\) has 2 decoder layers"):
        load_reward_model("tiny:llama", policy_tokenizer=tiny_tokenizer(), head_file=str(deep))
    save_file({"score.weight": torch.zeros(1, 32)}, deep, metadata={"layers": "first"})
    with pytest.raises(ValueError, match=r"layers 'first' is not a positive integer; refit the head"):
        load_reward_model("tiny:llama", policy_tokenizer=tiny_tokenizer(), head_file=str(deep))
