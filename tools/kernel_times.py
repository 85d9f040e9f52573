"""kernel_times.py: the table of tools/kernel-times.sh: the kernels of one forward and one backward
of a benchmark shape, from an ncu CSV of `mok bench --warmup 0 --repeat 1` (its stdout in the same
file gives the kernels per call), each with its time and, for the GEMMs, its TFLOP/s.
Usage: python3 tools/kernel_times.py SHAPE FILE"""
import csv
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from shapes import SHAPES, gemm_products  # noqa: E402

# ncu writes "ns", "us", ... (2025 onwards) or "nsecond", "usecond", ... (earlier).
UNITS = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6,
         "nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}


def launches(text):
    """[(kernel name, microseconds)] in launch order, from ncu's CSV rows."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        raise SystemExit("no ncu CSV header in the file")
    out = []
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        out.append((row["Kernel Name"], float(row["Metric Value"].replace(",", "")) *
                    UNITS[row["Metric Unit"]]))
    return out


def table(shape_name, text):
    s = next(x for x in SHAPES if x.name == shape_name)
    m = re.search(r"kernels per call \(CUDA graph kernel nodes\): forward (\d+), backward (\d+)",
                  text)
    if not m:
        raise SystemExit("no 'kernels per call' line: was the file written by mok bench on cuda?")
    nf, nb = int(m.group(1)), int(m.group(2))
    runs = launches(text)
    if len(runs) < nf + nb:
        raise SystemExit(f"{len(runs)} kernels profiled, fewer than one call ({nf} + {nb})")
    last = runs[-(nf + nb):]
    rows = []
    fwd_g, bwd_g = gemm_products(s)
    for direction, part, gemms in (("forward", last[:nf], fwd_g), ("backward", last[nf:], bwd_g)):
        g = iter(gemms)
        for name, us in part:
            short = re.sub(r"^void |\(.*$", "", name)
            if short.startswith("layer_forward"):  # every forward product, phases of one launch
                rest = list(g)
                label = " + ".join(["dispatch"] + [l for l, _ in rest] + ["combine"])
                flops = sum(f for _, f in rest)
            else:
                label, flops = next(g, ("?", 0)) if short.startswith("gemm_") else (short, 0)
            rows.append((direction, label, short, us, flops / us / 1e6 if flops else None))
    lines = [f"{shape_name}: one forward and one backward, ncu (clocks and caches not controlled)",
             "| direction | kernel | launch | us | TFLOP/s |", "|---|---|---|---:|---:|"]
    for d, label, short, us, tf in rows:
        lines.append(f"| {d} | {label} | {short} | {us:.1f} | {'' if tf is None else f'{tf:.0f}'} |")
    for d in ("forward", "backward"):
        total = sum(us for dd, _, _, us, _ in rows if dd == d)
        lines.append(f"| {d} | all |  | {total:.1f} |  |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(table(sys.argv[1], Path(sys.argv[2]).read_text(errors="replace")))
