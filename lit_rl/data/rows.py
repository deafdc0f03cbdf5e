"""Row checks shared by every prompt source: a row becomes ``{"prompt", "answer"}`` or one line naming what is wrong.

A prompt is either a non-empty string (a user turn, the instruction and the chat template are added later) or a
conversation: a non-empty list of ``{"role": ..., "content": ...}`` messages, rendered by the tokenizer's chat template
as it is. A field name may reach into nested columns with dots (``reward_model.ground_truth``, the layout of verl's
GSM8K and MATH parquet files); a column whose own name holds the dot is found first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

Messages = list[dict[str, Any]]

_MISSING = object()


def field_value(row: dict[str, Any], field: str) -> Any:
    """The value of ``field`` in ``row`` (``a.b`` reads ``row["a"]["b"]``), or ``None`` when any part is missing."""
    if field in row:
        return row[field]
    value: Any = row
    for part in field.split("."):
        value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is _MISSING:
            return None
    return value


def top_level_columns(*fields: str | None) -> list[str]:
    """The columns a reader must keep so :func:`field_value` finds ``fields`` (``reward_model.ground_truth`` needs
    ``reward_model``); a name with a dot is kept whole too, in case a column is called that."""
    columns: list[str] = []
    for field in fields:
        if field is not None:
            for name in (field, field.split(".", 1)[0]):
                if name not in columns:
                    columns.append(name)
    return columns


def is_messages(prompt: Any) -> bool:
    """Whether ``prompt`` is a conversation: a non-empty list of dicts, each with a string ``role`` and ``content``."""
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    )


def check_rows(
    rows: Iterable[dict[str, Any]], where: str, *, prompt_field: str = "prompt", answer_field: str | None = "answer"
) -> Iterator[dict[str, Any]]:
    """Yield ``{"prompt", "answer"}`` for each row, refusing the first row that lacks a field or holds a bad prompt.

    Args:
        rows: dicts, one per row, in order.
        where: names the source in the messages (a file path, or a dataset with its split).
        prompt_field: the field that holds the prompt (dots reach into nested columns).
        answer_field: the field reward functions compare against; ``None`` when no reward needs one.

    Raises:
        ValueError: a row without a configured field, or whose prompt is neither a non-empty string nor a list of
            ``{"role", "content"}`` messages; the message names the source, the 1-based row, the field and the fix.
    """
    for i, row in enumerate(rows, start=1):
        for name, field in (("prompt_field", prompt_field), ("answer_field", answer_field)):
            if field is not None and field_value(row, field) is None:
                raise ValueError(
                    f"data.{name}: {where}, row {i}: no field {field!r} (data.{name}); the row has {sorted(row)}; "
                    f"fix the row or set data.{name} to the column that holds it"
                )
        prompt = field_value(row, prompt_field)
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError(
                    f"data.source: {where}, row {i}: field {prompt_field!r} is an empty string; fix the row"
                )
        elif not is_messages(prompt):
            raise ValueError(
                f"data.prompt_field: {where}, row {i}: field {prompt_field!r} holds {_describe(prompt)}, neither a "
                'string nor a list of {"role": ..., "content": ...} messages; fix the row or set data.prompt_field '
                "to the column that holds the prompt"
            )
        yield {"prompt": prompt, "answer": field_value(row, answer_field) if answer_field else None}


def _describe(value: Any) -> str:
    if isinstance(value, list):
        if not value:
            return "an empty list"
        bad = next((m for m in value if not (isinstance(m, dict) and isinstance(m.get("content"), str))), value[0])
        return f"a list whose item {str(bad)[:60]!r} is not a message with string role and content"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({str(value)[:40]!r})"
