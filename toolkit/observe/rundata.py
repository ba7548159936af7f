"""Reading a run directory for `toolkit report`: memory/rank{N}.jsonl, metrics.jsonl, config.yaml,
ds_config.json and versions.json.

Reads only files inside the run directory, by relative path, so a run dir copied from another
machine works. Bad lines (truncated, not JSON, missing fields) are skipped and named, never fatal.
No torch/deepspeed imports here: the report must run anywhere, fast.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.config import ds_config as dc

PHASE_ORDER = ("model_loaded", "engine_ready", "first_step", "step", "final", "oom")
GPU_KEYS = ("allocated_gib", "reserved_gib", "peak_allocated_gib", "peak_reserved_gib", "nvml_used_gib")
MEMORY_REQUIRED = ("phase", "step")
NUMERIC_MEMORY = (*GPU_KEYS, "host_rss_gib", "alloc_retries", "oom_count")
METRIC_KEYS = ("loss", "lr", "tokens_per_s", "samples_per_s", "step_time_s", "grad_norm", "mfu", "elapsed_s",
               "padding_waste")
EVAL_KEYS = ("eval_loss", "eval_ppl", "eval_tokens",  # a held-out loss line (runtime/loops/evaluate.py)
             "eval_pairs", "eval_rewards/accuracies", "eval_rewards/margins",  # held-out preference pairs
             "eval_kl")  # held-out kto rows
PREF_KEYS = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")
RL_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "kl")  # train.objective=grpo
GEN_KEYS = ("gen_prompts", "gen_new_tokens", "gen_s", "gen_tokens_per_s", "gen_batch_size",
            "gen_exact_match")  # an eval.generate line (runtime/generation/evaluate.py)
# What toolkit/train.py writes into every run directory; a directory with none of them is not a run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "memory/rank*.jsonl")


@dataclass
class RunData:
    memory: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # rank -> snapshots in file order
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # held-out loss lines, by step
    generations: list[dict[str, Any]] = field(default_factory=list)  # eval.generate lines, in file order
    skipped: list[str] = field(default_factory=list)  # "file:line: why" for lines not used
    partial: list[str] = field(default_factory=list)  # "file:line: missing x" for lines used in part
    header: dict[str, Any] = field(default_factory=dict)


def _num(value: Any) -> float | None:
    # bool is an int in Python; a true/false where a number belongs is bad data, not 1/0.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _read_jsonl(path: Path, label: str, skipped: list[str]) -> list[tuple[int, dict[str, Any]]]:
    """Parse a JSONL file line by line; bad lines go to ``skipped`` as 'label:lineno: why'."""
    try:
        raw = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        skipped.append(f"{label}: unreadable ({e.strerror or e})")
        return []
    lines = raw.split("\n")
    ends_with_newline = raw.endswith("\n")
    if ends_with_newline:
        lines.pop()  # the empty string after the final newline
    out: list[tuple[int, dict[str, Any]]] = []
    for i, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            last = i == len(lines) and not ends_with_newline
            why = (
                "truncated last line (no newline; the writer probably died mid-write)"
                if last
                else f"not JSON ({e.msg} at column {e.colno})"
            )
            skipped.append(f"{label}:{i}: {why}")
            continue
        if not isinstance(obj, dict):
            skipped.append(f"{label}:{i}: not a JSON object ({type(obj).__name__})")
            continue
        out.append((i, obj))
    return out


def _rank_of(path: Path) -> int | None:
    m = re.fullmatch(r"rank(\d+)\.jsonl", path.name)
    return int(m.group(1)) if m else None


def load_run(run_dir: Path) -> RunData:
    data = RunData()
    mem_dir = run_dir / "memory"
    files = sorted((p for p in mem_dir.glob("rank*.jsonl") if _rank_of(p) is not None), key=_rank_of)
    for path in files:
        rank = _rank_of(path)
        assert rank is not None
        label = f"memory/{path.name}"
        rows: list[dict[str, Any]] = []
        for i, obj in _read_jsonl(path, label, data.skipped):
            missing = [k for k in MEMORY_REQUIRED if k not in obj]
            if missing or not isinstance(obj.get("phase"), str) or _num(obj.get("step")) is None:
                why = f"missing field {', '.join(missing)}" if missing else "phase/step of the wrong type"
                data.skipped.append(f"{label}:{i}: {why}")
                continue
            # The file name is the authority on the rank: a copied/renamed file still reports right.
            row: dict[str, Any] = {
                "phase": obj["phase"],
                "step": int(obj["step"]),
                "rank": rank,
                "ts": _num(obj.get("ts")),
            }
            absent = [k for k in (*NUMERIC_MEMORY, "device") if k not in obj]
            for k in NUMERIC_MEMORY:
                row[k] = _num(obj.get(k))
            row["device"] = obj.get("device")
            if absent:
                data.partial.append(f"{label}:{i}: missing {', '.join(absent)} (shown as -)")
            rows.append(row)
        data.memory[rank] = rows

    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.is_file():
        for i, obj in _read_jsonl(metrics_path, "metrics.jsonl", data.skipped):
            if _num(obj.get("step")) is None:
                data.skipped.append(f"metrics.jsonl:{i}: missing field step")
                continue
            if "eval_loss" in obj:
                data.evals.append({"step": int(obj["step"]), **{k: _num(obj.get(k)) for k in EVAL_KEYS}})
                continue
            if "gen_tokens_per_s" in obj:
                path = obj.get("gen_path")
                data.generations.append({"step": int(obj["step"]), **{k: _num(obj.get(k)) for k in GEN_KEYS},
                                         "gen_path": path if isinstance(path, str) else None})
                continue
            row = {"step": int(obj["step"]), **{k: _num(obj.get(k)) for k in METRIC_KEYS}}
            for k in (*PREF_KEYS, *RL_KEYS):  # preference and RL runs (train.objective): TRL's reward metrics
                if k in obj:
                    row[k] = _num(obj.get(k))
            if "moe_aux_loss" in obj:  # Mixture-of-Experts runs (raw path): the load-balancing loss, per-layer load
                row["moe_aux_loss"] = _num(obj.get("moe_aux_loss"))
                load = obj.get("expert_load")
                row["expert_load"] = [_num(x) for x in load] if isinstance(load, list) else None
            data.metrics.append(row)
        data.metrics.sort(key=lambda r: r["step"])
        data.evals.sort(key=lambda r: r["step"])
    data.header = read_header(run_dir, world_size_files=len(files), skipped=data.skipped)
    return data


def read_header(run_dir: Path, world_size_files: int, skipped: list[str]) -> dict[str, Any]:
    """Stage, offload, precision, world size and path from ds_config.json / config.yaml, when readable."""
    h: dict[str, Any] = {}
    ds_path = run_dir / "ds_config.json"
    batch: tuple[int, int, int] | None = None  # train_batch_size, micro, accumulation
    if ds_path.is_file():
        try:
            ds = json.loads(ds_path.read_text())
            zero = ds.get("zero_optimization") or {}
            h["zero stage"] = dc.zero_stage(ds)
            for key in ("offload_optimizer", "offload_param"):
                dev = (zero.get(key) or {}).get("device", "none")
                h[key.replace("_", " ")] = dev
            h["precision"] = dc.precision_of(ds) or "fp32"  # resolved: no "auto" left
            if h["precision"] == "fp32" and (ds.get("torch_autocast") or {}).get("enabled") is True:
                h["precision"] = f"torch autocast {ds['torch_autocast'].get('dtype', 'bfloat16')}"
            tbs, mbs = ds.get("train_batch_size"), ds.get("train_micro_batch_size_per_gpu")
            gas = ds.get("gradient_accumulation_steps", 1)
            if all(isinstance(v, int) and v > 0 for v in (tbs, mbs, gas)):
                batch = (tbs, mbs, gas)
                h["train batch size"] = f"{tbs} (micro {mbs} x accum {gas} x dp {tbs // (mbs * gas)})"
        except (OSError, ValueError, AttributeError) as e:
            skipped.append(f"ds_config.json: unreadable ({e})")
    cfg_path = run_dir / "config.yaml"
    if cfg_path.is_file():
        try:
            import yaml

            cfg = yaml.safe_load(cfg_path.read_text()) or {}
            train, model = cfg.get("train") or {}, cfg.get("model") or {}
            h["path"] = train.get("path")
            h["model"] = model.get("name")
            sp = int(train.get("sequence_parallel") or 1)
            if sp > 1 and train.get("path") == "trainer" and batch is not None:
                # the Trainer path's engine counts ranks (sequence/ulysses.py); a group's ranks share each sequence
                tbs, mbs, gas = batch
                h["train batch size"] = (f"{tbs // sp} sequences (micro {mbs} x accum {gas} x dp {tbs // (mbs * gas)} "
                                         f"ranks / sequence_parallel {sp})")
            # ds_config.json holds what ran; the training config's precision is only the fallback.
            h.setdefault("precision", train.get("precision"))
        except Exception as e:
            skipped.append(f"config.yaml: unreadable ({e})")
    if world_size_files:
        h["world size (rank files)"] = world_size_files
    return {k: v for k, v in h.items() if v is not None}


def has_gpu_data(data: RunData) -> bool:
    return any(r.get(k) is not None for rows in data.memory.values() for r in rows for k in GPU_KEYS)


def run_dir_problem(path: Path) -> str | None:
    """Why ``path`` is not a run directory, in one line; None when it is one."""
    if not path.exists():
        return f"{path} does not exist (give the train.run_dir of a toolkit/train.py run)"
    if not path.is_dir():
        return f"{path} is not a directory (give the train.run_dir of a toolkit/train.py run)"
    if not any(any(path.glob(pattern)) for pattern in RUN_FILES):
        return (
            f"{path} is not a run directory: it has no config.yaml, metrics.jsonl or memory/rank*.jsonl "
            "(toolkit/train.py writes them into train.run_dir)"
        )
    return None


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = obj


def settings(run_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """Every setting of a run, flattened: ``train.micro_batch_size`` (config.yaml),
    ``ds_config: zero_optimization.stage`` and ``versions: torch``; plus the files it could not read."""
    out: dict[str, Any] = {}
    problems: list[str] = []
    sources = (("config.yaml", ""), ("ds_config.json", "ds_config: "), ("versions.json", "versions: "))
    for name, label in sources:
        path = run_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        try:
            if name.endswith(".yaml"):
                import yaml

                data = yaml.safe_load(path.read_text()) or {}
            else:
                data = json.loads(path.read_text())
        except Exception as e:
            problems.append(f"{name}: unreadable ({type(e).__name__})")
            continue
        flat: dict[str, Any] = {}
        _flatten(data, "", flat)
        out.update({f"{label}{k}": v for k, v in flat.items()})
    return out, problems
