"""fp8.py: the FP8 side of the benchmark (DESIGN.md §8, issue 38): the PyTorch FP8 baseline and the
FP8 ceiling, both on what torch offers on sm_90.

  fp8_grouped_mm_moe  the layer of layers.grouped_mm_moe with every product on e4m3 operands
                      with row-wise fp32 scales (amax / 448, per row along the product's K):
                      torch._scaled_grouped_mm for the experts' forward products and their
                      dgrads, torch._scaled_mm for the shared expert's. torch has no FP8 form of
                      the weight gradients that this layer can use on sm_90 (a grouped product
                      along the tokens), so those stay BF16: torch._grouped_mm (routed) and a
                      matmul (shared). The weights' e4m3 copies (both orientations) are made once
                      per weight version, outside the timed calls, as mok's are.
  fp8_gemm_tflops     the ceiling: torch._scaled_mm of two n x n e4m3 matrices (per-tensor
                      scales, fast accumulation: the tensor cores' own rate), `reps` in a row.

Where torch._scaled_grouped_mm is missing (the CPU), each grouped product runs as a loop of
torch._scaled_mm over the groups, so that the harness and the numbers' meaning can be checked
without a GPU; the row's note says so.
"""
import statistics

import torch
import torch.nn.functional as F

from layers import _combine, _route
from measure import Clock, GpuSamples

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BF16 = torch.bfloat16
_SGMM = getattr(torch, "_scaled_grouped_mm", None)


def quantize_rows(t):
    """e4m3 codes of t [..., K] and one fp32 scale per row (amax / 448, so amax maps to 448):
    the row-wise scaling torch._scaled_mm and torch._scaled_grouped_mm take."""
    amax = t.detach().abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (t.detach().float() / scale).to(E4M3), scale.squeeze(-1)


