#!/usr/bin/env bash
# Issue 50's device rows on one host of 2 GPUs, from the repo root (carry .whl; kind nvidia-h100-x2 or nvidia-h200-x2):
#   bash bench/speed_model_rows.sh OUT PART      PART: 1 (attention rates + the unfitted shapes; runs past one 600 s command: give it two), rest (what
#   part 1 left), 2 or 3 (ZeRO-3 leaves), x4a then x4b (one host of 4 GPUs, kind nvidia-h100-x4: two commands),
#   s57 (2 H200s: DPO on both GPUs, then GPT-2 and Qwen2.5-3B rows beside LoRA DPO rows), s58a..s58d GPU_MEM
#   (2 GPUs: GPT-2 with accumulation, llama-1b ZeRO-2; GPT-2 profiled, leaves with checkpointing on 2; the 262K row;
#   the anatomy of the leaves' peak, GPT-2 alone)
# Part 1, each GPU its own queue: GPU 0 the attention kernel rates (bench/attention.py --rates) then its share of
# the validation rows (bench/plan_calibrate.py VALIDATE), GPU 1 the rest; the 262K rows with 2 steps, the others 4.
# Part 2: llama-1b at ZeRO-3 with train.zero3_leaves=false/true (LEAVES), one-GPU rows on both GPUs, then on two.
# Results: OUT/rates.json, OUT/{g0,g1,g0s,g1s,leaves1a,leaves1b,leaves2}/calibration.{json,md}.
set -uo pipefail
out=$1
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cal() { python bench/plan_calibrate.py run --lanes 1 --host-mem 120 --timeout 400 "$@"; }
if [ "$2" = 1 ]; then
  ( python bench/attention.py --rates --out "$out/rates.json" > "$out/rates.log" 2>&1
    cal --out "$out/g0" --device 0 --port 29610 --steps 2 --only v-q15-z0-256k
    cal --out "$out/g0s" --device 0 --port 29630 --steps 4 \
      --only v-q15-z2-s4096-m4,v-q15-z3-s4096-m4,v-q15-z0-s2048-m8,v-q3-z2-s4096-m2,v-q3-z3-s8192-m1,v-m7l8-z2-s2048-m4
  ) > "$out/g0.log" 2>&1 &
  ( cal --out "$out/g1" --device 1 --port 29710 --steps 2 --only v-q15-z3all-256k,v-q15-z2-32k,v-q3-z3-64k,v-m7l8-z2-32k
    cal --out "$out/g1s" --device 1 --port 29730 --steps 4 \
      --only v-q15-z2opt-s4096-m4,v-m7l8-z3-s4096-m2,v-m7l8-z3opt-s2048-m4
  ) > "$out/g1.log" 2>&1 &
  wait
elif [ "$2" = rest ]; then  # the VALIDATE rows call 1 never started (it ran past 600 s), one queue per GPU
  cal --out "$out/r0" --device 0 --port 29610 --steps 4 \
    --only v-q3-z2-s4096-m2,v-q3-z3-s8192-m1,v-m7l8-z2-s2048-m4 > "$out/r0.log" 2>&1 &
  cal --out "$out/r1" --device 1 --port 29710 --steps 4 \
    --only v-m7l8-z3-s4096-m2,v-m7l8-z3opt-s2048-m4,v-q15-z2opt-s4096-m4 > "$out/r1.log" 2>&1 &
  wait
  cal --out "$out/r2" --device 0 --port 29630 --steps 2 --only v-m7l8-z2-32k > "$out/r2.log" 2>&1
