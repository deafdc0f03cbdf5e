"""Memory tactics and memory profiling as Lightning callbacks; add each with a YAML fragment from ``callbacks/``."""

from lit_rl.callbacks.activation_checkpointing import ActivationCheckpointing
from lit_rl.callbacks.empty_cache import EmptyCache
from lit_rl.callbacks.memory_profiler import MemoryProfiler
from lit_rl.callbacks.oom_report import OOMReport

__all__ = ["ActivationCheckpointing", "EmptyCache", "MemoryProfiler", "OOMReport"]
