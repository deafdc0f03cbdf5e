"""Shared-prompt passes: the prompt of a group runs through the trunk once, its completions attend to it.

A GRPO rollout holds ``G`` completions of each prompt. The reference, old-log-prob, self-certainty and update
passes need the hidden states of the completion tokens only, yet the plain path runs every row as prompt +
completion: a group pushes ``G * (P + C)`` tokens through every layer where ``P + G * C`` would do. verl
(``use_prefix_grouper``) and unsloth (PrefixGrouper) share the prompt the same way; TRL does not.

How (:func:`shared_prompt_hidden`): the micro-batch becomes one packed row, ``u`` prompts of ``P`` tokens (left
padding kept) followed by ``b`` completions of ``C`` tokens, with each token's own position id. Every layer's
projections and MLP run on ``u * P + b * C`` tokens. Attention is the only place tokens meet; it is done by
:func:`shared_prompt_attention`, installed in front of transformers' ``sdpa`` attention function: prompt
queries attend causally to their own prompt, completion queries to their group's prompt keys (gathered per
completion) and causally to their own completion. That is exactly the attention of the plain path, so
log-probs and gradients are equal up to floating-point order, and the gradient of a group's prompt tokens is
summed over its completions in one backward through one prompt pass. The packed row carries no mask;
transformers' mask creation is skipped with a 4D placeholder mask that only this function receives.

Padding-free (``keep``): a completion's tokens after its end (EOS, or the micro-batch's longest completion) are
padding that no real token reads, since attention is causal. With ``keep`` they leave the packed row: every layer's
projections, MLP and saved activations run on the kept tokens only, and attention alone puts them back in their
``[P]``/``[C]`` blocks (zeros, masked out as keys) and takes the kept rows out again. The hidden states of kept
tokens are those of the padded row up to floating-point order; a dropped token's hidden state is zero, and its
log-prob is masked out by every loss. verl drops padding the same way (``use_remove_padding``), through flash
attention's variable-length kernels; here it rides on the shared-prompt attention, so it needs what that needs.

Calls without a layout fall through to transformers' own ``sdpa`` function unchanged, so generation, the
reward model and every other forward are untouched. Models whose layers do not all route through that
function (recurrent or convolutional mixers, sliding windows, attention softcaps, ``eager``/flash attention)
are found by :func:`shared_prompt_unsupported`, which compares both paths on a random batch at load time;
the method then uses the plain path and says why in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from lit_rl.models.cache_keyword import cache_kwargs
from lit_rl.models.head import base_model, trunk, trunk_hidden

_LAYOUT_KWARG = "lit_rl_prompt_layout"
_installed: dict[str, object] = {}


@dataclass
class PromptLayout:
    """Where the prompts and completions of one packed row are, as the attention function needs it."""

    groups: int  # u prompts, each [P] (left padded), then b completions, each [C]
    prompt_length: int  # P
    completion_length: int  # C
    group_of: torch.Tensor  # [b] long: the prompt each completion continues
    prompt_keys: torch.Tensor  # [u, P] bool: real (not padding) prompt tokens
    completion_keys: torch.Tensor  # [b, C] bool: real completion tokens
    kept: torch.Tensor | None = None  # [n] positions in the padded row of the tokens that run (None: all of them)
    calls: int = 0  # attention calls that used the layout (0 after a forward: the model ignored it)


def group_runs(start: int, stop: int, group_size: int) -> list[int]:
    """Lengths of the runs of rows ``start..stop-1`` that belong to one group of ``group_size`` consecutive rows.

    A micro-batch that splits a group holds a run of it: ``group_runs(3, 9, 4) == [1, 4, 1]``.
    """
    runs, row = [], start
    while row < stop:
        end = min(stop, (row // group_size + 1) * group_size)
        runs.append(end - row)
        row = end
    return runs


def shared_prompt_hidden(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    runs: list[int],
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hidden states ``[b, C, H]`` that score the completion tokens, the prompt of each run computed once.

    Equal (up to floating-point order) to ``trunk_hidden(model, input_ids, attention_mask)[:, P - 1 : -1]``.

    Args:
        input_ids: ``[b, P + C]`` prompt + completion rows; the rows of a run share their prompt (ids and mask).
        attention_mask: ``[b, P + C]``, left padding in the prompt part.
        prompt_length: ``P``.
        runs: lengths of the consecutive runs of rows that share a prompt (see :func:`group_runs`); ``sum(runs) = b``.
        keep: ``[b, C]``, nonzero for the completion tokens whose log-probs count (a prefix of each row, as the
            completion mask is); the others leave the packed row and get zero hidden states. ``None``, or fake tensors
            (an estimate: every token is taken to count), run every token.
    """
    install()
    b, total = input_ids.shape
    p, c = prompt_length, total - prompt_length
    device = input_ids.device
    u = len(runs)
    firsts = torch.tensor([sum(runs[:i]) for i in range(u)], device=device)  # [u] first row of each run
    group_of = torch.tensor([i for i, n in enumerate(runs) for _ in range(n)], device=device)  # [b]
    if len(group_of) != b:
        raise ValueError(f"runs {runs} cover {len(group_of)} rows, the micro-batch has {b}")
    prompt_ids, prompt_mask = input_ids[firsts, :p], attention_mask[firsts, :p]  # [u, P]
    if not isinstance(input_ids, FakeTensor) and not (
        torch.equal(input_ids[:, :p], prompt_ids[group_of])
        and torch.equal(attention_mask[:, :p], prompt_mask[group_of])
    ):
        raise ValueError(f"rows of one run ({runs}) hold different prompts; only rows that share a prompt can share it")
    completion_ids, completion_mask = input_ids[:, p:], attention_mask[:, p:]  # [b, C]
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [u, P] as trunk_hidden numbers them
    completion_pos = prompt_mask.sum(-1)[group_of, None] + completion_mask.cumsum(-1) - 1  # [b, C]
    ids = torch.cat([prompt_ids.reshape(-1), completion_ids.reshape(-1)])[None]  # [1, u*P + b*C]
    positions = torch.cat([prompt_pos.reshape(-1), completion_pos.clamp(min=0).reshape(-1)])[None]  # [1, N]
    layout = PromptLayout(u, p, c, group_of, prompt_mask.bool(), completion_mask.bool())
    if keep is not None and not isinstance(keep, FakeTensor) and not keep.bool().all():
        # the token at completion position j scores token j + 1, so the last kept token runs for no one's log-prob
        scores = F.pad(keep[:, 1:].bool(), (0, 1), value=False)  # [b, C]
        if not torch.equal(scores, scores.cummin(1).values):
            raise ValueError("keep: each row's kept completion tokens must be a prefix of it, as a completion mask is")
        layout.completion_keys = layout.completion_keys & scores
        runs_token = torch.cat([torch.ones(u * p, dtype=torch.bool, device=device), scores.reshape(-1)])  # [N]
        layout.kept = runs_token.nonzero()[:, 0]  # [n]
        ids, positions = ids[:, layout.kept], positions[:, layout.kept]  # [1, n]
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)  # 4D: transformers builds no mask
    out = trunk(model)(
        input_ids=ids, attention_mask=placeholder, position_ids=positions, use_cache=False, **{_LAYOUT_KWARG: layout}
    )
    if layout.calls == 0:
        raise RuntimeError(
            f"{type(base_model(model)).__name__} ignored the shared-prompt layout (its attention does not go through "
            "transformers' sdpa function); set model.share_prompt false"
        )
    hidden = out[0][0]  # [N, H], or [n, H] padding-free
    if layout.kept is not None:  # back to the padded row: zeros where a token did not run
        hidden = hidden.new_zeros(u * p + b * c, hidden.shape[-1]).index_copy(0, layout.kept, hidden)  # [N, H]
    last_prompt = group_of * p + p - 1  # [b] the prompt's last token predicts the first completion token
    within = u * p + torch.arange(b, device=device)[:, None] * c + torch.arange(c - 1, device=device)  # [b, C-1]
    return hidden[torch.cat([last_prompt[:, None], within], dim=1)]  # [b, C, H]


