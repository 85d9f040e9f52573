"""setup.py: what pyproject.toml cannot say: the package's version is mok.h's, building the
package runs make for build/libmok.so and build/mok and puts both inside it, and the wheel is
tagged for this platform (it holds native code) but any Python 3 (ctypes loads the library)."""
import os
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def version():
    h = (ROOT / "include" / "mok.h").read_text()
    part = lambda p: re.search(rf"#define MOK_VERSION_{p} (\d+)", h).group(1)
    return ".".join(part(p) for p in ("MAJOR", "MINOR", "PATCH"))


class BuildWithMake(build_py):
    """build_py, then make's libmok.so and mok command copied into the built package."""

    def run(self):
        super().run()
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
        subprocess.run(["make", "-C", str(ROOT), "build/libmok.so", "build/mok"], env=env,
                       check=True)
        pkg = Path(self.build_lib) / "mok"
        (pkg / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "build" / "libmok.so", pkg / "libmok.so")
        shutil.copy2(ROOT / "build" / "mok", pkg / "bin" / "mok")


class NativeCode(Distribution):
    def has_ext_modules(self):
        return True


class AnyPython3(bdist_wheel):
    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


(ROOT / "build" / "python").mkdir(parents=True, exist_ok=True)  # setuptools' own files go here
setup(version=version(), distclass=NativeCode,
      cmdclass={"build_py": BuildWithMake, "bdist_wheel": AnyPython3},
      options={"build": {"build_base": "build/python"}, "egg_info": {"egg_base": "build/python"}})
