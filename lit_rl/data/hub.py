"""Hugging Face datasets as prompt sources: a hub id (``openai/gsm8k``), or a folder ``save_to_disk`` wrote.

Read through the ``datasets`` library, an optional dependency (``pip install 'lit-rl[datasets]'``). Every row passes
the checks files pass (:func:`lit_rl.data.rows.check_rows`); only the prompt and answer columns are read.

**Large sets are streamed.** A hub split is *large* when the hub's metadata says its Arrow data is more than
:data:`STREAM_OVER_BYTES` (1 GiB): reading it the ordinary way would download every file of the split and write an
Arrow copy of all of it to the cache before the first step. A large split is instead streamed
(``as_streaming_dataset``): rows are read in order, checked as they pass, and only their prompt and answer are
kept; with ``data.max_rows`` reading stops there, so only the first files are fetched at all. ``data.streaming``
overrides the choice (``true`` / ``false``); a split whose size the hub does not report is read the ordinary way.
A ``save_to_disk`` folder is never downloaded: its Arrow files are memory-mapped and read in batches of
:data:`BATCH_ROWS` rows, so memory holds one batch of the two columns, not the table.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from lit_rl.data.rows import check_rows, top_level_columns

#: a hub split whose Arrow data the hub reports above this size is streamed unless ``data.streaming`` says otherwise
STREAM_OVER_BYTES = 1 << 30
#: rows read from a memory-mapped Arrow table at a time
BATCH_ROWS = 1024
_INSTALL = "pip install 'lit-rl[datasets]'"


def import_datasets():
    """The ``datasets`` module, or one line naming the extra that installs it."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            f"data.source: reading a Hugging Face dataset needs the datasets library; `{_INSTALL}`"
        ) from err
    return datasets


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def read_dataset(
    source: str,
    *,
    prompt_field: str,
    answer_field: str | None,
    subset: str | None,
    split: str,
    streaming: bool | None,
    max_rows: int | None,
) -> list[dict[str, Any]]:
    """Read ``{prompt, answer}`` records from a saved dataset folder or a hub dataset, checking every row.

    Every argument is named and has no default here: the defaults are :class:`~lit_rl.data.PromptDataModule`'s.

    Args:
        source: a ``save_to_disk`` folder, a folder laid out as a hub repository, or a hub id.
        prompt_field, answer_field: see :func:`lit_rl.data.rows.check_rows`.
        subset: the hub dataset's configuration (``main`` for ``openai/gsm8k``); ``None`` when it has one. A saved
            folder holds one subset already and does not read it.
        split: the split to read (``train``, or a slice such as ``train[:1000]``); a folder that one ``Dataset``
            was saved to has no splits and ignores it.
        streaming: stream the split (``None``: when it is large, see the module docstring).
        max_rows: read at most this many rows, the first ones.

    Raises:
        ImportError: ``datasets`` is not installed.
        ValueError: an unknown subset or split (the message lists the available ones), a bad row, or no rows.
        FileNotFoundError: a hub id that is neither cached nor on the hub.
    """
    datasets = import_datasets()
    path = Path(source).expanduser()
    columns = top_level_columns(prompt_field, answer_field)
    if path.is_dir() and is_saved_dataset(path):
        if subset is not None:  # the subset was chosen when it was saved: a hub config's subset may stay as it is
            rank_zero_info(f"data.subset {subset!r} is not read: {source} is a saved dataset, which has no subsets")
        where, rows = _saved_rows(datasets, path, split, columns)
    else:
        where, rows = _hub_rows(datasets, source, subset, split, streaming, columns)
    records = list(check_rows(islice(rows, max_rows), where, prompt_field=prompt_field, answer_field=answer_field))
    if not records:
        raise ValueError(f"data.source: {where} has no rows; give a dataset with one prompt per row")
    return records


