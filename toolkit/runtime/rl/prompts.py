"""An RL run's prompt file: one JSON object a line with the prompt (`prompt` text, `prompt` or `messages` as a list of
chat messages, rendered with the assistant's turn opened, or `input_ids`) and any fields its reward functions read
(`answer`, ...), which reach them as keyword lists, as TRL passes a dataset's columns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.runtime.data.jsonl import check_rows, is_messages, read_objects

PROMPT_FIELDS = ("prompt", "messages", "input_ids")


def check_row(row: dict[str, Any], where: str) -> str:
    """The row's prompt field, or a ConfigError naming the file, line and field."""
    field = next((f for f in PROMPT_FIELDS if f in row), None)
    if field is None:
        raise ConfigError(f"{where}: expected a prompt ({', '.join(PROMPT_FIELDS)}), got keys {sorted(row)}")
    value = row[field]
    if field == "input_ids":
        if not (isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in value)):
            raise ConfigError(f"{where}: input_ids must be a non-empty list of non-negative ints")
    elif isinstance(value, str):
        if field == "messages" or not value:
            raise ConfigError(f"{where}: {field} must be a non-empty string or a list of chat messages")
    elif not is_messages(value):
        raise ConfigError(f'{where}: {field} must be a non-empty string or a list of {{"role": str, "content": str}}')
    return field


def check_file(path: str | Path, label: str = "data.source", *, tokenizer: Any = None, vocab: int | None = None,
               need_tokenizer: bool = False) -> None:
    """Before launch: every row has a usable prompt and the first row's fields; with need_tokenizer, text and chat
    prompts have a tokenizer (and chat ones its chat template); input_ids fit the model's vocabulary."""
    first: list[set[str]] = []

    def check(row: dict[str, Any], where: str) -> None:
        field = check_row(row, where)
        keys = set(row) - set(PROMPT_FIELDS)
        if not first:
            first.append(keys)
        elif keys != first[0]:
            raise ConfigError(f"{where}: fields {sorted(keys)}, the first row's {sorted(first[0])}: reward functions "
                              "take every field as a list, one entry a completion")
        if need_tokenizer and field != "input_ids" and tokenizer is None:
            raise ConfigError(f'{where}: "{field}" prompts need a tokenizer (model.tokenizer); give "input_ids"')
        if need_tokenizer and isinstance(row[field], list) and field != "input_ids" \
                and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{where}: chat messages need a chat template, and the tokenizer has none")
        if field == "input_ids" and vocab and max(row[field]) >= vocab:
            raise ConfigError(f"{where}: input_ids holds {max(row[field])}, past the model's {vocab:,} token ids")

    check_rows(Path(path), label, check, "prompts")


def load(path: str | Path, tokenizer: Any | None, max_prompt_length: int, label: str = "data.source"
         ) -> tuple[list[dict[str, Any]], int]:
    """(rows, prompts cut): each row as {"prompt_ids", "prompt" (its text or messages, what reward functions get),
    "fields" (the row's other keys), "index" (its row number), "line" (its line in the file)}; a prompt longer than max_prompt_length keeps its end
    (the question and the opened assistant turn), as TRL truncates."""
    path = Path(path)
    check_file(path, label)
    rows: list[dict[str, Any]] = []
    cut = 0
    for lineno, row in read_objects(path, label):
        where = f"{label}: {path}:{lineno}"
        field = check_row(row, where)
        value = row[field]
        if field == "input_ids":
            ids = list(value)
        elif tokenizer is None:
            raise ConfigError(f'{where}: "{field}" prompts need a tokenizer (model.tokenizer); give "input_ids"')
        elif isinstance(value, list):
            if not getattr(tokenizer, "chat_template", None):
                raise ConfigError(f"{where}: chat messages need a chat template, and the tokenizer has none")
            ids = list(tokenizer.apply_chat_template(value, tokenize=True, add_generation_prompt=True,
                                                     return_dict=True)["input_ids"])
        else:
            ids = list(tokenizer(value)["input_ids"])
        if not ids:
            raise ConfigError(f"{where}: the prompt tokenizes to nothing")
        if max_prompt_length and len(ids) > max_prompt_length:
            ids, cut = ids[-max_prompt_length:], cut + 1
        fields = {k: v for k, v in row.items() if k not in PROMPT_FIELDS}
        rows.append({"prompt_ids": ids, "prompt": value, "fields": fields, "index": len(rows), "line": lineno})
    return rows, cut


def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A micro-batch of prompt rows, as they are (the step generates from them)."""
    return {"rows": rows}
