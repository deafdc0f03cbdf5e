"""A reward model as a reward function: any method can be rewarded by the score GumbelTopK backpropagates.

GumbelTopK (:mod:`lit_rl.methods.gumbel_topk`) differentiates a reward model's score through its soft rollouts;
a policy-gradient method only needs the score of each finished completion. :class:`RewardModelScore` is that score
as a plain reward function (``fn(completions, prompts=...)``, one float per completion): the prompt's tokens then the
completion's, read by the same ``forward_soft_sparse`` GumbelTopK calls (one-hot soft tokens, so the value is the
model's own score of those tokens), in batches, without gradients. The model loads at the first call and stays.

Name an instance by import path in ``model.reward_funcs``; the built-in one is :data:`shipped_sentiment`, the
sentiment head shipped with lit-rl on the embedded trunk (the reward model of ``configs/gumbel_topk.yaml``)::

    model:
      init_args:
        reward_funcs: [lit_rl.reward_model.shipped_sentiment]

Another reward model is one line in your own module, ``my_rm = RewardModelScore("path/to/classifier")``, named as
``my_pkg.rewards.my_rm``. The memory estimate does not count a reward function's model (it is outside the method's
step); the memory profiler does measure it.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_rl.reward_model.fit import pad

__all__ = ["RewardModelScore", "score_pairs", "shipped_sentiment"]


@torch.no_grad()
def score_pairs(model, pairs: list[tuple[list[int], list[int]]], *, pad_id: int, batch_size: int = 32) -> torch.Tensor:
    """``[N]`` float32 scores on the CPU of ``(prompt ids, completion ids)`` pairs (completions non-empty), through
    ``model.forward_soft_sparse`` with one-hot soft tokens, ``batch_size`` pairs per forward on the model's device:
    prompts left-padded, completions right-padded."""
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        ids, prompt_mask = pad([p for p, _ in chunk], pad_id, left=True)  # [b, P]
        comp, comp_mask = pad([c for _, c in chunk], pad_id, left=False)  # [b, C]
        mask = torch.cat([prompt_mask, comp_mask], dim=1).to(device)  # [b, P + C]
        weights = torch.ones(*comp.shape, 1, device=device)  # [b, C, 1] one-hot soft tokens
        out.append(model.forward_soft_sparse(ids.to(device), comp[..., None].to(device), weights, mask).float().cpu())
    return torch.cat(out) if out else torch.zeros(0)


class RewardModelScore:
    """A reward model's score of each completion after its prompt, as a reward function.

    Args:
        name_or_path: as :func:`lit_rl.models.load_reward_model` takes it (``embedded`` with ``head="shipped"``:
            the built-in sentiment reward model).
        head: ``shipped`` (the built-in head file), a ``.safetensors`` head file, or ``None`` (the checkpoint's own).
        batch_size: completions per forward.
        device: ``auto`` (CUDA when there is one, else CPU) or a torch device name.
        dtype: the reward model's weights, as :func:`~lit_rl.models.load_reward_model` takes it.
    """

    def __init__(
        self,
        name_or_path: str = "embedded",
        *,
        head: str | None = None,
        batch_size: int = 32,
        device: str = "auto",
        dtype: str = "float32",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"RewardModelScore.batch_size: must be >= 1, got {batch_size}")
        self.name_or_path, self.head, self.batch_size, self.dtype = name_or_path, head, batch_size, dtype
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   "cpu" if device == "auto" else device)  # fmt: skip
        self.model = self.tokenizer = None

    def load(self) -> None:
        """Load the tokenizer and the frozen reward model (the first call does it)."""
        from lit_rl.models import load_reward_model, load_tokenizer
        from lit_rl.reward_model import shipped_head_file

        self.tokenizer = load_tokenizer(self.name_or_path)
        head_file = shipped_head_file() if self.head == "shipped" else self.head
        self.model = load_reward_model(self.name_or_path, policy_tokenizer=self.tokenizer, dtype=self.dtype,
                                       vocab_size=len(self.tokenizer), head_file=head_file).to(self.device)  # fmt: skip

    def scores(self, completions: list[str], prompts: list[str]) -> torch.Tensor:
        """``[N]`` float32 scores on the CPU; an empty completion is scored as the EOS token alone."""
        if self.model is None:
            self.load()
        tok = self.tokenizer
        pairs = [(tok(p, add_special_tokens=False)["input_ids"],
                  tok(c, add_special_tokens=False)["input_ids"] or [tok.eos_token_id])
                 for p, c in zip(prompts, completions, strict=True)]  # fmt: skip
        return score_pairs(self.model, pairs, pad_id=tok.pad_token_id, batch_size=self.batch_size)

    def __call__(self, completions: list[str], prompts: list[str] | None = None, **_: Any) -> list[float]:
        if prompts is None:
            prompts = [""] * len(completions)
        return self.scores(completions, prompts).tolist()


#: the built-in sentiment reward model (the shipped head on the embedded trunk), the one GumbelTopK's demo optimises
shipped_sentiment = RewardModelScore("embedded", head="shipped")
