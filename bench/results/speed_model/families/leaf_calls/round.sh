#!/bin/bash
# one round of the leaf-call rows, each its own launch, in the order given, from the repository root on the device:
#   bash bench/results/speed_model/families/leaf_calls/round.sh ROUND ROW...
# (writes $OUT/round_ROUND.json, the rows of bench/plan_calibrate.py, and $OUT/host_ROUND.txt: the host, the load and a
# probe of its speed before each launch)
source .whl/setup.sh >/dev/null 2>&1
export TORCH_CUDA_ARCH_LIST=9.0
r=$1; shift
mkdir -p /tmp/o "$OUT"
h=$OUT/host_$r.txt
{ date -u; nproc; lscpu | grep "Model name"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader; } > "$h"
probe() {  # the host's own speed: a Python loop and torch's CPU dispatcher, seconds
python - <<'PY'
import time, torch
x = torch.zeros(8)
t = time.perf_counter(); s = 0
for i in range(2_000_000): s += i
a = time.perf_counter() - t
t = time.perf_counter()
for _ in range(100_000): x.add_(1)
b = time.perf_counter() - t
print(f"probe python_loop_s {a:.3f} torch_add_s {b:.3f}")
PY
}
merge() {
python - "$r" <<'PY'
import json, glob, sys, os
r = sys.argv[1]
rows = []
meta = {}
for f in sorted(glob.glob(f"/tmp/o/{r}-*/calibration.json")):
    d = json.load(open(f)); rows += d["rows"]
    meta = {k: v for k, v in d.items() if k != "rows"}
json.dump({**meta, "round": r, "rows": rows}, open(os.path.join(os.environ["OUT"], f"round_{r}.json"), "w"), indent=1)
PY
}
start=$SECONDS
for row in "$@"; do
  [ $((SECONDS - start)) -gt 470 ] && { echo "skipped $row: out of time" >> "$h"; continue; }
  echo "== $row $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) $(probe)" >> "$h"
  timeout 230 python bench/plan_calibrate.py run --out /tmp/o/$r-$row --timeout 220 --steps 12 --only $row > /tmp/o/$r-$row.log 2>&1
  rc=$?; echo "rc $rc $(date -u +%T)" >> "$h"; [ $rc = 0 ] || tail -15 /tmp/o/$r-$row.log >> "$h"
  merge
done
python - "$OUT/round_$r.json" <<'PY'
import json, sys
for x in json.load(open(sys.argv[1]))["rows"]:
    m = x.get("measured") or {}
    print(x["config"]["name"], x["rc"], round(m.get("tokens_per_s_per_gpu") or 0), [round(t, 3) for t in m.get("step_times_s", [])])
PY
cat "$h"
