#!/usr/bin/env bash
# Launch train.py through torchrun, torchtitan style.
#   CONFIG_FILE=configs/debug.toml NGPU=4 LOG_RANK=0,1 ./run_train.sh --training.steps 40 [--section.key value ...]
# NGPU: processes on this node (GPUs; on a machine without CUDA they run on the CPU with gloo).
# LOG_RANK: comma-separated ranks whose output is shown (default 0).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
NGPU=${NGPU:-1}
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-"./configs/debug.toml"}
PYTHON=${PYTHON:-python3}
if [ "${NGPU}" = "1" ] && [ -z "${FORCE_TORCHRUN:-}" ]; then
  # One process needs no rendezvous: start it directly (same behaviour, faster start).
  exec "${PYTHON}" train.py --job.config_file "${CONFIG_FILE}" "$@"
fi
# Several processes on a CPU-only machine share its cores: one thread each keeps them from oversubscribing.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Validate the job for NGPU processes first: a config error is printed once, before any worker starts (and
# without torchrun's failure report). SKIP_CONFIG_CHECK=1 saves the few seconds this takes.
if [ -z "${SKIP_CONFIG_CHECK:-}" ]; then
  "${PYTHON}" -m configs.checks --world_size "${NGPU}" --job.config_file "${CONFIG_FILE}" "$@" || exit $?
fi
exec "${PYTHON}" -m torch.distributed.run --nproc_per_node="${NGPU}" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "${LOG_RANK}" --role rank --tee 3 \
  train.py --job.config_file "${CONFIG_FILE}" "$@"
