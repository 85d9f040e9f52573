"""fp8_table.py: the table of tools/gpu-check.sh fp8: for each shape, `mok bench`'s median forward
and backward at --precision bf16 and fp8 (the JSON files DIR/SHAPE-bf16.json, DIR/SHAPE-fp8.json),
FP8's TFLOP/s and its speed-up over BF16 (forward + backward), as a markdown table.

    python3 tools/fp8_table.py DIR
"""
import json
import sys
from pathlib import Path


def main(d):
    d = Path(d)
    shapes = sorted({p.name.rsplit("-", 1)[0] for p in d.glob("*-bf16.json")} |
                    {p.name.rsplit("-", 1)[0] for p in d.glob("*-fp8.json")})
    print("| shape | bf16 fwd ms | bf16 bwd ms | fp8 fwd ms | fp8 bwd ms | fp8 fwd+bwd TFLOP/s "
          "| speed-up | bits repeat |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for s in shapes:
        r = {}
        for p in ("bf16", "fp8"):
            f = d / f"{s}-{p}.json"
            r[p] = json.loads(f.read_text()) if f.exists() else None
        b, e = r["bf16"], r["fp8"]
        cell = lambda j, k: f"{j[k]:.3f}" if j else "failed"
        if b and e:
            tb = b["forward_ms"] + b["backward_ms"]
            te = e["forward_ms"] + e["backward_ms"]
            flops = e["forward_flops"] + e["backward_flops"]
            rate, speed = f"{flops / te / 1e9:.0f}", f"{tb / te:.2f}"
        else:
            rate = speed = "-"
        bits = "/".join("yes" if j and j["identical_bits"] else "NO" for j in (b, e))
        print(f"| {s} | {cell(b, 'forward_ms')} | {cell(b, 'backward_ms')} | "
              f"{cell(e, 'forward_ms')} | {cell(e, 'backward_ms')} | {rate} | {speed} | {bits} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
