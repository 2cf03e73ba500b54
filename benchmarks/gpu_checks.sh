#!/usr/bin/env bash
# On a GPU machine: the GPU tests, then the debug and 370M configs for 20 steps each (plus 370M variants).
#   bash .gpu/setup.sh && OUT=/path bash benchmarks/gpu_checks.sh [pytest paths...]   (default: tests/gpu)
# Results (logs, metrics.jsonl) go to ${OUT:-./outputs/gpu_checks}.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-./outputs/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -rs "${@:-tests/gpu}" 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
train() {  # train NAME CONFIG [overrides...]
  local name=$1 cfg=$2; shift 2
  local t0=$SECONDS
  timeout 300 python3 train.py --job.config_file "configs/$cfg.toml" --training.steps 20 --metrics.log_freq 1 \
    --checkpoint.enable false --job.dump_folder "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? $((SECONDS - t0))s"; grep -E "^step +(1|10|20) " "$OUT/$name.log" || tail -15 "$OUT/$name.log"
}
train debug debug
train 370m mamba2_370m --training.local_batch_size 8 --training.seq_len 2048
train 370m_chunked_loss mamba2_370m --training.local_batch_size 8 --training.seq_len 2048 --training.loss_chunk_tokens 4096
train 370m_compile mamba2_370m --training.local_batch_size 8 --training.seq_len 2048 --compile.enable true
python3 benchmarks/compare_runs.py --rtol 1 --ref "$OUT/370m" "$OUT/370m_chunked_loss" "$OUT/370m_compile" "$OUT/debug"
