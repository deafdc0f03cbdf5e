"""Every architecture gets the model's own log-probs from the logits-free path, or is refused in one line at load.

Tiny random models of real architectures are built here from a transformers config (nothing is downloaded),
their heads scaled so that logits have a realistic spread (several nats between tokens, so that a missing
logit scale or softcap shows), and saved to a folder, which is how a user points lit-rl at a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from lit_rl.cli import LitRLCLI, main
from lit_rl.models import base_model, head_spec, load_causal_lm, trunk, trunk_hidden
from lit_rl.models.tiny import tiny_config, tiny_tokenizer
from lit_rl.ops import token_stats

ROOT = Path(__file__).resolve().parents[1]
VOCAB = len(tiny_tokenizer())
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
BERT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, is_decoder=True)  # fmt: skip

# name -> (config, what makes its head differ from lm_head(trunk(x)))
ARCHITECTURES = {
    "llama": lambda: tiny_config("llama", vocab_size=VOCAB),  # tied head
    "qwen2": lambda: tiny_config("qwen2", vocab_size=VOCAB),
    "gpt2": lambda: tiny_config("gpt2", vocab_size=VOCAB),  # dropout 0.1 everywhere
    "gemma2": lambda: transformers.Gemma2Config(
        **SMALL, head_dim=8, query_pre_attn_scalar=8, sliding_window=16, final_logit_softcapping=5.0
    ),
    "cohere": lambda: transformers.CohereConfig(**SMALL, logit_scale=0.25, tie_word_embeddings=False),
    "granite": lambda: transformers.GraniteConfig(**SMALL, logits_scaling=4.0, tie_word_embeddings=False),
    "falcon_h1": lambda: transformers.FalconH1Config(
        **SMALL, head_dim=8, lm_head_multiplier=2.5, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
        mamba_d_state=8, mamba_chunk_size=8, mamba_expand=1, tie_word_embeddings=False,
    ),  # fmt: skip
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
    ),
    "electra": lambda: transformers.ElectraConfig(**BERT, embedding_size=16),  # a projection H -> E before the head
}
# a head whose transform (dense -> gelu -> norm inside lm_head) is no single module: the check must refuse it
REFUSED = {"roberta": lambda: transformers.RobertaConfig(**BERT)}
SPREAD = 6.0  # standard deviation of the model's logits, in nats


def build(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random tiny model of ``name`` whose logits spread over several nats."""
    config = {**ARCHITECTURES, **REFUSED}[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, VOCAB, (2, 12))
    with torch.no_grad():
        std = model(input_ids=ids).logits.std().item()
        model.get_output_embeddings().weight.mul_(SPREAD / std)
    return model


