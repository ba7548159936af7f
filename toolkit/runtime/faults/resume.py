"""Resume: which checkpoint, on how many ranks, and proof that the load worked.

- The checkpoint a run resumes from is the newest complete one (or a named tag), on either path.
- A checkpoint written on another number of ranks is resharded through DeepSpeed's universal
  checkpoint (`ds_to_universal`, then `checkpoint.load_universal`): DeepSpeed alone refuses it
  ("The checkpoint being loaded used a DP world size of X but the current world size is Y",
  DeepSpeed#2898). The global batch stays the checkpoint's; gradient accumulation absorbs the change,
  so the batch order and the schedule continue where they stopped.
- Every save records the loss on a fixed batch; every resume recomputes it right after the load and
  stops the run when the two disagree (a load that silently kept other weights).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.launch import dist
from toolkit.runtime.data.batches import to_device
from toolkit.runtime.data.corpus import IGNORE_INDEX
from toolkit.runtime.faults import integrity
from toolkit.runtime.faults.checkpoint import COMPLETE, atomic_write, complete_checkpoints

# ZeRO-1/2/3 optimizer shards, one per data-parallel rank (bf16_ when DeepSpeed's BF16_Optimizer wrote them).
_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
UNIVERSAL_SUFFIX = "_universal"
RESUMES = "resumes.jsonl"  # one line per resume of this run directory


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint of either path, and what it was written with."""

    dir: Path  # what the path resumes from: raw `checkpoints/global_stepN`, Trainer `checkpoints/checkpoint-N`
    tag_dir: Path  # the DeepSpeed tag directory inside it (the same directory on the raw path)
    step: int
    record: dict[str, Any] = field(default_factory=dict)  # the completion marker's fields

    @property
    def world_size(self) -> int | None:
        """Data-parallel ranks whose optimizer shards it holds; None when the optimizer state is not
        partitioned (ZeRO-0 keeps a full copy per rank, which loads on any rank count)."""
        ranks = {int(m.group(1)) for f in self.tag_dir.iterdir() if (m := _SHARD.match(f.name))}
        return len(ranks) or None

    def global_batch(self, fallback: int) -> int:
        return int(self.record.get("global_batch", fallback))


def find(run_dir: Path, path: str, resume: str) -> Checkpoint:
    """The checkpoint `train.resume` names: `latest` (the newest complete one) or a tag."""
    root = run_dir / "checkpoints"
    prefix = "checkpoint-" if path == "trainer" else "global_step"
    if resume == "latest":
        done = complete_checkpoints(root, prefix)
        if not done:
            raise FileNotFoundError(f"train.resume=latest: no complete checkpoint under {root}")
        step, ckpt = done[-1]
    else:
        ckpt = root / resume
        if not ckpt.is_dir():
            raise FileNotFoundError(f"train.resume={resume}: no checkpoint {ckpt}")
        step = int(resume[len(prefix):]) if resume[len(prefix):].isdigit() else -1
    try:
        record = json.loads((ckpt / COMPLETE).read_text())
    except (OSError, ValueError):
        record = {}  # an unmarked checkpoint named explicitly, or one from an older toolkit version
    step = int(record.get("step", step))
    tag_dir = ckpt / f"global_step{step}" if path == "trainer" else ckpt
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"train.resume={resume}: {ckpt} holds no DeepSpeed checkpoint ({tag_dir.name})")
    return Checkpoint(ckpt, tag_dir, step, record)


def check_intact(ckpt: Checkpoint, path: str) -> str | None:
    """All ranks, before anything is loaded or moved: every file of the checkpoint against the digest taken
    when it was written (toolkit/runtime/faults/integrity.py). Returns the refusal (one line, the same on every rank),
    naming the damaged file and the previous complete checkpoint with the setting that resumes it; None when
    the checkpoint is whole."""
    problems, note = integrity.verify(ckpt.dir, ckpt.record)
    if not problems:
        if dist.rank() == 0:
            print(f"train.resume: {note}", flush=True)
        return None
    prefix = "checkpoint-" if path == "trainer" else "global_step"
    earlier = [d for step, d in complete_checkpoints(ckpt.dir.parent, prefix) if step < ckpt.step]
    more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
    fix = (f"the previous complete checkpoint is {earlier[-1].name}: resume from it with train.resume={earlier[-1].name}"
           if earlier else "there is no earlier complete checkpoint: start again with train.overwrite=true")
    return f"checkpoint {ckpt.dir} is damaged: {problems[0]}{more}; not resuming from it; {fix}"


