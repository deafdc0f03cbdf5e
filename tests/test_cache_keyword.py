"""The KV-cache keyword: the name the installed transformers' forward takes, through a peft wrapper too."""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import DynamicCache

from lit_rl.models import LoraSettings, apply_lora, cache_keyword, cache_kwargs, load_causal_lm, output_cache


def test_the_keyword_is_the_one_the_forward_names_and_a_cached_forward_raises_no_deprecation():
    model = load_causal_lm("tiny:llama")
    named = inspect.signature(type(model).forward).parameters
    expected = "cache" if "cache" in named else "past_key_values"
    wrapped = apply_lora(load_causal_lm("tiny:llama"), LoraSettings(r=4))
    assert cache_keyword(model) == expected and cache_keyword(wrapped) == expected
    assert cache_keyword(object()) == "past_key_values"  # nothing to read: the long-standing name

    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    for m in (model, wrapped):
        cache = DynamicCache(config=model.config)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a deprecated keyword or output field would raise here
            out = m(input_ids=ids, **cache_kwargs(m, cache), use_cache=True, return_dict=True)
            assert output_cache(out) is cache and cache.get_seq_length() == 5
