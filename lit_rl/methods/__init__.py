"""The RL methods, one LightningModule each, on a thin shared base."""

from lit_rl.methods.base import RLMethod
from lit_rl.methods.grpo import RefCachedGRPO

__all__ = ["RLMethod", "RefCachedGRPO"]
