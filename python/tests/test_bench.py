"""test_bench.py: bench/shapes.py agrees with the table of DESIGN.md §7, and (with torch) the
benchmark harness runs end to end on its tiny --smoke shapes."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from shapes import SHAPES  # noqa: E402


def test_shapes_match_design_md():
    text = (ROOT / "DESIGN.md").read_text()
    section = text[text.index("## 7."):]
    rows = re.findall(r"^\| ([\w.-]+)(?: \([^)]*\))? \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) "
                      r"\| (\d+) \|$", section, flags=re.M)
    design = [(n, *map(int, v)) for n, *v in rows]
    assert design == [tuple(s) for s in SHAPES]


def test_bench_smoke(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "r"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--out",
                           str(out), "--budget", "0.05", "--min-reps", "2", "--max-reps", "3",
                           "--cpu-budget", "0.05"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "bench.json").read_text())
    assert res["check"]["summary"].startswith("OK"), res["check"]
    impls = {r["impl"] for r in res["results"]}
    assert {"torch grouped_mm", "torch grouped_mm deterministic", "torch loop"} <= impls
    assert all(r["status"] == "ok" for r in res["results"]), res["results"]
    assert "| shape | impl |" in (out / "bench.md").read_text()
    # It says it wrote the chart exactly when it did (without matplotlib it does not).
    wrote = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines()
             if "wrote " in line]
    assert len(wrote) == 1 and ("bench.png" in wrote[0]) == (out / "bench.png").exists(), wrote


def test_bench_smoke_fp8(tmp_path):
    """--precision fp8: mok's FP8 layer and PyTorch's (off the GPU a loop of torch._scaled_mm per
    expert) beside the BF16 rows, checked against the reference, with the FP8 ceiling and the
    FP8 table."""
    pytest.importorskip("torch")
    out = tmp_path / "r"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--smoke", "--shapes",
                           "smoke-routed", "--no-loop", "--precision", "fp8", "--out", str(out),
                           "--budget", "0.05", "--min-reps", "2", "--max-reps", "2",
                           "--cpu-budget", "0.05"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((out / "bench.json").read_text())
    check = res["check"]
    assert check["summary"].startswith("OK") and "fp8 mok_vs_reference" in check, check
    assert 0.01 < check["fp8 torch_vs_reference"] < 0.10, check
    rows = {r["impl"].split(" (")[0]: r for r in res["results"]}
    assert {"mok", "fp8 mok", "fp8 torch scaled_grouped_mm"} <= set(rows), rows.keys()
    assert all(r["status"] == "ok" for r in res["results"]), res["results"]
    assert rows["fp8 mok"]["vs_mok_bf16_step"] > 0 and res["ceiling"]["fp8"]["tflops"] > 0
    assert "| shape | impl | vs bf16 fwd |" in (out / "bench.md").read_text()


def test_router_bench_smoke(tmp_path):
    """bench/router.py on the tiny shapes: every implementation timed, mok's bits repeat."""
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "router.py"), "--smoke",
                           "--device", "cpu", "--budget", "0.01", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "router.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == {"mok", "torch", "torch router + mok layer", "mok router",
                                        "torch router"}
    assert "| shape | implementation |" in proc.stdout


def test_gpu_samples_mean_and_skip_what_does_not_parse():
    pytest.importorskip("torch")
    from measure import GpuSamples, mean_samples
    assert mean_samples("1500, 600.5\n1700, 700.5\n[N/A], [N/A]\n\n") == (1600.0, 650.5)
    assert mean_samples("") == (None, None)
    with GpuSamples("cpu") as s:  # no GPU to sample: nothing started, nothing reported
        pass
    assert s.proc is None and s.mhz is None and s.watts is None


def test_kernels_figure_draws(tmp_path):
    """docs/figures/kernels.py (the picture of docs/kernels.md) runs and writes a PNG."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "kernels.png"
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "figures" / "kernels.py"),
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_actmem_smoke():
    """bench/actmem.py on the tiny shapes: mok's column is mok_saved_bytes / T, the same at FP8
    (and on the CUDA backend where there is one); the baselines keep what their autograd graph
    says, per routed row: x's row (bf16), g, silu(g), u and h (bf16), the combine's fp32 copy of
    the output row and its weighted product (fp32), the row's token and order (int64) and weight
    (fp32); per token the shared expert's g, silu(g), u and h."""
    torch = pytest.importorskip("torch")
    import actmem
    import layers
    from shapes import SMOKE
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "actmem.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in proc.stdout.splitlines()
            if line.startswith("| smoke")}
    assert set(rows) == {s.name for s in SMOKE}, proc.stdout
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for s in SMOKE:
        saved = {d: actmem.mok_saved(s, d)[0] for d in devices}
        ctx = actmem.mok.core.Context("cpu")
        dims = (s.H, s.I, s.I_s, s.E, s.k)
        bf16, fp8 = (actmem.mok.core.Workspace(ctx, (*dims, p), s.T) for p in ("bf16", "fp8"))
        assert bf16.saved_bytes(s.T) == fp8.saved_bytes(s.T) == saved["cpu"]
        assert len(set(saved.values())) == 1, saved
        bf16.close(), fp8.close(), ctx.close()
        assert rows[s.name][2] == f"{saved['cpu'] / s.T:,.0f}", rows[s.name]
        for fn in (layers.loop_moe, layers.grouped_mm_moe):
            if fn is layers.grouped_mm_moe and layers.grouped_mm_available("cpu") is not None:
                continue
            r = actmem.torch_per_token(fn, s, "cpu")
            assert r["a"] == s.k * (2 * s.H + 8 * s.I + 8 * s.H + 8 + 8 + 4) + 8 * s.I_s, r
            assert r["b"] == (4 * s.E if fn is layers.grouped_mm_moe else 0), r
