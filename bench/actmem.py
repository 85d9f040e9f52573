"""actmem.py: activation memory per token, what one layer keeps from its forward for its backward
(issue 41), for mok and for the benchmark's PyTorch baselines (bench/layers.py), as a markdown
table. Activation memory is what limits the batch in training: weights, their gradients and the
workspace do not grow with it.

  mok     mok_saved_bytes(ws, T) / T at the shape's T: the caller's `saved` of one call (src/layout.c:
          the schedule, gu and hw of every routed row with each expert's rows padded to 128 for the
          worst routing, the shared expert's gus and hs; the same on both backends and at BF16 and
          FP8). Split by DESIGN §2.4's accounting, which must leave only the schedule.
  torch   what autograd keeps between forward and backward of grouped_mm_moe (and loop_moe),
          seen by torch.autograd.graph.saved_tensors_hooks, each storage once, the layer's inputs
          (x, the routing, the weights) left out: mok's backward takes those again too. Measured
          at T = 32, 64 and 96 with zero weights (what is saved does not depend on the values);
          the three must lie on one line a*T + b, evaluated at the shape's T.

The workspace (mok_workspace_bytes, on the backend that ran) is reported apart: the layers of one
size share it (the Python binding keeps one per size), so it is not activation memory per layer.

    python3 bench/actmem.py                  # DESIGN §7's shapes, on the CPU (minutes; mok's CPU
                                             # workspace for qwen3-235b needs 20 GB of memory)
    python3 bench/actmem.py --device cuda    # mok's CUDA workspace, the baselines on the GPU
    python3 bench/actmem.py --smoke          # tiny shapes, seconds
"""
import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "python")]

import torch  # noqa: E402

import layers  # noqa: E402
from shapes import SHAPES, SMOKE  # noqa: E402

import mok  # noqa: E402

TILE_M = 128            # each expert's routed rows are padded to this (DESIGN §2)
MEASURE_T = (32, 64, 96)


def mok_saved(shape, device):
    """(saved bytes of a call of shape.T tokens, workspace bytes), from the library."""
    ctx = mok.core.Context("cuda" if device == "cuda" else "cpu")
    ws = mok.core.Workspace(ctx, (shape.H, shape.I, shape.I_s, shape.E, shape.k), shape.T)
    try:
        return ws.saved_bytes(shape.T), ws.bytes
    finally:
        ws.close()
        ctx.close()


def mok_parts(shape, saved):
    """DESIGN §2.4's accounting of saved (bytes of a call): routed gu and hw (6 I bytes a row, rows padded
    to 128 per expert for the worst routing), the shared expert's gus and hs (6 I_s a token) and
    the schedule, which is what is left and must be small."""
    slots = shape.T * shape.k
    rows = -(-(slots + min(shape.E, slots) * (TILE_M - 1)) // TILE_M) * TILE_M
    routed, shared = rows * 6 * shape.I, shape.T * 6 * shape.I_s
    schedule = saved - routed - shared
    # The schedule: per routed row its source and weight (and a word per 128-row block), per slot
    # its row, per expert its count and offset, and the header (each part 256-byte aligned).
    if not 0 < schedule <= rows * 8 + rows // TILE_M * 4 + slots * 4 + shape.E * 8 + 4096:
        raise AssertionError(f"{shape.name}: saved ({saved} bytes) is not DESIGN §2.4's gu, hw, "
                             f"gus and hs ({routed + shared}) plus a schedule")
    return dict(routed=routed, shared=shared, schedule=schedule, padding=rows / slots - 1)


def torch_saved(fn, shape, tokens, device):
    """Bytes of every storage autograd keeps for fn's backward, by (dtype, row width)."""
    g = torch.Generator(device=device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    topk_weights, topk_ids = torch.randn(tokens, shape.E, generator=g, device=device) \
        .softmax(-1).topk(shape.k, dim=-1)
    ins = dict(x=torch.randn(tokens, shape.H, generator=g, device=device).to(torch.bfloat16),
               topk_ids=topk_ids.to(torch.int32), topk_weights=topk_weights.contiguous(),
               w_gate=torch.zeros(shape.E, shape.I, shape.H, **bf),
               w_up=torch.zeros(shape.E, shape.I, shape.H, **bf),
               w_down=torch.zeros(shape.E, shape.H, shape.I, **bf))
    if shape.I_s:
        ins.update(ws_gate=torch.zeros(shape.I_s, shape.H, **bf),
                   ws_up=torch.zeros(shape.I_s, shape.H, **bf),
                   ws_down=torch.zeros(shape.H, shape.I_s, **bf))
    for v in ins.values():
        v.requires_grad_(v.is_floating_point())
    inputs = {v.untyped_storage().data_ptr() for v in ins.values()}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in inputs:
            kept[s.data_ptr()] = (s.nbytes(), t.dtype, t.shape[-1] if t.dim() > 1 else 1)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(**ins)
    assert y.requires_grad
    groups = {}
    for n, dtype, width in kept.values():
        groups[dtype, width] = groups.get((dtype, width), 0) + n
    return groups


def torch_per_token(fn, shape, device):
    """Bytes per token at shape.T (a*T + b over T, from MEASURE_T) and a's split by (dtype, width)."""
    runs = [torch_saved(fn, shape, t, device) for t in MEASURE_T]
    (t0, t1, t2), (n0, n1, n2) = MEASURE_T, [sum(r.values()) for r in runs]
    a, b = (n1 - n0) / (t1 - t0), n0 - (n1 - n0) / (t1 - t0) * t0
    if n2 != a * t2 + b or a != int(a):
        raise AssertionError(f"{shape.name} {fn.__name__}: saved bytes {n0}, {n1}, {n2} at T = "
                             f"{MEASURE_T} are not a * T + b")
    split = {k: (runs[1].get(k, 0) - runs[0].get(k, 0)) / (t1 - t0) for k in runs[1]}
    return dict(per_token=a + b / shape.T, a=int(a), b=int(b), split=split)


def _dims(shape, width):
    names = [n for n in ("I", "H", "I_s") if getattr(shape, n) == width]
    return "/".join(names) or str(width)


def describe_torch(shape, r):
    """The two largest (dtype, width) groups: rows of that width per token and their share."""
    out = []
    for (dtype, width), n in sorted(r["split"].items(), key=lambda kv: -kv[1])[:2]:
        size = torch.empty(0, dtype=dtype).element_size()
        name = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype)[6:])
        out.append(f"{n / (width * size):g} {name} x {_dims(shape, width)} "
                   f"{100 * n / r['a']:.0f} %")
    return ", ".join(out)


