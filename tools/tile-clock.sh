#!/usr/bin/env bash
# tile-clock.sh: on the device, where the GEMM tiles' cycles go in the benchmark's loop: builds
# mok with the tile-clock probe (src/cuda/tile_clock.cuh) in a scratch copy of the tree, runs
# `mok bench` of each shape, and prints per GEMM product the mean cycles a tile spends in its
# k-loop (against 1024 a k-block for the math alone), its epilogue and before it (phantom tiles,
# the wait for the next tile), with the SM clock each product ran at and the share of its time
# the producer waited for a free stage, from tools/tile_clock.py. Logs under $OUT (or results/).
# Usage: tools/tile-clock.sh [SHAPE...]   (default: the six shapes of DESIGN.md section 7)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
shapes=${*:-dsv3 qwen3-30b-a3b qwen3-235b mixtral-8x7b gpt-oss-120b fine-7b}
out=${OUT:-results}/tile-clock
mkdir -p "$out"
tree=$(mktemp -d /tmp/mok-tclk-XXXXXX) || exit 1
trap 'rm -rf "$tree"' EXIT
cp -r Makefile include src tools "$tree"/
make -C "$tree" -j"$(nproc)" build/mok NVEXTRA=-DMOK_TILE_CLOCK > "$out/build.log" 2>&1 ||
  { tail -20 "$out/build.log"; exit 1; }
rc=0
for s in $shapes; do
  echo "== $s" >&2
  "$tree/build/mok" bench --shape "$s" --warmup 2 --repeat 5 > "$out/$s.log" 2>&1 ||
    { echo "mok bench failed on $s (see $out/$s.log)" >&2; rc=1; continue; }
  python3 tools/tile_clock.py "$s" "$out/$s.log" | tee "$out/$s.md" || rc=1
done
exit $rc
