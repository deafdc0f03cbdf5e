"""Held-out evaluation for every method: complete held-out prompts, score them, aggregate with torchmetrics.

Every method is evaluated the same way, whatever its training step: the policy completes each held-out
prompt with plain token sampling (``generate``, greedy by default), and the method's text reward functions
(``reward_funcs``, where it has them) and its ``metric_funcs`` score the completions. GumbelTopK's reward
model and Intuitor's self-certainty are training signals, not held-out scores, so they are not re-run here;
give those methods a checker in ``metric_funcs`` (the configs use ``correct_answer``).

Scores are accumulated in :class:`torchmetrics.MeanMetric` objects, which sum and count on each process
and add the sums and counts of all processes in ``compute()``: the held-out score of a DDP run is the mean
over every completion of every rank, not a mean of per-rank means. (Lightning's distributed sampler pads
the last batch of a rank with repeated prompts when the held-out set does not split evenly.)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import MeanMetric

from lit_rl.models import sample_completions


@dataclass
class EvalSettings:
    """How held-out prompts are completed and scored (``model.init_args.evaluation``).

    When evaluation runs is the Trainer's business: ``trainer.val_check_interval: N`` with
    ``trainer.check_val_every_n_epoch: null`` evaluates every N training batches (= optimizer steps with
    ``num_iterations: 1``), and ``lit-rl validate`` / ``lit-rl test`` evaluate a checkpoint.

    Args:
        num_samples: completions per held-out prompt. Above 1, ``val/<name>/pass@k`` is logged (unbiased
            estimator of Chen et al. 2021) for k = 2, 4, ... and k = ``num_samples``. Memory and time:
            evaluation generates ``num_samples`` times as many sequences per batch.
        temperature: 0 decodes greedily; above 0 samples at this temperature.
        top_p: nucleus sampling when ``temperature > 0``.
        max_new_tokens: generation limit; ``null`` uses the method's (``rollout_shape().max_new_tokens``), or 32
            tokens for a method that generates nothing in training.
        pass_threshold: a completion passes when a function scores it at least this (pass@k only).
        before_training: evaluate once before the first training step (logged at step 0), so the curve
            starts from the untrained model.
    """

    num_samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int | None = None
    pass_threshold: float = 1.0
    before_training: bool = True

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"model.evaluation.num_samples must be >= 1, got {self.num_samples}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("model.evaluation.temperature must be >= 0 and model.evaluation.top_p in (0, 1]")
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(
                f"model.evaluation.num_samples is {self.num_samples} with greedy decoding (temperature 0), which draws "
                "the same completion every time; set model.evaluation.temperature > 0 or num_samples: 1"
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"model.evaluation.max_new_tokens must be >= 1 or null, got {self.max_new_tokens}")


def distinct_bigrams(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` share of distinct token bigrams among each row's bigrams (distinct-2, Li et al. 2016, arXiv 1510.03055).

    A degeneration signal: text that loops on a phrase falls toward 0, varied text stays near 1. Rows of ``ids
    [B, C]`` are read up to their ``lengths [B]``; a row with fewer than two tokens has no bigram and scores 1.
    """
    out = []
    for row, n in zip(ids.tolist(), lengths.long().tolist()):
        pairs = list(zip(row[: n - 1], row[1:n]))
        out.append(len(set(pairs)) / len(pairs) if pairs else 1.0)
    return torch.tensor(out, dtype=torch.float32)


