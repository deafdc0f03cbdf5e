"""The built-in sentiment reward model: a small score head on the frozen embedded SmolLM2 trunk, shipped with lit-rl.

GumbelTopK backpropagates a reward model's score into the policy, so its default config needs a
differentiable reward that shares the policy's vocabulary and runs offline on a CPU. As in GumbelTopK's paper
(cited in :mod:`lit_rl.methods.gumbel_topk`), it is the frozen base plus a small head. Here the head reads the
hidden state after the trunk's second decoder layer (the trunk keeps two of its 30 layers; the layer probe,
``lit-rl reward-model --probe-layers``, found the early layers read the labeller's lexicon best:
``bench/results/reward_model_layers_2000.md``), applies two layers (Linear, GELU, Linear) to every token and
averages them over the continuation (``pooling: mean``; read at the last token alone, a small trunk's hidden state
says little about the words before it). It is fitted on what the policy itself writes: continuations the embedded
model samples from the training split of the review openings (:mod:`lit_rl.data.sentiment`), cut at random
lengths, because GumbelTopK reads the score at every prefix of a completion. The labels are VADER's
(``vader_positive``: compound >= 0.05 on the continuation alone); the fit is :mod:`lit_rl.reward_model.fit`'s.

The fitted head (kilobytes) ships inside the package, beside the ``reward_model.json`` that the fit
wrote, with its agreement with the labeller on continuations of held-out openings, so a run never
trains on first use. ``lit-rl reward-model`` repeats the fit (seeded) and says how far the new head
is from the shipped one; ``--out lit_rl/reward_model/heads/smollm2_sentiment`` replaces the shipped head.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from tqdm.auto import tqdm

from lit_rl.data.datamodule import PromptDataModule
from lit_rl.data.sentiment import review_openings, vader_compound, vader_positive
from lit_rl.models import EMBEDDED, TINY_PREFIX, load_tokenizer, resolve_source
from lit_rl.reward_model import HEAD_FILE, META_FILE, SHIPPED_HEAD_DIR, shipped_head_file
from lit_rl.reward_model.fit import agreement, choose_and_fit_mlp, extract_features, mean_scores, pad
from lit_rl.reward_model.score import score_pairs


def review_formatter(tokenizer) -> PromptDataModule:
    """A ``PromptDataModule`` that formats review openings exactly as the GumbelTopK and GRPO configs do."""
    formatter = PromptDataModule(source="reviews", instruction=None, chat_template=False)
    formatter.connect(tokenizer)
    return formatter


def build_classifier(base: str, *, seed: int = 0):
    """A ``...ForSequenceClassification`` with one label on ``base``'s trunk, and ``base``'s tokenizer."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    tokenizer = load_tokenizer(base)
    torch.manual_seed(seed)
    if base.startswith(TINY_PREFIX):
        from lit_rl.models.tiny import tiny_config

        config = tiny_config(base[len(TINY_PREFIX) :], vocab_size=len(tokenizer), num_labels=1)
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        path, gguf = resolve_source(base, None)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the new head is "missing from the checkpoint": that is the point
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                path, gguf_file=gguf, num_labels=1, dtype=torch.float32
            )
        finally:
            hf_logging.set_verbosity(verbosity)
    model.config.pad_token_id = tokenizer.pad_token_id  # the model's own forward finds the last token with it
    model.requires_grad_(False).eval()
    return model, tokenizer


