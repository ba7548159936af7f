# s50, the first command of the call (source .whl/setup.sh; bash THIS): tiled loss on/off (GPUs 2,3 side by side),
# the Trainer path against the raw loop at SP=4. The call then ran the fp8 rows:
#   PER_GPU=32 bash bench/scaling_rows.sh /tmp/o50/s50 llama-1b-seq2048 2:fp8,3:fp8
o=/tmp/o50; mkdir -p $o
T=(train.path=raw model.name=llama-3.2-1b data.seq_len=32768 data.num_samples=12 train.micro_batch_size=1 train.grad_accum=1
   train.max_steps=6 train.precision=bf16 train.export=false train.warmup_steps=1 train.log_every=1 train.lr=1e-4
   model.liger_fused_loss=false model.gradient_checkpointing=true)
for x in true:2 false:3; do
  timeout 150 deepspeed --include localhost:${x#*:} --master_port 2962${x#*:} toolkit/train.py --ds ds_configs/zero2.json \
    "${T[@]}" model.tiled_loss=${x%:*} train.run_dir=$o/tl-${x%:*} > $o/tl-${x%:*}.log 2>&1 &
done
wait
C=(model.name=llama-3.2-1b data.seq_len=16384 data.num_samples=40 train.micro_batch_size=1 train.grad_accum=1
   train.max_steps=12 train.precision=bf16 train.export=false train.warmup_steps=2 train.lr=1e-4 train.log_every=1
   train.sequence_parallel=4)
for p in raw trainer; do
  timeout 170 deepspeed --num_gpus 4 --master_port 2963${#p} toolkit/train.py --ds ds_configs/zero2.json "${C[@]}" \
    train.path=$p train.run_dir=$o/sp4-$p > $o/sp4-$p.log 2>&1; echo "sp4-$p rc=$?"
done
python - $o <<'PY'
import json, sys
from pathlib import Path
o = Path(sys.argv[1]); doc = {}
for name in ("tl-true", "tl-false", "sp4-raw", "sp4-trainer"):
    d = o / name
    m = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] if (d / "metrics.jsonl").exists() else []
    peaks = [json.loads(x).get("peak_allocated_gib") or 0 for f in sorted((d / "memory").glob("rank*.jsonl"))
             for x in f.read_text().splitlines()] if (d / "memory").exists() else []
    doc[name] = {"losses": [r.get("loss") for r in m], "grad_norm": [r.get("grad_norm") for r in m],
                 "tokens_per_s": [r.get("tokens_per_s") for r in m], "peak_gib": max(peaks, default=None)}
    print(name, json.dumps(doc[name]))
(o / "s50.json").write_text(json.dumps(doc, indent=1))
PY
