"""Which hidden state of the trunk a linear sentiment head reads best, to choose where a reward model's head reads.

``lit-rl reward-model --probe-layers FILE.md`` samples the same pairs as the fit of :mod:`lit_rl.reward_model.train`
(same settings, same seeds), takes each hidden state of the frozen trunk averaged over the continuation
(:func:`~lit_rl.reward_model.fit.layer_features`), fits a logistic head without bias on each (the ridge weight chosen
by AUC on a validation fifth) and writes the held-out agreement with the labeller per layer, and for the three best
layers' features side by side. Nothing is saved but the table and its JSON. The shipped head reads where this probe
points (an early layer), through two layers instead of one (:func:`~lit_rl.reward_model.fit.fit_mlp_head`).
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from typing import Any

import torch

from lit_rl.data.sentiment import vader_positive
from lit_rl.reward_model.fit import agreement, choose_and_fit, layer_features
from lit_rl.reward_model.train import sample_task, train_sentiment_reward_model

L2_GRID = (1e-4, 1e-3, 1e-2, 1e-1)


def probe_layers(table: str | Path, **settings: Any) -> list[dict[str, Any]]:
    """Write ``table`` (markdown, and its ``.json``) with the held-out agreement of a head on each layer.

    Args:
        table: the markdown file to write.
        settings: :func:`~lit_rl.reward_model.train.train_sentiment_reward_model`'s sampling keywords.
    """
    defaults = {k: p.default for k, p in inspect.signature(train_sentiment_reward_model).parameters.items()
                if p.default is not inspect.Parameter.empty}  # fmt: skip
    s = {**defaults, **settings}
    start = time.perf_counter()
    model, tokenizer, _, (groups, texts), (held_groups, held_texts) = sample_task(
        s["base"], s["num_train_prompts"], s["num_heldout_prompts"], s["per_prompt"], s["max_new_tokens"],
        s["min_tokens"], s["temperature"], s["seed"],
    )  # fmt: skip
    pad_id = tokenizer.pad_token_id
    train, held = layer_features(model, groups, pad_id=pad_id), layer_features(model, held_groups, pad_id=pad_id)
    y_train, y_held = torch.tensor(vader_positive(texts)), torch.tensor(vader_positive(held_texts))  # [N], [N_held]
    prompt_of = torch.tensor([i for i, (_, cs) in enumerate(groups) for _ in cs])  # [N]
    rows = []
    for layer in range(train.shape[1]):
        weight, l2 = choose_and_fit(train[:, layer], y_train, prompt_of, l2_grid=L2_GRID)  # [H]
        rows.append({"layer": layer, "l2": l2, **agreement(held[:, layer] @ weight, y_held)})
    best = sorted(range(len(rows)), key=lambda i: rows[i]["auc"] or 0)[-3:]
    joined = lambda x: torch.cat([x[:, i] for i in best], 1)  # noqa: E731  [N, 3H]
    weight, l2 = choose_and_fit(joined(train), y_train, prompt_of, l2_grid=L2_GRID)
    rows.append({"layer": "+".join(map(str, sorted(best))), "l2": l2, **agreement(joined(held) @ weight, y_held)})
    seconds = time.perf_counter() - start
    table = Path(table)
    table.parent.mkdir(parents=True, exist_ok=True)
    table.with_suffix(".json").write_text(json.dumps({"settings": s, "rows": rows, "seconds": seconds}, indent=1))
    options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items() if v != defaults.get(k))
    lines = [
        "# Which layer a linear sentiment head reads best",
        "",
        f"Written by `lit-rl reward-model --probe-layers {table}{' ' + options if options else ''}` "
        f"(lit_rl/reward_model/probe.py) in {seconds:.0f} s; seeded: the figures do not depend on the machine.",
        "",
        f"The built-in reward model's data ({len(y_train)} training continuations of {s['num_train_prompts']} "
        f"openings cut at random lengths, {len(y_held)} whole continuations of {s['num_heldout_prompts']} held-out "
        f"openings, labelled by VADER: compound >= 0.05), the trunk of `{s['base']}`. Per hidden state (0: the "
        "embeddings' output; the last: after the final norm), the continuation's "
        "mean of it and a logistic head without bias fitted on it, the ridge weight chosen by AUC on every fifth "
        "training opening. The last row: the three best layers' features side by side.",
        "",
        "| layer | held-out AUC | accuracy | ridge weight |",
        "| --- | ---: | ---: | ---: |",
    ]
    auc = lambda r: "undefined (one label)" if r["auc"] is None else f"{r['auc']:.3f}"  # noqa: E731
    lines += [f"| {r['layer']} | {auc(r)} | {r['accuracy']:.3f} | {r['l2']:g} |" for r in rows]
    table.write_text("\n".join(lines) + "\n")
    return rows


__all__ = ["probe_layers"]
