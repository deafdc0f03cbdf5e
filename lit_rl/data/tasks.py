"""Built-in prompt sources: the generated arithmetic task, local JSONL / Parquet files, and the dispatch to Hugging
Face datasets (:mod:`lit_rl.data.hub`).

A source yields records ``{"prompt": str | list[dict], "answer": Any}``; the prompt is the user message before
the chat template (or a whole conversation, see :mod:`lit_rl.data.rows`), the answer is whatever the reward
functions compare against.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from lit_rl.data.rows import check_rows

# difficulty -> (operators, range of the first operand, range of the second operand)
_LEVELS: dict[int, tuple[str, tuple[int, int], tuple[int, int]]] = {
    1: ("+", (1, 9), (1, 9)),
    2: ("+-", (1, 9), (1, 9)),
    3: ("+-", (10, 99), (1, 9)),
    4: ("+-", (10, 99), (10, 99)),
    5: ("+-*", (10, 99), (2, 9)),
}


def arithmetic_prompts(num_prompts: int, *, difficulty: int = 1, seed: int = 0) -> list[dict[str, Any]]:
    """Seeded arithmetic questions with integer answers.

    Level 1 (single-digit addition) is the default because SmolLM2-135M-Instruct already answers
    about a third of it: GRPO needs groups whose rewards differ, and learns nothing from a task the
    model never or always solves. Higher levels add subtraction, two-digit operands and products.

    Args:
        num_prompts: how many questions.
        difficulty: 1 to 5, see ``_LEVELS``.
        seed: the same seed gives the same questions.
    """
    if difficulty not in _LEVELS:
        raise ValueError(f"data.difficulty: {difficulty} is not one of {sorted(_LEVELS)}")
    if num_prompts < 1:
        raise ValueError(f"data.num_prompts must be >= 1, got {num_prompts}")
    ops, (a_lo, a_hi), (b_lo, b_hi) = _LEVELS[difficulty]
    rng = random.Random(seed)
    records = []
    for _ in range(num_prompts):
        op = rng.choice(ops)
        a, b = rng.randint(a_lo, a_hi), rng.randint(b_lo, b_hi)
        if op == "-" and b > a:  # keep answers non-negative: the small model has trouble with signs
            a, b = b, a
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        records.append({"prompt": f"What is {a} {op} {b}?", "answer": answer})
    return records


FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def read_source(
    source: str,
    *,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    max_rows: int | None = None,
    **dataset_options: Any,
) -> list[dict[str, Any]]:
    """Read ``{prompt, answer}`` records from a JSONL / Parquet file or a Hugging Face dataset, checking every row.

    A path ending in ``.jsonl``, ``.json`` or ``.parquet`` is a file; anything else is a dataset, either a folder
    (``save_to_disk``, or a hub repository's layout) or a hub id, read by :func:`lit_rl.data.hub.read_dataset`.

    Args:
        max_rows: keep at most this many rows, the first ones; ``None`` for all.
        dataset_options: ``subset``, ``split`` and ``streaming`` of :func:`lit_rl.data.hub.read_dataset`; a file
            has none of them and ignores them.

    Raises:
        FileNotFoundError: a file source that does not exist.
        ValueError: a bad row, or a dataset subset, split or setting that does not fit; see :func:`read_records`
            and :func:`lit_rl.data.hub.read_dataset`.
    """
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"data.max_rows: must be >= 1, got {max_rows}; set it to 1 or more, or null for every row")
    fields = {"prompt_field": prompt_field, "answer_field": answer_field}
    if Path(source).suffix in FILE_SUFFIXES:
        return read_records(source, **fields)[:max_rows]
    from lit_rl.data.hub import read_dataset

    return read_dataset(source, **fields, max_rows=max_rows, **dataset_options)


def read_records(
    path: str | Path, *, prompt_field: str = "prompt", answer_field: str | None = "answer"
) -> list[dict[str, Any]]:
    """Read ``{prompt, answer}`` records from a JSONL or Parquet file, checking every row (:func:`check_rows`).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is empty, a row is not valid JSON, lacks a configured field or holds a prompt that is
            neither a string nor a message list; the message names the file, the 1-based row and the field.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"data.source: {path} does not exist; give a .jsonl or .parquet file, a dataset folder or hub id, "
            "or 'arithmetic'"
        )
    if path.suffix in (".jsonl", ".json"):
        rows = list(_jsonl_rows(path))
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError(f"data.source: reading {path} needs pyarrow; `pip install pyarrow`") from err
        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"data.source: {path} has suffix {path.suffix!r}; use a .jsonl or .parquet file")
    if not rows:
        raise ValueError(f"data.source: {path} has no rows; give a file with one prompt per row")
    return list(check_rows(rows, str(path), prompt_field=prompt_field, answer_field=answer_field))


def _jsonl_rows(path: Path):
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"data.source: {path}, row {i}: not valid JSON ({err.msg}); each line must be one JSON object"
                ) from err
            if not isinstance(row, dict):
                raise ValueError(
                    f"data.source: {path}, row {i}: expected a JSON object, got {type(row).__name__}; fix the row"
                )
            yield row
