"""Ulysses sequence parallelism (DeepSpeed's ALST pieces) around the toolkit's attention.

Each group of `size` consecutive ranks trains on the same micro-batches; rank r of a group keeps the r-th
slice of every row's tokens. Around each attention, DeepSpeed's `UlyssesSPAttentionHF` all-to-alls q/k/v so
that each rank holds the whole sequence for 1/size of the heads, runs the toolkit's attention on it (so
packed documents stay apart through the collator's boundaries, which are the whole rows'), and all-to-alls
the output back. Everything else in the model is per-token and runs on the slice.

Written here rather than taken from DeepSpeed whole, and why:
- `UlyssesSPAttentionHF.register_with_transformers` wraps one attention name and keeps the wrapper out of
  reach; the toolkit's attention has two names (interface.py), and only the one that carries document
  boundaries is wrapped here, so generation (padded prompts, no boundaries) runs unsharded on every rank.
- `UlyssesSPDataLoaderAdapter` gathers each rank's batch to the whole group and requires every tensor to be
  (batch, seq): the boundaries (1-D) break it. Here the ranks of a group draw the same batch (the sampler
  deals by data-parallel rank) and each keeps its slice: no exchange of data at all.
The loss needs nothing extra: the toolkit's loss is a sum over target tokens divided by the global count
(loops/raw.py), so each rank's slice contributes its own tokens, a slice without targets contributes 0 (no NaN),
and DeepSpeed sums gradients over a group and averages over the data-parallel ranks.

The HF Trainer path runs the same attention and slices, dealt by GroupOrder and cut by ShardingCollator. Its
engine gets no mpu (Accelerate builds it, and passes one only with its own Ulysses setup, whose data adapter
gathers a group's batches and breaks on the collator's 1-D document boundaries): to DeepSpeed every rank is then
data-parallel, holding its slice's tokens, which is exact for a token-mean loss. The Trainer divides each rank's
target sum by the targets of all ranks and multiplies by the world size, and DeepSpeed averages over the world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from toolkit.config.ds_config import ConfigError
from toolkit.runtime.data.batches import document_boundaries
from toolkit.runtime.data.corpus import IGNORE_INDEX


@dataclass
class SequenceParallel:
    size: int
    rank: int
    """This rank's place in its group: which slice of each row it keeps."""
    dp_rank: int
    dp_world: int
    """Data-parallel rank and count (groups): what the sampler deals by."""
    mpu: Any
    """DeepSpeed's parallel_state_sp module, for deepspeed.initialize(mpu=...)."""

    def shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A collated (batch, seq) causal-LM batch -> this rank's slice of it, with what the attention needs to
        put the rows back together: global position ids and document boundaries (a row is one document when
        the collator gave none), and labels shifted before slicing (`shift_labels`, which transformers' and
        Liger's losses read), so no target is lost at a slice edge. attention_mask is dropped: rows are
        right-padded, and causal attention never lets a token see the padding after it."""
        ids = batch["input_ids"]
        b, s = ids.shape
        if s % self.size:
            raise ValueError(f"a batch of {s} positions does not split over train.sequence_parallel={self.size}")
        out = {k: v for k, v in batch.items() if k not in ("attention_mask", "labels")}
        if "position_ids" not in out:
            out["position_ids"] = torch.arange(s).expand(b, s)
        if "cu_seq_lens_q" not in out:
            out |= document_boundaries([[s]] * b, s) | {"whole_rows": b}
        out["shift_labels"] = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        width = s // self.size
        lo = self.rank * width
        for k, v in out.items():
            if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape == (b, s):
                out[k] = v[:, lo:lo + width].contiguous()
        out["labels"] = out["shift_labels"]  # the model computes a loss only when given labels; shift_labels win
        return out


class GroupOrder(torch.utils.data.Sampler):
    """The HF Trainer path's sample order: every micro-batch of the epoch's order `size` times in a row. Accelerate
    deals batch i to rank i % world, so the `size` consecutive ranks of a group get the same micro-batch: the one the
    raw loop's ShardedBatches deals to their data-parallel rank."""

    def __init__(self, order: Any, micro_batch: int, size: int) -> None:
        self.order, self.micro, self.size = order, micro_batch, size

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def __iter__(self) -> Any:
        idx = self.order.order(self.order.epoch)
        for start in range(0, len(self) // self.size, self.micro):
            batch = idx[start:start + self.micro].tolist()
            for _ in range(self.size):
                yield from batch

    def __len__(self) -> int:
        return self.order.n // self.micro * self.micro * self.size


TOKENS_KEY = "toolkit_group_tokens"
"""The HF Trainer path's sharded batches carry their whole batch's token count under this key (training_step
takes it out before the model sees the batch): the slices' own positions cannot tell padding from tokens."""


class ShardingCollator:
    """The HF Trainer path's collator under sequence parallelism: the toolkit's collator, then this rank's slice
    (SequenceParallel.shard) in the loader, before the Trainer counts the batch's targets (it counts `shift_labels`,
    this rank's, and sums over every rank: each target once) and moves it to the device."""

    def __init__(self, collate: Any, sp: SequenceParallel) -> None:
        from dataclasses import replace

        self.collate, self.sp = collate, replace(sp, mpu=None)  # a module does not pickle into loader workers

    def __call__(self, rows: list[Any]) -> dict[str, Any]:
        from toolkit.observe.metrics import TokenCounter

        batch = self.collate(rows)
        counted = TokenCounter()
        counted.add(batch)
        return self.sp.shard(batch) | {TOKENS_KEY: torch.as_tensor(counted.tokens)}


def start(size: int, model_config: Any, micro_batch: int) -> SequenceParallel:
    """Every rank, after the process group and before deepspeed.initialize: DeepSpeed's sequence-parallel groups
    and its Ulysses attention wrapped around the toolkit's packed-rows attention name."""
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AttentionInterface

    from toolkit.launch import dist
    from toolkit.runtime.attention.interface import PACKED, attention_forward

    stop()  # an earlier run in this process (tests share launches): its groups and wrapper go first
    mpu.initialize_sequence_parallel(sequence_parallel_size=size)
    text = model_config.get_text_config()
    if getattr(text, "per_layer_attributes", None):  # DeepSpeed's Ulysses takes one head count and one head dim
        raise ConfigError(f"train.sequence_parallel: this model sets {', '.join(sorted(text.per_layer_attributes))} "
                          "per layer (per_layer_config); DeepSpeed's Ulysses attention takes one for every layer")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    ulysses = UlyssesSPAttentionHF(attn=attention_forward, batch_size=micro_batch,
                                   attn_head_count=text.num_attention_heads, attn_head_size=head_dim,
                                   kv_head_count=text.num_key_value_heads, num_hidden_layers=text.num_hidden_layers,
                                   process_group=mpu.get_sequence_parallel_group(), seq_length_is_variable=True)

    def sharded_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        _fit_batch(ulysses, query.shape[0])
        return ulysses(module, query, key, value, None, *args, **kwargs)  # masks: built for a slice, never read

    AttentionInterface.register(PACKED, sharded_attention)
    rank, world = dist.rank(), dist.world_size()
    return SequenceParallel(size=size, rank=mpu.get_sequence_parallel_rank(), dp_rank=rank // size,
                            dp_world=world // size, mpu=mpu)


def loss_multiplier(sp: SequenceParallel, ds: dict[str, Any]) -> int:
    """What the raw loop multiplies each rank's loss (sum over its targets / the global target count) by, so
    that DeepSpeed's gradient reduction yields the gradient of the global token mean.

    DeepSpeed sums the gradients of a sequence-parallel group and averages over the groups: x groups. Except
    ZeRO-3 with reduce_scatter on (its default): deepspeed 0.19.8's reduce-scatter path divides by every rank
    (stage3.py `__avg_scatter_grads` -> `reduce_scatter_coalesced`), where its contiguous path and ZeRO-1/2
    divide by ranks / sequence_parallel; its gradients came out 1/sequence_parallel of ZeRO-2's (measured:
    half the gradient norm at SP=2, tests/dist/test_sequence_parallel.py). Adam hides that from the loss,
    not from gradient clipping. There: x ranks."""
    zero = ds.get("zero_optimization", {})
    if int(zero.get("stage", 0)) == 3 and zero.get("reduce_scatter", True):
        return sp.dp_world * sp.size
    return sp.dp_world


def stop() -> None:
    """Undo start(): DeepSpeed keeps its groups and the engine's mpu in module globals (deepspeed.utils.groups),
    where a later engine in the same process, without sequence parallelism, would still find them; and the
    attention name gets the plain toolkit attention back. A no-op when start() never ran."""
    import sys

    sp_state = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if sp_state is None or getattr(sp_state, "_SEQUENCE_PARALLEL_GROUP", None) is None:
        return
    from deepspeed.utils import groups
    from transformers import AttentionInterface

    from toolkit.runtime.attention.interface import PACKED, attention_forward

    sp_state._release_sequence_parallel_groups()
    if groups.mpu is sp_state:
        groups.mpu = None
    AttentionInterface.register(PACKED, attention_forward)


def _fit_batch(ulysses: Any, rows: int) -> None:
    """DeepSpeed's wrapper checks shapes against the micro-batch it was built with; an eval batch may hold
    fewer rows (the last one), so the expected shapes follow the batch (the sequence dimension already does,
    with seq_length_is_variable)."""
    if ulysses.batch_size == rows:
        return
    ulysses.batch_size = rows
    for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
        shape = getattr(ulysses, name)
        setattr(ulysses, name, torch.Size([shape[0], rows, *shape[2:]]))
