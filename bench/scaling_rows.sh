#!/usr/bin/env bash
# Scaling from one GPU to N (N = every GPU nvidia-smi lists) on one host, one device command, from the repo root:
#   PER_GPU=32 bash bench/scaling_rows.sh OUT WORKLOAD ROWS
#   ROWS: comma-separated STAGE:TUNE items, TUNE one of bench/speed.py's --tune levers or empty for the plain row,
#         e.g. 2:,3:,3:compile or 2:fp8,3:fp8
# Each row runs twice, raw path: on one GPU and on all N. The one-GPU rows run side by side, each on a GPU of its own
# (item i on GPU i mod N, in turn), then the N-GPU rows one after another; every row is its own launch of
# bench/speed.py run. PER_GPU=K (default 32): K sequences per GPU per optimizer step on 1 and on N GPUs (weak
# scaling: the same micro-batch and accumulation per GPU). A *-data100k workload trains on the 100k-row corpus
# (bench/data_cache.py make, built here first).
# -> OUT/speed.json, OUT/speed.md (rows), OUT/scaling.md (efficiency per row), OUT/logs.tgz (logs and, under
#    s/NAME/, one JSON per row: NAME = OUT's last part, the run name the tables show). Four files: the device tool
#    returns at most eight a call.
set -uo pipefail
out=$1 workload=$2 rows=$3
per_gpu=${PER_GPU:-32}
n=$(nvidia-smi -L | wc -l)
gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $n"
work=/tmp/dc
name=$(basename "$out")
rows_dir=$out/s/$name
mkdir -p "$rows_dir"
export PYTHONUNBUFFERED=1
arch=${TORCH_CUDA_ARCH_LIST:-}
[[ $arch != *a ]] || export TORCH_CUDA_ARCH_LIST=${arch%a}  # what speed.py passes its launches: one cached FusedAdam
python bench/prebuild_ops.py fused_adam > "$out/s/prebuild.log" 2>&1 &
data=()
if [[ $workload == *-data100k ]]; then
  python bench/data_cache.py make --work "$work" --files data100k > "$out/s/make.log" 2>&1
  data=(--data-dir "$work")
fi
wait
IFS=, read -r -a items <<< "$rows"

row_args() {  # STAGE:TUNE -> speed.py's options for that one row
  local stage=${1%%:*} tune=${1#*:}
  echo "--only $workload --stages $stage --variants raw --warmup 3 --steps 5 --timeout 200 --global-batch-per-gpu $per_gpu"\
       "${tune:+--tune $tune --tune-only}"
}

# one GPU: item i on GPU i mod n; a GPU's items one after another, the GPUs side by side
for ((g = 0; g < n && g < ${#items[@]}; g++)); do
  (
    for ((i = g; i < ${#items[@]}; i += n)); do
      # shellcheck disable=SC2046  # row_args is several options
      python bench/speed.py run --include "localhost:$g" --out "$rows_dir" --port $((29700 + 20 * i)) \
        "${data[@]}" $(row_args "${items[i]}") > "$out/s/one-$i.log" 2>&1
      tail -1 "$out/s/one-$i.log"
    done
  ) &
done
wait
for ((i = 0; i < ${#items[@]}; i++)); do
  # shellcheck disable=SC2046
  python bench/speed.py run --gpus "$n" --out "$rows_dir" --port $((29900 + 20 * i)) "${data[@]}" \
    $(row_args "${items[i]}") 2>&1 | tail -1
done
python bench/speed.py table "$rows_dir"/*.json --json "$out/speed.json" --gpu "$gpu" \
  --command "PER_GPU=$per_gpu bash bench/scaling_rows.sh OUT $workload $rows" > "$out/speed.md"
cat "$out/speed.md"
python bench/speed.py scaling "$out/speed.json" | tee "$out/scaling.md"
tar czf "$out/logs.tgz" --exclude='*.pt' --exclude='checkpoints' -C "$out" s 2>/dev/null
rm -rf "$out/s"
