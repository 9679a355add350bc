#!/usr/bin/env bash
# The real-vLLM GPU session (vLLM 0.26 from ../shared/vllm-gpu/ on the lent H200), from the checkout's root:
#
#   bash .vdev/device.sh unpack && . .vdev/env.sh && OUT=gpu-vllm-out bash scripts/gpu_vllm.sh
#
# Steps (STEPS, comma-separated, run in this order; default "tests,oom,bench"):
#   tests  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_vllm_gpu.py     limit TESTS_TIMEOUT (480 s)
#          (TP=2 left out unless TESTS_ARGS says otherwise: it has its own step; three children by
#          default, bf16, w4a16 and glm-w4a16 (GLM-4.5's layout); MMO_GPU_QUANTS=w4a16 runs one child
#          only; MMO_CHILD_HANG_S bounds each case, and
#          a W4A16 child alone on a fresh machine spends ~100 s of its first case compiling kernels)
#   tp2    the TP=2 test alone (two GPUs: nvidia-h200-x2), limit TP2_TIMEOUT (540 s); its cases (no
#          offload, then layer streaming, the expert cache and hybrid) each start vLLM at TP=2 (session 6:
#          > 180 s for the first, Triton JIT included), so it takes a device call of its own, or two:
#          MMO_TP2_CASES=mmap_hybrid (say) runs the reference and that case only; every process logs to
#          $OUT/vllm_gpu_tp2.log
#   launcher  the README's serving command on the GPU (tests/test_launcher_gpu.py: `mmap-offload vllm serve`,
#          its own processes, against the same server without offload)                limit LAUNCHER_TIMEOUT (420 s)
#   oom    python3 benchmarks/oom_repro.py --vllm --out $OUT $OOM_ARGS                limit OOM_DEADLINE (300 s)
#   bench  python3 benchmarks/bench_vllm.py --out $OUT --deadline $BENCH_DEADLINE     limit BENCH_DEADLINE (420 s)
# A device call lasts at most 10 minutes: run "tests,oom" in one call and "bench" in the next (the machine
# keeps /tmp/site, the Marlin JIT cache and $WORK between calls while it stays warm).
#
# Everything lands in $OUT (the device tool brings back 8 files or fewer: run "tests" and "bench" into their
# own OUT): gpu_vllm.log, vllm_gpu_*.json and .log (tests), oom_vllm.json, oom_vllm.md, cpu_pairs.json,
# bench_vllm.json, bench_vllm.md, bench_vllm.png.
# Knobs: OUT (gpu-vllm-out), WORK (/tmp/mmo-vllm: checkpoints, caches, child logs; the bench checkpoint is
# kept for a later call), PYTHON (python3), OOM_ARGS / BENCH_ARGS / TESTS_ARGS (extra arguments; e.g.
# TESTS_ARGS="-k tensor_parallel"), TESTS_TIMEOUT,
# OOM_DEADLINE, BENCH_DEADLINE (seconds), SESSION_LIMIT (560 s: the whole script; each step gets the
# smaller of its own limit and what is left, so a 10-minute device call returns its files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-vllm-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export OUT  # tests/test_vllm_gpu.py copies its children's JSON here
WORK=${WORK:-/tmp/mmo-vllm}
PY=${PYTHON:-python3}
STEPS=${STEPS:-tests,oom,bench}
LOG="$OUT/gpu_vllm.log"
mkdir -p "$WORK"
if ! "$PY" -c "import vllm" 2>/dev/null && [ -f .vdev/env.sh ]; then
  . .vdev/env.sh  # PYTHONPATH=/tmp/site:$PWD and the variables vLLM 0.26 needs there
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
say() { echo "$@" | tee -a "$LOG"; }
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
  echo "cpus $(getconf _NPROCESSORS_ONLN); $(free -g | awk 'NR==2{print "mem GiB total " $2 ", available " $7}')"
  df -h "$WORK" | tail -1
  head -3 /proc/self/cgroup
  echo "cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo -)"
} >>"$LOG" 2>&1
tail -4 "$LOG"
rc=0
t0=$SECONDS
LIMIT=${SESSION_LIMIT:-560}
left() { echo $(( LIMIT - (SECONDS - t0) )); }
cap() { local a=$1 b; b=$(( $(left) - ${2:-0} )); [ "$b" -lt "$a" ] && a=$b; echo "$a"; }
has() {  # the step is asked for and at least 60 s of its budget are left
  case ",$STEPS," in *",$1,"*) ;; *) return 1 ;; esac
  [ "$(left)" -ge 60 ] && return 0
  say "== $1: skipped, only $(left) s of SESSION_LIMIT left"; rc=1; return 1
}

