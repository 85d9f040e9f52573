#!/usr/bin/env bash
# wheel.sh: pip install . into a fresh virtual environment (numpy from the package index), then,
# from a directory outside the repository and with no MOK_LIB: import mok, the library inside the
# package, its version, a forward and backward on the CPU backend against the float64 reference of
# the tests, and the mok command. Run by make test after the build (the package's make finds
# everything built); prints one line per check and "N passed, N failed"; exit status 1 if any
# failed.
set -euo pipefail
repo=$(pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. "$(dirname "${BASH_SOURCE[0]}")/check.sh"

py=$tmp/venv/bin/python
check wheel/venv 0 '' -- python3 -m venv "$tmp/venv"
# A make of the package's own (not this one's sub-make), as a user's pip install runs it.
check wheel/pip_install 0 'Successfully installed .*mok-' -- \
  env -u MAKEFLAGS -u MAKELEVEL -u MOK_LIB "$py" -m pip install --no-cache-dir "$repo"
mkdir "$tmp/elsewhere"
cd "$tmp/elsewhere"
check wheel/import_elsewhere 0 'ok' -- env -u MOK_LIB "$py" -c "
import importlib.metadata, pathlib, mok
from mok import _lib
site = pathlib.Path(mok.__file__).parent
assert site.parent.name == 'site-packages', site
assert _lib.library_path() == site / 'libmok.so', _lib.library_path()
assert mok.__version__ == importlib.metadata.version('mok'), mok.__version__
v = _lib.lib.mok_version()
assert mok.__version__ == '%d.%d.%d' % (v // 10000, v // 100 % 100, v % 100), mok.__version__
print('ok')"
# The forward and backward of test_numpy.py's reference, from the installed package.
cp "$repo/python/tests/ref_layer.py" "$tmp/elsewhere/"
check wheel/cpu_forward_backward 0 'ok' -- env -u MOK_LIB "$py" -c "
import mok
from ref_layer import GRADS, inputs, layer_f64, make_layer, rel_err
L = make_layer(40, 64, 32, 8, 2, 32, seed=3)
y, saved = mok.forward(*inputs(L))
g = mok.backward(L['dy'], *inputs(L), saved=saved)
want = layer_f64(L, round_like_mok=True)
errs = [rel_err(mok.bf16_to_f32(y), want['y'])]
errs += [rel_err(mok.bf16_to_f32(getattr(g, n)) if n != 'd_topk_weights' else g.d_topk_weights,
                 want[n]) for n in GRADS]
assert max(errs) < 1e-2, errs
print('ok')"
check wheel/command 0 '^mok [0-9]+\.[0-9]+\.[0-9]+ .*backends built: cpu' -- "$tmp/venv/bin/mok" info
check wheel/python_m_mok 0 'run: PASS' -- \
  "$py" -m mok run --shape fine-7b --scale 1/64 --backend cpu --check-rows 2

check_done
