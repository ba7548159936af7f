#!/usr/bin/env bash
# Issue 34's rows on one multi-GPU host (N = every GPU nvidia-smi lists), from the repo root, one device command:
#   bash bench/multi_gpu_rows.sh OUT [PARTS]    PARTS: comma-separated of sp, data, moe (default sp,data)
#   GPUS=2,3 in the environment: these GPUs only (N = 2), so another job can use the others meanwhile;
#   MOE_VARIANTS=raw: the moe part without the bare loop's row
# (Runs s40 and s41 ran it as bench/two_gpu_rows.sh, on 2 GPUs, at commit 9497ac3.)
# 1. Sequence parallelism: llama-3.2-1b at 16,384 tokens, bf16, ZeRO-2, 20 steps, one sequence per step:
#    train.sequence_parallel=N on all GPUs against the same job on GPU 0 alone -> OUT/sp.json (per-step losses,
#    mean |difference|, peaks, tokens/s), run dirs' metrics in OUT/sp{1,N}.metrics.jsonl.
# 2. Real data: llama-1b seq 2048 on the 100k-row corpus against synthetic rows, ZeRO-2 and ZeRO-3, on N GPUs, and
#    the corpus on GPU 0 alone (scaling 1 -> N) -> OUT/speed.json, OUT/speed.md, OUT/scaling.md. PER_GPU=32 in the
#    environment: the same work per GPU on 1 and N GPUs (weak scaling) instead of 32 sequences in all.
# 3. Mixture-of-Experts: the reduced-layer Qwen3-30B-A3B shape (3 of 48 layers) at ZeRO-3 on N GPUs, the toolkit
#    at the planner's micro 8, and with DeepSpeed's AutoEP (autoep_size N), against the bare DeepSpeed loop
#    -> OUT/moe.json, OUT/moe.md.
set -uo pipefail
out=$1
parts=",${2:-sp,data},"
ids=${GPUS:-$(seq -s, 0 $(($(nvidia-smi -L | wc -l) - 1)))}
ids=${ids// /}
n=$(tr , '\n' <<< "$ids" | wc -l)
first=${ids%%,*}
p=$((first * 1000))  # each copy (GPUS=0,1 beside GPUS=2,3) its own ports and corpus directory
gpu="$(nvidia-smi -i "$first" --query-gpu=name --format=csv,noheader) x $n"
work=/tmp/dc$first
mkdir -p "$out/s"
export PYTHONUNBUFFERED=1
if [ "${TORCH_CUDA_ARCH_LIST:-}" != "${TORCH_CUDA_ARCH_LIST%a}" ]; then
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST%a}  # the bare loop is not run here; one cached FusedAdam
fi
python bench/prebuild_ops.py fused_adam > "$out/s/prebuild.log" 2>&1 &
[[ $parts == *,data,* ]] && python bench/data_cache.py make --work "$work" --files data100k > "$out/s/make.log" 2>&1
wait

if [[ $parts == *,sp,* ]] && [ "$n" -gt 1 ]; then  # SP=N against SP=1 needs N > 1

C=(train.path=raw model.name=llama-3.2-1b data.seq_len=16384 data.num_samples=40 train.micro_batch_size=1
   train.grad_accum=1 train.max_steps=20 train.precision=bf16 train.export=false train.warmup_steps=2 train.lr=1e-4
   train.log_every=1)
timeout --kill-after=10 170 deepspeed --include "localhost:$first" --master_port $((p + 29610)) toolkit/train.py \
  --ds ds_configs/zero2.json "${C[@]}" train.run_dir="$out/s/sp1" > "$out/s/sp1.log" 2>&1; echo "sp1 rc=$?"
timeout --kill-after=10 170 deepspeed --include "localhost:$ids" --master_port $((p + 29611)) toolkit/train.py \
  --ds ds_configs/zero2.json "${C[@]}" train.sequence_parallel="$n" train.run_dir="$out/s/sp$n" > "$out/s/sp$n.log" 2>&1
