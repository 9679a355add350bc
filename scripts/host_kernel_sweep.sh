#!/usr/bin/env bash
# The host kernel's build-time knobs, swept in one run (one device call on the GPU machine's host):
# each variant of csrc/host_kernel.c is compiled with its -D flags, loaded through
# MMAP_OFFLOAD_NATIVE_MO_HOST, and measured by bench_host_kernel.py at the same shapes and thread counts.
#
#   bash scripts/host_kernel_sweep.sh                                  # defaults below, ~1-2 min on 16 cores
#   VARIANTS="base|-DPF_DIST=2|-DPF_DIST=4|-DSEG_MAX=32" ARGS="--shapes user --threads 8,all --m 1" \
#     OUT=sweep bash scripts/host_kernel_sweep.sh
#
# VARIANTS: "|"-separated flag sets ("base" = none; a word isa=NAME is not a flag but the kernel path the variant
# measures, bench_host_kernel.py --isa NAME: "isa=avx512vnni|isa=avx512bw" compares two paths of one build;
# a word src=FILE builds that file instead of csrc/host_kernel.c: an earlier version, for a before/after in one run,
# e.g. git show HEAD:csrc/host_kernel.c > before_host_kernel.c, then VARIANTS="src=before_host_kernel.c|base");
# ARGS: bench_host_kernel.py's arguments; OUT: a folder
# for sweep.json (each variant's flags and bench JSON) and sweep.md (a table: GB/s per variant, shape,
# threads, M, and % of DRAM): two files, so a device call returns them all.
# Knobs of csrc/host_kernel.c: PF_DIST (tiles the software prefetch runs ahead, 1; 0: none), PF_HINT
# (_MM_HINT_T1, the default since session 13, or _MM_HINT_T0 ...), SEG_MAX (tiles per segment at most, 16), SEG_TM (tiles x rows, 128),
# CHUNK_K (k rows of a unit's chunk per row of x, at least: 256), RANGE_TILES (columns of a unit at most: 16),
# UNITS_PER_THREAD (units per phase aimed at, 4), SPIN_NS_DEFAULT (ns an idle worker spins before it sleeps, 1 ms);
# DIAG_LOADS_ONLY (a diagnostic: the same reads without the arithmetic, WRONG results: how much of the rate the
# arithmetic costs); DIAG_TIMING (per-thread times of each call: join delay, time in units, chunk sums, idle;
# sweep.md's columns, HostKernel.diag). BENCHMARKS.md "Host compute" says which were tried where.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CC=${CC:-cc}
OUT=${OUT:-host-sweep}
VARIANTS=${VARIANTS:-"base|-DPF_DIST=2|-DPF_HINT=_MM_HINT_T0|-DSEG_MAX=8|-DSEG_MAX=32"}
ARGS=${ARGS:-"--shapes user,mixtral --threads 8,all --m 1,3 --seconds 0.25 --no-torch"}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
i=0
IFS='|' read -r -a sets <<<"$VARIANTS"
for variant in "${sets[@]}"; do
  i=$((i + 1))
  flags="" isa="" src=csrc/host_kernel.c
  for word in $variant; do
    case "$word" in
      base) ;;
      isa=*) isa="--isa ${word#isa=}" ;;
      src=*) src="${word#src=}" ;;
      *) flags="$flags $word" ;;
    esac
  done
  lib="$build/mo_host_$i.so"
  # shellcheck disable=SC2086  # the flags are words
  "$CC" -O3 -shared -fPIC $flags -o "$lib" "$src" -lpthread -lm
  echo "== variant $i: $variant"
  # shellcheck disable=SC2086
  MMAP_OFFLOAD_NATIVE_MO_HOST="$lib" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" benchmarks/bench_host_kernel.py $ARGS $isa --out "$build/variant_$i.json" | grep -v "^#" || true
  echo "$variant" >"$build/variant_$i.flags"
done
"$PY" - "$build" "$OUT" <<'EOF'
import json, sys
from pathlib import Path
src, out = Path(sys.argv[1]), Path(sys.argv[2])
rows, runs = [], []
for f in sorted(src.glob("variant_*.json"), key=lambda p: int(p.stem.split("_")[1])):
    flags = (src / f"{f.stem}.flags").read_text().strip()
    runs.append({"flags": flags, "bench": json.loads(f.read_text())})
    for r in runs[-1]["bench"]["rows"]:
        rows.append((flags, r.get("isa", ""), r["shape"], r["threads"], r["m"], r["host_gbs"], r["dram_gbs"],
                     r.get("diag") or {}))
def us(d, k):
    return f"{d[k]:.0f}" if k in d else "-"
cols = ("call_us", "python_us", "c_us", "join_us", "busy_us", "red_us", "idle_us")
lines = ["| variant | path | shape | threads | M | host GB/s | % of DRAM | call us | python us | C us | join us "
         "| units us | sums us | idle us |", "| --- | --- | --- |" + " ---: |" * 11]
lines += [f"| {v} | {k} | {s} | {t} | {m} | {g:.1f} | {100 * g / d:.0f}% | " + " | ".join(us(x, c) for c in cols) + " |"
          for v, k, s, t, m, g, d, x in rows]
(out / "sweep.json").write_text(json.dumps(runs, indent=1))
(out / "sweep.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