def _loop_sgmm(qa, qb, sa, sb, offs, out_dtype=BF16):
    """torch._scaled_grouped_mm(qa [M, K], qb [G, K, N] column-major, sa [M], sb [G, N], offs) as
    a loop of torch._scaled_mm (rows past offs[-1] stay zero)."""
    out = torch.zeros(qa.shape[0], qb.shape[2], dtype=out_dtype, device=qa.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = torch._scaled_mm(qa[start:end], qb[g], sa[start:end, None],
                                              sb[g][None, :], out_dtype=out_dtype)
        start = end
    return out


def sgmm_available(device):
    """None if torch._scaled_grouped_mm runs here (on a tiny problem), else why not."""
    if _SGMM is None:
        return "torch._scaled_grouped_mm is missing in this torch"
    try:
        a = torch.ones(32, 32, device=device).to(E4M3)
        b = torch.ones(2, 16, 32, device=device).to(E4M3).transpose(1, 2)
        out = _SGMM(a, b, torch.ones(32, device=device), torch.ones(2, 16, device=device),
                    offs=torch.tensor([16, 32], device=device, dtype=torch.int32),
                    out_dtype=BF16)
        if not torch.equal(out.float(), torch.full((32, 16), 32.0, device=device)):
            return "torch._scaled_grouped_mm gave a wrong result on a probe"
    except Exception as e:  # noqa: BLE001 - any failure means: the loop of _scaled_mm
        msg = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        return f"torch._scaled_grouped_mm failed here: {type(e).__name__}: {msg}"
    return None


_GROUPED = None  # torch._scaled_grouped_mm, or _loop_sgmm where it does not run (set by use())


def use(device):
    """Picks the grouped FP8 product for `device`; returns None, or why the loop runs instead."""
    global _GROUPED
    reason = sgmm_available(device)
    _GROUPED = _loop_sgmm if reason else _SGMM
    return reason


# The weights' e4m3 copies, as a training step would make them once per optimizer step: for each
# weight [.., N, K], its codes and row scales, and those of its transpose [.., K, N].
_copies = {}


def forget():
    """Drops the weights' e4m3 copies (after a shape)."""
    _copies.clear()


def _weights8(w):
    key = (w.data_ptr(), w._version, tuple(w.shape))
    if key not in _copies:
        if len(_copies) > 64:
            _copies.clear()
        wt = w.detach().transpose(-1, -2).contiguous()
        _copies[key] = (*quantize_rows(w), *quantize_rows(wt))
    return _copies[key]


class _GroupedLinear8(torch.autograd.Function):
    """out [M, N] = a [M, K] by w [G, N, K] per group of rows (offs): FP8 forward and dgrad, BF16
    weight gradient."""

    @staticmethod
    def forward(ctx, a, w, offs):
        ctx.save_for_backward(a, w, offs)
        qa, sa = quantize_rows(a)
        qw, sw, _, _ = _weights8(w)
        return _GROUPED(qa, qw.transpose(1, 2), sa, sw, offs=offs, out_dtype=BF16)

    @staticmethod
    def backward(ctx, g):
        a, w, offs = ctx.saved_tensors
        g = g.contiguous()
        qg, sg = quantize_rows(g)
        _, _, qwt, swt = _weights8(w)
        da = _GROUPED(qg, qwt.transpose(1, 2), sg, swt, offs=offs, out_dtype=BF16)
        dw = torch._grouped_mm(g.t(), a, offs=offs)  # BF16: [G, N, K]
        return da, dw, None


class _Linear8(torch.autograd.Function):
    """out [M, N] = a [M, K] by w [N, K]: FP8 forward and dgrad (torch._scaled_mm, row-wise),
    BF16 weight gradient."""

    @staticmethod
    def forward(ctx, a, w):
        ctx.save_for_backward(a, w)
        qa, sa = quantize_rows(a)
        qw, sw, _, _ = _weights8(w)
        return torch._scaled_mm(qa, qw.t(), sa[:, None], sw[None, :], out_dtype=BF16)

    @staticmethod
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        g = g.contiguous()
        qg, sg = quantize_rows(g)
        _, _, qwt, swt = _weights8(w)
        da = torch._scaled_mm(qg, qwt.t(), sg[:, None], swt[None, :], out_dtype=BF16)
        return da, g.t() @ a


def fp8_grouped_mm_moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None,
                       ws_up=None, ws_down=None):
    order, tok, counts = _route(topk_ids, w_gate.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[tok]
    g = _GroupedLinear8.apply(xs, w_gate, offs)
    u = _GroupedLinear8.apply(xs, w_up, offs)
    o = _GroupedLinear8.apply(F.silu(g) * u, w_down, offs)
    if ws_gate is None:
        shared = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    else:
        a = F.silu(_Linear8.apply(x, ws_gate)) * _Linear8.apply(x, ws_up)
        shared = _Linear8.apply(a, ws_down).float()
    return _combine(x, o, order, tok, topk_weights, shared)


def fp8_gemm_tflops(device, n=8192, reps=20):
    """The FP8 ceiling: torch._scaled_mm of two random n x n e4m3 matrices (B column-major, as
    it must be), per-tensor scales, bf16 out, fast accumulation; `reps` in a row, with the GPU's
    mean clock and power meanwhile."""
    a = torch.randn(n, n, device=device).to(E4M3)
    b = torch.randn(n, n, device=device).to(E4M3).t()
    one = torch.ones((), device=device)
    mm = lambda: torch._scaled_mm(a, b, one, one, out_dtype=BF16,
                                  use_fast_accum=torch.device(device).type == "cuda")
    clock = Clock(device)
    for _ in range(3):
        mm()
    clock.sync()
    pairs = []
    with GpuSamples(device) as gpu:
        for _ in range(reps):
            s = clock.mark()
            mm()
            pairs.append((s, clock.mark()))
        ms = statistics.median(clock.ms(pairs))
    return dict(n=n, ms=ms, tflops=2 * n ** 3 / ms / 1e9, reps=reps, mhz=gpu.mhz,
                watts=gpu.watts)
