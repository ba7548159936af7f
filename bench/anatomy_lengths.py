"""What grows with the sequence at the peak: bench/peak_anatomy.py at two or more lengths of one long-sequence setup,
beside the planner's breakdown at the same lengths (issue 35: the planner's per-token slope).

Each length runs one optimizer step of bench/max_seq_probe.py's setup (same Config, DeepSpeed config and overrides)
under torch's allocator history on its own GPU, all at once; then the live tensors at each peak are grouped by the
frame that allocated them and divided by the length's tokens per rank, so a site whose bytes per token differ
from the planner's term is the term to fix:

    python bench/anatomy_lengths.py --out OUT --lengths 65536,131072 --gpus 0,1 --model llama-3.2-1b --rope 8 --lora

OUT/anatomy-SEQ.json (peak_anatomy's result), OUT/logs/, OUT/anatomy_lengths.json (per-site bytes per token between
the lengths, and the planner's phase and breakdown at each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])
sys.path.insert(1, str(Path(__file__).resolve().parent))

import plan_calibrate as pc  # noqa: E402

from toolkit.plan import planner as pl  # noqa: E402
from toolkit.plan.speedups import tiled_mlp_on  # noqa: E402


def _classes(measured: dict, tokens: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for size, n in measured.get("sizes_at_peak", {}).items():
        key = f"{int(size) / tokens:.1f}"
        out[key] = round(out.get(key, 0.0) + int(size) * n / pl.GIB, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", required=True, help="comma-separated sequence lengths, one GPU each")
    ap.add_argument("--gpus", default="0,1", help="comma-separated GPU indices, one per length (a GPU may repeat)")
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--rope", type=float, default=8.0)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--gpu-mem", type=float, default=26.65, help="the planner's --gpu-mem (its phases only)")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--stacks", action="store_true", help="record Python stacks (sites); off: sizes only")
    ap.add_argument("--tiled-mlp", choices=("auto", "false"), default="auto", help="auto: as the run's auto (on from 65,536 tokens)")
    ap.add_argument("--at-bytes-per-token", type=float, default=0.0,
                    help="the live set just after the last allocation of this many bytes per token, not at the peak")
    ap.add_argument("--port", type=int, default=29700, help="master port of the first length (+1 for each next)")
    ap.add_argument("--at-first", action="store_true", help="the first such allocation, not the last")
    a = ap.parse_args()
    out = Path(a.out)
    lengths = [int(x) for x in a.lengths.split(",")]
    gpus = a.gpus.split(",")
    if len(gpus) < len(lengths):
        raise SystemExit("one GPU per length")
    procs = []
    for i, (seq, gpu) in enumerate(zip(lengths, gpus, strict=False)):
        c = pc.Config(f"anat-{seq}", a.model, seq, 1, 1, a.stage, ckpt=True, lora=a.lora,
                      tiled=tiled_mlp_on(a.tiled_mlp, seq, 1)[0], rope=a.rope)
        ds_file, run_dir = out / "ds" / f"{c.name}.json", out / "runs" / c.name
        ds_file.parent.mkdir(parents=True, exist_ok=True)
        (out / "logs").mkdir(exist_ok=True)
        ds_file.write_text(json.dumps(pc.ds_config_for(c.choice()), indent=1))
        plan_file = out / f"{c.name}.plan.json"
        p = pc.predict(c, a.gpu_mem, False)
        plan_file.write_text(json.dumps(pc.plan_record(c, p, "bench/anatomy_lengths.py"), indent=1))
        cmd = ["deepspeed", "--master_port", str(a.port + i), "--include", f"localhost:{gpu}", "bench/peak_anatomy.py",
               str(out / f"anatomy-{seq}.json"), "--ds", str(ds_file),
               *pc._overrides(c, 1, run_dir, plan_file, False)]
        log = (out / "logs" / f"{c.name}.log").open("w")
        env = dict(os.environ) | {"PYTHONUNBUFFERED": "1", "PEAK_ANATOMY_STACKS": "1" if a.stacks else "0",
                                  "PEAK_ANATOMY_AT_SIZE": str(int(a.at_bytes_per_token * seq)),
                                  "PEAK_ANATOMY_AT_FIRST": "1" if a.at_first else "0"}
        procs.append((seq, p, subprocess.Popen(cmd, cwd=pc.ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)))
    rows = {}
    for seq, p, proc in procs:
        try:
            rc = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = -9
        f = out / f"anatomy-{seq}.json"
        measured = json.loads(f.read_text()) if f.is_file() else None
        rows[seq] = {"rc": rc, "peak_gib": measured and measured["peak_gib"],
                     "peak_event_site": measured and measured["peak_event_site"],
                     "sites": {f"{r['site']} [{r['phase']}]": r["gib"] for r in (measured or {}).get("live_at_peak", [])},
                     # live tensors by bytes per token of this length: a tensor that grows with the sequence keeps its
                     # class at every length (4,096: a bf16 hidden state), a fixed one moves
                     "per_token_classes": _classes(measured, seq) if measured else None,
                     "to_peak_per_token": [round(x / seq, 1) for x in (measured or {}).get("to_peak", [])],
                     "after_peak_per_token": [round(x / seq, 1) for x in (measured or {}).get("after_peak", [])],
                     "planner": {"peak_gib": p.peak_allocated_gib, "phase": p.phase, "gpu_gib": p.gpu}}
    doc: dict = {"command": "python bench/anatomy_lengths.py " + " ".join(sys.argv[1:]), "device": pc._device_name(),
                 "lengths": rows}
    done = [s for s in lengths if rows[s]["peak_gib"]]
    if len(done) >= 2:  # bytes per token between the shortest and the longest that ran
        lo, hi = done[0], done[-1]
        sites = set(rows[lo]["sites"]) | set(rows[hi]["sites"])
        per = {s: (rows[hi]["sites"].get(s, 0.0) - rows[lo]["sites"].get(s, 0.0)) * pl.GIB / (hi - lo) for s in sites}
        doc["bytes_per_token"] = dict(sorted(per.items(), key=lambda kv: -abs(kv[1])))
        doc["peak_bytes_per_token"] = (rows[hi]["peak_gib"] - rows[lo]["peak_gib"]) * pl.GIB / (hi - lo)
        doc["planner_bytes_per_token"] = (rows[hi]["planner"]["peak_gib"] - rows[lo]["planner"]["peak_gib"]) \
            * pl.GIB / (hi - lo)
    (out / "anatomy_lengths.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "lengths"}, indent=1))
    return 0 if len(done) == len(lengths) else 1


if __name__ == "__main__":
    sys.exit(main())
