"""Reward models read soft tokens as a sparse gather; the built-in sentiment reward model trains on tiny models."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

from lit_rl.models import forward_soft_sparse, load_reward_model
from lit_rl.models.tiny import tiny_config, tiny_tokenizer


def _save_classifier(folder, *, num_labels=1, seed=0):
    """A tiny Llama sequence classifier and its tokenizer, saved as a real checkpoint folder."""
    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    config = tiny_config("llama", vocab_size=len(tok), num_labels=num_labels)
    config.pad_token_id = tok.pad_token_id
    model = LlamaForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # a visible score, not one near 0
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok


def _left_padded_prompts(lengths, vocab, pad, generator):
    """``[B, P]`` prompt ids left-padded with ``pad`` and their mask; no prompt token is ``pad``."""
    P = max(lengths)
    ids = torch.full((len(lengths), P), pad, dtype=torch.long)  # [B, P]
    mask = torch.zeros(len(lengths), P, dtype=torch.long)  # [B, P]
    for row, n in enumerate(lengths):
        ids[row, P - n :] = torch.randint(3, vocab, (n,), generator=generator)
        mask[row, P - n :] = 1
    return ids, mask


@pytest.fixture
def reward_folder(tmp_path):
    tok = _save_classifier(tmp_path / "rm")
    return tmp_path / "rm", tok


def _float64_model_and_prompts(reward_folder, lengths: list[int], seed: int):
    """The saved reward model in float64, its vocabulary size, a seeded generator and left-padded prompts."""
    folder, tok = reward_folder
    model = load_reward_model(str(folder), policy_tokenizer=tok).double()
    V = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(seed)
    input_ids, prompt_mask = _left_padded_prompts(lengths, V, tok.pad_token_id, g)  # [B, P]
    return model, V, g, input_ids, prompt_mask


def test_sparse_equals_dense_value_and_gradient_float64(reward_folder):
    B, C, k = 3, 5, 3
    model, V, g, input_ids, prompt_mask = _float64_model_and_prompts(reward_folder, [7, 4, 2], seed=1)
    completion_mask = torch.ones(B, C, dtype=torch.long)  # [B, C]
    completion_mask[1, 3:] = 0  # a completion that ended early
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [B, P + C]
    soft_indices = torch.stack([torch.randperm(V - 3, generator=g)[:k] + 3 for _ in range(B * C)]).view(B, C, k)
    logits = torch.randn(B, C, k, generator=g, dtype=torch.float64)  # [B, C, k]
    weights = logits.softmax(-1).requires_grad_(True)  # [B, C, k]

    sparse = forward_soft_sparse(model, input_ids, soft_indices, weights, attention_mask)  # [B]
    (grad_sparse,) = torch.autograd.grad((sparse * torch.tensor([1.0, -2.0, 0.5])).sum(), weights)

    # dense reference: [B, C, V] weights @ [V, H], each row alone without padding, the model's own forward
    dense_w = torch.zeros(B, C, V, dtype=torch.float64).scatter(-1, soft_indices, weights.detach())  # [B, C, V]
    dense_w.requires_grad_(True)
    E = model.get_input_embeddings().weight  # [V, H]
    embeds = torch.cat([E[input_ids], dense_w @ E], dim=1)  # [B, P + C, H]
    dense = torch.stack(
        [model(inputs_embeds=embeds[b, attention_mask[b].bool()][None]).logits[0, 0] for b in range(B)]
    )  # [B]
    (grad_dense,) = torch.autograd.grad((dense * torch.tensor([1.0, -2.0, 0.5])).sum(), dense_w)

    torch.testing.assert_close(sparse.double(), dense, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_sparse, grad_dense.gather(-1, soft_indices), rtol=1e-9, atol=1e-12)
    assert grad_sparse.abs().sum() > 0
    assert grad_sparse[1, 3:].abs().max() == 0  # masked positions after the end do not reach the score


@pytest.mark.parametrize("mode, layers", [("mean", None), ("sum", None), ("sum", 1), ("mean", 2)])
def test_pooled_sparse_score_equals_a_plain_pool_of_the_head_value_and_gradient_float64(
    reward_folder, tmp_path, mode, layers
):
    """A head file that pools over the completion (mean or sum), reading the last layer or an earlier one (``layers``
    of the tiny trunk's 2: the trunk keeps those, then its final norm), against the full model's own hidden state
    after that layer, normed, the head applied per token and pooled, each row alone."""
    from safetensors.torch import save_file

    from lit_rl.models.reward import pooling

    folder, tok = reward_folder
    head = torch.randn(1, 32, generator=torch.Generator().manual_seed(3))  # [1, H]
    meta = {"pooling": mode, **({} if layers is None else {"layers": str(layers)})}
    save_file({"score.weight": head}, tmp_path / "head.safetensors", metadata=meta)
    model = load_reward_model(str(folder), policy_tokenizer=tok, head_file=str(tmp_path / "head.safetensors"))
    assert pooling(model) == mode and torch.equal(model.score.weight, head)
    assert len(model.model.layers) == (layers or 2) == model.config.num_hidden_layers
    model = model.double()
    full = LlamaForSequenceClassification.from_pretrained(folder, dtype=torch.float64)  # every layer, the reference
    B, C, k = 3, 5, 3
    V = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(4)
    input_ids, prompt_mask = _left_padded_prompts([5, 2, 4], V, tok.pad_token_id, g)  # [B, P]
    completion_mask = torch.ones(B, C, dtype=torch.long)  # [B, C]
    completion_mask[0, 2:] = 0  # ended after two tokens
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [B, P + C]
    soft_indices = torch.stack([torch.randperm(V - 3, generator=g)[:k] + 3 for _ in range(B * C)]).view(B, C, k)
    weights = torch.randn(B, C, k, generator=g, dtype=torch.float64).softmax(-1).requires_grad_(True)  # [B, C, k]
    sparse = forward_soft_sparse(model, input_ids, soft_indices, weights, attention_mask)  # [B]
    (grad_sparse,) = torch.autograd.grad(sparse.sum(), weights)

    E = model.get_input_embeddings().weight  # [V, H]
    w = weights.detach().clone().requires_grad_(True)
    embeds = (w[..., None] * E[soft_indices]).sum(-2)  # [B, C, H]
    plain = []
    for b in range(B):  # each row alone, no padding: the head at each completion token, pooled
        n = int(completion_mask[b].sum())
        row = torch.cat([E[input_ids[b, prompt_mask[b].bool()]], embeds[b, :n]])  # [P_b + n, H]
        states = full.model(inputs_embeds=row[None], output_hidden_states=True).hidden_states
        # transformers gives the last layer's state normed already, and every earlier one before the norm
        hidden = (states[-1] if layers in (None, 2) else full.model.norm(states[layers]))[0, -n:]  # [n, H]
        per_token = hidden @ model.score.weight[0]  # [n]
        plain.append(per_token.sum() if mode == "sum" else per_token.mean())
    plain = torch.stack(plain)  # [B]
    (grad_plain,) = torch.autograd.grad(plain.sum(), w)
    torch.testing.assert_close(sparse.double(), plain, rtol=0, atol=1e-9)
    torch.testing.assert_close(grad_sparse, grad_plain, rtol=1e-9, atol=1e-12)
    assert grad_sparse[0, 2:].abs().max() == 0


@pytest.mark.parametrize("mode", ["last", "mean", "sum"])
def test_every_prefix_score_equals_the_score_of_that_prefix_float64(reward_folder, mode):
    from lit_rl.models import score_every_prefix, soft_embeddings

    B, C, k = 3, 5, 4
    model, V, g, input_ids, prompt_mask = _float64_model_and_prompts(reward_folder, [6, 3, 5], seed=2)
    model.score_pooling = mode
    soft_indices = torch.stack([torch.randperm(V - 3, generator=g)[:k] + 3 for _ in range(B * C)]).view(B, C, k)
    weights = torch.randn(B, C, k, generator=g, dtype=torch.float64).softmax(-1).requires_grad_(True)  # [B, C, k]
    embeds = soft_embeddings(model.get_input_embeddings(), soft_indices, weights)  # [B, C, H]

    table = score_every_prefix(model, input_ids, embeds, prompt_mask)  # [B, C]
    assert table.shape == (B, C)
    for t in range(C):  # the prefix cut after token t, scored alone with its mask ending at t
        completion_mask = (torch.arange(C) <= t).long().expand(B, C)  # [B, C]
        alone = forward_soft_sparse(
            model, input_ids, soft_indices, weights, torch.cat([prompt_mask, completion_mask], 1)
        )
        torch.testing.assert_close(table[:, t], alone, rtol=0, atol=1e-10)
        (g_table,) = torch.autograd.grad(table[:, t].sum(), weights, retain_graph=True)
        (g_alone,) = torch.autograd.grad(alone.sum(), weights)
        torch.testing.assert_close(g_table, g_alone, rtol=1e-9, atol=1e-12)
        assert g_table[:, t + 1 :].abs().max() == 0 if t + 1 < C else True  # a prefix never sees what follows


def test_one_hot_equals_the_models_own_score(reward_folder):
    folder, tok = reward_folder
    model = load_reward_model(str(folder))
    V = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(2)
    input_ids, prompt_mask = _left_padded_prompts([6, 3], V, tok.pad_token_id, g)  # [B, P]
    completion = torch.randint(3, V, (2, 4), generator=g)  # [B, C]
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion)], dim=1)  # [B, P + C]
    got = model.forward_soft_sparse(input_ids, completion.unsqueeze(-1), torch.ones(2, 4, 1), attention_mask)  # [B]
    hard = torch.cat([input_ids, completion], dim=1)  # [B, P + C]
    with torch.no_grad():
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # [B, P + C]
        batched = model(input_ids=hard, attention_mask=attention_mask, position_ids=position_ids).logits[:, 0]
        alone = torch.stack([model(input_ids=hard[b, attention_mask[b].bool()][None]).logits[0, 0] for b in range(2)])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, batched, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


def test_frozen_parameters_get_no_grad_soft_weights_do(reward_folder):
    folder, tok = reward_folder
    model = load_reward_model(str(folder), policy_tokenizer=tok)
    model.train()  # a parent module switching modes must not turn dropout or gradients back on
    assert not any(p.requires_grad for p in model.parameters())
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    V = model.get_input_embeddings().num_embeddings
    weights = torch.full((2, 3, 4), 0.25, requires_grad=True)  # [B, C, k]
    indices = torch.randint(3, V, (2, 3, 4))  # [B, C, k]
    score = model.forward_soft_sparse(torch.randint(3, V, (2, 5)), indices, weights, torch.ones(2, 8))  # [B]
    score.sum().backward()
    assert weights.grad is not None and weights.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())


def test_vocabulary_mismatch_is_refused_in_one_line(reward_folder, tmp_path):
    folder, _ = reward_folder
    other = tiny_tokenizer()
    other.add_tokens(["<extra>"])
    other.save_pretrained(tmp_path / "policy")
    policy = type(other).from_pretrained(tmp_path / "policy")
    with pytest.raises(ValueError) as err:
        load_reward_model(str(folder), policy_tokenizer=policy)
    message = str(err.value)
    assert "\n" not in message
    assert str(folder) in message and str(tmp_path / "policy") in message
    assert f"{len(policy)} tokens" in message and f"{len(policy) - 1} tokens" in message
    assert "use a reward model trained on the policy's tokenizer" in message


def test_same_size_but_other_ids_is_refused(reward_folder):
    folder, tok = reward_folder
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    swapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), pad_token="<pad>")
    assert len(swapped) == len(tok)
    with pytest.raises(ValueError, match=rf"\(built in memory, {len(tok)} tokens; 4 token->id pairs differ\)"):
        load_reward_model(str(folder), policy_tokenizer=swapped)


def test_num_labels_other_than_one_is_refused(tmp_path):
    _save_classifier(tmp_path / "rm2", num_labels=2)
    with pytest.raises(ValueError, match=r"num_labels=2; .* use a checkpoint trained with num_labels=1"):
        load_reward_model(str(tmp_path / "rm2"))


def test_causal_lm_checkpoint_without_a_head_is_refused(tmp_path):
    tok = tiny_tokenizer()
    config = tiny_config("llama", vocab_size=len(tok))
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "lm")
    config.num_labels = 1
    with pytest.raises(ValueError, match="no trained classification head"):
        load_reward_model(str(tmp_path / "lm"))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_tiny_architectures_pass_the_parity_check(arch):
    tok = tiny_tokenizer()
    model = load_reward_model(f"tiny:{arch}", policy_tokenizer=tok, vocab_size=len(tok))
    assert type(model).__name__.endswith("ForSequenceClassification")
    score = model.forward_soft_sparse(
        torch.randint(3, len(tok), (2, 4)),
        torch.randint(3, len(tok), (2, 3, 2)),
        torch.full((2, 3, 2), 0.5),
        torch.ones(2, 7),
    )  # [B]
    assert score.shape == (2,) and torch.isfinite(score).all()


# ---------------------------------------------------------------- the built-in sentiment reward model (tiny trunk)
def test_features_equal_a_plain_forward_and_the_soft_sparse_score():
    from lit_rl.reward_model.fit import extract_features
    from lit_rl.reward_model.train import build_classifier, score_soft_sparse

    model, tok = build_classifier("tiny:llama")
    torch.nn.init.normal_(model.score.weight, std=0.5)
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in ("Hi: 7+5?", "Hi: 12+30?", "Hi: 1?")]
    groups = [
        (enc[0], [[30, 31, 2], [33]]),  # a one-token completion
        (enc[1], [[40, 41, 42, 43, 44, 2]]),
        (enc[2], [[50, 51], [52, 53, 54], [55]]),
    ]
    features = extract_features(model, groups, pad_id=tok.pad_token_id, prompts_per_batch=2, rows_per_batch=2)
    last = features.last
    body = model.model
    with torch.no_grad():
        for i, (p, c) in enumerate([(p, c) for p, cs in groups for c in cs]):
            hidden = body(input_ids=torch.tensor([p + c]))[0][0]  # [P + C, H]
            torch.testing.assert_close(last[i], hidden[-1], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(features.mean[i], hidden[len(p) :].mean(0), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(features.tokens[features.owner == i], hidden[len(p) :], rtol=1e-4, atol=1e-5)
    assert features.owner.tolist() == sorted(features.owner.tolist())  # completion after completion
    scores = score_soft_sparse(model_with_soft(model), groups, pad_id=tok.pad_token_id, batch_size=4)  # [N]
    torch.testing.assert_close(scores, last @ model.score.weight[0], rtol=1e-4, atol=1e-5)


def model_with_soft(model):
    import types

    model.forward_soft_sparse = types.MethodType(forward_soft_sparse, model)
    return model


def test_training_continuations_are_cut_at_random_lengths_and_labelled_by_vader():
    from lit_rl.data.sentiment import vader_positive
    from lit_rl.reward_model.train import cut_at_random_lengths

    tok = tiny_tokenizer()
    long = tok(" a wonderful film with great acting and a lovely story", add_special_tokens=False)["input_ids"]
    groups = [([5, 6], [long] * 40)]
    cut, texts = cut_at_random_lengths(groups, tok, min_tokens=3, seed=0)
    lengths = [len(c) for c in cut[0][1]]
    assert min(lengths) >= 3 and max(lengths) == len(long) and len(set(lengths)) > 3, "whole, and cut in many places"
    assert texts == tok.batch_decode(cut[0][1], skip_special_tokens=True)
    assert 0 < sum(vader_positive(texts)) < len(texts), "a prefix can lose the word that made it positive"


def test_train_writes_a_loadable_head_with_its_metrics(tmp_path):
    from lit_rl.reward_model.train import HEAD_FILE, META_FILE, train_sentiment_reward_model

    out = tmp_path / "rm"
    meta = train_sentiment_reward_model(
        out, base="tiny:llama", num_train_prompts=8, num_heldout_prompts=4, max_new_tokens=5, layers=1
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rm"]  # no temporary folder left behind
    assert sorted(p.name for p in out.iterdir()) == [HEAD_FILE, META_FILE], "the head only: kilobytes, not a model"
    saved = json.loads((out / META_FILE).read_text())
    assert saved["train_pairs"] == 32 and saved["heldout"]["agreement"]["n"] == 16
    assert saved["heldout"]["feature_path_max_abs_diff"] < 1e-4, "the saved head scores as the fitted features say"
    assert saved["choice"] == meta["choice"] and len(saved["heldout"]["examples"]) == 16
    assert saved["choice"]["width"] in (32, 64) and saved["layers"] == 1
    model = load_reward_model("tiny:llama", policy_tokenizer=tiny_tokenizer(), head_file=str(out / HEAD_FILE))
    assert isinstance(model.score, torch.nn.Sequential) and model.score[0].weight.abs().sum() > 0
    assert len(model.model.layers) == 1, "the trunk keeps the layer the head reads after, not the ones above it"


def test_an_interrupted_run_leaves_no_folder(tmp_path, monkeypatch):
    from lit_rl.reward_model import train as reward_model

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(reward_model, "score_soft_sparse", interrupted)  # runs once the folder is half written
    with pytest.raises(KeyboardInterrupt):
        reward_model.train_sentiment_reward_model(
            tmp_path / "rm", base="tiny:llama", num_train_prompts=4, num_heldout_prompts=2, max_new_tokens=3
        )
    assert list(tmp_path.iterdir()) == []


def test_the_command_trains_and_refuses_a_foreign_folder_in_one_line(tmp_path, capsys):
    from lit_rl.cli import main

    small = ["--num-train-prompts", "4", "--num-heldout-prompts", "2", "--max-new-tokens", "3", "--seed", "1"]
    main(["reward-model", "--base", "tiny:llama", "--out", str(tmp_path / "rm"), *small])
    saved = json.loads((tmp_path / "rm" / "reward_model.json").read_text())
    assert saved["settings"]["seed"] == 1 and saved["settings"]["num_train_prompts"] == 4
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        main(["reward-model", "--base", "tiny:llama", "--out", str(tmp_path / "other"), *small])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no reward_model.json" in err[0], err
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"  # nothing of the user's is lost
    with pytest.raises(SystemExit) as exit_:
        main(["reward-model", "--seeds", "1"])
    assert exit_.value.code == 2
    assert "lit-rl reward-model: unrecognized arguments: --seeds 1" in capsys.readouterr().err


def test_a_reward_model_as_a_reward_function_scores_each_completion_after_its_prompt(reward_folder):
    """RewardModelScore's batched, padded scores are the model's own score of each prompt + completion alone."""
    from lit_rl.data.rewards import score
    from lit_rl.reward_model import RewardModelScore

    folder, tok = reward_folder
    fn = RewardModelScore(str(folder), batch_size=2, device="cpu")
    prompts = ["a good", "it was", "x"]
    completions = ["film indeed", "", "bad and long enough"]  # an empty one is scored as EOS alone
    got = score(fn, "rm", completions, [None] * 3, prompts)  # the checks every reward function goes through
    model = load_reward_model(str(folder))
    expected = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            ids = tok(p, add_special_tokens=False)["input_ids"]
            ids += tok(c, add_special_tokens=False)["input_ids"] or [tok.eos_token_id]
            expected.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    assert got.shape == (3,) and len(set(got.tolist())) == 3
    torch.testing.assert_close(got, torch.tensor(expected, dtype=got.dtype), rtol=1e-5, atol=1e-5)
    assert fn(completions[:1]) == pytest.approx(fn(completions[:1], prompts=[""]))  # no prompts: an empty one each
    with pytest.raises(ValueError, match="batch_size"):
        RewardModelScore(str(folder), batch_size=0)


def test_layer_features_end_with_the_fits_own_mean_features(reward_folder):
    """The probe's per-layer means read the same hidden states the fit reads: its last entry is the fit's feature."""
    from lit_rl.reward_model.fit import extract_features, layer_features

    folder, tok = reward_folder
    model = load_reward_model(str(folder))
    g = torch.Generator().manual_seed(3)
    groups = [(torch.randint(3, 60, (n,), generator=g).tolist(),
               [torch.randint(3, 60, (m,), generator=g).tolist() for m in (1, 4, 2)]) for n in (5, 2)]  # fmt: skip
    per_layer = layer_features(model, groups, pad_id=tok.pad_token_id, rows_per_batch=4)
    mean = extract_features(model, groups, pad_id=tok.pad_token_id).mean
    assert per_layer.shape == (6, model.config.num_hidden_layers + 1, model.config.hidden_size)
    torch.testing.assert_close(per_layer[:, -1], mean, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(per_layer[:, 0], per_layer[:, -1])  # the layers differ, so the order is checked


def test_the_layer_probe_writes_a_row_per_hidden_state_and_one_for_the_best_three(tmp_path, capsys):
    from lit_rl.cli import main

    table = tmp_path / "layers.md"
    main(["reward-model", "--base", "tiny:llama", "--num-train-prompts", "6", "--num-heldout-prompts", "4",
          "--max-new-tokens", "4", "--probe-layers", str(table)])  # fmt: skip
    rows = json.loads(table.with_suffix(".json").read_text())["rows"]
    layers = [r["layer"] for r in rows]
    assert layers[:-1] == list(range(len(rows) - 1)) and layers[-1].count("+") == 2
    assert all(r["n"] == 16 for r in rows)
    text = table.read_text()
    assert (
        text.count("\n| ") == len(rows) + 2 and "--probe-layers" in text and f"wrote {table}" in capsys.readouterr().out
    )
    assert not (tmp_path / "runs").exists()  # a probe saves no head