def _saved_rows(datasets, path: Path, split: str, columns: list[str]) -> tuple[str, Iterator[dict[str, Any]]]:
    loaded = datasets.load_from_disk(str(path))
    where = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"data.split: {path} has no split {split!r}; use one of {', '.join(loaded)} (data.split)")
        loaded, where = loaded[split], f"{path} (split {split})"
    return where, _table_rows(loaded, columns)


def _table_rows(table, columns: list[str]) -> Iterator[dict[str, Any]]:
    """Rows of a memory-mapped ``Dataset``, one batch in memory at a time, with only ``columns``."""
    names = table.column_names
    present = [c for c in columns if c in names]
    kept = table.select_columns(present) if present else table  # none present: row 1 fails the check, naming all
    for batch in kept.iter(batch_size=BATCH_ROWS):
        # a row lacking a prompt or answer column still names every column it has in the row check's message
        size = len(next(iter(batch.values()))) if batch else 0
        for i in range(size):
            row = {name: None for name in names}
            row.update({name: values[i] for name, values in batch.items()})
            yield row


def _hub_rows(
    datasets, source: str, subset: str | None, split: str, streaming: bool | None, columns: list[str]
) -> tuple[str, Iterator[dict[str, Any]]]:
    where = f"{source}{f' ({subset})' if subset else ''} split {split}"
    try:
        builder = datasets.load_dataset_builder(source, subset)
    except ValueError as err:  # an unknown subset, or none given where the dataset has several
        names = _subsets(datasets, source)
        listed = f"use one of {', '.join(names)}" if names else "see the dataset's page for its subsets"
        if subset is None:
            raise ValueError(f"data.subset: {source} has several subsets; {listed} (data.subset)") from err
        raise ValueError(f"data.subset: {source} has no subset {subset!r}; {listed} (data.subset)") from err
    except (ConnectionError, FileNotFoundError) as err:
        if datasets.config.HF_HUB_OFFLINE:
            why = "not in the datasets cache, and offline mode is on (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE)"
        elif isinstance(err, ConnectionError):
            why = f"the Hugging Face Hub could not be reached ({type(err).__name__})"
        else:
            why = "not a dataset on the Hugging Face Hub"
        raise FileNotFoundError(
            f"data.source: {source} is not a local file or folder, and {why}; check the id or path, "
            "or give a saved dataset folder or a .jsonl / .parquet file"
        ) from err
    splits = builder.info.splits or {}
    name = re.split(r"[\[+]", split, maxsplit=1)[0]  # `train[:100]` reads the train split
    if splits and name not in splits:
        raise ValueError(_no_split(source, subset, split, splits))
    size = splits[name].num_bytes if name in splits else None
    if streaming if streaming is not None else (size is not None and size > STREAM_OVER_BYTES):
        table = builder.as_streaming_dataset(split=split)
        if table.column_names:  # known from the metadata: leave the other columns unread
            table = table.select_columns([c for c in columns if c in table.column_names])
        return where, (dict(row) for row in table)
    builder.download_and_prepare()
    try:
        table = builder.as_dataset(split=split)
    except ValueError as err:  # the split, when the hub's metadata did not list the splits before preparing
        raise ValueError(_no_split(source, subset, split, builder.info.splits or {})) from err
    return where, _table_rows(table, columns)


def _no_split(source: str, subset: str | None, split: str, splits) -> str:
    return (
        f"data.split: {source}{f' ({subset})' if subset else ''} has no split {split!r}; use one of "
        f"{', '.join(splits) or 'the splits on its page'} (data.split)"
    )


def _subsets(datasets, source: str) -> list[str]:
    """The subsets of ``source``: from the hub, or offline from the folders of the datasets cache."""
    if datasets.config.HF_HUB_OFFLINE and not Path(source).exists():
        cached = Path(datasets.config.HF_DATASETS_CACHE) / source.replace("/", "___")
        return sorted(p.name for p in cached.iterdir() if p.is_dir()) if cached.is_dir() else []
    try:
        return list(datasets.get_dataset_config_names(source))
    except Exception:  # the listing is a hint in an error message; the error itself is what matters
        return []
