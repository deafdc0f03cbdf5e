"""The built-in arithmetic reward model: a linear score head on the frozen embedded SmolLM2 trunk.

GumbelTopK backpropagates a reward model's score into the policy, so its default config needs a
differentiable reward that shares the policy's vocabulary and runs offline on a CPU. This module
makes one from what is already installed: (prompt, completion) pairs on the built-in arithmetic task
(prompts formatted exactly as :class:`~lit_rl.data.PromptDataModule` formats them), with synthetic
completions (the right or a nearby wrong number in several phrasings, or cut-off reasoning) and
completions the policy itself samples, all labelled by the true checker
:func:`~lit_rl.data.rewards.correct_answer`; the frozen trunk's hidden state at the last token of each
pair (computed once, prompts cached); and a logistic fit of the ``score`` head on those features. Only
the head is trained; the trunk is a copy of the policy's weights.

It is a stand-in for a real reward model, not a replacement for the checker: a linear read-out of a
135M model's last hidden state agrees with the checker only partly. ``reward_model.json`` records the
held-out accuracy and AUC (synthetic pairs and, with ``--policy-samples``, the policy's own samples).

Run it with ``python -m lit_rl.data.reward_model --out DIR`` (``lit-rl reward-model`` once wired).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from tqdm.auto import tqdm

from lit_rl.data.datamodule import PromptDataModule
from lit_rl.data.reward_fit import agreement, choose_and_fit, extract_features, pad
from lit_rl.data.rewards import correct_answer
from lit_rl.data.tasks import arithmetic_prompts
from lit_rl.models import EMBEDDED, EMBEDDED_NAME, TINY_PREFIX, cache_dir, load_tokenizer, resolve_source

META_FILE = "reward_model.json"

# completion templates, "|"-separated: {n} is the stated number, {a} {op} {b} the question
_ANSWERS = (
    "{n}|{n}.|**{n}**|Answer: {n}|The answer is {n}.|The correct answer is {n}.|{a} {op} {b} = {n}|"
    "{a} {op} {b} = {n}.|{a} {op} {b} equals {n}.|{a} {op} {b} is {n}.|Sure! {a} {op} {b} makes {n}."
).split("|")
# what the sampled policy often writes instead: cut-off reasoning whose last number is an operand, or none
_RAMBLES = (
    "To solve this, we add {a} and {b}|{a} {op} {b} = ?|Let's think step by step. {a} {op} {b}|"
    "This is a simple arithmetic problem|Here is the calculation:\n\n{a} {op} |The answer is {n}, because {a} {op} {b}"
).split("|")


def is_heldout(question: str) -> bool:
    """A fixed fifth of all questions (by hash), never trained on, whatever the sizes and seeds."""
    return int(hashlib.md5(question.encode()).hexdigest(), 16) % 5 == 0


def question_records(num: int, *, heldout: bool, difficulties: tuple[int, ...], seed: int) -> list[dict[str, Any]]:
    """``num`` arithmetic records from the train or the held-out questions, levels in turn."""
    records: list[dict[str, Any]] = []
    for i, level in enumerate(difficulties):
        want = num // len(difficulties) + (i < num % len(difficulties))
        pool = arithmetic_prompts(20 * want + 100, difficulty=level, seed=seed * 1000 + level)
        records += [{**r, "difficulty": level} for r in pool if is_heldout(r["prompt"]) == heldout][:want]
    return records


def _wrong_number(n: int, a: int, b: int, rng: random.Random) -> int:
    choices = [n + 1, n - 1, n + 2, n - 2, n + 10, n - 10, a, b, int(str(abs(n))[::-1]), n + rng.randint(3, 9)]
    choices = [c for c in choices if c != n and c >= 0]
    return rng.choice(choices)


def make_completions(record: dict[str, Any], per_prompt: int, rng: random.Random) -> list[tuple[str, bool]]:
    """``per_prompt`` (text, ends-with-eos) completions: about 40% right, 40% a nearby wrong number, 20% rambling."""
    a, op, b = record["prompt"].removeprefix("What is ").removesuffix("?").split()
    n = int(record["answer"])
    out = []
    for _ in range(per_prompt):
        u = rng.random()
        if u < 0.2:
            text, eos = rng.choice(_RAMBLES), rng.random() < 0.2
            n_said = n if rng.random() < 0.5 else _wrong_number(n, int(a), int(b), rng)
        else:
            text, eos = rng.choice(_ANSWERS), rng.random() < 0.8
            n_said = n if u < 0.6 else _wrong_number(n, int(a), int(b), rng)
        out.append((text.format(n=n_said, a=a, op=op, b=b), eos))
    return out


def build_groups(records, tokenizer, formatter: PromptDataModule, per_prompt: int, seed: int):
    """Token ids grouped by prompt, and the checker's label per completion (prompt order, then completion)."""
    rng = random.Random(seed)
    groups, labels = [], []
    for record in records:
        prompt = tokenizer(formatter.format_prompt(record["prompt"]), add_special_tokens=False)["input_ids"]
        pairs = make_completions(record, per_prompt, rng)
        completions = [
            tokenizer(t, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
            for t, eos in pairs
        ]
        groups.append((prompt, completions))
        labels += correct_answer([t for t, _ in pairs], [record["answer"]] * len(pairs))
    return groups, torch.tensor(labels)


def build_classifier(base: str, *, seed: int = 0):
    """A ``...ForSequenceClassification`` with one label on ``base``'s trunk, and ``base``'s tokenizer."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    tokenizer = load_tokenizer(base)
    torch.manual_seed(seed)
    if base.startswith(TINY_PREFIX):
        from lit_rl.testing import tiny_config

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
    """Completions the policy samples (top-k off, as in the GRPO rollout), cut after the first EOS.

    Returns:
        ``(groups, labels, texts)``: ``(prompt_ids, [completion_ids, ...])`` per prompt, and per completion
        the checker's label and the decoded text.
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
    groups, texts, answers = [], [], []
    for start in tqdm(range(0, len(records), prompts_per_batch), desc="policy samples", unit="batch", disable=None):
        chunk = records[start : start + prompts_per_batch]
        prompts = [
            tokenizer(formatter.format_prompt(r["prompt"]), add_special_tokens=False)["input_ids"] for r in chunk
        ]
        ids, mask = pad(prompts, tokenizer.pad_token_id, left=True)  # [b, P]
        with torch.no_grad():
            out = policy.generate(input_ids=ids, attention_mask=mask, generation_config=config)  # [b*G, P + C]
        rows = [r[: r.index(eos) + 1] if eos in r else r for r in out[:, ids.shape[1] :].tolist()]
        for i, (prompt, record) in enumerate(zip(prompts, chunk)):
            groups.append((prompt, rows[i * per_prompt : (i + 1) * per_prompt]))
            answers += [record["answer"]] * per_prompt
        texts += tokenizer.batch_decode(rows, skip_special_tokens=True)
    return groups, torch.tensor(correct_answer(texts, answers)), texts


def score_soft_sparse(reward_model, groups, *, pad_id: int, batch_size: int = 32) -> torch.Tensor:
    """Scores ``[N]`` through the reward model's ``forward_soft_sparse`` with one-hot soft tokens."""
    rows = [(p, c) for p, cs in groups for c in cs]
    scores = []
    for start in range(0, len(rows), batch_size):
        ids, prompt_mask = pad([p for p, _ in rows[start : start + batch_size]], pad_id, left=True)  # [b, P]
        comp, comp_mask = pad([c for _, c in rows[start : start + batch_size]], pad_id, left=False)  # [b, C]
        mask = torch.cat([prompt_mask, comp_mask], dim=1)  # [b, P + C]
        with torch.no_grad():
            scores.append(reward_model.forward_soft_sparse(ids, comp[..., None], torch.ones(*comp.shape, 1), mask))
    return torch.cat(scores)


def train_arithmetic_reward_model(
    out_dir: str | Path,
    *,
    base: str = EMBEDDED,
    num_train: int = 1600,
    num_policy_train: int = 400,
    num_heldout: int = 400,
    per_prompt: int = 8,
    difficulties: tuple[int, ...] = (1, 2, 3),
    seed: int = 0,
    policy_samples: int = 0,
    max_new_tokens: int = 12,
    temperature: float = 1.0,
) -> dict[str, Any]:
    """Fit the ``score`` head of a one-label classifier on ``base``'s frozen trunk; save it with its metrics.

    The folder is written under a temporary name and renamed at the end, so an interrupted run leaves
    no half-written reward model.

    Args:
        out_dir: the folder to write (``save_pretrained`` files, tokenizer, ``reward_model.json``).
        base: the trunk, tokenizer and sampling policy: ``embedded``, ``tiny:*`` (tests), or a causal LM folder.
        num_train: synthetic labelled (prompt, completion) pairs to fit on.
        num_policy_train: completions sampled from ``base`` on training questions, labelled by the checker
            and fitted on too: the policy's own rambling is what the reward model meets in training.
        num_heldout: synthetic pairs on held-out questions (never trained on) for the reported metrics.
        per_prompt: completions per question (they share the question's KV cache).
        difficulties: arithmetic levels the questions come from, in equal parts.
        seed: questions, completions and sampling.
        policy_samples: also measure agreement on this many completions sampled from ``base`` on held-out
            level-1 questions (the default task), scored by the saved model's ``forward_soft_sparse``; 0 skips.
        max_new_tokens: length limit of sampled completions.
        temperature: sampling temperature of sampled completions.

    Returns:
        what ``reward_model.json`` holds: settings, held-out metrics, seconds.
    """
    from lit_rl.models import load_causal_lm, load_reward_model
    from lit_rl.models.reward import classification_head

    out_dir = Path(out_dir).expanduser()
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / META_FILE).exists():
        raise FileExistsError(f"{out_dir} exists and holds no {META_FILE}; choose an empty or new folder")
    if min(num_train, num_heldout) < per_prompt or per_prompt < 1:
        raise ValueError(f"num_train ({num_train}) and num_heldout ({num_heldout}) must be >= per_prompt >= 1")
    t_start = time.perf_counter()
    model, tokenizer = build_classifier(base, seed=seed)
    formatter = PromptDataModule()  # the DataModule's own formatting: instruction and chat template
    formatter.connect(tokenizer)
    train = question_records(num_train // per_prompt, heldout=False, difficulties=difficulties, seed=seed)
    heldout = question_records(num_heldout // per_prompt, heldout=True, difficulties=difficulties, seed=seed + 1)
    groups, y_train = build_groups(train, tokenizer, formatter, per_prompt, seed)
    held_groups, y_held = build_groups(heldout, tokenizer, formatter, per_prompt, seed + 1)
    if num_policy_train or policy_samples:
        policy = load_causal_lm(base, vocab_size=len(tokenizer)).eval()
        kw = {"per_prompt": per_prompt, "max_new_tokens": max_new_tokens, "temperature": temperature}
    if num_policy_train:
        records = question_records(num_policy_train // per_prompt, heldout=False, difficulties=difficulties, seed=seed)
        sampled, y_sampled, _ = sample_policy_groups(policy, tokenizer, formatter, records, seed=seed + 2, **kw)
        groups, y_train = groups + sampled, torch.cat([y_train, y_sampled])
    if policy_samples:
        eval_records = question_records(-(-policy_samples // per_prompt), heldout=True, difficulties=(1,), seed=seed)
        eval_groups, y_eval, texts = sample_policy_groups(
            policy, tokenizer, formatter, eval_records, seed=seed + 3, **kw
        )
    t_sampling = time.perf_counter() - t_start
    pad = tokenizer.pad_token_id
    last_train, mean_train = extract_features(model, groups, pad_id=pad, desc="features (train)")
    last_held, mean_held = extract_features(model, held_groups, pad_id=pad, desc="features (held-out)")
    prompt_of = torch.tensor([i for i, (_, cs) in enumerate(groups) for _ in cs])  # [N]
    w_last, l2 = choose_and_fit(last_train, y_train, prompt_of)
    w_mean, l2_mean = choose_and_fit(mean_train, y_train, prompt_of)
    head = classification_head(model)
    with torch.no_grad():
        head.weight.copy_(w_last[None].to(head.weight.dtype))  # [1, H]
        if getattr(head, "bias", None) is not None:
            head.bias.zero_()
    level = torch.tensor([r["difficulty"] for r in heldout for _ in range(per_prompt)])  # [N_held]
    s_held = last_held @ w_last  # [N_held]
    meta: dict[str, Any] = {
        "base": base,
        "task": "arithmetic",
        "difficulties": list(difficulties),
        "instruction": formatter.hparams.instruction,
        "num_train": num_train // per_prompt * per_prompt,
        "num_policy_train": len(y_train) - num_train // per_prompt * per_prompt,
        "num_heldout": len(y_held),
        "per_prompt": per_prompt,
        "sampling": {"temperature": temperature, "top_k": 0, "max_new_tokens": max_new_tokens},
        "seed": seed,
        "head": "score: linear, no bias, on the frozen trunk's last-token hidden state; logistic loss, LBFGS",
        "l2": l2,
        "train_positive_rate": y_train.float().mean().item(),
        "heldout": {
            "last_token": agreement(s_held, y_held),
            "by_difficulty": {int(d): agreement(s_held[level == d], y_held[level == d]) for d in difficulties},
            "mean_pooled_diagnostic": agreement(mean_held @ w_mean, y_held),
        },
        "mean_pooled_diagnostic": f"a head (l2={l2_mean}) on the completion's mean hidden state, for comparison "
        "only: the classifier reads the last token",
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if policy_samples:  # scored by the saved model itself, as GumbelTopK will load it
            scores = score_soft_sparse(load_reward_model(str(tmp), policy_tokenizer=tokenizer), eval_groups, pad_id=pad)
            last_eval, mean_eval = extract_features(model, eval_groups, pad_id=pad, desc="features (samples)")
            meta["policy_samples"] = {
                "questions": "held-out, difficulty 1",
                "last_token": agreement(scores, y_eval),
                "mean_pooled_diagnostic": agreement(mean_eval @ w_mean, y_eval),
                "feature_path_max_abs_diff": (scores - last_eval @ w_last).abs().max().item(),
                "examples": [
                    {"completion": t, "checker": float(y), "score": round(s.item(), 3)}
                    for t, y, s in list(zip(texts, y_eval, scores))[:32]
                ],
            }
        meta["seconds"] = {"sampling": t_sampling, "total": time.perf_counter() - t_start}
        meta["torch_threads"] = torch.get_num_threads()
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.replace(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def embedded_reward_model_path(*, train_if_missing: bool = True) -> Path:
    """The folder of the built-in arithmetic reward model on the embedded SmolLM2, trained on first use.

    Raises:
        FileNotFoundError: it is missing and ``train_if_missing`` is off.
    """
    target = cache_dir() / f"{EMBEDDED_NAME}-arithmetic-rm"
    if (target / META_FILE).exists():
        return target
    if not train_if_missing:
        raise FileNotFoundError(
            f"no reward model in {target}; train it with `lit-rl reward-model` (a few minutes on a CPU)"
        )
    rank_zero_info(
        f"lit-rl: training the built-in arithmetic reward model into {target} (once, a few minutes on a CPU)"
    )
    train_arithmetic_reward_model(target)
    return target


_OPTIONS = {  # option -> help; the defaults are train_arithmetic_reward_model's
    "base": "trunk, tokenizer and sampling policy: embedded, tiny:llama, or a causal LM folder",
    "num_train": "synthetic labelled pairs to fit on",
    "num_policy_train": "completions sampled from the policy, labelled by the checker, to fit on too",
    "num_heldout": "synthetic pairs on held-out questions for the metrics",
    "per_prompt": "completions per question",
    "difficulties": "arithmetic levels",
    "seed": "questions, completions and sampling",
    "policy_samples": "also measure agreement on this many policy samples on held-out questions",
    "max_new_tokens": "length limit of sampled completions",
    "temperature": "temperature of sampled completions",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lit-rl reward-model",
        description="Train the built-in arithmetic reward model (a score head on the frozen embedded SmolLM2).",
    )
    parser.add_argument("--out", help="folder to write (default: the cache folder embedded_reward_model_path reads)")
    defaults = inspect.signature(train_arithmetic_reward_model).parameters
    for name, text in _OPTIONS.items():
        default = defaults[name].default
        many = isinstance(default, tuple)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default[0]) if many else type(default),
            nargs="+" if many else None,
            default=default,
            help=f"{text} (default: {' '.join(map(str, default)) if many else default})",
        )
    return parser


def main(argv: list[str] | None = None) -> None:
    """``lit-rl reward-model``: train, save, and print the held-out agreement with the checker."""
    args = vars(_parser().parse_args(sys.argv[1:] if argv is None else argv))
    out = Path(args.pop("out") or cache_dir() / f"{EMBEDDED_NAME}-arithmetic-rm")
    args["difficulties"] = tuple(args["difficulties"])
    rank_zero_info(f"lit-rl reward-model: training on {args['base']}; writing {out}")
    try:
        meta = train_arithmetic_reward_model(out, **args)
    except (ValueError, FileExistsError, FileNotFoundError) as err:
        raise SystemExit(f"error: lit-rl reward-model: {err}") from err
    for name, part in (("held-out pairs", "heldout"), ("policy samples", "policy_samples")):
        if part not in meta:
            continue
        m = meta[part]["last_token"]
        rank_zero_info(
            f"{name}: accuracy {m['accuracy']:.3f}, AUC {m['auc'] or float('nan'):.3f} against the checker "
            f"(n={m['n']}, {m['positive_rate']:.0%} correct)"
        )
    rank_zero_info(f"wrote {out} in {meta['seconds']['total']:.0f} s (metrics in {out / META_FILE})")


if __name__ == "__main__":
    main()
