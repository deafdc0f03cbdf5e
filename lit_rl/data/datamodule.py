"""``PromptDataModule``: prompt batches (chat template applied, left-padded) plus the answers rewards need.

The tokenizer (and, for density sampling, the policy model) are known only once the method has
loaded them, so the method hands them over through :meth:`PromptDataModule.connect` in its
``setup``; batches are tokenised in the collate function, after that call.
"""

from __future__ import annotations

import shlex
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, Dataset

from lit_rl.data.density import EmbeddingCache, StaleEmbeddingCacheError, density_weights_for
from lit_rl.data.heldout import split_held_out
from lit_rl.data.rows import Messages
from lit_rl.data.sentiment import review_openings
from lit_rl.data.tasks import arithmetic_prompts, read_source

_SUBCOMMANDS = ("fit", "validate", "test", "predict")
_SUBCOMMAND_OPTIONS = ("--ckpt_path", "--verbose", "--return_predictions")  # options `lit-rl embed` does not take


def _embed_command(argv: Sequence[str]) -> str | None:
    """``lit-rl embed`` with the arguments of this ``lit-rl fit ...`` process (``sys.argv``), so a stale
    cache is rebuilt for exactly this run's configs and overrides; ``None`` when this process is not
    the ``lit-rl`` command (called from Python, where the arguments are not known here)."""
    if len(argv) < 2 or argv[1] not in _SUBCOMMANDS:
        return None
    prog = Path(argv[0])
    if prog.name != "lit-rl" and (prog.name, prog.parent.name) != ("__main__.py", "lit_rl"):  # `python -m lit_rl`
        return None
    args, rest = [], list(argv[2:])
    while rest:
        arg = rest.pop(0)
        if arg.split("=", 1)[0] in _SUBCOMMAND_OPTIONS:
            if "=" not in arg and rest:
                rest.pop(0)  # its value
            continue
        args.append(arg)
    return shlex.join(["lit-rl", "embed", *args])


class _Records(Dataset):
    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.records[index], "index": index}


