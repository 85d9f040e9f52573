"""test_nccl_load.py: which libnccl.so.2 mok takes for its NCCL groups (src/nccl.c), with the
stand-in NCCL libraries make test builds (tests/nccl_stub.c) first on the loader's path: a release
earlier than the headers mok was built with is refused with a message naming both, a later one
is taken. Each case runs in a process of its own (mok loads NCCL once). Skipped where the
stand-ins are not built (a build without CUDA has no NCCL groups)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mok import _lib

STUBS = Path(_lib.library_path()).parent / "nccl-stub"
pytestmark = pytest.mark.skipif(not STUBS.is_dir(), reason=f"no stand-in NCCLs in {STUBS}")

NCCL_ID = """
import mok
try:
    print("id", mok.nccl_id().hex())
except mok.MokUnsupported as e:
    print("refused:", e.message)
"""


def nccl_id_with(release):
    env = dict(os.environ, LD_LIBRARY_PATH=str(STUBS / release))
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, "-c", NCCL_ID], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_earlier_nccl_refused():
    out = nccl_id_with("2.27.0")
    assert out.startswith("refused: libnccl.so.2 is NCCL 2.27.0;") and "or a later one" in out, out


def test_later_nccl_taken():
    assert nccl_id_with("2.99.0") == "id " + "2a" * 128
