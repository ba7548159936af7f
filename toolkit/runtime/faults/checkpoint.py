"""Run-directory snapshot and the final export (HF safetensors directory or a LoRA adapter).

Saving is a collective under ZeRO-3 (weights are gathered from every rank), so every rank calls
`export_model`; only rank 0 writes. The export lands in `<dir>.tmp` and is renamed when complete,
so a crash never leaves a half-written directory that looks like a result.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import Config, save_config
from toolkit.launch import dist
from toolkit.runtime.faults import integrity

PACKAGES = ("torch", "deepspeed", "transformers", "peft", "datasets", "accelerate", "liger-kernel")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def write_run_files(run_dir: Path, cfg: Config, ds: dict[str, Any], extra: dict[str, Any]) -> None:
    """Rank 0: exactly what ran: the resolved training config, DeepSpeed dict and versions."""
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / "ds_config.json").write_text(json.dumps(ds, indent=2) + "\n")
    (run_dir / "versions.json").write_text(json.dumps(versions() | extra, indent=2) + "\n")


def write_status(run_dir: Path, status: str, **fields: Any) -> None:
    if dist.rank() == 0:
        (run_dir / "status.json").write_text(json.dumps({"status": status, **fields}, indent=2) + "\n")


def gathered_state_dict(engine: Any) -> dict[str, Any] | None:
    """Full weights on rank 0 (None elsewhere). Collective under ZeRO-3.

    ZeRO-3 parameters are empty placeholders on every rank; `module.state_dict()` would save
    zero-size tensors. DeepSpeed's consolidated 16-bit gather returns real tensors (fp32 when
    training in fp32, despite the name).
    """
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict()
    return engine.module.state_dict() if dist.rank() == 0 else None


def export_model(engine: Any, out_dir: Path, tokenizer: Any | None = None,
                 verify: Callable[[Path], str | None] | None = None) -> Path | None:
    """Write an HF directory (safetensors) or, for a PEFT model, the adapter directory. All ranks call.

    verify (rank 0): the written `<dir>.tmp` held to the trained model (faults/export_check.py); the line it
    returns is an ExportError on every rank, and the files stay in `<dir>.tmp`, not marked done."""
    state = gathered_state_dict(engine)
    error = None
    if dist.rank() == 0:
        assert state is not None
        empty = [k for k, v in state.items() if v.numel() == 0]
        if empty:
            raise RuntimeError(f"refusing to export empty tensors (e.g. {empty[0]}): gather failed")
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        module = engine.module
        # training ran without a KV cache (runtime/model.py), and transformers copied that into the generation config
        # when the model was built; the exported model's inference wants its cache in both
        off = [c for c in (getattr(module, "config", None), getattr(module, "generation_config", None))
               if getattr(c, "use_cache", None) is False]
        for c in off:
            c.use_cache = True
        try:
            # PeftModel.save_pretrained keeps only the adapter weights of the full state dict.
            module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        finally:
            for c in off:
                c.use_cache = False
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        del state  # rank 0 held the whole model: freed before the check reloads it
        error = verify(tmp) if verify is not None else None
        if error is None:
            shutil.rmtree(out_dir, ignore_errors=True)
            tmp.rename(out_dir)
    error = dist.broadcast_object(error)
    if error is not None:
        raise ExportError(error)
    return out_dir


class ExportError(ConfigError):
    """An export that does not hold the trained model (faults/export_check.py): said in one line, not marked done."""


# ----------------------------------------------------------------------------- atomic checkpoints

COMPLETE = "complete.json"  # written into a checkpoint directory once every rank's files are on disk


def atomic_write(path: Path, text: str) -> None:
    """Write-then-rename with fsync: a reader sees the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # the rename itself is durable once the directory is synced
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def mark_complete(ckpt: Path, step: int, record: dict[str, Any] | None = None) -> None:
    """`record`: what resume needs besides the step (rank count, global batch, the fixed-batch loss)."""
    atomic_write(ckpt / COMPLETE, json.dumps({"step": step, **(record or {})}) + "\n")


