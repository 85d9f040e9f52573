"""torch_ops.py: the layer as PyTorch custom ops (mok::forward, mok::backward) with fake
implementations and autograd, so eager mode, torch.compile(fullgraph=True) and CUDA graphs work;
plus `moe()` and the `MoELayer` module. Imported by `mok` on first use of mok.moe / MoELayer.

CPU tensors run on mok's CPU backend; CUDA tensors on the CUDA backend, on the current stream.
Every host-checkable mistake (dtype, shape, device, layout) raises TypeError/ValueError naming the
argument before any C call. Expert ids out of range:
  - CPU: always checked here (ValueError).
  - CUDA: only the device can see them cheaply. The kernels flag the error in the workspace and
    leave the outputs untouched; `mok.check()` raises it (it synchronises). With MOK_DEBUG=1 (or
    mok.set_debug(True)) every CUDA forward also checks the ids before it, and every CUDA call
    runs mok_check after it, except while a CUDA graph is being captured, where both would break
    the capture.

precision="fp8" (DESIGN.md §8): the bf16 weights stay the parameters (and get bf16 gradients);
the ops make their FP8 copy with mok_quantize_weights and keep it per device and per set of
weight tensors, re-made when any of them changed since: another tensor, another data_ptr, or a
bumped version counter (an in-place update such as an optimizer step). While a CUDA graph is
being captured the quantization is captured too, so every replay quantizes the weights as they
are then.
"""
import os
import threading
import weakref
from typing import Optional

import torch
from torch import Tensor

from . import core
from ._lib import SAVED_ALIGN, TENSOR_ALIGN
from .validate import WEIGHTS, expert_ids_error, layer_dims

_debug = os.environ.get("MOK_DEBUG", "0") not in ("", "0")


def set_debug(on=True):
    """Turns the expert-id checks and mok_check after every CUDA call on or off (see above)."""
    global _debug
    _debug = bool(on)


_DTYPES = {"x": torch.bfloat16, "dy": torch.bfloat16, "topk_ids": torch.int32,
           "topk_weights": torch.float32, **{n: torch.bfloat16 for n in WEIGHTS}}


def _check(where, tensors, real, ep=1):
    """dtype, device and layout of every tensor (None = absent), then the shapes; returns (T, dims).
    `real` adds what fake tensors cannot answer: pointer alignment. `ep`: ranks of the EP group
    (the weights hold E / ep experts)."""
    dev = tensors["x"].device if isinstance(tensors.get("x"), Tensor) else None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{where}: {name} is a {type(t).__name__}; expected a torch.Tensor")
        if t.dtype != _DTYPES[name]:
            raise TypeError(f"{where}: {name} has dtype {t.dtype}; expected {_DTYPES[name]}")
        if t.device != dev:
            raise ValueError(f"{where}: {name} is on {t.device}; expected x's device {dev}")
        if not t.is_contiguous():
            raise ValueError(f"{where}: {name} is not contiguous (strides {t.stride()}); "
                             f"pass {name}.contiguous()")
        if real and t.numel() and t.data_ptr() % TENSOR_ALIGN:
            raise ValueError(f"{where}: {name} (data_ptr {t.data_ptr():#x}) is not "
                             f"{TENSOR_ALIGN}-byte aligned; pass {name}.clone()")
    if dev.type not in ("cpu", "cuda") and not (dev.type == "meta" and not real):
        raise ValueError(f"{where}: x is on {dev}; mok runs on 'cpu' or 'cuda' tensors")
    shapes = {n: (None if t is None else tuple(t.shape)) for n, t in tensors.items()}
    return layer_dims(where, **shapes, ep=ep)


def _where(dev):
    """(backend, device ordinal) for a tensor's device; meta tensors size `saved` as the CPU."""
    return ("cuda" if dev.type == "cuda" else "cpu",
            (dev.index if dev.index is not None else torch.cuda.current_device())
            if dev.type == "cuda" else 0)


def _stream(dev):
    return torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0


