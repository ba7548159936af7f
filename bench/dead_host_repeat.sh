#!/usr/bin/env bash
# The dead-host fault tests again and again under load (issue 33): the kill and the cut case of
# tests/dist/test_multinode_faults.py in turn, with a CPU burner beside them, one line per run into LOG.
#   bash bench/dead_host_repeat.sh SECONDS LOG     (root: the tests make hosts in Linux namespaces)
# A failed run's whole log is kept beside LOG as LOG.fail-CASE-N.
set -u
cd "$(dirname "$0")/.."
budget=${1:-3000} out=${2:-/tmp/dead_host_repeat.log}
: > "$out"
python3 -c "
while True:
    sum(i * i for i in range(10**6))
" &
burner=$!
trap 'kill $burner 2>/dev/null' EXIT
end=$(( $(date +%s) + budget ))
i=0
while [ "$(date +%s)" -lt "$end" ]; do
  i=$((i + 1))
  for case in kill cut; do
    t0=$(date +%s)
    if timeout 400 python -m pytest -q -s -p no:cacheprovider \
        "tests/dist/test_multinode_faults.py::test_a_dead_host_ends_the_job_on_every_host_within_60s[$case]" \
        > "$out.last" 2>&1; then r=pass; else r=FAIL; cp "$out.last" "$out.fail-$case-$i"; fi
    echo "$i $case $r $(( $(date +%s) - t0 ))s $(grep -o 'every process of the job gone [0-9.]* s' "$out.last" | head -1)" >> "$out"
  done
done
