"""Logits-free token math from hidden states and the LM head (with its logit scale / softcap), full-vocabulary KL,
top-k Gumbel-softmax."""

from lit_rl.ops.gumbel import gumbel_softmax_topk
from lit_rl.ops.head import HeadSpec
from lit_rl.ops.kl import kl_divergence
from lit_rl.ops.token_math import TokenStats, entropy, selective_log_probs, self_certainty, token_stats

__all__ = [
    "HeadSpec",
    "TokenStats",
    "entropy",
    "gumbel_softmax_topk",
    "kl_divergence",
    "selective_log_probs",
    "self_certainty",
    "token_stats",
]
