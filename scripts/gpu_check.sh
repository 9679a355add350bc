#!/usr/bin/env bash
# Everything that needs the GPU, in one call on the lent machine (OUT=... bash scripts/gpu_check.sh):
#   1. the GPU tests of every module (pytest -m gpu)
#   2. benchmarks/bench_repack.py on CUDA          (repack GB/s, bar >= 20)
#   3. benchmarks/bench_warmup.py on CUDA          (warm-up vs the disk's sequential write, bar >= 80%)
#   4. benchmarks/bench_moe.py                     (tokens/s against UVA; see docs/BENCHMARKS.md)
#   optional (TRANSFER=1): benchmarks/bench_transfer.py $TRANSFER_ARGS (default --skip-cold)
# $OUT gets check.log (steps 1-3 and the transfer table), transfer.json, and moe/ (step 4: run.log,
# results.json, results.md, 3 PNGs): 8 files, the device tool's limit. kvikio wheels in .whl/ are
# installed first. Knobs: BENCH_ARGS, BENCH_DEADLINE, WARMUP_GIB, TESTS_TIMEOUT, SKIP_REPACK=1, SKIP_WARMUP=1,
# SKIP_MOE=1, LATENCY=1 (benchmarks/bench_latency.py into check.log), CONTENTION=1 (benchmarks/bench_launch_contention.py
# into check.log; CONTENTION_ARGS, e.g. --scenarios "idle|host=7,copy=8"), ROUTE_COST=1 (benchmarks/bench_route_cost.py:
# the launching thread's price per MoE layer of the hybrid decode path, into check.log).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
t0=$SECONDS
{
echo "== gpu tests"
timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -W ignore 2>&1 | tail -25
echo "tests: $((SECONDS - t0)) s"
if [ "${SKIP_REPACK:-0}" != 1 ]; then
echo "== bench_repack"
timeout 60 python3 benchmarks/bench_repack.py --device cuda --out /tmp/repack.json 2>&1 | tail -12
fi
if [ "${TRANSFER:-0}" = 1 ]; then
echo "== bench_transfer (warm, native pool vs Python threads)"
timeout 240 python3 benchmarks/bench_transfer.py --size-gib ${TRANSFER_GIB:-4} ${TRANSFER_ARGS:---skip-cold} \
  --out "$OUT/transfer.json" 2>&1 | grep -v "^# env" | tail -${TRANSFER_TAIL:-16}
rm -f /tmp/mmap_offload_bench.bin
fi
if [ "${LATENCY:-0}" = 1 ]; then
echo "== bench_latency (decode-sized batches: submit -> on GPU)"
timeout 120 python3 benchmarks/bench_latency.py --reps ${LATENCY_REPS:-30} --out /tmp/latency.json 2>&1 | tail -30
fi
if [ "${CONTENTION:-0}" = 1 ]; then
echo "== bench_launch_contention (vLLM's launching thread, stood in for, beside the hybrid path's threads)"
timeout 120 python3 benchmarks/bench_launch_contention.py ${CONTENTION_ARGS:-} --out /tmp/contention 2>&1 | tail -14
fi
if [ "${ROUTE_COST:-0}" = 1 ]; then
echo "== bench_route_cost (route() and patch 4b on vLLM's launching thread, per MoE layer)"
timeout 120 python3 benchmarks/bench_route_cost.py --out /tmp/route-cost 2>&1 | tail -5
echo "== bench_route_cost at 1 token (the async expert step, no host job: does our stream work slow vLLM's launches?)"
timeout 120 python3 benchmarks/bench_route_cost.py --tokens 1 --slots 16 --out /tmp/route-cost-1 2>&1 | tail -5
fi
if [ "${SKIP_WARMUP:-0}" != 1 ]; then
echo "== bench_warmup"
timeout 120 python3 benchmarks/bench_warmup.py --device cuda --gib ${WARMUP_GIB:-4} --dir /tmp/mmo-warmup --out /tmp/warmup.json 2>&1 | tail -8
fi
echo "elapsed: $((SECONDS - t0)) s"
} 2>&1 | tee "$OUT/check.log"
[ "${SKIP_MOE:-0}" = 1 ] && exit 0
echo "== bench_moe"
SKIP_TESTS=1 SKIP_OOM=1 BENCH_DEADLINE=${BENCH_DEADLINE:-120} OUT="$OUT/moe" bash scripts/gpu_bench.sh
echo "total: $((SECONDS - t0)) s"
