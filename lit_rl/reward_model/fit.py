"""Features of a frozen trunk and the logistic fits of score heads on them: the numerical core of the built-in
reward model (:mod:`lit_rl.reward_model.train` makes the labelled pairs and saves the result).

Features are the trunk's hidden states over each (prompt, completion) pair's completion tokens (their last and mean
derived from them); each prompt, and the prefix all prompts share (the system prompt), runs
once. The shipped head is :func:`fit_mlp_head`'s: two layers applied to every completion token, their mean the score.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lit_rl.models import cache_kwargs, trunk
from lit_rl.models.reward import mlp_head


def completion_mean(values: torch.Tensor, owner: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, ...]``: the mean of ``values [T, ...]`` over the tokens of each of ``n`` completions (``owner [T]``)."""
    total = values.new_zeros(n, *values.shape[1:]).index_add(0, owner, values)  # [n, ...]
    counts = torch.bincount(owner, minlength=n).clamp_min(1).to(total.dtype)  # [n]
    return total / counts.view(n, *[1] * (values.dim() - 1))


class Features(NamedTuple):
    """What :func:`extract_features` reads of ``N`` completions (``T`` tokens in all, none empty), float32 on the CPU.

    The per-completion ``last`` and ``mean`` ``[N, H]`` (the last token's hidden state, and their mean) are derived.
    """

    tokens: torch.Tensor  # [T, H] every completion token's hidden state, completion after completion
    owner: torch.Tensor  # [T] the completion each token belongs to, ascending

    @property
    def count(self) -> int:
        return int(self.owner[-1]) + 1 if len(self.owner) else 0

    @property
    def last(self) -> torch.Tensor:
        return self.tokens[torch.bincount(self.owner, minlength=self.count).cumsum(0) - 1]  # [N, H]

    @property
    def mean(self) -> torch.Tensor:
        return completion_mean(self.tokens, self.owner, self.count)  # [N, H]


def pad(seqs: list[list[int]], pad_id: int, *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, L]`` ids and mask of ``seqs`` padded to one length, on the left (prompts) or the right."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)  # [n, L]
    mask = torch.zeros(len(seqs), L, dtype=torch.long)  # [n, L]
    for i, seq in enumerate(seqs):
        span = slice(L - len(seq), L) if left else slice(0, len(seq))
        ids[i, span], mask[i, span] = torch.tensor(seq, dtype=torch.long), 1
    return ids, mask


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs) - 1  # every prompt keeps at least one token of its own
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return max(n, 0)


@torch.no_grad()
def extract_features(
    model, groups, *, pad_id: int, prompts_per_batch: int = 16, rows_per_batch: int = 64, desc: str = "features"
):
    """The trunk's hidden state at every completion token (and so its last token's and their mean), per completion.

    Work is shared where the result cannot change: the prompts' common prefix (the chat template's
    system turn) runs once per batch, each prompt once, and its KV cache is then reused by its
    completions, sorted by length so little padding is computed. Positions come from the mask, as in
    :func:`lit_rl.models.forward_soft_sparse`, so the last-token feature is what the ``score`` head reads there.

    Args:
        model: a ``...ForSequenceClassification`` (or any model whose trunk :func:`lit_rl.models.trunk` finds).
        groups: ``(prompt_ids, [completion_ids, ...])`` per prompt; every completion non-empty.
        pad_id: the padding token id.
        prompts_per_batch: prompts per trunk call; rows_per_batch: completions per trunk call.

    Returns:
        :class:`Features`, completions in the order of ``groups``.
    """
    body = trunk(model)
    device = next(model.parameters()).device
    n_total = sum(len(c) for _, c in groups)
    per_row: list[torch.Tensor | None] = [None] * n_total  # each completion's [C_i, H] token states
    offset = 0
    with tqdm(total=n_total, desc=desc, unit="pair", disable=None) as bar:
        for start in range(0, len(groups), prompts_per_batch):
            chunk = groups[start : start + prompts_per_batch]
            shared = _common_prefix([p for p, _ in chunk])
            cache = None
            if shared:
                cache = body(input_ids=torch.tensor([chunk[0][0][:shared]], device=device), use_cache=True)[1]
                cache.batch_select_indices(torch.zeros(len(chunk), dtype=torch.long, device=device))
            ids, rest_mask = pad([p[shared:] for p, _ in chunk], pad_id, left=True)  # [b, R] after the prefix
            prompt_mask = torch.cat([torch.ones(len(chunk), shared, dtype=torch.long), rest_mask], 1).to(device)
            position_ids = (prompt_mask.cumsum(-1) - 1).clamp_min(0)[:, shared:]  # [b, R]
            cache = body(
                input_ids=ids.to(device),
                attention_mask=prompt_mask,
                position_ids=position_ids,
                **cache_kwargs(body, cache),
                use_cache=True,
            )[1]
            rows = [(row, c) for row, (_, cs) in enumerate(chunk) for c in cs]
            order = sorted(range(len(rows)), key=lambda i: len(rows[i][1]))
            for b0 in range(0, len(order), rows_per_batch):
                pick = order[b0 : b0 + rows_per_batch]
                states = _completion_features(body, cache, prompt_mask, [rows[i] for i in pick], pad_id)
                for i, state in zip(pick, states, strict=True):
                    per_row[offset + i] = state
                bar.update(len(pick))
            offset += len(rows)
    owner = torch.cat([torch.full((len(t),), i, dtype=torch.long) for i, t in enumerate(per_row)])  # [T]
    return Features(torch.cat(per_row), owner)