def complete_checkpoints(root: Path, prefix: str) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint `<prefix><step>` under root, oldest first."""
    found = []
    for d in root.glob(f"{prefix}*") if root.is_dir() else []:
        step = d.name[len(prefix):]
        if d.is_dir() and step.isdigit() and (d / COMPLETE).is_file():
            found.append((int(step), d))
    return sorted(found)


def prune(root: Path, prefix: str, keep: int) -> list[Path]:
    """Rank 0, after a save completed: drop partial checkpoints (a save killed half-way: unmarked and
    newer than the newest complete one, so unmarked checkpoints of older toolkit versions stay) and all
    but the newest `keep` complete ones (0 keeps all). Returns what was removed."""
    complete = complete_checkpoints(root, prefix)
    newest = complete[-1][0] if complete else -1
    done = {d for _, d in complete}
    partial = [d for d in root.glob(f"{prefix}*") if d.is_dir() and d not in done
               and d.name[len(prefix):].isdigit() and int(d.name[len(prefix):]) > newest]
    old = [d for _, d in complete[:-keep]] if keep > 0 else []
    # a raw-path universal conversion (global_stepN_universal) goes with the checkpoint it came from
    gone = [*partial, *old, *(u for d in partial + old if (u := d.with_name(d.name + "_universal")).is_dir())]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone


def clear_stale(ckpt: Path) -> None:
    """All ranks, before a save into `ckpt`: a directory of that name left by a killed run (or a run
    resumed from an earlier step) would keep its extra shards and its old complete.json beside the new
    files, so rank 0 removes it (with its universal conversion) first."""
    if dist.rank() == 0:
        for d in (ckpt, ckpt.with_name(ckpt.name + "_universal")):
            shutil.rmtree(d, ignore_errors=True)
    dist.barrier()


def save_deepspeed_checkpoint(engine: Any, root: Path, step: int, keep: int,
                              record: Callable[[], dict[str, Any]] | None = None) -> Path:
    """All ranks call. DeepSpeed's own `save_checkpoint` writes `latest` on rank 0 as soon as rank 0's
    files are written, before the other ranks finish, and without a rename (../shared/notes/faults.md
    (c)); so `latest` is written here instead, after a barrier, atomically, with a completion marker
    that holds a digest of every file (toolkit/runtime/faults/integrity.py). A checkpoint that cannot fit is
    refused before a byte is written; a disk that fills during the save stops the run with one line
    (integrity.CheckpointError on every rank) and leaves no partial checkpoint and `latest` unchanged."""
    tag = f"global_step{step}"
    save = begin_save(engine, root / tag, "global_step")
    # save_checkpoint ends with a barrier (deepspeed/runtime/engine.py save_checkpoint): once it
    # returns, every rank's shard is written (or its failed write recorded).
    engine.save_checkpoint(str(root), tag=tag, client_state={"step": step}, save_latest=False)
    digests = end_save(save, root / tag)
    keep_note = save.keep_note
    # after the save: a failure here (e.g. the fixed-batch forward) must not cost the checkpoint's files
    fields = record() if record else None  # every rank: a collective under ZeRO-3
    error = None
    if dist.rank() == 0:
        try:
            mark_complete(root / tag, step, {**(fields or {}), **digests})
        except OSError as e:  # no marker, no checkpoint: give its space back
            shutil.rmtree(root / tag, ignore_errors=True)
            error = f"saving {root / tag} failed writing its {COMPLETE} ({e.strerror or e}); {keep_note}"
        if error is None:
            with contextlib.suppress(OSError):  # resume goes by complete.json; `latest` is for DeepSpeed's tools
                atomic_write(root / "latest", tag)
            prune(root, "global_step", keep)
    error = dist.broadcast_object(error)  # also the barrier: nobody leaves before the marker is written
    if error:
        raise integrity.CheckpointError(error)
    return root / tag


@dataclass(frozen=True)
class Save:
    """A save under way: what `end_save` needs to report a failed write."""

    writer: integrity.DigestingEngine | None
    needed: int
    known_from: str
    keep_note: str
    free_before: int


def begin_save(engine: Any, ckpt: Path, prefix: str) -> Save:
    """All ranks, before a DeepSpeed save into `ckpt` (either path): refuse a checkpoint that cannot fit,
    clear a stale directory of that name, and route the shards through a digest."""
    clear_stale(ckpt)  # first: a stale directory of this name is not space the save lacks
    needed, known_from, keep_note = expected_size(engine, ckpt.parent, prefix)
    integrity.precheck(ckpt, needed, known_from, keep_note)
    free_before = integrity.free_bytes(ckpt.parent)
    writer = integrity.install(engine)
    if writer is not None:
        writer.start()
    return Save(writer, needed, known_from, keep_note, free_before)


def end_save(save: Save, ckpt: Path) -> dict[str, Any]:
    """All ranks, after the save returned: the digests for the completion marker (rank 0), or the same
    CheckpointError on every rank when a write failed."""
    return integrity.finish_save(save.writer, ckpt, save.needed, save.known_from, save.free_before, save.keep_note)


def expected_size(engine: Any, root: Path, prefix: str) -> tuple[int, str, str]:
    """All ranks: (bytes the next checkpoint takes, how that is known, what stays if it fails). The size of
    the newest complete checkpoint when it recorded one (every save of a run has the same tensors), else an
    estimate from the engine's tensors (the first save)."""
    known = None
    if dist.rank() == 0:
        done = complete_checkpoints(root, prefix)
        keep_note = (f"{done[-1][1].name} stays the newest complete checkpoint (train.resume=latest resumes it)"
                     if done else "no complete checkpoint exists yet")
        size = None
        if done:
            with contextlib.suppress(OSError, ValueError):
                size = json.loads((done[-1][1] / COMPLETE).read_text()).get("bytes")
        known = (size, f"the size of {done[-1][1].name}" if size else "", keep_note)
    size, how, keep_note = dist.broadcast_object(known)
    if not size:  # a collective: every rank takes this branch or none does (rank 0 decided)
        size, how = integrity.estimate_bytes(engine), "estimated from the model and optimizer tensors"
    return int(size), how, keep_note