def set_aside_newer(ckpt: Checkpoint, path: str) -> str | None:
    """Rank 0, resuming from a checkpoint older than the newest complete one: the newer complete ones belong
    to the abandoned continuation. Left in place, `latest` and pruning (both by step) would prefer them over what this run
    writes, so they move to checkpoints/abandoned-<time>/, kept, not deleted."""
    root = ckpt.dir.parent
    prefix = "checkpoint-" if path == "trainer" else "global_step"
    # complete ones only: a newer partial save is pruned by the next save (checkpoint.prune), as before
    newer = [d for step, d in complete_checkpoints(root, prefix) if step > ckpt.step]
    if not newer:
        return None
    aside = root / time.strftime("abandoned-%Y%m%d-%H%M%S")
    aside.mkdir(exist_ok=True)
    for d in newer:
        for x in (d, d.with_name(d.name + UNIVERSAL_SUFFIX)):
            if x.is_dir():
                x.rename(aside / x.name)
    return f"train.resume: {len(newer)} checkpoint(s) newer than {ckpt.dir.name} moved to {aside}"


@dataclass(frozen=True)
class Reshard:
    """A resume onto another number of ranks than the checkpoint was written on."""

    checkpoint: Checkpoint
    saved_world: int
    global_batch: int
    grad_accum: int  # this run's accumulation: the checkpoint's global batch over micro x ranks


