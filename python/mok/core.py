"""core.py: contexts and workspaces as Python objects, the workspace cache, and the calls of the
layer on raw pointers. numpy_api.py and torch_ops.py sit on top; neither talks to ctypes directly.

A workspace is cached per (layer dims, backend, device). A call with more tokens than the cached
workspace holds replaces it with one for the next power of two (the `saved` buffers of earlier
calls stay valid: they hold everything backward reads). The replaced one is kept until
clear_cache(), since a CUDA graph captured earlier may still use it. Calls on one workspace must
be ordered: a CPU workspace here holds a lock around its calls; CUDA calls must come on one
stream (or be ordered by the caller), as mok's scratch is shared between the calls of a
workspace.
"""
import ctypes
import os
import threading
from collections import namedtuple

from . import _lib
from ._lib import check, lib

# The sizes of the layer that a workspace is made for, and its precision ("bf16", or "fp8":
# DESIGN.md §8); T (tokens) varies per call up to max_tokens.
Dims = namedtuple("Dims", "hidden inter shared_inter experts top_k precision", defaults=("bf16",))
PRECISIONS = {"bf16": _lib.BF16, "fp8": _lib.FP8}

BACKENDS = {"cpu": _lib.BACKEND_CPU, "cuda": _lib.BACKEND_CUDA}
GRAD_MODES = {"bf16": _lib.GRAD_WRITE_BF16, "f32": _lib.GRAD_ACCUMULATE_F32}
MAX_TOKENS = 1 << 20          # mok.h MOK_MAX_TOKENS
MAX_ROWS = 1 << 26            # api.c check_shape: max_tokens * top_k * ep_size <= 2^26


def cuda_device_count():
    return lib.mok_cuda_device_count()


def _cpu_threads():
    return int(os.environ.get("MOK_CPU_THREADS", "0"))


NCCL_ID_BYTES = 128  # mok.h MOK_NCCL_ID_BYTES


def nccl_id():
    """An NCCL unique id (bytes) for EPGroup.nccl: one rank makes it, every rank gets it."""
    buf = ctypes.create_string_buffer(NCCL_ID_BYTES)
    check(lib.mok_nccl_id(buf), "mok_nccl_id")
    return buf.raw


class EPGroup:
    """An expert-parallel group (mok_ep_group).

    EPGroup(ranks): `ranks` ranks emulated in this process: each rank gets its own
    Context(group=, rank=) and workspace and calls from its own thread (ctypes releases the GIL
    while mok runs). EPGroup.nccl(...): this process's rank of a group of processes, one GPU each,
    over an NCCL communicator (CUDA backend); `rank` and `device` are then this process's.
    A rank that does not arrive within timeout_ms (0 = 10 s) makes the others raise MokTimeout."""

    def __init__(self, ranks, timeout_ms=0):
        ptr = ctypes.c_void_p()
        check(lib.mok_ep_group_create_emulated(int(ranks), int(timeout_ms), ctypes.byref(ptr)),
              "mok_ep_group_create_emulated")
        self.ranks, self.rank, self.device = int(ranks), None, None
        self.ptr, self._destroy = ptr.value, lib.mok_ep_group_destroy

    @classmethod
    def nccl(cls, id_bytes, rank, ranks, device, timeout_ms=0):
        """Rank `rank` of `ranks` processes on CUDA device `device`, joined through the NCCL id
        `id_bytes` (nccl_id() on one rank). Returns once every rank has joined."""
        if not isinstance(id_bytes, (bytes, bytearray)) or len(id_bytes) != NCCL_ID_BYTES:
            raise ValueError(f"id_bytes must be the {NCCL_ID_BYTES} bytes of mok.nccl_id()")
        g = cls.__new__(cls)
        ptr = ctypes.c_void_p()
        check(lib.mok_ep_group_create_nccl_id(bytes(id_bytes), int(rank), int(ranks), int(device),
                                              int(timeout_ms), ctypes.byref(ptr)),
              "mok_ep_group_create_nccl_id")
        g.ranks, g.rank, g.device = int(ranks), int(rank), int(device)
        g.ptr, g._destroy = ptr.value, lib.mok_ep_group_destroy
        return g

    def close(self):
        """Drops this handle; mok frees the group when its last context is gone too."""
        if getattr(self, "ptr", None):
            self._destroy(self.ptr)
            self.ptr = None

    __del__ = close


