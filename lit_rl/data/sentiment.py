"""The built-in sentiment task: movie-review openings to continue, scored by two lexicons that ship their data.

The paper behind GumbelTopK (cited in :mod:`lit_rl.methods.gumbel_topk`) shows its differentiable rollouts on
continuing movie-review openings toward positive sentiment. This module makes that task offline, on any machine:

- **Openings** are generated from templates (an opener in one of three tones, a film, an aspect), a few
  thousand distinct texts. A fixed fifth of them, chosen by a hash of the text, is held out: no training
  prompt, and no prompt the built-in reward model was fitted on, is ever a held-out prompt.
- **The labeller** is VADER (Hutto and Gilbert, ICWSM 2014; the ``vaderSentiment`` package ships its
  lexicon): the compound score of the completion alone, so what is measured is what the policy wrote,
  not the opening it was given. The built-in reward model's labels and GRPO's reward on this task are
  VADER's.
- **The judge** is AFINN (Nielsen, arXiv 1103.2903; the ``afinn`` package ships the word list): a second,
  independently made lexicon that nothing is trained on. A policy that games VADER's lexicon (or the
  reward model's reading of it) without writing positive text shows up as a gap between the two.

Reward-shaped functions here follow :mod:`lit_rl.data.rewards`: ``fn(completions, answers=..., prompts=...)``
returns one float per completion, so they can be named in ``reward_funcs`` or ``metric_funcs``.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
from typing import Any, Literal

# openers per tone of the opening: {film} and {aspect} are filled in, and each opening ends mid-sentence,
# right where the policy's continuation decides the sentiment
_OPENERS: dict[str, tuple[str, ...]] = {
    "positive": (
        "I loved {film}, and {aspect}",
        "From the very first scene of {film}, {aspect}",
        "I went in with low expectations for {film}, but {aspect}",
        "My whole family enjoyed {film}. {Aspect}",
        "Years from now people will still talk about {film}, because {aspect}",
        "I was pleasantly surprised by {film}: {aspect}",
    ),
    "negative": (
        "I wanted to like {film}, but {aspect}",
        "I regret paying to see {film}; {aspect}",
        "Two hours of my life went to {film}, and {aspect}",
        "Everyone told me {film} was good, but {aspect}",
        "I walked out of {film} halfway through, because {aspect}",
        "It pains me to say it about {film}, but {aspect}",
    ),
    "neutral": (
        "I watched {film} last night, and {aspect}",
        "After seeing {film} twice, I think {aspect}",
        "A friend recommended {film} to me. {Aspect}",
        "Here are my thoughts on {film}. First of all, {aspect}",
        "I saw {film} at a festival last week, and {aspect}",
    ),
}
_FILMS = (
    "this movie", "this film", "the sequel", "this thriller", "this comedy", "the documentary",
    "this drama", "the remake", "this horror film", "this animated film", "the director's latest film",
    "this romance", "this western", "this war film", "the musical", "this mystery", "this crime drama",
)  # fmt: skip
_ASPECTS = (
    "the acting", "the plot", "the soundtrack", "the dialogue", "the ending", "the pacing",
    "the cinematography", "the special effects", "the lead performance", "the script", "the supporting cast",
    "the costumes", "the editing", "the villain", "the humor", "the story",
)  # fmt: skip

Split = Literal["train", "heldout", "all"]


def is_heldout(text: str) -> bool:
    """A fixed fifth of all texts (by hash), whatever the sizes and seeds: the held-out split."""
    return int(hashlib.md5(text.encode()).hexdigest(), 16) % 5 == 0


@functools.cache
def _all_openings() -> tuple[tuple[str, str], ...]:
    """Every ``(opening, tone)`` the templates make, in a fixed order."""
    out = []
    for tone, openers in _OPENERS.items():
        for opener in openers:
            for film in _FILMS:
                for aspect in _ASPECTS:
                    out.append((opener.format(film=film, aspect=aspect, Aspect=aspect[0].upper() + aspect[1:]), tone))
    return tuple(out)


def review_openings(num_prompts: int | None = None, *, split: Split = "train", seed: int = 0) -> list[dict[str, Any]]:
    """Movie-review openings ``{"prompt": opening, "answer": tone}``, shuffled with ``seed``.

    Args:
        num_prompts: how many (distinct) openings; ``None`` for all of the split.
        split: ``train`` (four fifths of the texts), ``heldout`` (the other fifth, see :func:`is_heldout`) or ``all``.
        seed: the order; the same seed gives the same openings.

    Raises:
        ValueError: more openings asked for than the split has; the message gives the number.
    """
    pool = [
        (text, tone) for text, tone in _all_openings() if split == "all" or is_heldout(text) == (split == "heldout")
    ]
    random.Random(seed).shuffle(pool)
    if num_prompts is not None:
        if not 1 <= num_prompts <= len(pool):
            raise ValueError(
                f"data.num_prompts: {num_prompts} review openings asked for, the {split} split has {len(pool)}; "
                f"give 1 to {len(pool)}"
            )
        pool = pool[:num_prompts]
    return [{"prompt": text, "answer": tone} for text, tone in pool]


@functools.cache
def _vader():
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError as err:  # a dependency of lit-rl; missing only in a broken install
        raise ImportError("the sentiment task needs vaderSentiment: `pip install vaderSentiment`") from err
    return SentimentIntensityAnalyzer()


@functools.cache
def _afinn():
    try:
        from afinn import Afinn
    except ImportError as err:
        raise ImportError("the sentiment judge needs afinn: `pip install afinn`") from err
    return Afinn(language="en")


_SPACE = re.compile(r"\s+")

#: VADER's own threshold for a positive text (compound >= 0.05), from the package's documentation
VADER_POSITIVE = 0.05


def vader_compound(completions: list[str], **_: Any) -> list[float]:
    """VADER's compound score of each completion, in [-1, 1] (the labeller; GRPO's reward on this task)."""
    analyzer = _vader()
    return [analyzer.polarity_scores(_SPACE.sub(" ", c))["compound"] for c in completions]


def vader_positive(completions: list[str], **_: Any) -> list[float]:
    """1.0 when VADER calls the completion positive (compound >= 0.05), else 0.0: the reward model's label."""
    return [float(s >= VADER_POSITIVE) for s in vader_compound(completions)]


def afinn_positive(completions: list[str], **_: Any) -> list[float]:
    """1.0 when the AFINN word scores of the completion sum above 0, else 0.0: the independent judge."""
    judge = _afinn()
    return [float(judge.score(c) > 0) for c in completions]


def afinn_score(completions: list[str], **_: Any) -> list[float]:
    """AFINN's word scores of the completion summed, per word (so a longer text is not scored higher for its length)."""
    judge = _afinn()
    return [judge.score(c) / max(len(c.split()), 1) for c in completions]
