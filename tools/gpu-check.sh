#!/usr/bin/env bash
# gpu-check.sh: the one command for the device (make gpu-check). Builds everything, runs the GPU
# tests, the Python tests (torch, CUDA) and the benchmark, writes full logs under $OUT (or
# results/ when $OUT is unset) and prints a short summary last; exit status 1 if a step failed.
# Usage: tools/gpu-check.sh [tests|bench|all|sanitize|train|fp8|bench-fp8|ep|ep-tests|ep-bench|
#        actmem] (default all)
#   fp8: the FP8 layer's GPU tests (test_gpu fp8), then `mok bench` of each shape at bf16 and at
#       fp8, one process each, and tools/fp8_table.py's table of the two (SHAPES: the shapes,
#       default all six; FP8_ARGS: more options for mok bench).
#   bench-fp8: bench/run.py --precision fp8 (issue 38's bar): mok's FP8 and BF16 layers,
#       PyTorch's FP8 layer (torch._scaled_grouped_mm, its weight gradients BF16) and the BF16
#       baselines, with the BF16 and FP8 GEMM ceilings, in one run (no per-expert loop); not in
#       all.
#   train: the router and the model of issue 39. examples/check_training.py: a ~60M-parameter
#       MoE transformer trained 300 steps on the Python standard library's source, twice with mok
#       and once with the PyTorch MoE; fails unless the two mok loss curves are bit-identical and
#       mok's held-out loss is within 2 % of torch's; reports tokens/s and the MoE layers' share
#       of a step ($OUT/train/curves.json, curves.png); a fourth run in FP8 must come within 2 %
#       of mok's BF16 held-out loss (its line says so apart). Then bench/router.py: fine-7b,
#       qwen3-30b-a3b and dsv3 with the router included, mok against a PyTorch router feeding
#       grouped_mm ($OUT/train/router.json). The router's GPU tests are in `tests`.
#   sanitize: compute-sanitizer's memcheck and racecheck on the small-shape GPU tests, BF16 and
#       FP8 (minutes each, so not in all); clusters of 2 x 1 and of 2 x 2 both run there.
#   ep: expert parallelism over every visible GPU, one process per GPU (issue 7): the GPU tests,
#       python/tests/ep_nccl.py (D4 against ep = 1, a late rank, a missing rank) at ep = 2, 4 and
#       8 as far as the GPUs go, then bench/ep.py at the largest; NVLink multicast off. It can
#       take longer than one call of a time-limited device: each step prints its result as it
#       ends and leaves its log under $OUT, so a cut-off run still says how far it got; and
#       ep-tests (the tests alone) and ep-bench (the benchmark alone) split it in two calls.
#       bench/ep.py writes its tables after every measurement, into $OUT/ep.
#   actmem: bench/actmem.py --device cuda: activation memory per token, mok's saved against what
#       autograd keeps for the PyTorch baselines (on the GPU), and mok's CUDA workspace; not in all.
# Where the logs come to more than 8 files (what the device returns), they end packed in
# $OUT/logs.tgz.
set -uo pipefail
what=${1:-all}
case "$what" in
  tests | bench | all | sanitize | train | fp8 | bench-fp8 | ep | ep-tests | ep-bench | actmem) ;;
  *) echo "usage: tools/gpu-check.sh [tests|bench|all|sanitize|train|fp8|bench-fp8|ep|ep-tests|ep-bench|actmem]" >&2
     exit 2 ;;
