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
  $PIP install -q "verl[vllm]==0.9.1"
else
  # torch must come first: without it pip resolves verl's transitive torch to a CUDA build.
  $PIP install -q "torch==2.13.0"
  echo "torch==2.13.0" > /tmp/seal-torch-pin.txt
  export PIP_CONSTRAINT="${PIP_CONSTRAINT:+$PIP_CONSTRAINT }/tmp/seal-torch-pin.txt"
fi
$PIP install -q -e ".[dev]"
$PIP install -q --no-deps "bfcl-eval==2026.3.23"
python -c "import bfcl_eval, verl, env_service, seal; print('seal install OK: verl', verl.__version__)"
