"""numpy_api.py: the layer on numpy arrays with the CPU backend; needs no torch.

bf16 tensors are uint16 arrays of bf16 bits (see bf16.py), router weights float32, expert ids
int32 (int64 is converted). Arrays must be C-contiguous; mok also needs them 16-byte aligned
(numpy's allocations are) and reports a misaligned view as MokAlignmentError.

    y, saved = mok.forward(x, ids, w, w_gate, w_up, w_down)          # cached workspace
    g = mok.backward(dy, x, ids, w, w_gate, w_up, w_down, saved=saved)
    g.dx, g.d_topk_weights, g.dw_gate, ...

`Layer` holds one explicit workspace instead of the cache (fixed max_tokens).

precision="fp8" (DESIGN.md §8): every product on e4m3 operands with fp32 scales. The bf16 weights
stay the arguments: each call quantizes them (mok_quantize_weights) into an FP8 buffer it reads,
so a weight changed between calls is always taken as it is now.
"""
from collections import namedtuple

import numpy as np

from . import core
from ._lib import SAVED_ALIGN, MokError
from .validate import WEIGHTS, expert_ids_error, layer_dims

Grads = namedtuple("Grads", "dx d_topk_weights " + " ".join("d" + n for n in WEIGHTS))

_DTYPES = {"x": np.uint16, "dy": np.uint16, "topk_ids": np.int32, "topk_weights": np.float32,
           **{n: np.uint16 for n in WEIGHTS}}


def aligned_empty(nbytes, align=SAVED_ALIGN):
    """A uint8 array of nbytes whose data starts on an `align`-byte boundary."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes]


def _array(where, name, a):
    if a is None:
        return None
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{where}: {name} is a {type(a).__name__}; expected a numpy array")
    want = _DTYPES[name]
    if name == "topk_ids" and a.dtype == np.int64:  # int32 values only: astype would wrap them
        if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise ValueError(f"{where}: topk_ids has values in {a.min()}..{a.max()}, outside "
                             f"int32; expected expert ids 0..E-1")
        a = a.astype(np.int32)
    if a.dtype != want:
        hint = " of bf16 bits (mok.f32_to_bf16)" if want == np.uint16 else ""
        raise TypeError(f"{where}: {name} has dtype {a.dtype}; expected {np.dtype(want)}{hint}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{where}: {name} is not C-contiguous; pass np.ascontiguousarray({name})")
    return a


def _inputs(where, x, topk_ids, topk_weights, weights, dy=None, check_ids=True, ep=1):
    arrs = {n: _array(where, n, a) for n, a in
            [("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
             *zip(WEIGHTS, weights), ("dy", dy)]}
    shapes = {n: (None if a is None else a.shape) for n, a in arrs.items()}
    t, dims = layer_dims(where, **shapes, ep=ep)
    ids = arrs["topk_ids"]
    if check_ids and ids.size and (ids.min() < 0 or ids.max() >= dims.experts):
        raise expert_ids_error(where, int(ids.min()), int(ids.max()), dims.experts)
    return t, dims, arrs


def _addr(a):
    return 0 if a is None else a.ctypes.data


def _wptrs(arrs):
    return [_addr(arrs[n]) for n in WEIGHTS]


class Layer:
    """An explicit CPU workspace for one layer shape, up to max_tokens tokens per call.

    With group=mok.EPGroup(R) and rank=r it is rank r of R emulated expert-parallel ranks:
    `experts` counts all of them, the weights passed are rank r's E/R experts (global ids
    r*E/R ..), topk_ids are global ids, and every rank calls forward/backward at the same time
    from its own thread; each gets the outputs of its own tokens (DESIGN.md §2.3)."""

    def __init__(self, hidden, inter, experts, top_k, shared_inter=0, max_tokens=4096,
                 threads=None, group=None, rank=0, precision="bf16"):
        _precision("Layer", precision)
        ctx = core.Context("cpu", 0, threads, group, rank)
        self.ep = ctx.ep
        self.ws = core.Workspace(ctx, core.Dims(hidden, inter, shared_inter, experts, top_k,
                                                precision), max_tokens)

    def _call(self, fn):
        """Runs fn; on an EP rank, a mistake found in Python (before mok is called) is first told
        to the peer ranks, through a call mok refuses, so that they fail now rather than wait for
        this rank until the group's timeout."""
        try:
            return fn()
        except MokError:
            raise  # from mok: the peers know
        except (ValueError, TypeError):
            if self.ep > 1:
                try:
                    self.ws.forward(0, 0, 0, 0, (0,) * 6, 0, 0)
                except MokError:
                    pass
            raise

    def forward(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
                ws_down=None, check_ids=True):
        """Returns (y, saved): y [T, H] bf16 bits, saved the buffer backward reads."""
        return self._call(lambda: _forward(
            self.ws, "Layer.forward", x, topk_ids, topk_weights,
            (w_gate, w_up, w_down, ws_gate, ws_up, ws_down), check_ids, self.ep))

    def recompute(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None,
                  ws_up=None, ws_down=None):
        """Fills a new `saved` as forward would, without y (activation checkpointing)."""
        return self._call(lambda: _forward(
            self.ws, "Layer.recompute", x, topk_ids, topk_weights,
            (w_gate, w_up, w_down, ws_gate, ws_up, ws_down), True, self.ep, want_y=False)[1])

    def backward(self, dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None,
                 ws_up=None, ws_down=None, *, saved, grad_mode="bf16", main_grads=None):
        """As mok.backward, on this Layer's workspace."""
        return self._call(lambda: _backward(
            self.ws, "Layer.backward", dy, x, topk_ids, topk_weights,
            (w_gate, w_up, w_down, ws_gate, ws_up, ws_down), saved, grad_mode, main_grads,
            self.ep))

    def schedule_counts(self, saved, tokens):
        """Routed rows per expert, from the schedule in `saved`."""
        _check_saved("Layer.schedule_counts", self.ws, saved, int(tokens))
        return np.array(self.ws.schedule_counts(saved.ctypes.data, tokens), dtype=np.int32)

    def check(self):
        self.ws.check()


