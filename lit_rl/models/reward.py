"""Reward models that read a completion as sparse soft tokens, so a reward's gradient reaches the policy.

GumbelTopK (:mod:`lit_rl.methods.gumbel_topk`) backpropagates a frozen reward model's score into the policy
through the soft tokens of a differentiable rollout. Its paper feeds the reward model a dense
``[B, C, V]`` distribution times its ``[V, H]`` embedding matrix; here each completion position
carries only the k ids and k weights of the top-k Gumbel-softmax, and its input embedding is a
gather of k embedding rows and a weighted sum (``[B, C, k, H]``, never ``[B, C, V]``). Both give the
same embedding, so the score and its gradient w.r.t. the weights are those of the dense form.

The reward model must share the policy's vocabulary (the soft ids index its embedding matrix), and
must be a decoder that scores the last non-padding position (Llama, Qwen2, Mistral, GPT-2 style
``...ForSequenceClassification``); :func:`load_reward_model` checks both at load time. A head loaded from a
file may instead average its score over the completion's tokens (``pooling: mean``, see :func:`load_head`).
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn.functional as F

from lit_rl.models.head import disable_dropout, trunk
from lit_rl.models.loading import (
    DTYPES,
    EMBEDDED,
    TINY_PREFIX,
    build_from_config,
    load_tokenizer,
    meta_config,
    resolve_dtype,
    resolve_source,
)
from lit_rl.models.quantize import check_quantize_base, nf4_stand_in, quantize_base_nf4
from lit_rl.models.shapes import SHAPE_PREFIX, shape_config, with_tiny_special_tokens

# attribute names of the classification head on the last hidden state, in the order they are tried
HEAD_NAMES = ("score", "classifier", "classification_head", "v_head")
#: how a head reads a completion (:func:`pooling`)
POOLINGS = ("last", "mean", "sum")


def load_reward_model(
    name_or_path: str,
    *,
    policy_tokenizer=None,
    gguf_file: str | None = None,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    vocab_size: int | None = None,
    head_file: str | None = None,
    quantize_base: str = "none",
):
    """A frozen ``...ForSequenceClassification`` with one label and a ``forward_soft_sparse`` method.

    Every parameter has ``requires_grad=False``, the model is in eval mode and its dropout
    probabilities are set to 0, so a parent module switching to train mode cannot turn dropout back on.

    Args:
        name_or_path: a local folder or hub id of a sequence classifier, a folder plus ``gguf_file``,
            ``tiny:llama`` / ``tiny:qwen2`` / ``tiny:gpt2`` (random weights, tests only), or ``shape:<name>`` (a
            real architecture with random weights: memory and speed measurements).
        policy_tokenizer: the policy's tokenizer; the reward model's must have the same token -> id map.
        gguf_file: file name inside ``name_or_path`` when that is a folder holding GGUF files.
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto``; the score is float32 whatever this is.
        trust_remote_code: run model code shipped with the checkpoint. Off unless you trust it.
        vocab_size: only for ``tiny:*`` models (to match a tokenizer).
        head_file: a ``.safetensors`` file with the classification head's weights (``score.weight [1, H]``) for a
            checkpoint that has no head of its own: the built-in reward model is the embedded causal LM's trunk
            plus a head shipped inside lit-rl. The file's head replaces any head in the checkpoint.
        quantize_base: ``nf4``: the trunk's linear layers in 4 bits (:mod:`lit_rl.models.quantize`), the head and
            embeddings as loaded; the parity check runs on the quantized model. ``none``: as loaded.

    Raises:
        ValueError: a head that was not in the checkpoint, ``num_labels != 1``, a vocabulary other
            than the policy's, or an architecture whose score ``forward_soft_sparse`` cannot reproduce.
    """
    check_quantize_base(quantize_base, lora=True)  # frozen whole: no adapters needed
    if dtype not in DTYPES:
        raise ValueError(f"reward_model.dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    config = meta_config("reward", name_or_path)
    if config is not None:  # an estimate: shapes only, so no tokenizer or parity check
        from transformers import AutoModelForSequenceClassification

        config = copy.deepcopy(config)
        config.num_labels = 1
        model = build_from_config(AutoModelForSequenceClassification, config, resolve_dtype(dtype, config))
        if head_file is not None:  # a head that reads an early layer: the estimate counts the kept layers only
            keep_layers(model, head_metadata(head_file)["layers"], head_file)
        if quantize_base == "nf4":
            nf4_stand_in(model)
        freeze(model)
        model.forward_soft_sparse = types.MethodType(forward_soft_sparse, model)
        return model
    if name_or_path.startswith(SHAPE_PREFIX):
        from transformers import AutoModelForSequenceClassification

        config = with_tiny_special_tokens(shape_config(name_or_path))
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, dtype=resolve_dtype(dtype, config))
    elif name_or_path.startswith(TINY_PREFIX):
        from transformers import AutoModelForSequenceClassification

        from lit_rl.models.tiny import tiny_config

        torch.manual_seed(0)
        config = tiny_config(name_or_path[len(TINY_PREFIX) :], vocab_size=vocab_size or 128, num_labels=1)
        model = AutoModelForSequenceClassification.from_config(config)
        if torch_dtype != "auto":
            model = model.to(torch_dtype)
    else:
        model = _from_pretrained(name_or_path, gguf_file, torch_dtype, trust_remote_code, has_head=head_file is None)
    if head_file is not None:
        load_head(model, head_file)
        if model.config.pad_token_id is None and policy_tokenizer is not None:
            model.config.pad_token_id = policy_tokenizer.pad_token_id  # a causal LM's config may name none
    if model.config.num_labels != 1:
        raise ValueError(
            f"reward model {name_or_path} has num_labels={model.config.num_labels}; a reward model gives one score "
            "per sequence: use a checkpoint trained with num_labels=1"
        )
    if policy_tokenizer is not None:
        tokenizer = load_tokenizer(name_or_path, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
        check_same_vocabulary(tokenizer, policy_tokenizer, reward_name=name_or_path)
    if quantize_base == "nf4":
        quantize_base_nf4(model)
    freeze(model)
    classification_head(model)  # refuse a model without a head we know, now rather than at the first step
    model.forward_soft_sparse = types.MethodType(forward_soft_sparse, model)
    check_parity(model, name_or_path)
    return model


def _from_pretrained(name_or_path: str, gguf_file: str | None, torch_dtype, trust_remote_code: bool, has_head: bool):
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    path, gguf = resolve_source(name_or_path, gguf_file)
    verbosity = hf_logging.get_verbosity()
    if not has_head:
        hf_logging.set_verbosity_error()  # the head is "missing from the checkpoint": it comes from head_file
    try:
        extra = {} if has_head else {"num_labels": 1}  # a causal LM's trunk: one label, the head from head_file
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, gguf_file=gguf, dtype=torch_dtype, trust_remote_code=trust_remote_code, output_loading_info=True,
            **extra,
        )  # fmt: skip
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = [k for k in info.get("missing_keys", ()) if k.split(".")[0] in HEAD_NAMES]
    if missing and has_head:
        hint = " ('embedded' is the policy)" if name_or_path == EMBEDDED else ""
        raise ValueError(
            f"reward model {name_or_path}{hint} has no trained classification head ({', '.join(sorted(missing))} "
            "missing from the checkpoint, so the score would be random); give a checkpoint trained as a reward "
            "model, e.g. the built-in arithmetic one that `lit-rl reward-model` writes"
        )
    if gguf is not None:
        model.hf_quantizer = None  # dequantised on load; the marker only blocks save_pretrained
    return model


def head_metadata(head_file: str) -> dict:
    """``{"pooling": ..., "layers": int | None}`` from a head file's safetensors metadata (no tensor is read).

    ``pooling``: how the head reads a completion (:func:`pooling`; ``last`` when the file does not say).
    ``layers``: the trunk's decoder layers the head was fitted after (the rest are dropped, :func:`keep_layers`);
    ``None``: all of them.

    Raises:
        ValueError: an unknown pooling or a layer count that is not a positive integer; names the file and the fix.
    """
    from safetensors import safe_open

    with safe_open(head_file, "pt") as f:
        meta = f.metadata() or {}
    mode, layers = meta.get("pooling", "last"), meta.get("layers")
    if mode not in POOLINGS:
        raise ValueError(
            f"reward model head {head_file}: pooling {mode!r} is not one of {', '.join(POOLINGS)}; refit the head"
        )
    if layers is not None and not (layers.isdigit() and int(layers) > 0):
        raise ValueError(f"reward model head {head_file}: layers {layers!r} is not a positive integer; refit the head")
    return {"pooling": mode, "layers": None if layers is None else int(layers)}


def keep_layers(model, layers: int | None, head_file: str = "") -> None:
    """Keep the trunk's first ``layers`` decoder layers (``None``: all): its output is then the final norm of
    layer ``layers``' hidden state, which a head fitted there reads; the layers after it are never run.

    Raises:
        ValueError: a trunk without a ``layers`` list, or fewer layers than the head needs; one line with the fix.
    """
    if layers is None:
        return
    body = trunk(model)
    stack = getattr(body, "layers", None)
    if not isinstance(stack, torch.nn.ModuleList) or layers > len(stack):
        have = f"{len(stack)} decoder layers" if isinstance(stack, torch.nn.ModuleList) else "no `layers` list"
        raise ValueError(
            f"reward model head {head_file}: reads the hidden state after decoder layer {layers}, and the trunk "
            f"({type(body).__name__}) has {have}; use the trunk the head was fitted on"
        )
    body.layers = torch.nn.ModuleList(list(stack)[:layers])
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]


def mlp_head(hidden_size: int, width: int) -> torch.nn.Sequential:
    """A score head of two layers, ``Linear(H, width)``, GELU, ``Linear(width, 1)``: a head file holding
    ``<name>.0.weight`` (``[width, H]``) and the rest of this module's state dict loads as one (:func:`load_head`)."""
    return torch.nn.Sequential(torch.nn.Linear(hidden_size, width), torch.nn.GELU(), torch.nn.Linear(width, 1))


