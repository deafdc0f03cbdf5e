"""Prompt data: the DataModule, built-in tasks, reward functions and density-aware sampling.

The built-in reward functions a config names by path (``lit_rl.data.rewards.correct_answer``) are importable from
here too: :func:`correct_answer`, :func:`number_only`.
"""

from lit_rl.data.datamodule import PromptDataModule
from lit_rl.data.rewards import correct_answer, number_only

__all__ = ["PromptDataModule", "correct_answer", "number_only"]
