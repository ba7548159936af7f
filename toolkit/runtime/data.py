"""Training data: an embedded learnable default, local jsonl/parquet/text files, collation, ordering.

Both training paths draw batches in the same order (`ShardedOrder`), so the raw loop and the HF
Trainer see the same samples on the same ranks and their losses can be compared step by step.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import Config
from toolkit.runtime.jsonl import read_objects

IGNORE_INDEX = -100  # positions the loss skips (prompt tokens, padding): HF's convention
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")


class ListDataset(Dataset):
    def __init__(self, rows: list[dict[str, list[int] | int]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int] | int]:
        return self.rows[i]


def synthetic_chain(vocab_size: int, seed: int) -> list[int]:
    """A fixed random permutation: the "next token" rule the embedded data follows."""
    rng = random.Random(seed)
    perm = list(range(vocab_size))
    rng.shuffle(perm)
    return perm


def synthetic_causal(cfg: Config, vocab_size: int, pad_id: int) -> list[dict[str, list[int]]]:
    """SFT-shaped samples: a random prompt (masked) then a response that follows a fixed bigram chain.

    Uniformly random tokens cannot be learned; the chain can (a bigram table), so the loss visibly
    falls from ln(vocab) within a few dozen steps, while the prompt part stays unlearnable and is
    correctly excluded from the loss with -100.
    """
    rng = random.Random(cfg.train.seed)
    # Token ids 0..3 stay reserved (pad/bos/eos/unk in the presets' tokenizer-free setup).
    low = 4
    chain = synthetic_chain(vocab_size, 0)
    rows = []
    for _ in range(cfg.data.num_samples):
        n = cfg.data.seq_len
        p = max(1, n // 4)
        prompt = [rng.randrange(low, vocab_size) for _ in range(p)]
        resp = []
        tok = prompt[-1]
        for _ in range(n - p):
            tok = chain[tok]
            if tok < low:  # stay in the non-special range
                tok = low + tok
            resp.append(tok)
        ids = prompt + resp
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * p + resp})
    return rows


def synthetic_classification(cfg: Config, vocab_size: int, num_labels: int) -> list[dict[str, Any]]:
    """Label = bucket of the first token: learnable from one position, like a [CLS] decision."""
    rng = random.Random(cfg.train.seed)
    rows = []
    for _ in range(cfg.data.num_samples):
        ids = [rng.randrange(4, vocab_size) for _ in range(cfg.data.seq_len)]
        label = (ids[0] - 4) * num_labels // (vocab_size - 4)
        rows.append({"input_ids": ids, "labels": label})
    return rows


def check_data_file(cfg: Config) -> None:
    """Cheap checks that run before any process-group work (missing file, wrong columns)."""
    if cfg.data.source == "synthetic":
        return
    p = Path(cfg.data.source)
    if not p.is_file():
        raise ConfigError(f"data.source: {p} is not a file (use 'synthetic' or a local {'/'.join(SUPPORTED_SUFFIXES)})")
    if p.suffix not in SUPPORTED_SUFFIXES:
        raise ConfigError(f"data.source: {p.suffix!r} files are not supported; use {', '.join(SUPPORTED_SUFFIXES)}")
    if p.suffix == ".txt":
        return
    cols = _columns(p)
    d = cfg.data
    if cfg.model.task == "seq_cls":
        need = [d.text_field, d.label_field]
        ok = all(c in cols for c in need)
    else:
        need = [d.prompt_field, d.response_field]
        ok = all(c in cols for c in need) or d.text_field in cols
        need_msg = f"{d.prompt_field!r}+{d.response_field!r} or {d.text_field!r}"
    if not ok:
        want = need_msg if cfg.model.task == "causal_lm" else " and ".join(repr(c) for c in need)
        raise ConfigError(f"data.source: {p} has columns {sorted(cols)}; expected {want} "
                          "(set data.prompt_field / data.response_field / data.text_field / data.label_field)")


def _columns(p: Path) -> set[str]:
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return set(pq.read_schema(p).names)
    for _, row in read_objects(p, "data.source"):
        return set(row)  # the first object names the columns
    raise ConfigError(f"data.source: {p} is empty")


def load_file_rows(cfg: Config, tokenizer: Any) -> list[dict[str, Any]]:
    """Tokenize a local file with `datasets` (no hub access: the loaders read local files only)."""
    from datasets import load_dataset

    p = Path(cfg.data.source)
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}[p.suffix]
    ds = load_dataset(kind, data_files=str(p), split="train")
    d, n = cfg.data, cfg.data.seq_len
    rows: list[dict[str, Any]] = []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for ex in ds:
        if cfg.model.task == "seq_cls":
            ids = tokenizer(ex[d.text_field], truncation=True, max_length=n)["input_ids"]
            rows.append({"input_ids": ids, "labels": int(ex[d.label_field])})
        elif d.prompt_field in ex and d.response_field in ex and kind != "text":
            prompt = tokenizer(ex[d.prompt_field], add_special_tokens=True)["input_ids"]
            resp = tokenizer(ex[d.response_field], add_special_tokens=False)["input_ids"] + eos
            ids = (prompt + resp)[:n]
            labels = ([IGNORE_INDEX] * len(prompt) + resp)[:n]
            if any(t != IGNORE_INDEX for t in labels):  # a prompt longer than seq_len leaves nothing to learn
                rows.append({"input_ids": ids, "labels": labels})
        else:
            ids = tokenizer(ex[d.text_field], add_special_tokens=True)["input_ids"] + eos
            rows.append({"input_ids": ids[:n], "labels": ids[:n]})
    if d.packing:
        rows = pack(rows, n)
    if not rows:
        raise ConfigError(f"data.source: {p} produced no training samples")
    return rows


def pack(rows: list[dict[str, Any]], block: int) -> list[dict[str, list[int]]]:
    """Concatenate samples into full blocks (labels keep their -100 masks); drops the ragged tail."""
    ids: list[int] = []
    labels: list[int] = []
    for r in rows:
        ids += r["input_ids"]
        labels += r["labels"]
    return [{"input_ids": ids[i:i + block], "labels": labels[i:i + block]}
            for i in range(0, len(ids) - block + 1, block)]


@dataclass
class Collator:
    """Pads to the longest sequence in the batch; padded label positions are -100."""

    pad_id: int
    task: str = "causal_lm"
    drop_full_mask: bool = False
    """Training batches: leave attention_mask out when nothing is padded, so causal models run SDPA's
    causal kernel without building a mask or checking it on the host (transformers calls
    `mask.all()` on the device tensor, a sync per forward). Equivalent: every token is attended."""

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            mask[i, :n] = 1
        out = {"input_ids": ids, "attention_mask": mask}
        if self.task == "seq_cls":
            out["labels"] = torch.tensor([b["labels"] for b in batch], dtype=torch.long)
        else:
            labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
            for i, b in enumerate(batch):
                labels[i, : len(b["labels"])] = torch.tensor(b["labels"])
            out["labels"] = labels
            if self.drop_full_mask and all(len(b["input_ids"]) == width for b in batch):
                del out["attention_mask"]
        return out


class EpochOrder(Sampler[int]):
    """The global sample order: a seeded permutation per epoch (or identity without shuffle).

    The HF Trainer gets this as its sampler (Accelerate then deals batch i to rank i % world);
    the raw loop deals the same way through `ShardedBatches`, so both paths see identical batches.
    """

    def __init__(self, n: int, seed: int, shuffle: bool) -> None:
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epoch))

    def __len__(self) -> int:
        return self.n


class ShardedBatches(Sampler[list[int]]):
    """Accelerate's batch dealing (batch i -> rank i % world), for the raw loop."""

    def __init__(self, order: EpochOrder, micro_batch: int, rank: int, world: int) -> None:
        self.order, self.micro, self.rank, self.world = order, micro_batch, rank, world
        self.skip = 0  # set on resume: micro-batches of this rank already consumed this epoch
        # Sample indices in the order batches were drawn. Loader workers prefetch, so this runs ahead of
        # training; the loop takes one entry per batch it consumes (the DataLoader keeps the order).
        self.drawn: collections.deque[list[int]] = collections.deque()

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        idx = self.order.order(self.order.epoch)
        batches = [idx[i:i + self.micro] for i in range(0, len(idx) - self.micro + 1, self.micro)]
        mine = batches[self.rank::self.world][: len(self)]
        # A generator, so the skip is consumed when batches are drawn, not when iter() is called: a
        # DataLoader with workers calls iter() on its batch sampler twice before the first batch.
        skip, self.skip = self.skip, 0  # only the first (resumed) epoch starts part-way
        for batch in mine[skip:]:
            self.drawn.append(batch)
            yield batch

    def __len__(self) -> int:
        return self.order.n // (self.micro * self.world)


