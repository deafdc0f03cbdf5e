"""The keyword under which a model's forward takes its KV cache.

transformers 5.24 renamed the forward's ``past_key_values`` argument (and the output field) to ``cache`` and warns on
the old name until 5.40, where the old name goes away; releases before 5.24, and remote-code models written for them,
take only ``past_key_values``. Every cached forward in lit-rl passes the cache under :func:`cache_keyword` (the
loops that step token by token read it once per rollout), so one code path serves both, with no warning on either.
"""

from __future__ import annotations

import inspect
from typing import Any

from lit_rl.models.head import base_model

__all__ = ["cache_keyword", "cache_kwargs", "output_cache"]


def cache_keyword(model: Any) -> str:
    """``"cache"`` when the model's forward names that parameter (transformers >= 5.24), else ``"past_key_values"``.

    A peft wrapper passes its keywords through to the transformers model under it, whose signature decides.
    """
    forward = getattr(base_model(model), "forward", None)
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a builtin or a wrapped callable without a signature: the long-standing name
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model(**inputs, **cache_kwargs(model, cache))``."""
    return {cache_keyword(model): cache}


def output_cache(output: Any) -> Any:
    """The cache a forward returned, read by the field name its transformers release uses."""
    fields = output.keys() if hasattr(output, "keys") else ()
    return output["cache"] if "cache" in fields else output.past_key_values
