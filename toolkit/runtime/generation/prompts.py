"""Where generation prompts come from: a prompt file (held out, with optional references) or the first
training rows; and the exact-match score against the references."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.runtime.data.jsonl import check_rows, is_messages, read_objects

IGNORE_INDEX = -100  # same value as toolkit.runtime.data.batches.IGNORE_INDEX; not imported to keep this import light
FIELDS = ("input_ids", "prompt", "text", "messages")


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    reference: str | list[int] | None = None
    """What the generation should be, for the exact-match score: text (compared decoded and stripped) or ids."""


def _ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def check_row(row: dict[str, Any], where: str) -> str:
    """The row's prompt field, or a ConfigError naming the file, line and field."""
    field = next((f for f in FIELDS if f in row), None)
    if field is None:
        raise ConfigError(f'{where}: expected one of {", ".join(map(repr, FIELDS))}, got keys {sorted(row)}')
    value = row[field]
    if field == "input_ids" and not _ids(value):
        raise ConfigError(f"{where}: input_ids must be a non-empty list of non-negative ints")
    if field in ("prompt", "text") and not (isinstance(value, str) and value):
        raise ConfigError(f"{where}: {field} must be a non-empty string")
    if field == "messages" and not is_messages(value):
        raise ConfigError(f'{where}: messages must be a non-empty list of {{"role": str, "content": str}}')
    ref = row.get("reference")
    if ref is not None and not (isinstance(ref, str) or _ids(ref)):
        raise ConfigError(f"{where}: reference must be a string or a list of token ids")
    return field


def check_file(path: Path, label: str) -> None:
    """Before launch: the file exists and every row has a usable prompt (nothing tokenized yet)."""
    check_rows(path, label, check_row, "prompts")


def load_prompts(path: Path, tokenizer: Any | None, label: str) -> list[Prompt]:
    """Every row's prompt as token ids: input_ids as given, text with the tokenizer, messages through its chat
    template with the assistant's turn opened (as `apply_chat_template(..., add_generation_prompt=True)`)."""
    check_file(path, label)
    out: list[Prompt] = []
    for lineno, row in read_objects(path, label):
        where = f"{label}: {path}:{lineno}"
        field = check_row(row, where)
        if field == "input_ids":
            ids = list(row[field])
        elif tokenizer is None:
            raise ConfigError(f'{where}: "{field}" prompts need a tokenizer in the model directory; give "input_ids"')
        elif field == "messages":
            if not getattr(tokenizer, "chat_template", None):
                raise ConfigError(f"{where}: messages need a chat template, and the tokenizer has none")
            ids = list(tokenizer.apply_chat_template(row[field], tokenize=True, add_generation_prompt=True,
                                                     return_dict=True)["input_ids"])
        else:
            ids = list(tokenizer(row[field])["input_ids"])
        if not ids:
            raise ConfigError(f"{where}: the prompt tokenizes to nothing")
        out.append(Prompt(ids, row.get("reference")))
    return out


def from_rows(rows: list[dict[str, Any]], n: int) -> list[Prompt]:
    """The first n training samples' prompts: the leading tokens whose labels are -100.

    Plain-text rows (labels == input_ids) have no masked prefix; their first half is the prompt.
    """
    out = []
    for r in rows[:n]:
        ids, labels = list(r["input_ids"]), list(r["labels"])
        k = 0
        while k < len(labels) and labels[k] == IGNORE_INDEX:
            k += 1
        if k == 0 or k >= len(ids):
            k = max(1, len(ids) // 2)
        out.append(Prompt(ids[:k]))
    return out


def exact_match(prompts: list[Prompt], outputs: list[list[int]], tokenizer: Any | None,
                stops: set[int]) -> float | None:
    """The share of prompts with a reference whose generation equals it; None where none has one. Text is
    compared decoded without special tokens and stripped; ids without the stop token that ended them."""
    scored = [(p.reference, o) for p, o in zip(prompts, outputs, strict=True) if p.reference is not None]
    if not scored:
        return None
    hits = 0
    for ref, out in scored:
        if isinstance(ref, str):
            text = tokenizer.decode(out, skip_special_tokens=True) if tokenizer is not None else None
            hits += text is not None and text.strip() == ref.strip()
        else:
            hits += [t for t in out if t not in stops] == list(ref)
    return hits / len(scored)
