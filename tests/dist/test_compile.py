"""train.compile=torch on both paths: the decoder layers are really compiled in place, and a compiled run
trains, saves, resumes (with the fixed-batch check), generates and exports what an eager run does; at ZeRO-3 the
compiled layers are leaf modules and train as eager ones.

Every run of this file shares one launch (tests/dist/_multi_train.py; torch._dynamo is reset between runs, as a new
process would have it); each test reads back its runs' directories and their part of the launch's output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import Runs, launch, run_logs

from tests.dist._jsonl import lines

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
PATHS = ["raw", "trainer"]
# ZeRO-3: name -> (path, train.compile)
ZERO3 = {"eager": ("raw", "off"), "raw": ("raw", "torch"), "trainer-ckpt": ("trainer", "torch"),
         "eager-leaves-ckpt": ("raw", "off")}


def _runs(tmp: Path) -> list[dict]:
    runs = []

    def add(name: str, run_dir: Path, ds: str, path: str, compile_: str, *extra: str) -> None:
        argv = ["--ds", str(ROOT / "ds_configs" / f"{ds}.json"), f"train.path={path}", f"train.compile={compile_}",
                "memory.every=0", "metrics.tensorboard=false", f"train.run_dir={run_dir}", *extra]
        runs.append({"name": name, "argv": argv})

    for path in PATHS:
        common = ["train.micro_batch_size=2", f"train.max_steps={STEPS}", "train.save_every=2", "eval.generate=true"]
        add(f"{path}-eager", tmp / path / "eager", "zero2", path, "off", *common)
        # compiled: stop with a checkpoint after 2 steps, then resume it (compiled) to the end
        add(f"{path}-compiled-stop", tmp / path / "compiled", "zero2", path, "torch", *common, "train.stop_after=2")
        add(f"{path}-compiled-resume", tmp / path / "compiled", "zero2", path, "torch", *common,
            "train.resume=latest")
    for name, (path, mode) in ZERO3.items():
        extra = ["model.gradient_checkpointing=true"] if name.endswith("-ckpt") else []
        if name == "eager":  # the reference: DeepSpeed's hook on every submodule
            extra.append("train.zero3_leaves=false")
        if name == "eager-leaves-ckpt":  # leaves without compile, recomputed, MLPs in 2 tiles (TiledMLP's backward)
            extra += ["train.zero3_leaves=true", "model.tiled_mlp=true"]
        add(f"zero3-{name}", tmp / "zero3" / name, "zero3", path, mode, "train.micro_batch_size=1",
            "train.grad_accum=2", "train.max_steps=3", "train.export=false",
            "data.seq_len=128",  # two hidden sizes: tiled MLPs (where asked) run 2 tiles
            *extra)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    tmp = Runs(tmp_path_factory.mktemp("compile"))
    launch(tmp, _runs(tmp), name="compile", timeout=1400)
    return tmp, run_logs(tmp / "compile.log")


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "export" / "model.safetensors"))


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("path", PATHS)
def test_compiled_run_trains_saves_resumes_generates_and_exports_as_eager(
        runs: tuple[Path, dict[str, str]], path: str) -> None:
    tmp, logs = runs
    eager, compiled = tmp / path / "eager", tmp / path / "compiled"
    log = logs[f"{path}-eager"]
    assert "compiled in place" not in log and "torch.compile: off (train.compile=off)" in log, log[-3000:]
    log = logs[f"{path}-compiled-stop"]
    assert "torch.compile: 2 x LlamaDecoderLayer compiled in place" in log, log[-3000:]
    (resumed,) = lines(compiled / "resumes.jsonl")
    # the compiled forward after the load gives the loss recorded by the compiled forward at the save
    assert resumed["not_verified"] is None and resumed["step"] == 2, resumed
    assert resumed["fixed_batch_loss_loaded"] == pytest.approx(resumed["fixed_batch_loss_saved"], abs=1e-5)

    by_step = {r["step"]: r["loss"] for r in lines(compiled / "metrics.jsonl") if "loss" in r}  # not generation's
    want = {r["step"]: r["loss"] for r in lines(eager / "metrics.jsonl") if "loss" in r}
    assert sorted(by_step) == sorted(want) == list(range(1, STEPS + 1))
    # fp32 on CPU: inductor reorders some reductions, nothing more
    assert [by_step[s] for s in sorted(by_step)] == pytest.approx([want[s] for s in sorted(want)], abs=1e-5)

    # generation runs through the compiled module (greedy): the same tokens as eager
    assert lines(compiled / "generations.jsonl") == lines(eager / "generations.jsonl"), logs[f"{path}-compiled-resume"][-3000:]
    # the export holds the model's own names (no `_orig_mod.` prefix) and the same weights
    a, b = _weights(eager), _weights(compiled)
    assert sorted(a) == sorted(b)
    for name, t in a.items():
        assert (b[name] - t).abs().max().item() < 1e-4, name


@pytest.mark.timeout(900)
def test_compiled_layers_train_as_eager_at_zero3(runs: tuple[Path, dict[str, str]]) -> None:
    """ZeRO-3 partitions the weights the compiled layers read; the compiled decoder layers are ZeRO-3 leaf modules
    (one gather, one graph and one reduce per layer). 2 ranks, fp32 on CPU: the same losses and gradient norms as
    eager with DeepSpeed's hooks on every submodule, on the raw path and on the Trainer with gradient
    checkpointing and accumulation (the leaf's backward hook must reduce each layer once per micro-batch); eager
    layers as leaves (train.zero3_leaves=true) with checkpointing the same."""
    tmp, logs = runs
    got = {}
    for name, (_, mode) in ZERO3.items():
        log = logs[f"zero3-{name}"]
        if mode == "torch":
            assert "2 x LlamaDecoderLayer compiled in place" in log and "each a ZeRO-3 leaf module" in log, log[-3000:]
        if name == "eager-leaves-ckpt":
            assert "ZeRO-3 leaf modules: 2 x LlamaDecoderLayer, eager (train.zero3_leaves=true)" in log, log[-3000:]
        got[name] = [(r["loss"], r["grad_norm"]) for r in lines(tmp / "zero3" / name / "metrics.jsonl")]
    want = [x for pair in got["eager"] for x in pair]
    assert len(got["eager"]) == 3 and all(g > 0 for _, g in got["eager"])
    for name in ("raw", "trainer-ckpt", "eager-leaves-ckpt"):
        assert [x for pair in got[name] for x in pair] == pytest.approx(want, rel=1e-5), (name, got)
