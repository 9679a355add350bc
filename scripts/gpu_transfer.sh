#!/usr/bin/env bash
# GPU tests of pinned.py / transfer.py and benchmarks/bench_transfer.py, in one go, on the lent
# GPU machine (or any CUDA box). Output (logs + JSON) goes under $OUT (default ./bench-out).
#   bash scripts/gpu_transfer.sh [extra bench_transfer.py args]
# kvikio travels as wheels in .whl/ (see docs/TRANSFER.md); the caller installs them first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PYTHONPATH
set -u
OUT=${OUT:-./bench-out}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$(pwd):${PYTHONPATH:-}"
{
  date -u; uname -r; nproc; free -g | head -2
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
  python3 -c 'import kvikio, kvikio.defaults as d; print("kvikio", kvikio.__version__, "compat", d.get("compat_mode"))' 2>&1 | tail -1
  ls /sys/module/nvidia_fs 2>/dev/null && echo "nvidia_fs loaded" || echo "no nvidia_fs (GDS compat mode)"
  df -h /tmp | tail -1
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)|L3"
  cat /sys/kernel/mm/transparent_hugepage/enabled; grep -E "FileHugePages|AnonHugePages" /proc/meminfo
  python3 -c "from mmap_offload.native import library_status as s; print(\"native library mo_native:\", s(\"mo_native\"))"
} 2>&1 | tee "$OUT/env.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pinned.py tests/test_transfer.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -15
timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/bench_transfer.py --size-gib "${SIZE_GIB:-8}" \
  --cold-gib "${COLD_GIB:-3}" --out "$OUT/bench_transfer.json" "$@" 2>&1 | tee "$OUT/bench_transfer.log"
echo "exit ${PIPESTATUS[0]}"