def _capturing(dev):
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_ids(where, ids, experts):
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= experts:
        raise expert_ids_error(where, lo, hi, experts)


def _aligned_addr(saved):
    """Address of the first SAVED_ALIGN-aligned byte of a saved tensor (it has the slack)."""
    p = saved.data_ptr()
    return p + (-p) % SAVED_ALIGN


def _saved_len(ws, t):
    """Bytes of a saved tensor for t tokens: mok's size plus the slack _aligned_addr needs."""
    return ws.saved_bytes(t) + SAVED_ALIGN - 1


def _named(x, topk_ids, topk_weights, weights, dy=None):
    """The call's tensors by argument name, for _check (dy first when given)."""
    ten = {} if dy is None else {"dy": dy}
    names = ("x", "topk_ids", "topk_weights", *WEIGHTS)
    ten.update(zip(names, (x, topk_ids, topk_weights, *weights)))
    return ten


def _ptr(t):
    return 0 if t is None else t.data_ptr()


def _precision(where, precision):
    if precision not in core.PRECISIONS:
        raise ValueError(f"{where}: precision is {precision!r}; expected 'bf16' or 'fp8'")
    return precision


# ---- FP8 weight copies --------------------------------------------------------------------------
class _FP8Copy:
    """An FP8 weight buffer (a uint8 tensor with room to align it) and what it was made from; the
    buffer is let go as soon as one of those weights is freed."""

    def __init__(self, weights, buf):
        def release(_ref, copy=self):
            copy.buf = None
        self.refs = [None if w is None else weakref.ref(w, release) for w in weights]
        self.stamp, self.buf = None, buf

    def made_from(self, weights):
        return all((r is None) == (w is None) and (r is None or r() is w)
                   for r, w in zip(self.refs, weights))

    def alive(self):
        return self.buf is not None and all(r is None or r() is not None for r in self.refs)


_fp8_lock = threading.Lock()
_fp8_copies = {}  # (dims, backend, device) -> [_FP8Copy]


def _stamp(weights):
    """What says a weight changed: its data_ptr and its version counter."""
    return tuple(None if w is None else (w.data_ptr(), w._version) for w in weights)


def _fp8_weights(ws, weights, dev, stream):
    """Address of ws's FP8 weight buffer for the bf16 tensors `weights` (None where absent),
    quantized anew unless the copy made from these very tensors is still current."""
    key, stamp = (ws.dims, ws.backend, ws.ctx.device), _stamp(weights)
    with _fp8_lock:
        for k in list(_fp8_copies):  # those whose weights are gone
            _fp8_copies[k] = [c for c in _fp8_copies[k] if c.alive()]
        copies = _fp8_copies.get(key, [])
        copy = next((c for c in copies if c.made_from(weights)), None)
        if copy is None:
            n = ws.fp8_weights_bytes() + SAVED_ALIGN - 1
            copy = _FP8Copy(weights, torch.empty(n, dtype=torch.uint8, device=dev))
            copies.append(copy)
        _fp8_copies[key] = copies
        addr = _aligned_addr(copy.buf)
        if copy.stamp != stamp or _capturing(dev):
            ws.quantize_weights([_ptr(w) for w in weights], addr, stream)
            copy.stamp = stamp
    return addr


def _weight_ptrs(ws, weights, dev, stream):
    """The call's weight addresses: the six bf16 tensors', and at fp8 the FP8 copy's."""
    ptrs = [_ptr(w) for w in weights]
    if ws.dims.precision == "fp8":
        ptrs.append(_fp8_weights(ws, weights, dev, stream))
    return ptrs


class _Device:
    """torch.cuda.device(dev) for CUDA tensors, nothing for CPU ones."""

    def __init__(self, dev):
        self.guard = torch.cuda.device(dev) if dev.type == "cuda" else None

    def __enter__(self):
        return self.guard.__enter__() if self.guard else None

    def __exit__(self, *exc):
        return self.guard.__exit__(*exc) if self.guard else False


