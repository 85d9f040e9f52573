"""router.py: the layer with its router included, timed beside a PyTorch router feeding the same
experts (issue 39), on the fine-grained shapes of DESIGN.md §7 (run.py's protocol: CUDA events
after warm-up, the median of the repeats, forward and backward apart).

  mok          mok's router and layer as one autograd node (MoELayer(router=...)'s path: the
               router's dx added into the layer's)
  torch        bench/layers.py's torch_router (fp32 linear, softmax or sigmoid, topk) feeding
               grouped_mm_moe (the benchmark's baseline; a loop of matmuls where
               torch._grouped_mm does not run), in deterministic mode
  torch router + mok layer   the PyTorch router feeding mok's layer (mok.moe): the same experts,
               so the difference to `mok` is the router's alone
  mok router, torch router   the two routers alone (weights out, their backward from them)

The router: softmax top-k, but on dsv3 DeepSeek-V3's (sigmoid, 8 groups of which 4 are kept,
renormalised, scale 2.5). Prints a markdown table; with --out, writes router.json beside it.

    python3 bench/router.py [--shapes fine-7b,qwen3-30b-a3b,dsv3] [--out DIR]
    python3 bench/router.py --smoke --device cpu     # the tiny shapes, seconds
"""
import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "python")]

import torch  # noqa: E402

import layers  # noqa: E402
from measure import measure  # noqa: E402
from run import deterministic  # noqa: E402
from shapes import SHAPES, SMOKE  # noqa: E402

import mok  # noqa: E402
from mok.torch_router import _RoutedMoE  # noqa: E402


def options(shape):
    if shape.name == "dsv3":
        return dict(scoring="sigmoid", n_group=8, topk_group=4, renormalize=True, scale=2.5)
    return dict(scoring="softmax", n_group=0, topk_group=0, renormalize=False, scale=1.0)


def implementations(shape, device):
    o = options(shape)
    opts = (shape.k, o["scoring"], o["n_group"], o["topk_group"], o["renormalize"], o["scale"])
    moe = (layers.grouped_mm_moe if layers.grouped_mm_available(device) is None
           else layers.loop_moe)

    def mok_layer(x, w_router, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
        return _RoutedMoE.apply(x, w_router, None, opts, 0, 0, "bf16", w_gate, w_up, w_down,
                                ws_gate, ws_up, ws_down)[0]

    def torch_layer(x, w_router, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
        ids, tw, _, _, _ = layers.torch_router(x, w_router, shape.k, **o)
        return moe(x, ids, tw, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)

    def torch_router_mok_layer(x, w_router, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
        ids, tw, _, _, _ = layers.torch_router(x, w_router, shape.k, **o)
        return mok.moe(x, ids, tw, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)

    def mok_router(x, w_router, **_):
        return mok.route(x, w_router, shape.k, **o).topk_weights

    def torch_router(x, w_router, **_):
        return layers.torch_router(x, w_router, shape.k, **o)[1]

    return [("mok", mok_layer, "layer"), ("torch", torch_layer, "layer"),
            ("torch router + mok layer", torch_router_mok_layer, "layer"),
            ("mok router", mok_router, "router"), ("torch router", torch_router, "router")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="fine-7b,qwen3-30b-a3b,dsv3")
    p.add_argument("--smoke", action="store_true", help="the tiny shapes of run.py --smoke")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of repeats per timing")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    shapes = SMOKE if args.smoke else [s for s in SHAPES if s.name in args.shapes.split(",")]
    rows = []
    for shape in shapes:
        ins, dy = layers.make_inputs(shape, device, seed=0)
        g = torch.Generator(device=device).manual_seed(1)
        w_router = (torch.randn(shape.E, shape.H, generator=g, device=device)
                    * shape.H ** -0.5).to(torch.bfloat16).requires_grad_()
        ins = {n: v for n, v in ins.items() if n not in ("topk_ids", "topk_weights")}
        ins["w_router"] = w_router
        dtw = torch.randn(shape.T, shape.k, generator=g, device=device)
        for name, fn, kind in implementations(shape, device):
            these = ins if kind == "layer" else dict(x=ins["x"], w_router=w_router)
            with deterministic():
                m = measure(fn, these, dy if kind == "layer" else dtw, budget_s=args.budget)
            rows.append(dict(shape=shape.name, impl=name, **{k: m[k] for k in (
                "fwd_ms", "bwd_ms", "bits_equal", "peak_bytes")}))
            print(f"{shape.name:14s} {name:25s} fwd {m['fwd_ms']:8.3f} ms  bwd "
                  f"{m['bwd_ms']:8.3f} ms  bits equal: {m['bits_equal']}", flush=True)
    lines = ["| shape | implementation | fwd ms | bwd ms | fwd+bwd ms | speed-up | bits equal |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        base = next(b for b in rows if b["shape"] == r["shape"] and b["impl"] == (
            "torch router" if r["impl"] in ("mok router", "torch router") else "torch"))
        tot = r["fwd_ms"] + r["bwd_ms"]
        lines.append(f"| {r['shape']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | "
                     f"{tot:.3f} | {(base['fwd_ms'] + base['bwd_ms']) / tot:.2f} | "
                     f"{'yes' if r['bits_equal'] else 'no'} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "router.json").write_text(json.dumps(dict(
            device=str(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu",
            commit=os.environ.get("MOK_COMMIT"), rows=rows)) + "\n")
    return 0 if all(r["bits_equal"] for r in rows if r["impl"].startswith("mok")) else 1


if __name__ == "__main__":
    sys.exit(main())
