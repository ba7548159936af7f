#!/usr/bin/env bash
# The GPU benchmark commands, as run on a 2x H200 machine (device tool) from the repo root.
#   bash bench/gpu_runs.sh seeds  OUT   # 1-GPU seed tables: toolkit on GPU 0, plain HF Trainer on GPU 1, in parallel
#   bash bench/gpu_runs.sh twogpu OUT   # 2-GPU: ~1B preset ZeRO-2/3/offload both paths (tests/gpu) + snapshot overhead
#   bash bench/gpu_runs.sh all    OUT   # 1-GPU: only the Qwen "all together" variant, toolkit and HF, in parallel
#   bash bench/gpu_runs.sh anatomy OUT  # 2-GPU: live tensors at the peak (llama-1b ZeRO-2/3) + BERT/Qwen ZeRO-2/3/offload
#   bash bench/gpu_runs.sh speed OUT --gpus 2 [bench/speed.py run options]   # bare vs toolkit vs HF, tokens/s
#   bash bench/gpu_runs.sh lanes OUT "--include localhost:0 [options]" "--include localhost:1,2 [options]" ...
#                                    # speed.py runs side by side, each on its own GPUs (OUT/lane0, lane1, ...)
#   bash bench/gpu_runs.sh lora-liger OUT  # 2-GPU: LoRA (adapter autocast) with Liger kernels, 3 steps
#   bash bench/gpu_runs.sh paths-auto OUT  # 2-GPU: tests/gpu/test_gpu_speed_paths.py, llama-1b ZeRO-3 with
#                                          # train.micro_batch_size=auto, Qwen2 ZeRO-2 raw vs Trainer speed
#   bash bench/gpu_runs.sh compile-fp8 OUT [STEPS]  # 1-GPU: tests/gpu/test_gpu_compile.py, and beside it on the same
#                                          # GPU the float8 vs bf16 A/B on real text (bench/fp8_ab.py, STEPS steps)
#   bash bench/gpu_runs.sh auto-fp8 OUT    # 1-GPU: llama-1b fp8 with train.micro_batch_size=auto (the probes compile),
#                                          # a bf16 run's float8 hint line, then tests/gpu/test_gpu_compile.py
set -uo pipefail
mode=$1 out=$2 cmdline="$*"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python bench/prebuild_ops.py > "$out/prebuild.log" 2>&1
# speed rows -> OUT/speed.json and OUT/speed.md, with this command and the GPU's name
tabulate() {
  python bench/speed.py table "$@" --json "$out/speed.json" --command "bash bench/gpu_runs.sh $cmdline" \
    --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee "$out/speed.md"
}
case $mode in
  compile-fp8)  # the A/B runs beside the tests: neither is timed, and one machine start serves both
    ( python bench/fp8_ab.py make --work "$out/abwork" && \
      python bench/fp8_ab.py run --work "$out/abwork" --out "$out/ab" --steps "${3:-1000}" --together ) > "$out/ab.log" 2>&1 &
    TOOLKIT_BENCH_OUT="$out/gpu" timeout 480 python -m pytest -q tests/gpu/test_gpu_compile.py -p no:cacheprovider \
      > "$out/gputest.log" 2>&1; echo "gpu tests rc=$?"; tail -15 "$out/gputest.log"
    wait; echo "ab:"; tail -22 "$out/ab.log"
    exit 0 ;;
  auto-fp8)
    common="--ds ds_configs/zero2.json model.name=llama-1b data.seq_len=2048 train.path=raw train.export=false train.lr=1e-4"
    # shellcheck disable=SC2086
    t0=$SECONDS
    timeout 300 deepspeed --num_gpus 1 --master_port 29610 toolkit/train.py $common \
      data.num_samples=640 train.micro_batch_size=auto train.global_batch_size=32 train.max_steps=8 train.precision=fp8 \
      train.warmup_steps=1 train.run_dir="$out/auto-fp8" > "$out/auto-fp8.log" 2>&1; echo "auto rc=$? wall $((SECONDS - t0)) s"
    grep -E "micro_batch_size=auto|  micro|fp8:|torch.compile" "$out/auto-fp8.log"
    # shellcheck disable=SC2086
    timeout 150 deepspeed --num_gpus 1 --master_port 29620 toolkit/train.py $common data.num_samples=64 \
      train.micro_batch_size=16 train.max_steps=3 train.run_dir="$out/hint" > "$out/hint.log" 2>&1; echo "hint rc=$?"
    grep -E "fp8:|torch.compile|liger kernels" "$out/hint.log"
    TOOLKIT_BENCH_OUT="$out/gpu" timeout 330 python -m pytest -q tests/gpu/test_gpu_compile.py -p no:cacheprovider \
      > "$out/gputest.log" 2>&1; echo "gpu tests rc=$?"; tail -3 "$out/gputest.log"
    exit 0 ;;
  speed)
    python bench/speed.py run --out "$out" "${@:3}" 2>&1 | tee "$out/speed.log"
    tabulate "$out"/*.json
    exit 0 ;;
  lanes)  # one speed.py run per argument, at once, each on the GPUs its --include names; ratios stay within a lane.
    # The lanes share the host's cores (CPU Adam in an offload lane slows the others): screening, not claims
    # (bench/results/speed.md). Keep OUT outside the device tool's $OUT and pack it into one file there.
    i=0
    for lane in "${@:3}"; do
      # shellcheck disable=SC2086  # a lane is a list of options
      python bench/speed.py run --out "$out/lane$i" --port $((29700 + 50 * i)) $lane > "$out/lane$i.log" 2>&1 &
      i=$((i + 1))
    done
    wait
    tabulate "$out"/lane*/*.json
    exit 0 ;;
  paths-auto)  # each part bounded, so one slow part cannot take the others' results with it
    TOOLKIT_BENCH_OUT="$out" timeout 250 python -m pytest -q tests/gpu/test_gpu_speed_paths.py -p no:cacheprovider \
      > "$out/gputest.log" 2>&1; echo "gpu tests rc=$?"; tail -3 "$out/gputest.log"
    timeout 160 deepspeed --num_gpus 2 --master_port 29610 toolkit/train.py --ds ds_configs/zero3.json model.name=llama-1b \
      data.seq_len=2048 data.num_samples=640 train.micro_batch_size=auto train.global_batch_size=32 train.max_steps=20 \
      train.path=raw train.precision=bf16 train.export=false train.lr=1e-4 train.warmup_steps=1 \
      train.run_dir="$out/auto-z3" > "$out/auto-z3.log" 2>&1; echo "auto rc=$?"; grep "micro_batch_size=auto\|  micro" "$out/auto-z3.log"
    timeout 80 python bench/speed.py run --out "$out/qwen" --gpus 2 --only qwen2-0.5b-seq2048 --stages 2 \
      --variants raw,trainer --warmup 3 --steps 6 --port 29640 > "$out/qwen.log" 2>&1; echo "qwen rc=$?"; tail -2 "$out/qwen.log"
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
