"""A micro-batch of pairs as one forward, and the summed log-probs of each sequence's completion back as PairLogps.

Sequences are numbered pair by pair, chosen then rejected: sequence 2i is pair i's chosen, 2i + 1 its rejected.

- side by side (`packed=False`): one row per sequence, right-padded to the longest, with the attention mask.
- packed (`packed=True`): the micro-batch's sequences one after another in a single row, no padding at all
  (TRL's padding_free does the same, and since its DPO rewrite silently does not). Position ids restart at each
  sequence and no mask is sent, which is how transformers keeps packed documents apart (data/batches.Collator); on
  CUDA the varlen kernel gets each sequence's boundaries. The first label of each sequence is masked (it would be
  predicted by the previous sequence's last token); it is a prompt token in any case.

Each batch carries `seq_ids` ([rows, positions], the sequence each label belongs to, -1 on padding) and `sequences`
(their count, a Python int: read from the device it would be a host sync between the forward and the backward), which
the step takes out before the forward, `ref_logps` (a list of (chosen, rejected) floats a pair) where the reference's
log-probs were precomputed, and `kto_labels` (a list of 0/1 a row: desirable or not) for train.objective=kto.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from toolkit.runtime.objectives.logprobs import IGNORE
from toolkit.runtime.objectives.losses import PairLogps

PRIVATE = ("seq_ids", "sequences", "ref_logps", "kto_labels")
"""Batch keys the step reads and the model must not see."""


def sequences(row: dict[str, Any]) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """A pair row (objectives/pairs.as_row) as its (chosen, rejected) SFT rows: prompt + completion, prompt masked."""
    prompt = list(row["prompt"])
    mask = [IGNORE] * len(prompt)
    return ({"input_ids": prompt + list(row["chosen"]), "labels": mask + list(row["chosen"])},
            {"input_ids": prompt + list(row["rejected"]), "labels": mask + list(row["rejected"])})


@dataclass
class PairCollator:
    """Pair rows to one forward's batch, side by side or packed (module docstring)."""

    pad_id: int
    packed: bool = False
    boundaries: bool = False
    """Packed: also the cu_seq_lens / max_length keywords of transformers' varlen attention (the CUDA kernels)."""

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        seqs = [s for r in rows for s in sequences(r)]
        out = self._packed(seqs) if self.packed else self._side_by_side(seqs)
        out["sequences"] = len(seqs)
        if "ref_chosen" in rows[0]:
            # Python floats, not a tensor: the HF Trainer casts every floating-point input to the DeepSpeed dtype, and
            # a summed log-prob near -1,000 in bf16 is off by up to 4 (TRL's precompute under DeepSpeed bf16 has that
            # bug: its first DPO loss 0.80, not ln 2, measured on llama-1b with TRL 1.16)
            out["ref_logps"] = [(float(r["ref_chosen"]), float(r["ref_rejected"])) for r in rows]
        if "label" in rows[0]:  # kto: Python ints, as the step reads them (no host sync)
            out["kto_labels"] = [int(r["label"]) for r in rows]
        return out

    def _side_by_side(self, seqs: list[dict[str, list[int]]]) -> dict[str, Any]:
        width = max(len(s["input_ids"]) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        seq_ids = torch.full((len(seqs), width), -1, dtype=torch.long)
        for k, s in enumerate(seqs):
            n = len(s["input_ids"])
            ids[k, :n] = torch.tensor(s["input_ids"])
            labels[k, :n] = torch.tensor(s["labels"])
            mask[k, :n] = 1
            seq_ids[k, :n] = k
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "seq_ids": seq_ids}

    def _packed(self, seqs: list[dict[str, list[int]]]) -> dict[str, Any]:
        return pack(seqs, self.boundaries)


