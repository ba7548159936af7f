#!/usr/bin/env bash
# Real data against synthetic rows on one GPU (the device tool), from the repo root:
#   bash bench/real_data.sh OUT STAGE "speed.py run options" ["more options" ...]
# STAGE kernels: corpora made (bench/data_cache.py make: data100k, docs), attention kernels alone
#                (bench/attention.py), tests/gpu/test_gpu_varlen.py, then the speed rows in the options;
# STAGE test:    corpora made, tests/gpu/test_gpu_varlen.py, then the speed rows;
# STAGE rows:    only the speed rows (the corpora made first where /tmp/dc lacks them);
# STAGE synthetic: only the speed rows, of synthetic workloads (no corpora made);
# STAGE experts: one MoE layer's experts paths alone (bench/experts.py -> OUT/experts.json), then the speed rows
#                (synthetic workloads only: no corpora made).
# Each quoted group is one `bench/speed.py run` (its own workloads and variants), in order, until
# ROWS_BUDGET_S seconds (default 520) are spent. Speed rows go to OUT/speed.json + OUT/speed.md (bench/speed.py table, this command, the GPU's name);
# logs and per-row JSON to OUT/logs.tgz.
set -uo pipefail
out=$1 stage=$2
shift 2
cmdline="bash bench/real_data.sh OUT $stage$(printf ' "%s"' "$@")"
work=/tmp/dc
mkdir -p "$out/s"
export PYTHONUNBUFFERED=1
if [ "$stage" = kernels ] || [ "$stage" = test ]; then
  python bench/prebuild_ops.py fused_adam > "$out/s/prebuild.log" 2>&1 &
  python bench/data_cache.py make --work "$work" --files "${MAKE_FILES:-data100k,docs}" > "$out/s/make.log" 2>&1 &
  [ "$stage" = test ] || python bench/attention.py --out "$out/attention.json" > "$out/s/attention.log" 2>&1
  python -m pytest -q -x tests/gpu/test_gpu_varlen.py > "$out/s/gpu_test.log" 2>&1; echo "gpu test rc=$?" >> "$out/s/gpu_test.log"
  tail -3 "$out/s/gpu_test.log"
  wait
elif [ "$stage" = synthetic ]; then  # synthetic rows only: FusedAdam built first, no corpora
  python bench/prebuild_ops.py fused_adam > "$out/s/prebuild.log" 2>&1
elif [ "$stage" = experts ]; then
  python bench/prebuild_ops.py fused_adam > "$out/s/prebuild.log" 2>&1 &
  timeout --kill-after=10 "${EXPERTS_BUDGET_S:-150}" python bench/experts.py --out "$out/experts.json" \
    > "$out/s/experts.log" 2>&1; echo "experts rc=$?" >> "$out/s/experts.log"
  tail -8 "$out/s/experts.log"
  wait
elif [ ! -f "$work/docs.jsonl" ]; then  # a fresh machine: the corpora and FusedAdam first
  python bench/prebuild_ops.py fused_adam > "$out/s/prebuild.log" 2>&1 &
  python bench/data_cache.py make --work "$work" --files data100k,docs > "$out/s/make.log" 2>&1
  wait
fi
# stop the rows in time for the table and the archive (one device command runs 600 s at most)
deadline=$((SECONDS + ${ROWS_BUDGET_S:-520})) i=0
for group in "$@"; do
  left=$((deadline - SECONDS))
  [ "$left" -gt 30 ] || { echo "out of time before: $group" | tee -a "$out/s/run.log"; continue; }
  # shellcheck disable=SC2086  # a group is several options
  timeout --kill-after=10 "$left" python bench/speed.py run --gpus 1 --out "$out/s" --data-dir "$work" \
    --port $((29700 + 40 * i)) $group 2>&1 | tee -a "$out/s/run.log"
  i=$((i + 1))
done
python bench/speed.py table "$out"/s/*.json --json "$out/speed.json" --command "$cmdline" \
  --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" > "$out/speed.md"
cat "$out/speed.md"
tar czf "$out/logs.tgz" --exclude='*.pt' --exclude='checkpoints' -C "$out" s 2>/dev/null
rm -rf "$out/s"
