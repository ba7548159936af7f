"""MetricsLogger in one process: metrics.jsonl, MFU, TensorBoard events read back with TensorBoard's own
reader, and the closing summary."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from toolkit.observe.metrics import (
    MetricsLogger,
    TokenCounter,
    closing_summary,
    count_params,
    flops_per_token,
    median_after_first,
    peak_flops_per_gpu,
)
from toolkit.observe.tb import TRAIN_TAGS


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _log_steps(logger: MetricsLogger, steps: range) -> list[dict]:
    recs = []
    for step in steps:
        logger.counter.add({"input_ids": torch.zeros(2, 8, dtype=torch.long)})  # 16 tokens
        recs.append(logger.log(step, loss=7.0 - step, lr=1e-3 * step, grad_norm=None if step == 1 else 0.5))
    return recs


def test_jsonl_mfu_and_tensorboard_agree(tmp_path: Path) -> None:
    logger = MetricsLogger(
        tmp_path, total_steps=4, counter=TokenCounter(), is_main=True, flops_per_token=1e9, peak_flops=1e12
    )
    logger.start(0)
    recs = _log_steps(logger, range(1, 5))
    logger.close()
    logger.close()  # idempotent: the loop closes again on its way out
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == recs
    for r in lines:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * 1e9 / 1e12)
    tb = _scalars(tmp_path / "tb")
    assert set(tb) == set(TRAIN_TAGS.values())
    assert tb["train/loss"] == [(s, 7.0 - s) for s in range(1, 5)]
    assert [s for s, _ in tb["train/grad_norm"]] == [2, 3, 4]  # null grad norm: no point, not NaN
    for key, tag in TRAIN_TAGS.items():
        if key != "grad_norm":
            assert [v for _, v in tb[tag]] == pytest.approx([r[key] for r in lines], rel=1e-6), tag
    assert logger.history == lines


def test_tensorboard_off_and_no_mfu_without_peak(tmp_path: Path) -> None:
    logger = MetricsLogger(
        tmp_path, total_steps=2, counter=TokenCounter(), is_main=True, flops_per_token=1e9, tensorboard=False
    )
    logger.start(0)
    recs = _log_steps(logger, range(1, 3))
    logger.close()
    assert all(r["mfu"] is None for r in recs)
    assert not (tmp_path / "tb").exists()


def test_resume_purges_later_steps_of_an_earlier_attempt(tmp_path: Path) -> None:
    first = MetricsLogger(tmp_path, total_steps=6, counter=TokenCounter(), is_main=True)
    first.start(0)
    _log_steps(first, range(1, 6))  # crashed after step 5; the last checkpoint was at step 3
    first.close()
    second = MetricsLogger(tmp_path, total_steps=6, counter=TokenCounter(), is_main=True)
    second.start(3)
    _log_steps(second, range(4, 7))
    second.close()
    assert [s for s, _ in _scalars(tmp_path / "tb")["train/loss"]] == [1, 2, 3, 4, 5, 6]


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, total_steps=2, counter=TokenCounter(), is_main=False)
    logger.start(0)
    _log_steps(logger, range(1, 3))
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_peak_flops_table() -> None:
    assert peak_flops_per_gpu("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert peak_flops_per_gpu("NVIDIA H100 PCIe", "fp16") == pytest.approx(756e12)
    assert peak_flops_per_gpu("NVIDIA H200", "bf16") == pytest.approx(989.4e12)
    assert peak_flops_per_gpu("NVIDIA A100-SXM4-80GB", "bf16") == pytest.approx(312e12)
    assert peak_flops_per_gpu("NVIDIA H200", "fp32") is None  # TF32 or not depends on torch settings
    assert peak_flops_per_gpu("Some Future GPU", "bf16") is None
    assert peak_flops_per_gpu(None, "bf16") is None  # CPU
    assert peak_flops_per_gpu("Some Future GPU", "fp32", override_tflops=100) == pytest.approx(100e12)


def test_flops_per_token_and_param_count() -> None:
    # no frozen weights: the usual 6N + 12·L·H·T (bench/speed.py)
    assert flops_per_token(1000, 1000, 2, 64, 128) == 6 * 1000 + 12 * 2 * 64 * 128
    # LoRA: frozen weights get no weight gradient
    assert flops_per_token(1000, 10, 0, 64, 128) == 4 * 1000 + 2 * 10
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2, bias=False))
    model[1].weight.requires_grad_(False)
    assert count_params(model) == (28, 20)
    # ZeRO-3: a rank holds an empty shard; ds_numel is the full size
    shard = SimpleNamespace(
        parameters=lambda: [SimpleNamespace(numel=lambda: 0, ds_numel=500, requires_grad=True)]
    )
    assert count_params(shard) == (500, 500)


def test_median_after_first() -> None:
    assert median_after_first([1.0, 10.0, 20.0, 30.0]) == 20.0
    assert median_after_first([5.0]) == 5.0
    assert median_after_first([None, 2.0, None, 4.0]) == 4.0  # the first *recorded* value is dropped
    assert median_after_first([None]) is None


def _history(n: int) -> list[dict]:
    return [
        {"step": s, "loss": 7.0 - 0.1 * s, "tokens_per_s": 100.0 * s, "mfu": None, "elapsed_s": 1.5 * s}
        for s in range(1, n + 1)
    ]


def test_closing_summary_cpu_and_gpu() -> None:
    run = Path("runs/default")
    cpu = closing_summary(
        _history(20),
        run,
        20,
        20,
        {
            0: {"peak_allocated_gib": None, "host_rss_gib": 0.58},
            1: {"peak_allocated_gib": None, "host_rss_gib": 0.57},
        },
        True,
    )
    assert cpu.splitlines() == [
        "done: 20 of 20 steps in 30.0 s",
        "  loss        6.9000 (step 1) -> 5.0000 (step 20)",
        "  tokens/s    1,100 (all ranks, median after step 1)",
        "  peak host   rank 0 0.58, rank 1 0.57 GiB RSS (CPU run: no GPU memory)",
        "  run dir     runs/default",
        "  next        toolkit report runs/default   |   tensorboard --logdir runs/default/tb",
    ]
    hist = [r | {"mfu": 0.4} for r in _history(3)]
    gpu = closing_summary(hist, run, 3, 6, {0: {"peak_allocated_gib": 49.35, "host_rss_gib": 5.9}}, False)
    assert gpu.splitlines()[0] == (
        "stopped after step 3 of 6 (train.stop_after); continue with train.resume=latest"
    )
    assert "MFU 40.0%" in gpu and "peak GPU    rank 0 49.35 GiB allocated" in gpu
    assert gpu.splitlines()[-1] == "  next        toolkit report runs/default"
