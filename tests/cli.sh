#!/usr/bin/env bash
# cli.sh: end-to-end tests of the mok command (build/mok) on the CPU backend and of the README's C
# example (build/example). Run by make test from the repository root; prints one line per test
# and "N passed, N failed"; exit status 1 if any failed.
set -euo pipefail

mok=./build/mok
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "${BASH_SOURCE[0]}")/check.sh"

# The digest table of a run's output (stdout only): the lines between "outputs" and the check.
digests() { "$@" 2>/dev/null | sed -n '/^outputs/,/^$/p'; }

check cli/help 0 'usage: mok <command>' -- $mok --help
check cli/help_run 0 'fine-7b +24576.*--grad-mode' -- $mok run --help
check cli/help_bench 0 '--repeat N' -- $mok help bench
check cli/no_command 2 'usage: mok' -- $mok
check cli/bad_option 2 "unknown option '--scal'" -- $mok run --scal 1/16
check cli/bad_scale 2 "expected 1/N" -- $mok bench --scale 16
check cli/too_many_threads 2 "--threads 100000: expected 0..1024" -- \
  $mok run --shape dsv3 --scale 1/32 --backend cpu --threads 100000
# --check-rows beyond the rows there are checks each of them once (2048 = 8 experts x 256 rows),
# in a second; it used to plan 2^31 rows, for minutes, before printing anything.
check cli/check_rows_capped 0 'about 0 s .*dw_gate +2048 rows .*dw_down +2048 columns .*run: PASS' \
  -- timeout 60 $mok run --shape mixtral-8x7b --scale 1/64 --tokens 8 --backend cpu \
  --check-rows 2147483647
check cli/info 0 'CUDA devices visible: [0-9]+' -- $mok info
v=$(sed -n 's/^#define MOK_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' include/mok.h | paste -sd.)
check cli/version 0 "^mok $v \$" -- $mok --version
check cli/tokens_past_the_limit 2 "--tokens '2000000': expected an integer 1\.\.1048576 \(the library's limit" \
  -- $mok run --tokens 2000000 --backend cpu

small=(--scale 1/32 --backend cpu)
check cli/run_dsv3 0 'run: PASS' -- $mok run --shape dsv3 "${small[@]}"
check cli/run_no_shared_f32 0 'run: PASS' -- \
  $mok run --shape qwen3-30b-a3b --scale 1/64 --backend cpu --grad-mode f32 --check-rows 2
check cli/run_one_token 0 'T=1 .*run: PASS' -- \
  $mok run --shape mixtral-8x7b --scale 1/64 --tokens 1 --backend cpu
check cli/run_fails_below_tolerance 1 'dw_gate [^A-Z]* FAIL.*run: FAIL' -- \
  $mok run --shape dsv3 "${small[@]}" --tol 1e-12

# FP8 (DESIGN.md §8): checked against ref64's FP8 recipe; other bits than BF16's; D4 on 4 ranks;
# bench writes the precision into its JSON.
check cli/run_fp8 0 'precision fp8.*quantizing the weights.*run: PASS' -- \
  $mok run --shape dsv3 "${small[@]}" --precision fp8
check cli/run_fp8_no_shared_f32 0 'run: PASS' -- \
  $mok run --shape qwen3-30b-a3b --scale 1/64 --backend cpu --grad-mode f32 --precision fp8 \
  --check-rows 2
check cli/run_fp8_ep4_same_bits 0 'dw_down +identical.*run --ep 4: PASS' -- \
  $mok run --shape dsv3 "${small[@]}" --ep 4 --precision fp8
check cli/bench_fp8 0 'precision fp8.*repeated bits: identical.*bench: PASS' -- \
  $mok bench --shape fine-7b --scale 1/64 --backend cpu --precision fp8 --warmup 0 --repeat 2 \
  --json "$tmp/fp8.json"
