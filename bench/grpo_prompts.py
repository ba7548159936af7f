"""Prompts for the GRPO benchmark from local text: consecutive windows of --tokens tokens of the repository's own
markdown, decoded back to text ({"prompt": text} a line; re-tokenized they come back at about --tokens tokens).

    python bench/grpo_prompts.py --tokenizer .pairs/tok --tokens 128 --n 512 --out .pairs/prompts_128.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    text = "\n\n".join(p.read_text() for p in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")]))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rows = []
    for k in range(a.n):
        start = (k * a.tokens) % max(len(ids) - a.tokens, 1)
        rows.append({"prompt": tok.decode(ids[start:start + a.tokens])})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lens = [len(tok(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows]
    print(f"{a.out}: {len(rows)} prompts of {min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.1f})")


if __name__ == "__main__":
    main()