def load_head(model, head_file: str) -> None:
    """Load the classification head's weights from ``head_file`` (safetensors): a linear head (``<head name>.weight
    [1, H]``, a bias optional) or the two layers of :func:`mlp_head` (``<head name>.0.weight [width, H]``, ...), which
    then replaces the model's head.

    The file's metadata (:func:`head_metadata`) may say ``pooling: mean`` or ``sum``: the score is then the head's
    mean or sum over the completion's tokens (:func:`pooling`), which reads a whole continuation where the last
    token of a small model does not; and ``layers: K``: the head reads the hidden state after decoder layer ``K``,
    so the trunk keeps its first ``K`` layers (:func:`keep_layers`).

    Raises:
        ValueError: the file holds no head weight, or one whose shape is not the model's; names the file and the fix.
    """
    from safetensors.torch import load_file

    meta = head_metadata(head_file)
    keep_layers(model, meta["layers"], head_file)
    head = classification_head(model)
    tensors = {name.split(".", 1)[1] if name.split(".")[0] in HEAD_NAMES else name: t
               for name, t in load_file(head_file).items()}  # fmt: skip
    ref = next(head.parameters())  # the head's dtype and device
    hidden = model.config.get_text_config().hidden_size
    if "0.weight" in tensors and tensors["0.weight"].dim() == 2 and tensors["0.weight"].shape[1] == hidden:
        mlp = mlp_head(hidden, tensors["0.weight"].shape[0]).to(ref)
        try:
            mlp.load_state_dict(tensors)
        except RuntimeError as err:
            raise ValueError(
                f"reward model head {head_file}: not a head of two layers ({err}); refit the head"
            ) from err
        name = next(n for n in HEAD_NAMES if getattr(model, n, None) is head)
        setattr(model, name, mlp)
    else:
        weight = next((t for name, t in tensors.items() if name.split(".")[-1] == "weight"), None)
        if weight is None or weight.shape != (1, hidden) or not isinstance(head, torch.nn.Linear):
            found = "no weight" if weight is None else f"a weight of shape {tuple(weight.shape)}"
            raise ValueError(
                f"reward model head {head_file}: holds {found}, the model's head is {(1, hidden)}; "
                "use a head fitted on this model's trunk (`lit-rl reward-model --base` it)"
            )
        with torch.no_grad():
            head.weight.copy_(weight)
            if getattr(head, "bias", None) is not None:
                bias = next((t for name, t in tensors.items() if name.split(".")[-1] == "bias"), None)
                head.bias.copy_(bias) if bias is not None else head.bias.zero_()
    model.score_pooling = meta["pooling"]


