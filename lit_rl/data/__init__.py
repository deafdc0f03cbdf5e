"""Prompt data: the DataModule, built-in tasks, reward functions and density-aware sampling."""

from lit_rl.data.datamodule import PromptDataModule

__all__ = ["PromptDataModule"]
