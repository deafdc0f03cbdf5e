"""The built-in reward model: a small head on the frozen embedded trunk, its fit and the command that refits it.

This module says where the shipped head is (a method that loads the built-in reward model needs nothing more) and
gives a reward model as a reward function (:mod:`lit_rl.reward_model.score`); the fit and the command live in
:mod:`lit_rl.reward_model.train`, which imports the data module.
"""

from __future__ import annotations

from pathlib import Path

from lit_rl.reward_model.score import RewardModelScore, shipped_sentiment

META_FILE = "reward_model.json"
HEAD_FILE = "head.safetensors"
#: the head fitted on the embedded model's trunk, shipped inside the package (written by ``lit-rl reward-model``)
SHIPPED_HEAD_DIR = Path(__file__).parent / "heads" / "smollm2_sentiment"


def shipped_head_file() -> str:
    """The ``.safetensors`` head of the built-in sentiment reward model on the embedded SmolLM2 trunk."""
    return str(SHIPPED_HEAD_DIR / HEAD_FILE)


__all__ = ["HEAD_FILE", "META_FILE", "SHIPPED_HEAD_DIR", "RewardModelScore", "shipped_head_file", "shipped_sentiment"]
