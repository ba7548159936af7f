"""pref.reference=precomputed: the reference's log-probs of every pair, computed once before training by the policy
itself (the reference is the policy's starting point: a full fine-tune's model before its first update, a LoRA
run's base with the adapters off), so training holds one model and runs no reference forward.

The pass replays the first epoch's micro-batches exactly as training draws them (the same sampler, collator and
ranks), so at step 1 the stored values are bit for bit what a live reference would compute and the first-loss check
(ln 2 for DPO) holds in bf16 too. Every rank then holds every pair's values (a gather of two floats a pair).

They are saved twice: `reference_logps.pt` in the run directory (a resume reads it: by then the policy is no longer
the reference, so it could not recompute them) and in the cache (`data.cache_dir`/reference, by default
$TOOLKIT_CACHE/reference), keyed by everything that changes the values (the model's weights as named, the pairs,
precision, kernels, batching), so a later run of the same model on the same pairs (another beta, learning rate or
length of run) skips the pass. TRL's precompute_ref_log_probs never worked under DeepSpeed until July 2026
(../shared/notes/preference.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from toolkit.launch import dist

FILE = "reference_logps.pt"


def cache_dir(data_cache_dir: str | None) -> Path:
    from toolkit.runtime.data.corpus import default_cache_dir

    return Path(data_cache_dir) / "reference" if data_cache_dir else default_cache_dir().parent / "reference"


def _weights(name: str) -> list[Any]:
    """A model directory's weight files by name, size and modification time (hashing gigabytes would cost more than
    the pass it saves); a preset's name alone (its weights are the seed's, hashed with it)."""
    from toolkit.hub import is_hub_id, resolved

    pinned = [r.sha for r in resolved() if r.id == name]
    if is_hub_id(name) and pinned:  # a hub id: its commit says what its weights are
        return [name, pinned[0]]
    path = Path(name)
    if not path.is_dir():
        return [name]
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".json"))
    return [name, *[(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in files]]


def row_hashes(rows: Any) -> list[int]:
    """A 64-bit fingerprint of each pair's tokens (Python's tuple hash: the same in every process, ints being
    unsalted), so a resume on another rank count (other rows trimmed) finds its pairs' values by prefix."""
    return [hash((tuple(r["prompt"]), tuple(r["chosen"]), tuple(r["rejected"]))) for r in rows]


def key_of(cfg: Any, resolved: Any, rows: Any, world: int, eval_rows: Any = None, model_config: Any = None
           ) -> tuple[str, str]:
    """(key, model key). The key: everything the stored values depend on (the model, the pairs, the first epoch's
    batching). The model key: the model and its numerics alone, what a resume on another rank count needs to match.
    The model: its name (a directory's weight files by name, size and time), its built config (model.num_layers and
    model.rope_factor included) and the seed of a preset's random init; the ZeRO stage, whose forward rounds
    otherwise in bf16 (llama-1b, 1,500-token pairs: ZeRO-3's values gave a ZeRO-2 policy a first loss of 0.786, not
    ln 2, one H200)."""
    t = cfg.train
    mc = model_config.to_json_string(use_diff=False) if model_config is not None else None
    model = {"weights": _weights(cfg.model.name), "config": mc, "seed": t.seed, "precision": resolved.precision,
             "stage": resolved.stage, "attention": resolved.attention.implementation, "liger": resolved.liger.kwargs,
             "packing": resolved.packing, "lora": bool(cfg.lora.enabled)}
    pairs = hashlib.sha256(json.dumps([row_hashes(rows), row_hashes(eval_rows or [])]).encode()).hexdigest()
    batching = {"micro": t.micro_batch_size, "world": world, "shuffle": cfg.data.shuffle, "pairs": pairs}

    def digest(obj: Any) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]

    return digest({**model, **batching}), digest(model)


def _load(path: Path) -> dict[str, Any] | None:
    """A stored file, or None where there is none or it cannot be read (a later pass replaces it)."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        return saved if isinstance(saved, dict) and {"key", "model_key", "logps", "rows"} <= saved.keys() else None
    except Exception:  # a truncated or foreign file is as good as none
        return None


def _matches(saved: dict[str, Any] | None, key: str, model_key: str, rows: list[int], held: list[int],
             resumed: bool) -> dict[str, Any] | None:
    """The stored values for these rows: the same key; or, on a resume, the same model and these pairs first (another
    rank count trims another number of rows: the values are per pair)."""
    if saved is None:
        return None
    if saved["key"] == key:
        return saved
    n = len(rows)
    same_pairs = saved["rows"][:n] == rows and saved.get("held", []) == held
    if resumed and saved["model_key"] == model_key and same_pairs:
        return {**saved, "logps": saved["logps"][:n]}
    return None


def save_atomic(path: Path, saved: dict[str, Any]) -> None:
    """torch.save through a temporary file and a rename: a reader (another launch) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    torch.save(saved, tmp)
    tmp.replace(path)  # atomic: a reader never sees half a file