def pack(seqs: list[dict[str, list[int]]], boundaries: bool = False) -> dict[str, Any]:
    """Sequences ({"input_ids", "labels"}) one after another in a single row (module docstring: packed), with their
    `seq_ids`; boundaries: the varlen kernel's cu_seq_lens / max_length keywords too. An RL step packs its
    completions the same way (rl/step.py)."""
    from toolkit.runtime.data.batches import document_boundaries

    lens = [len(s["input_ids"]) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s["input_ids"]])[None]
    labels = torch.tensor([t for s in seqs for t in [IGNORE, *s["labels"][1:]]])[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    seq_ids = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lens))[None]
    out = {"input_ids": ids, "labels": labels, "position_ids": pos, "seq_ids": seq_ids, "sequences": len(seqs)}
    if boundaries:
        out |= document_boundaries([lens], sum(lens))
    return out


def sequence_sums(token_logps: torch.Tensor, labels: torch.Tensor, seq_ids: torch.Tensor, n: int) -> PairLogps:
    """Each pair's summed completion log-probs and token counts from per-position log-probs.

    token_logps: [rows, positions], position t's log-prob of the label at t + 1 (0 where that label is ignored);
    labels and seq_ids: [rows, positions] as the batch carries them; n: the number of sequences (the batch's
    `sequences`)."""
    per_label = torch.zeros_like(token_logps)
    per_label[:, 1:] = token_logps[:, :-1]  # the state at t predicts the label at t + 1
    counted = labels != IGNORE
    counted[:, 0] = False
    slot = seq_ids.masked_fill(~counted, n).reshape(-1)  # padding and prompt tokens go to a dump slot
    sums = torch.zeros(n + 1, dtype=torch.float32, device=token_logps.device).index_add(
        0, slot, per_label.reshape(-1).float())
    tokens = torch.zeros(n + 1, dtype=torch.float32, device=token_logps.device).index_add(
        0, slot, counted.reshape(-1).float())
    return PairLogps(sums[0:n:2], sums[1:n:2], tokens[0:n:2], tokens[1:n:2])


def token_logps(model: Any, batch: dict[str, Any], head: Any, temperature: float = 1.0) -> torch.Tensor:
    """Position t's log-prob of the label at t + 1 under `model` ([rows, positions], fp32, 0 where that label is
    ignored), of the logits divided by `temperature`: through the model's SelectedHead (`head`, logprobs.py) where it
    has one, else from the whole logits. The batch's private keys stay out of the forward. Preference and RL steps
    both take their log-probs here."""
    return token_logps_entropy(model, batch, head, temperature, entropy=False)[0]


def token_logps_entropy(model: Any, batch: dict[str, Any], head: Any, temperature: float = 1.0,
                        entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logps` and, where `entropy`, each position's entropy of its whole next-token distribution (the same
    temperature; [rows, positions], fp32, no gradient): an RL run's entropy metric, from the same chunks."""
    inputs = {k: v for k, v in batch.items() if k not in PRIVATE and k != "labels"}
    labels = batch["labels"]
    if head is not None:
        with head.targets(labels, temperature, entropy):
            out = model(**inputs, use_cache=False).logits
            return out, head.entropy
    logits = model(**inputs, use_cache=False).logits
    return logits_token_logps(logits / temperature if temperature != 1.0 else logits, labels, entropy)


def logits_token_logps(logits: torch.Tensor, labels: torch.Tensor, entropy: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position log-probs of the next label from the whole logits (models whose head is not a plain matrix:
    a final soft-cap or a logit scale), a row at a time in fp32 (one row's fp32 copy at once, not the batch's);
    and each position's entropy where `entropy`."""
    out = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    ent = torch.zeros_like(out) if entropy else None
    for r in range(logits.shape[0]):
        targets = labels[r, 1:]
        logp = logits[r, :-1].float().log_softmax(-1)
        out[r, :-1] = logp.gather(-1, targets.clamp(min=0)[:, None]).squeeze(-1).masked_fill(targets == IGNORE, 0.0)
        if ent is not None:
            with torch.no_grad():
                ent[r, :-1] = -(logp.exp() * logp).sum(-1)
    return out, ent