class PromptDataModule(L.LightningDataModule):
    """Prompts from a built-in task, a JSONL / Parquet file or a Hugging Face dataset, sampled uniformly or by density.

    Each batch is a dict: ``input_ids`` and ``attention_mask`` ``[B, P]`` (left-padded, so generation
    continues every row at the same position), ``prompts`` (the templated strings), ``answers``,
    ``index`` (dataset rows) and ``num_truncated`` (prompts cut to ``max_prompt_length``).

    Args:
        source: ``arithmetic`` (generated questions with integer answers), ``reviews`` (movie-review openings to
            continue, answers are the opening's tone; see :mod:`lit_rl.data.sentiment`, whose fixed held-out fifth
            ``val_size`` draws from), a path to a ``.jsonl`` / ``.parquet`` file, a folder ``save_to_disk`` wrote,
            or a hub dataset id such as ``openai/gsm8k`` (needs ``pip install 'lit-rl[datasets]'``; see
            :mod:`lit_rl.data.hub` for when a large one is streamed).
        prompt_field: column holding the prompt (files and datasets): a string, or a list of ``{"role", "content"}``
            messages that the chat template renders as it is (system turns included; ``instruction`` and
            ``system_prompt`` are not added to it). Dots reach into nested columns.
        answer_field: column holding what reward functions compare against (dots reach into nested columns, e.g.
            ``reward_model.ground_truth``); ``null`` when no reward needs it.
        subset: the hub dataset's subset (configuration), e.g. ``main`` for ``openai/gsm8k``; ``null`` when it has one.
        split: the dataset split to train on (``train``, or a slice such as ``train[:1000]``).
        streaming: stream a hub split instead of downloading it whole; ``null`` streams splits over 1 GiB.
        max_rows: read at most this many rows of a file or dataset (the first ones); ``null`` for all.
        num_prompts: how many arithmetic questions or review openings to generate.
        difficulty: arithmetic difficulty, 1 (single-digit addition) to 5.
        instruction: appended to every prompt (the arithmetic task asks for just the number); ``null`` for none.
        system_prompt: optional system message.
        chat_template: wrap each prompt in the tokenizer's chat template as a user turn; ``false`` gives the model
            the prompt text as it is, to continue (the review task: the completion continues the opening).
        batch_size: prompts per step; each is completed ``num_generations`` times by the method.
        max_prompt_length: prompts longer than this many tokens are cut from the left (and counted in
            ``prompts/truncated``) or rejected, see ``truncation``.
        truncation: ``left`` or ``error``.
        sampler: ``uniform``, or ``density`` to weight prompts by the inverse kNN density of their embeddings
            (sparse regions of prompt space are drawn more often). Costs one no-grad pass of the policy
            over every prompt at start-up (cached on disk with ``density_cache_dir``).
        density_k: neighbours for the density estimate.
        density_pooling: ``hidden`` (mean last hidden state, small) or ``logits``
            (mean-pooled logits, vocab-sized: what ``bench/bench_density.py`` compares against).
        density_backend: ``auto``, ``exact``, ``ivf`` or ``numpy``.
        density_cache_dir: folder for the offline embedding cache (``lit-rl embed`` writes it).
        seed: seeds the arithmetic generator and the sampling stream.
        num_workers: DataLoader workers.
        val_size: held-out prompts taken from ``source`` (distinct prompt texts, drawn with ``seed``; no training
            row keeps one), for ``val``/``test`` evaluation; 0 with no ``val_source``: no held-out set.
        val_source: a file or dataset of held-out prompts (same fields as ``source``) instead.
        val_split: the split of ``val_source`` when it is a dataset (default: ``split``), e.g. ``test``.
        val_batch_size: held-out prompts per evaluation batch (default ``batch_size``).
    """

    def __init__(
        self,
        source: str = "arithmetic",
        prompt_field: str = "prompt",
        answer_field: str | None = "answer",
        subset: str | None = None,
        split: str = "train",
        streaming: bool | None = None,
        max_rows: int | None = None,
        num_prompts: int = 2000,
        difficulty: int = 1,
        instruction: str | None = "Answer with just the number.",
        system_prompt: str | None = None,
        chat_template: bool = True,
        batch_size: int = 4,
        max_prompt_length: int = 256,
        truncation: Literal["left", "error"] = "left",
        sampler: Literal["uniform", "density"] = "uniform",
        density_k: int = 10,
        density_pooling: Literal["hidden", "logits"] = "hidden",
        density_backend: Literal["auto", "exact", "ivf", "numpy"] = "auto",
        density_cache_dir: str | None = None,
        seed: int = 0,
        num_workers: int = 0,
        val_size: int = 0,
        val_source: str | None = None,
        val_split: str | None = None,
        val_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size: must be >= 1, got {batch_size}; set it to 1 or more")
        if truncation not in ("left", "error"):
            raise ValueError(f"data.truncation: {truncation!r} is not 'left' or 'error'; use one of them")
        if sampler not in ("uniform", "density"):
            raise ValueError(f"data.sampler: {sampler!r} is not 'uniform' or 'density'; use one of them")
        if val_size and val_source is not None:
            raise ValueError(f"data.val_size: {val_size} with data.val_source {val_source}; set one of them, not both")
        self.save_hyperparameters()
        self.records: list[dict[str, Any]] | None = None
        self.held_out: list[dict[str, Any]] | None = None
        self.tokenizer = None
        self._embed_model: Callable[[], torch.nn.Module] | None = None
        self._model_id = ""
        self._sampler = None
        self._sampler_state: dict[str, Any] | None = None
        self.density_stats: dict[str, float] = {}
        self.density_weights: np.ndarray | None = None
        self.message_prompts = False  # whether any prompt is a message list (then the chat template is required)

    # ------------------------------------------------------------------ wiring
    def connect(
        self, tokenizer, *, embed_model: Callable[[], torch.nn.Module] | None = None, model_id: str = ""
    ) -> None:
        """Hand over what is known only after the method loaded its model.

        Args:
            tokenizer: the policy's tokenizer (left padding, pad token set).
            embed_model: returns the policy model; called once, only when ``sampler: density``.
            model_id: names the model in the embedding cache's metadata.
        """
        self.tokenizer = tokenizer
        self._embed_model = embed_model
        self._model_id = model_id
        if self.message_prompts:  # refused now, before the first batch, if the tokenizer cannot render them
            self._check_chat_template()

    def prepare_records(self) -> list[dict[str, Any]]:
        """Read or generate the prompt records (cached after the first call)."""
        if self.records is None:
            hp = self.hparams
            if hp.source == "reviews":  # the task's own held-out texts, which its reward model never saw either
                self.records = review_openings(hp.num_prompts, split="train", seed=hp.seed)
                self.held_out = review_openings(hp.val_size, split="heldout", seed=hp.seed) if hp.val_size else []
            elif hp.source == "arithmetic":
                self.records = arithmetic_prompts(hp.num_prompts, difficulty=hp.difficulty, seed=hp.seed)
            else:
                self.records = self._read(hp.source, hp.split)
            if hp.source != "reviews":
                self.records, self.held_out = split_held_out(self.records, hp.val_size, seed=hp.seed)
            if hp.val_source is not None:
                self.held_out = self._read(hp.val_source, hp.val_split or hp.split)
            self.message_prompts = any(
                not isinstance(r["prompt"], str) for r in [*self.records, *(self.held_out or [])]
            )
            if self.message_prompts and (hp.instruction or hp.system_prompt):
                rank_zero_warn(
                    "data.instruction / data.system_prompt are not added to message-list prompts, which the chat "
                    "template renders as they are; set them to null to silence this"
                )
            if self.tokenizer is not None and self.message_prompts:
                self._check_chat_template()
        return self.records

    def _read(self, source: str, split: str) -> list[dict[str, Any]]:
        hp = self.hparams
        return read_source(
            source, prompt_field=hp.prompt_field, answer_field=hp.answer_field, max_rows=hp.max_rows,
            subset=hp.subset, split=split, streaming=hp.streaming,
        )  # fmt: skip

    def held_out_records(self) -> list[dict[str, Any]]:
        """The held-out prompts (``val_source`` or ``val_size`` of ``source``); empty without either."""
        self.prepare_records()
        return self.held_out or []

    def setup(self, stage: str) -> None:
        self.prepare_records()

    # ------------------------------------------------------------------ formatting
    def format_prompt(self, prompt: str | Messages) -> str:
        """The text the model sees: instruction appended, chat template applied when set and the tokenizer has one.

        A message list goes through the chat template as it is, with the assistant's turn opened
        (``add_generation_prompt=True``); it needs ``chat_template: true`` and a tokenizer that has a template.
        """
        hp = self.hparams
        if not isinstance(prompt, str):
            self._check_chat_template()
            return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        content = f"{prompt} {hp.instruction}" if hp.instruction else prompt
        if not hp.chat_template:
            return content  # continued as it is: no newline that would end the sentence
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": hp.system_prompt}] if hp.system_prompt else []
            messages.append({"role": "user", "content": content})
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return f"{hp.system_prompt}\n\n{content}\n" if hp.system_prompt else f"{content}\n"

    def _check_chat_template(self) -> None:
        """Refuse message-list prompts that cannot be rendered: no chat template wanted, or none in the tokenizer."""
        if not self.hparams.chat_template:
            raise ValueError(
                "data.chat_template: false, but the prompts are message lists, which only a chat template renders; "
                "set data.chat_template: true or give a prompt field of plain strings"
            )
        if not getattr(self.tokenizer, "chat_template", None):
            model = f" of {self._model_id}" if self._model_id else ""
            raise ValueError(
                f"data.prompt_field: the prompts are message lists, but the tokenizer{model} has no chat template; "
                "use a chat (instruct) model, or give a prompt field of plain strings"
            )

    def collate(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        if self.tokenizer is None:
            raise MisconfigurationException(
                "PromptDataModule has no tokenizer: the method must call datamodule.connect(tokenizer) in its setup()"
            )
        prompts = [self.format_prompt(it["prompt"]) for it in items]
        encoded = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        limit, num_truncated = self.hparams.max_prompt_length, 0
        for row, (ids, item) in enumerate(zip(encoded, items)):
            if len(ids) > limit:
                if self.hparams.truncation == "error":
                    raise ValueError(
                        f"data.max_prompt_length: the prompt of dataset row {item['index'] + 1} has {len(ids)} tokens > "
                        f"data.max_prompt_length={limit}; raise max_prompt_length or set data.truncation: left"
                    )
                encoded[row] = ids[-limit:]  # keep the end: the question and the generation prompt
                num_truncated += 1
        width = max(len(ids) for ids in encoded)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)  # [B, P]
        attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)  # [B, P]
        for row, ids in enumerate(encoded):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "prompts": prompts,
            "answers": [it["answer"] for it in items],
            "index": torch.tensor([it["index"] for it in items]),
            "num_truncated": num_truncated,
        }

    # ------------------------------------------------------------------ sampling
    def _build_sampler(self):
        from lit_rl.data.sampler import WeightedStreamSampler

        records = self.prepare_records()
        weights = None
        if self.hparams.sampler == "density":
            weights = self._density_weights(records, rebuild_stale=False)
        sampler = WeightedStreamSampler(
            weights if weights is not None else np.ones(len(records)) / len(records),
            len(records),
            seed=self.hparams.seed,
        )
        if self._sampler_state is not None:
            sampler.load_state_dict(self._sampler_state)
            self._sampler_state = None
        return sampler

    def build_density_cache(self) -> np.ndarray:
        """Write the prompt-embedding cache in ``density_cache_dir`` (what ``lit-rl embed`` runs).

        A cache built for other prompts, model or settings is replaced (one log line says which file
        and why); a matching one is reused. The density weights are computed too, so ``density_k``
        is checked and the effective sample size logged before a training run needs them.

        Returns:
            ``[N]`` density weights summing to 1.

        Raises:
            MisconfigurationException: ``density_cache_dir`` is not set, or :meth:`connect` has not
                been given the policy model.
        """
        if self.hparams.density_cache_dir is None:
            raise MisconfigurationException(
                "data.density_cache_dir is not set; set it to the folder the embeddings are written to"
            )
        return self._density_weights(self.prepare_records(), rebuild_stale=True)

    def _density_weights(self, records: list[dict[str, Any]], *, rebuild_stale: bool) -> np.ndarray:
        if self._embed_model is None or self.tokenizer is None:
            raise MisconfigurationException(
                "data.sampler: density needs the policy model; the method must call "
                "datamodule.connect(tokenizer, embed_model=...) in its setup()"
            )
        hp = self.hparams
        start = time.perf_counter()
        try:
            weights, stats = density_weights_for(
                [self.format_prompt(r["prompt"]) for r in records],
                model=self._embed_model(),
                tokenizer=self.tokenizer,
                k=hp.density_k,
                pooling=hp.density_pooling,
                backend=hp.density_backend,
                cache_dir=hp.density_cache_dir,
                model_id=self._model_id,
                max_length=hp.max_prompt_length,
                overwrite=rebuild_stale,
            )
        except StaleEmbeddingCacheError as err:
            command = _embed_command(sys.argv) or (
                "`lit-rl embed` and the --config files and overrides of this run (`fit` replaced by `embed`)"
            )
            raise StaleEmbeddingCacheError(
                f"data.density_cache_dir: the embedding cache {EmbeddingCache(hp.density_cache_dir).npy_path} "
                f"was built for other prompts or settings ({err.reason}); rebuild it with: {command}",
                reason=err.reason,
            ) from None
        self.density_stats = stats
        self.density_weights = weights
        self._log_density(weights, stats)
        rank_zero_info(
            f"density sampling: {len(records)} prompts weighted in {time.perf_counter() - start:.1f}s, "
            f"effective sample size {stats.get('density/ess', float('nan')):.3f} of N"
        )
        if hp.density_cache_dir is not None:
            rank_zero_info(
                f"embedding cache {EmbeddingCache(hp.density_cache_dir).npy_path}: {len(records)} prompts x "
                f"{int(stats['density/dim'])} dims, {'reused' if stats['density/cache_hit'] else 'written'}"
            )
        return weights

    def _log_density(self, weights: np.ndarray, stats: dict[str, float]) -> None:
        """Once at setup: the stage statistics as scalars and the weights as a TensorBoard histogram."""
        logger = self.trainer.logger if self.trainer is not None else None
        if logger is None:
            return
        logger.log_metrics({k: float(v) for k, v in stats.items()}, step=0)
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_histogram"):
            experiment.add_histogram("density/weights", weights * len(weights), global_step=0)  # 1 = uniform

    def train_dataloader(self) -> DataLoader:
        if (
            self.trainer is not None
            and self.trainer.world_size > 1
            and self.trainer._accelerator_connector.use_distributed_sampler
        ):
            rank_zero_warn(
                "PromptDataModule shards its own sampling stream across ranks; set trainer.use_distributed_sampler: false "
                "so Lightning does not wrap it a second time"
            )
        self._sampler = self._build_sampler()
        return DataLoader(
            _Records(self.prepare_records()),
            batch_size=self.hparams.batch_size,
            sampler=self._sampler,
            collate_fn=self.collate,
            num_workers=self.hparams.num_workers,
            drop_last=True,
            # its own generator: the worker seeds it draws at each epoch start would otherwise come from the global
            # one, which a resumed run restores at its first step (the uninterrupted run drew them earlier)
            generator=torch.Generator().manual_seed(self.hparams.seed),
        )

    def val_dataloader(self) -> DataLoader | list:
        """Held-out prompts in file order, each once; ``[]`` (no evaluation) without ``val_size`` or ``val_source``."""
        records = self.held_out_records()
        if not records:
            return []
        batch_size = self.hparams.val_batch_size or self.hparams.batch_size
        return DataLoader(_Records(records), batch_size=batch_size, collate_fn=self.collate, shuffle=False)

    def test_dataloader(self) -> DataLoader | list:
        """The held-out prompts, as for validation (``lit-rl test`` reports them under ``test/``)."""
        return self.val_dataloader()

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """Where the prompt stream stands, so a resumed run continues it.

        The position comes from the training loop's progress, not from the sampler: with DataLoader
        workers the sampler has already yielded prefetched batches that never trained.
        """
        if self._sampler is None:
            return {}
        if self.trainer is None:
            return {"sampler": self._sampler.state_dict()}
        from lit_rl.data.sampler import trained_position

        epoch, position = trained_position(self.trainer, self.hparams.batch_size)
        return {"sampler": self._sampler.state_dict(epoch=epoch, position=position)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning warns that a mid-epoch resume is unreliable unless the DataLoader is resumable; the stream
        # position travels in this state instead, so the resumed run trains on the uninterrupted run's prompts
        warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch")
        self._sampler_state = state_dict.get("sampler")
        if self._sampler is not None and self._sampler_state is not None:  # a live sampler follows the restore
            self._sampler.load_state_dict(self._sampler_state)
            self._sampler_state = None
