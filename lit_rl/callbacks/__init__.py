"""Memory tactics, memory profiling, the run log and a gradient-noise measurement as Lightning callbacks; add each with a YAML fragment from
``callbacks/`` (the configs list ``RunLog`` themselves). Beside them the checkpoint IO plugin every ``lit-rl`` run
saves with (``trainer.plugins``)."""

from lit_rl.callbacks.activation_checkpointing import ActivationCheckpointing
from lit_rl.callbacks.activation_offloading import ActivationOffloading
from lit_rl.callbacks.checkpoint_io import StreamingCheckpointIO
from lit_rl.callbacks.empty_cache import EmptyCache
from lit_rl.callbacks.gradient_noise import GradientNoise
from lit_rl.callbacks.memory_profiler import MemoryProfiler
from lit_rl.callbacks.oom_report import OOMReport
from lit_rl.callbacks.progress_bar import StepProgressBar
from lit_rl.callbacks.run_log import RunLog

__all__ = [
    "ActivationCheckpointing",
    "ActivationOffloading",
    "EmptyCache",
    "GradientNoise",
    "MemoryProfiler",
    "OOMReport",
    "RunLog",
    "StepProgressBar",
    "StreamingCheckpointIO",
]
