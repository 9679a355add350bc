#!/usr/bin/env bash
# Set up and run the main job on the embedded default: synthesise a small W4A16 MoE checkpoint (no
# download), warm the cache up (Marlin repack, checksums, atomic publish), verify it, serve it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/pip install -q --disable-pip-version-check -e . 2>&1 | grep -v "^WARNING: Location" || true
rm -rf "${DEMO_DIR:-mmap-offload-demo}"
exec .venv/bin/mmap-offload demo --workdir "${DEMO_DIR:-mmap-offload-demo}" "$@"
