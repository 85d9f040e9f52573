#!/usr/bin/env bash
# kernel-times.sh: on the device, the time of every kernel of one forward and one backward of each
# shape (ncu, clocks and caches left as a timed run has them), with TFLOP/s for the GEMMs: the
# table tools/kernel_times.py prints, per shape, after the raw CSV is kept under $OUT.
# Usage: tools/kernel-times.sh [SHAPE...]   (default: the six shapes of DESIGN.md section 7)
set -uo pipefail
shapes=${*:-dsv3 qwen3-30b-a3b qwen3-235b mixtral-8x7b gpt-oss-120b fine-7b}
out=${OUT:-results}/kernel-times
mkdir -p "$out"
rc=0
for s in $shapes; do
  echo "== $s" >&2
  ncu --csv --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    ./build/mok bench --shape "$s" --warmup 0 --repeat 1 > "$out/$s.csv" 2> "$out/$s.err" ||
    { echo "ncu failed on $s (see $out/$s.err)" >&2; rc=1; continue; }
  python3 tools/kernel_times.py "$s" "$out/$s.csv" || rc=1
done
exit $rc
