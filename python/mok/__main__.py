"""The mok command (tools/mok.c), as `python -m mok` and as the `mok` a pip install puts on PATH:
it runs the binary built into the package (or, in the repository, build/mok)."""
import os
import sys
from pathlib import Path


def command_path():
    here = Path(__file__).resolve().parent
    inside = here / "bin" / "mok"
    return inside if inside.is_file() else (here / ".." / ".." / "build" / "mok").resolve()


def main():
    exe = command_path()
    if not exe.is_file():
        sys.exit(f"mok: {exe} not found; run `make` in the repository root or pip install mok")
    os.execv(exe, ["mok"] + sys.argv[1:])


if __name__ == "__main__":
    main()