def _completion_features(body, prompt_cache, prompt_mask, rows, pad_id):
    """Each completion's token states ``[C_i, H]``, for right-padded completions continuing cached prompts."""
    device = prompt_mask.device
    cache = copy.deepcopy(prompt_cache)  # the prompt cache serves the next bucket too
    owner = torch.tensor([row for row, _ in rows], device=device)  # [n]
    cache.batch_select_indices(owner)
    ids, cmask = pad([c for _, c in rows], pad_id, left=False)  # [n, C]
    ids, cmask = ids.to(device), cmask.to(device)
    mask = torch.cat([prompt_mask[owner], cmask], dim=1)  # [n, P + C]
    hidden = body(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1)[:, prompt_mask.shape[1] :],
        **cache_kwargs(body, cache),
        use_cache=True,
    )[0].float()  # [n, C, H]
    return [hidden[i, :n].cpu() for i, n in enumerate(cmask.sum(-1).tolist())]


def layer_features(model, groups, *, pad_id: int, rows_per_batch: int = 64) -> torch.Tensor:
    """``[N, L + 1, H]`` float32: each hidden state of the trunk (the embeddings' output, then every layer's, the
    last with the final norm, as ``output_hidden_states`` gives them) averaged over each completion's tokens.

    Each row is its prompt (left-padded) then its completion (right-padded), positions from the mask, so the last
    entry is :func:`extract_features`'s mean; no work is shared between rows (a probe, not the fit's fast path).
    """
    body = trunk(model)
    device = next(model.parameters()).device
    rows = [(p, c) for p, cs in groups for c in cs]
    out = []
    for start in tqdm(range(0, len(rows), rows_per_batch), desc="layer features", unit="batch", disable=None):
        chunk = rows[start : start + rows_per_batch]
        ids, prompt_mask = pad([p for p, _ in chunk], pad_id, left=True)  # [b, P]
        comp, comp_mask = pad([c for _, c in chunk], pad_id, left=False)  # [b, C]
        mask = torch.cat([prompt_mask, comp_mask], 1).to(device)  # [b, P + C]
        with torch.no_grad():
            hidden = body(input_ids=torch.cat([ids, comp], 1).to(device), attention_mask=mask,
                          position_ids=(mask.cumsum(-1) - 1).clamp_min(0), output_hidden_states=True).hidden_states  # fmt: skip
        weight = comp_mask.to(device).float()[..., None]  # [b, C, 1]
        p = ids.shape[1]
        out.append(torch.stack([(h[:, p:].float() * weight).sum(1) / weight.sum(1) for h in hidden], 1).cpu())
    return torch.cat(out)  # [N, L + 1, H]


