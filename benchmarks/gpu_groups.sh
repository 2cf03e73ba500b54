#!/usr/bin/env bash
# Run several benchmark commands side by side, each on its own GPUs of one host, then bundle their small results.
#   bash .gpu/setup.sh && OUT=$OUT RUNS=/tmp/runs bash benchmarks/gpu_groups.sh \
#     "0,1,2,3|bash benchmarks/multi_gpu.sh ddp units" "4,5|bash benchmarks/multi_gpu.sh pp370m bubble"
# Every group sees only its GPUs (CUDA_VISIBLE_DEVICES) and writes under RUNS (multi_gpu.sh's OUT); torchrun picks a
# free port, so groups do not collide. Host-bound runs share the host's cores: compare figures taken side by side
# with care (docs/performance.md says which were). Stdout: each group's log. $OUT/results.tar.gz: every
# metrics.jsonl, compare table (*.json) and log tail under RUNS. GROUP_TIMEOUT (s, default 560) bounds each group.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUNS=${RUNS:-/tmp/gpu_groups}; OUT=${OUT:-$RUNS}
mkdir -p "$RUNS" "$OUT"
i=0
for group in "$@"; do
  gpus=${group%%|*}; cmd=${group#*|}; i=$((i + 1))
  ( export CUDA_VISIBLE_DEVICES=$gpus OUT=$RUNS; t0=$SECONDS
    timeout "${GROUP_TIMEOUT:-560}" bash -c "$cmd"; echo "[group $i rc=$? $((SECONDS - t0))s]" ) > "$RUNS/group$i.log" 2>&1 &
done
wait
for ((g = 1; g <= i; g++)); do echo "##### group $g: ${!g}"; grep -v -i "warn" "$RUNS/group$g.log" | tail -60; done
cd "$RUNS" && find . \( -name '*.log' -not -name 'group*.log' \) -o -name log.txt | while read -r f; do tail -40 "$f" > "$f.tail"; done
find . \( -name metrics.jsonl -o -name '*.json' -o -name '*.jsonl' -o -name '*.tail' -o -name 'group*.log' \) \
  -not -path '*/checkpoint/*' -not -path '*profile_trace*' -size -20M | tar czf "$OUT/results.tar.gz" -T -
