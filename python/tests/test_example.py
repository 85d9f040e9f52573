"""test_example.py: examples/check_training.py on its CPU configuration (a tiny model, 3 steps,
the CPU backend): two mok runs bit-identical, mok's held-out loss within 2 % of the PyTorch
MoE's and the FP8 run's within 2 % of BF16's, the records written. Keeps the example from rotting; the real check runs on a GPU
(tools/gpu-check.sh train). Skipped without torch."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import check_training  # noqa: E402


def test_training_check_on_cpu(tmp_path):
    lines = []
    rc = check_training.main(["--preset", "tiny", "--device", "cpu", "--steps", "3",
                              "--max-bytes", "200000", "--eval-batches", "1", "--log-every", "1",
                              "--fp8", "--out", str(tmp_path)], log=lines.append)
    assert rc == 0, "\n".join(lines)
    runs = json.loads((tmp_path / "curves.json").read_text())
    assert set(runs) == {"mok", "mok-repeat", "torch", "mok-fp8"}
    assert runs["mok-fp8"]["precision"] == "fp8"
    assert runs["mok-fp8"]["loss_bits"] != runs["mok"]["loss_bits"]  # it did run in FP8
    assert runs["mok"]["loss_bits"] == runs["mok-repeat"]["loss_bits"]
    assert all(len(r["loss"]) == 3 for r in runs.values())
    assert runs["mok"]["loss"][-1] < runs["mok"]["loss"][0]  # it learns
    assert "training check: ok" in lines