# ---- expert-parallel groups ---------------------------------------------------------------------
# The custom ops take a group as an int (a handle here; 0 = none): their schema has no room for
# Python objects.
_groups = {}     # handle -> core.EPGroup
_pg_handles = {}  # torch.distributed process group -> handle


def ep_group(process_group=None, timeout_ms=0):
    """mok's expert-parallel group over a torch.distributed process group (default: the world),
    one process per GPU, each on its current CUDA device. Collective over the process group: its
    rank 0 makes an NCCL id and broadcasts it (over whatever backend the group has), then every
    rank joins mok's own NCCL communicator. Cached per process group. A rank that does not reach
    a call within timeout_ms (0 = 10 s) makes the others fail (mok.check raises MokTimeout)."""
    import torch.distributed as dist
    pg = dist.group.WORLD if process_group is None else process_group
    if pg in _pg_handles:
        return _groups[_pg_handles[pg]]
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    box = [core.nccl_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
    g = core.EPGroup.nccl(box[0], rank, size, torch.cuda.current_device(), timeout_ms)
    _pg_handles[pg] = _handle(g)
    return g


def _handle(g):
    """The int that names core.EPGroup g in the custom ops (registering it on first use)."""
    if g.rank is None:
        raise TypeError("an emulated EPGroup runs under mok.Layer (numpy), one thread per rank; "
                        "torch takes groups of processes (mok.ep_group)")
    for h, known in _groups.items():
        if known is g:
            return h
    h = len(_groups) + 1
    _groups[h] = g
    return h


def _group_of(group):
    """The handle of `group`: None, a core.EPGroup, or a torch.distributed process group."""
    if group is None:
        return 0
    return _handle(group if isinstance(group, core.EPGroup) else ep_group(group))


def _ep(group):
    return _groups[group].ranks if group else 1


def _rank_group(group, dev, where):
    """The core.EPGroup of handle `group` (None for 0), checked against the tensors' device."""
    g = _groups.get(group)
    if g is not None and (dev.type != "cuda" or dev.index != g.device):
        raise ValueError(f"{where}: x is on {dev}; this EP group's rank runs on cuda:{g.device}")
    return g


# ---- mok::forward -------------------------------------------------------------------------------
@torch.library.custom_op("mok::forward", mutates_args=())
def _forward_op(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor,
                w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor],
                ws_down: Optional[Tensor], max_tokens: int = 0, group: int = 0,
                precision: str = "bf16") -> tuple[Tensor, Tensor]:
    where = "mok.moe"
    weights = (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    ten = _named(x, topk_ids, topk_weights, weights)
    t, dims = _check(where, ten, real=True, ep=_ep(group))
    dims = dims._replace(precision=_precision(where, precision))
    dev = x.device
    g = _rank_group(group, dev, where)
    y = torch.empty((t, dims.hidden), dtype=torch.bfloat16, device=dev)
    if t == 0 and g is None:
        return y, torch.empty(0, dtype=torch.uint8, device=dev)
    if t == 0:
        raise ValueError(f"{where}: T = 0; every rank of an EP group takes part in each call with "
                         f"at least one token")
    backend, index = _where(dev)
    debug = backend == "cpu" or (_debug and not _capturing(dev))
    if debug:
        _check_ids(where, topk_ids, dims.experts)
    with _Device(dev):
        ws = core.workspace(dims, t, backend, index, max_tokens, g)
        saved = torch.empty(_saved_len(ws, t), dtype=torch.uint8, device=dev)
        stream = _stream(dev)
        ws.forward(t, x.data_ptr(), topk_ids.data_ptr(), topk_weights.data_ptr(),
                   _weight_ptrs(ws, weights, dev, stream), y.data_ptr(), _aligned_addr(saved),
                   stream)
        if debug and backend == "cuda":
            ws.check(stream)
    return y, saved


@_forward_op.register_fake
def _forward_fake(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                  max_tokens=0, group=0, precision="bf16"):
    ten = _named(x, topk_ids, topk_weights, (w_gate, w_up, w_down, ws_gate, ws_up, ws_down))
    t, dims = _check("mok.moe", ten, real=False, ep=_ep(group))
    dims = dims._replace(precision=_precision("mok.moe", precision))
    y = x.new_empty((t, dims.hidden))
    if isinstance(t, int):
        # Static shapes: the size comes from the library, from the workspace the call will use.
        if t == 0:
            return y, x.new_empty(0, dtype=torch.uint8)
        backend, index = _where(x.device)
        with _Device(x.device):
            ws = core.workspace(dims, t, backend, index, max_tokens, _groups.get(group))
        n = _saved_len(ws, t)
    else:
        n = torch.library.get_ctx().new_dynamic_size()  # symbolic T: a data-dependent size
    return y, x.new_empty(n, dtype=torch.uint8)


# ---- mok::backward ------------------------------------------------------------------------------
@torch.library.custom_op("mok::backward", mutates_args=())
def _backward_op(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor,
                 w_up: Tensor, w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor],
                 ws_down: Optional[Tensor], saved: Tensor, group: int = 0,
                 precision: str = "bf16") -> list[Tensor]:
    """Returns [dx, d_topk_weights, dw_gate, dw_up, dw_down, dws_gate, dws_up, dws_down]; the
    shared-expert grads are empty (I_s = 0) when there is no shared expert."""
    where = "mok.moe backward"
    weights = (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    ten = _named(x, topk_ids, topk_weights, weights, dy)
    t, dims = _check(where, ten, real=True, ep=_ep(group))
    dims = dims._replace(precision=_precision(where, precision))
    out = _grad_outputs(dy, dims, t, _ep(group))
    dev = x.device
    g = _rank_group(group, dev, where)
    if t == 0:
        for grad in out[2:]:
            grad.zero_()
        return out
    grads = out[2:5] + (out[5:] if dims.shared_inter else [None] * 3)
    _backward_call(where, dims, t, g, x, topk_ids, topk_weights, weights, saved, dy, out, grads,
                   "bf16")
    return out


def _backward_call(where, dims, t, g, x, topk_ids, topk_weights, weights, saved, dy, out, grads,
                   mode):
    """What mok::backward and mok::backward_main_grad share: saved's size checked against the
    workspace's, then the call, into out's dx and d_topk_weights and the six `grads` (None where
    there is no shared expert), written (mode "bf16") or added to ("f32")."""
    dev = x.device
    backend, index = _where(dev)
    with _Device(dev):
        ws = core.workspace(dims, t, backend, index, group=g)
        need = _saved_len(ws, t)
        if saved.dtype != torch.uint8 or saved.device != dev or saved.numel() < need:
            raise ValueError(f"{where}: saved must be the uint8 tensor of {need} bytes on {dev} "
                             f"that mok::forward returned")
        stream = _stream(dev)
        ws.backward(t, x.data_ptr(), topk_ids.data_ptr(), topk_weights.data_ptr(),
                    _weight_ptrs(ws, weights, dev, stream), _aligned_addr(saved), dy.data_ptr(),
                    out[0].data_ptr(), out[1].data_ptr(), [_ptr(gi) for gi in grads], mode,
                    stream)
        if _debug and backend == "cuda" and not _capturing(dev):
            ws.check(stream)


_MAIN = ("m_gate", "m_up", "m_down", "ms_gate", "ms_up", "ms_down")  # one per WEIGHTS


@torch.library.custom_op("mok::backward_main_grad", mutates_args=_MAIN)
def _backward_main_grad_op(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                           w_gate: Tensor, w_up: Tensor, w_down: Tensor, ws_gate: Optional[Tensor],
                           ws_up: Optional[Tensor], ws_down: Optional[Tensor], saved: Tensor,
                           m_gate: Tensor, m_up: Tensor, m_down: Tensor, ms_gate: Optional[Tensor],
                           ms_up: Optional[Tensor], ms_down: Optional[Tensor],
                           group: int = 0, precision: str = "bf16") -> list[Tensor]:
    """mok::backward with MOK_GRAD_ACCUMULATE_F32: adds the weight gradients to the main grads m*
    (fp32, one per weight, None with the weight) and returns [dx, d_topk_weights]."""
    where = "mok.moe backward"
    weights = (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    main_grads = [m for m in (m_gate, m_up, m_down, ms_gate, ms_up, ms_down) if m is not None]
    ten = _named(x, topk_ids, topk_weights, weights, dy)
    t, dims = _check(where, ten, real=True, ep=_ep(group))
    dims = dims._replace(precision=_precision(where, precision))
    _check_main_grads(where, main_grads, weights, real=True)
    out = _grad_outputs(dy, dims, t, _ep(group))[:2]
    dev = x.device
    g = _rank_group(group, dev, where)
    if t == 0:
        return out
    mg = list(main_grads) + [None] * (6 - len(main_grads))
    _backward_call(where, dims, t, g, x, topk_ids, topk_weights, weights, saved, dy, out, mg,
                   "f32")
    return out


@_backward_main_grad_op.register_fake
def _backward_main_grad_fake(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up,
                             ws_down, saved, m_gate, m_up, m_down, ms_gate, ms_up, ms_down,
                             group=0, precision="bf16"):
    weights = (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    main_grads = [m for m in (m_gate, m_up, m_down, ms_gate, ms_up, ms_down) if m is not None]
    ten = _named(x, topk_ids, topk_weights, weights, dy)
    t, dims = _check("mok.moe backward", ten, real=False, ep=_ep(group))
    _check_main_grads("mok.moe backward", main_grads, weights, real=False)
    return _grad_outputs(dy, dims, t, _ep(group))[:2]


def _check_main_grads(where, main_grads, weights, real):
    """main_grads: an fp32 tensor shaped like each weight given (three, or six with the shared
    expert), on the weights' device, contiguous (and, real, 16-byte aligned)."""
    given = [w for w in weights if w is not None]
    if len(main_grads) != len(given):
        raise ValueError(f"{where}: main_grads has {len(main_grads)} tensors; expected one per "
                         f"weight ({len(given)}: {', '.join(WEIGHTS[:len(given)])})")
    for name, m, w in zip(WEIGHTS, main_grads, given):
        if not isinstance(m, Tensor) or m.dtype != torch.float32:
            raise TypeError(f"{where}: the main grad of {name} is "
                            f"{getattr(m, 'dtype', type(m).__name__)}; expected torch.float32")
        if m.shape != w.shape or m.device != w.device or not m.is_contiguous():
            raise ValueError(f"{where}: the main grad of {name} is {tuple(m.shape)} on {m.device}"
                             f"{'' if m.is_contiguous() else ', not contiguous'}; expected "
                             f"{tuple(w.shape)} on {w.device}, contiguous")
        if real and m.numel() and m.data_ptr() % TENSOR_ALIGN:
            raise ValueError(f"{where}: the main grad of {name} is not {TENSOR_ALIGN}-byte "
                             f"aligned")


def _grad_outputs(dy, dims, t, ep=1):
    h, i, i_s, e = dims.hidden, dims.inter, dims.shared_inter, dims.experts // ep
    bf = dict(dtype=torch.bfloat16)
    return [dy.new_empty((t, h)), dy.new_empty((t, dims.top_k), dtype=torch.float32),
            dy.new_empty((e, i, h), **bf), dy.new_empty((e, i, h), **bf),
            dy.new_empty((e, h, i), **bf), dy.new_empty((i_s, h), **bf),
            dy.new_empty((i_s, h), **bf), dy.new_empty((h, i_s), **bf)]


@_backward_op.register_fake
def _backward_fake(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                   saved, group=0, precision="bf16"):
    ten = _named(x, topk_ids, topk_weights, (w_gate, w_up, w_down, ws_gate, ws_up, ws_down), dy)
    t, dims = _check("mok.moe backward", ten, real=False, ep=_ep(group))
    return _grad_outputs(dy, dims, t, _ep(group))


# ---- autograd -----------------------------------------------------------------------------------
class _MoE(torch.autograd.Function):
    """mok.moe's autograd through the custom ops. forward, setup_context and backward apart, so
    that torch.func's transforms (grad, vjp) take it as well as autograd and torch.compile. With
    main_grads, backward adds the weight gradients to them (fp32) and gives the weights none."""

    @staticmethod
    def forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                max_tokens, group, main_grads, precision):
        return torch.ops.mok.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate,
                                     ws_up, ws_down, max_tokens, group, precision)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ids, tw, wg, wu, wd, wsg, wsu, wsd, _max_tokens, group, main_grads, precision = inputs
        ctx.has_shared, ctx.group, ctx.precision = wsg is not None, group, precision
        ctx.main_grad = main_grads is not None
        ctx.save_for_backward(x, ids, tw, wg, wu, wd, wsg, wsu, wsd, output[1],
                              *(main_grads or ()))
        ctx.mark_non_differentiable(output[1])
        # Gradients of outputs that have none stay None. By default autograd would hand backward
        # a tensor of zeros the size of `saved` for that uint8 output: as much memory again as
        # saved itself, at the backward's peak.
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dy, _dsaved):
        x, ids, tw, wg, wu, wd, wsg, wsu, wsd, saved, *main_grads = ctx.saved_tensors
        if dy is None:  # y does not reach what is differentiated
            if not ctx.group:
                return (None,) * 13  # no gradient for any input
            dy = torch.zeros_like(x)  # an EP rank still takes part in the group's backward
        args = (dy.contiguous(), x, ids, tw, wg, wu, wd, wsg, wsu, wsd, saved)
        # The gradients are not differentiable again (under torch.func.grad the backward's inputs
        # track gradients of their own).
        with torch.no_grad():
            if ctx.main_grad:
                mg = main_grads + [None] * (6 - len(main_grads))
                dx, dtw = torch.ops.mok.backward_main_grad(*args, *mg, ctx.group, ctx.precision)
                return (dx, None, dtw) + (None,) * 10
            g = torch.ops.mok.backward(*args, ctx.group, ctx.precision)
        shared = tuple(g[5:]) if ctx.has_shared else (None, None, None)
        return (g[0], None, g[1], g[2], g[3], g[4], *shared, None, None, None, None)


