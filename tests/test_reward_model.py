"""Reward models read soft tokens as a sparse gather; the built-in arithmetic reward model trains on tiny models."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

from lit_rl.models import forward_soft_sparse, load_reward_model
from lit_rl.testing import tiny_config, tiny_tokenizer


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


def test_sparse_equals_dense_value_and_gradient_float64(reward_folder):
    folder, tok = reward_folder
    model = load_reward_model(str(folder), policy_tokenizer=tok).double()
    V = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(1)
    B, C, k = 3, 5, 3
    input_ids, prompt_mask = _left_padded_prompts([7, 4, 2], V, tok.pad_token_id, g)  # [B, P]
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

    assert sparse.dtype == torch.float32
    torch.testing.assert_close(sparse.double(), dense, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_sparse, grad_dense.gather(-1, soft_indices), rtol=1e-9, atol=1e-12)
    assert grad_sparse.abs().sum() > 0
    assert grad_sparse[1, 3:].abs().max() == 0  # masked positions after the end do not reach the score


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
