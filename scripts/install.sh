#!/usr/bin/env bash
# Installs seal into the current Python environment (use a venv or conda env).
#   bash scripts/install.sh          # CPU path: CPU torch wheel, verl 0.9.1, tiny-model tooling (dev/CI)
#   bash scripts/install.sh gpu      # GPU path: verl[vllm]==0.9.1 resolves vLLM, CUDA torch, transformers
# bfcl-eval is installed WITHOUT its dependencies: they pin numpy 1.26 (verl needs numpy>=2) and pull
# API SDKs and sentence-transformers that the multi-turn backends never import.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-cpu}"
PIP="python -m pip"
$PIP install -q --upgrade pip
if [ "$target" = "gpu" ]; then
  # verl[vllm] resolves vLLM 0.24, torch 2.11 built with CUDA 13.0 (NVIDIA driver >= 580) and transformers 5.9,
  # but not flash-attn, which the GPU recipes' FSDP actor and reference need (attn_implementation:
  # flash_attention_2 with padding removal). verl's own `fsdp` extra pins flash-attn 2.8.3 and points its
  # installer at this prebuilt wheel for torch 2.11 + CUDA 13; the package index has only its source (a long nvcc build).
  $PIP install -q "verl[vllm]==0.9.1"
  echo "torch==2.11.0" > /tmp/seal-torch-pin.txt  # nothing below may swap the CUDA torch that vLLM was built for
  export PIP_CONSTRAINT="${PIP_CONSTRAINT:+$PIP_CONSTRAINT }/tmp/seal-torch-pin.txt"
  py="cp$(python -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
  wheels="https://github.com/mjun0812/flash-attention-prebuild-wheels/releases/download/v0.9.4"
  $PIP install -q "$wheels/flash_attn-2.8.3+cu130torch2.11-$py-$py-linux_x86_64.whl" \
    || { echo "no prebuilt flash-attn for $py: building it from source (needs nvcc; 20-30 min)"; \
         $PIP install -q --no-build-isolation "flash-attn==2.8.3"; }
  python -c "import flash_attn; print('flash-attn', flash_attn.__version__)"
else
  # torch must come first: without it pip resolves verl's transitive torch to a CUDA build.
  $PIP install -q "torch==2.13.0"
  echo "torch==2.13.0" > /tmp/seal-torch-pin.txt
  export PIP_CONSTRAINT="${PIP_CONSTRAINT:+$PIP_CONSTRAINT }/tmp/seal-torch-pin.txt"
fi
$PIP install -q -e ".[dev]"
$PIP install -q --no-deps "bfcl-eval==2026.3.23"
python -c "import bfcl_eval, verl, env_service, seal; print('seal install OK: verl', verl.__version__)"
