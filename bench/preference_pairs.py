"""Preference pairs from local real text, for the DPO benchmarks (the toolkit's and TRL's `DPOTrainer`).

    python bench/data_cache.py make --work /tmp/dc --files docs      # docs.jsonl + the 8k BPE tokenizer
    python bench/preference_pairs.py --preset short --out /tmp/dc/pairs_short.jsonl --n 2000 --seed 0
    python bench/preference_pairs.py --preset long --out /tmp/dc/pairs_long.jsonl --n 2000 --seed 0
    python bench/preference_pairs.py --tokenizer /tmp/dc/llama --out pairs.jsonl --n 2000 \\
        --prompt-tokens 40-120 --completion-tokens 60-180 --seed 0

Each row is `{"prompt": str, "chosen": str, "rejected": str}`, cut from the long standard-library documents of
`data_cache.py make --files docs` (docs.jsonl): the prompt is a slice of one document, `chosen` the text that
follows it in that document, `rejected` a slice of another document. Their lengths are counted in tokens of
--tokenizer and drawn uniformly from the ranges (prompt and each completion independently); every cut falls on a
token boundary of the document's own tokenization (character offsets), so the text is real and unaltered.
Only cuts that tokenize the same alone and joined (prompt, prompt + chosen, prompt + rejected) are kept, so a
trainer splitting prompt from completion by tokenizing both (TRL does) gets the drawn counts exactly.
Presets: short (prompt 40-120, completions 60-180: 100-300 tokens per sequence, prompt + completion) and long
(prompt 500-700, completions 800-1000: about 1,500). The same seed, source and tokenizer give the same file.
Prints one line: rows, mean and range of tokens per sequence (prompt + completion, both sequences of a pair).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

PRESETS = {"short": ((40, 120), (60, 180)), "long": ((500, 700), (800, 1000))}


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"expected LO-HI token counts with 0 < LO <= HI, got {text!r}")
    return a, b


class Docs:
    """The documents, each tokenized once on first use (the pairs touch a few hundred of them)."""

    def __init__(self, path: Path, tokenizer: Any) -> None:
        self.texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
        self.tok = tokenizer
        self._enc: dict[int, tuple[list[int], list[tuple[int, int]]]] = {}

    def tokens(self, i: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of document i and their character offsets."""
        if i not in self._enc:
            enc = self.tok(self.texts[i], add_special_tokens=False, return_offsets_mapping=True)
            self._enc[i] = (list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]])
        return self._enc[i]

    def cut(self, i: int, start: int, n: int) -> tuple[str, list[int]]:
        """Tokens start..start+n of document i: the document's own characters, and the ids."""
        ids, offs = self.tokens(i)
        return self.texts[i][offs[start][0]:offs[start + n - 1][1]], ids[start:start + n]

    def encodes_to(self, text: str, ids: list[int]) -> bool:
        return self.tok(text, add_special_tokens=False)["input_ids"] == ids


def make_pairs(docs: Docs, n: int, prompt: tuple[int, int], completion: tuple[int, int],
               seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    tries = 0
    while len(rows) < n:  # most draws pass the boundary check below (about 3 in 4 on the short preset)
        tries += 1
        if tries > 50 * n:
            raise SystemExit(f"only {len(rows)} of {n} pairs fit: the documents are too short for these ranges")
        p, c, r = rng.randint(*prompt), rng.randint(*completion), rng.randint(*completion)
        a, b = rng.randrange(len(docs.texts)), rng.randrange(len(docs.texts))
        if a == b:
            continue
        na, nb = len(docs.tokens(a)[0]), len(docs.tokens(b)[0])
        if na < p + c or nb < r:  # a short document: draw again (the ranges decide, not the documents)
            continue
        s, t = rng.randrange(na - p - c + 1), rng.randrange(nb - r + 1)
        (pt, pi), (ct, ci), (rt, ri) = docs.cut(a, s, p), docs.cut(a, s + p, c), docs.cut(b, t, r)
        # Cuts where the texts tokenize alone and joined exactly as cut: a trainer that tokenizes prompt and
        # prompt + completion (TRL does) then splits them where they were cut, with the drawn token counts. A cut
        # inside a word or whitespace run (BPE merges across it, or the pre-tokenizer splits it otherwise) is drawn
        # again.
        if not (docs.encodes_to(pt, pi) and docs.encodes_to(pt + ct, pi + ci) and docs.encodes_to(pt + rt, pi + ri)):
            continue
        rows.append({"prompt": pt, "chosen": ct, "rejected": rt})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=Path("/tmp/dc/docs.jsonl"),
                    help="documents, one {'text': ...} a line (bench/data_cache.py make --files docs)")
    ap.add_argument("--tokenizer", default="/tmp/dc/llama", help="local tokenizer directory that sizes the cuts")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="short")
    ap.add_argument("--prompt-tokens", type=_span, default=None, help="LO-HI, overrides the preset's")
    ap.add_argument("--completion-tokens", type=_span, default=None, help="LO-HI, overrides the preset's")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    prompt, completion = PRESETS[a.preset]
    prompt, completion = a.prompt_tokens or prompt, a.completion_tokens or completion
    rows = make_pairs(Docs(a.source, tok), a.n, prompt, completion, a.seed)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Re-tokenized the way a trainer sees them (prompt + completion as one string), so the summary is what they get
    lens = [len(tok(r["prompt"] + r[k], add_special_tokens=False)["input_ids"]) for r in rows
            for k in ("chosen", "rejected")]
    print(f"wrote {a.out}: {len(rows)} rows, {sum(lens) / len(lens):.1f} tokens per sequence on average "
          f"(min {min(lens)}, max {max(lens)}; prompt {prompt[0]}-{prompt[1]}, completion "
          f"{completion[0]}-{completion[1]}, seed {a.seed})", flush=True)


if __name__ == "__main__":
    main()