elif [ "$2" = x4a ]; then  # 4 one-GPU queues: leaves on this card, Mistral-7B (8 layers), issue 47's rows
  python bench/prebuild_ops.py fused_adam cpu_adam > "$out/prebuild.log" 2>&1
  C="python bench/plan_calibrate.py run --lanes 1 --host-mem 120 --gpu-mem 79"
  P="python bench/preference.py --tokenizer .pairs/tok --warmup 3 --steps 6 --max-length 2048 --micro 16
     --pairs .pairs/pairs_short.jsonl"
  ( timeout 300 $C --timeout 140 --out "$out/a0" --device 0 --port 29610 --steps 6 \
      --only lv-l-z3-s2048-m2-1gpu-false,lv-l-z3-s2048-m2-1gpu-true,lv-l-z3-s2048-m8-ckpt-1gpu-true
    timeout 200 $P --model llama-1b --budget-s 100 --include localhost:0 --port 29500 \
      --sft-seq 3200 --sft-micro 2 --rows sft-z2,tk-pre-z2 --out "$out/sft" ) > "$out/a0.log" 2>&1 &
  timeout 450 $C --timeout 300 --out "$out/a1" --device 1 --port 29710 --steps 4 \
    --only v-m7l8-z2-s2048-m4,v-m7l8-z3-s4096-m2 > "$out/a1.log" 2>&1 &
  ( timeout 250 $C --timeout 240 --out "$out/a2" --device 2 --port 29810 --steps 4 --only v-m7l8-z3opt-s2048-m4
    timeout 230 $C --timeout 220 --out "$out/a2l" --device 2 --port 29830 --steps 2 --only v-m7l8-z2-32k
  ) > "$out/a2.log" 2>&1 &
  ( timeout 260 $P --model llama-3-8b --gpu-mem 79 --budget-s 60 --include localhost:3 \
      --port 29600 --syn-seq 1024 --syn-micro 4 --rows tk-syn-lora-z2 --out "$out/lora8b"
    timeout 220 $P --model llama-1b --budget-s 120 --include localhost:3 --port 29800 \
      --rows tk-lora-z2,trl-lora-z2 --out "$out/lora" ) > "$out/a3.log" 2>&1 &
  wait
elif [ "$2" = x4b ]; then  # two GPUs (leaves rows; DPO against TRL on the other two), then all four
  ( timeout 250 python bench/plan_calibrate.py run --gpu-mem 79 --out "$out/b2" --port 29650 --steps 6 --timeout 120 \
      --host-mem 120 --only lv-l-z3-s2048-m2-2gpu-false,lv-l-z3-s2048-m2-2gpu-true ) > "$out/b2.log" 2>&1 &
  timeout 250 python bench/preference.py --tokenizer .pairs/tok --warmup 3 --steps 6 --max-length 2048 \
    --pairs .pairs/pairs_short.jsonl --micro 16 --model llama-1b --budget-s 120 --gpus 2 --include localhost:2,3 \
    --port 29500 --rows tk-pre-leaves-z3,trl-z3 --out "$out/pref2" > "$out/pref2.log" 2>&1 &
  wait
  timeout 270 python bench/plan_calibrate.py run --gpu-mem 79 --out "$out/b4" --port 29750 --steps 6 --timeout 120 \
    --host-mem 120 --only lv-l-z3-s2048-m2-4gpu-false,lv-l-z3-s2048-m2-4gpu-true,lv-l-z3-s2048-m8-ckpt-4gpu-true \
    > "$out/b4.log" 2>&1
elif [ "$2" = s57 ]; then
  python bench/prebuild_ops.py fused_adam > "$out/prebuild.log" 2>&1
  C="python bench/plan_calibrate.py run --lanes 1 --host-mem 120 --gpu-mem 139"
  P="python bench/preference.py --tokenizer .pairs/tok --warmup 3 --steps 6 --max-length 2048 --micro 16
     --pairs .pairs/pairs_short.jsonl --model llama-1b"
  timeout 190 $P --gpus 2 --budget-s 90 --port 29500 --rows tk-pre-gc-leaves-z3,trl-z3 --out "$out/pref2" \
    > "$out/pref2.log" 2>&1
  timeout 330 $C --timeout 120 --out "$out/c0" --device 0 --port 29610 --steps 4 \
    --only v-g2-z2-s1024-m16,v-g2-z3-s1024-m16,v-g2-z0-s1024-m32,v-q3-z2-s4096-m2,v-q3-z3-s8192-m1 \
    > "$out/c0.log" 2>&1 &
  ( timeout 320 $P --budget-s 200 --include localhost:1 --port 29800 \
      --rows tk-lora-gc-z2,trl-lora-z2,tk-syn-pre-z2 --out "$out/lora" ) > "$out/c1.log" 2>&1 &
  wait
