#!/usr/bin/env bash
# On a GPU machine: kernel-vs-reference tests, then the debug and 370M configs for 20 steps each.
# Results (logs, metrics.jsonl) go to ${OUT:-./outputs/gpu_checks}.
#   bash .gpu/setup.sh && bash benchmarks/gpu_checks.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-./outputs/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q tests/gpu -x -rs 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
for cfg in debug mamba2_370m; do
  python3 train.py --job.config_file configs/$cfg.toml --training.steps 20 --metrics.log_freq 5 \
    --checkpoint.enable false --job.dump_folder "$OUT/$cfg" "$@" 2>&1 | tail -8 | tee "$OUT/train_$cfg.log"
done