# ----------------------------------------------------------------------------- one run, one record

DEFAULT_RUN_DIR = "runs/default"
RUN_MARKERS = ("status.json", "metrics.jsonl", "memory", "checkpoints")
# Everything a run writes into its directory: train.overwrite removes these and nothing else.
RUN_ENTRIES = frozenset({*RUN_MARKERS, "config.yaml", "ds_config.json", "resolved.json", "versions.json", "export",
                         "export.tmp", "adapter", "adapter.tmp", "tb", "logs", "report.md", "report.png", "memory.png",
                         "probe.pt", "generations.jsonl", "resumes.jsonl", "plan.json", "micro_batch.json", "profile",
                         "trackers.json", "wandb", "reference_logps.pt", "completions.jsonl",
                         "optimizer_groups.json"})


def holds_a_run(run_dir: Path) -> bool:
    return any((run_dir / m).exists() for m in RUN_MARKERS)


def claim_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, default: bool) -> str | None:
    """Rank 0, before any rank writes: make sure this run never appends to another run's records.

    Resume appends to its own run. A directory that holds another run is refused with the fixes,
    except the default directory: the README's main job must work twice in a row, so the earlier run
    is moved aside (runs/default -> runs/default.<its last write>) and `runs/default` stays the latest.
    `overwrite` removes the earlier run. Returns a line to print, or raises ConfigError.
    """
    import time

    from toolkit.config.ds_config import ConfigError

    if resume or not holds_a_run(run_dir):
        return None
    if overwrite:
        foreign = sorted(e.name for e in run_dir.iterdir() if e.name not in RUN_ENTRIES)
        if foreign:
            raise ConfigError(f"train.overwrite=true: {run_dir} also holds {', '.join(foreign[:5])}, which no run "
                              "wrote; move them or pick another train.run_dir")
        for e in run_dir.iterdir():
            shutil.rmtree(e) if e.is_dir() else e.unlink()
        return f"train.overwrite=true: removed the earlier run in {run_dir}"
    if not default:
        raise ConfigError(f"train.run_dir={run_dir} already holds a run; continue it with train.resume=latest, "
                          "pick another train.run_dir, or replace it with train.overwrite=true")
    written = max((run_dir / m).stat().st_mtime for m in RUN_MARKERS if (run_dir / m).exists())
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(written))  # when the earlier run last wrote
    aside = run_dir.with_name(f"{run_dir.name}.{stamp}")
    n = 1
    while aside.exists():
        aside, n = run_dir.with_name(f"{run_dir.name}.{stamp}-{n}"), n + 1
    run_dir.rename(aside)
    return f"the earlier run in {run_dir} moved to {aside}"
