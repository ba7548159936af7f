#!/usr/bin/env bash
# The GPU benchmark commands, as run on a 2x H200 machine (device tool) from the repo root.
#   bash bench/gpu_runs.sh seeds  OUT   # 1-GPU seed tables: toolkit on GPU 0, plain HF Trainer on GPU 1, in parallel
#   bash bench/gpu_runs.sh twogpu OUT   # 2-GPU: ~1B preset ZeRO-2/3/offload both paths (tests/gpu) + snapshot overhead
#   bash bench/gpu_runs.sh all    OUT   # 1-GPU: only the Qwen "all together" variant, toolkit and HF, in parallel
#   bash bench/gpu_runs.sh anatomy OUT  # 2-GPU: live tensors at the peak (llama-1b ZeRO-2/3) + BERT/Qwen ZeRO-2/3/offload
#   bash bench/gpu_runs.sh speed OUT --gpus 2 [bench/speed.py run options]   # bare vs toolkit vs HF, tokens/s
#   bash bench/gpu_runs.sh lora-liger OUT  # 2-GPU: LoRA (adapter autocast) with Liger kernels, 3 steps
set -uo pipefail
mode=$1 out=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python bench/prebuild_ops.py > "$out/prebuild.log" 2>&1
case $mode in
  speed)
    python bench/speed.py run --out "$out" "${@:3}" 2>&1 | tee "$out/speed.log"
    python bench/speed.py table "$out"/*.json --json "$out/speed.json" --command "bash bench/gpu_runs.sh $*" \
      --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee "$out/speed.md"
    exit 0 ;;
  lora-liger)
    deepspeed --num_gpus 2 --master_port 29550 toolkit/train.py --ds ds_configs/zero2.json model.name=qwen2-0.5b \
      lora.enabled=true data.seq_len=512 data.num_samples=64 train.max_steps=3 train.export=false \
      train.run_dir="$out/run-lora-liger" > "$out/lora-liger.log" 2>&1
    echo "lora-liger rc=$?"; grep -E "liger|error|Error" "$out/lora-liger.log" | head; cat "$out/run-lora-liger/metrics.jsonl"
    exit 0 ;;
  seeds)
    ( for s in qwen bert qwen-zero; do
        CUDA_VISIBLE_DEVICES=1 python bench/seeds.py suite --runner hf --suite $s --out "$out"
      done ) > "$out/hf.log" 2>&1 &
    for s in qwen bert qwen-zero; do
      python bench/seeds.py suite --runner toolkit --suite $s --include localhost:0 --port 29510 --out "$out"
    done > "$out/toolkit.log" 2>&1
    wait ;;
  all)  # the Qwen "all together" variant only: toolkit on GPU 0, plain HF Trainer on GPU 1, in parallel
    CUDA_VISIBLE_DEVICES=1 python bench/seeds.py suite --runner hf --suite qwen --only all --out "$out" > "$out/hf.log" 2>&1 &
    python bench/seeds.py suite --runner toolkit --suite qwen --only all --include localhost:0 --port 29510 \
      --out "$out" > "$out/toolkit.log" 2>&1
    wait ;;
  twogpu)
    TOOLKIT_BENCH_OUT="$out" python -m pytest -q tests/gpu -p no:cacheprovider > "$out/gputest.log" 2>&1
    python bench/seeds.py suite --runner toolkit --suite overhead --gpus 2 --port 29520 --out "$out" > "$out/overhead.log" 2>&1 ;;
  anatomy)  # what is alive at the per-rank peak, llama-1b ZeRO-2 vs ZeRO-3 (3 steps), then other models
    for ds in zero2 zero3; do
      deepspeed --num_gpus 2 --master_port 29530 bench/peak_anatomy.py "$out/anatomy-$ds.json" --ds ds_configs/$ds.json \
        model.name=llama-1b data.seq_len=512 data.num_samples=48 train.micro_batch_size=4 train.max_steps=3 \
        train.precision=bf16 train.export=false train.path=raw memory.every=1 train.run_dir="$out/run-anatomy-$ds"
    done > "$out/anatomy.log" 2>&1
    python bench/seeds.py suite --runner toolkit --suite zero-2gpu --gpus 2 --port 29540 --out "$out" > "$out/zero2gpu.log" 2>&1 ;;
esac
python bench/seeds.py table "$out"/*.json > "$out/tables.md"
tail -5 "$out"/*.log
cat "$out/tables.md"
