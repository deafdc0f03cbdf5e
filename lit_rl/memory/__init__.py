"""Memory: phases of a step, exact tensor accounting, the estimator and its tactics, the roofline.

What a user calls directly, importable from here:

- :func:`estimate_step`: the per-phase peak of one training step of a method, predicted on fake tensors before a
  weight is loaded (what ``lit-rl estimate`` runs); :class:`Estimate` is its result, :func:`settings_from` the
  keyword arguments a datamodule, a precision and callbacks give it, :func:`estimate_for_trainer` the same for a
  method under a Trainer, and :data:`BUILTIN_SHAPES` the model shapes ``--model-config shape:<name>`` names;
- :class:`TensorMemoryTracker`: exact bytes held by tensors, on any device, as a ``TorchDispatchMode`` (what the
  ``MemoryProfiler`` measures with on CPU), filing them under :data:`CATEGORIES`;
- :func:`read_rss`, :func:`read_peak_rss` and :func:`reset_peak_rss`: the process's resident memory now and its
  high-water mark since the last reset (what the profiler logs beside the tensor bytes);
- :func:`format_bytes` and :func:`parse_bytes`: the byte sizes every memory tool prints (``1.52 GiB``), and reading
  them back (``--device-memory 24GB``, a printed table's cell).

The other modules (phases, peaks, the fake-tensor substitutions, the tactic table, the roofline and the host
allocator) are what the methods, callbacks and the CLI are built from; ``docs/development.md`` lists
them.
"""

from lit_rl.memory.estimate import estimate_for_trainer, estimate_step, settings_from
from lit_rl.memory.report import Estimate
from lit_rl.memory.rss import read_peak_rss, read_rss, reset_peak_rss
from lit_rl.memory.shapes import BUILTIN_SHAPES
from lit_rl.memory.tracker import CATEGORIES, TensorMemoryTracker
from lit_rl.memory.units import format_bytes, parse_bytes

__all__ = [
    "BUILTIN_SHAPES",
    "CATEGORIES",
    "Estimate",
    "TensorMemoryTracker",
    "estimate_for_trainer",
    "estimate_step",
    "format_bytes",
    "parse_bytes",
    "read_peak_rss",
    "read_rss",
    "reset_peak_rss",
    "settings_from",
]