elif [ "$2" = s58a ]; then  # 2 GPUs: GPT-2 alone on GPU 0 (with accumulation, then profiled), llama-1b ZeRO-2 on GPU 1
  python bench/prebuild_ops.py fused_adam cpu_adam > "$out/prebuild.log" 2>&1
  C="python bench/plan_calibrate.py run --lanes 1 --host-mem 120 --gpu-mem $3"
  ( timeout 330 $C --timeout 90 --out "$out/g2" --device 0 --port 29610 --steps 6 \
      --only v-g2-z2-s1024-m16,v-g2-z2-s1024-m16-a4,v-g2-z0-s1024-m32,v-g2-z0-s1024-m32-a2,v-g2-z3-s1024-m16
    timeout 150 $C --timeout 70 --out "$out/g2prof" --device 0 --port 29630 --steps 6 \
      --set 'train.profile_steps=[4,5]' --only v-g2-z2-s1024-m16,v-g2-z0-s1024-m32 ) > "$out/g0.log" 2>&1 &
  timeout 300 $C --timeout 140 --out "$out/l2" --device 1 --port 29710 --steps 5 \
    --only v-l-z2-s2048-m8,v-l-z2-s2048-m8-a4 > "$out/g1.log" 2>&1 &
  wait
elif [ "$2" = s58b ]; then  # GPT-2 profiled (train.profile_steps), then leaves with checkpointing on 2 GPUs
  python bench/prebuild_ops.py fused_adam > "$out/prebuild.log" 2>&1
  C="python bench/plan_calibrate.py run --host-mem 120 --gpu-mem $3"
  timeout 150 $C --lanes 1 --timeout 70 --out "$out/prof" --device 0 --port 29630 --steps 6 \
    --set 'train.profile_steps=[4,5]' --only v-g2-z2-s1024-m16,v-g2-z0-s1024-m32 > "$out/prof.log" 2>&1
  timeout 150 $C --timeout 130 --out "$out/lv2" --port 29650 --steps 6 --only lv-l-z3-s2048-m8-ckpt-2gpu-true \
    > "$out/lv2.log" 2>&1
elif [ "$2" = s58c ]; then  # the 262K offload row as leaf modules (today's default for it), one GPU
  timeout 380 python bench/plan_calibrate.py run --lanes 1 --host-mem 120 --gpu-mem "$3" --timeout 360 \
    --out "$out/q256" --device 0 --port 29670 --steps 2 --only v-q15-z3all-256k-leaves > "$out/q256.log" 2>&1
elif [ "$2" = s58d ]; then  # what is alive at the peak of leaves with checkpointing (2 GPUs), then GPT-2 alone
  python bench/prebuild_ops.py fused_adam > "$out/prebuild.log" 2>&1
  python -c "
