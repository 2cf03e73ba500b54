#!/usr/bin/env bash
# Installs what mambatitan needs into the current Python environment (use a venv if you like).
#   bash scripts/setup.sh           # torch (kept if 2.11-2.13 is already installed) + requirements.txt
# On a machine without CUDA this installs torch 2.13.0; on GPU machines install torch for your CUDA first.
# GPU kernels (mamba_ssm, causal_conv1d) are separate: see README "GPU kernels".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if ! "${PYTHON}" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if (2, 11) <= v <= (2, 13) else 1)' 2>/dev/null; then
  # An exact pin: a range admitting newer releases would pull several GB of CUDA packages.
  "${PYTHON}" -m pip install -q "torch==2.13.0"
fi
"${PYTHON}" -m pip install -q -r requirements.txt
"${PYTHON}" -c 'import torch, tokenizers, tensorboard, safetensors; print(f"setup ok: torch {torch.__version__}, cuda {torch.cuda.is_available()}")'