# ---- the public API -----------------------------------------------------------------------------
def moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None,
        *, max_tokens=None, group=None, main_grads=None, precision="bf16"):
    """y = shared(x) + sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x) (DESIGN.md §1).

    precision: "bf16", or "fp8": every product on e4m3 operands with fp32 scales (DESIGN.md §8);
    the weights stay bf16 parameters with bf16 gradients, and their FP8 copy is made and kept for
    you (made again whenever a weight changed; see the module's docstring).

    x [T, H] bf16; topk_ids [T, k] int32 or int64 (global expert ids, each in 0..E-1: padding
    slots, id -1, are refused); topk_weights [T, k] fp32 or bf16 (taken as fp32); w_gate, w_up
    [E, I, H], w_down [E, H, I] bf16; optional shared expert ws_gate, ws_up [I_s, H], ws_down
    [H, I_s] bf16. All contiguous, on one device. Differentiable in x, topk_weights and every
    weight (bf16 weight grads), also under torch.func.grad and vjp. `max_tokens` sizes the cached
    workspace up front (e.g. before capturing a CUDA graph; a workspace grows, i.e. allocates,
    when T exceeds it).

    main_grads: fp32 tensors shaped like w_gate, w_up, w_down (and ws_gate, ws_up, ws_down with
    the shared expert), as Megatron's `param.main_grad`: backward adds the weight gradients to
    them, accumulated in fp32 (MOK_GRAD_ACCUMULATE_F32), and gives the weights no .grad. Under
    torch.compile the layer then runs eagerly, a graph break (fullgraph=True refuses it).

    Expert parallelism: `group` is a torch.distributed process group (or mok.ep_group(pg)), one
    process per GPU. Each rank passes its own tokens and its E / ep experts' weights (experts
    r E/ep .. of rank r; topk_ids stay global); every rank calls at the same time, and the first
    call on every rank needs the same max_tokens (the workspace is made then, together, and never
    grows). The shared expert's weight gradients are this rank's partial sums."""
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                    ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down), ("ws_gate", ws_gate),
                    ("ws_up", ws_up), ("ws_down", ws_down)):
        if not isinstance(t, Tensor) and not (t is None and name.startswith("ws_")):
            raise TypeError(f"mok.moe: {name} is a {type(t).__name__}; expected a torch.Tensor")
    _precision("mok.moe", precision)
    if topk_ids.dtype == torch.int64:  # outside int32 clamped to ids mok refuses, not wrapped
        topk_ids = topk_ids.clamp(-1, torch.iinfo(torch.int32).max).to(torch.int32)
    if topk_weights.dtype == torch.bfloat16:  # its gradient comes back as bf16 through the cast
        topk_weights = topk_weights.float()
    elif topk_weights.dtype != torch.float32:
        raise TypeError(f"mok.moe: topk_weights has dtype {topk_weights.dtype}; expected "
                        f"torch.float32 or torch.bfloat16")
    if main_grads is not None:
        main_grads = list(main_grads)
        weights = (w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
        _check_main_grads("mok.moe", main_grads, weights, real=False)
        return _moe_main_grad(x, topk_ids, topk_weights, *weights, int(max_tokens or 0),
                              _group_of(group), main_grads, precision)
    y, _saved = _MoE.apply(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up,
                           ws_down, int(max_tokens or 0), _group_of(group), None, precision)
    return y


# A backward that adds into tensors of the forward cannot be traced (AOTAutograd does not take
# a mutation of a saved tensor in the backward graph): under torch.compile this part runs eagerly
# (a graph break; fullgraph=True refuses it).
@torch.compiler.disable
def _moe_main_grad(*args):
    return _MoE.apply(*args)[0]


def check(device=None):
    """Raises any device-side error (e.g. MokExpertIdError) flagged since the last check, for the
    cached workspaces on `device` (a torch device or None = all). Synchronises with the stream."""
    dev = None if device is None else torch.device(device)
    backend, index = (None, None) if dev is None else (dev.type, dev.index)
    for ws in core.cached_workspaces(backend, index, retired=True):
        if ws.backend == "cuda":
            d = torch.device("cuda", ws.ctx.device)
            with torch.cuda.device(d):
                ws.check(torch.cuda.current_stream(d).cuda_stream)
        else:
            ws.check()


class MoELayer(torch.nn.Module):
    """One MoE layer owning its bf16 weights: forward(x, topk_ids, topk_weights) -> y, or, with
    router=mok.Router(hidden, experts, top_k, ...), forward(x) -> y, routing included (the router
    is a submodule; after each call `counts`, `aux_loss` and `z_loss` hold that call's, the losses
    differentiable).

    x may have leading dims ([..., H]); topk_ids and topk_weights then [..., k]. Weights start as
    N(0, 1/H) for gate/up and N(0, 1/I) (N(0, 1/I_s)) for down, as the C tests' inputs do.
    With `group` (a torch.distributed process group, see moe) the layer holds this rank's
    experts / ep experts and needs max_tokens. With main_grad=True backward adds the weight
    gradients to each weight's fp32 `main_grad` (Megatron's; made as zeros where absent) and
    leaves .grad alone. precision="fp8" runs the layer in FP8 as moe does, the bf16 weights
    staying the parameters."""

    def __init__(self, hidden, inter, experts, top_k, shared_inter=0, *, device=None,
                 dtype=torch.bfloat16, max_tokens=None, group=None, router=None,
                 main_grad=False, precision="bf16"):
        super().__init__()
        self.main_grad = bool(main_grad)
        self.precision = _precision("MoELayer", precision)
        if router is not None and (router.hidden, router.experts, router.top_k) != (
                hidden, experts, top_k):
            raise ValueError(f"MoELayer: router is for hidden {router.hidden}, experts "
                             f"{router.experts}, top_k {router.top_k}; the layer has {hidden}, "
                             f"{experts}, {top_k}")
        if router is not None and main_grad:
            raise ValueError("MoELayer: main_grad with a router is not supported; route with "
                             "mok.Router apart and pass topk_ids, topk_weights")
        self.router = router
        self.counts = self.aux_loss = self.z_loss = None
        if dtype != torch.bfloat16:
            raise TypeError(f"MoELayer: dtype is {dtype}; mok's weights are torch.bfloat16")
        if not 1 <= top_k <= experts:
            raise ValueError(f"MoELayer: top_k is {top_k}; expected 1..experts ({experts})")
        self.hidden, self.inter, self.experts, self.top_k = hidden, inter, experts, top_k
        self.shared_inter, self.max_tokens = shared_inter, max_tokens
        self.group = None
        if group is not None:
            self.group = group if isinstance(group, core.EPGroup) else ep_group(group)
            if experts % self.group.ranks:
                raise ValueError(f"MoELayer: experts ({experts}) is not a multiple of the EP "
                                 f"group's {self.group.ranks} ranks")
        local = experts // (self.group.ranks if self.group else 1)
        kw = dict(device=device, dtype=dtype)
        p = torch.nn.Parameter
        self.w_gate = p(torch.empty(local, inter, hidden, **kw))
        self.w_up = p(torch.empty(local, inter, hidden, **kw))
        self.w_down = p(torch.empty(local, hidden, inter, **kw))
        if shared_inter:
            self.ws_gate = p(torch.empty(shared_inter, hidden, **kw))
            self.ws_up = p(torch.empty(shared_inter, hidden, **kw))
            self.ws_down = p(torch.empty(hidden, shared_inter, **kw))
        else:
            self.ws_gate = self.ws_up = self.ws_down = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator=None):
        for w, fan_in in ((self.w_gate, self.hidden), (self.w_up, self.hidden),
                          (self.w_down, self.inter), (self.ws_gate, self.hidden),
                          (self.ws_up, self.hidden), (self.ws_down, self.shared_inter)):
            if w is not None:
                w.normal_(0.0, fan_in ** -0.5, generator=generator)

    def forward(self, x, topk_ids=None, topk_weights=None):
        lead = x.shape[:-1]
        if self.router is not None:
            if topk_ids is not None or topk_weights is not None:
                raise ValueError("MoELayer: this layer routes with its router; call layer(x)")
            from .torch_router import routed_moe
            y, self.counts, self.aux_loss, self.z_loss = routed_moe(
                x.reshape(-1, self.hidden), self.router,
                (self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up, self.ws_down),
                max_tokens=self.max_tokens, group=_group_of(self.group), precision=self.precision)
            return y.reshape(*lead, self.hidden)
        if topk_ids is None or topk_weights is None:
            raise ValueError("MoELayer: pass topk_ids and topk_weights, or make the layer with "
                             "router=mok.Router(...)")
        y = moe(x.reshape(-1, self.hidden), topk_ids.reshape(-1, self.top_k),
                topk_weights.reshape(-1, self.top_k), self.w_gate, self.w_up, self.w_down,
                self.ws_gate, self.ws_up, self.ws_down, max_tokens=self.max_tokens,
                group=self.group, main_grads=self.main_grads() if self.main_grad else None,
                precision=self.precision)
        return y.reshape(*lead, self.hidden)

    def main_grads(self):
        """Each weight's fp32 `main_grad`, made as zeros where absent."""
        out = []
        for w in (self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up, self.ws_down):
            if w is not None:
                if getattr(w, "main_grad", None) is None:
                    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                out.append(w.main_grad)
        return out

    def extra_repr(self):
        return (f"hidden={self.hidden}, inter={self.inter}, experts={self.experts}, "
                f"top_k={self.top_k}, shared_inter={self.shared_inter}, "
                f"precision={self.precision}")
