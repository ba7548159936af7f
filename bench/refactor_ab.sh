#!/usr/bin/env bash
# One committed speed row, run with the code before a refactor and with the working tree, in one device call,
# on the same GPU, in alternating order (old, new, old, new), so that the ratio new/old says whether the
# refactor changed the speed. The row (default): llama-1b, seq 2048, ZeRO-2, 1 GPU, bf16, synthetic rows,
# the toolkit's raw path at micro 16 x 2 (real_data.md / speed.md: 65.8k tokens/s, run s33, commit 6d11036).
#
# Here, once (no GPU): the pre-refactor tree into .baseline/ (ignored through .git/info/exclude):
#   bash bench/refactor_ab.sh prepare [REF]          # REF: a commit (default f6c834c) or a directory
# On the GPU machine (device tool, carry [".whl", ".baseline"]; .whl from ../shared/device/wheels.sh):
#   source .whl/setup.sh > /dev/null 2>&1; bash bench/refactor_ab.sh run $OUT
# Writes OUT/refactor_ab.json (tokens/s of every run, each arm's median, new/old), OUT/refactor_ab.md (the table),
# OUT/ab.log (this script's output) and OUT/logs.tgz (each run's launcher log, metrics.jsonl, row JSON).
#
# Both arms run their own tree's bench/speed.py (identical at f6c834c), so `toolkit/train.py` and `ds_configs/`
# resolve inside that tree, with PYTHONPATH pointing at that tree alone. Environment (all optional):
#   AB_ORDER="old new old new"  the runs, in order; AB_NEW=DIR the "new" tree (default: the working tree;
#   AB_NEW=.baseline gives an A/A check of the method); AB_ONLY=llama-1b-seq2048 AB_STAGES=2 AB_VARIANT=raw;
#   AB_WARMUP=3 AB_STEPS=10 (tokens/s: median over the steps after the warm-up); AB_TIMEOUT=150 s per run;
#   AB_BUDGET_S=500 (no run starts with less than AB_TIMEOUT s of it left); AB_GPUS=1.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
mode=${1:-}

if [ "$mode" = prepare ]; then
  ref=${2:-f6c834c}
  rm -rf .baseline && mkdir -p .baseline
  if [ -d "$ref" ]; then  # a checkout of the old code (e.g. a git worktree)
    (cd "$ref" && tar cf - --exclude=__pycache__ --exclude=bench/results toolkit ds_configs bench launch.sh pyproject.toml) \
      | tar xf - -C .baseline
    (cd "$ref" && git rev-parse HEAD 2>/dev/null || echo "$ref") > .baseline/REF
  else
    git archive "$ref" toolkit ds_configs bench launch.sh pyproject.toml | tar xf - -C .baseline --exclude=bench/results
    git rev-parse "$ref" > .baseline/REF
  fi
  ex=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$ex")"
  grep -qxF '/.baseline/' "$ex" 2>/dev/null || echo '/.baseline/' >> "$ex"
  git check-ignore -q .baseline || { echo "error: .baseline/ is not ignored" >&2; exit 1; }
  echo ".baseline/ = $(cat .baseline/REF) ($(du -sh .baseline | cut -f1)); carry it: [\".whl\", \".baseline\"]"
  exit 0
fi
[ "$mode" = run ] || { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

out=${2:?usage: bash bench/refactor_ab.sh run OUT}
mkdir -p "$out"
exec > >(tee -a "$out/ab.log") 2>&1
old=$root/.baseline
new=$(cd "${AB_NEW:-.}" && pwd)
[ -f "$old/toolkit/train.py" ] || { echo "error: no .baseline/ (bash bench/refactor_ab.sh prepare; carry .baseline)"; exit 1; }
order=${AB_ORDER:-old new old new}
only=${AB_ONLY:-llama-1b-seq2048} stages=${AB_STAGES:-2} variant=${AB_VARIANT:-raw}
warmup=${AB_WARMUP:-3} steps=${AB_STEPS:-10} per_run=${AB_TIMEOUT:-150} gpus=${AB_GPUS:-1}
deadline=$((SECONDS + ${AB_BUDGET_S:-500}))
export PYTHONUNBUFFERED=1
# The image's TORCH_CUDA_ARCH_LIST=9.0a breaks DeepSpeed 0.19.8's op builder (int('0a')). bench/speed.py and the
# toolkit fix it too; fixed here first so that the prebuild and both arms build and share one FusedAdam.
if [[ ${TORCH_CUDA_ARCH_LIST:-} == *a ]]; then
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST -> ${TORCH_CUDA_ARCH_LIST%a}"
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST%a}
fi
site=/tmp/site  # .whl/setup.sh's install target; each arm sees it and its own tree, nothing else of ours
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "gpu: ${gpu:-none}; old: $(cat "$old/REF" 2>/dev/null); new: $new; order: $order; $only z$stages $variant, warmup $warmup, steps $steps"

# FusedAdam once, outside the timed runs (old tree's prepare_env: the same fix as above)
t0=$SECONDS
PYTHONPATH=$site:$old python "$old/bench/prebuild_ops.py" fused_adam > "$out/prebuild.log" 2>&1
echo "prebuild rc=$? in $((SECONDS - t0)) s: $(tail -1 "$out/prebuild.log")"