check cli/bench_fp8_json 0 'ok' -- python3 -c "
import json
j = json.load(open('$tmp/fp8.json'))
assert j['precision'] == 'fp8' and j['identical_bits'] is True, j
print('ok')"
check cli/bad_precision 2 "--precision 'fp16': expected bf16 or fp8" -- \
  $mok run --precision fp16
digests $mok run --shape dsv3 "${small[@]}" --check-tokens 0 --check-rows 0 >"$tmp/bf16"
digests $mok run --shape dsv3 "${small[@]}" --check-tokens 0 --check-rows 0 --precision fp8 \
  >"$tmp/fp8"
check cli/fp8_other_bits_than_bf16 1 '' -- cmp -s "$tmp/bf16" "$tmp/fp8"

# Expert parallelism on emulated ranks: the same bits as one rank (D4).
check cli/run_ep8_same_bits 0 'dw_down +identical.*run --ep 8: PASS' -- \
  $mok run --shape dsv3 "${small[@]}" --ep 8 --grad-mode f32
check cli/run_ep_uneven 2 "32 experts do not split over 3 ranks" -- \
  $mok run --shape dsv3 "${small[@]}" --ep 3
# A shape the library refuses fails before the inputs of the global batch are made (the header,
# then the error: no progress line between them; making them took over a minute here).
check cli/bench_ep_bad_shape_fails_first 1 \
  'grad-mode bf16 mok: error: mok_workspace_create: .*max_tokens \* top_k \* ep_size is 102400000' \
  -- $mok bench --shape fine-7b --scale 1/64 --backend cpu --ep 64 --tokens 200000
check cli/run_ep_one_rank_too_big_fails_first 1 \
  'grad-mode bf16 mok: error: mok_workspace_create: .*max_tokens is 1200000.*one rank running all 2 x 600000 tokens' \
  -- $mok run --shape fine-7b --scale 1/64 --backend cpu --ep 2 --tokens 600000
check cli/bench_ep 0 'on 4 ranks.*backward .*repeated bits: identical.*bench: PASS' -- \
  $mok bench --shape dsv3 "${small[@]}" --ep 4 --grad-mode f32 --warmup 0 --repeat 2 \
  --json "$tmp/ep.json"
check cli/bench_ep_json 0 'ok' -- python3 -c "
import json
j = json.load(open('$tmp/ep.json'))
assert j['ep'] == 4 and j['identical_bits'] is True and len(j['backward_ms_all']) == 2, j
print('ok')"

# Determinism through the command: same seed, same digests, on 1 thread and on 2 (D1, D2);
# another seed, other digests.
digests $mok run --shape dsv3 "${small[@]}" --threads 1 --check-tokens 0 --check-rows 0 >"$tmp/a"
digests $mok run --shape dsv3 "${small[@]}" --threads 2 --check-tokens 0 --check-rows 0 >"$tmp/b"
digests $mok run --shape dsv3 "${small[@]}" --seed 2 --check-tokens 0 --check-rows 0 >"$tmp/c"
check cli/same_bits_any_threads 0 '' -- cmp "$tmp/a" "$tmp/b"
check cli/other_seed_other_bits 1 '' -- cmp -s "$tmp/a" "$tmp/c"

check cli/bench 0 'repeated bits: identical.*bench: PASS' -- \
  $mok bench --shape fine-7b --scale 1/64 --backend cpu --warmup 0 --repeat 2 --json "$tmp/b.json"
# An unwritable --json fails before anything runs (no progress line, no header) and leaves no file;
# a benchmark that fails after the file was opened leaves none either.
check cli/bench_json_unwritable 2 '^mok: error: --json /nonexistent/b.json: No such file or directory; nothing was run $' \
  -- $mok bench --shape fine-7b --scale 1/64 --backend cpu --json /nonexistent/b.json
check cli/bench_failed_leaves_no_json 1 'MOK_ERR' -- sh -c "$mok bench --shape fine-7b \
  --scale 1/64 --backend cpu --ep 64 --tokens 200000 --json '$tmp/failed.json'; rc=\$?; \
  test ! -e '$tmp/failed.json' && exit \$rc"
