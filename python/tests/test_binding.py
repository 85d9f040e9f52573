"""test_binding.py: the ctypes declarations against the C headers (struct layouts, status names)
and the numpy bf16 conversions against the library's conversion. No torch needed."""
import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import mok
from mok import _lib

ROOT = Path(__file__).resolve().parents[2]
STRUCTS = {"mok_context_config": _lib.ContextConfig, "mok_shape": _lib.Shape,
           "mok_weights": _lib.Weights, "mok_forward_args": _lib.ForwardArgs,
           "mok_grads": _lib.Grads, "mok_backward_args": _lib.BackwardArgs,
           "mok_router_config": _lib.RouterConfig,
           "mok_router_forward_args": _lib.RouterForwardArgs,
           "mok_router_backward_args": _lib.RouterBackwardArgs}


def test_status_names_match_the_library():
    for code, (name, cls) in _lib.STATUS.items():
        assert _lib.status_name(code) == name
        assert (cls is None) == (code == 0)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_struct_layouts_match_mok_h(tmp_path):
    """Compiles a program that prints sizeof and every offsetof of mok.h's structs."""
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "mok.h"', "int main(void) {"]
    for cname, py in STRUCTS.items():
        lines.append(f'printf("{cname} size %zu\\n", sizeof({cname}));')
        for field, _ in py._fields_:
            lines.append(f'printf("{cname} {field} %zu\\n", offsetof({cname}, {field}));')
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines + ["return 0; }"]) + "\n")
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-std=c11", f"-I{ROOT / 'include'}", str(src), "-o", str(exe)],
                   check=True)
    got = {}
    for line in subprocess.run([str(exe)], check=True, capture_output=True,
                               text=True).stdout.splitlines():
        cname, field, value = line.split()
        got[cname, field] = int(value)
    for cname, py in STRUCTS.items():
        assert got[cname, "size"] == ctypes.sizeof(py), cname
        for field, _ in py._fields_:
            assert got[cname, field] == getattr(py, field).offset, (cname, field)


def test_every_mok_h_function_is_declared():
    header = (ROOT / "include" / "mok.h").read_text()
    import re
    names = set(re.findall(r"\b(mok_[a-z_]+)\s*\(", header))
    names -= {"mok_status"}  # the enum's type name, not a function
    assert names <= set(_lib._PROTOTYPES), sorted(names - set(_lib._PROTOTYPES))


def test_bf16_conversion_matches_the_library():
    rng = np.random.default_rng(0)
    specials = np.array([0.0, -0.0, 1.0, 1.00390625, 1.005859375, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8,
                         3.3895314e38, 3.4e38, np.inf, -np.inf, np.nan, -np.nan, 1e-40, -1e-42,
                         65504.0, 2 ** -126], dtype=np.float32)
    vals = np.concatenate([specials, rng.standard_normal(2000).astype(np.float32) * 100,
                           rng.integers(0, 2 ** 32, 2000, dtype=np.uint64).astype(np.uint32)
                           .view(np.float32)])
    ours = mok.f32_to_bf16(vals)
    theirs = np.array([_lib.lib.mok_f32_to_bf16(float(v)) for v in vals], dtype=np.uint16)
    assert np.array_equal(ours, theirs)
    back = np.array([_lib.lib.mok_bf16_to_f32(int(b)) for b in ours], dtype=np.float32)
    assert np.array_equal(mok.bf16_to_f32(ours).view(np.uint32), back.view(np.uint32))
