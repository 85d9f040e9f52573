"""torch_router.py: mok's router (DESIGN.md §1.2) as PyTorch custom ops (mok::router_forward,
mok::router_backward) with autograd; `route()`, the `Router` module, and `routed_moe()`, the router
and the layer in one autograd node, whose backward adds the router's dx into the layer's in place
(MoELayer(..., router=Router(...)) calls it). Imported by `mok` on first use of mok.Router.

CPU tensors run on mok's CPU backend; CUDA tensors on the CUDA backend, on the current stream.
Nothing here synchronises: ids, weights, counts and both losses stay on the device.
"""
from collections import namedtuple
from typing import Optional

import torch
from torch import Tensor

from . import core
from .torch_ops import _aligned_addr, _Device, _ptr, _stream, _where

RouterOutput = namedtuple("RouterOutput", "topk_ids topk_weights counts aux_loss z_loss")


def _check(where, x, w_router, bias, top_k, real=True):
    """dtype, device, layout and shapes; returns (T, RouterDims without the options)."""
    for name, t, dtype in (("x", x, torch.bfloat16), ("w_router", w_router, torch.bfloat16),
                           ("bias", bias, torch.float32)):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{where}: {name} is a {type(t).__name__}; expected a torch.Tensor")
        if t.dtype != dtype:
            raise TypeError(f"{where}: {name} has dtype {t.dtype}; expected {dtype}")
        if t.device != x.device:
            raise ValueError(f"{where}: {name} is on {t.device}; expected x's device {x.device}")
        if not t.is_contiguous():
            raise ValueError(f"{where}: {name} is not contiguous; pass {name}.contiguous()")
        if real and t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{where}: {name} is not 16-byte aligned; pass {name}.clone()")
    if x.dim() != 2 or w_router.dim() != 2 or x.shape[1] != w_router.shape[1]:
        raise ValueError(f"{where}: x {tuple(x.shape)} and w_router {tuple(w_router.shape)}; "
                         f"expected [T, H] and [E, H]")
    e = w_router.shape[0]
    if bias is not None and tuple(bias.shape) != (e,):
        raise ValueError(f"{where}: bias has shape {tuple(bias.shape)}; expected [E] = [{e}]")
    if not 1 <= top_k <= e:
        raise ValueError(f"{where}: top_k is {top_k}; expected 1..E ({e})")
    return x.shape[0], e


def _dims(x, w_router, top_k, scoring, n_group, topk_group, renormalize, scale):
    return core.RouterDims(int(x.shape[1]), int(w_router.shape[0]), int(top_k), scoring,
                           int(n_group), int(topk_group), bool(renormalize), float(scale))


def _router(dims, t, dev):
    backend, index = _where(dev)
    return core.router(dims, t, backend, index)


