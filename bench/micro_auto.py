"""train.micro_batch_size=auto against the micro-batch it picks given by hand: time from launch to the end of the first
optimizer step (issue 60: the planner predicts first, the probes only confirm).

    source .whl/setup.sh && python bench/micro_auto.py --out /tmp/ma --model qwen3-4b --layers 12 \\
        --seq 4096 --global-batch 32 --stage 2   [--model phi3-mini ...]
        -> OUT/micro_auto.json: per model, the auto launch (its probes and choice) and the hand-given launch

Each launch is `deepspeed --include localhost:0 toolkit/train.py --ds ds_configs/zeroS.json ... train.max_steps=1`
(raw path, bf16, synthetic data), with its own empty TOOLKIT_CACHE so auto never reuses a recorded answer. The time
to the first step is read from the launch's own clock: the wall time of the launch (one step, then the same exit in
both); the probes' lines are kept from the log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _proc import call_group  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]


def launch(out: Path, name: str, a: argparse.Namespace, micro: str, accum: int | None) -> dict[str, Any]:
    run_dir = out / "runs" / name
    cmd = ["deepspeed", "--master_port", str(a.port), "--include", "localhost:0", "toolkit/train.py",
           "--ds", f"ds_configs/zero{a.stage}.json", f"model.name={a.model}", f"data.seq_len={a.seq}",
           f"data.num_samples={a.global_batch * 2}", f"train.global_batch_size={a.global_batch}",
           f"train.micro_batch_size={micro}", "train.max_steps=1", "train.path=raw", "train.export=false",
           "train.warmup_steps=1", "metrics.tensorboard=false", "train.precision=bf16", f"train.run_dir={run_dir}"]
    if accum is not None:
        cmd.append(f"train.grad_accum={accum}")
    if a.layers:
        cmd.append(f"model.num_layers={a.layers}")
    cache = tempfile.mkdtemp(prefix="toolkit-cache-")
    env = dict(os.environ) | {"PYTHONUNBUFFERED": "1", "TOOLKIT_CACHE": cache}
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = call_group(cmd, ROOT, env, f, a.timeout)
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    lines = [ln.strip() for ln in text.splitlines()
             if ln.startswith("micro_batch_size=auto") or re.match(r"\s+micro \d+ x", ln)]
    picked = re.search(r"micro_batch_size=auto: (\d+) x accum (\d+)", text)
    row = {"argv": " ".join(cmd), "rc": rc, "wall_s": round(wall, 1), "auto_lines": lines,
           "picked": [int(picked[1]), int(picked[2])] if picked else None}
    if rc != 0:
        row["log_tail"] = text[-3000:]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", action="append", required=True, help="a preset (repeat for several)")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--port", type=int, default=29720)
    p.add_argument("--timeout", type=int, default=420)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in a.model:
        one = argparse.Namespace(**{**vars(a), "model": model})
        auto = launch(out, f"{model}-auto", one, "auto", None)
        row: dict[str, Any] = {"model": model, "layers": a.layers, "seq": a.seq, "global_batch": a.global_batch,
                               "stage": a.stage, "auto": auto}
        if auto["picked"]:
            micro, accum = auto["picked"]
            row["given"] = launch(out, f"{model}-given", one, str(micro), accum)
            row["auto_over_given"] = round(auto["wall_s"] / row["given"]["wall_s"], 3)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("auto", "given")} |
                         {"auto_s": auto["wall_s"], "given_s": row.get("given", {}).get("wall_s"),
                          "picked": auto["picked"]}), flush=True)
        (out / "micro_auto.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0 if all(r["auto"]["rc"] == 0 and r.get("given", {}).get("rc", 1) == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
