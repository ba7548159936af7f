"""`train.micro_batch_size=auto`: the fastest micro-batch that fits the requested global batch.

The planner (toolkit/plan/planner.py) names the micro-batches predicted to fit; short probe runs decide. Each
probe is a child job of the same command (same ranks, same GPUs, its own rendezvous port) for a few
optimizer steps, because an out-of-memory error inside the real job is not recoverable: the rank that
fails leaves its peers waiting in a collective. Every rank polls its own child, and the ranks agree once a
second over a CPU (gloo) group, so one child's failure stops the other children at once.

Where the planner predicts with room to spare (its need plus its own 10% error under the card), its largest
fitting micro-batch is taken without a probe. Nearer the edge that one is probed to confirm it, smaller ones
only if it does not fit. Where the planner cannot say, every divisor is probed, largest first, while they get
faster; the fastest that ran wins.

Compile and float8 (`train.compile`, `train.precision=fp8`) change both memory and speed, so the planner
predicts with them and the probes run them: each probe is told the run's resolved compile setting (`auto`
would see a 4-step probe as too short to compile). The compile is not paid blindly: it lands in a probe's
first step, which its speed leaves out; the decoder layers share one compiled graph, so a probe compiles one
layer (6-12 s on an H200, bench/results/fp8_compile.md); and inductor's on-disk cache, shared by the probes and
the run on a machine, lets the run load the winning probe's compiled graphs (same shapes) instead of compiling
them again. The result is recorded in the run directory (`micro_batch.json`) and in a cache
keyed by everything that changes it (~/.cache/toolkit/micro_batch.json), and reused from either.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.config.ds_config import ConfigError
from toolkit.config.schema import Config, packing
from toolkit.launch import dist

if TYPE_CHECKING:
    from toolkit.runtime.spec import RunInputs

PROBE_STEPS = 4  # optimizer steps per probe; the median tokens/s of steps 2.. is its speed
PLAN_ERROR = 0.10  # the planner's peaks against measured ones (bench/results/speed_model/): the margin that skips a probe
RECORD = "micro_batch.json"
CACHE = Path(os.environ.get("TOOLKIT_CACHE", Path.home() / ".cache" / "toolkit")) / RECORD
OOM_MARKS = ("OutOfMemoryError", "CUDA out of memory", "out of memory", "Cannot allocate memory")
# Tests only: a child whose micro-batch is above this raises an out-of-memory error on its last rank
# (CPU runs never run out of memory); see tests/dist/test_autotune.py.
FAULT_ENV = "TOOLKIT_FAULT_OOM_ABOVE_MICRO"


def divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def key_of(inputs: RunInputs, gpu: str) -> dict[str, Any]:
    """Everything that changes the answer; a record made under another key is not reused."""
    cfg, ds, world = inputs.cfg, inputs.ds_raw, inputs.world_size
    m, t = cfg.model, cfg.train
    return {"model": m.name, "seq_len": cfg.data.seq_len, "packing": packing(cfg)[0], "task": m.task,
            "attn": m.attn_implementation, "grad_ckpt": m.gradient_checkpointing, "liger": m.liger,
            "fused_loss": m.liger_fused_loss, "lora": cfg.lora.enabled and [cfg.lora.r, *cfg.lora.target_modules],
            "precision": t.precision, "fp8_recipe": t.fp8_recipe if t.precision == "fp8" else None,
            "zero_sizes": t.zero_sizes, "compile": [t.compile, run_compiles(inputs)], "zero3_leaves": t.zero3_leaves,
            "path": t.path, "world": world, "gpu": gpu,
            "gpu_limit_gib": cfg.memory.gpu_limit_gib, "tiled_loss": m.tiled_loss,
            "global_batch": t.global_batch_size, "ds": hashlib.sha256(json.dumps(ds, sort_keys=True).encode()).hexdigest()[:16],
            "data": _data_identity(cfg.data.source), "versions": _versions(),
            "objective": [t.objective, cfg.pref.reference, cfg.pref.reference_offload]}


def _data_identity(source: str) -> str:
    """A data file pads batches to its longest rows: another file (or the same one changed) is another answer."""
    f = Path(source)
    if source == "synthetic" or not f.is_file():
        return source
    st = f.stat()
    return f"{f.resolve()}:{st.st_size}:{int(st.st_mtime)}"


def _versions() -> str:
    from toolkit import __version__
    from toolkit.runtime.faults.checkpoint import versions

    v = versions()
    return f"toolkit {__version__}, torch {v['torch']}, deepspeed {v['deepspeed']}, liger {v['liger-kernel']}"


def gpu_name_and_gib() -> tuple[str, float | None]:
    """NVML, so the parent process creates no CUDA context on the GPU its probes will use."""
    if dist.on_cpu():
        return "cpu", None
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(dist.local_rank())
        name = pynvml.nvmlDeviceGetName(h)
        return (name.decode() if isinstance(name, bytes) else name), pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
    except Exception:  # no NVML: probe every divisor
        return "cuda", None


def candidates(inputs: RunInputs, per_rank: int, gpu_gib: float | None) -> tuple[list[int], str]:
    """Largest first, and how to use them:
    - "predicted": the planner's largest fitting micro-batch, whose planned need leaves the planner's own error
      (PLAN_ERROR) free on the card: taken without a probe;
    - "confirm": the planner's fitting divisors, near the card's edge: the first probe that fits is the answer;
    - "search": every divisor (the planner cannot say): probed for speed until a smaller one is slower."""
    every = divisors(per_rank)
    if gpu_gib is None:
        return every, "search"
    from toolkit.plan.planner import micro_batch_needs, run_settings
    from toolkit.runtime.resolved import tiled_mlp_choice

    cfg = inputs.cfg
    try:
        fit = micro_batch_needs(inputs.model_config, inputs.ds_raw, inputs.world_size, cfg.data.seq_len,
                                per_rank, gpu_gib, **run_settings(cfg, run_compiles(inputs), tiled_mlp_choice(cfg)[0]))
    except Exception as e:  # a shape the planner refuses: the probes still find the answer
        print(f"micro_batch_size=auto: no prediction ({type(e).__name__}: {e}); probing every divisor", flush=True)
        return every, "search"
    if not fit:
        return every[-1:], "confirm"
    # The planner's largest fitting micro-batch is also its fastest (tokens per micro-step only raise MFU). Its peaks
    # are within 10% of measured ones (bench/results/speed_model/, the families it never saw among them): with that
    # much room left the plan is the answer, and a probe (a whole child launch, ~50 s on an H200) would only repeat it.
    # Nearer the edge one probe confirms it, and a smaller one follows only if it does not fit (issue 60).
    micro, need = fit[0]
    if need * (1 + PLAN_ERROR) <= gpu_gib:
        print(f"micro_batch_size=auto: the plan predicts {micro} (needs {need:.1f} of {gpu_gib:.1f} GiB, more than "
              f"its {PLAN_ERROR:.0%} error to spare): no probe", flush=True)
        return [micro], "predicted"
    return [m for m, _ in fit], "confirm"


def run_compiles(inputs: RunInputs) -> bool:
    """Whether the run itself will compile its layers: the record's rule (toolkit/runtime/resolved.py), for the
    steps known before the micro-batch is (train.max_steps; a run of one epoch counts as long)."""
    from toolkit.runtime.resolved import compile_choice

    t = inputs.cfg.train
    return compile_choice(inputs.cfg, inputs.ds_raw, not dist.on_cpu(), t.max_steps or None)[0]


def resolve(inputs: RunInputs, argv: list[str]) -> dict[str, Any]:
    """All ranks, with the process group up. Sets cfg.train.micro_batch_size and grad_accum; returns the record."""
    cfg, world = inputs.cfg, inputs.world_size
    t = cfg.train
    if t.global_batch_size < 1:
        raise ConfigError("train.micro_batch_size=auto needs train.global_batch_size (sequences per optimizer "
                          "step, all ranks together)")
    if t.global_batch_size % world:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} does not split over {world} ranks")
    _check_objective(cfg)
    per_rank = t.global_batch_size // world
    gpu, gib = gpu_name_and_gib()
    if gib is not None and cfg.memory.gpu_limit_gib > 0:  # the probes run under the same cap (their overrides)
        from toolkit.plan.planner import CUDA_CONTEXT_GIB

        gib = min(gib, cfg.memory.gpu_limit_gib + CUDA_CONTEXT_GIB)  # the planner's card: the context outside the cap
    # Rank 0 decides from the smallest GPU of the job and tells everyone, so every rank runs the same probes
    # in the same order (each rank asking NVML for itself could disagree: MIG, mixed nodes, a failed NVML).
    import torch.distributed as tdist

    group = tdist.new_group(backend="gloo")  # CPU agreement: NVML figures, then the probes' states
    smallest = _all_min(gib, group)
    key = key_of(inputs, gpu)
    record, order, error = None, None, None
    mode = "search"
    if dist.rank() == 0:
        try:
            record = _reuse(Path(t.run_dir), key, per_rank)
            order, mode = (None, mode) if record else candidates(inputs, per_rank, smallest)
        except Exception as e:  # raised on rank 0 alone, the others would wait in the broadcast below
            error = f"micro_batch_size=auto: {type(e).__name__}: {e}"
    record, order, mode, error = dist.broadcast_object([record, order, mode, error])
    if error:
        raise RuntimeError(error)
    if record is None and mode == "predicted":  # not cached: a prediction costs seconds, and a probe may follow later
        record = {"key": key, "micro_batch": order[0], "grad_accum": per_rank // order[0], "probes": [],
                  "predicted": True, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if dist.rank() == 0:
            print(f"micro_batch_size=auto: {record['micro_batch']} x accum {record['grad_accum']}", flush=True)
    elif record is None:
        record = _search(cfg, [*argv, f"train.compile={'torch' if run_compiles(inputs) else 'off'}"], key, per_rank,
                         order, group, mode == "confirm")
    t.micro_batch_size = int(record["micro_batch"])
    t.grad_accum = per_rank // t.micro_batch_size
    return record


def _check_objective(cfg: Config) -> None:
    """Preference runs are probed as SFT runs are (global_batch_size counts pairs); not where a probe cannot stand
    for the run."""
    from toolkit.runtime.objectives.reference import mode_of

    t = cfg.train
    if t.objective == "grpo":
        raise ConfigError("train.objective=grpo takes a number of prompts for train.micro_batch_size (auto: not yet)")
    if t.objective == "kto":
        raise ConfigError("train.micro_batch_size=auto with train.objective=kto: not tested yet (its probes would "
                          "run KTO's KL all-reduce); give a number of rows")
    if t.objective in ("dpo", "ipo") and mode_of(cfg.pref.reference, bool(cfg.lora.enabled))[0] == "precomputed":
        # the stored values are keyed by the micro-batch (precompute.key_of): every probe would make its own pass
        raise ConfigError("train.micro_batch_size=auto with pref.reference=precomputed: each probe would compute the "
                          "reference over the first epoch again; give a number of pairs, or pref.reference=engine")


def _all_min(gib: float | None, group: Any) -> float | None:
    """The smallest GPU memory over the ranks (None when any rank cannot tell)."""
    import torch
    import torch.distributed as tdist

    value = torch.tensor([-1.0 if gib is None else -gib], dtype=torch.float64)
    tdist.all_reduce(value, op=tdist.ReduceOp.MAX, group=group)  # max of -gib: the smallest; -1 if unknown
    return None if float(value) == -1.0 else -float(value)


def _reuse(run_dir: Path, key: dict[str, Any], per_rank: int) -> dict[str, Any] | None:
    for source in (run_dir / RECORD, CACHE):
        try:
            found = json.loads(source.read_text())
        except (OSError, ValueError):
            continue
        for rec in found if isinstance(found, list) else [found]:
            micro = rec.get("micro_batch") if isinstance(rec, dict) else None
            # only a record this job can run: an edited or foreign one is ignored, never truncated
            if rec.get("key") == key and isinstance(micro, int) and micro >= 1 and per_rank % micro == 0 \
                    and not rec.get("predicted"):  # a prediction is made again (the planner may have changed)
                print(f"micro_batch_size=auto: {rec['micro_batch']} (recorded in {source})", flush=True)
                return rec | {"reused_from": str(source)}
    return None


def _search(cfg: Config, argv: list[str], key: dict[str, Any], per_rank: int, order: list[int],
            group: Any, confirm: bool = False) -> dict[str, Any]:
    root = dist.broadcast_object([tempfile.mkdtemp(prefix="toolkit-autotune-") if dist.rank() == 0 else None])[0]
    Path(root).mkdir(parents=True, exist_ok=True)  # other nodes: the same path in their own temp directory
    if dist.rank() == 0:
        what = (f"the plan predicts {order[0]}: one probe confirms it" if confirm
                else f"probing {', '.join(map(str, order))}")
        print(f"micro_batch_size=auto: {what} ({PROBE_STEPS} steps each, global batch "
              f"{cfg.train.global_batch_size}) in {root}", flush=True)
    probes: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    for micro in order:
        probe = _probe(cfg, argv, micro, per_rank // micro, Path(root) / f"micro{micro}", group)
        probes.append(probe)
        if dist.rank() == 0:
            speed = f"{probe['tokens_per_s']:,.0f} tokens/s" if probe["fits"] else probe["outcome"]
            print(f"  micro {micro} x accum {per_rank // micro}: {speed}", flush=True)
        if not probe["fits"]:
            if best:
                break
            continue
        if best and probe["tokens_per_s"] <= best["tokens_per_s"]:
            break  # smaller micro-batches only get slower from here
        best = probe
        if confirm:
            break
    if best is None:
        shutil.rmtree(root, ignore_errors=True)
        raise ConfigError(f"train.micro_batch_size=auto: no micro-batch of {order} fits (per-rank batch {per_rank}); "
                          "use ZeRO-3, offload, model.gradient_checkpointing=true or a smaller global batch")
    record = {"key": key, "micro_batch": best["micro_batch"], "grad_accum": per_rank // best["micro_batch"],
              "probes": probes, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if dist.rank() == 0:
        _remember(record)
        print(f"micro_batch_size=auto: {record['micro_batch']} x accum {record['grad_accum']}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return record


def _remember(record: dict[str, Any]) -> None:
    from toolkit.runtime.faults.checkpoint import atomic_write

    try:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(CACHE.read_text()) if CACHE.is_file() else []
        kept = [r for r in old if isinstance(r, dict) and r.get("key") != record["key"]][-50:]
        atomic_write(CACHE, json.dumps([*kept, record], indent=1) + "\n")
    except (OSError, ValueError) as e:  # a read-only home: the run directory still has it
        print(f"micro_batch_size=auto: not cached ({e})", flush=True)


def _probe(cfg: Config, argv: list[str], micro: int, accum: int, run_dir: Path, group: Any) -> dict[str, Any]:
    """All ranks: one child per rank; the children form their own job on a port rank 0 found free."""
    import torch
    import torch.distributed as tdist

    over = [f"train.micro_batch_size={micro}", f"train.grad_accum={accum}", f"train.max_steps={PROBE_STEPS}",
            f"train.run_dir={run_dir}", "train.overwrite=true", "train.resume=null", "train.export=false",
            "train.save_every=0", "train.stop_after=0", "train.log_every=1", "eval.generate=false",
            "memory.every=1", "metrics.report_to=none", "train.warmup_steps=1",  # no tracker runs per probe
            "train.profile_steps=[]"]  # a profiler in a probe would slow the steps it times
    port = dist.broadcast_object([_free_port() if dist.rank() == 0 else None])[0]
    env = os.environ | {"MASTER_PORT": str(port), "TOOLKIT_AUTOTUNE_PROBE": "1"}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    out = run_dir.parent / f"micro{micro}.rank{dist.rank()}.log"
    with out.open("w") as log:
        child = subprocess.Popen([sys.executable, "-u", str(Path(__file__).resolve().parents[2] / "train.py"), *argv, *over],
                                 env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + cfg.train.collective_timeout_s + 600  # start-up, then PROBE_STEPS steps
    outcome = "ok"
    try:
        while True:
            time.sleep(1.0)
            rc = child.poll()
            late = rc is None and time.monotonic() > deadline
            failed = rc not in (None, 0)
            # [out of memory, other failure, timed out, running], OR-ed over the ranks. Out of memory
            # anywhere wins: its peers then fail too (connection closed by peer), and that is not a
            # reason to stop the search. A child the kernel's OOM killer took has no text: SIGKILL.
            oom = _oom(out) or (failed and rc == -signal.SIGKILL)
            state = torch.tensor([oom, failed and not oom, late, rc is None], dtype=torch.int64)
            tdist.all_reduce(state, op=tdist.ReduceOp.MAX, group=group)
            any_oom, any_failed, any_late, running = (bool(x) for x in state.tolist())
            if any_oom or any_failed or any_late:  # stop every other child now, not at its collective timeout
                outcome = "out of memory" if any_oom else "timed out" if any_late else "failed"
                break
            if not running:
                break
    finally:  # also when this loop raises (a peer parent gone): never leave a child holding the GPU
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    if outcome == "failed":
        tail = out.read_text()[-3000:] if child.returncode else ""
        # every rank raises; the one whose child failed for a reason other than memory shows its log
        raise RuntimeError(f"micro_batch_size=auto: the probe at micro {micro} failed (not out of memory); "
                           f"rank {dist.rank()} log {out}" + (f":\n{tail}" if tail else ""))
    result: dict[str, Any] = {"micro_batch": micro, "fits": outcome == "ok", "outcome": outcome}
    if outcome == "ok" and dist.rank() == 0:
        try:
            result |= _measured(run_dir)
        except (OSError, ValueError, KeyError) as e:  # rank 0 alone: report it, do not leave the others waiting
            result |= {"fits": False, "outcome": f"no measurement ({type(e).__name__}: {e})"}
    return dist.broadcast_object([result])[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _oom(log: Path) -> bool:
    text = log.read_text(errors="replace")[-20000:]
    return any(m in text for m in OOM_MARKS)


def _measured(run_dir: Path) -> dict[str, Any]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in lines if r["step"] > 1 and r.get("tokens_per_s")]
    peaks = [json.loads(x).get("peak_allocated_gib") for x in (run_dir / "memory" / "rank0.jsonl").read_text().splitlines()]
    peaks = [p for p in peaks if p is not None]
    return {"tokens_per_s": statistics.median(tps) if tps else 0.0, "peak_allocated_gib": max(peaks) if peaks else None}


def inject_fault_for_tests(micro: int) -> None:
    """A probe child above FAULT_ENV's micro-batch fails like an OOM on its last rank (tests only)."""
    limit = os.environ.get(FAULT_ENV)
    if limit and os.environ.get("TOOLKIT_AUTOTUNE_PROBE") and micro > int(limit) \
            and dist.rank() == dist.world_size() - 1:
        import torch

        raise torch.OutOfMemoryError(f"{FAULT_ENV}={limit}: injected at micro {micro}")

