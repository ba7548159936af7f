"""bench/speed.py's launch lines and tuned presets, without running anything (the runs themselves are
tests/dist/test_bench_speed.py, on 2 CPU ranks)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def speed():
    sys.path.insert(0, str(ROOT / "bench"))  # speed.py imports its neighbour _proc
    try:
        spec = importlib.util.spec_from_file_location("bench_speed", ROOT / "bench" / "speed.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_include_names_the_gpus_in_place_of_a_count(speed, tmp_path: Path) -> None:
    # DeepSpeed's launcher drops CUDA_VISIBLE_DEVICES when --num_gpus is given: lanes must use --include
    cmd, _ = speed._command("raw", "tiny-seq64", 2, "none", 2, 29500, tmp_path / "r.json", 1, 2, None, [],
                            include="localhost:2,3")
    assert cmd[:5] == ["deepspeed", "--include", "localhost:2,3", "--master_port", "29500"]
    assert "--num_gpus" not in cmd and "train.grad_accum=4" in cmd  # 32 = 4 per micro x 4 x 2 GPUs
    cmd, _ = speed._command("bare", "tiny-seq64", 2, "none", 1, 29500, tmp_path / "b.json", 1, 2, None, [])
    assert cmd[:3] == ["deepspeed", "--num_gpus", "1"]


def test_a_run_needs_gpus_or_include(speed, tmp_path: Path, capsys) -> None:
    args = argparse.Namespace(tune="", out=str(tmp_path), variants="raw", include="", gpus=0)
    assert speed.run(args) == 2
    assert "--gpus N or --include" in capsys.readouterr().err


def test_deepcompile_writes_its_own_section_and_leaves_zero_alone(speed, tmp_path: Path) -> None:
    over, sections, micro = speed.TUNES["deepcompile"]
    assert "train.compile=torch" in over and micro is None  # DeepCompile acts on engine.compile() only
    ds = json.loads(Path(speed._tuned_preset(3, "none", sections, tmp_path / "dc.json")).read_text())
    shipped = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    assert ds["compile"] == {"deepcompile": True}
    assert ds["zero_optimization"] == shipped["zero_optimization"]
    sized = json.loads(Path(speed._tuned_preset(3, "none", speed.TUNES["all"][1], tmp_path / "all.json")).read_text())
    assert sized["zero_optimization"]["stage3_module_granularity_threshold"] == 6_000_000
    assert sized["zero_optimization"]["stage3_prefetch_bucket_size"] == 120_000_000
    assert sized["zero_optimization"]["stage"] == 3  # merged over the preset, not in place of it


def test_table_pools_the_repeats_of_a_variant_and_keeps_each_runs_median(speed, tmp_path: Path) -> None:
    run = tmp_path / "s99"
    run.mkdir()
    base = {"workload": "tiny-seq64", "stage": 3, "offload": "none", "gpus": 1, "micro_batch": 4, "grad_accum": 8,
            "rc": 0, "host_rss_gib": 1.0}
    files = []
    for name, variant, times, peak in (("raw-rep1", "raw", [1.0, 1.0, 3.0], 2.0), ("trainer-rep1", "trainer", [2.0], 1.0),
                                       ("raw-rep2", "raw", [2.0, 2.0], 5.0)):
        f = run / f"{name}.json"
        f.write_text(json.dumps(base | {"variant": variant, "step_times_s": times, "peak_allocated_gib": peak}))
        files.append(str(f))
    out = tmp_path / "speed.json"
    args = argparse.Namespace(files=files, command="c", gpu="g", json=str(out), source=None)
    assert speed.table(args) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 2
    raw = rows["raw"]
    assert raw["step_time_s"] == 2.0  # the median of 1, 1, 3, 2, 2: both runs' steps together
    assert raw["repeat_tokens_per_s_per_gpu"] == [32 * 64 / 1.0, 32 * 64 / 2.0]  # each run's own median
    assert raw["peak_allocated_gib"] == 5.0
    assert "repeat_tokens_per_s_per_gpu" not in rows["trainer"]


def test_table_pools_only_repeat_files_of_one_directory_and_leaves_failed_repeats_out(speed, tmp_path: Path) -> None:
    base = {"workload": "tiny-seq64", "stage": 3, "offload": "none", "gpus": 1, "micro_batch": 4, "grad_accum": 8,
            "variant": "raw"}
    files = []
    for d, name, times, rc in (("a/s1", "raw", [1.0], 0), ("b/s1", "raw", [2.0], 0),  # same dir name, two machines
                               ("c/s2", "raw-rep1", [4.0], 0), ("c/s2", "raw-rep2", [8.0, 8.0], 124)):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        f = tmp_path / d / f"{name}.json"
        f.write_text(json.dumps(base | {"step_times_s": times, "rc": rc}))
        files.append(str(f))
    out = tmp_path / "speed.json"
    assert speed.table(argparse.Namespace(files=files, command="c", gpu="g", json=str(out), source=None)) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["step_time_s"] for r in rows) == [1.0, 2.0, 4.0]  # s1 rows apart; the cut repeat's steps out
    pooled = next(r for r in rows if r["step_time_s"] == 4.0)
    assert pooled["rc"] == 124  # the failure stays on record


def test_scaling_divides_each_multi_gpu_row_by_the_same_variant_on_one_gpu(speed, tmp_path: Path, capsys) -> None:
    def row(gpus: int, stage: int, variant: str, tps: float | None, run: str) -> dict:
        return {"workload": "w", "stage": stage, "offload": "none", "gpus": gpus, "variant": variant,
                "tokens_per_s_per_gpu": tps, "measured_in": run}
    doc = {"rows": [row(1, 2, "raw", 100.0, "a"), row(2, 2, "raw", 96.0, "b"), row(2, 3, "raw", 90.0, "b"),
                    row(1, 3, "raw-fp8", 80.0, "a"), row(2, 3, "raw-fp8", None, "b"), row(2, 2, "bare", 50.0, "b")]}
    f = tmp_path / "t.json"
    f.write_text(json.dumps(doc))
    assert speed.main(["scaling", str(f)]) == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    # only ZeRO-2 raw has both: ZeRO-3 raw has no 1-GPU row, fp8 failed on 2, bare has no 1-GPU row
    assert lines == ["| w | 2 | raw | 0.1k | 2 | 0.1k | 96.0% | a, b |"]


def test_weak_scaling_rows_count_their_own_global_batch(speed, tmp_path: Path) -> None:
    """run --global-batch-per-gpu K: each row records K x GPUs sequences a step, and the table counts those."""
    base = {"workload": "tiny-seq64", "stage": 2, "offload": "none", "rc": 0, "step_times_s": [1.0, 1.0]}
    (tmp_path / "a.json").write_text(json.dumps(base | {"gpus": 2, "variant": "raw-32pergpu", "global_batch": 64}))
    (tmp_path / "b.json").write_text(json.dumps(base | {"gpus": 1, "variant": "raw", "global_batch": speed.GLOBAL_BATCH}))
    out = tmp_path / "t.json"
    assert speed.main(["table", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["raw-32pergpu"]["tokens_per_s_per_gpu"] == 64 * 64 / 2  # 64 sequences of 64 tokens a second, 2 GPUs
    assert rows["raw-32pergpu"]["global_batch"] == 64 and "global_batch" not in rows["raw"]
    assert rows["raw"]["tokens_per_s_per_gpu"] == speed.GLOBAL_BATCH * 64


def test_the_committed_speed_page_is_the_table_of_speed_json(speed, capsys) -> None:
    """bench/results/speed.md opens with what `speed.py markdown` renders from speed.json, so the page cannot drift
    from the rows (it had: s55's, s56moe's and s71's rows were missing from it)."""
    assert speed.main(["markdown", str(ROOT / "bench" / "results" / "speed.json")]) == 0
    table = capsys.readouterr().out.rstrip("\n")
    assert (ROOT / "bench" / "results" / "speed.md").read_text().startswith(table + "\n\n")
