"""Training data: an embedded learnable default, local files (tokenized once into a memory-mapped cache by
runtime/data/corpus.py), a held-out split, collation (packed blocks included), ordering.

Both training paths draw batches in the same order (`ShardedOrder`), so the raw loop and the HF
Trainer see the same samples on the same ranks and their losses can be compared step by step.
"""

from __future__ import annotations

import collections
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import Config
from toolkit.runtime.data.corpus import IGNORE_INDEX  # positions the loss skips (prompt tokens, padding)

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")


class ListDataset(Dataset):
    def __init__(self, rows: Sequence[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
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
    """Cheap checks that run before any process-group work: missing file, wrong suffix, wrong columns."""
    from toolkit.runtime.data.corpus import check_format, file_columns, resolve_format

    for what, source in (("data.source", cfg.data.source), ("data.eval_source", cfg.data.eval_source)):
        if source is None or (what == "data.source" and source == "synthetic"):
            continue
        p = Path(source)
        if not p.is_file():
            hint = "'synthetic' or " if what == "data.source" else ""
            raise ConfigError(f"{what}: {p} is not a file (use {hint}a local {'/'.join(SUPPORTED_SUFFIXES)})")
        if p.suffix not in SUPPORTED_SUFFIXES:
            raise ConfigError(f"{what}: {p.suffix!r} files are not supported; use {', '.join(SUPPORTED_SUFFIXES)}")
        cols = file_columns(p, what)
        check_format(cfg, resolve_format(cfg, p, cols), cols, None, p, what)


class Rows(Sequence[dict[str, Any]]):
    """Samples as the loops read them: a Python list (synthetic data) or a memory-mapped Arrow dataset
    (a tokenized file), optionally through an index array (a held-out split) and a length limit (whole
    rounds of batches). Nothing is copied: a row is read when it is drawn."""

    def __init__(self, base: Any, index: Any = None, limit: int | None = None) -> None:
        self.base, self.index = base, index
        self._len = min(len(base) if index is None else len(index), limit if limit is not None else sys.maxsize)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        return self.base[int(i if self.index is None else self.index[i])]

    def limited(self, n: int) -> Rows:
        return Rows(self.base, self.index, n)


def build_rows(cfg: Config, vocab_size: int, pad_id: int, tokenizer: Any) -> tuple[Rows, Rows | None]:
    """(training rows, held-out rows or None). Files are tokenized once into the cache (runtime/data/corpus.py)."""
    if cfg.data.source == "synthetic":
        rows: Rows = Rows(synthetic_classification(cfg, vocab_size, cfg.model.num_labels)
                          if cfg.model.task == "seq_cls" else synthetic_causal(cfg, vocab_size, pad_id))
    else:
        rows = _corpus(cfg, cfg.data.source, tokenizer, "data.source")
    if cfg.data.eval_source:
        return rows, _corpus(cfg, cfg.data.eval_source, tokenizer, "data.eval_source")
    if cfg.data.eval_fraction:
        return split_eval(rows, cfg.data.eval_fraction, cfg.train.seed)
    return rows, None


def _corpus(cfg: Config, source: str, tokenizer: Any, what: str) -> Rows:
    from toolkit.runtime.data.corpus import load_corpus

    if tokenizer is None:
        raise ConfigError(f"{what} is a file: set model.tokenizer to a local tokenizer directory "
                          "(or use a local model directory that contains one)")
    c = load_corpus(cfg, source, tokenizer, what)
    return Rows(c.rows, c.index)


def split_eval(rows: Rows, fraction: float, seed: int) -> tuple[Rows, Rows]:
    """A seeded draw of the held-out rows (every rank draws the same); both keep the file's order."""
    import numpy as np

    n = len(rows)
    n_eval = max(1, round(n * fraction))
    if n_eval >= n:
        raise ConfigError(f"data.eval_fraction={fraction} leaves no training rows out of {n}")
    pick = np.random.default_rng(seed).permutation(n)
    held = np.sort(pick[:n_eval])
    train = np.sort(pick[n_eval:])
    base = rows.base if rows.index is None else None
    if base is None:  # a view of a view: compose the indices
        train, held = np.asarray(rows.index)[train], np.asarray(rows.index)[held]
        base = rows.base
    return Rows(base, train), Rows(base, held)


@dataclass
class Collator:
    """Pads to the longest sequence in the batch; padded label positions are -100."""

    pad_id: int
    task: str = "causal_lm"
    boundaries: bool = False
    """Packed rows also carry their documents' boundaries for variable-length attention: cu_seq_lens_q/k
    (int32 offsets over the flattened batch; the padding after a row's last document is one more segment)
    and max_length_q/k (a Python int, so no forward waits for the device to find it). Unpacked batches
    without padding (drop_full_mask) carry them too, each row one document and whole: a sliding-window model's
    unpacked rows (runtime/attention.plan)."""
    whole_rows: bool = False
    """With boundaries, for the toolkit's own attention: rows that hold one document filling at least 7/8 of
    the row come first and `whole_rows` counts them (they run through sdpa's causal kernel, cuDNN's on Hopper,
    about 1.5x flash's varlen kernel per token at 8k); the others follow with their own `packed_cu_seq_lens`
    and `packed_max_length` (see `row_split`). Rows of a batch are independent, so their order is free."""
    multiple_of: int = 1
    """Batches are padded to a multiple of this many positions (train.sequence_parallel: each rank's slice)."""
    drop_full_mask: bool = False
    """Training batches: leave attention_mask out when nothing is padded, so causal models run SDPA's
    causal kernel without building a mask or checking it on the host (transformers calls
    `mask.all()` on the device tensor, a sync per forward). Equivalent: every token is attended."""

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "seq_lens" in batch[0]:
            return self._packed(batch)
        width = self._width(batch)
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
                if self.boundaries:  # unpacked rows of a sliding-window model (attention.plan): one document each
                    out |= document_boundaries([[width]] * len(batch), width) | {"whole_rows": len(batch)}
        return out


    def _width(self, batch: list[dict[str, Any]]) -> int:
        longest = max(len(b["input_ids"]) for b in batch)
        return -(-longest // self.multiple_of) * self.multiple_of

    def _packed(self, batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Packed blocks: position ids restart at 0 for every sample and no attention_mask is sent, which is
        how transformers recognizes packed sequences (masking_utils.find_packed_sequence_indices for sdpa and
        eager, the varlen path for flash-attention): no sample attends to another. Padding after the last
        sample gets position 0 at every token, so each pad is a sequence of its own (TokenCounter tells it
        apart: real samples have at least 2 tokens)."""
        width = self._width(batch)
        if self.boundaries and self.whole_rows:  # rows of one document first: the attention slices, not gathers
            batch = sorted(batch, key=lambda b: not is_whole(b["seq_lens"], width))
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        pos = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            labels[i, :n] = torch.tensor(b["labels"])
            pos[i, :n] = torch.cat([torch.arange(k) for k in b["seq_lens"]])
        out = {"input_ids": ids, "labels": labels, "position_ids": pos}
        if self.boundaries:
            lens = [list(b["seq_lens"]) for b in batch]
            out |= document_boundaries(lens, width)
            if self.whole_rows:
                out |= row_split(lens, width)
        return out


def document_boundaries(seq_lens: list[list[int]], width: int) -> dict[str, Any]:
    """The keywords transformers' varlen attention paths read (its DataCollatorWithFlattening writes the same),
    for rows of `width` positions holding these documents, each row's padding one more segment."""
    segments: list[int] = []
    for lens in seq_lens:
        segments.extend(lens)
        if width > sum(lens):
            segments.append(width - sum(lens))
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(segments, dtype=torch.int32).cumsum(0)
    longest = max(segments)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def is_whole(seq_lens: list[int], width: int) -> bool:
    """A row of one document filling at least 7/8 of it (the padding after it needs no mask under causal
    attention, as no token of the document sees it)."""
    return len(seq_lens) == 1 and 8 * seq_lens[0] >= 7 * width


def row_split(seq_lens: list[list[int]], width: int) -> dict[str, Any]:
    """For a packed batch whose rows of one document come first (the Collator orders them so): `whole_rows`,
    how many rows lead that are one document each (a Python int: the attention slices the batch there without
    asking the device), and for the rows after them their documents' own boundaries (`packed_cu_seq_lens`,
    `packed_max_length`). Empty when no row is whole; only `whole_rows` when every row is."""
    whole = 0
    while whole < len(seq_lens) and is_whole(seq_lens[whole], width):
        whole += 1
    if any(is_whole(lens, width) for lens in seq_lens[whole:]):
        raise ValueError("row_split: rows of one document must come first (Collator(whole_rows=True) orders them)")
    if not whole:
        return {}
    out: dict[str, Any] = {"whole_rows": whole}
    if whole < len(seq_lens):
        b = document_boundaries(seq_lens[whole:], width)
        out |= {"packed_cu_seq_lens": b["cu_seq_lens_q"], "packed_max_length": b["max_length_q"]}
    return out


def to_device(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    """A collated batch on `device`: its tensors moved, its Python values (max_length_q/k) kept."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def document_note(rows: Rows) -> str | None:
    """Packed rows of a file: how long their documents are, token-weighted (what attention spans within
    each document; `toolkit plan --doc-len` takes it). None for rows that are not packed blocks."""
    if isinstance(rows.base, list) or "seq_lens" not in rows.base.column_names:
        return None
    import numpy as np
    import pyarrow.compute as pc

    lens = pc.list_flatten(rows.base.data.column("seq_lens")).to_numpy().astype(np.float64)
    if not len(lens):
        return None
    weighted = float((lens * lens).sum() / lens.sum())
    return (f"packed: {len(rows):,} blocks of {len(lens):,} documents, mean {lens.mean():.0f} tokens, "
            f"token-weighted {weighted:.0f} (toolkit plan --doc-len {weighted:.0f})")


class EpochOrder(Sampler[int]):
    """The global sample order: a seeded permutation per epoch (or identity without shuffle).

    The HF Trainer gets this as its sampler (Accelerate then deals batch i to rank i % world);
    the raw loop deals the same way through `ShardedBatches`, so both paths see identical batches.

    With `lengths` (rows not packed), each epoch's permutation is grouped by length the way HF's
    `group_by_length` does it (transformers' `get_length_grouped_indices`: megabatches of up to 50 rounds
    of `group` samples, each sorted longest first, the longest sample in the first batch), so a
    micro-batch pads to a length close to each of its rows'.
    """

    def __init__(self, n: int, seed: int, shuffle: bool, lengths: Any = None, group: int = 1) -> None:
        self.n, self.seed, self.shuffle, self.epoch = n, seed, shuffle, 0
        self.lengths, self.group = lengths, group

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's sample indices as one int64 tensor (8 bytes a sample, not a Python int each)."""
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed + epoch)
        if self.lengths is not None:
            from transformers.trainer_pt_utils import get_length_grouped_indices

            return torch.as_tensor(get_length_grouped_indices(self.lengths, self.group, generator=g),
                                   dtype=torch.int64)
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[int]:
        return (int(i) for i in self.order(self.epoch))

    def __len__(self) -> int:
        return self.n


def row_lengths(rows: Rows) -> Any:
    """Tokens per row as a numpy array, read from the Arrow column without touching the rows (None for
    synthetic rows: they all have one length)."""
    import numpy as np

    if isinstance(rows.base, list):
        return None
    import pyarrow.compute as pc

    lengths = pc.list_value_length(rows.base.data.column("input_ids")).to_numpy()
    if rows.index is not None:
        lengths = lengths[np.asarray(rows.index)]
    return lengths[: len(rows)]


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
        # A generator, so the skip is consumed when batches are drawn, not when iter() is called: a
        # DataLoader with workers calls iter() on its batch sampler twice before the first batch.
        skip, self.skip = self.skip, 0  # only the first (resumed) epoch starts part-way
        for k in range(skip, len(self)):  # this rank's k-th batch is the epoch's batch rank + k * world
            start = (self.rank + k * self.world) * self.micro
            batch = idx[start:start + self.micro].tolist()
            self.drawn.append(batch)
            yield batch

    def __len__(self) -> int:
        return self.order.n // (self.micro * self.world)


def rank_batches(n: int, micro: int, rank: int, world: int) -> list[list[int]]:
    """Row indices of each of this rank's eval batches; every rank gets the same count. An empty batch (a
    rank past the end) is [-1]: a masked stand-in."""
    per_round = micro * world
    rounds = max(1, -(-n // per_round))
    out = []
    for r in range(rounds):
        start = r * per_round + rank * micro
        idx = list(range(start, min(start + micro, n)))
        out.append(idx or [-1])
    return out


def window_repeats(cfg: Config) -> int:
    """Optimizer steps each window of micro-batches is trained on: rl.num_iterations for GRPO (a rollout's
    updates, TRL's mu, as its RepeatSampler repeats a generation batch), else 1."""
    return cfg.rl.num_iterations if cfg.train.objective == "grpo" else 1


def steps_per_epoch(n_samples: int, cfg: Config, world: int) -> int:
    """Optimizer steps in one pass over n_samples (what train.max_steps=0 means)."""
    per_step = cfg.train.micro_batch_size * cfg.train.grad_accum * world
    return max(1, n_samples // per_step) * window_repeats(cfg)


def even_rows(rows: Rows, micro_batch: int, world: int) -> Rows:
    """Trim to whole rounds of micro_batch x world so every rank gets the same number of batches.

    Accelerate pads an uneven last round with samples from the start, which a raw loop would have
    to imitate; trimming keeps both paths identical and simple.
    """
    keep = len(rows) - len(rows) % (micro_batch * world)
    if keep == 0:
        raise ConfigError(f"{len(rows)} samples are fewer than one global micro-batch "
                          f"(micro_batch_size {micro_batch} x world size {world})")
    return rows.limited(keep)