def describe_mok(p, saved):
    out = [f"gu, hw {100 * p['routed'] / saved:.0f} % (rows +{100 * p['padding']:.1f} %)"]
    if p["shared"]:
        out.append(f"shared {100 * p['shared'] / saved:.0f} %")
    out.append(f"schedule {100 * p['schedule'] / saved:.1f} %")
    return ", ".join(out)


def table(shapes, device, log=print):
    gmm = layers.grouped_mm_available(device) is None
    base = "grouped_mm" if gmm else "loop"
    rows = [f"| shape | T | mok saved B/token | torch {base} saved B/token | mok / torch | "
            "mok: parts (share) | torch: rows kept per token (share) |", "|---|---:|---:|---:|---:|---|---|"]
    notes, workspace = [], []
    for s in shapes:
        saved, ws_bytes = mok_saved(s, device)
        parts = mok_parts(s, saved)
        t = torch_per_token(layers.grouped_mm_moe if gmm else layers.loop_moe, s, device)
        if gmm:  # the loop must save the same per token: grouped_mm adds only its offsets
            loop = torch_per_token(layers.loop_moe, s, device)
            if loop["a"] != t["a"]:
                raise AssertionError(f"{s.name}: the loop saves {loop['a']} B/token, "
                                     f"grouped_mm {t['a']}")
            notes.append(f"{s.name} {t['b'] - loop['b']}")
        rows.append(f"| {s.name} | {s.T} | {saved / s.T:,.0f} | {t['per_token']:,.0f} | "
                    f"{saved / s.T / t['per_token']:.2f} | {describe_mok(parts, saved)} | "
                    f"{describe_torch(s, t)} |")
        workspace.append(f"{s.name} {ws_bytes / 2 ** 30:.3g}")
        log(rows[-1])
    text = "\n".join(rows) + "\n\n"
    if notes:
        text += ("The per-expert loop saves the same bytes per token as grouped_mm; grouped_mm "
                 "adds its offsets, per call: " + ", ".join(notes) + " bytes.\n")
    text += (f"mok's workspace on the {device.upper()} backend (GiB), shared by the layers of "
             "one size, not per layer: " + ", ".join(workspace) + ".\n")
    return text


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="mok's backend and the baselines' device (default cpu)")
    p.add_argument("--shapes", default="", help="comma-separated names (default: all of §7)")
    p.add_argument("--smoke", action="store_true", help="the tiny shapes of shapes.py")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    shapes = SMOKE if args.smoke else SHAPES
    if args.shapes:
        want = args.shapes.split(",")
        shapes = [s for s in SHAPES + SMOKE if s.name in want]
        if len(shapes) != len(want):
            p.error(f"--shapes: expected names among {[s.name for s in SHAPES + SMOKE]}")
    print(table(shapes, args.device, log=lambda r: print(r, file=sys.stderr, flush=True)))


if __name__ == "__main__":
    main()