def fit_linear_head(features: torch.Tensor, labels: torch.Tensor, *, l2: float = 1e-3, steps: int = 300):
    """The ``[H]`` weight of a logistic regression of ``labels [N]`` on ``features [N, H]``, full-batch LBFGS.

    No intercept (the ``score`` head has no bias); ridge term ``l2 * |w|^2 / 2`` on the mean loss.
    """
    x, y = features.double(), labels.double()  # [N, H], [N]
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)  # [H]
    opt = torch.optim.LBFGS([w], lr=1, max_iter=steps, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(x @ w, y) + 0.5 * l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().float()


def agreement(scores: torch.Tensor, labels: torch.Tensor) -> dict[str, float | None]:
    """Accuracy of ``score > 0`` against the checker, AUC (ties count half), and the positive rate."""
    scores, labels = scores.float(), labels.bool()
    pos, neg = scores[labels], scores[~labels]
    auc = None  # undefined when the checker gives one label only
    if len(pos) and len(neg):
        diff = pos[:, None] - neg[None, :]  # [n_pos, n_neg]
        auc = ((diff > 0).float() + 0.5 * (diff == 0).float()).mean().item()
    accuracy = ((scores > 0) == labels).float().mean().item()
    return {"accuracy": accuracy, "auc": auc, "positive_rate": labels.float().mean().item(), "n": len(labels)}


def choose_and_fit(features, labels, prompt_of, *, l2_grid=(1e-3, 1e-2, 1e-1)):
    """Pick the ridge weight by AUC on every fifth prompt (``prompt_of [N]``: each pair's prompt), refit on all."""
    val = prompt_of % 5 == 4  # [N]

    def val_auc(l2: float) -> float:
        w = fit_linear_head(features[~val], labels[~val], l2=l2)
        return agreement(features[val] @ w, labels[val])["auc"] or 0.0

    best = max(l2_grid, key=val_auc) if val.any() else l2_grid[0]
    return fit_linear_head(features, labels, l2=best), best


def mean_scores(head: torch.nn.Module, tokens: torch.Tensor, owner: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]``: ``head`` applied to every token state ``[T, H]`` and averaged per completion (``owner [T]``)."""
    return completion_mean(head(tokens)[:, 0], owner, n)


def fit_mlp_head(
    tokens: torch.Tensor,
    owner: torch.Tensor,
    labels: torch.Tensor,
    *,
    width: int = 32,
    epochs: int = 150,
    weight_decay: float = 0.1,
    lr: float = 3e-3,
    seed: int = 0,
) -> torch.nn.Sequential:
    """:func:`~lit_rl.models.reward.mlp_head` fitted so that its mean over each completion's tokens is the logit of
    ``labels [N]``: full-batch AdamW on the logistic loss, ``epochs`` steps, from a seeded initialisation.

    Args:
        tokens: ``[T, H]`` token states (:attr:`Features.tokens`); owner: ``[T]`` each token's completion.
    """
    torch.manual_seed(seed)
    head = mlp_head(tokens.shape[1], width)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    y = labels.float()
    for _ in range(epochs):
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(mean_scores(head, tokens, owner, len(y)), y).backward()
        opt.step()
    return head.requires_grad_(False).eval()


def choose_and_fit_mlp(features: Features, labels, prompt_of, *, widths=(32, 64), epochs=(150, 300), seed: int = 0):
    """Pick the head's width and epochs by AUC on every fifth prompt (``prompt_of [N]``), refit on all.

    Returns:
        ``(head, {"width": ..., "epochs": ..., "validation_auc": ...})``.
    """
    val = prompt_of % 5 == 4  # [N]
    index = torch.full((len(labels),), -1, dtype=torch.long)  # completion -> its row in the fit or the validation
    index[~val], index[val] = torch.arange(int((~val).sum())), torch.arange(int(val.sum()))
    on_val = val[features.owner]  # [T]
    fit_part = (features.tokens[~on_val], index[features.owner[~on_val]])
    val_part = (features.tokens[on_val], index[features.owner[on_val]])

    def val_auc(width: int, steps: int) -> float:
        head = fit_mlp_head(*fit_part, labels[~val], width=width, epochs=steps, seed=seed)
        with torch.no_grad():
            return agreement(mean_scores(head, *val_part, int(val.sum())), labels[val])["auc"] or 0.0

    grid = [(w, e) for w in widths for e in epochs]
    aucs = {choice: val_auc(*choice) for choice in grid} if val.any() else {grid[0]: 0.0}
    width, steps = max(aucs, key=aucs.get)
    head = fit_mlp_head(features.tokens, features.owner, labels, width=width, epochs=steps, seed=seed)
    return head, {"width": width, "epochs": steps, "validation_auc": aucs[(width, steps)]}
