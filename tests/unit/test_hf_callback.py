"""ToolkitCallback's own decisions, one process, no Trainer: the NaN/Inf stop, the run-directory claim,
tokens/s only where the Trainer counts tokens. tests/dist/test_library.py runs it inside a real Trainer
on 2 ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from toolkit import NonFiniteError, ToolkitCallback
from toolkit.config.ds_config import ConfigError


def args(**kw: Any) -> SimpleNamespace:
    base = dict(process_index=0, world_size=1, local_process_index=0, per_device_train_batch_size=2,
                gradient_accumulation_steps=3, learning_rate=1e-3, warmup_steps=0, seed=0, output_dir="out",
                bf16=False, fp16=False, logging_nan_inf_filter=True, logging_steps=1, device=torch.device("cpu"))
    return SimpleNamespace(**(base | kw))


def state(step: int = 0, tokens: int = 0) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, max_steps=5, num_input_tokens_seen=tokens)


def model() -> torch.nn.Module:
    m = torch.nn.Linear(2, 2)
    m.config = SimpleNamespace(_name_or_path="tiny-test", num_hidden_layers=1, hidden_size=2)  # type: ignore[assignment]
    return m


def started(run_dir: Path, a: SimpleNamespace | None = None, **kw: Any) -> ToolkitCallback:
    cb = ToolkitCallback(run_dir, memory_every=1, **kw)
    cb.on_train_begin(a or args(), state(), None, model=model())
    return cb


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_nan_loss_stops_and_is_recorded(tmp_path: Path) -> None:
    a = args()
    cb = started(tmp_path / "run", a)
    assert a.logging_nan_inf_filter is False  # else the Trainer averages a NaN away before the log
    cb.on_log(a, state(1), None, logs={"loss": 2.0, "grad_norm": 1.0, "learning_rate": 1e-3})
    with pytest.raises(NonFiniteError, match="at step 2"):
        cb.on_log(a, state(2), None, logs={"loss": float("nan"), "grad_norm": 1.0, "learning_rate": 1e-3})
    rows = lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and math.isnan(rows[1]["loss"])
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "failed"


def test_infinite_grad_norm_stops_except_under_fp16(tmp_path: Path) -> None:
    cb = started(tmp_path / "a")
    with pytest.raises(NonFiniteError):
        cb.on_log(args(), state(1), None, logs={"loss": 2.0, "grad_norm": float("inf")})
    fp16 = args(fp16=True)
    cb = started(tmp_path / "b", fp16)
    cb.on_log(fp16, state(1), None, logs={"loss": 2.0, "grad_norm": float("inf")})  # DeepSpeed skips the step


def test_a_directory_holding_a_run_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cb = started(run)
    cb.on_train_end(args(), state(5), None)
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already holds a run"):
        started(run)
    # a resumed Trainer continues its own records
    ToolkitCallback(run).on_train_begin(args(), state(step=3), None, model=model())
    started(run, overwrite=True)
    assert not (run / "metrics.jsonl").exists() and (run / "notes.txt").read_text() == "mine"
    assert lines(run / "memory" / "rank0.jsonl")[0]["phase"] == "engine_ready"


def test_tokens_per_s_only_where_the_trainer_counts_tokens(tmp_path: Path) -> None:
    a = args()
    cb = started(tmp_path / "run", a)
    cb.on_log(a, state(1), None, logs={"loss": 2.0, "learning_rate": 1e-3})
    cb.on_log(a, state(2, tokens=600), None, logs={"loss": 1.9, "learning_rate": 1e-3})
    first, second = lines(tmp_path / "run" / "metrics.jsonl")
    assert first["tokens_per_s"] is None and second["tokens_per_s"] > 0
    assert first["samples_per_s"] > 0 and second["mfu"] is None  # CPU: no peak to divide by
    assert first["grad_norm"] is None and second["lr"] == 1e-3


def test_run_files_say_what_the_trainer_was_told(tmp_path: Path) -> None:
    started(tmp_path / "run", args(bf16=True))
    import yaml

    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert cfg["train"]["path"] == "hf-trainer" and cfg["train"]["precision"] == "bf16"
    assert cfg["model"]["name"] == "tiny-test" and cfg["train"]["grad_accum"] == 3
    assert json.loads((tmp_path / "run" / "versions.json").read_text())["world_size"] == 1
