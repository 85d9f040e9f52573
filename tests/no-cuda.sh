#!/usr/bin/env bash
# no-cuda.sh BUILD: checks a build made without the CUDA toolkit (make WITH_CUDA=0 BUILD=...; make
# test makes one under build/no-cuda and runs this): libmok links nothing of CUDA, its CUDA
# backend and NCCL groups say they were not built, and the C tests and the command run on the CPU
# backend. Prints one line per check and "N passed, N failed"; exit status 1 if any failed.
set -euo pipefail
b=${1:?usage: tests/no-cuda.sh BUILD}
. "$(dirname "${BASH_SOURCE[0]}")/check.sh"

check no-cuda/links_no_cuda 0 '' -- sh -c "! nm '$b/libmok.so' | grep -qi 'cuda[A-Z]\|nccl[A-Z]'"
check no-cuda/c_tests 0 ' passed, 0 failed' -- "$b/test_mok"
check no-cuda/info 0 'backends built: cpu \(cuda: not built.*CUDA devices visible: 0' -- "$b/mok" info
check no-cuda/run_cpu 0 'run: PASS' -- "$b/mok" run --shape dsv3 --scale 1/32 --backend cpu
check no-cuda/run_cuda_refused 1 'MOK_ERR_UNSUPPORTED: this libmok was built without the CUDA backend' \
  -- "$b/mok" run --shape dsv3 --scale 1/32 --backend cuda
check no-cuda/python 0 'ok' -- env MOK_LIB="$b/libmok.so" python3 -c "
import sys; sys.path.insert(0, 'python')
import numpy as np, mok
assert mok.cuda_device_count() == 0
try:
    mok.Context(backend='cuda')
    raise SystemExit('a CUDA context was made')
except mok.MokUnsupported as e:
    assert 'built without the CUDA backend' in e.message, e.message
try:
    mok.nccl_id()
    raise SystemExit('an NCCL id was made')
except mok.MokUnsupported as e:
    assert 'built without the CUDA backend' in e.message, e.message
print('ok')"

check_done
