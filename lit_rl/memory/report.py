"""What an estimate returns: the per-phase peaks and the table of what holds memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_rl.memory.units import GIB, format_bytes


@dataclass
class Component:
    """One line of the component table: what holds memory, its shape and its bytes."""

    name: str
    shape: str
    bytes: int
    note: str = ""


@dataclass
class Estimate:
    """Predicted per-phase peaks (bytes held by tensors) of one steady-state training step.

    Attributes:
        phases: phase -> peak bytes, the phases the step announces (``reference`` is absent with
            ``beta = 0`` and one iteration); the same quantity as ``memory/<phase>/peak_gib``.
        first_step: the same for the first step, before the optimizer state exists.
        breakdown: phase -> bytes per category (:data:`~lit_rl.memory.tracker.CATEGORIES`) at its peak.
        components: the table of what holds memory (parameters, gradients, optimizer state, KV cache, ...).
        settings: what was assumed (model, batch, lengths, precision, micro-batch, tactics, ...).
        seconds: wall time of the estimate.
    """

    phases: dict[str, int]
    first_step: dict[str, int]
    breakdown: dict[str, dict[str, int]]
    components: list[Component]
    settings: dict[str, Any]
    seconds: float = 0.0

    @property
    def peak_bytes(self) -> int:
        """The step's peak: the largest phase peak."""
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r}; have {[c.name for c in self.components]}")

    def table(self) -> str:
        """The component table and the per-phase peaks, as plain text."""
        s = self.settings
        lines = [
            f"{s['method']} on {s['model']} ({s['architecture']}), precision {s['precision']}, "
            f"{'LoRA' if s['lora'] else 'full fine-tuning'}, predicted for {s['device_type']}",
            f"batch {s['batch']} completions ({s['prompts']} prompt{'s' * (s['prompts'] != 1)} x {s['num_generations']} "
            f"generations), "
            f"prompt {s['prompt_length']} + {s['max_new_tokens']} new tokens = {s['sequence_length']}, "
            f"micro-batch {s['micro_batch_size']}, activation checkpointing "
            f"{'on' if s['activation_checkpointing'] else 'off'}, attention mask "
            f"{'built (padded prompts)' if s['padded'] else 'skipped (no padding)'}",
            "",
        ]
        if s.get("rollout_gather") is not None:  # sharded (FSDP2)
            layers = s.get("rollout_gather") == "layers"
            gather = "layer by layer" if layers else "the whole policy (rollout_gather auto, when it fits, or whole)"
            lines[-1:-1] = [
                f"sharded over {s['shard_processes']} processes (FSDP2): the phase peaks are one process's (its share "
                "of the weights, gradients and optimizer state, and the weights it gathers); the components are the "
                f"whole model's; the rollout gathers {gather}"
                + (
                    "; cpu_offload: the peaks are the device's, the shards, their gradients and the optimizer state "
                    "stay in host memory"
                    if s.get("shard_offload")
                    else ""
                )
            ]
        width = max(len(c.name) for c in self.components)
        shape_w = max(len(c.shape) for c in self.components)
        lines.append(f"{'component':<{width}}  {'shape':<{shape_w}}  {'bytes':>15}  {'':>10}  note")
        for c in self.components:
            lines.append(
                f"{c.name:<{width}}  {c.shape:<{shape_w}}  {c.bytes:>15,}  {format_bytes(c.bytes):>10}  {c.note}"
            )
        lines += ["", f"{'phase':<15} {'peak GiB':>9} {'peak':>10} {'first step':>11}   at the peak"]
        for name, peak in self.phases.items():
            parts = [f"{k} {format_bytes(v)}" for k, v in self.breakdown.get(name, {}).items() if v >= 0.005 * peak]
            lines.append(
                f"{name:<15} {peak / GIB:>9.4f} {format_bytes(peak):>10} {self.first_step[name] / GIB:>11.4f}   "
                f"{', '.join(parts)}"
            )
        first = max(self.first_step.values())
        lines.append(
            f"{'step':<15} {self.peak_bytes / GIB:>9.4f} {format_bytes(self.peak_bytes):>10} {first / GIB:>11.4f}"
        )
        lines.append(
            "\ntensor bytes (what memory/<phase>/peak_gib measures); a GPU adds the CUDA context, workspaces and "
            "allocator fragmentation on top.\n"
            f"an upper bound for a run's steps: every prompt padded to {s['prompt_length']} tokens and every completion "
            f"{s['max_new_tokens']} tokens long; the MemoryProfiler predicts each measured step at its own lengths."
        )
        return "\n".join(lines)
