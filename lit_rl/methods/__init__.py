"""The RL methods, one LightningModule each, on a thin shared base."""

from lit_rl.methods.base import RLMethod
from lit_rl.methods.grpo import RefCachedGRPO
from lit_rl.methods.gumbel_topk import GumbelTopK
from lit_rl.methods.intuitor import Intuitor

__all__ = ["GumbelTopK", "Intuitor", "RLMethod", "RefCachedGRPO"]