check cli/bench_json 0 'ok' -- python3 -c "
import json, sys
j = json.load(open('$tmp/b.json'))
assert j['shape'] == 'fine-7b' and j['repeat'] == 2 and j['identical_bits'] is True, j
assert len(j['forward_ms_all']) == 2 and j['forward_ms'] > 0 and j['backward_tflops'] > 0, j
print('ok')"
# The one hash bench prints is FNV-1a over the hashes of mok run's table, in its order (each as
# 8 little-endian bytes), for the same shape and seed; another seed gives another.
digests $mok run --shape fine-7b --scale 1/64 --backend cpu --check-tokens 0 --check-rows 0 \
  >"$tmp/run_digests"
check cli/bench_digest_joins_run_digests 0 'ok' -- python3 -c "
import json
rows = [l.split() for l in open('$tmp/run_digests').read().splitlines()[2:] if l.strip()]
assert len(rows) == 6, rows
h = 0xcbf29ce484222325
for r in rows:
    for b in int(r[2], 16).to_bytes(8, 'little'):
        h = ((h ^ b) * 0x100000001b3) % 2**64
j = json.load(open('$tmp/b.json'))
assert j['outputs_fnv64'] == '%016x' % h, (j['outputs_fnv64'], '%016x' % h)
print('ok')"
check cli/bench_digest_other_seed 0 'outputs fnv64: [0-9a-f]{16}' -- sh -c "
  $mok bench --shape fine-7b --scale 1/64 --backend cpu --warmup 0 --repeat 1 --seed 7 |
  grep 'outputs fnv64' | grep -v \$(python3 -c \"import json; print(json.load(open('$tmp/b.json'))['outputs_fnv64'])\")"

# tools/ab.sh, the A/B driver for the device, on the CPU backend: a row per run, a missing build
# is a row that says so, not a stop.
ab=(env OUT="$tmp" SHAPES=fine-7b REPS=1 ARGS="--backend cpu --scale 1/64 --warmup 0 --repeat 1")
check cli/ab_bench 0 '\| 1 \| fine-7b \| here \| [0-9.]+ \| [0-9.]+ \| same \| - \| - \| [0-9.]+ \| [0-9.]+ \|' -- \
  "${ab[@]}" tools/ab.sh bench
# With an nvidia-smi that reports a busy and an idle sample every 50 ms: the busy ones' means.
mkdir -p "$tmp/smi"
printf '#!/bin/sh\nwhile :; do echo "1500, 650.5, 100"; echo "345, 80.0, 0"; sleep 0.05; done\n' \
  >"$tmp/smi/nvidia-smi"
chmod +x "$tmp/smi/nvidia-smi"
check cli/ab_bench_clocks 0 '\| 1 \| fine-7b \| here \| [0-9.]+ \| [0-9.]+ \| same \| 1500 \| 650 \|' -- \
  "${ab[@]}" PATH="$tmp/smi:$PATH" tools/ab.sh bench
check cli/ab_missing_build 0 '\| 1 \| fine-7b \| nope \| failed' -- \
  "${ab[@]}" BUILDS=nope tools/ab.sh bench
# Every build's outputs are compared with the shape's reference build, the first that printed a
# hash (EXP: where builds are): "old" stands for a mok from before bench printed one, "other"
# for a build with other bits; the second "here" is compared with the first, not with "other".
mkdir -p "$tmp/exp/other" "$tmp/exp/old"
fake='#!/bin/sh\necho "  forward 1.0 1.0 1.0 1.0"\necho "  backward 2.0 2.0 2.0 1.0"
echo "  repeated bits: identical (every output of the last timed run = the reference run)"\n'
printf "$fake" >"$tmp/exp/old/mok"
printf "$fake"'echo "  outputs fnv64: 0123456789abcdef (the reference run)"\n' >"$tmp/exp/other/mok"
chmod +x "$tmp/exp/other/mok" "$tmp/exp/old/mok"
r='\| [0-9.]+ \| [0-9.]+ \|'
check cli/ab_bits_across_builds 0 "\| 1 \| fine-7b \| old $r no digest .*\| 1 \| fine-7b \| here $r same .*\| 1 \| fine-7b \| other $r other than here .*\| 1 \| fine-7b \| here $r same .*\| 2 \| fine-7b \| other $r other than here " -- \
  "${ab[@]}" REPS=2 EXP="$tmp/exp" BUILDS="old here other here" tools/ab.sh bench
check cli/ab_usage 2 'tools/ab.sh build NAME REV' -- tools/ab.sh

# tools/gpu-check.sh ep, the multi-GPU command, with GPUS=N standing for N visible GPUs and a
# python3 that records each torch.distributed.run launch (with NCCL_NVLS_ENABLE,
# TORCH_SYMM_MEM_DISABLE_MULTICAST and NVSHMEM_DISABLE_NVLS, "011" when set) and hands every
# other call to the real python3: ep_nccl.py at ep = 2, 4, ... up to N, the benchmark at the
# largest, nothing below 2 GPUs; a failing launch is a FAIL. Only without a GPU (test_gpu fails
# at once, so the exit status is 1 in every case).
if $mok info | grep -q 'CUDA devices visible: 0'; then
  mkdir -p "$tmp/stub"
  cat >"$tmp/stub/python3" <<STUB
#!/bin/sh
case "\$*" in
  "-m torch.distributed.run "*)
    echo "\$NCCL_NVLS_ENABLE\$TORCH_SYMM_MEM_DISABLE_MULTICAST\$NVSHMEM_DISABLE_NVLS \$*" >>"\$OUT/launches"
    exit \${EP_RC:-0} ;;
  *) exec $(command -v python3) "\$@" ;;
