"""What the silent-wrong-training checks cost (issue 81): the load report, the moved check, the fp32-kept check and
the export check, against the step time (and the export's own time).

    python bench/check_cost.py --out OUT [--gpus 1] [--model llama-1b] [--seq 2048] [--micro 4] [--stage 2]

Saves the preset at random init as a model directory (bf16 safetensors, the test tokenizer beside it), then runs
toolkit/train.py from that directory through the real launcher with both checks on (the defaults). Each check says
its own time in its console line ("checkpoint: ... (checked in X s)", "every trainable parameter moved ...
(checked in Y ms)"), the export check in export/export_check.json (the engine's forward on the probe, then the
files' index and the CPU reload); the median step time comes from metrics.jsonl. The fp32-kept check names nothing
in a Llama, so its walk of the model is timed here, in this process, on the model built on the meta device. Every
check runs once a run, so OUT/result.json holds each one's time as a share of one median step, and the run's
records. On the CPU (DS_ACCELERATOR=cpu) it runs the same way with a small preset.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import torch
    from conftest import write_tokenizer
    from transformers import AutoModelForCausalLM

    from toolkit.plan.shapes import preset_config

    model_dir = out / "model"
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(preset_config(args.model)).to(torch.bfloat16).save_pretrained(model_dir)
        write_tokenizer(model_dir)
    run_dir = out / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cpu = os.environ.get("DS_ACCELERATOR") == "cpu"
    cmd = ["deepspeed", "--num_gpus", str(args.gpus), "--master_port", "29631", "toolkit/train.py",
           "--ds", f"ds_configs/zero{args.stage}.json", f"model.name={model_dir}", f"data.seq_len={args.seq}",
           f"train.micro_batch_size={args.micro}", f"train.max_steps={args.steps}", "train.warmup_steps=2",
           f"train.precision={'fp32' if cpu else 'bf16'}", "train.export=true", "train.path=raw",
           "data.num_samples=" + str(args.micro * args.gpus * args.steps), f"train.run_dir={run_dir}"]
    log = out / "train.log"
    import time

    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    load = re.search(r"^checkpoint: .*\(checked in ([\d.]+) s\)$", text, flags=re.M)
    moved = re.search(r"^every trainable parameter moved over steps (\d+)-(\d+) \((\d+) tensors; checked in ([\d.]+) ms\)$",
                      text, flags=re.M)
    exported = re.search(r"^exported .* in ([\d.]+)s$", text, flags=re.M)
    check = run_dir / "export" / "export_check.json"
    export = json.loads(check.read_text()) if check.exists() else None
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x] \
        if (run_dir / "metrics.jsonl").exists() else []
    median = statistics.median(s["step_time_s"] for s in steps[2:]) if len(steps) > 2 else None  # past compile/warmup
    result = {
        "command": " ".join(["python", "bench/check_cost.py", *sys.argv[1:]]),
        "train_command": " ".join(cmd), "rc": rc,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "median_step_s": median, "tokens_per_s": statistics.median(s["tokens_per_s"] for s in steps[2:]) if median else None,
        "load_report_s": float(load.group(1)) if load else None, "load_report_line": load.group(0) if load else None,
        "moved_check_s": float(moved.group(4)) / 1e3 if moved else None, "moved_line": moved.group(0) if moved else None,
        "fp32_kept_check_s": _fp32_walk_s(args.model),
        "export_s": float(exported.group(1)) if exported else None, "export_check": export,
        "export_check_s": export["logits"]["seconds"] + export["logits"]["engine_probe_s"] if export else None,
    }
    result["run_wall_s"] = wall  # the launcher's whole run: start-up, load, steps, export
    checks = [result[k] for k in ("load_report_s", "moved_check_s", "fp32_kept_check_s", "export_check_s")]
    if all(c is not None for c in checks):
        result["checks_s"] = sum(checks)
        result["checks_share_of_the_run"] = sum(checks) / wall
    if median:
        for k in ("load_report", "moved_check", "fp32_kept_check", "export_check"):
            if result[f"{k}_s"] is not None:
                result[f"{k}_share_of_a_step"] = result[f"{k}_s"] / median
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(model_dir, ignore_errors=True)  # gigabytes of random weights: not worth bringing back
    print(json.dumps(result, indent=1))
    return 0 if rc == 0 and load and moved and export else 1


def _fp32_walk_s(model: str) -> float:
    """The fp32-kept check's own work on the model (its pattern, then every buffer and parameter name matched),
    built on the meta device: what it costs a run after deepspeed.initialize."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.plan.shapes import preset_config
    from toolkit.runtime.faults import fp32_kept

    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(preset_config(model))
    t0 = time.perf_counter()
    fp32_kept.inspect(built, {}, torch.bfloat16)
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