def sample_policy_groups(
    policy, tokenizer, formatter, records, *, per_prompt, max_new_tokens, temperature, seed, prompts_per_batch=8
):
    """Completions the policy samples (top-k off, as in the rollouts), cut after the first EOS.

    Returns:
        ``(groups, texts)``: ``(prompt_ids, [completion_ids, ...])`` per prompt, and each completion's decoded text.
    """
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        num_return_sequences=per_prompt,
    )
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    groups, texts = [], []
    for start in tqdm(range(0, len(records), prompts_per_batch), desc="policy samples", unit="batch", disable=None):
        chunk = records[start : start + prompts_per_batch]
        prompts = [
            tokenizer(formatter.format_prompt(r["prompt"]), add_special_tokens=False)["input_ids"] for r in chunk
        ]
        ids, mask = pad(prompts, tokenizer.pad_token_id, left=True)  # [b, P]
        with torch.no_grad():
            out = policy.generate(input_ids=ids, attention_mask=mask, generation_config=config)  # [b*G, P + C]
        rows = [r[: r.index(eos) + 1] if eos in r else r for r in out[:, ids.shape[1] :].tolist()]
        rows = [r if r else [eos] for r in rows]  # an immediate EOS is still one token to read the score at
        for i, prompt in enumerate(prompts):
            groups.append((prompt, rows[i * per_prompt : (i + 1) * per_prompt]))
        texts += tokenizer.batch_decode(rows, skip_special_tokens=True)
    return groups, texts


def cut_at_random_lengths(groups, tokenizer, *, min_tokens: int, seed: int):
    """Each completion cut after a uniformly drawn number of tokens (at least ``min_tokens``), or kept whole with
    probability 1/2: GumbelTopK reads the score of every prefix, so the head must be right on prefixes too.

    Returns:
        ``(groups, texts)`` with the cut completions and their decoded texts.
    """
    rng = random.Random(seed)
    out, texts = [], []
    for prompt, completions in groups:
        cut = []
        for c in completions:
            keep = len(c) if rng.random() < 0.5 or len(c) <= min_tokens else rng.randint(min_tokens, len(c))
            cut.append(c[:keep])
        out.append((prompt, cut))
        texts += tokenizer.batch_decode(cut, skip_special_tokens=True)
    return out, texts


def score_soft_sparse(reward_model, groups, *, pad_id: int, batch_size: int = 32) -> torch.Tensor:
    """Scores ``[N]`` of every completion of ``groups`` through the reward model's ``forward_soft_sparse`` with
    one-hot soft tokens (:func:`~lit_rl.reward_model.score.score_pairs`)."""
    return score_pairs(reward_model, [(p, c) for p, cs in groups for c in cs], pad_id=pad_id, batch_size=batch_size)


def sample_task(base, num_train_prompts, num_heldout_prompts, per_prompt, max_new_tokens, min_tokens, temperature,
                seed):  # fmt: skip
    """The fit's data: ``(classifier, tokenizer, held-out openings, (train groups, texts), (held-out groups, texts))``,
    training continuations cut at random lengths (:func:`train_sentiment_reward_model` documents the arguments)."""
    from lit_rl.models import load_causal_lm

    model, tokenizer = build_classifier(base, seed=seed)
    formatter = review_formatter(tokenizer)
    policy = load_causal_lm(base, vocab_size=len(tokenizer)).eval()
    kw = {"per_prompt": per_prompt, "max_new_tokens": max_new_tokens, "temperature": temperature}
    train = review_openings(num_train_prompts, split="train", seed=seed)
    heldout = review_openings(num_heldout_prompts, split="heldout", seed=seed)
    groups, _ = sample_policy_groups(policy, tokenizer, formatter, train, seed=seed + 1, **kw)
    groups, texts = cut_at_random_lengths(groups, tokenizer, min_tokens=min_tokens, seed=seed)
    held = sample_policy_groups(policy, tokenizer, formatter, heldout, seed=seed + 2, **kw)
    return model, tokenizer, heldout, (groups, texts), held