# ---- mok::router_forward ------------------------------------------------------------------------
@torch.library.custom_op("mok::router_forward", mutates_args=())
def _router_forward_op(x: Tensor, w_router: Tensor, bias: Optional[Tensor], top_k: int,
                       scoring: str, n_group: int, topk_group: int, renormalize: bool,
                       scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(topk_ids int32 [T, k], topk_weights fp32 [T, k], counts int32 [E], aux_loss fp32 [],
    z_loss fp32 [], saved uint8)."""
    t, e = _check("mok.route", x, w_router, bias, top_k)
    dev = x.device
    dims = _dims(x, w_router, top_k, scoring, n_group, topk_group, renormalize, scale)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    tw = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    counts = torch.empty(e, dtype=torch.int32, device=dev)
    losses = torch.empty(2, dtype=torch.float32, device=dev)
    if t == 0:
        counts.zero_(), losses.zero_()
        return ids, tw, counts, losses[0], losses[1], torch.empty(0, dtype=torch.uint8, device=dev)
    with _Device(dev):
        r = _router(dims, t, dev)
        saved = torch.empty(r.saved_bytes(t) + 255, dtype=torch.uint8, device=dev)
        r.forward(t, x.data_ptr(), w_router.data_ptr(), _ptr(bias), ids.data_ptr(),
                  tw.data_ptr(), counts.data_ptr(), losses.data_ptr(), losses.data_ptr() + 4,
                  _aligned_addr(saved), _stream(dev))
    return ids, tw, counts, losses[0].clone(), losses[1].clone(), saved


@_router_forward_op.register_fake
def _router_forward_fake(x, w_router, bias, top_k, scoring, n_group, topk_group, renormalize,
                         scale):
    t, e = _check("mok.route", x, w_router, bias, top_k, real=False)
    if isinstance(t, int) and t > 0:
        dims = _dims(x, w_router, top_k, scoring, n_group, topk_group, renormalize, scale)
        with _Device(x.device):
            n = _router(dims, t, x.device).saved_bytes(t) + 255
    elif isinstance(t, int):
        n = 0
    else:
        n = torch.library.get_ctx().new_dynamic_size()
    return (x.new_empty((t, top_k), dtype=torch.int32), x.new_empty((t, top_k), dtype=torch.float32),
            x.new_empty(e, dtype=torch.int32), x.new_empty((), dtype=torch.float32),
            x.new_empty((), dtype=torch.float32), x.new_empty(n, dtype=torch.uint8))


# ---- mok::router_backward -----------------------------------------------------------------------
@torch.library.custom_op("mok::router_backward", mutates_args=("dx",))
def _router_backward_op(dx: Tensor, accumulate: bool, x: Tensor, w_router: Tensor, saved: Tensor,
                        d_topk_weights: Tensor, d_aux: Optional[Tensor], d_z: Optional[Tensor],
                        top_k: int, scoring: str, n_group: int, topk_group: int,
                        renormalize: bool, scale: float) -> Tensor:
    """dW_r (bf16 [E, H]); dx [T, H] bf16 gets the router's dx (added to it with accumulate)."""
    t, e = _check("mok.route backward", x, w_router, None, top_k)
    dev = x.device
    dw = torch.empty_like(w_router)
    if t == 0:
        return dw.zero_()
    dims = _dims(x, w_router, top_k, scoring, n_group, topk_group, renormalize, scale)
    d_aux = None if d_aux is None else d_aux.float().contiguous()
    d_z = None if d_z is None else d_z.float().contiguous()
    with _Device(dev):
        r = _router(dims, t, dev)
        r.backward(t, x.data_ptr(), w_router.data_ptr(), _aligned_addr(saved),
                   d_topk_weights.contiguous().data_ptr(), _ptr(d_aux), _ptr(d_z),
                   dx.data_ptr(), accumulate, dw.data_ptr(), "bf16", _stream(dev))
    return dw


@_router_backward_op.register_fake
def _router_backward_fake(dx, accumulate, x, w_router, saved, d_topk_weights, d_aux, d_z, top_k,
                          scoring, n_group, topk_group, renormalize, scale):
    return torch.empty_like(w_router)


def _options(ctx):
    return (ctx.top_k, ctx.scoring, ctx.n_group, ctx.topk_group, ctx.renormalize, ctx.scale)


def _setup_context(ctx, inputs, output):
    x, w_router, _bias, *opts = inputs
    ctx.top_k, ctx.scoring, ctx.n_group, ctx.topk_group, ctx.renormalize, ctx.scale = opts
    ctx.save_for_backward(x, w_router, output[5])
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, _dids, dtw, _dcounts, d_aux, d_z, _dsaved):
    x, w_router, saved = ctx.saved_tensors
    if dtw is None:
        dtw = torch.zeros(x.shape[0], ctx.top_k, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x)
    dw = torch.ops.mok.router_backward(dx, False, x, w_router, saved, dtw.float(), d_aux, d_z,
                                       *_options(ctx))
    return (dx, dw) + (None,) * 7


torch.library.register_autograd("mok::router_forward", _backward_formula,
                                setup_context=_setup_context)


# ---- the public API -----------------------------------------------------------------------------
def route(x, w_router, top_k, bias=None, *, scoring="softmax", n_group=0, topk_group=0,
          renormalize=False, scale=1.0):
    """mok's router (DESIGN.md §1.2): x [T, H] bf16, w_router [E, H] bf16, optional bias [E] fp32
    (steers the choice only). Returns RouterOutput(topk_ids int32 [T, k], topk_weights fp32 [T, k],
    counts int32 [E], aux_loss, z_loss): differentiable in x and w_router through topk_weights and
    both losses (add `coef * aux_loss` to the training loss to use it)."""
    out = torch.ops.mok.router_forward(x, w_router, bias, int(top_k), scoring, int(n_group),
                                       int(topk_group), bool(renormalize), float(scale))
    return RouterOutput(*out[:5])