work=/tmp/refactor_ab
rm -rf "$work" && mkdir -p "$work"
i=0
for arm in $order; do
  i=$((i + 1))
  case $arm in old) tree=$old ;; new) tree=$new ;; *) echo "unknown arm $arm"; continue ;; esac
  left=$((deadline - SECONDS))
  [ "$left" -ge "$per_run" ] || { echo "run $i ($arm): skipped, $left s of the budget left"; continue; }
  t0=$SECONDS
  PYTHONPATH=$site:$tree timeout --kill-after=10 $((per_run + 30)) python "$tree/bench/speed.py" run --gpus "$gpus" \
    --out "$work/$i-$arm" --only "$only" --stages "$stages" --variants "$variant" --warmup "$warmup" --steps "$steps" \
    --timeout "$per_run" --port $((29500 + 10 * i))
  echo "run $i ($arm): rc=$? in $((SECONDS - t0)) s"
done

python - "$work" "$out" "$warmup" "$old" "$new" "$order" "$gpu" <<'EOF'
import hashlib, json, statistics, sys
from pathlib import Path

work, out, warmup, old, new, order, gpu = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:]

def tree_hash(root):  # what code ran: the tree's toolkit/ sources
    h = hashlib.sha256()
    for f in sorted(Path(root, "toolkit").rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]

runs = []
for d in sorted(work.iterdir(), key=lambda p: int(p.name.split("-")[0])):
    i, arm = d.name.split("-", 1)
    spec = json.loads(next(d.glob("*.json")).read_text()) if list(d.glob("*.json")) else {}  # speed.py's row
    row = {"run": int(i), "arm": arm, "rc": spec.get("rc"), "wall_s": spec.get("wall_s")}
    metrics = sorted(d.glob("*/metrics.jsonl"))
    if not metrics:
        row["error"] = "no metrics.jsonl" + (f" ({spec['error']})" if spec.get("error") else "")
        runs.append(row)
        continue
    lines = [json.loads(x) for x in metrics[0].read_text().splitlines() if x.strip()]
    steps = [r for r in lines if r.get("tokens_per_s") is not None]  # eval lines carry no tokens_per_s
    timed = [r for r in steps if r["step"] > warmup]
    row |= {"steps_timed": len(timed),
            "tokens_per_s": [round(r["tokens_per_s"], 1) for r in timed],
            "step_time_s": [round(r["step_time_s"], 4) for r in timed],
            "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in timed), 1) if timed else None,
            "median_step_time_s": round(statistics.median(r["step_time_s"] for r in timed), 4) if timed else None,
            "loss_first_last": [steps[0].get("loss"), steps[-1].get("loss")] if steps else None,
            "micro_x_accum": f"{spec.get('micro_batch')} x {spec.get('grad_accum')}", "argv": spec.get("argv")}
    runs.append(row)

arms = {}
for arm in ("old", "new"):
    tps = [t for r in runs if r["arm"] == arm for t in r.get("tokens_per_s") or []]
    each = [r["median_tokens_per_s"] for r in runs if r["arm"] == arm and r.get("median_tokens_per_s")]
    arms[arm] = {"runs": len(each), "median_tokens_per_s": round(statistics.median(tps), 1) if tps else None,
                 "each_run": each, "spread": round(max(each) / min(each) - 1, 4) if len(each) > 1 else None}
o, n = arms["old"]["median_tokens_per_s"], arms["new"]["median_tokens_per_s"]
doc = {"gpu": gpu, "order": order, "warmup": warmup, "old_tree": old, "new_tree": new,
       "old_ref": (Path(old, "REF").read_text().strip() if Path(old, "REF").exists() else None),
       "old_toolkit_sha": tree_hash(old), "new_toolkit_sha": tree_hash(new),
       "committed": {"row": "llama-1b-seq2048 z2 1gpu raw 16 x 2 bf16 synthetic", "tokens_per_s": 65.8e3,
                     "where": "bench/results/real_data.md run s33 (6d11036, H100)"},
       "arms": arms, "new_over_old": round(n / o, 4) if o and n else None, "runs": runs}
(out / "refactor_ab.json").write_text(json.dumps(doc, indent=1) + "\n")
md = [f"A/B on {gpu or 'unknown GPU'}, order {order}; tokens/s per GPU, median of the steps after {warmup} warm-up.",
      f"old = {doc['old_ref']} (toolkit {doc['old_toolkit_sha']}), new = {new} (toolkit {doc['new_toolkit_sha']})", "",
      "| run | tree | rc | micro x accum | timed steps | tokens/s (median) | step s (median) | wall s |", "|---|---|---|---|---|---|---|---|"]
for r in runs:
    t = f"{r['median_tokens_per_s'] / 1000:.1f}k" if r.get("median_tokens_per_s") else r.get("error", "failed")
    md.append(f"| {r['run']} | {r['arm']} | {r.get('rc')} | {r.get('micro_x_accum', '')} | {r.get('steps_timed', 0)} | {t} | "
              f"{r.get('median_step_time_s') or ''} | {r.get('wall_s') or ''} |")
md += ["", "| tree | runs | tokens/s (pooled median) | each run | spread |", "|---|---|---|---|---|"]
for arm, a in arms.items():
    t = f"{a['median_tokens_per_s'] / 1000:.2f}k" if a["median_tokens_per_s"] else "none"
    spread = f"{100 * a['spread']:.2f}%" if a["spread"] is not None else ""
    md.append(f"| {arm} | {a['runs']} | {t} | {' / '.join(f'{x / 1000:.2f}' for x in a['each_run'])} | {spread} |")
md += ["", f"new / old: **{doc['new_over_old']}x**" if doc["new_over_old"] else "new / old: n/a"]
(out / "refactor_ab.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
EOF
tar czf "$out/logs.tgz" --exclude='*.pt' --exclude='checkpoints' --exclude='*.safetensors' -C "$work" . -C "$out" prebuild.log 2>/dev/null
rm -f "$out/prebuild.log"