def freeze(model) -> None:
    """No gradients, eval mode and dropout probabilities set to 0 (also if a parent calls ``.train()``)."""
    model.requires_grad_(False)
    model.eval()
    disable_dropout(model)


def check_same_vocabulary(reward_tokenizer, policy_tokenizer, *, reward_name: str = "") -> None:
    """Refuse a reward tokenizer whose token -> id map differs from the policy's (the soft ids index its embedding).

    Raises:
        ValueError: one line naming both tokenizers, their sizes and the fix.
    """
    reward_vocab, policy_vocab = reward_tokenizer.get_vocab(), policy_tokenizer.get_vocab()
    if len(reward_tokenizer) == len(policy_tokenizer) and reward_vocab == policy_vocab:
        return
    differ = len(set(reward_vocab.items()) ^ set(policy_vocab.items()))
    reward_id = reward_tokenizer.name_or_path or "built in memory"
    policy_id = policy_tokenizer.name_or_path or "built in memory"
    raise ValueError(
        f"reward model {reward_name or reward_id}: its tokenizer ({reward_id}, {len(reward_tokenizer)} tokens) "
        f"is not the policy's ({policy_id}, {len(policy_tokenizer)} tokens; {differ} token->id pairs differ): "
        "the soft tokens are policy ids; use a reward model trained on the policy's tokenizer (the same model family)"
    )