def pass_at_k(n: int, c: torch.Tensor, k: int) -> torch.Tensor:
    """Unbiased pass@k per prompt from ``c [B]`` passing samples out of ``n``: ``1 - C(n - c, k) / C(n, k)``."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    fail = torch.tensor([math.comb(n - int(ci), k) / math.comb(n, k) for ci in c.tolist()], dtype=torch.float64)
    return (1.0 - fail).float()  # [B]


def pass_ks(n: int) -> list[int]:
    """The k of pass@k logged for ``n`` samples: powers of two below ``n``, then ``n`` (none for one sample)."""
    if n < 2:
        return []
    return sorted({2**i for i in range(1, n.bit_length()) if 2**i < n} | {n})


class HeldOutEvaluation:
    """``validation_step`` / ``test_step`` for an :class:`~lit_rl.methods.base.RLMethod` (mixed into its base).

    **Logged Metrics** (per evaluation, at the training step it follows; ``test/`` instead of ``val/`` for
    ``lit-rl test``): ``val/<function>`` (mean score of each reward and metric function over every held-out
    completion), ``val/<function>/pass@<k>`` (with ``num_samples > 1``), ``val/completions/mean_length``,
    ``val/completions/clipped_ratio``, ``val/completions/distinct_bigrams`` (see :func:`distinct_bigrams`).

    Each evaluation also writes its completions, one JSON line per completion with its prompt and scores, to
    ``heldout/<val|test>_step<N>.jsonl`` in the run's log folder (``_rank<r>`` added per process under DDP), so
    what the scores mean can be read, and a scorer that is not part of the run can be applied afterwards.

    The host provides ``policy``, ``tokenizer``, ``eos_ids()``, ``decode()``, ``score_functions()``,
    ``rollout_shape()`` (the completion length when ``evaluation.max_new_tokens`` is null), ``metric_names`` /
    ``metric_fns`` (and optionally ``reward_names`` / ``reward_fns``, and ``share_prompt``) and
    ``evaluation_settings`` (an :class:`EvalSettings`). The batches are the datamodule's ``val_dataloader``
    batches: ``input_ids`` and ``attention_mask`` (left-padded prompts), ``prompts`` and ``answers``.
    """

    evaluation_settings: EvalSettings

    # ------------------------------------------------------------------ Lightning hooks
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.evaluate_batch(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.evaluate_batch(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self.log_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self.log_evaluation("test")

    def on_train_start(self) -> None:
        """Evaluate once before the first step (a fresh run only, and only when there are held-out prompts)."""
        trainer = self.trainer
        if not self.evaluation_settings.before_training or trainer.global_step > 0:
            return
        loop = trainer.fit_loop.epoch_loop.val_loop
        loop.setup_data()
        if loop.skip:
            return
        rank_zero_info("held-out evaluation before the first training step")
        # what Lightning's training loop does around its own validation runs
        trainer.validating = True
        try:
            loop.run()
        finally:
            trainer.training = True

    # ------------------------------------------------------------------ the work
    def evaluation_functions(self) -> tuple[list[str], list]:
        """Names and callables scored on held-out completions: the text rewards, then the metric functions."""
        names = list(getattr(self, "reward_names", [])) + list(self.metric_names)
        fns = list(getattr(self, "reward_fns", [])) + list(self.metric_fns)
        keep = [i for i, name in enumerate(names) if name not in names[:i]]  # a checker may be both
        return [names[i] for i in keep], [fns[i] for i in keep]

    @torch.no_grad()
    def generate_held_out(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``num_samples`` completions per prompt: ``(completion ids [B*n, C], lengths [B*n])`` up to the first EOS."""
        s = self.evaluation_settings
        n = s.num_samples
        eos = self.eos_ids()
        sample = s.temperature > 0
        limit = s.max_new_tokens or self.rollout_shape().max_new_tokens or 32
        config = dict(do_sample=sample, max_new_tokens=limit)
        if sample:
            config.update(temperature=s.temperature, top_p=s.top_p, top_k=0)
        sequences = sample_completions(
            self.policy, input_ids, attention_mask, self.tokenizer.pad_token_id, eos,
            repeats=n, share_prompt=getattr(self, "share_prompt", False), own_decode=getattr(self, "own_decode", False),
            rows_at_once=self.hparams.get("rollout_rows"), **config,
        )  # [B*n, P + C]  # fmt: skip
        completion = sequences[:, input_ids.shape[1] :]  # [B*n, C]
        is_eos = torch.isin(completion, torch.tensor(eos, device=completion.device))  # [B*n, C]
        ended = is_eos.any(1)  # [B*n]
        lengths = torch.where(ended, is_eos.int().argmax(1) + 1, completion.shape[1])  # [B*n] EOS counted
        return completion, lengths

    def evaluate_batch(self, batch: dict[str, Any], prefix: str) -> None:
        """Complete and score one batch of held-out prompts; the scores go into this evaluation's metrics."""
        n = self.evaluation_settings.num_samples
        completion, lengths = self.generate_held_out(batch["input_ids"], batch["attention_mask"])
        texts = self.decode(completion, lengths)
        names, fns = self.evaluation_functions()
        scores = self.score_functions(fns, names, texts, batch, n)  # [B*n, F]
        eos = torch.tensor(self.eos_ids(), device=completion.device)
        clipped = (~torch.isin(completion, eos).any(1)).float()  # [B*n]
        values: dict[str, torch.Tensor] = {
            "completions/mean_length": lengths.float(),
            "completions/clipped_ratio": clipped,
            "completions/distinct_bigrams": distinct_bigrams(completion, lengths),
        }
        for i, name in enumerate(names):
            values[name] = scores[:, i]
            passed = (scores[:, i] >= self.evaluation_settings.pass_threshold).view(-1, n).sum(1)  # [B]
            for k in pass_ks(n):
                values[f"{name}/pass@{k}"] = pass_at_k(n, passed, k)
        for name, value in values.items():
            self.held_out_metric(prefix, name).update(value.to(self.device))
        prompts = [p for p in batch["prompts"] for _ in range(n)]
        rows = self.__dict__.setdefault("_held_out_rows", [])  # a plain list: not saved in checkpoints
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            scored = {k: round(float(v[i]), 4) for k, v in values.items() if "/pass@" not in k}  # pass@k: per prompt
            rows.append({"prompt": prompt, "completion": text, **scored})

    def held_out_metric(self, prefix: str, name: str) -> MeanMetric:
        """The running mean behind ``<prefix>/<name>`` (created on first use, on the module's device)."""
        store = self.__dict__.setdefault("_held_out_metrics", {})  # a plain dict: not a submodule, not in checkpoints
        key = f"{prefix}/{name}"
        if key not in store:
            # float32 sums whatever the default dtype: bf16-true sets bf16 inside validation_step, and 300 scores
            # summed in bf16 reported a mean length above the length limit
            store[key] = MeanMetric().set_dtype(torch.float32).to(self.device)
        return store[key]

    def log_evaluation(self, prefix: str) -> dict[str, float]:
        """Compute (summed over processes), log and reset the metrics of one evaluation; returns the values."""
        store = self.__dict__.get("_held_out_metrics", {})
        values = {}
        for key in [k for k in store if k.startswith(f"{prefix}/")]:
            metric = store.pop(key)
            if metric.update_count:
                values[key] = metric.compute()  # all ranks' sums and counts
        if values and not self.trainer.sanity_checking:
            self.log_dict(values, on_step=False, on_epoch=True, sync_dist=False)  # already reduced over ranks
            self._write_held_out_rows(prefix)
        self.__dict__["_held_out_rows"] = []
        self.last_evaluation = {k: float(v) for k, v in values.items()}
        return self.last_evaluation

    def _write_held_out_rows(self, prefix: str) -> None:
        """This evaluation's completions as JSON lines in ``<log dir>/heldout/``, one file per evaluation."""
        rows = self.__dict__.get("_held_out_rows", [])
        trainer = self.trainer
        folder = trainer.log_dir or trainer.default_root_dir
        if not rows or folder is None:
            return
        rank = f"_rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        path = Path(folder) / "heldout" / f"{prefix}_step{trainer.global_step:06d}{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
