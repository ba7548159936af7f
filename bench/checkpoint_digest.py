"""What the checkpoint digests cost (toolkit/runtime/faults/integrity.py): hashing rate, a shard written with and
without the digest, and the read-back at resume, on a directory you name (the disk checkpoints go to).

    python bench/checkpoint_digest.py --dir /tmp --gib 1 --out bench/results/checkpoint_digest.json

The 7B estimate in docs/faults-and-resume.md comes from these rates: a 7B model with Adam in mixed precision
writes 2 (bf16 weights) + 12 (fp32 master weights and two moments) = 14 bytes per parameter, 98 GB.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the shards are written")
    ap.add_argument("--gib", type=float, default=1.0, help="shard size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch
    import xxhash

    from toolkit.runtime.faults import integrity

    n = int(args.gib * (1 << 30))
    state = {"exp_avg": torch.randn(n // 8), "exp_avg_sq": torch.randn(n // 8)}
    raw = memoryview(state["exp_avg"].numpy()).cast("B")
    rates = {}
    for name, make in (("xxh3_128", xxhash.xxh3_128), ("sha256", hashlib.sha256)):
        rates[name] = len(raw) / _best(lambda make=make: make(raw).hexdigest(), args.repeats) / 1e9
    path = args.dir / "digest_bench.pt"

    class _Engine:
        zipfile_serialization = True

    def plain() -> None:  # what DeepSpeed does: torch.save to a path, no fsync
        torch.save(state, path)

    def plain_fsync() -> None:
        torch.save(state, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def digested() -> None:  # the toolkit: unbuffered, digest while writing, fsync
        w = integrity.DigestingEngine(_Engine())
        w.save(state, str(path))
        assert w.failure is None

    times = {k: _best(f, args.repeats) for k, f in (("torch_save", plain), ("torch_save_fsync", plain_fsync),
                                                     ("digest_fsync", digested))}
    size = path.stat().st_size
    verify_warm = _best(lambda: integrity.file_digest(path), args.repeats)
    path.unlink()
    gb = size / 1e9
    result = {
        "dir": str(args.dir), "shard_gb": round(gb, 3), "cpu": os.cpu_count(),
        "hash_gb_per_s": {k: round(v, 2) for k, v in rates.items()},
        "write_s": {k: round(v, 3) for k, v in times.items()},
        "write_gb_per_s": {k: round(gb / v, 2) for k, v in times.items()},
        "digest_overhead_s_per_gb": round((times["digest_fsync"] - times["torch_save_fsync"]) / gb, 3),
        "verify_page_cache_gb_per_s": round(gb / verify_warm, 2),
        "7b_checkpoint_gb": 98.0,
        "7b_hash_cpu_s": round(98.0 / rates["xxh3_128"], 1),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