def shared_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, repeats: int):
    """A KV cache of all but the last token of each prompt ``[B, P]``, computed once and repeated ``repeats`` times.

    ``model.generate(input_ids.repeat_interleave(repeats, 0), ..., **cache_kwargs(model, cache))`` then runs only the
    last prompt token and the new ones per row: the rollout's prefill costs ``B * (P - 1)`` tokens instead of
    ``B * repeats * (P - 1)``. Positions are numbered as ``generate`` numbers them.
    """
    from transformers import DynamicCache

    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # [B, P]
    cache = DynamicCache(config=base_model(model).config)
    trunk(model)(
        input_ids=input_ids[:, :-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids[:, :-1],
        **cache_kwargs(trunk(model), cache),
        use_cache=True,
    )
    cache.batch_repeat_interleave(repeats)
    return cache


def shared_prompt_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
):
    """transformers' ``sdpa`` attention, or the shared-prompt attention when the forward carries a layout.

    Shapes as transformers passes them: ``query [1, Hq, N, D]``, ``key``/``value [1, Hkv, N, D]``; returns
    ``([1, N, Hq, D], None)``.
    """
    layout: PromptLayout | None = kwargs.pop(_LAYOUT_KWARG, None)
    if layout is None:
        return _installed["sdpa"](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    for name in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"shared-prompt attention does not support {name}; set model.share_prompt false")
    layout.calls += 1
    u, p, c = layout.groups, layout.prompt_length, layout.completion_length
    b = layout.group_of.shape[0]
    gqa = query.shape[1] != key.shape[1]  # grouped-query attention: sdpa repeats the key/value heads itself
    q, k, v = query[0], key[0], value[0]  # [Hq, N, D], [Hkv, N, D]; padding-free: [H, n, D]
    if layout.kept is not None:  # the dropped tokens back as zeros: masked out as keys, their queries' rows unread
        q, k, v = (t.new_zeros(t.shape[0], u * p + b * c, t.shape[2]).index_copy(1, layout.kept, t) for t in (q, k, v))

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [H, N, D] -> [u, H, P, D], [b, H, C, D]
        return t[:, : u * p].unflatten(1, (u, p)).transpose(0, 1), t[:, u * p :].unflatten(1, (b, c)).transpose(0, 1)

    (qp, qc), (kp, kc), (vp, vc) = split(q), split(k), split(v)
    dev = query.device
    causal_p = torch.ones(p, p, dtype=torch.bool, device=dev).tril()
    # pad queries (left padding) see themselves only, so no row is empty; real queries never see a pad key
    mask_p = (causal_p & layout.prompt_keys[:, None, None, :]) | torch.eye(p, dtype=torch.bool, device=dev)  # [u,1,P,P]
    out_p = F.scaled_dot_product_attention(
        qp, kp, vp, attn_mask=mask_p, dropout_p=dropout, scale=scaling, enable_gqa=gqa
    )  # [u, Hq, P, D]
    causal_c = torch.ones(c, c, dtype=torch.bool, device=dev).tril()
    keys_c = torch.cat(
        [
            layout.prompt_keys[layout.group_of][:, None, None, :].expand(b, 1, c, p),
            causal_c & layout.completion_keys[:, None, None, :],
        ],
        dim=-1,
    )  # [b, 1, C, P + C]
    kg = torch.cat([kp[layout.group_of], kc], dim=2)  # [b, Hkv, P + C, D] the group's prompt keys, then its own
    vg = torch.cat([vp[layout.group_of], vc], dim=2)
    out_c = F.scaled_dot_product_attention(
        qc, kg, vg, attn_mask=keys_c, dropout_p=dropout, scale=scaling, enable_gqa=gqa
    )  # [b, Hq, C, D]
    out = torch.cat([out_p.transpose(0, 1).flatten(1, 2), out_c.transpose(0, 1).flatten(1, 2)], dim=1)  # [Hq, N, D]
    if layout.kept is not None:
        out = out[:, layout.kept]  # [Hq, n, D]
    return out.transpose(0, 1)[None].contiguous(), None  # [1, N, Hq, D] ([1, n, Hq, D] padding-free)