esac
out=${OUT:-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MOK_LIB=build/libmok.so
# The device gets a copy of the tree without .git: the caller passes the commit in MOK_COMMIT.
export MOK_COMMIT=${MOK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# NCCL: the C tests load the libnccl.so.2 the loader finds (the CUDA toolkit's or the system's),
# the Python tests torch's (its nvidia-nccl wheel), which may be another release. Where both are
# here, step nccl-torch runs the C NCCL group test again with torch's, so that two releases are
# tested; where the loader finds none, every test takes torch's.
wheel=$(python3 -c "import nvidia.nccl as n; print(n.__path__[0])" 2>/dev/null)
torch_nccl=
if [ -n "$wheel" ] && [ -e "$wheel/lib/libnccl.so.2" ]; then
  if ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2 '; then
    torch_nccl=$wheel/lib
  else
    export LD_LIBRARY_PATH=$wheel/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
fi
summary=()
failed=0
step() { # step NAME TIMEOUT_S COMMAND...: runs it, logs to $out/NAME.log, records ok/FAIL
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "== $name: $([ $rc = 0 ] && echo ok || echo FAIL) (rc=$rc, $((SECONDS - t0)) s)"
  summary+=("$(printf '%-12s %s  rc=%d  %ds' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL)" $rc $((SECONDS - t0)))")
  [ $rc = 0 ] || failed=1
  return $rc
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$out/gpu.txt" 2>&1
step build 600 make -j16 all build/test_gpu || { printf '%s\n' "${summary[@]}"; exit 1; }
if [ "$what" = tests ] || [ "$what" = all ]; then
  step gpu-tests 420 ./build/test_gpu
  # The README's GPU command, whose float64 check must take seconds: its log says how long.
  step run-dsv3 90 ./build/mok run --shape dsv3 --backend cuda
  [ -z "$torch_nccl" ] || step nccl-torch 120 \
    env LD_LIBRARY_PATH="$torch_nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ./build/test_gpu gpu/nccl
  step py-tests 300 python3 -m pytest -q -x python/tests
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  step bench 480 python3 bench/run.py --out "$out"
fi
if [ "$what" = bench-fp8 ]; then
  step bench-fp8 540 python3 bench/run.py --precision fp8 --no-loop --out "$out"
fi
if [ "$what" = actmem ]; then
  step actmem 300 python3 bench/actmem.py --device cuda
fi
if [ "$what" = train ]; then
  step train 400 python3 examples/check_training.py --fp8 --out "$out/train"
  step router-bench 300 python3 bench/router.py --out "$out/train"
fi
if [ "$what" = fp8 ]; then
  step fp8-tests 420 ./build/test_gpu fp8
  mkdir -p "$out/fp8"
  for s in ${SHAPES:-dsv3 qwen3-30b-a3b qwen3-235b mixtral-8x7b gpt-oss-120b fine-7b}; do
    for p in bf16 fp8; do
      # shellcheck disable=SC2086
      step "$s-$p" 180 ./build/mok bench --shape "$s" --precision "$p" ${FP8_ARGS:-} \
        --json "$out/fp8/$s-$p.json"
    done
  done
  python3 tools/fp8_table.py "$out/fp8" | tee "$out/fp8.md"
fi
if [ "$what" = sanitize ]; then
  for tool in memcheck racecheck; do
    step "$tool" 540 compute-sanitizer --tool "$tool" --error-exitcode 1 \
      ./build/test_gpu gpu/layer_vs_cpu_small_shapes
    step "$tool-fp8" 540 compute-sanitizer --tool "$tool" --error-exitcode 1 \
      ./build/test_gpu gpu/fp8_layer_vs_cpu_small_shapes
  done
fi
if [ "$what" = ep ] || [ "$what" = ep-tests ] || [ "$what" = ep-bench ]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  # The GPUs this process may use (CUDA_VISIBLE_DEVICES counts), as the library sees them.
  gpus=${GPUS:-$(./build/mok info 2>/dev/null | sed -n 's/.*CUDA devices visible: \([0-9]*\).*/\1/p')}
  gpus=${gpus:-0}
  [ "$what" = ep-bench ] || step gpu-tests 420 ./build/test_gpu
  top=0
  for r in 2 4 8; do
    [ "$r" -le "$gpus" ] || break
    [ "$what" = ep-bench ] || step "ep$r-tests" 300 python3 -m torch.distributed.run \
      --standalone --nproc-per-node "$r" python/tests/ep_nccl.py
    top=$r
  done
  if [ "$what" = ep-tests ]; then
    :
  elif [ "$top" -gt 0 ]; then
    step ep-bench 540 python3 -m torch.distributed.run --standalone --nproc-per-node "$top" \
      bench/ep.py --out "$out/ep"
  else
    summary+=("ep           skipped: $gpus GPU(s) here, expert parallelism needs 2 or more")
  fi
fi
echo
echo "== summary ($(head -2 "$out/gpu.txt" | tail -1))"
printf '%s\n' "${summary[@]}"
grep -hE "passed, .* failed" "$out/gpu-tests.log" 2>/dev/null
# The device returns at most 8 files from $OUT: past that, everything goes into logs.tgz there,
# and the benchmark's bench.json, bench.md and bench.png also stay beside it.
if [ "$(find "$out" -type f | wc -l)" -gt 8 ]; then
  pack=$(mktemp /tmp/gpu-check-XXXXXX.tgz)
  tar czf "$pack" -C "$out" . &&
    find "$out" -type f ! -name 'bench.json' ! -name 'bench.md' ! -name 'bench.png' -delete &&
    find "$out" -mindepth 1 -type d -empty -delete && mv "$pack" "$out/logs.tgz" &&
    echo "(more than 8 files: every log is in $out/logs.tgz)"
fi
exit $failed