import sys, json; sys.path.insert(0, 'bench'); import plan_calibrate as pc
c = next(c for c in pc.LEAVES if c.name == 'lv-l-z3-s2048-m8-ckpt-2gpu-true')
json.dump(pc.ds_config_for(c.choice()), open('$out/ds.json', 'w'))"
  # no Python stacks: torch's tracer breaks checkpointing's recompute ("apply returned NULL"), as with TiledMLP
  PEAK_ANATOMY_STACKS=0 timeout 200 deepspeed --master_port 29660 --num_gpus 2 bench/peak_anatomy.py \
    "$out/anatomy-leaves-ckpt-2gpu.json" --ds "$out/ds.json" model.name=llama-1b data.seq_len=2048 data.num_samples=64 \
    train.micro_batch_size=8 train.grad_accum=1 train.max_steps=3 train.path=raw train.export=false \
    train.warmup_steps=1 memory.every=1 metrics.tensorboard=false train.zero_sizes=speed \
    model.gradient_checkpointing=true model.liger=true train.zero3_leaves=true train.compile=off \
    train.run_dir="$out/anatomy-run" > "$out/anatomy.log" 2>&1
  timeout 240 python bench/plan_calibrate.py run --lanes 1 --host-mem 120 --gpu-mem "$3" --timeout 70 \
    --out "$out/g2solo" --device 0 --port 29610 --steps 6 \
    --only v-g2-z2-s1024-m16,v-g2-z0-s1024-m32,v-g2-z0-s1024-m32-a2,v-g2-z2-s1024-m16-a4 > "$out/g2solo.log" 2>&1
elif [ "$2" = s58e ]; then  # run at 841eae4 (the leaf-release experiment, reverted after): leaves on 2 GPUs again
  python bench/prebuild_ops.py fused_adam > "$out/prebuild.log" 2>&1
  timeout 280 python bench/plan_calibrate.py run --host-mem 120 --gpu-mem "$3" --timeout 120 --out "$out/fix" \
    --port 29650 --steps 6 --only lv-l-z3-s2048-m8-ckpt-2gpu-true,lv-l-z3-s2048-m2-2gpu-true > "$out/fix.log" 2>&1
elif [ "$2" = 2 ]; then
  cal --out "$out/leaves1a" --device 0 --port 29610 --steps 6 \
    --only lv-l-z3-s2048-m2-1gpu-false,lv-l-z3-s2048-m2-1gpu-true > "$out/leaves1a.log" 2>&1 &
  cal --out "$out/leaves1b" --device 1 --port 29710 --steps 6 \
    --only lv-l-z3-s2048-m8-ckpt-1gpu-false,lv-l-z3-s2048-m8-ckpt-1gpu-true > "$out/leaves1b.log" 2>&1 &
  wait
  python bench/plan_calibrate.py run --out "$out/leaves2" --port 29650 --steps 6 --timeout 300 --host-mem 120 \
    --only lv-l-z3-s2048-m2-2gpu-false,lv-l-z3-s2048-m2-2gpu-true,lv-l-z3-s2048-m8-ckpt-2gpu-false,lv-l-z3-s2048-m8-ckpt-2gpu-true \
    > "$out/leaves2.log" 2>&1
else  # 3: ZeRO-3 leaves, then short DPO pairs at ZeRO-3 (issue 47) on GPU 1 meanwhile; the 2-GPU rows after
  ( cal --out "$out/leaves1a" --device 0 --port 29610 --steps 6 \
      --only lv-l-z3-s2048-m2-1gpu-false,lv-l-z3-s2048-m2-1gpu-true,lv-q15-z3-s4096-m4-1gpu-true
    cal --out "$out/leaves1b" --device 0 --port 29630 --steps 6 \
      --only lv-l-z3-s2048-m8-ckpt-1gpu-false,lv-l-z3-s2048-m8-ckpt-1gpu-true ) > "$out/leaves1.log" 2>&1 &
  python bench/preference.py --tokenizer .pairs/tok --model llama-1b --warmup 3 --steps 6 --max-length 2048 \
    --budget-s 280 --pairs .pairs/pairs_short.jsonl --micro 16 --include localhost:1 --port 29700 \
    --rows tk-pre-gc-leaves-z3,trl-z3,tk-pre-leaves-z3,tk-pre-gc-z3 --out "$out/pref" > "$out/pref.log" 2>&1 &
  wait
  timeout 200 python bench/plan_calibrate.py run --out "$out/leaves2" --port 29650 --steps 6 --timeout 100 \
    --host-mem 120 --only lv-l-z3-s2048-m2-2gpu-false,lv-l-z3-s2048-m2-2gpu-true > "$out/leaves2.log" 2>&1
fi