def install() -> None:
    """Put :func:`shared_prompt_attention` in front of transformers' ``sdpa`` attention function (once)."""
    if "sdpa" in _installed:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    _installed["sdpa"] = ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register("sdpa", shared_prompt_attention)


def _architecture_reason(hf) -> str | None:
    """What in the config rules the shared path out, decided without weights (an estimate decides the same)."""
    from transformers import DynamicCache

    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    try:
        layers = DynamicCache(config=hf.config).layers
    except Exception as err:  # any architecture whose cache transformers cannot describe
        return f"its cache layout is unknown ({type(err).__name__})"
    kinds = sorted({type(layer).__name__ for layer in layers} - {"DynamicLayer"})
    if kinds:
        return f"it has {', '.join(kinds)} layers (recurrent, linear or sliding-window mixers)"
    if getattr(config, "attn_logit_softcapping", None):
        return "its attention scores are softcapped"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return f"its layers are not all full attention ({sorted(set(config.layer_types))})"
    return None


def shared_prompt_unsupported(model) -> str | None:
    """Why the shared-prompt path is not exact for ``model`` (``None`` when it is).

    Runs both paths in eval mode on two groups of random tokens (one left-padded, one split over two runs), the
    shared one also padding-free with completions ending early, and compares the hidden states that score the
    completions.
    """
    hf = base_model(model)
    attn = getattr(hf.config, "_attn_implementation", None)
    if attn != "sdpa":
        return f"its attention implementation is {attn!r}; the shared-prompt passes need 'sdpa'"
    reason = _architecture_reason(hf)
    if reason is not None or hf.get_input_embeddings().weight.is_meta:  # an estimate has no values to compare
        return reason
    vocab = hf.get_input_embeddings().weight.shape[0]
    device = hf.get_input_embeddings().weight.device
    gen = torch.Generator().manual_seed(0)
    p, c = 5, 4
    prompts = torch.randint(min(3, vocab - 1), vocab, (2, p), generator=gen, device="cpu")
    ids = torch.cat(
        [prompts.repeat_interleave(3, 0), torch.randint(min(3, vocab - 1), vocab, (6, c), generator=gen, device="cpu")],
        1,
    )
    mask = torch.ones_like(ids)
    mask[3:, :2] = 0  # the second prompt is left padded
    ids, mask = ids.to(device), mask.to(device)
    was_training = hf.training
    hf.eval()
    try:
        with torch.no_grad():
            plain = trunk_hidden(hf, ids, mask)[:, p - 1 : -1].double()
            shared = shared_prompt_hidden(hf, ids, mask, p, [3, 2, 1]).double()
            keep = torch.arange(c, device=device) < torch.tensor([4, 2, 3, 1, 4, 2], device=device)[:, None]  # [6, C]
            free = shared_prompt_hidden(hf, ids, mask, p, [3, 2, 1], keep).double()  # padding-free
            # generation: the prompt's last token on top of a shared prefill, against a whole-prompt forward
            prompt_ids, prompt_mask = ids[::3, :p], mask[::3, :p]
            cache = shared_prefill(hf, prompt_ids, prompt_mask, 3)
            position = prompt_mask.sum(-1, keepdim=True).repeat_interleave(3, 0) - 1  # [6, 1]
            last = trunk(hf)(
                input_ids=ids[:, p - 1 : p],
                attention_mask=mask[:, :p],
                position_ids=position,
                **cache_kwargs(trunk(hf), cache),
                use_cache=True,
            )[0][:, -1].double()  # [6, H]
    except (NotImplementedError, RuntimeError, TypeError, ValueError, AttributeError) as err:
        return f"its forward does not take the shared-prompt layout ({type(err).__name__}: {err})"
    finally:
        hf.train(was_training)
    scale = plain.abs().max().item()
    diff = max((shared - plain).abs().max().item(), (last - plain[:, 0]).abs().max().item(),
               (free - plain)[keep].abs().max().item())  # fmt: skip
    dtype = next(hf.parameters()).dtype
    tolerance = 1e-4 * max(1.0, scale) + 64 * torch.finfo(dtype).eps * max(1.0, scale)
    if not diff <= tolerance:
        return f"its hidden states differ from the plain path by {diff:.3g} (tolerance {tolerance:.2g})"
    return None
