"""conftest.py: makes `import mok` find python/mok when pytest runs from the repository root
(`make test` sets MOK_LIB=build/libmok.so)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
