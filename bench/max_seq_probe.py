"""The longest sequence that trains, measured, beside `toolkit plan --max-seq`'s answer (issue 35).

Each trial is one optimizer step through the real `deepspeed` launcher (bench/plan_calibrate.py's run_one) with
each rank's allocator capped at --gpu-limit GiB (memory.gpu_limit_gib), so a small limit makes the search cheap
and a limit of 77 tries an 80 GB card on a bigger one. The planner is asked for the same choice with
--gpu-mem = limit + its CUDA-context allowance (the cap holds the allocator; the context lives outside it).
Trials start at the planner's answer, grow by --grow while they train, then bisect to one step (1,024 x SP):

    python bench/max_seq_probe.py --out OUT --model llama-3.2-1b --rope 8 --lora --stage 2 --gpu-limit 24
    python bench/max_seq_probe.py --out OUT --model llama-3.2-1b --rope 8 --lora --stage 2 --gpu-limit 24 \\
        --gpus 2 --sp 2 --start 229376 --budget 300     # one trial where the start trains: a lower bound
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python bench/max_seq_probe.py ...   # as far as the edge

OUT/max_seq.json: the planner's answer and every trial (length, trained or out of memory, peaks, the planner's
peak at that length); the measured longest is the longest length that trained below the shortest that did not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])
sys.path.insert(1, str(Path(__file__).resolve().parent))

import plan_calibrate as pc  # noqa: E402

from toolkit.plan import max_seq  # noqa: E402
from toolkit.plan import planner as pl  # noqa: E402
from toolkit.plan.speedups import tiled_mlp_on  # noqa: E402


def planner_longest(c: pc.Config, gpu_mem: float, host_mem: float, tiled_mlp: str = "auto") -> tuple[int, int]:
    """The planner's longest length for this exact choice (stage, offload, micro 1, checkpointing), and its edge
    (the longest whose peak alone fits: toolkit/plan/max_seq.py)."""
    w = dataclasses.replace(pc.workload(c), seq_len=1024 * c.sp)  # search() resolves tiled MLPs per length
    hw = pl.Hardware(c.gpus, 1, gpu_mem, host_mem or None)
    rows = max_seq.search(w, hw, tiled_mlp, stages=(c.stage,), offloads=(c.offload,), micro_batches=(c.micro,),
                          grad_ckpt=(c.ckpt,), zero_sizes=(c.zero_sizes,))
    if not rows:
        raise SystemExit("the planner fits no length for this choice")
    return rows[0].seq_len, rows[0].edge


def outcome(row: dict[str, Any], out: Path, name: str) -> str:
    if row["rc"] == 0:
        return "trained"
    text = row.get("log_tail", "")
    log = out / "logs" / f"{name}.log"
    if log.is_file():
        text = log.read_text(errors="replace")
    if "out of memory" in text.lower() or list((out / "runs" / name / "memory").glob("*oom*")):
        return "out_of_memory"
    return "timeout" if row["rc"] in (124, 137, -9) else "error"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--rope", type=float, default=8.0)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--act-offload", default="false", help="model.activation_offload of the trials")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--sp", type=int, default=1, help="train.sequence_parallel")
    ap.add_argument("--gpu-limit", type=float, required=True, help="memory.gpu_limit_gib of every trial")
    ap.add_argument("--host-mem", type=float, default=0.0)
    ap.add_argument("--start", type=int, default=0, help="first length (0: the planner's answer)")
    ap.add_argument("--grow", type=float, default=1.25, help="factor while trials train")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all trials; none starts past it")
    ap.add_argument("--timeout", type=int, default=200, help="seconds per trial")
    ap.add_argument("--port", type=int, default=29900)
    ap.add_argument("--include", default=None, help="localhost:I[,J]: the GPUs of every trial (default: the first)")
    ap.add_argument("--tiled-mlp", choices=("auto", "false"), default="auto",
                    help="auto: model.tiled_mlp=true from 65,536 tokens per rank, as the run's auto; false: never")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = pc.Config("probe", a.model, 0, 1, 1, a.stage, gpus=a.gpus, ckpt=True, lora=a.lora,
                     tiled=a.tiled_mlp == "auto", rope=a.rope,
                     act_offload=a.act_offload, sp=a.sp)
    gpu_mem = a.gpu_limit + pl.CUDA_CONTEXT_GIB
    planned, edge = planner_longest(base, gpu_mem, a.host_mem, a.tiled_mlp)
    step = 1024 * a.sp
    doc: dict[str, Any] = {"command": "python bench/max_seq_probe.py " + " ".join(sys.argv[1:]),
                           "device": pc._device_name(), "planner_longest": planned, "planner_edge": edge, "step": step,
                           "planner_gpu_mem_gib": gpu_mem,
                           # expandable_segments:True lets trials reach the planner's edge (fragmentation otherwise)
                           "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "trials": []}
    t0 = time.perf_counter()
    good, bad = 0, 0
    seq = a.start or planned
    while seq and time.perf_counter() - t0 < a.budget:
        c = dataclasses.replace(base, name=f"probe-sp{a.sp}-{seq}", seq=seq,
                                tiled=tiled_mlp_on(a.tiled_mlp, seq, a.sp)[0])
        print(f"trial {seq}", flush=True)
        row = pc.run_one(c, out, 1, a.port + len(doc["trials"]), a.include, False, gpu_mem, a.timeout, False,
                         a.gpu_limit, a.host_mem)
        result = outcome(row, out, c.name)
        peaks = (row.get("measured") or {}).get("per_rank", {}).values()
        doc["trials"].append({"seq": seq, "result": result, "wall_s": row["wall_s"], "rc": row["rc"],
                              "peak_allocated_gib": max((r.get("peak_allocated_gib") or 0 for r in peaks), default=None),
                              "peak_reserved_gib": max((r.get("peak_reserved_gib") or 0 for r in peaks), default=None),
                              "step_s": ((row.get("measured") or {}).get("step_times_s") or [None])[-1],
                              "predicted_peak_gib": row["predicted"]["peak_allocated_gib"],
                              "predicted_need_gib": row["predicted"]["gpu_need_gib"], "argv": row["argv"]})
        print(json.dumps(doc["trials"][-1]), flush=True)
        if result == "trained":
            good = seq
        elif result == "out_of_memory":
            bad = seq
        else:
            break  # an error or a timeout says nothing about memory
        if bad and good and bad - good <= step:
            break
        if not bad:
            seq = max(int(seq * a.grow) // step * step, seq + step)
        elif not good:
            seq = max(int(seq / a.grow) // step * step, step) if seq > step else 0
        else:  # strictly between: a --start off the step grid must not bring back a length already tried
            seq = min(max((good + bad) // 2 // step * step, good + step), bad - 1)
    doc |= {"measured_longest": good or None, "shortest_failed": bad or None,
            "resolved": bool(good and bad and bad - good <= step), "wall_s": round(time.perf_counter() - t0, 1)}
    (out / "max_seq.json").write_text(json.dumps(doc, indent=1) + "\n")
    print({k: v for k, v in doc.items() if k != "trials"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