def reshard_for(ckpt: Checkpoint, micro_batch: int, grad_accum: int, world: int) -> Reshard | None:
    """None when the checkpoint loads as it is; otherwise the accumulation that keeps its global batch."""
    saved = ckpt.world_size
    if saved is None or saved == world:
        return None
    batch = ckpt.global_batch(micro_batch * grad_accum * saved)  # older markers: assume the same config
    if batch % (micro_batch * world):
        per_rank = batch // world if batch % world == 0 else None
        fix = (f"train.micro_batch_size={max(d for d in range(1, micro_batch) if per_rank % d == 0)}" if per_rank
               else f"a rank count that divides {batch}")
        raise ConfigError(f"train.resume: {ckpt.dir} was written on {saved} ranks with a global batch of {batch}, "
                          f"which {world} ranks at micro_batch_size={micro_batch} cannot split evenly; use {fix}")
    return Reshard(ckpt, saved, batch, batch // (micro_batch * world))


def to_universal(ckpt: Checkpoint, timeout_s: int) -> str:
    """Rank 0: convert the tag directory once, with DeepSpeed's own converter; returns the universal tag.

    The converter writes in place and names its output in `latest_universal` only at the end
    (../shared/notes/faults.md (d)); it runs into a staging directory here and is renamed when done, so a
    conversion killed half-way is redone, never loaded.
    """
    root, tag = ckpt.tag_dir.parent, ckpt.tag_dir.name
    out = root / f"{tag}{UNIVERSAL_SUFFIX}"
    if not (out / COMPLETE).is_file():
        staging = root / f".{tag}{UNIVERSAL_SUFFIX}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        staging.mkdir()
        # --inject_missing_state: ZeRO-1/2 saves of a plain deepspeed.initialize (or the HF Trainer) lack
        # the universal_checkpoint_info the converter asserts on (DeepSpeed#5405); it only tags the version.
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt.tag_dir),
               "--output_folder", str(staging / out.name), "--inject_missing_state",
               "--num_extract_workers", str(max(1, min(4, (os.cpu_count() or 1) // 2))), "--num_merge_workers", "1"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"ds_to_universal failed on {ckpt.tag_dir} (exit {done.returncode}):\n"
                               f"{(done.stdout + done.stderr)[-3000:]}")
        os.replace(staging / out.name, out)
        shutil.rmtree(staging, ignore_errors=True)
        atomic_write(out / COMPLETE, json.dumps({"from": tag, "seconds": round(time.perf_counter() - t0, 1)}) + "\n")
    atomic_write(root / "latest_universal", out.name)  # what load_checkpoint(tag=None) reads with load_universal
    return out.name


def prepare(p_reshard: Reshard | None, timeout_s: int) -> str | None:
    """All ranks: rank 0 converts, the others wait; returns the universal tag (None: nothing to convert).

    A rank-0 failure is broadcast, so every rank raises the same error instead of waiting forever."""
    if p_reshard is None:
        return None
    result: list[str | None] = [None, None]  # [tag, error]
    if dist.rank() == 0:
        try:
            result[0] = to_universal(p_reshard.checkpoint, timeout_s)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            result[1] = str(e)
    tag, error = dist.broadcast_object(result)
    if error:
        raise RuntimeError(error)
    return tag


def universal_config(ds: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed dict that loads a universal checkpoint (the rest of the run is unchanged)."""
    return ds | {"checkpoint": {**ds.get("checkpoint", {}), "load_universal": True}}


# ----------------------------------------------------------------------------- proof on a fixed batch


# The proof needs every weight, not the training length: a whole long row's forward (no gradients, its full
# logits) does not fit where its training step does (384K tokens of an 8B model: 200 GB of logits alone).
FIXED_TOKENS = 2048


def fixed_batch(rows: list[dict[str, Any]], collate: Any) -> dict[str, Any]:
    """The first FIXED_TOKENS of the first two samples: the same batch on every rank and every rank count."""
    return collate([_head(r, FIXED_TOKENS) for r in rows[:2]])


def _head(row: dict[str, Any], n: int) -> dict[str, Any]:
    """A row's first n tokens: its per-token lists cut, a packed row's documents cut to fit (seq_lens). A window
    of prompt only (a long row's labels start after it) scores every token instead: a loss over no label is NaN,
    which proves nothing."""
    ids = row["input_ids"]
    if len(ids) <= n:
        return row
    out = {k: v[:n] if hasattr(v, "__len__") and not isinstance(v, str) and len(v) == len(ids) else v
           for k, v in row.items()}
    labels = out.get("labels")
    if isinstance(labels, (list, tuple)) and all(int(x) == IGNORE_INDEX for x in labels):
        out["labels"] = list(out["input_ids"])
    if "seq_lens" in row:
        lens, left = [], n
        for k in row["seq_lens"]:
            if left <= 0:
                break
            lens.append(min(int(k), left))
            left -= lens[-1]
        out["seq_lens"] = lens
    return out


def batch_digest(batch: dict[str, Any]) -> str:
    return hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest()[:16]


def fixed_batch_loss(model: Any, batch: dict[str, Any]) -> float:
    """Every rank calls it (under ZeRO-3 the forward gathers weights from all ranks). Eval mode: no dropout."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(**to_device(batch, dist.device()))
        # a batch without labels (a reward model's): the mean of the model's outputs proves the weights as well
        return float(out.loss if out.loss is not None else out.logits.float().mean())
    finally:
        model.train(was_training)


def save_record(model: Any, batch: dict[str, Any], world: int, global_batch: int,
                sequence_parallel: int = 1) -> dict[str, Any]:
    """What a completion marker records besides the step: enough to reshard and to verify the load."""
    return {"world_size": world, "global_batch": global_batch, "fixed_batch_loss": fixed_batch_loss(model, batch),
            "fixed_batch": batch_digest(batch), "sequence_parallel": sequence_parallel}


def tolerance(precision: str) -> float:
    # fp32: the same weights give the same loss to rounding (the 1e-5). 16-bit: the 16-bit copy
    # is re-derived from the fp32 master weights on load, which may round a few values the other way.
    return 1e-5 if precision == "fp32" else 1e-3


def verify(model: Any, batch: dict[str, Any], ckpt: Checkpoint, run_dir: Path, precision: str, world: int,
           grad_accum: int, universal: str | None) -> None:
    """All ranks, right after the load: the loss on the fixed batch must equal the one recorded at the save.
    Rank 0 appends the evidence to resumes.jsonl. Every rank sees the same loss, so every rank raises."""
    saved = ckpt.record.get("fixed_batch_loss")
    same_batch = ckpt.record.get("fixed_batch") == batch_digest(batch)
    why_not = None if saved is not None and math.isfinite(saved) and same_batch else (
        "the checkpoint has no fixed-batch loss (an older toolkit)" if saved is None else
        "the fixed-batch loss at the save was not finite" if not math.isfinite(saved) else
        "the proof batch changed (other data, or a toolkit that took another window of it)")
    loaded = fixed_batch_loss(model, batch) if why_not is None else None
    # decided on the largest difference over the ranks, so every rank stops or none does (NaN counts as inf)
    diff = float("inf") if loaded is None or loaded != loaded else abs(loaded - saved)
    worst = _all_max(0.0 if why_not else diff)
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "checkpoint": ckpt.dir.name, "step": ckpt.step,
             "saved_world_size": ckpt.world_size, "world_size": world, "grad_accum": grad_accum,
             "universal": universal, "fixed_batch_loss_saved": saved, "fixed_batch_loss_loaded": loaded,
             "not_verified": why_not}
    if dist.rank() == 0:
        with (run_dir / RESUMES).open("a") as f:
            f.write(json.dumps(entry) + "\n")
        how = f", resharded {ckpt.world_size} -> {world} ranks through {universal}" if universal else ""
        seen = (f"; not verified: {why_not}" if why_not else
                f"; loss on a fixed batch {saved:.6f} at the save, {loaded:.6f} after the load")
        print(f"resumed {ckpt.dir.name} at step {ckpt.step}{how}{seen}", flush=True)
    if not worst <= tolerance(precision) * max(1.0, abs(saved or 0.0)):
        raise RuntimeError(f"resume from {ckpt.dir}: the loss on a fixed batch was {saved:.6f} when it was saved and is "
                           f"{loaded} after the load on rank {dist.rank()} (largest difference over the ranks "
                           f"{worst:.3g}): the weights did not load as saved; not training on them")


def _all_max(x: float) -> float:
    import torch
    import torch.distributed as tdist

    t = torch.tensor([x], dtype=torch.float64, device=dist.device())
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return float(t)
