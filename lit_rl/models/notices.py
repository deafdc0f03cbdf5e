"""Lines a run says once, however often the code that finds them runs (each rollout asks again)."""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_info

_said: set[str] = set()


def say_once(message: str) -> None:
    """``rank_zero_info(message)`` the first time this process is given ``message``."""
    if message not in _said:
        _said.add(message)
        rank_zero_info(message)
