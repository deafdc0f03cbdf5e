"""The trunk and the LM head of any causal LM, as the logits-free ops read them, and the load-time parity check.

The ops compute log-probs from the trunk's hidden states and the head (:class:`~lit_rl.ops.HeadSpec`), never
from the model's own ``logits``, so both must be found exactly:

- **trunk**: the module that owns the input embedding and produces the hidden states the head reads. It is
  found by walking up from the input embedding to the highest module that does not hold the LM head
  (``model`` for Llama and Llama 4, ``transformer`` for GPT-2, the multimodal ``model`` of Gemma 3 and
  other ``...ForConditionalGeneration`` wrappers), not through ``base_model_prefix``, which some classes
  set to an attribute they do not have.
- **head**: the output embedding's weight and bias, a logit scale and a final softcap read from the model's
  (text) config under whichever name the architecture uses (:data:`LOGIT_SCALES`, :data:`SOFTCAPS`), and a
  transform of the hidden states before the head when the model has one as a module (BERT's
  ``cls.predictions.transform``, ELECTRA's projection, ModernBERT-decoder's ``lm_head``).

:func:`check_head_parity` is the safety net for whatever this misses: at load time it runs the model's own
forward on a few tokens and compares its log-probs and entropies with the logits-free path, and refuses the
model in one line if they differ.
"""

from __future__ import annotations

import math

import torch

from lit_rl.ops import HeadSpec, token_stats

# config attribute -> power of its value that multiplies the logits (+1: multiplied, -1: divided)
LOGIT_SCALES: dict[str, int] = {
    "logit_scale": 1,  # Cohere, Cohere2
    "logits_scaling": -1,  # Granite, GraniteMoE*; MiniCPM3 divides the hidden states of its bias-free head
    "lm_head_multiplier": 1,  # Falcon-H1
    "output_multiplier": 1,  # MuseSpark (before its softcap)
    "logits_mup_width_multiplier": -1,  # Inkling (hidden states of a bias-free head)
}
# (model_type, attribute) pairs that use one of those names the other way round
SCALE_EXCEPTIONS: dict[tuple[str, str], int] = {("hyperclovax", "logits_scaling"): 1}
# config attributes holding the c of a final c * tanh(z / c)
SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
# tokens of the parity check's forward
PARITY_TOKENS = 8
# the child under which a sharded trunk holds the modules beside it (lit_rl.models.sharding)
ADOPTED = "lit_rl_beside_trunk"
_DROPOUTS = (
    torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)  # fmt: skip


