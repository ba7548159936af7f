"""Who reads a DeepSpeed JSON decides which "auto" values get filled (ds_config.FILLS): gen-config writes
"auto" only where every consumer it targets fills it, and `toolkit check --consumer` refuses the rest
with the key, the consumer and the value to write. What HF's own code does is held against the same
table in tests/dist/test_hf_consumers.py; these are the pure-dict contracts."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.config import ds_config as dc
from toolkit.config.checks import check_config, check_file

REPO = Path(__file__).resolve().parents[2]
OLD = REPO / "tests" / "fixtures" / "ds" / "presets_before_issue24"


def auto_errors(findings: list) -> dict[str, str]:
    return {f.key: f.message for f in findings if f.level == "error" and f.message.startswith('"auto" is not')}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)


@pytest.mark.parametrize("name", sorted(dc.PRESETS))
def test_presets_say_auto_only_where_every_default_target_fills_it(name: str) -> None:
    cfg = dc.preset(name)
    assert {c: dc.unfilled(cfg, c) for c in dc.DEFAULT_TARGETS} == {c: [] for c in dc.DEFAULT_TARGETS}
    # the training config still owns batch, precision and optimizer values: those stay "auto"
    auto = {k for k, v in dc.iter_leaves(cfg) if v == dc.AUTO}
    assert {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer.params.lr",
            "optimizer.params.betas", "bf16.enabled"} <= auto


def test_sizes_a_trainer_cannot_fill_are_deepspeed_defaults() -> None:
    z2, z3 = dc.preset("zero2")["zero_optimization"], dc.preset("zero3")["zero_optimization"]
    assert z2["allgather_bucket_size"] == dc.SPEED_SIZES["zero_optimization.allgather_bucket_size"]
    assert z3["stage3_max_live_parameters"] == z3["stage3_max_reuse_distance"] == 1_000_000_000
    assert z3["reduce_bucket_size"] == z3["stage3_prefetch_bucket_size"] == dc.AUTO  # the Trainer fills these


def test_memory_sizes_still_apply_to_the_presets_numbers() -> None:
    # train.zero_sizes=memory asks for lean sizes; a JSON that only writes DeepSpeed's default out states
    # no choice of its own, while any other number is the JSON's to keep.
    values = dc.AutoValues(micro_batch=1, grad_accum=1, world_size=2, precision="fp32", grad_clip=1.0, lr=1e-3,
                           hidden_size=64, zero_sizes="memory")
    lean = dc.resolve(dc.preset("zero3"), values)["zero_optimization"]
    assert lean["stage3_max_live_parameters"] == lean["stage3_max_reuse_distance"] == 24 * 64 * 64
    assert dc.resolve(dc.preset("zero2"), values)["zero_optimization"]["allgather_bucket_size"] == 64 * 64
    pinned = dc.preset("zero3")
    pinned["zero_optimization"]["stage3_max_live_parameters"] = 2_000_000_000
    assert dc.resolve(pinned, values)["zero_optimization"]["stage3_max_live_parameters"] == 2_000_000_000
    fast = dc.resolve(dc.preset("zero3"), dataclasses.replace(values, zero_sizes="speed"))["zero_optimization"]
    assert fast["stage3_max_live_parameters"] == 1_000_000_000


def test_accelerate_target_writes_betas_and_eps() -> None:
    cfg = dc.gen_config(3, "cpu", "cpu", targets=["accelerate"])
    assert dc.unfilled(cfg, "accelerate") == []
    assert cfg["optimizer"]["params"]["betas"] == [0.9, 0.999] and cfg["optimizer"]["params"]["eps"] == 1e-8
    assert cfg["optimizer"]["params"]["lr"] == dc.AUTO  # DummyOptim carries the lr
    assert auto_errors(check_config(cfg, world_size=2, consumer="accelerate")) == {}


def test_bare_deepspeed_target_needs_the_run_dependent_values() -> None:
    with pytest.raises(dc.ConfigError) as e:
        dc.gen_config(2, targets=["deepspeed"])
    assert all(flag in str(e.value) for flag in ("--micro-batch", "--precision", "--lr"))
    cfg = dc.gen_config(3, "cpu", "cpu", precision="bf16", micro_batch=2, lr=1e-4, targets=["deepspeed"])
    assert [k for k, v in dc.iter_leaves(cfg) if v == dc.AUTO] == []
    assert "train_batch_size" not in cfg  # DeepSpeed derives it from micro x accumulation x world size
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["optimizer"]["params"]["lr"] == 1e-4
    assert check_config(cfg, world_size=2, consumer="deepspeed") == []


def test_old_presets_are_refused_for_a_plain_trainer_with_the_value_to_write() -> None:
    found = auto_errors(check_file(OLD / "zero3.json", world_size=2, consumer="hf-trainer"))
    assert set(found) == {"zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance"}
    msg = found["zero_optimization.stage3_max_live_parameters"]
    assert "plain HF Trainer script" in msg and msg.endswith("write 1000000000")
    assert set(auto_errors(check_file(OLD / "zero2.json", consumer="hf-trainer"))) == {
        "zero_optimization.allgather_bucket_size"}
    # the toolkit's own paths fill them: the old presets still run there
    for consumer in ("trainer", "raw"):
        assert auto_errors(check_file(OLD / "zero3.json", world_size=2, consumer=consumer)) == {}


def test_bare_deepspeed_refuses_every_auto() -> None:
    cfg = dc.preset("zero2")
    found = auto_errors(check_config(cfg, world_size=2, consumer="deepspeed"))
    assert set(found) == {k for k, v in dc.iter_leaves(cfg) if v == dc.AUTO}
    assert "bare deepspeed.initialize" in found["train_batch_size"]


def test_value_hint_falls_back_to_deepspeeds_default() -> None:
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_size": "auto"}}}
    msg = auto_errors(check_config(cfg, consumer="hf-trainer"))["zero_optimization.offload_param.buffer_size"]
    assert "write 100000000 (DeepSpeed's default)" in msg


def test_plugin_defaults_are_filled_not_refused() -> None:
    # accelerate's DeepSpeedPlugin fills stage "auto" with its default 2: the Trainer runs it
    cfg = dc.preset("zero2") | {"zero_optimization": {**dc.preset("zero2")["zero_optimization"], "stage": "auto"}}
    assert [f for f in check_config(cfg, world_size=2, consumer="hf-trainer") if f.level == "error"] == []
    assert "zero_optimization.stage" in auto_errors(check_config(cfg, world_size=2, consumer="trainer"))


def test_unknown_consumer_is_an_error() -> None:
    with pytest.raises(dc.ConfigError, match="known: trainer, raw, hf-trainer"):
        check_config(dc.preset("zero1"), consumer="lightning")
    with pytest.raises(dc.ConfigError, match="unknown consumer"):
        dc.gen_config(1, targets=["lightning"])


def test_cli_consumer_and_the_old_path_flag() -> None:
    old = str(OLD / "zero3.json")
    p = cli("check", old, "--world-size", "2", "--consumer", "hf-trainer")
    assert p.returncode == 1 and p.stdout.count("error: ") == 2 and "will not run: 2 errors" in p.stderr
    assert cli("check", old, "--world-size", "2", "--path", "raw").returncode == 0  # launch.sh's spelling
    assert cli("check", old, "--path", "bogus").returncode == 2


def test_cli_gen_config_consumer(tmp_path: Path) -> None:
    p = cli("gen-config", "--stage", "3", "--consumer", "accelerate")
    assert p.returncode == 0 and json.loads(p.stdout) == dc.gen_config(3, targets=["accelerate"])
    p = cli("gen-config", "--stage", "3", "--consumer", "deepspeed")
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1 and "--micro-batch" in p.stderr
    p = cli("gen-config", "--stage", "2", "--consumer", "deepspeed", "--consumer", "hf-trainer", "--precision",
            "fp32", "--micro-batch", "4", "--lr", "3e-4")
    cfg = json.loads(p.stdout)
    assert p.returncode == 0 and cfg["optimizer"]["params"]["lr"] == 3e-4 and "bf16" not in cfg
    assert [k for k, v in dc.iter_leaves(cfg) if v == dc.AUTO] == []
    out = tmp_path / "acc"
    assert cli("gen-config", "--all", "--consumer", "accelerate", "-o", str(out)).returncode == 0
    for f in out.iterdir():
        assert dc.unfilled(dc.load_ds_config(f), "accelerate") == [], f.name
