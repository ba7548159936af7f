"""`eval.generate`: generation from held-out prompts every eval.generate_every steps and after training, on
both paths; run_dir/generations.jsonl (and generations/step_N.jsonl), a line per call in metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.launch import dist
from toolkit.runtime.generation.batched import GenStats, generate_all, stop_ids
from toolkit.runtime.generation.guard import guard_generate, unwrap
from toolkit.runtime.generation.prompts import Prompt, exact_match, from_rows, load_prompts

if TYPE_CHECKING:
    from toolkit.runtime.spec import RunSpec


def run_prompts(p: RunSpec, tokenizer: Any | None, rows: list[dict[str, Any]]) -> list[Prompt]:
    """eval.generate_source's prompts (checked before launch), else the first eval.num_prompts training rows'."""
    src = p.cfg.eval.generate_source
    if src:
        return load_prompts(Path(src), tokenizer, "eval.generate_source")
    return from_rows(rows, p.cfg.eval.num_prompts)


def ids_of(p: RunSpec, tokenizer: Any | None) -> tuple[int, int | None]:
    """(pad id, stop id) for the run's generation."""
    mc = p.model_config
    pad_id = tokenizer.pad_token_id if tokenizer is not None else (mc.pad_token_id or 0)
    eos_id = p.cfg.eval.eos_token_id
    if eos_id is None:
        eos_id = tokenizer.eos_token_id if tokenizer is not None else getattr(mc, "eos_token_id", None)
    return pad_id, eos_id


def run_eval_generation(p: RunSpec, engine: Any, tokenizer: Any | None, prompts: list[Prompt], step: int,
                        final: bool, log: Any = None) -> GenStats | None:
    """Every rank calls it; rank 0 writes the generations and the line. `log(step, record)`: metrics.jsonl."""
    cfg = p.cfg
    if cfg.model.task != "causal_lm":
        if dist.rank() == 0:
            print("eval.generate: skipped (model.task is not causal_lm)", flush=True)
        return None
    pad_id, eos_id = ids_of(p, tokenizer)
    guard_generate(unwrap(engine))
    outputs, stats = generate_all(engine, [q.ids for q in prompts], cfg.eval, mc=p.model_config,
                                  zero3=p.resolved.stage == 3, pad_id=pad_id, eos_id=eos_id)
    if outputs is None:
        return stats
    path = p.run_dir / ("generations.jsonl" if final else f"generations/step_{step}.jsonl")
    write_generations(path, prompts, outputs, tokenizer)
    rec = stats.record()
    score = exact_match(prompts, outputs, tokenizer, stop_ids(unwrap(engine), eos_id))
    if score is not None:
        rec["gen_exact_match"] = score
    print(f"{stats.line()}{'' if score is None else f'; exact match {score:.3f}'} -> {path}", flush=True)
    if log is not None:
        log(step, rec)
    return stats


def write_generations(path: Path, prompts: list[Prompt], outputs: list[list[int]], tokenizer: Any | None) -> None:
    """One JSON object per prompt: index, prompt ids, generated ids (+ decoded text with a tokenizer, and the
    reference where the prompt has one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for i, (prompt, new) in enumerate(zip(prompts, outputs, strict=True)):
            row: dict[str, Any] = {"index": i, "prompt_ids": prompt.ids, "generated_ids": new}
            if tokenizer is not None:
                row["prompt_text"] = tokenizer.decode(prompt.ids)
                row["text"] = tokenizer.decode(new, skip_special_tokens=True)
            if prompt.reference is not None:
                row["reference"] = prompt.reference
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)  # never half a file