def _precision(where, precision):
    if precision not in core.PRECISIONS:
        raise ValueError(f"{where}: precision is {precision!r}; expected 'bf16' or 'fp8'")
    return precision


def _workspace(ws, where, dims, t, precision):
    """The Layer's workspace `ws` (checked against the arrays), or the cached one for dims at
    `precision` (None: the Layer's)."""
    if ws is None:
        return core.workspace(dims._replace(precision=_precision(where, precision)), t, "cpu")
    dims = dims._replace(precision=ws.dims.precision)
    if dims != ws.dims:
        raise ValueError(f"{where}: the arrays give {dims}; this Layer was made for {ws.dims}")
    return ws


def _weight_ptrs(ws, a):
    """The weights' addresses for a call on ws; at fp8 the six bf16 ones and a seventh, of an
    FP8 buffer quantized from them now (returned too: it must outlive the call)."""
    ptrs = _wptrs(a)
    if ws.dims.precision != "fp8":
        return ptrs, None
    buf = aligned_empty(ws.fp8_weights_bytes())
    ws.quantize_weights(ptrs, buf.ctypes.data)
    return ptrs + [buf.ctypes.data], buf


def _need_tokens(where, t, ep):
    if t == 0 and ep > 1:
        raise ValueError(f"{where}: T = 0; every rank of an EP group takes part in each call "
                         f"with at least one token")


def _forward(ws, where, x, topk_ids, topk_weights, weights, check_ids, ep=1, want_y=True,
             precision=None):
    """(y, saved); with want_y=False, recompute: y is None and only saved is filled."""
    t, dims, a = _inputs(where, x, topk_ids, topk_weights, weights, check_ids=check_ids, ep=ep)
    _need_tokens(where, t, ep)
    y = np.empty((t, dims.hidden), dtype=np.uint16) if want_y else None
    if t == 0:
        return y, aligned_empty(0)
    ws = _workspace(ws, where, dims, t, precision)
    saved = aligned_empty(ws.saved_bytes(t))
    w, _fp8 = _weight_ptrs(ws, a)
    ptrs = (_addr(a["x"]), _addr(a["topk_ids"]), _addr(a["topk_weights"]), w)
    if want_y:
        ws.forward(t, *ptrs, y.ctypes.data, saved.ctypes.data)
    else:
        ws.recompute(t, *ptrs, saved.ctypes.data)
    return y, saved


def _backward(ws, where, dy, x, topk_ids, topk_weights, weights, saved, grad_mode, main_grads,
              ep=1, precision=None):
    t, dims, a = _inputs(where, x, topk_ids, topk_weights, weights, dy=dy, ep=ep)
    _need_tokens(where, t, ep)
    if grad_mode == "f32":
        if main_grads is None or len(main_grads) != 6:
            raise ValueError(f"{where}: grad_mode 'f32' needs main_grads: six float32 arrays "
                             f"shaped as the weights (None for absent shared-expert ones)")
        g = list(main_grads)
        for n, gi, wi in zip(WEIGHTS, g, weights):
            if (gi is None) != (wi is None) or (gi is not None and (
                    gi.dtype != np.float32 or gi.shape != wi.shape or not gi.flags.c_contiguous)):
                raise ValueError(f"{where}: main_grads d{n} must be a C-contiguous float32 array "
                                 f"of shape {None if wi is None else wi.shape}")
    elif grad_mode == "bf16":
        g = [None if w is None else np.empty(w.shape, dtype=np.uint16) for w in weights]
    else:
        raise ValueError(f"{where}: grad_mode is {grad_mode!r}; expected 'bf16' or 'f32'")
    dx = np.empty((t, dims.hidden), dtype=np.uint16)
    dtw = np.empty((t, dims.top_k), dtype=np.float32)
    if t == 0:
        if grad_mode == "bf16":
            for gi in g:
                if gi is not None:
                    gi.fill(0)
        return Grads(dx, dtw, *g)
    ws = _workspace(ws, where, dims, t, precision)
    _check_saved(where, ws, saved, t)
    w, _fp8 = _weight_ptrs(ws, a)
    ws.backward(t, _addr(a["x"]), _addr(a["topk_ids"]), _addr(a["topk_weights"]), w,
                saved.ctypes.data, _addr(a["dy"]), dx.ctypes.data, dtw.ctypes.data,
                [_addr(gi) for gi in g], grad_mode)
    return Grads(dx, dtw, *g)