def classification_head(model) -> torch.nn.Module:
    """The module that maps the last hidden state to the score (``score`` for Llama/Qwen2/GPT-2)."""
    for name in HEAD_NAMES:
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise ValueError(
        f"{type(model).__name__} has no classification head named one of {', '.join(HEAD_NAMES)}; "
        "use a decoder sequence classifier (Llama, Qwen2, Mistral, GPT-2 style)"
    )


def soft_embeddings(embedding: torch.nn.Module, soft_indices: torch.Tensor, soft_weights: torch.Tensor) -> torch.Tensor:
    """``sum_k w * E[idx]``: the input embedding of soft tokens as a gather of k rows, never ``[..., V]``."""
    rows = F.embedding(soft_indices, embedding.weight)  # [B, C, k, H]
    soft = (soft_weights.to(rows.dtype).unsqueeze(-1) * rows).sum(-2)  # [B, C, H]
    scale = getattr(embedding, "embed_scale", None)  # Gemma-style embeddings scale inside their forward
    return soft * scale if scale is not None else soft


def forward_soft_sparse(
    model,
    input_ids: torch.Tensor,
    soft_indices: torch.Tensor,
    soft_weights: torch.Tensor,
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """Score prompts (hard tokens) followed by completions given as sparse soft tokens.

    Attached to models from :func:`load_reward_model` as ``model.forward_soft_sparse(...)``.

    Args:
        model: a ``...ForSequenceClassification`` (decoder, head on the last position).
        input_ids: ``[B, P]`` prompt ids, left-padded.
        soft_indices: ``[B, C, k]`` token ids of each completion position.
        soft_weights: ``[B, C, k]`` their weights (summing to 1 per position); differentiable.
        attention_mask: ``[B, P + C]``; 0 for the prompt's left padding and completion positions after the end.

    Returns:
        ``[B]`` float32 scores, read at the last position whose mask is 1; gradients flow to ``soft_weights``.
    """
    completion = soft_embeddings(model.get_input_embeddings(), soft_indices, soft_weights)  # [B, C, H]
    return forward_soft_embeds(model, input_ids, completion, attention_mask)


def forward_soft_embeds(
    model, input_ids: torch.Tensor, completion_embeds: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Score prompts (hard tokens) followed by completions given as input embeddings ``[B, C, H]``.

    :func:`forward_soft_sparse` builds those from k rows per position; the full-vocabulary baseline the benchmarks
    measure GumbelTopK against (``bench/gumbel_legacy.py``) builds them densely (``[B, C, V] @ [V, H]``).
    """
    B, P = input_ids.shape
    C = completion_embeds.shape[1]
    if attention_mask.shape != (B, P + C):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(B, P + C)}")
    hidden = _hidden_states(model, input_ids, completion_embeds, attention_mask.long())  # [B, P + C, H]
    if pooling(model) != "last":  # the head at every completion token, summed or averaged
        keep = attention_mask[:, P:].to(torch.float32)  # [B, C]
        total = (_score(model, hidden[:, P:]) * keep).sum(-1)  # [B]
        return total if pooling(model) == "sum" else total / keep.sum(-1).clamp_min(1)
    positions = torch.arange(P + C, device=attention_mask.device)  # [P + C]
    last = (positions * attention_mask.long()).argmax(-1)  # [B] rightmost position whose mask is 1
    pooled = hidden[torch.arange(B, device=hidden.device), last]  # [B, H]
    return _score(model, pooled)  # [B]


def score_every_prefix(
    model, input_ids: torch.Tensor, completion_embeds: torch.Tensor, prompt_mask: torch.Tensor
) -> torch.Tensor:
    """``[B, C]``: the score of the prompt plus the first ``t + 1`` completion tokens, for every ``t``, in one pass.

    The reward model is causal, so the hidden state at completion position ``t`` sees exactly the prefix
    up to ``t``: column ``t`` equals :func:`forward_soft_embeds` with the attention mask ending at ``t``.
    GumbelTopK reads the score where a completion stops from this table, which makes the stop itself
    differentiable (see ``GumbelTopK.score``).
    """
    B, P = input_ids.shape
    C = completion_embeds.shape[1]
    if prompt_mask.shape != (B, P):
        raise ValueError(f"prompt_mask has shape {tuple(prompt_mask.shape)}; expected {(B, P)}")
    ones = torch.ones(B, C, dtype=torch.long, device=prompt_mask.device)  # [B, C]
    hidden = _hidden_states(model, input_ids, completion_embeds, torch.cat([prompt_mask.long(), ones], 1))
    scores = _score(model, hidden[:, P:])  # [B, C] the head at each completion position
    if pooling(model) == "sum":  # the sum of the head over the prefix's completion tokens
        return scores.cumsum(-1)  # [B, C]
    if pooling(model) == "mean":  # their mean
        return scores.cumsum(-1) / torch.arange(1, C + 1, device=scores.device, dtype=scores.dtype)  # [B, C]
    return scores


def _hidden_states(model, input_ids: torch.Tensor, completion_embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, P + C, H]``: the trunk's last hidden states over the prompt's embeddings and ``completion_embeds``."""
    prompt = model.get_input_embeddings()(input_ids)  # [B, P, H]
    inputs_embeds = torch.cat([prompt, completion_embeds.to(prompt.dtype)], dim=1)  # [B, P + C, H]
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)  # [B, P + C] as in left-padded generation
    out = trunk(model)(inputs_embeds=inputs_embeds, attention_mask=mask, position_ids=position_ids, use_cache=False)
    return out[0]


def pooling(model) -> str:
    """How the reward model reads a completion: ``last`` (the head at the last token, what a ``...ForSequence
    Classification`` does), ``mean`` or ``sum`` (the head's mean or sum over the completion's tokens; set by a head
    file that says so).
    """
    return getattr(model, "score_pooling", "last")


def _score(model, hidden: torch.Tensor) -> torch.Tensor:
    """The classification head's single score for each hidden state ``[..., H] -> [...]``, at least float32."""
    score = classification_head(model)(hidden)[..., 0]
    return score.to(torch.promote_types(score.dtype, torch.float32))  # float32 (float64 kept)


def check_parity(model, name: str) -> None:
    """Refuse a model whose own score differs from ``forward_soft_sparse`` with one-hot soft tokens.

    One forward of 6 tokens; catches heads that read another position or embeddings scaled elsewhere.
    """
    atol = 1e-3 if model.get_input_embeddings().weight.dtype == torch.float32 else 5e-2
    vocab = model.get_input_embeddings().num_embeddings
    pad = model.config.pad_token_id
    ids = torch.arange(3, 9, device=model.device) % vocab
    if pad is not None:
        ids = torch.where(ids == pad, (ids + 1) % vocab, ids)
    ids = ids.unsqueeze(0)  # [1, 6]
    with torch.no_grad():
        if pooling(model) != "last":  # the head over the model's own hidden states of the 3 completion tokens
            per_token = _score(model, trunk(model)(input_ids=ids)[0][:, 3:])  # [1, 3]
            expected = per_token.sum(-1) if pooling(model) == "sum" else per_token.mean(-1)  # [1]
        else:
            expected = model(input_ids=ids).logits[:, 0].float()  # [1]
        got = forward_soft_sparse(
            model,
            ids[:, :3],
            ids[:, 3:].unsqueeze(-1),
            torch.ones(1, 3, 1, device=ids.device),
            torch.ones_like(ids),
        )  # [1]
    scale = max(1.0, expected.abs().item())
    if not torch.isfinite(got).all() or (got - expected).abs().item() > atol * scale:
        raise ValueError(
            f"reward model {name} ({type(model).__name__}): forward_soft_sparse gives {got.item():.4g} where the "
            f"model gives {expected.item():.4g} on the same tokens; use a decoder sequence classifier that scores "
            "the last token (Llama, Qwen2, Mistral, GPT-2 style)"
        )