esac
STUB
  chmod +x "$tmp/stub/python3"
  gc=(env PATH="$tmp/stub:$PATH" OUT="$tmp/gc" tools/gpu-check.sh ep)
  # ep_mode NAME MODE GPUS STATUS SUMMARY LAUNCHES: `gpu-check.sh MODE` with GPUS stand-in GPUs
  # exits with STATUS and its output matches SUMMARY; the launches it recorded match LAUNCHES.
  # ep-tests and ep-bench are the two halves, for two device calls.
  ep_mode() {
    check "cli/gpu_check_$1" "$4" "$5" -- env GPUS="$3" PATH="$tmp/stub:$PATH" OUT="$tmp/gc" \
      tools/gpu-check.sh "$2"
    check "cli/gpu_check_$1_launches" 0 "$6" -- cat "$tmp/gc/launches"
    rm -f "$tmp/gc/launches"
  }
  run="011 -m torch.distributed.run --standalone --nproc-per-node"
  ep_mode ep_4_gpus ep 4 1 'ep2-tests +ok.*ep4-tests +ok.*ep-bench +ok' \
    "^$run 2 python/tests/ep_nccl.py $run 4 python/tests/ep_nccl.py $run 4 bench/ep.py --out $tmp/gc/ep \$"
  ep_mode ep_tests_alone ep-tests 4 1 'ep2-tests +ok.*ep4-tests +ok' \
    "^$run 2 python/tests/ep_nccl.py $run 4 python/tests/ep_nccl.py \$"
  ep_mode ep_bench_alone ep-bench 8 0 'ep-bench +ok' "^$run 8 bench/ep.py --out $tmp/gc/ep \$"
  check cli/gpu_check_ep_1_gpu 1 'skipped: 1 GPU' -- env GPUS=1 "${gc[@]}"
  check cli/gpu_check_unknown_mode 2 'usage: tools/gpu-check.sh' -- tools/gpu-check.sh ep-all
  check cli/gpu_check_ep_1_gpu_launches_nothing 1 '' -- test -e "$tmp/gc/launches"
  check cli/gpu_check_ep_launch_fails 1 'ep2-tests +FAIL  rc=3.*ep-bench +FAIL' -- \
    env GPUS=2 EP_RC=3 "${gc[@]}"
  # fp8: the FP8 GPU tests (failing here: no GPU), then each shape's bench at bf16 and fp8 and
  # their table, on the CPU backend through FP8_ARGS.
  check cli/gpu_check_fp8 1 '\| fine-7b \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9]+ \| [0-9.]+ \| yes/yes \|' -- \
    env SHAPES=fine-7b FP8_ARGS="--backend cpu --scale 1/64 --warmup 0 --repeat 1" \
    OUT="$tmp/gf" tools/gpu-check.sh fp8
  # actmem: bench/actmem.py on the GPU (here it says there is none).
  python3 -c 'import torch' 2>/dev/null &&
    check cli/gpu_check_actmem 1 'actmem.py --device cuda.*no CUDA device.*actmem +FAIL' -- \
      env OUT="$tmp/gm" tools/gpu-check.sh actmem
  # sanitize: memcheck and racecheck of the small-shape tests (BF16, FP8), through a recording
  # stand-in.
  printf '#!/bin/sh\necho "$*" >>"$OUT/sanitizer"\n' >"$tmp/stub/compute-sanitizer"
  chmod +x "$tmp/stub/compute-sanitizer"
  check cli/gpu_check_sanitize 0 'memcheck +ok.*racecheck +ok' -- \
    env PATH="$tmp/stub:$PATH" OUT="$tmp/gcs" tools/gpu-check.sh sanitize
  check cli/gpu_check_sanitize_runs 0 '^--tool memcheck --error-exitcode 1 ./build/test_gpu gpu/layer_vs_cpu_small_shapes --tool memcheck --error-exitcode 1 ./build/test_gpu gpu/fp8_layer_vs_cpu_small_shapes --tool racecheck' -- \
    cat "$tmp/gcs/sanitizer"
  # More than 8 files under $OUT (the most the device returns): all packed into logs.tgz, and a
  # benchmark table stays beside it.
  mkdir -p "$tmp/gc9/old"
  for i in 1 2 3 4 5 6 7; do echo "$i" >"$tmp/gc9/old/f$i"; done
  echo table >"$tmp/gc9/bench.md"
  check cli/gpu_check_packs_logs 0 'every log is in' -- \
    env PATH="$tmp/stub:$PATH" OUT="$tmp/gc9" tools/gpu-check.sh sanitize
  check cli/gpu_check_packed_files 0 '^bench.md logs.tgz $' -- \
    sh -c "cd '$tmp/gc9' && find . -type f | sed 's|^./||' | sort | tr '\n' ' '"
  check cli/gpu_check_packed_logs 0 'memcheck.log.*old/f7.*sanitizer' -- \
    sh -c "tar tzf '$tmp/gc9/logs.tgz' | sort | tr '\n' ' '"
fi

if $mok info | grep -q 'CUDA devices visible: 0'; then
  check cli/cuda_without_gpu 1 'MOK_ERR_UNSUPPORTED.*--backend cpu' -- $mok run --scale 1/64
  check cli/run_ep_cuda_without_gpu 1 'MOK_ERR_UNSUPPORTED.*no CUDA device' -- \
    $mok run --shape dsv3 --scale 1/64 --ep 2
  check cli/test_gpu_without_gpu 1 'no CUDA device is visible.*0 passed, 1 failed' -- \
    ./build/test_gpu
fi

# The README's C example is tools/example.c, and it runs.
awk '/^```c$/ {f = 1; next} /^```$/ {f = 0} f' README.md >"$tmp/readme.c"
check cli/readme_example_is_example_c 0 '' -- diff "$tmp/readme.c" tools/example.c
check cli/example_runs 0 '^y\[0\] = ' -- ./build/example

check_done
