"""Padding waste of the batching a run chooses, on a real corpus: pad positions / computed positions over
one epoch, through the toolkit's own rows (runtime/data/corpus.py cache) and sample order (runtime/data/batches.py).

    python bench/data_cache.py make --work /tmp/dc --files data100k
    python bench/padding.py --work /tmp/dc --out bench/results/padding.json

Rows: packing on (blocks of seq_len, best-fit decreasing), packing off with batches grouped by length
(the default without packing), and packing off in a plain shuffled order (what runs did before), at
seq 2048, micro 16, one rank and eight. No GPU, no model: only the token counts of each micro-batch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def waste(rows, order, micro: int, world: int) -> dict[str, float]:
    from toolkit.runtime.data.batches import ShardedBatches, row_lengths

    lengths = row_lengths(rows)
    tokens = positions = 0
    for rank in range(world):
        for batch in ShardedBatches(order, micro, rank, world):
            n = lengths[batch]
            tokens += int(n.sum())
            positions += int(n.max()) * len(batch)
    return {"tokens": tokens, "positions": positions, "padding_waste": round(1 - tokens / positions, 4)}


def main() -> int:
    from transformers import AutoTokenizer

    from toolkit.config.schema import load_config
    from toolkit.runtime.data.batches import EpochOrder, build_rows, row_lengths

    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=16)
    a = p.parse_args()
    tok = AutoTokenizer.from_pretrained(a.work / "llama")
    out = {"corpus": str(a.work / "data100k.jsonl"), "seq_len": a.seq, "micro_batch": a.micro, "rows": []}
    for packing in ("true", "false"):
        cfg = load_config(None, [f"data.source={a.work / 'data100k.jsonl'}", f"data.seq_len={a.seq}",
                                 f"data.packing={packing}", f"data.cache_dir={a.work / 'cache'}"])
        rows, _ = build_rows(cfg, len(tok), tok.pad_token_id, tok)
        kinds = ["blocks"] if packing == "true" else ["grouped by length", "shuffled"]
        for kind in kinds:
            for world in (1, 8):
                lengths = row_lengths(rows) if kind == "grouped by length" else None
                order = EpochOrder(len(rows), 1234, True, lengths=lengths, group=a.micro * world)
                out["rows"].append({"packing": packing == "true", "order": kind, "ranks": world, "samples": len(rows),
                                    **waste(rows, order, a.micro, world)})
                print(out["rows"][-1], flush=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
