#!/usr/bin/env bash
# One command on the GPU machine: the GPU kernel tests, the MoE benchmark against UVA, and the user's
# OOM reproduced at the largest scale the time allows. Everything lands under $OUT (at most 8 files):
#   run.log  results.json  results.md  tokens_per_s.png  memory.png  bytes_per_step.png  oom.json
#
#   OUT=bench-out bash scripts/gpu_bench.sh            # from the repository root
#
# Knobs (environment): PYTHON (python3), WORK (/tmp/mmo-bench: checkpoints + caches, deleted at the end),
# BENCH_ARGS (extra bench_moe.py arguments), BENCH_DEADLINE (s, 130), OOM_MIB (expert MiB of the OOM repro,
# 2048), SKIP_TESTS / SKIP_BENCH / SKIP_OOM (=1). Wheels in .whl/ (kvikio for the kvikio variant) are
# installed into /tmp/site first when present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
WORK=${WORK:-/tmp/mmo-bench}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
LOG="$OUT/run.log"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  df -h "$WORK" | tail -1; getconf _NPROCESSORS_ONLN; free -g | head -2
  head -3 /proc/self/cgroup; ls /sys/fs/cgroup | head -5
} >>"$LOG" 2>&1
rc=0
t0=$SECONDS
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== gpu tests" | tee -a "$LOG"
  timeout 90 "$PY" -m pytest tests/test_moe_kernel.py -q -m gpu -p no:cacheprovider 2>&1 | tail -15 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "tests: $((SECONDS - t0)) s" | tee -a "$LOG"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== bench_moe" | tee -a "$LOG"
  timeout $(( ${BENCH_DEADLINE:-130} + 60 )) "$PY" benchmarks/bench_moe.py --out "$OUT" --workdir "$WORK/bench" \
    --deadline "${BENCH_DEADLINE:-130}" ${BENCH_ARGS:-} >>"$LOG" 2>&1 || rc=1
  grep -A20 "^| bar" "$OUT/results.md" 2>/dev/null | tee -a /dev/stderr >/dev/null
  rm -rf "$WORK/bench"
  echo "bench: $((SECONDS - t0)) s" | tee -a "$LOG"
fi
if [ "${SKIP_OOM:-0}" != 1 ]; then
  echo "== oom_repro" | tee -a "$LOG"
  timeout 120 "$PY" benchmarks/oom_repro.py --expert-mib "${OOM_MIB:-2048}" --device cuda --warmup-device cuda \
    --workdir "$WORK/oom" --json "$OUT/oom.json" --timeout 90 2>&1 | tail -4 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  rm -rf "$WORK/oom"
  echo "oom: $((SECONDS - t0)) s" | tee -a "$LOG"
fi
exit $rc