class Context:
    """One mok_context: a backend on a device, rank `rank` of `group` (an EPGroup) or alone."""

    def __init__(self, backend="cpu", device=0, threads=None, group=None, rank=0):
        if backend not in BACKENDS:
            raise ValueError(f"backend is {backend!r}; expected 'cpu' or 'cuda'")
        if group is not None and group.rank is not None:  # NCCL: the process's rank and GPU
            rank, device = group.rank, group.device
        self.backend, self.device = backend, int(device)
        self.threads = _cpu_threads() if threads is None else int(threads)
        self.group, self.rank = group, int(rank)  # the group outlives its contexts
        self.ep = group.ranks if group is not None else 1
        cfg = _lib.ContextConfig(backend=BACKENDS[backend], device=self.device,
                                 ep_rank=self.rank, ep_size=self.ep, threads=self.threads,
                                 group=_ptr(group.ptr if group is not None else 0))
        ptr = ctypes.c_void_p()
        check(lib.mok_context_create(ctypes.byref(cfg), ctypes.byref(ptr)), "mok_context_create")
        self.ptr, self._destroy = ptr.value, lib.mok_context_destroy

    def close(self):
        if getattr(self, "ptr", None):
            self._destroy(self.ptr)
            self.ptr = None

    __del__ = close


def _ptr(p):
    return ctypes.c_void_p(p or None)