def _check_saved(where, ws, saved, t):
    """saved is a buffer a call of t tokens fills: mok reads up to ws.saved_bytes(t) of it."""
    if not isinstance(saved, np.ndarray) or saved.dtype != np.uint8:
        raise TypeError(f"{where}: saved must be the uint8 array forward returned")
    if saved.nbytes < ws.saved_bytes(t):
        raise ValueError(f"{where}: saved has {saved.nbytes} bytes; a call of {t} tokens needs "
                         f"{ws.saved_bytes(t)} (pass the buffer forward returned)")


def _host_only(backend):
    if backend != "cpu":
        raise ValueError(f"backend is {backend!r}: numpy arrays live on the host, so only 'cpu'; "
                         f"use mok.moe with CUDA tensors for the CUDA backend")


# mok_mxfp8_to_bf16 needs a workspace of the CPU backend, of any shape: this small one, cached.
_MX_DIMS = core.Dims(hidden=64, inter=64, shared_inter=0, experts=1, top_k=1)


def mxfp8_to_bf16(q, scales):
    """MXFP8 to bf16 bits (DESIGN.md §8.5): q [..., K] uint8 e4m3 codes, scales [..., K / 32]
    uint8 E8M0 bytes (one per 32 consecutive values along the last axis). Returns uint16 bf16
    bits of q's shape, exact unless a value is finer than 2^-133 (scale bytes 0..2). A scale byte
    0xff or a value of 2^128 or more raises MokInvalidArgument."""
    for name, a in (("q", q), ("scales", scales)):
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8:
            raise TypeError(f"mxfp8_to_bf16: {name} must be a uint8 numpy array, got "
                            f"{getattr(a, 'dtype', type(a).__name__)}")
    if q.ndim == 0 or q.shape[-1] % 32 or q.shape[-1] == 0:
        raise ValueError(f"mxfp8_to_bf16: q has shape {q.shape}; its last axis must be a positive "
                         f"multiple of 32")
    want = q.shape[:-1] + (q.shape[-1] // 32,)
    if scales.shape != want:
        raise ValueError(f"mxfp8_to_bf16: scales has shape {scales.shape}; expected {want}")
    q, scales = np.ascontiguousarray(q), np.ascontiguousarray(scales)
    out = np.empty(q.shape, dtype=np.uint16)
    k = q.shape[-1]
    rows = q.size // k
    if rows:
        core.workspace(_MX_DIMS, 1, "cpu").mxfp8_to_bf16(rows, k, q.ctypes.data,
                                                        scales.ctypes.data, out.ctypes.data)
    return out


def forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
            ws_down=None, *, backend="cpu", check_ids=True, precision="bf16"):
    """y = shared(x) + sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x) on the CPU backend,
    at precision 'bf16' or 'fp8'. Returns (y, saved): y [T, H] bf16 bits; saved for backward."""
    _host_only(backend)
    return _forward(None, "mok.forward", x, topk_ids, topk_weights,
                    (w_gate, w_up, w_down, ws_gate, ws_up, ws_down), check_ids,
                    precision=precision)


def backward(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
             ws_down=None, *, saved, grad_mode="bf16", main_grads=None, backend="cpu",
             precision="bf16"):
    """Gradients of the layer for dy [T, H] (bf16 bits), with the forward's inputs, precision and
    `saved`. Returns Grads(dx, d_topk_weights, dw_gate, dw_up, dw_down, dws_gate, dws_up,
    dws_down); the weight grads (of the bf16 weights) are bf16 bits, or with grad_mode='f32' the
    given float32 main_grads, added to."""
    _host_only(backend)
    return _backward(None, "mok.backward", dy, x, topk_ids, topk_weights,
                     (w_gate, w_up, w_down, ws_gate, ws_up, ws_down), saved, grad_mode,
                     main_grads, precision=precision)