def base_model(model):
    """The transformers model under an optional peft wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lm_head(model) -> torch.nn.Module:
    """The output embedding (LM head) module; :func:`head_spec` says how the logits are made from it."""
    return base_model(model).get_output_embeddings()


def trunk(model) -> torch.nn.Module:
    """The decoder without the LM head: the highest module above the input embedding that does not hold the head.

    Falls back to ``get_decoder()`` / ``base_model_prefix`` for a model whose head is its input embedding.
    """
    hf = base_model(model)
    embedding, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    path = next((name for name, module in hf.named_modules() if module is embedding), None)
    if path:
        parts = path.split(".")
        for depth in range(1, len(parts)):
            candidate = hf.get_submodule(".".join(parts[:depth]))
            # a sharded trunk also holds the head, as a second name under ADOPTED (lit_rl.models.sharding)
            held = (m for name, m in candidate.named_modules() if ADOPTED not in name.split("."))
            if head is None or not any(m is head for m in held):
                return candidate
    decoder = hf.get_decoder() if hasattr(hf, "get_decoder") else None
    if isinstance(decoder, torch.nn.Module) and decoder is not hf and decoder is not head:
        return decoder
    return getattr(hf, hf.base_model_prefix)


def trunk_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states ``[B, L, H]`` of ``input_ids`` ``[B, L]``, positions from the (left-padded) mask."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, L] left padding must not shift them
    out = trunk(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out[0]  # last_hidden_state, also for models that return tuples


def gather_trunk(model) -> None:
    """Gather the unit of a sharded trunk (FSDP2: the embedding and the head, :mod:`lit_rl.models.sharding`) for a
    read of their weights outside its forward, as its forward would; FSDP shards it again after its backward.
    No effect on a model that is not sharded."""
    body = trunk(base_model(model))
    if hasattr(body, "unshard"):  # an FSDPModule
        body.unshard()


def logit_transform(config) -> tuple[float, float | None]:
    """``(scale, softcap)`` of the logits, read from the model's (text) config under its architecture's names."""
    configs = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        configs.insert(0, text)
    scale, softcap = 1.0, None
    for name, power in LOGIT_SCALES.items():
        cfg = next((c for c in configs if isinstance(getattr(c, name, None), (int, float))), None)
        if cfg is not None:
            power = SCALE_EXCEPTIONS.get((getattr(cfg, "model_type", ""), name), power)
            scale *= float(getattr(cfg, name)) ** power
    for name in SOFTCAPS:
        value = next((getattr(c, name) for c in configs if getattr(c, name, None)), None)
        if value:
            softcap = float(value)
            break
    return scale, softcap


def beside_the_way(model, target: torch.nn.Module, leave_out: torch.nn.Module | None = None) -> list | None:
    """The children with parameters of every module on the way from ``model`` down to ``target`` that are off that
    way (``leave_out`` left out too); ``None`` when ``target`` is not below ``model``."""
    found, parent = [], model
    while parent is not target:
        onward = None
        for child in parent.children():
            if any(m is target for m in child.modules()):
                onward = child
            elif child is not leave_out and any(True for _ in child.parameters()):
                found.append(child)
        if onward is None:
            return None
        parent = onward
    return found


def head_transform(model) -> torch.nn.Module | None:
    """The module between the trunk and the LM head, if the model has exactly one (with parameters).

    Looked for among the children of every module on the way from the root to the head, leaving out the trunk
    and the way itself. ``None`` when there is none, or several (a transform not held by one module: the
    parity check then refuses the model).
    """
    hf = base_model(model)
    found = beside_the_way(hf, hf.get_output_embeddings(), leave_out=trunk(hf))
    return found[0] if found is not None and len(found) == 1 else None


def head_spec(model) -> HeadSpec:
    """What the logits-free ops need of ``model``'s head: weight, bias, scale, softcap and hidden transform.

    Raises:
        ValueError: a model without an output embedding ``[V, E]``.
    """
    hf = base_model(model)
    gather_trunk(hf)
    head = hf.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{type(hf).__name__}: not a causal LM with an output embedding (LM head) of shape [V, E]")
    scale, softcap = logit_transform(hf.config)
    bias = getattr(head, "bias", None)
    return HeadSpec(
        weight=weight,
        bias=bias if isinstance(bias, torch.Tensor) else None,
        scale=scale,
        softcap=softcap,
        transform=head_transform(hf),
    )


def disable_dropout(model) -> None:
    """Set every dropout probability to 0: ``nn.Dropout`` modules and float ``*dropout*`` attributes (attention)."""
    for module in model.modules():
        if isinstance(module, _DROPOUTS):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(module, key, 0.0)


def check_head_parity(model, name: str) -> None:
    """Refuse ``model`` if the logits-free path disagrees with its own forward on a few tokens.

    Log-probs and entropies of :data:`PARITY_TOKENS` tokens from ``log_softmax(model(ids).logits)`` against
    the trunk's hidden states through :func:`head_spec` and :func:`lit_rl.ops.token_stats` (the path training
    uses), in eval mode. The tolerance is 1e-3 nats plus four roundings of the largest logit in the weight dtype.

    Raises:
        ValueError: one line naming the model, its architecture and the disagreement in nats.
    """
    hf = base_model(model)
    arch = type(hf).__name__
    spec = head_spec(hf)
    vocab = spec.weight.shape[0]
    device = spec.weight.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (1, PARITY_TOKENS), generator=gen, device="cpu").to(device)  # [1, L]
    mask = torch.ones_like(ids)
    was_training = hf.training
    hf.eval()
    try:
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]  # [1, L-1, V']
            hidden = trunk_hidden(hf, ids, mask)[:, :-1]  # [1, L-1, H]
            if logits.shape[-1] != vocab:
                raise ValueError(
                    f"{name}: {arch}'s logits have {logits.shape[-1]} entries per token but its LM head has {vocab} "
                    "rows; the logits-free ops cannot reproduce this head, use another architecture"
                )
            stats = token_stats(spec.features(hidden), spec.weight, ids[:, 1:], entropy=True, **spec.op_kwargs)
    finally:
        hf.train(was_training)
    logp_all = torch.log_softmax(logits.double(), dim=-1)  # [1, L-1, V]
    ref_logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [1, L-1]
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)  # [1, L-1]
    diff = max(
        (stats.logp.double() - ref_logp).abs().max().item(), (stats.entropy.double() - ref_ent).abs().max().item()
    )
    largest = logits.abs().max().item()
    tolerance = 1e-3 + 4 * torch.finfo(logits.dtype).eps * max(1.0, largest)
    if not math.isfinite(diff) or diff > tolerance:
        raise ValueError(
            f"{name}: lit-rl's log-probs for {arch} differ from the model's own by up to {diff:.3g} nats per token "
            f"(tolerance {tolerance:.2g}; scale {spec.scale:g}, softcap {spec.softcap}, "
            f"{'a' if spec.transform is not None else 'no'} pre-head transform found): its head is one the "
            "logits-free ops do not reproduce; use another architecture or report it"
        )