@torch.no_grad()
def _compute(step: Any, engine: Any, rows: Any, collator: Any, batches: Any) -> torch.Tensor:
    """This rank's `batches` (lists of row indices; -1: a stand-in, where a rank has fewer) through the reference;
    every pair's values gathered on every rank."""
    from toolkit.runtime.data.batches import to_device

    mine: list[tuple[int, float, float]] = []
    engine.eval()
    for indices in batches:
        batch = to_device(collator([rows[max(i, 0)] for i in indices]), step.device)
        ref = step.reference_logps(engine, {k: v for k, v in batch.items() if k != "ref_logps"})
        mine += [x for x in zip(indices, ref.chosen.tolist(), ref.rejected.tolist(), strict=True) if x[0] >= 0]
    engine.train()
    out = torch.full((len(rows), 2), float("nan"))
    for part in dist.all_gather_object(mine):
        for i, c, r in part:
            out[i] = torch.tensor([c, r])
    if torch.isnan(out).any():
        raise RuntimeError(f"precomputed reference: {int(torch.isnan(out[:, 0]).sum())} of {len(rows)} pairs were in "
                           "no rank's first epoch")
    return out


def attach(step: Any, engine: Any, rows: Any, collator: Any, sampler: Any, run_dir: Path, cache: Path,
           keys: tuple[str, str], resumed: bool, eval_rows: Any = None) -> str:
    """Every row (and held-out row) gets ref_chosen / ref_rejected (the collator passes them on as ref_logps);
    returns the line to print: where the values came from. Rank 0 reads and writes the files and tells the others
    (an error there is raised on every rank, not left to hang them)."""
    key, model_key = keys
    local, shared = run_dir / FILE, cache / f"{key}.pt"
    mine, held = row_hashes(rows), row_hashes(eval_rows or [])
    found: list[Any] = [None, ""]
    if dist.rank() == 0:
        for path, where in ((local, f"{local} (this run's)"), (shared, f"the cache ({shared})")):
            saved = _matches(_load(path), key, model_key, mine, held, resumed and path == local)
            if saved is not None:
                found = [saved, where]
                break
    saved, where = dist.broadcast_object(found)
    t0 = time.perf_counter()
    if saved is None:
        if resumed:
            raise RuntimeError(f"pref.reference=precomputed: {local} is missing or belongs to another model or other "
                               "pairs, and a resumed policy is no longer the reference: it cannot be recomputed. "
                               "Restore the file, or start the run again")
        sampler.set_epoch(0)
        saved = {"key": key, "model_key": model_key, "rows": mine, "held": held,
                 "logps": _compute(step, engine, rows, collator, sampler), "eval": None}
        sampler.drawn.clear()
        if eval_rows is not None:
            from toolkit.runtime.data.batches import rank_batches

            saved["eval"] = _compute(step, engine, eval_rows, collator,
                                     rank_batches(len(eval_rows), sampler.micro, sampler.rank, sampler.world))
        where = f"computed in {time.perf_counter() - t0:.1f}s"
    failed = ""
    if dist.rank() == 0:
        if not where.startswith(str(local)):  # this run's own copy: what a resume reads
            try:
                save_atomic(local, {**saved, "key": key})
            except OSError as e:
                failed = f"pref.reference=precomputed: cannot write {local} ({e}); a resume would need it"
        if not failed and not shared.is_file():
            try:
                save_atomic(shared, saved)
            except OSError as e:  # a read-only cache costs later runs the pass, not this one its run
                where += f" (not cached: {e})"
    failed = dist.broadcast_object(failed)
    if failed:
        raise RuntimeError(failed)
    for part, values in ((rows, saved["logps"]), (eval_rows, saved.get("eval"))):
        for i, (c, r) in enumerate(values.tolist() if part is not None else []):
            part[i]["ref_chosen"], part[i]["ref_rejected"] = c, r
    n_held = f" and {len(eval_rows):,} held-out pairs" if eval_rows is not None else ""
    return f"reference log-probs of {len(rows):,} pairs{n_held}: {where}"