class Router(torch.nn.Module):
    """The router's weight W_r [E, H] (bf16, N(0, 1/H)) and options; forward(x) -> RouterOutput.
    With bias=True it keeps an fp32 [E] buffer `bias` (zeros) for auxiliary-loss-free balancing,
    which update_bias moves after each step."""

    def __init__(self, hidden, experts, top_k, *, scoring="softmax", n_group=0, topk_group=0,
                 renormalize=False, scale=1.0, bias=False, device=None, dtype=torch.bfloat16):
        super().__init__()
        if dtype != torch.bfloat16:
            raise TypeError(f"Router: dtype is {dtype}; mok's router weight is torch.bfloat16")
        if scoring not in core._lib.SCORINGS:
            raise ValueError(f"Router: scoring is {scoring!r}; expected 'softmax' or 'sigmoid'")
        self.hidden, self.experts, self.top_k = hidden, experts, top_k
        self.scoring, self.n_group, self.topk_group = scoring, n_group, topk_group
        self.renormalize, self.scale = bool(renormalize), float(scale)
        self.weight = torch.nn.Parameter(torch.empty(experts, hidden, device=device, dtype=dtype))
        if bias:
            self.register_buffer("bias", torch.zeros(experts, device=device, dtype=torch.float32))
        else:
            self.bias = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator=None):
        self.weight.normal_(0.0, self.hidden ** -0.5, generator=generator)

    @torch.no_grad()
    def update_bias(self, counts, rate=1e-3):
        """DeepSeek-V3's auxiliary-loss-free balancing: bias += rate * sign(mean(counts) - counts)
        (experts that took more than their share become less likely, and the other way round).
        `counts`: the forward's (summed over the steps' micro-batches or ranks as the caller
        likes). On the device, no host sync."""
        if self.bias is None:
            raise ValueError("Router.update_bias: this router was made without bias=True")
        c = counts.to(self.bias.device, torch.float32)
        self.bias.add_(torch.sign(c.mean() - c), alpha=rate)

    def options(self):
        return dict(scoring=self.scoring, n_group=self.n_group, topk_group=self.topk_group,
                    renormalize=self.renormalize, scale=self.scale)

    def forward(self, x):
        lead = x.shape[:-1]
        out = route(x.reshape(-1, self.hidden), self.weight, self.top_k, self.bias,
                    **self.options())
        return out._replace(topk_ids=out.topk_ids.reshape(*lead, self.top_k),
                            topk_weights=out.topk_weights.reshape(*lead, self.top_k))

    def extra_repr(self):
        return (f"hidden={self.hidden}, experts={self.experts}, top_k={self.top_k}, "
                f"scoring={self.scoring}, n_group={self.n_group}, topk_group={self.topk_group}, "
                f"renormalize={self.renormalize}, scale={self.scale}, "
                f"bias={self.bias is not None}")


class _RoutedMoE(torch.autograd.Function):
    """The router and the layer as one node: backward runs the layer's backward, then the router's
    with accumulate_dx, so the router's dx is added into the layer's dx in place."""

    @staticmethod
    def forward(ctx, x, w_router, bias, opts, max_tokens, group, precision, *weights):
        top_k = opts[0]
        ids, tw, counts, aux, z, rsaved = torch.ops.mok.router_forward(x, w_router, bias, *opts)
        y, saved = torch.ops.mok.forward(x, ids, tw, *weights, max_tokens, group, precision)
        ctx.opts, ctx.group, ctx.has_shared, ctx.top_k = opts, group, weights[3] is not None, top_k
        ctx.precision = precision
        ctx.save_for_backward(x, w_router, ids, tw, rsaved, saved, *weights)
        ctx.mark_non_differentiable(counts)
        ctx.set_materialize_grads(False)
        return y, counts, aux, z

    @staticmethod
    def backward(ctx, dy, _dcounts, d_aux, d_z):
        x, w_router, ids, tw, rsaved, saved, *weights = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        g = torch.ops.mok.backward(dy.contiguous(), x, ids, tw, *weights, saved, ctx.group,
                                   ctx.precision)
        dx = g[0]
        dw = torch.ops.mok.router_backward(dx, True, x, w_router, rsaved, g[1], d_aux, d_z,
                                           *ctx.opts)
        shared = tuple(g[5:]) if ctx.has_shared else (None, None, None)
        return (dx, dw, None, None, None, None, None, g[2], g[3], g[4], *shared)


def routed_moe(x, router, weights, *, max_tokens=None, group=0, precision="bf16"):
    """y, counts, aux_loss, z_loss of the router `router` (a Router) feeding the layer of
    `weights` (w_gate, w_up, w_down, ws_gate, ws_up, ws_down) on x [T, H], at `precision`."""
    opts = (router.top_k, router.scoring, router.n_group, router.topk_group, router.renormalize,
            router.scale)
    return _RoutedMoE.apply(x, router.weight, router.bias, opts, int(max_tokens or 0), group,
                            precision, *weights)
