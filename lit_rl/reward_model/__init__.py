"""The built-in reward model: a small head on the frozen embedded trunk, its fit and the command that refits it."""
