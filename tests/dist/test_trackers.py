"""metrics.report_to (issue 24): TensorBoard, wandb and mlflow on both paths, 2 CPU ranks, offline (wandb's
offline mode, mlflow's local file store), read back from what each tracker wrote: the same scalars as
metrics.jsonl (loss, lr, grad norm, tokens/s, MFU) and every rank's memory. One launch for both runs."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from _launch import Runs, launch

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
PATHS = ("raw", "trainer")
STEPS = 3
TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "train/tokens_per_s",
        "mfu": "train/mfu"}


def wandb_history(run_dir: Path) -> list[dict[str, float]]:
    """The history rows of a run's offline wandb runs, oldest first (a resumed run writes a second one)."""
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline wandb run in {run_dir}"
    return [row for f in files for row in _wandb_file(f)]


def _wandb_file(path: Path) -> list[dict[str, float]]:
    """History rows from a .wandb file: wandb's record log (LevelDB-style 32 KiB blocks of crc32/length/type
    framed protobuf records after a 7-byte W&B header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, part, rows = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: one record complete
            rec = pb.Record()
            rec.ParseFromString(part)
            part = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = Runs(tmp_path_factory.mktemp("trackers"))
    common = [f"train.max_steps={STEPS}", "train.precision=fp32", "train.warmup_steps=1", "memory.every=1",
              "data.num_samples=64", "train.export=false", "metrics.report_to=[tensorboard,wandb,mlflow]",
              "metrics.peak_tflops=0.001"]  # a made-up peak, so that CPU runs log an MFU too
    spec = [{"name": path, "argv": ["--ds", str(ROOT / "ds_configs" / "zero2.json"), *common, f"train.path={path}",
                                    f"train.run_dir={tmp / path}"]} for path in PATHS]
    # stopped after step 2 with a checkpoint, then resumed: the same wandb and mlflow runs continue
    spec += [{"name": f"resume-{i}", "argv": ["--ds", str(ROOT / "ds_configs" / "zero2.json"), *common,
                                             "train.path=raw", f"train.run_dir={tmp / 'resumed'}", *extra]}
             for i, extra in enumerate((["train.stop_after=2"], ["train.resume=latest"]))]
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "toolkit-test", "MLFLOW_TRACKING_URI": f"file:{tmp / 'mlruns'}",
           "MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_EXPERIMENT_NAME": "toolkit-test"}
    launch(tmp, spec, name="runs", timeout=800, env=env)
    return tmp


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", PATHS)
def test_wandb_offline_has_the_metrics_and_every_ranks_memory(runs: Path, path: str) -> None:
    rows = {int(r["_step"]): r for r in wandb_history(runs / path)}
    lines = metrics(runs / path)
    assert sorted(rows) == [m["step"] for m in lines] == list(range(1, STEPS + 1))
    for m in lines:
        row = rows[m["step"]]
        for key, tag in TAGS.items():
            assert row[tag] == pytest.approx(m[key], rel=1e-9), (path, m["step"], tag)
        for rank in (0, 1):
            assert 0 < row[f"memory/rank{rank}/host_rss_gib"] < 64
            assert f"memory/rank{rank}/allocated_gib" not in row  # null on CPU: left out, not NaN
    record = json.loads((runs / path / "trackers.json").read_text())
    assert record["wandb"]["mode"] == "offline" and record["wandb"]["project"] == "toolkit-test"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", PATHS)
def test_mlflow_file_store_has_the_metrics_and_every_ranks_memory(runs: Path, path: str) -> None:
    from mlflow.tracking import MlflowClient

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # this process reads the store the run wrote
    client = MlflowClient(tracking_uri=f"file:{runs / 'mlruns'}")
    run_id = json.loads((runs / path / "trackers.json").read_text())["mlflow"]["run_id"]
    run = client.get_run(run_id)
    assert run.info.run_name == path and run.info.status == "FINISHED"
    assert run.data.params["train.path"] == path and run.data.params["metrics.peak_tflops"] == "0.001"
    lines = metrics(runs / path)
    for key, tag in TAGS.items():
        history = sorted((h.step, h.value) for h in client.get_metric_history(run_id, tag))
        assert history == [(m["step"], pytest.approx(m[key], rel=1e-9)) for m in lines], (path, tag)
    for rank in (0, 1):
        rss = client.get_metric_history(run_id, f"memory/rank{rank}/host_rss_gib")
        assert sorted(h.step for h in rss) == list(range(1, STEPS + 1)) and all(0 < h.value < 64 for h in rss)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", PATHS)
def test_tensorboard_still_written_beside_them(runs: Path, path: str) -> None:
    assert list((runs / path / "tb").glob("events.out.tfevents.*"))
    assert list((runs / path / "tb" / "rank1").glob("events.out.tfevents.*"))


@pytest.mark.timeout(900)
def test_a_resumed_run_continues_the_same_tracker_runs(runs: Path) -> None:
    from mlflow.tracking import MlflowClient

    run_dir = runs / "resumed"
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({f.stem for f in files}) == 1  # one run id, two attempts
    assert [int(r["_step"]) for r in wandb_history(run_dir)] == [1, 2, 3]
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=f"file:{runs / 'mlruns'}")
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    assert sorted(h.step for h in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3]
    assert [r.info.run_name for r in client.search_runs([client.get_run(run_id).info.experiment_id])].count(
        "resumed") == 1
