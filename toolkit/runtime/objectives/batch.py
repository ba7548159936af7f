"""Pairs through one forward: chosen and rejected side by side (padded), or packed padding-free into rows, and the
summed log-probs of each sequence's completion tokens back as PairLogps.

Packed, a pair's two sequences go into the same row as two documents: position ids restart at each, and the
attention keeps them apart as it keeps packed SFT documents apart (data/batches.py Collator, and the varlen kernel
on CUDA). The first token of each sequence predicts nothing across the boundary: its label is masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from toolkit.runtime.objectives.logprobs import DEFAULT_CHUNK, IGNORE, selected_logprobs
from toolkit.runtime.objectives.losses import PairLogps
from toolkit.runtime.objectives.pairs import Pair


@dataclass(frozen=True)
class Segment:
    pair: int
    """Index of the pair in the batch."""
    chosen: bool


def side_by_side(pairs: list[Pair]) -> tuple[list[dict[str, Any]], list[Segment]]:
    """One row per sequence: every pair's chosen, then every pair's rejected (collate with data/batches.Collator)."""
    rows = [p.rows()[0] for p in pairs] + [p.rows()[1] for p in pairs]
    segments = [Segment(i, True) for i in range(len(pairs))] + [Segment(i, False) for i in range(len(pairs))]
    return rows, segments


def packed(pairs: list[Pair], seq_len: int) -> tuple[list[dict[str, Any]], list[Segment]]:
    """Rows of at most seq_len tokens, each pair's chosen and rejected kept together in one row (first fit, in
    order); rows carry seq_lens as packed SFT rows do. Segments list every row's sequences in row order."""
    rows: list[dict[str, Any]] = []
    row_segments: list[list[Segment]] = []
    for i, p in enumerate(pairs):
        chosen, rejected = p.rows()
        need = len(chosen["input_ids"]) + len(rejected["input_ids"])
        if need > seq_len:
            raise ValueError(f"pair {i} takes {need} tokens, more than a row's {seq_len}: truncate pairs to half "
                             "a row or less before packing")
        r = next((k for k, row in enumerate(rows) if len(row["input_ids"]) + need <= seq_len), None)
        if r is None:
            rows.append({"input_ids": [], "labels": [], "seq_lens": []})
            row_segments.append([])
            r = len(rows) - 1
        for seq, side in ((chosen, True), (rejected, False)):
            labels = list(seq["labels"])
            labels[0] = IGNORE  # predicted by the previous sequence's last token: not this pair's
            rows[r]["input_ids"] += seq["input_ids"]
            rows[r]["labels"] += labels
            rows[r]["seq_lens"].append(len(seq["input_ids"]))
            row_segments[r].append(Segment(i, side))
    return rows, [s for segs in row_segments for s in segs]


def sequence_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   seq_lens: list[list[int]] | None = None, chunk: int = DEFAULT_CHUNK
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of each sequence's labelled tokens, and their counts, in row order.

    hidden: [rows, positions, hidden size] (the last layer's, after the final norm), weight: the output embedding,
    labels: [rows, positions] as the batch carries them (position t's label is predicted by position t-1).
    seq_lens: each packed row's sequence lengths (None: one sequence per row). Never builds the whole logits.
    """
    targets = torch.full_like(labels, IGNORE)
    targets[:, :-1] = labels[:, 1:]  # the state at t predicts the label at t + 1
    per_token = selected_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk)
    per_token = per_token.view(labels.shape)
    counted = (targets != IGNORE).float()
    if seq_lens is None:
        return per_token.sum(-1), counted.sum(-1)
    # each packed token's sequence number over the batch; padding after a row's last sequence goes to a dump slot
    ids = torch.full(labels.shape, -1, dtype=torch.long)
    n = 0
    for r, lens in enumerate(seq_lens):
        start = 0
        for k in lens:
            ids[r, start:start + k] = n
            start += k
            n += 1
    ids = ids.to(labels.device).masked_fill(ids.to(labels.device) < 0, n).reshape(-1)
    sums = torch.zeros(n + 1, dtype=per_token.dtype, device=per_token.device).index_add(0, ids, per_token.reshape(-1))
    tokens = torch.zeros(n + 1, device=per_token.device).index_add(0, ids, counted.reshape(-1))
    return sums[:n], tokens[:n]


def pair_logps(sums: torch.Tensor, tokens: torch.Tensor, segments: list[Segment], n_pairs: int) -> PairLogps:
    """Per-sequence sums (in the order of `segments`) as each pair's chosen and rejected."""
    chosen = [k for k, s in enumerate(segments) if s.chosen]
    rejected = [k for k, s in enumerate(segments) if not s.chosen]
    order_c = torch.tensor([segments[k].pair for k in chosen]).argsort()
    order_r = torch.tensor([segments[k].pair for k in rejected]).argsort()
    if len(chosen) != n_pairs or len(rejected) != n_pairs:
        raise ValueError(f"{len(chosen)} chosen and {len(rejected)} rejected sequences for {n_pairs} pairs")
    c = torch.tensor(chosen, device=sums.device)[order_c.to(sums.device)]
    r = torch.tensor(rejected, device=sums.device)[order_r.to(sums.device)]
    return PairLogps(sums[c], sums[r], tokens[c], tokens[r])


@dataclass
class PairCollator:
    """A micro-batch of pair rows (objectives/pairs.as_row) as one forward: every chosen sequence, then every
    rejected one, padded (data/batches.Collator)."""

    pad_id: int

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        from toolkit.runtime.data.batches import Collator

        seqs, _ = side_by_side([Pair(list(r["prompt"]), list(r["chosen"]), list(r["rejected"])) for r in rows])
        return Collator(pad_id=self.pad_id)(seqs)


def logits_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of each row's labelled tokens (and their counts) from the whole logits, a row at a time in
    fp32 (so one row's fp32 copy exists at once, not the batch's)."""
    sums, counts = [], []
    for r in range(logits.shape[0]):
        targets = labels[r, 1:]
        keep = targets != IGNORE
        lp = logits[r, :-1].float().log_softmax(-1).gather(-1, targets.clamp(min=0)[:, None]).squeeze(-1)
        sums.append((lp * keep).sum())
        counts.append(keep.sum().float())
    return torch.stack(sums), torch.stack(counts)