echo "sp$n rc=$?"
cp "$out/s/sp1/metrics.jsonl" "$out/sp1.metrics.jsonl" 2>/dev/null
cp "$out/s/sp$n/metrics.jsonl" "$out/sp$n.metrics.jsonl" 2>/dev/null
python - "$out" "$n" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, n = Path(sys.argv[1]), int(sys.argv[2])
def read(n):
    p = out / "s" / f"sp{n}"
    m = [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()] if (p / "metrics.jsonl").exists() else []
    peaks = [json.loads(x).get("peak_allocated_gib") or 0 for f in sorted((p / "memory").glob("rank*.jsonl"))
             for x in f.read_text().splitlines()] if (p / "memory").exists() else []
    return m, max(peaks, default=None)
(m1, p1), (m2, p2) = read(1), read(n)
d = [abs(a["loss"] - b["loss"]) for a, b in zip(m1, m2)]
doc = {"seq": 16384, "sequence_parallel": n, "steps": len(d), "mean_abs_loss_diff": statistics.mean(d) if d else None,
       "max_abs_loss_diff": max(d, default=None), "peak_gib": {"sp1": p1, f"sp{n}": p2},
       "tokens_per_s_job": {k: statistics.median(r["tokens_per_s"] for r in m[2:]) if len(m) > 2 else None
                            for k, m in (("sp1", m1), (f"sp{n}", m2))},
       "losses": {"sp1": [r["loss"] for r in m1], f"sp{n}": [r["loss"] for r in m2]}}
(out / "sp.json").write_text(json.dumps(doc, indent=1))
print({k: v for k, v in doc.items() if k != "losses"})
EOF
fi

if [[ $parts == *,data,* ]]; then
R="--data-dir $work --only llama-1b-seq2048,llama-1b-seq2048-data100k --stages 2,3 --variants raw --warmup 2 --steps 3 --timeout 120"
# PER_GPU=K: weak scaling, K sequences per GPU per optimizer step on 1 and on N GPUs (default: 32 in all on both)
R="$R${PER_GPU:+ --global-batch-per-gpu $PER_GPU}"
# shellcheck disable=SC2086  # R is several options
python bench/speed.py run --include "localhost:$ids" --out "$out/s/rows" --port $((p + 29700)) $R 2>&1 | tee -a "$out/s/run.log"
# shellcheck disable=SC2086
python bench/speed.py run --include "localhost:$first" --out "$out/s/rows" --port $((p + 29750)) ${R/llama-1b-seq2048,/} 2>&1 | tee -a "$out/s/run.log"
python bench/speed.py table "$out"/s/rows/*.json --json "$out/speed.json" --command "GPUS=$ids PER_GPU=${PER_GPU:-} bash bench/multi_gpu_rows.sh OUT data" \
  --gpu "$gpu" > "$out/speed.md"
cat "$out/speed.md"
python bench/speed.py scaling "$out/speed.json" | tee "$out/scaling.md"
fi

if [[ $parts == *,moe,* ]]; then
  python bench/speed.py run --include "localhost:$ids" --out "$out/s/moe" --port $((p + 29800)) --only qwen3-30b-a3b-l3-seq4096 --stages 3 \
    --variants "${MOE_VARIANTS:-bare,raw}" --tune m8,autoep-m8 --tune-only --warmup 2 --steps 3 --timeout 170 2>&1 | tee -a "$out/s/run.log"
  python bench/speed.py table "$out"/s/moe/*.json --json "$out/moe.json" --command "GPUS=$ids MOE_VARIANTS=${MOE_VARIANTS:-bare,raw} bash bench/multi_gpu_rows.sh OUT moe" \
    --gpu "$gpu" > "$out/moe.md"
  cat "$out/moe.md"
fi
tar czf "$out/logs.tgz" --exclude='*.pt' --exclude='checkpoints' -C "$out" s 2>/dev/null
rm -rf "$out/s"
