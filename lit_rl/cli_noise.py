"""Quiet start-up: Lightning's lines that say nothing about a run, and notices of optional kernels, filtered out.

Every other line passes; ``lit-rl`` calls :func:`quiet_lightning` once before it parses anything.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

#: Lightning's start-up lines that say nothing about the run, named by the function that logs them (the file
#: under lightning/pytorch/ and the function), not by their wording
_LIGHTNING_NOISE = {
    ("trainer/setup.py", "_log_device_info"),  # "GPU available: False, used: False", "TPU available: ..."
    ("trainer/connectors/logger_connector/logger_connector.py", "configure_logger"),  # the litlogger advert
    ("trainer/connectors/callback_connector.py", "_maybe_show_litmodels_tip"),  # the litmodels advert
}


class _DropLightningNoise(logging.Filter):
    """Drops the log records of :data:`_LIGHTNING_NOISE`; every other Lightning line passes."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        path = Path(record.pathname).as_posix()
        return not any(path.endswith(f"lightning/pytorch/{file}") and record.funcName == function
                       for file, function in _LIGHTNING_NOISE)  # fmt: skip


class _DropOptionalKernelNotice(logging.Filter):
    """Drops bitsandbytes' notice that the optional ``kernels`` package is absent; its other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


def quiet_lightning() -> None:
    """Silence what the libraries print on every run that is not about the run; their other lines and warnings stay.

    - Lightning's accelerator banner and the litlogger and litmodels adverts: a filter on the logger
      ``rank_zero_info`` writes to;
    - the ``FutureWarning`` torch raises when Lightning's ``utilities/_pytree.py`` builds a ``LeafSpec``
      (Lightning's own code, nothing a user can act on), matched by category and module as torch does itself;
    - the ``FutureWarning`` transformers >= 5.24 raises when peft reads ``is_gradient_checkpointing`` while it wraps
      a model for LoRA (peft's code, not the run's);
    - in sharded runs, torch's deprecation of the ``all_gather`` Lightning calls, and torch's notice that a sharded
      ``last.ckpt`` folder is overwritten (each save of ``save_last`` does that);
    - bitsandbytes' warning, on import (peft imports it for every LoRA run once it is installed), that the optional
      ``kernels`` package with a faster CPU decode kernel is absent: lit-rl never uses that kernel;
    - jsonargparse's (>= 4.53) warning that a tuple default of a parameter without a type hint is written to the
      run's ``config.yaml`` as a list (bitsandbytes' ``AdamW8bit(betas=(0.9, 0.999))``, which the planner chooses):
      the optimizer reads a list the same. Its other dump warnings pass.
    """
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropLightningNoise) for f in logger.filters):
        logger.addFilter(_DropLightningNoise())
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    # peft reads `model.is_gradient_checkpointing` when it wraps a model, a property transformers >= 5.24 deprecates
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # sharded runs: Lightning's all_gather (the metrics' mean, the RNG states) calls a torch function torch 2.13
    # deprecates, and each save of a sharded last.ckpt overwrites the folder, which is what save_last asks for
    warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated")
    warnings.filterwarnings("ignore", message=r"Detected an existing checkpoint in .*, overwriting since")
    warnings.filterwarnings(
        "ignore", message=r"\s*Dump of a value that does not round-trip: a tuple is serialized as list"
    )
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(f, _DropOptionalKernelNotice) for f in bnb.filters):
        bnb.addFilter(_DropOptionalKernelNotice())


__all__ = ["quiet_lightning"]