def build_rows(cfg: Config, vocab_size: int, pad_id: int, tokenizer: Any) -> list[dict[str, Any]]:
    if cfg.data.source == "synthetic":
        if cfg.model.task == "seq_cls":
            return synthetic_classification(cfg, vocab_size, cfg.model.num_labels)
        return synthetic_causal(cfg, vocab_size, pad_id)
    if tokenizer is None:
        raise ConfigError("data.source is a file: set model.tokenizer to a local tokenizer directory "
                          "(or use a local model directory that contains one)")
    return load_file_rows(cfg, tokenizer)


def steps_per_epoch(n_samples: int, cfg: Config, world: int) -> int:
    """Optimizer steps in one pass over n_samples (what train.max_steps=0 means)."""
    per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * world
    return max(1, n_samples // per_step)


def even_rows(rows: list[dict[str, Any]], micro_batch: int, world: int) -> list[dict[str, Any]]:
    """Trim to whole rounds of micro_batch x world so every rank gets the same number of batches.

    Accelerate pads an uneven last round with samples from the start, which a raw loop would have
    to imitate; trimming keeps both paths identical and simple.
    """
    keep = len(rows) - len(rows) % (micro_batch * world)
    if keep == 0:
        raise ConfigError(f"{len(rows)} samples are fewer than one global micro-batch "
                          f"(micro_batch_size {micro_batch} x world size {world})")
    return rows[:keep]