if has tests; then
  T=$(cap "${TESTS_TIMEOUT:-480}" 10)
  say "== tests (limit $T s)"
  timeout -k 10 "$T" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_vllm_gpu.py \
    ${TESTS_ARGS:--k "not tensor_parallel"} >>"$LOG" 2>&1
  r=$?
  [ $r = 0 ] || rc=1
  grep -E "passed|failed|error|skipped" "$LOG" | tail -3
  say "tests: rc $r, $((SECONDS - t0)) s"
fi

if has tp2; then
  T=$(cap "${TP2_TIMEOUT:-540}" 10)
  say "== tp2 (limit $T s)"
  MMO_CHILD_HANG_S=${MMO_CHILD_HANG_S:-$((T / 3))} timeout -k 10 "$T" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_vllm_gpu.py -k tensor_parallel >>"$LOG" 2>&1
  r=$?
  [ $r = 0 ] || rc=1
  grep -E "passed|failed|error|skipped" "$LOG" | tail -2
  say "tp2: rc $r, $((SECONDS - t0)) s"
fi

if has launcher; then
  T=$(cap "${LAUNCHER_TIMEOUT:-420}" 10)
  say "== launcher (limit $T s)"
  timeout -k 10 "$T" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_launcher_gpu.py >>"$LOG" 2>&1
  r=$?
  [ $r = 0 ] || rc=1
  grep -E "passed|failed|error|skipped" "$LOG" | tail -2
  say "launcher: rc $r, $((SECONDS - t0)) s"
fi

if has oom; then
  t=$SECONDS
  D=$(cap "${OOM_DEADLINE:-300}" 40)
  say "== oom_repro --vllm (limit $D s)"
  timeout -k 10 $((D + 30)) "$PY" benchmarks/oom_repro.py --vllm --out "$OUT" --workdir "$WORK/oom" \
    --deadline "$D" ${OOM_ARGS:-} >>"$LOG" 2>&1
  r=$?
  [ $r = 0 ] || rc=1
  cat "$OUT/oom_vllm.md" 2>/dev/null
  rm -rf "$WORK/oom"
  say "oom: rc $r, $((SECONDS - t)) s"
fi

if has bench; then
  t=$SECONDS
  # the VM's vCPUs before the children: which run slow now (one speed or the other, 1.8x apart, for
  # seconds at a time: session 36), ~6 s, before the bench's deadline is taken from what is left;
  # cpu_pairs.json beside the bench's files
  timeout 60 "$PY" benchmarks/bench_cpu_pairs.py --rounds 1 --repeats 5 --out "$OUT" 2>&1 | tail -3 >>"$LOG"
  D=$(cap "${BENCH_DEADLINE:-420}" 55)
  say "== bench_vllm (deadline $D s)"
  thr0=$(awk '/throttled_usec/{print $2}' /sys/fs/cgroup/cpu.stat 2>/dev/null)
  timeout -k 10 $((D + 45)) "$PY" benchmarks/bench_vllm.py --out "$OUT" --workdir "$WORK/bench" --deadline "$D" \
    ${BENCH_ARGS:-} >>"$LOG" 2>&1
  r=$?
  [ $r = 0 ] || rc=1
  awk '/^\| bar \(issue 12\)/{on=1} on&&/^$/{exit} on' "$OUT/bench_vllm.md" 2>/dev/null
  grep -E "^- (uva_prefill|expected)" "$OUT/bench_vllm.md" 2>/dev/null
  thr1=$(awk '/throttled_usec/{print $2}' /sys/fs/cgroup/cpu.stat 2>/dev/null)
  say "bench: rc $r, $((SECONDS - t)) s; cgroup CPU throttled $(( (${thr1:-0} - ${thr0:-0}) / 1000 )) ms meanwhile"
fi

n=$(find "$OUT" -type f | wc -l)
say "total $((SECONDS - t0)) s, rc $rc; $n files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
[ "$n" -le 8 ] || say "WARNING: more than 8 files in $OUT: the device tool brings back at most 8"
exit $rc
