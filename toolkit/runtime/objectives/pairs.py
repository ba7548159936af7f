"""Preference pairs from the rows users bring, as token ids with the prompt masked.

Three shapes of row, TRL's names for the columns (prompt, chosen, rejected):
  - strings: {"prompt": str, "chosen": str, "rejected": str}, the prompt tokenized with the tokenizer's special
    tokens and the completions without, an EOS after each completion;
  - conversations that share their prompt turns: {"chosen": [messages], "rejected": [messages]}, the last turn of
    each the assistant's; the turns before it must be the same in both;
  - a prompt conversation and a final assistant turn each: {"prompt": [messages], "chosen": [messages],
    "rejected": [messages]}.
Conversations are rendered with the tokenizer's chat template; the prompt is what the template writes for the turns
before the answer with the assistant's turn opened (`add_generation_prompt=True`), the completion what it writes
after that.

Truncation, to at most `max_length` tokens per sequence (prompt + completion): first the prompt is cut from its start,
keeping its end (the turns nearest the answer) and at least half of `max_length`; then both completions are cut to
the same room from their end. A row that loses tokens is counted as truncated. A row whose chosen or rejected
completion is empty, or whose two completions are the same (before truncation or after it), is dropped and
counted. A missing field or a wrong type
is a ConfigError naming the row and the field.

train.objective=kto takes unpaired rows, TRL's names: {"prompt", "completion", "label": true or false}, the prompt and
completion strings or conversations (a prompt conversation and a final assistant turn). Each becomes a Pair whose
chosen is its completion and whose rejected is the next row's completion (the next of the same shape with one,
wrapping to the first, and with another prompt where one of the next few has one) after this row's prompt: the
mismatched sequence KTO's KL estimate reads (TRL rotates completions within chunks of its prepared dataset; here the
file's order decides, so a precomputed reference covers them too). The row's own sequence is truncated as a pair's
would be, alone; the mismatched completion is cut to the room its prompt leaves. A row with an empty completion is
dropped and counted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.runtime.data.jsonl import is_messages

IGNORE_INDEX = -100
OK, TRUNCATED, EMPTY, IDENTICAL = 0, 1, 2, 3
STATUS = {OK: "kept", TRUNCATED: "truncated", EMPTY: "dropped: an empty completion",
          IDENTICAL: "dropped: chosen and rejected are the same"}
FIELDS = ("prompt", "chosen", "rejected")
KTO_FIELDS = ("prompt", "completion", "label")


@dataclass(frozen=True)
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    status: int = OK

    def rows(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """(chosen, rejected) as SFT rows: input_ids = prompt + completion, labels -100 over the prompt."""
        mask = [IGNORE_INDEX] * len(self.prompt)
        return ({"input_ids": self.prompt + self.chosen, "labels": mask + self.chosen},
                {"input_ids": self.prompt + self.rejected, "labels": mask + self.rejected})


def shape_of(row: dict[str, Any], where: str) -> str:
    """strings, shared (conversations sharing their prompt turns) or split (a prompt conversation and an answer each);
    a ConfigError naming the field otherwise."""
    for field in ("chosen", "rejected"):
        if field not in row:
            raise ConfigError(f'{where}: no "{field}" field (a preference row needs "chosen" and "rejected", and a '
                              f'"prompt" unless both are conversations sharing their prompt turns)')
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f'{where}: "prompt" must be a non-empty string when "chosen" and "rejected" are '
                              "strings")
        return "strings"
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        if not is_messages(value):
            raise ConfigError(f'{where}: "{field}" must be a string or a list of {{"role": str, "content": str}}')
        if value[-1]["role"] != "assistant":
            raise ConfigError(f'{where}: the last turn of "{field}" must be the assistant\'s')
    if prompt is None:
        if chosen[:-1] != rejected[:-1] or len(chosen) < 2:
            raise ConfigError(f'{where}: without a "prompt", "chosen" and "rejected" must share every turn before '
                              "their last (the assistant's answer), and have at least one")
        return "shared"
    if not is_messages(prompt):
        raise ConfigError(f'{where}: "prompt" must be a list of {{"role": str, "content": str}} with conversations')
    return "split"


def kto_shape_of(row: dict[str, Any], where: str) -> str:
    """An unpaired (kto) row: strings or split (a prompt conversation and a final assistant turn); a ConfigError
    naming the field otherwise."""
    for field in KTO_FIELDS:
        if field not in row:
            raise ConfigError(f'{where}: no "{field}" field (train.objective=kto reads unpaired rows: "prompt", '
                              '"completion" and "label")')
    if not isinstance(row["label"], bool):
        raise ConfigError(f'{where}: "label" must be true or false (whether the completion is desirable), got '
                          f"{row['label']!r}")
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(completion, str):
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f'{where}: "prompt" must be a non-empty string when "completion" is a string')
        return "strings"
    if not is_messages(completion) or completion[-1]["role"] != "assistant":
        raise ConfigError(f'{where}: "completion" must be a string or a list of {{"role": str, "content": str}} '
                          "ending with the assistant's turn")
    if not is_messages(prompt):
        raise ConfigError(f'{where}: "prompt" must be a list of {{"role": str, "content": str}} with conversations')
    return "split"


def tokenize(row: dict[str, Any], tokenizer: Any, max_length: int, where: str, unpaired: bool = False) -> Pair:
    """One row as a Pair (its status says whether it was truncated or is to be dropped). unpaired (kto): rejected is
    the mismatched completion, which may equal chosen."""
    shape = shape_of(row, where)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if shape == "strings":
        prompt = tokenizer(row["prompt"], add_special_tokens=True)["input_ids"]
        chosen, rejected = (tokenizer(row[f], add_special_tokens=False)["input_ids"] for f in ("chosen", "rejected"))
        chosen, rejected = (c + eos if c else c for c in (chosen, rejected))
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{where}: conversations need a chat template, and the tokenizer has none")
        turns = row["chosen"][:-1] if shape == "shared" else row["prompt"]
        before = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        completions = []
        for field in ("chosen", "rejected"):
            full = tokenizer.apply_chat_template([*turns, row[field][-1]], tokenize=False)
            if not full.startswith(before):
                raise ConfigError(f"{where}: the chat template does not write the prompt turns the same way before "
                                  f'the "{field}" answer; it cannot be split into prompt and completion')
            completions.append(full[len(before):])
        prompt = tokenizer(before, add_special_tokens=False)["input_ids"]
        chosen, rejected = (tokenizer(c, add_special_tokens=False)["input_ids"] if row[f][-1]["content"] else []
                            for c, f in zip(completions, ("chosen", "rejected"), strict=True))
    if not chosen or not rejected:
        return Pair(prompt, chosen, rejected, EMPTY)
    if chosen == rejected and not unpaired:
        return Pair(prompt, chosen, rejected, IDENTICAL)
    if unpaired:  # the row's own sequence is cut as it alone would be; the mismatched completion to the room left
        own = truncate(prompt, chosen, chosen, max_length)
        return Pair(own.prompt, own.chosen, rejected[:max_length - len(own.prompt)], own.status)
    pair = truncate(prompt, chosen, rejected, max_length)
    if pair.chosen == pair.rejected:  # they differed only past the room truncation left
        return Pair(pair.prompt, pair.chosen, pair.rejected, IDENTICAL)
    return pair


def truncate(prompt: list[int], chosen: list[int], rejected: list[int], max_length: int) -> Pair:
    """The rule in the module docstring: the prompt keeps its end (at least half of max_length of it), then both
    completions are cut alike to the room left."""
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= max_length:
        return Pair(prompt, chosen, rejected)
    keep = max(max_length - longest, min(len(prompt), max_length // 2))
    prompt = prompt[len(prompt) - keep:]
    room = max_length - len(prompt)
    return Pair(prompt, chosen[:room], rejected[:room], TRUNCATED)


def counts(pairs: list[Pair]) -> dict[str, int]:
    """How many rows ended in each status, by STATUS's words (for the run's data line)."""
    n = {status: sum(p.status == status for p in pairs) for status in STATUS}
    return {STATUS[status]: k for status, k in n.items() if k}


def as_row(pair: Pair, label: bool | None = None) -> dict[str, Any]:
    """A pair as the loops' row: its parts, and the chosen sequence as an SFT row (input_ids, labels), which the
    resume proof batch and the generation prompts read; a kto row's label (1: desirable) too."""
    chosen, _ = pair.rows()
    row: dict[str, Any] = {"prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected, **chosen}
    if label is not None:
        row["label"] = int(label)
    return row


def synthetic(n: int, seq_len: int, vocab_size: int, seed: int) -> list[dict[str, list[int]]]:
    """Learnable pairs without a file: a random prompt, the chosen completion following the fixed bigram chain the
    synthetic SFT rows follow (data/batches.py), the rejected one random tokens. Every sequence is seq_len long."""
    import random

    from toolkit.runtime.data.batches import synthetic_chain

    rng, chain, low = random.Random(seed), synthetic_chain(vocab_size, 0), 4
    p = max(1, seq_len // 4)
    rows = []
    for _ in range(n):
        prompt = [rng.randrange(low, vocab_size) for _ in range(p)]
        chosen, tok = [], prompt[-1]
        for _ in range(seq_len - p):
            tok = chain[tok]
            if tok < low:
                tok = low + tok
            chosen.append(tok)
        rejected = [rng.randrange(low, vocab_size) for _ in range(seq_len - p)]
        rows.append(as_row(Pair(prompt, chosen, rejected)))
    return rows


def synthetic_kto(n: int, seq_len: int, vocab_size: int, seed: int) -> list[dict[str, Any]]:
    """Learnable unpaired rows: `synthetic`'s pairs split into a desirable row (the chain) and an undesirable one
    (random tokens), each with a mismatched completion chosen as for a file (`partners`: another prompt's)."""
    items = [(r["prompt"], r[side], side == "chosen") for r in synthetic((n + 1) // 2, seq_len, vocab_size, seed)
             for side in ("chosen", "rejected")][:n]
    mates = partners([0] * len(items), [p for p, _, _ in items], [True] * len(items))
    return [as_row(Pair(p, c, items[m][1]), good) for (p, c, good), m in zip(items, mates, strict=True)]


def check_file(path: Any, label: str, kto: bool = False) -> None:
    """Before launch: every row of a JSON-lines pair file has the fields and types of one of the three shapes (kto:
    of an unpaired row)."""
    from pathlib import Path

    from toolkit.runtime.data.jsonl import check_rows

    path = Path(path)
    if path.is_file() and path.suffix not in (".jsonl", ".json"):
        raise ConfigError(f"{label}: preference pairs are read from JSON lines (.jsonl), got {path.name}")
    check_rows(path, label, kto_shape_of if kto else shape_of)


PARTNER_TRIES = 8
"""How many later candidates a row's mismatched completion is looked for among before one with the row's own prompt
is taken (files made from pairs hold each prompt's answers side by side)."""


def partners(keys: list[Any], prompts: list[Any], usable: list[bool]) -> list[int]:
    """Each row's mismatched row: the next usable row with the same key (the row's shape), wrapping to the first,
    whose prompt differs from the row's if one of the next PARTNER_TRIES does; the row itself if none is usable. One
    pass per key: rows by key in file order, each looked up by its place there."""
    import bisect

    by_key: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        if usable[i]:
            by_key.setdefault(key, []).append(i)
    out = []
    for k, key in enumerate(keys):
        order = by_key.get(key, [])
        if not order:
            out.append(k)
            continue
        start = bisect.bisect_right(order, k)
        tries = [order[(start + j) % len(order)] for j in range(min(PARTNER_TRIES, len(order)))]
        out.append(next((i for i in tries if i != k and prompts[i] != prompts[k]), tries[0]))
    return out


def _kto_pairs(objects: list[tuple[int, dict[str, Any]]], tokenizer: Any, max_length: int, where: str
               ) -> tuple[list[Pair], list[bool]]:
    """Unpaired rows as Pairs (module docstring) and their labels."""
    def filled(c: Any) -> bool:
        return bool(c) if isinstance(c, str) else bool(c[-1]["content"])

    shapes = [kto_shape_of(row, f"{where}:{lineno}") for lineno, row in objects]
    rows = [row for _, row in objects]
    mates = partners(shapes, [repr(r["prompt"]) for r in rows], [filled(r["completion"]) for r in rows])
    pairs = []
    for (lineno, row), mate in zip(objects, mates, strict=True):
        pseudo = {"prompt": row["prompt"], "chosen": row["completion"], "rejected": rows[mate]["completion"]}
        pairs.append(tokenize(pseudo, tokenizer, max_length, f"{where}:{lineno}", unpaired=True))
    return pairs, [row["label"] for row in rows]


def load_file(path: Any, tokenizer: Any, max_length: int, label: str, kto: bool = False
              ) -> tuple[list[dict[str, Any]], str]:
    """The file's pairs (kto: unpaired rows) as rows (the dropped ones left out), and one line saying what happened
    to its rows."""
    from pathlib import Path

    from toolkit.runtime.data.jsonl import read_objects

    if tokenizer is None:
        raise ConfigError(f"{label} is a file: set model.tokenizer to a local tokenizer directory")
    where = f"{label}: {path}"
    if kto:
        pairs, labels = _kto_pairs(list(read_objects(Path(path), label)), tokenizer, max_length, where)
    else:
        pairs = [tokenize(row, tokenizer, max_length, f"{where}:{lineno}")
                 for lineno, row in read_objects(Path(path), label)]
        labels = [None] * len(pairs)
    rows = [as_row(p, good) for p, good in zip(pairs, labels, strict=True) if p.status in (OK, TRUNCATED)]
    what = "unpaired rows" if kto else "pairs"
    if not rows:
        raise ConfigError(f"{label}: {path}: no usable {what.removesuffix('s')} ({counts(pairs)})")
    said = ", ".join(f"{n:,} {what}" for what, n in counts(pairs).items())
    if kto:
        good = sum(r["label"] for r in rows)
        said += f"; {good:,} desirable, {len(rows) - good:,} undesirable"
    return rows, (f"{label}: {len(pairs):,} preference {what} from {path}: {said} (at most {max_length} tokens a "
                  "sequence)")


CACHE_VERSION = 1


def load_cached(path: Any, tokenizer: Any, max_length: int, label: str, cache_root: Any, kto: bool = False
                ) -> tuple[list[dict], str]:
    """load_file, tokenized once: the rows go to `cache_root`/pairs/NAME.pt (token ids as flat int32 tensors),
    keyed by the file (path, size, modification time), the tokenizer (corpus.tokenizer_identity) and max_length, as
    SFT files are cached; a later launch reads them back. Every rank reads the cache or tokenizes; rank 0 writes."""
    import hashlib
    import json
    from pathlib import Path

    import torch

    from toolkit.launch import dist
    from toolkit.runtime.data.corpus import tokenizer_identity

    if tokenizer is None:
        raise ConfigError(f"{label} is a file: set model.tokenizer to a local tokenizer directory")
    src = Path(path)
    st = src.stat()
    key = {"version": CACHE_VERSION, "file": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
           "tokenizer": tokenizer_identity(tokenizer), "max_length": max_length, **({"kto": True} if kto else {})}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cached = Path(cache_root) / "pairs" / f"{src.stem[:40]}-{digest}.pt"
    if cached.is_file():
        try:
            saved = torch.load(cached, weights_only=True)
            return _unflatten(saved), f"{saved['note']} (tokenized before: {cached})"
        except Exception:  # a truncated or foreign file: tokenize again (rank 0 replaces it below)
            pass
    rows, note = load_file(path, tokenizer, max_length, label, kto)
    if dist.rank() == 0:
        from toolkit.runtime.objectives.precompute import save_atomic

        try:
            save_atomic(cached, {**_flatten(rows), "note": note})
        except OSError as e:  # a read-only cache costs later launches the tokenizing, not this one its run
            note += f" (not cached: {e})"
    return rows, note


def _flatten(rows: list[dict]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for field in FIELDS:
        out[field] = torch.tensor([t for r in rows for t in r[field]], dtype=torch.int32)
        out[f"{field}_lens"] = torch.tensor([len(r[field]) for r in rows], dtype=torch.int64)
    if "label" in rows[0]:
        out["label"] = torch.tensor([r["label"] for r in rows], dtype=torch.int8)
    return out


def _unflatten(saved: dict[str, Any]) -> list[dict]:
    parts = {}
    for field in FIELDS:
        flat, lens = saved[field].tolist(), saved[f"{field}_lens"].tolist()
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        parts[field] = [flat[a:b] for a, b in itertools.pairwise(starts)]
    labels = saved["label"].tolist() if "label" in saved else [None] * len(parts["prompt"])
    return [as_row(Pair(p, c, r), good) for p, c, r, good in zip(parts["prompt"], parts["chosen"], parts["rejected"],
                                                                  labels, strict=True)]