def train_sentiment_reward_model(
    out_dir: str | Path,
    *,
    base: str = EMBEDDED,
    num_train_prompts: int = 2000,
    num_heldout_prompts: int = 200,
    per_prompt: int = 4,
    max_new_tokens: int = 16,
    min_tokens: int = 3,
    temperature: float = 1.0,
    seed: int = 0,
    layers: int = 2,
) -> dict[str, Any]:
    """Fit the ``score`` head of a one-label classifier on ``base``'s frozen trunk; save the head with its metrics.

    The folder is written under a temporary name and renamed at the end, so an interrupted run leaves
    no half-written reward model.

    Args:
        out_dir: the folder to write (``head.safetensors`` and ``reward_model.json``).
        base: the trunk, tokenizer and sampling policy: ``embedded``, ``tiny:*`` (tests), or a causal LM folder.
        num_train_prompts: training-split openings; the policy continues each ``per_prompt`` times.
        num_heldout_prompts: held-out openings (never fitted on) whose continuations give the reported metrics.
        per_prompt: continuations per opening.
        max_new_tokens: length limit of the sampled continuations (the GumbelTopK config's length).
        min_tokens: training continuations are cut at random lengths down to this many tokens.
        temperature: sampling temperature.
        seed: openings, sampling, cuts and the head's initialisation.
        layers: the head reads the hidden state after this many decoder layers (the trunk keeps those only).

    Returns:
        what ``reward_model.json`` holds: settings, held-out agreement with the labeller, seconds.
    """
    from safetensors.torch import save_file

    from lit_rl.models import load_reward_model
    from lit_rl.models.reward import keep_layers

    out_dir = Path(out_dir).expanduser()
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / META_FILE).exists():
        raise FileExistsError(f"{out_dir} exists and holds no {META_FILE}; choose an empty or new folder")
    if min(num_train_prompts, num_heldout_prompts, per_prompt, max_new_tokens, min_tokens, layers) < 1:
        raise ValueError(
            "num_train_prompts, num_heldout_prompts, per_prompt, max_new_tokens, min_tokens and layers must be >= 1"
        )
    t_start = time.perf_counter()
    model, tokenizer, heldout, (groups, texts), (held_groups, held_texts) = sample_task(
        base, num_train_prompts, num_heldout_prompts, per_prompt, max_new_tokens, min_tokens, temperature, seed
    )
    y_train, y_held = torch.tensor(vader_positive(texts)), torch.tensor(vader_positive(held_texts))  # [N], [N_held]
    t_sampling = time.perf_counter() - t_start
    pad_id = tokenizer.pad_token_id
    keep_layers(model, layers)  # the head reads the hidden state after decoder layer `layers`, normed
    train_features = extract_features(model, groups, pad_id=pad_id, desc="features (train)")
    held_features = extract_features(model, held_groups, pad_id=pad_id, desc="features (held-out)")
    prompt_of = torch.tensor([i for i, (_, cs) in enumerate(groups) for _ in cs])  # [N]
    head, choice = choose_and_fit_mlp(train_features, y_train, prompt_of, seed=seed)
    held_prefixes, held_prefix_texts = cut_at_random_lengths(held_groups, tokenizer, min_tokens=min_tokens, seed=seed)
    meta: dict[str, Any] = {
        "base": base,
        "task": "reviews: continue a movie-review opening (lit_rl.data.sentiment)",
        "label": "vader_positive: VADER compound >= 0.05 on the continuation alone",
        "head": f"score: two layers (Linear, GELU, Linear) on the hidden state after decoder layer {layers} of the "
        "frozen trunk (the rest dropped), averaged over the continuation's tokens (pooling: mean); logistic loss, "
        "full-batch AdamW; width and steps chosen by AUC on every fifth training opening",
        "hidden_size": int(train_features.tokens.shape[1]),
        "layers": layers,
        "choice": choice,
        "settings": {
            "num_train_prompts": num_train_prompts,
            "num_heldout_prompts": num_heldout_prompts,
            "per_prompt": per_prompt,
            "max_new_tokens": max_new_tokens,
            "min_tokens": min_tokens,
            "temperature": temperature,
            "seed": seed,
            "layers": layers,
        },
        "train_pairs": len(y_train),
        "train_positive_rate": y_train.float().mean().item(),
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        tensors = {f"score.{name}": t.detach().contiguous() for name, t in head.state_dict().items()}
        save_file(tensors, tmp / HEAD_FILE, metadata={"pooling": "mean", "layers": str(layers)})
        # scored by the saved head through forward_soft_sparse, as GumbelTopK will read it
        saved = load_reward_model(
            base, policy_tokenizer=tokenizer, vocab_size=len(tokenizer), head_file=str(tmp / HEAD_FILE)
        )
        if base.startswith(TINY_PREFIX):  # a tiny model is random: its trunk is this classifier's, not a fresh draw
            saved = _with_trunk_of(saved, model)
        s_held = score_soft_sparse(saved, held_groups, pad_id=pad_id)  # [N_held]
        s_prefix = score_soft_sparse(saved, held_prefixes, pad_id=pad_id)  # [N_held]
        fitted = mean_scores(head, held_features.tokens, held_features.owner, len(s_held))  # [N_held] as fitted
        feature_gap = (s_held - fitted).abs().max().item()
        meta["heldout"] = {
            "openings": "held-out split of lit_rl.data.sentiment (never fitted on), whole continuations",
            "agreement": agreement(s_held, y_held),
            "prefixes": agreement(s_prefix, torch.tensor(vader_positive(held_prefix_texts))),
            "feature_path_max_abs_diff": feature_gap,
            "examples": [
                {"opening": heldout[i // per_prompt]["prompt"], "continuation": t, "vader": v, "score": round(s, 3)}
                for i, (t, v, s) in enumerate(zip(held_texts, vader_compound(held_texts), s_held.tolist()))
            ][:24],
        }
        meta["seconds"] = {"sampling": round(t_sampling, 1), "total": round(time.perf_counter() - t_start, 1)}
        meta["torch_threads"] = torch.get_num_threads()
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.replace(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _with_trunk_of(reward_model, classifier):
    """``reward_model`` with ``classifier``'s trunk (the tiny test models are drawn at random on each load; the head
    is the saved one)."""
    from lit_rl.models import trunk

    trunk(reward_model).load_state_dict(trunk(classifier).state_dict())
    return reward_model


#: ``lit-rl reward-model``'s options (``lit_rl/cli.py`` builds the parser): option -> help; the defaults are
#: :func:`train_sentiment_reward_model`'s
REFIT_OPTIONS = {
    "base": "trunk, tokenizer and sampling policy: embedded, tiny:llama, or a causal LM folder",
    "num_train_prompts": "training-split openings the policy continues",
    "num_heldout_prompts": "held-out openings for the reported agreement",
    "per_prompt": "continuations per opening",
    "max_new_tokens": "length limit of the continuations",
    "min_tokens": "shortest random cut of a training continuation",
    "temperature": "sampling temperature",
    "seed": "openings, sampling, cuts and the head's initialisation",
    "layers": "decoder layers the head reads after (the trunk keeps those only)",
}


def refit(out: str | Path, **settings) -> dict:
    """``lit-rl reward-model``: fit, save, and print the held-out agreement and the distance to the shipped head.

    Args:
        out: the folder to write (``SHIPPED_HEAD_DIR`` replaces the shipped head).
        settings: :func:`train_sentiment_reward_model`'s keyword arguments.

    Returns:
        The metadata written beside the head.
    """
    from safetensors.torch import load_file

    out = Path(out)
    base = settings.get("base", EMBEDDED)
    rank_zero_info(f"lit-rl reward-model: fitting a sentiment head on {base}; writing {out}")
    meta = train_sentiment_reward_model(out, **settings)
    for name, part in (("whole continuations", "agreement"), ("random prefixes", "prefixes")):
        m = meta["heldout"][part]
        rank_zero_info(
            f"held-out {name}: accuracy {m['accuracy']:.3f}, AUC {m['auc'] or float('nan'):.3f} against VADER "
            f"(n={m['n']}, {m['positive_rate']:.0%} positive)"
        )
    shipped = Path(shipped_head_file())
    if base == EMBEDDED and shipped.exists() and out.resolve() != SHIPPED_HEAD_DIR.resolve():
        new, old = load_file(out / HEAD_FILE), load_file(shipped)
        if new.keys() == old.keys() and all(new[k].shape == old[k].shape for k in new):
            diff = max((new[k] - old[k]).abs().max().item() for k in new)
            rank_zero_info(f"largest difference from the shipped head {shipped}: {diff:.3g}")
        else:
            rank_zero_info(f"the shipped head {shipped} has another shape: {sorted(old)}")
    rank_zero_info(f"wrote {out} in {meta['seconds']['total']:.0f} s (metrics in {out / META_FILE})")
    return meta