class Workspace:
    """One mok_workspace for `dims` and up to `max_tokens` tokens per call."""

    def __init__(self, ctx, dims, max_tokens):
        self.ctx, self.dims, self.max_tokens = ctx, Dims(*dims), int(max_tokens)
        d = self.dims
        if d.precision not in PRECISIONS:
            raise ValueError(f"precision is {d.precision!r}; expected 'bf16' or 'fp8'")
        shape = _lib.Shape(self.max_tokens, d.hidden, d.inter, d.shared_inter, d.experts,
                           d.top_k, PRECISIONS[d.precision])
        ptr = ctypes.c_void_p()
        check(lib.mok_workspace_create(ctx.ptr, ctypes.byref(shape), ctypes.byref(ptr)),
              "mok_workspace_create")
        self.ptr, self._destroy = ptr.value, lib.mok_workspace_destroy
        self.bytes = lib.mok_workspace_bytes(self.ptr)
        self.lock = threading.Lock() if ctx.backend == "cpu" else _NoLock()

    @property
    def backend(self):
        return self.ctx.backend

    def close(self):
        if getattr(self, "ptr", None):
            self._destroy(self.ptr)  # kept from __init__: module globals may be gone at exit
            self.ptr = None

    __del__ = close

    def saved_bytes(self, tokens):
        n = lib.mok_saved_bytes(self.ptr, int(tokens))
        if n == 0:  # mok_saved_bytes reports a bad count by returning 0
            raise _lib.MokInvalidArgument(
                1, "MOK_ERR_INVALID_ARG",
                f"tokens is {tokens}; expected 1..max_tokens ({self.max_tokens})",
                "mok_saved_bytes")
        return n

    def fp8_weights_bytes(self):
        """Bytes of this workspace's FP8 weight buffer (0 unless precision is 'fp8')."""
        return lib.mok_fp8_weights_bytes(self.ptr)

    def quantize_weights(self, w, fp8, stream=0):
        """The FP8 weight buffer at address fp8 (fp8_weights_bytes, 256-byte aligned) <- the bf16
        weights at the six addresses w (mok_quantize_weights)."""
        a = self._weights(w)
        with self.lock:
            check(lib.mok_quantize_weights(self.ptr, ctypes.byref(a), _ptr(fp8), _ptr(stream)),
                  "mok_quantize_weights")

    # Each call takes integer addresses (0 = NULL) and the stream as an integer (0 = default).
    # w: the six bf16 weights' addresses, and at precision 'fp8' a seventh, the FP8 weight
    # buffer's (which forward and backward then read alone).
    @staticmethod
    def _weights(w):
        return _lib.Weights(*(_ptr(p) for p in w))

    def _fwd_args(self, tokens, x, ids, tw, w, y, saved):
        return _lib.ForwardArgs(int(tokens), _ptr(x), _ptr(ids), _ptr(tw), self._weights(w),
                                _ptr(y), _ptr(saved))

    def forward(self, tokens, x, ids, tw, w, y, saved, stream=0):
        a = self._fwd_args(tokens, x, ids, tw, w, y, saved)
        with self.lock:
            check(lib.mok_forward(self.ptr, ctypes.byref(a), _ptr(stream)), "mok_forward")

    def recompute(self, tokens, x, ids, tw, w, saved, stream=0):
        a = self._fwd_args(tokens, x, ids, tw, w, 0, saved)
        with self.lock:
            check(lib.mok_recompute(self.ptr, ctypes.byref(a), _ptr(stream)), "mok_recompute")

    def schedule(self, tokens, ids, tw, saved, stream=0):
        a = self._fwd_args(tokens, 0, ids, tw, (0,) * 6, 0, saved)
        with self.lock:
            check(lib.mok_schedule(self.ptr, ctypes.byref(a), _ptr(stream)), "mok_schedule")

    def backward(self, tokens, x, ids, tw, w, saved, dy, dx, dtw, g, grad_mode="bf16", stream=0):
        if grad_mode not in GRAD_MODES:
            raise ValueError(f"grad_mode is {grad_mode!r}; expected 'bf16' or 'f32'")
        a = _lib.BackwardArgs(int(tokens), _ptr(x), _ptr(ids), _ptr(tw), self._weights(w),
                              _ptr(saved), _ptr(dy), _ptr(dx), _ptr(dtw),
                              _lib.Grads(*(_ptr(p) for p in g)), GRAD_MODES[grad_mode])
        with self.lock:
            check(lib.mok_backward(self.ptr, ctypes.byref(a), _ptr(stream)), "mok_backward")

    def mxfp8_to_bf16(self, rows, k, q, scales, out, stream=0):
        """out [rows, k] bf16 <- MXFP8 codes q [rows, k] with E8M0 scales [rows, k / 32]."""
        with self.lock:
            check(lib.mok_mxfp8_to_bf16(self.ptr, int(rows), int(k), _ptr(q), _ptr(scales),
                                        _ptr(out), _ptr(stream)), "mok_mxfp8_to_bf16")

    def check(self, stream=0):
        """Waits for `stream` and raises any device-side error (bad expert id, capacity)."""
        with self.lock:
            check(lib.mok_check(self.ptr, _ptr(stream)), "mok_check")

    def schedule_counts(self, saved, tokens, stream=0):
        counts = (ctypes.c_int32 * (self.dims.experts // self.ctx.ep))()
        with self.lock:
            check(lib.mok_schedule_counts(self.ptr, _ptr(saved), int(tokens), counts,
                                          _ptr(stream)), "mok_schedule_counts")
        return list(counts)


# The router's options (mok_router_config less max_tokens); a router is made per (config, backend,
# device) and grows with the tokens as a workspace does.
RouterDims = namedtuple("RouterDims", "hidden experts top_k scoring n_group topk_group renormalize "
                                      "scale")


class Router:
    """One mok_router for `dims` (RouterDims) and up to `max_tokens` tokens per call."""

    def __init__(self, ctx, dims, max_tokens):
        self.ctx, self.dims, self.max_tokens = ctx, RouterDims(*dims), int(max_tokens)
        d = self.dims
        if d.scoring not in _lib.SCORINGS:
            raise ValueError(f"scoring is {d.scoring!r}; expected 'softmax' or 'sigmoid'")
        cfg = _lib.RouterConfig(self.max_tokens, d.hidden, d.experts, d.top_k,
                                _lib.SCORINGS[d.scoring], d.n_group, d.topk_group,
                                int(d.renormalize), float(d.scale))
        ptr = ctypes.c_void_p()
        check(lib.mok_router_create(ctx.ptr, ctypes.byref(cfg), ctypes.byref(ptr)),
              "mok_router_create")
        self.ptr, self._destroy = ptr.value, lib.mok_router_destroy
        self.lock = threading.Lock() if ctx.backend == "cpu" else _NoLock()

    @property
    def backend(self):
        return self.ctx.backend

    def close(self):
        if getattr(self, "ptr", None):
            self._destroy(self.ptr)
            self.ptr = None

    __del__ = close

    def saved_bytes(self, tokens):
        n = lib.mok_router_saved_bytes(self.ptr, int(tokens))
        if n == 0:
            raise _lib.MokInvalidArgument(
                1, "MOK_ERR_INVALID_ARG",
                f"tokens is {tokens}; expected 1..max_tokens ({self.max_tokens})",
                "mok_router_saved_bytes")
        return n

    def forward(self, tokens, x, w, bias, ids, tw, counts, aux, z, saved, stream=0):
        a = _lib.RouterForwardArgs(int(tokens), *(_ptr(p) for p in (x, w, bias, ids, tw, counts,
                                                                     aux, z, saved)))
        with self.lock:
            check(lib.mok_router_forward(self.ptr, ctypes.byref(a), _ptr(stream)),
                  "mok_router_forward")

    def backward(self, tokens, x, w, saved, dtw, d_aux, d_z, dx, accumulate_dx, dw,
                 grad_mode="bf16", stream=0):
        if grad_mode not in GRAD_MODES:
            raise ValueError(f"grad_mode is {grad_mode!r}; expected 'bf16' or 'f32'")
        a = _lib.RouterBackwardArgs(int(tokens), _ptr(x), _ptr(w), _ptr(saved), _ptr(dtw),
                                    _ptr(d_aux), _ptr(d_z), _ptr(dx), int(bool(accumulate_dx)),
                                    _ptr(dw), GRAD_MODES[grad_mode])
        with self.lock:
            check(lib.mok_router_backward(self.ptr, ctypes.byref(a), _ptr(stream)),
                  "mok_router_backward")


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- caches -------------------------------------------------------------------------------------
_cache_lock = threading.Lock()
_contexts = {}    # (backend, device, threads) -> Context
_workspaces = {}  # (dims, backend, device) -> Workspace
_retired = []     # replaced by bigger ones; alive for graphs that captured them
_routers = {}     # (router dims, backend, device) -> Router


def context(backend="cpu", device=0, group=None):
    key = (backend, int(device), _cpu_threads(), id(group))  # the context holds its group
    with _cache_lock:
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = _contexts[key] = Context(backend, device, key[2], group)
        return ctx


def _grown(tokens, top_k):
    """max_tokens for a new workspace: the next power of two >= tokens, within mok's limits."""
    want = int(tokens)
    n = 1 << max(0, want - 1).bit_length()
    limit = min(MAX_TOKENS, MAX_ROWS // max(1, top_k))
    return max(want, min(n, limit))


def workspace(dims, tokens, backend="cpu", device=0, max_tokens=None, group=None):
    """The cached workspace for dims on (backend, device) that holds `tokens` tokens, created or
    grown as needed (`max_tokens` asks for at least that many, e.g. before a CUDA graph capture).
    With an NCCL EP group it is made once, for max_tokens, and never grows: making it is
    collective, and ranks whose calls differ in T would not all grow together."""
    dims = Dims(*dims)
    if group is not None:
        return _group_workspace(dims, int(tokens), backend, int(device), max_tokens, group)
    key = (dims, backend, int(device))
    need = max(int(tokens), int(max_tokens or 0))
    with _cache_lock:
        ws = _workspaces.get(key)
        if ws is not None and ws.max_tokens >= need:
            return ws
    ctx = context(backend, device)
    new = Workspace(ctx, dims, _grown(need, dims.top_k))
    with _cache_lock:
        cur = _workspaces.get(key)
        if cur is not None and cur.max_tokens >= new.max_tokens:
            return cur  # another thread grew it meanwhile
        if cur is not None:
            _retired.append(cur)
        _workspaces[key] = new
        return new


def router(dims, tokens, backend="cpu", device=0):
    """The cached router for dims (RouterDims) on (backend, device) that holds `tokens` tokens,
    created or grown (to the next power of two) as needed; a replaced one is kept as workspaces
    are."""
    dims = RouterDims(*dims)
    key = (dims, backend, int(device))
    with _cache_lock:
        r = _routers.get(key)
        if r is not None and r.max_tokens >= tokens:
            return r
    new = Router(context(backend, device), dims, _grown(tokens, 1))
    with _cache_lock:
        cur = _routers.get(key)
        if cur is not None and cur.max_tokens >= new.max_tokens:
            return cur
        if cur is not None:
            _retired.append(cur)
        _routers[key] = new
        return new


def _group_workspace(dims, tokens, backend, device, max_tokens, group):
    key = (dims, backend, device, id(group))
    with _cache_lock:
        ws = _workspaces.get(key)
    if ws is None:
        if not max_tokens:
            raise ValueError("with an EP group, pass max_tokens (the most tokens any rank's call "
                             "will have): every rank makes the workspace together, once")
        ws = Workspace(context(backend, device, group), dims, int(max_tokens))
        with _cache_lock:
            _workspaces[key] = ws
    if tokens > ws.max_tokens:
        raise ValueError(f"T = {tokens} exceeds max_tokens ({ws.max_tokens}) of this EP group's "
                         f"workspace, which cannot grow; pass a larger max_tokens on every rank "
                         f"from the first call")
    return ws


def cached_workspaces(backend=None, device=None, retired=False):
    """The cached workspaces (with retired=True also those replaced by bigger ones)."""
    with _cache_lock:
        every = list(_workspaces.values()) + (_retired if retired else [])
        every = [w for w in every if isinstance(w, Workspace)]  # _retired holds routers too
    return [ws for ws in every if (backend is None or ws.backend == backend) and
            (device is None or ws.ctx.device == device)]


def clear_cache():
    """Drops every cached workspace and context (their memory is freed once unreferenced). No
    CUDA graph that captured a mok call may be replayed after this."""
    with _cache_lock:
        _workspaces.clear()
        _routers.clear()
        _retired.clear()
        _contexts.clear()