def save(name: str, folder) -> str:
    """``build(name)`` and the tiny tokenizer saved as a checkpoint folder."""
    build(name).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def _dense(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, self-certainty) ``[B, T]`` from full logits ``[B, T, V]``."""
    logp_all = torch.log_softmax(logits, -1)  # [B, T, V]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # [B, T]
    ent = -(logp_all.exp() * logp_all).sum(-1)  # [B, T]
    sc = torch.logsumexp(logits, -1) - logits.mean(-1) - torch.log(torch.tensor(float(logits.shape[-1])))  # [B, T]
    return logp, ent, sc


def _inputs(seed: int = 1, padded: bool = True):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 11), generator=gen)  # [B, L] odd length
    mask = torch.ones_like(ids)
    if padded:  # left padding, as in a rollout batch
        mask[1, :3] = 0
        ids[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logits_free_stats_match_float64_full_logits_value_and_gradient(name, temperature):
    model = build(name, _experts_implementation="eager").double()  # grouped expert matmuls have no float64 kernel
    # Gemma 2's eager attention gives NaN rows for fully masked (padded) queries in float64 (not in float32),
    # and the NaN reaches every gradient through the model's own backward: no padding there
    ids, mask = _inputs(padded=name != "gemma2")
    targets, keep = ids[:, 1:], mask[:, 1:].bool()  # [B, L-1]
    ups = [torch.randn(targets.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i in range(3)]

    params = [p for p in model.parameters() if p.requires_grad]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, :-1]  # [B, L-1, V]
    ref = [torch.where(keep, r, 0.0) for r in _dense(logits / temperature, targets)]  # padded rows may be NaN
    ref_grads = torch.autograd.grad(sum((r * u).sum() for r, u in zip(ref, ups)), params, allow_unused=True)

    spec = head_spec(model)
    hidden = trunk_hidden(model, ids, mask)[:, :-1]  # [B, L-1, H]
    stats = token_stats(spec.features(hidden), spec.weight, targets, temperature=temperature, self_certainty=True,
                        chunk_size=5, _vocab_chunk=17, **spec.op_kwargs)  # fmt: skip
    got = [torch.where(keep, s, 0.0) for s in stats]
    grads = torch.autograd.grad(sum((g * u).sum() for g, u in zip(got, ups)), params, allow_unused=True)

    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        if r is None:  # e.g. experts no token was routed to
            assert g is None or g.abs().max() == 0
            continue
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    if spec.scale != 1.0 or spec.softcap is not None:  # at this spread the transform matters: the test can fail
        plain = token_stats(hidden, spec.weight, targets, temperature=temperature).logp  # lm_head(trunk(x)) alone
        assert (torch.where(keep, plain, 0.0) - ref[0]).abs().max() > 0.1


def test_head_spec_reads_each_architectures_transform():
    specs = {name: head_spec(build(name)) for name in ARCHITECTURES}
    assert specs["gemma2"].softcap == 5.0 and specs["gemma2"].scale == 1.0
    assert specs["cohere"].scale == 0.25 and specs["granite"].scale == 0.25 and specs["falcon_h1"].scale == 2.5
    assert type(specs["electra"].transform).__name__ == "ElectraGeneratorPredictions"
    for name in ("llama", "qwen2", "gpt2", "qwen3_moe"):
        assert (specs[name].scale, specs[name].softcap, specs[name].transform) == (1.0, None, None), name


def test_text_config_of_a_multimodal_model_gives_the_softcap():
    config = transformers.Gemma3Config(
        text_config=dict(**SMALL, head_dim=8, sliding_window=16, final_logit_softcapping=7.0),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4,
    )  # fmt: skip
    model = transformers.Gemma3ForConditionalGeneration(config)
    assert head_spec(model).softcap == 7.0
    assert trunk(model) is model.model  # the multimodal model: it owns the embedding, the head reads its output


def test_llama4_trunk_is_found_despite_its_base_model_prefix():
    config = transformers.Llama4TextConfig(**SMALL, head_dim=8, num_local_experts=2, interleave_moe_layer_step=1)
    model = transformers.Llama4ForCausalLM(config)
    assert model.base_model_prefix not in dict(model.named_children())  # what used to break
    assert trunk(model) is model.model
    ids = torch.randint(3, VOCAB, (1, 6))
    hidden = trunk_hidden(model, ids, torch.ones_like(ids))
    torch.testing.assert_close(model.lm_head(hidden), model(input_ids=ids).logits)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_architecture_passes_the_load_time_check(name, tmp_path):
    model = load_causal_lm(save(name, tmp_path), vocab_size=VOCAB)
    assert head_spec(model).weight.shape[0] == VOCAB


def test_an_unreproducible_head_is_refused_in_one_line(tmp_path):
    folder = save("roberta", tmp_path)
    with pytest.raises(ValueError) as err:
        load_causal_lm(folder)
    message = str(err.value)
    assert "\n" not in message and "RobertaForCausalLM" in message and "nats" in message
    assert float(message.split("by up to ")[1].split()[0]) > 0.1  # the size of the disagreement


@pytest.mark.parametrize("disable", [True, False])
def test_dropout_is_off_by_default_so_two_passes_agree(disable):
    model = base_model(load_causal_lm("tiny:gpt2", vocab_size=VOCAB, disable_dropout=disable)).train()
    ids, mask = _inputs()
    first, second = (trunk_hidden(model, ids, mask) for _ in range(2))
    if disable:
        torch.testing.assert_close(first, second, atol=0, rtol=0)
    else:  # GPT-2's dropout (0.1) is on in train mode: the passes differ
        assert (first - second).abs().max() > 1e-3


# ------------------------------------------------------------------------------- lit-rl fit and estimate, end to end

RUN = [
    "--config", str(ROOT / "configs" / "grpo_tiny.yaml"), "--trainer.max_steps", "1", "--trainer.logger", "false",
    "--model.init_args.num_generations", "2", "--model.init_args.max_new_tokens", "3",
    "--data.init_args.num_prompts", "2", "--data.init_args.batch_size", "1", "--data.init_args.max_prompt_length", "24",
    "--data.init_args.val_size", "0",  # two prompts leave none to hold out; the held-out split is tested elsewhere
]  # fmt: skip


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_fit_one_step_and_estimate(name, tmp_path, capsys):
    folder = save(name, tmp_path / name)
    args = [*RUN, "--model.init_args.name_or_path", folder, "--trainer.default_root_dir", str(tmp_path)]
    cli = LitRLCLI(args=["fit", *args])
    assert cli.trainer.global_step == 1
    assert torch.isfinite(cli.trainer.callback_metrics["loss"])
    capsys.readouterr()
    main(["estimate", *args])
    table = capsys.readouterr().out
    assert "policy_forward" in table and "no weights were loaded" in table


def test_fit_refuses_an_unreproducible_head_before_any_step(tmp_path):
    folder = save("roberta", tmp_path / "roberta")
    args = [*RUN, "--model.init_args.name_or_path", folder, "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises((ValueError, SystemExit), match=r"RobertaForCausalLM differ from the model's own by up to"):
        LitRLCLI(args=["fit", *args])
