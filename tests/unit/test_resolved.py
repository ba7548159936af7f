"""The resolved record (toolkit/runtime/resolved.py): the committed benchmark rows' configurations resolve as the code
before the record did (tests/fixtures/resolved_before.json, made by bench/resolved_before.py from commit f6c834c),
`toolkit check --explain` prints it, and a resumed run's differences are named."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from toolkit.config.ds_config import load_ds_config
from toolkit.config.schema import load_config
from toolkit.plan.planner import CUDA_CONTEXT_GIB
from toolkit.runtime.model import model_config
from toolkit.runtime.resolved import Machine, changes, saved_changes
from toolkit.runtime.spec import RunInputs, build_spec

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = json.loads((ROOT / "tests/fixtures/resolved_before.json").read_text())


def _bench_module() -> Any:
    """bench/resolved_before.py, which made the fixture: its data-file stubs serve the test too (it imports no
    toolkit at module level; its old tree is loaded only by its main)."""
    spec = importlib.util.spec_from_file_location("resolved_before", ROOT / "bench" / "resolved_before.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


BENCH = _bench_module()
GIB = 2**30
# liger-kernel's model types as bench/resolved_before.py answered them (liger-kernel is not installed on CPU machines)
LIGER = ("gemma", "gemma2", "gemma3", "gemma3_text", "glm4", "granite", "llama", "llama4", "llama4_text", "mistral",
         "mixtral", "mllama", "olmo2", "olmo3", "phi3", "qwen2", "qwen2_5_vl", "qwen2_vl", "qwen3", "qwen3_moe",
         "qwen3_next", "qwen3_vl", "qwen3_vl_moe", "smollm3")


def _machine(w: dict[str, Any]) -> Machine:
    """The row's GPU as the run reads it: a card, or under memory.gpu_limit_gib the cap plus the CUDA context."""
    capped = any(o.startswith("memory.gpu_limit_gib=") for o in w["overrides"])
    gpu = int(w["gpu_gib"] * GIB) + int(CUDA_CONTEXT_GIB * GIB) if capped else int(w["gpu_gib"] * GIB)
    return Machine(cuda=True, varlen=True, liger_types=LIGER, gpu_bytes=gpu, host_bytes=w["host_gib"] * GIB,
                   ranks_per_node=w["world_size"], bf16=True, capability=(9, 0), gpu_name="NVIDIA H100 80GB HBM3")


def _stub_paths(overrides: list[str], tmp: Path) -> list[str]:
    """model.tokenizer=DIR -> the suite's own small tokenizer, made here, and data.cache_dir=DIR -> a folder in tmp: the
    rows named a developer's /tmp (bench/data_cache.py's work folder), and the decisions read only that a tokenizer
    is given and holds the model's ids."""
    from conftest import write_tokenizer

    out = []
    for o in overrides:
        if o.startswith("model.tokenizer="):
            o = f"model.tokenizer={write_tokenizer(tmp / 'tokenizer')}"
        elif o.startswith("data.cache_dir="):
            o = f"data.cache_dir={tmp / 'cache'}"
        out.append(o)
    return out


def _record(w: dict[str, Any], tmp: Path) -> Any:
    cfg = load_config(None, _stub_paths(BENCH._stub_data(w["overrides"], tmp), tmp))
    if isinstance(w["ds"], dict):
        path = tmp / f"{w['name']}.ds.json"
        path.write_text(json.dumps(w["ds"]))
        cfg.train.ds_config = str(path)
    else:
        cfg.train.ds_config = str(ROOT / w["ds"])
    inputs = RunInputs(cfg, load_ds_config(cfg.train.ds_config), model_config(cfg), w["world_size"])
    return build_spec(inputs, _machine(w)).resolved


@pytest.mark.parametrize("w", FIXTURE["workloads"], ids=[w["name"] for w in FIXTURE["workloads"]])
def test_the_benchmark_rows_resolve_as_before_the_record(w: dict[str, Any], tmp_path: Path) -> None:
    r = _record(w, tmp_path)
    before = w["decided"]
    now = {"stage": r.stage, "precision": r.precision, "fp8": r.fp8, "adapter_autocast": r.adapter_autocast,
           "packing": r.packing,
           "attention": {"implementation": r.attention.implementation, "boundaries": r.attention.boundaries,
                         "whole_rows": r.attention.whole_rows, "note": r.attention.note},
           "compile": r.compile, "compile_why": r.compile_why, "tiled_mlp": r.tiled_mlp, "tiled_loss": r.tiled_loss,
           "tiled_loss_tile": r.tiled_loss_tile if r.tiled_loss else None, "liger_kwargs": r.liger.kwargs,
           "liger_reason": r.liger.reason, "experts_path": r.experts.describe() if r.experts else None,
           "activation_offload": {"on": r.activation_offload.on,
                                  "pinned": r.activation_offload.pinned if r.activation_offload.on else None}}
    assert {k: now[k] for k in before} == before


def test_a_resumed_runs_changed_settings_are_named(tmp_path: Path) -> None:
    w = next(w for w in FIXTURE["workloads"] if w["name"] == "llama1b-s2048-z2-synthetic")
    r = _record(w, tmp_path)
    saved = json.loads(json.dumps(r.to_dict()))
    assert changes(saved, json.loads(json.dumps(r.to_dict()))) == []
    saved["compile"] = True
    saved["liger"]["kwargs"]["swiglu"] = False
    (tmp_path / "resolved.json").write_text(json.dumps(saved))
    assert saved_changes(tmp_path, r) == ["compile: True -> False", "liger.kwargs.swiglu: False -> True"]
    assert saved_changes(tmp_path / "none", r) == []  # no saved record: nothing to compare


def test_toolkit_check_explain_prints_the_block_a_run_starts_with() -> None:
    out = subprocess.run([sys.executable, "-m", "toolkit", "check", "ds_configs/zero3.json", "--explain",
                          "--world-size", "2", "model.name=tiny", "lora.enabled=true"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "resolved settings" in out.stdout and "  ZeRO-3, 2 ranks, fp32" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "toolkit", "check", "ds_configs/zero3.json", "--explain",
                          "model.experts=grouped_mm"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert bad.returncode == 1 and "model.experts=grouped_mm applies to Mixture-of-Experts models" in bad.stdout


def test_the_probes_of_an_auto_micro_batch_compile_as_the_run_will() -> None:
    """speed/autotune.py runs its probes with the record's compile rule, tiled MLPs included (auto compile: off)."""
    from toolkit.runtime.resolved import compile_choice

    ds = load_ds_config(str(ROOT / "ds_configs/zero2.json"))
    long = load_config(None, ["model.name=llama-3.2-1b", "data.seq_len=131072"])
    assert compile_choice(long, ds, True, None) == (False, "train.compile=auto with tiled MLPs: their compiled speed "
                                                           "is not measured yet; train.compile=torch compiles")
    assert compile_choice(load_config(None, ["model.name=llama-3.2-1b"]), ds, True, None)[0] is True
    assert compile_choice(load_config(None, ["model.name=llama-3.2-1b", "data.seq_len=131072", "train.compile=torch"]),
                          ds, True, None)[0] is True
