"""Logits-free token math from hidden states and the LM head (with its logit scale / softcap), full-vocabulary KL,
top-k Gumbel-softmax, and a gradient sink for a weight read many times in one pass.

:func:`plan_chunks` says how the token math blocks the logits for given sizes: the tokens and vocabulary rows of
one float32 logits block, within ``LOGITS_BUDGET_BYTES`` (64 MiB) unless ``chunk_size`` is set.
"""

from lit_rl.ops.gradient_sink import GradientSink
from lit_rl.ops.gumbel import gumbel_softmax_topk
from lit_rl.ops.head import HeadSpec
from lit_rl.ops.kl import kl_divergence
from lit_rl.ops.token_math import (
    LOGITS_BUDGET_BYTES,
    TokenStats,
    entropy,
    plan_chunks,
    selective_log_probs,
    self_certainty,
    token_stats,
)

__all__ = [
    "GradientSink",
    "LOGITS_BUDGET_BYTES",
    "HeadSpec",
    "TokenStats",
    "entropy",
    "gumbel_softmax_topk",
    "kl_divergence",
    "plan_chunks",
    "selective_log_probs",
    "self_certainty",
    "token_stats",
]
