"""The trackers in `metrics.report_to` besides TensorBoard (toolkit/observe/tb.py): wandb and mlflow.

Rank 0 logs, on both paths, what it writes to metrics.jsonl under TensorBoard's tags (train/loss,
train/lr, train/grad_norm, train/tokens_per_s, train/mfu, ..., eval/loss) and every rank's memory as
memory/rank{N}/<field>. The memory of the other ranks reaches rank 0 inside the all-reduce that a log
line does anyway (MetricsLogger.log), so trackers add no collective and no host sync.

Each tracker is configured the way its own docs say (WANDB_PROJECT, WANDB_MODE=offline,
MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, ...). Where a run goes is recorded in run_dir/trackers.json,
and a resumed run (train.resume) continues the same wandb / mlflow run. The packages are optional:
`check` turns a missing one into one line naming the install, before any process starts training.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from toolkit.config.ds_config import ConfigError
from toolkit.observe.tb import EVAL_TAGS, MEMORY_TAGS, TRAIN_TAGS

RECORD = "trackers.json"
# tracker -> (module to import, what to install)
PACKAGES = {"wandb": ("wandb", "pip install wandb"), "mlflow": ("mlflow", "pip install mlflow-skinny (or mlflow)")}
MEMORY_KEYS = tuple(MEMORY_TAGS)  # allocated_gib, peak_allocated_gib, nvml_used_gib, host_rss_gib
_SCALAR_TAGS = {**TRAIN_TAGS, **EVAL_TAGS}


def external(report_to: list[str] | tuple[str, ...]) -> list[str]:
    """The trackers this module runs (TensorBoard has its own writers)."""
    return [n for n in report_to if n in PACKAGES]


def check(report_to: list[str] | tuple[str, ...]) -> None:
    """Before training: each tracker's package is there, and mlflow's tracking store opens. One line."""
    for name in external(report_to):
        module, install = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"metrics.report_to has {name}, but the {module} package is not installed: {install}")
    if "mlflow" in report_to:
        _mlflow_client()


def _mlflow_client() -> Any:
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = mlflow.get_tracking_uri()  # MLFLOW_TRACKING_URI, else mlflow's default
    try:
        return MlflowClient(tracking_uri=uri)
    except Exception as e:
        raise ConfigError(
            f"metrics.report_to has mlflow, but its tracking store {uri} does not open ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}); set MLFLOW_TRACKING_URI to your server, to sqlite:///mlflow.db "
            "(the full mlflow package), or to file:DIR with MLFLOW_ALLOW_FILE_STORE=true") from None


def memory_slots(reading: dict[str, float | None] | None, rank: int, world: int) -> list[float]:
    """This rank's reading in its own slots of a world-sized vector, zeros elsewhere: summed over ranks,
    the vector holds every rank's values (a null travels as NaN, and NaN + 0 stays NaN)."""
    if reading is None:
        return []
    out = [0.0] * (world * len(MEMORY_KEYS))
    for i, k in enumerate(MEMORY_KEYS):
        v = reading.get(k)
        out[rank * len(MEMORY_KEYS) + i] = float(v) if _is_num(v) else math.nan
    return out


def memory_from_slots(values: list[float], world: int) -> dict[int, dict[str, float | None]]:
    """The summed vector back as rank -> {field: GiB or None}."""
    n = len(MEMORY_KEYS)
    if len(values) != world * n:
        return {}
    return {r: {k: None if math.isnan(v) else v for k, v in zip(MEMORY_KEYS, values[r * n:(r + 1) * n], strict=True)}
            for r in range(world)}


def scalars(rec: dict[str, Any], memory: dict[int, dict[str, float | None]] | None = None) -> dict[str, float]:
    """A metrics.jsonl line (and every rank's memory) as tag -> number; nulls are left out, not NaN."""
    out = {tag: float(rec[k]) for k, tag in _SCALAR_TAGS.items() if _is_num(rec.get(k))}
    for rank, values in (memory or {}).items():
        out |= {f"memory/rank{rank}/{k}": float(v) for k, v in values.items() if _is_num(v)}
    return out


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flat(val, f"{prefix}.{key}" if prefix else key).items()}
    return {prefix: obj}


class _Wandb:
    def __init__(self, run_dir: Path, config: dict[str, Any], resume_id: str | None) -> None:
        import wandb

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "toolkit"), name=run_dir.name, dir=str(run_dir), config=config,
            id=resume_id, resume="allow" if resume_id else None,
            # the toolkit keeps its own console log per rank (observe/console.py); wandb must not wrap stdout
            settings=wandb.Settings(console="off"),
        )
        self.record = {"id": self._run.id, "project": self._run.project, "mode": os.environ.get("WANDB_MODE", "online")}

    def log(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class _Mlflow:
    def __init__(self, run_dir: Path, config: dict[str, Any], resume_id: str | None) -> None:
        from mlflow.entities import Param

        self._client = _mlflow_client()
        if resume_id:
            self.run_id = resume_id
            self._client.update_run(resume_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "toolkit")
            exp = self._client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp else self._client.create_experiment(name)
            self.run_id = self._client.create_run(exp_id, run_name=run_dir.name).info.run_id
            params = [Param(k, str(v)[:500]) for k, v in _flat(config).items()]
            for i in range(0, len(params), 100):  # mlflow takes at most 100 params per batch
                self._client.log_batch(self.run_id, params=params[i:i + 100])
        import mlflow

        self.record = {"run_id": self.run_id, "tracking_uri": mlflow.get_tracking_uri()}

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step) for k, v in values.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class Trackers:
    """Rank 0's wandb / mlflow runs for one training run. ``start_step`` > 0 (a resume) continues the runs
    recorded in run_dir/trackers.json."""

    def __init__(self, names: list[str], run_dir: Path, config: dict[str, Any], start_step: int) -> None:
        self.run_dir = Path(run_dir)
        record_file = self.run_dir / RECORD
        before = json.loads(record_file.read_text()) if start_step and record_file.is_file() else {}
        kinds = {"wandb": (_Wandb, "id"), "mlflow": (_Mlflow, "run_id")}
        self._open: dict[str, Any] = {}
        for name in external(names):
            cls, key = kinds[name]
            self._open[name] = cls(self.run_dir, config, before.get(name, {}).get(key))
        record_file.write_text(json.dumps({n: t.record for n, t in self._open.items()}, indent=2) + "\n")

    def log(self, rec: dict[str, Any], step: int, memory: dict[int, dict[str, float | None]] | None = None) -> None:
        values = scalars(rec, memory)
        for tracker in self._open.values():
            tracker.log(values, step)

    def close(self) -> None:
        for tracker in self._open.values():
            tracker.close()
        self._open = {}
