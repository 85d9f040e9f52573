"""layers.py: the layer of DESIGN.md §1 written in plain PyTorch, as the benchmark's baselines, plus
the seeded inputs. Every function takes (x, topk_ids, topk_weights, w_gate, w_up, w_down,
ws_gate, ws_up, ws_down) as mok.moe does and returns y [T, H] bf16, differentiable by autograd.

  grouped_mm_moe  rows sorted by expert (stable: expert, token, slot, mok's canonical order),
                  torch._grouped_mm for gate, up and down, SwiGLU, weighted scatter-add combine
                  (index_add in fp32), shared expert as dense matmuls.
  loop_moe        the same with one matmul per expert in a Python loop (group sizes go to the host).
  reference_moe   float32 throughout, one expert at a time (for the startup check only).
  torch_router    the router of DESIGN.md §1.2 in plain PyTorch (linear in fp32, softmax or
                  sigmoid, bias, group-limited topk), the baseline beside mok's router.

torch._grouped_mm(mat_a, mat_b, offs) in torch 2.11 (aten/src/ATen/native/GroupedMMUtils.h,
cuda/GroupedBlas.cpp, cuda/GroupMM.cu): 2d x 3d is mat_a [M, K] bf16 (rows of group g are
offs[g-1]..offs[g]-1), mat_b [G, K, N] bf16 row- or column-major (so w.transpose(1, 2) of a
contiguous [G, N, K] weight is taken as is), offs int32 [G] cumulative END offsets on the device,
out [M, N] bf16 (rows past offs[-1] are left unwritten). Strides must be multiples of 16 bytes
(8 bf16 values) and data 16-byte aligned; at most 1023 groups. On sm90/sm100 with bf16 it runs a
CUTLASS grouped GEMM (fp32 accumulation, no host sync); elsewhere a loop of mm that reads offs on
the host. It has autograd (derivatives.yaml: _grouped_mm_mat1_backward / _mat2_backward).
"""
import torch
import torch.nn.functional as F

_GMM = getattr(torch, "_grouped_mm", None)


def make_inputs(shape, device, seed=0, tokens=None):
    """x, dy ~ N(0, 1); gate/up weights ~ N(0, 1/H), down ~ N(0, 1/I) (mok_gen.h's scales); routing
    from a softmax of Gaussian logits, its top-k and their probabilities. Leaves require grad."""
    t = shape.T if tokens is None else tokens
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, scale=1.0):
        out = torch.empty(*size, device=device, dtype=torch.bfloat16)
        for chunk in out.view(-1).split(1 << 28):  # bounded fp32 temporaries for big weights
            chunk.copy_(torch.randn(chunk.numel(), generator=g, device=device) * scale)
        return out

    probs = torch.randn(t, shape.E, generator=g, device=device).softmax(-1)
    topk_weights, topk_ids = probs.topk(shape.k, dim=-1)
    ins = dict(x=randn(t, shape.H), topk_ids=topk_ids.to(torch.int32),
               topk_weights=topk_weights.contiguous(),
               w_gate=randn(shape.E, shape.I, shape.H, scale=shape.H ** -0.5),
               w_up=randn(shape.E, shape.I, shape.H, scale=shape.H ** -0.5),
               w_down=randn(shape.E, shape.H, shape.I, scale=shape.I ** -0.5),
               ws_gate=None, ws_up=None, ws_down=None)
    if shape.I_s:
        ins.update(ws_gate=randn(shape.I_s, shape.H, scale=shape.H ** -0.5),
                   ws_up=randn(shape.I_s, shape.H, scale=shape.H ** -0.5),
                   ws_down=randn(shape.H, shape.I_s, scale=shape.I_s ** -0.5))
    for v in ins.values():
        if v is not None and v.is_floating_point():
            v.requires_grad_()
    return ins, randn(t, shape.H)


def _route(topk_ids, experts):
    """Rows (t*k + j) sorted by expert (stable), the token of each, and rows per expert [E]."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    return order, order // k, counts


def _shared(x, ws_gate, ws_up, ws_down):
    if ws_gate is None:
        return torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    return ((F.silu(x @ ws_gate.T) * (x @ ws_up.T)) @ ws_down.T).float()


def _combine(x, out_rows, order, tok, topk_weights, shared):
    """y[t] = shared[t] + sum of w * o over t's rows: fp32 scatter-add (index_add), then bf16."""
    w = topk_weights.reshape(-1)[order]
    y = shared.index_add(0, tok, out_rows.float() * w[:, None])
    return y.to(x.dtype)


def grouped_mm_moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
                   ws_down=None):
    order, tok, counts = _route(topk_ids, w_gate.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[tok]                                           # dispatch: [T*k, H], expert-sorted
    g = _GMM(xs, w_gate.transpose(1, 2), offs=offs)       # [T*k, I]
    u = _GMM(xs, w_up.transpose(1, 2), offs=offs)
    o = _GMM(F.silu(g) * u, w_down.transpose(1, 2), offs=offs)  # [T*k, H]
    return _combine(x, o, order, tok, topk_weights, _shared(x, ws_gate, ws_up, ws_down))


def loop_moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
             ws_down=None):
    order, tok, counts = _route(topk_ids, w_gate.shape[0])
    xs = x[tok]
    outs, start = [], 0
    wg, wu, wd = w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0)  # one stack in backward
    for e, c in enumerate(counts.tolist()):  # host sync: the loop needs the sizes
        if c:
            xe = xs[start:start + c]
            outs.append((F.silu(xe @ wg[e].T) * (xe @ wu[e].T)) @ wd[e].T)
            start += c
    return _combine(x, torch.cat(outs), order, tok, topk_weights,
                    _shared(x, ws_gate, ws_up, ws_down))


def reference_moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
                  ws_down=None):
    f = lambda t: None if t is None else t.float()
    xf = x.float()
    y = torch.zeros_like(xf)
    for e in range(w_gate.shape[0]):
        t, j = (topk_ids == e).nonzero(as_tuple=True)
        a = F.silu(xf[t] @ f(w_gate[e]).T) * (xf[t] @ f(w_up[e]).T)
        y = y.index_add(0, t, (a @ f(w_down[e]).T) * topk_weights[t, j, None])
    if ws_gate is not None:
        y = y + (F.silu(xf @ f(ws_gate).T) * (xf @ f(ws_up).T)) @ f(ws_down).T
    return y


def torch_router(x, w_router, top_k, bias=None, *, scoring="softmax", n_group=0, topk_group=0,
                 renormalize=False, scale=1.0):
    """(topk_ids int64, topk_weights fp32, counts int32 [E], aux_loss, z_loss) with mok's math
    (DESIGN.md §1.2): fp32 logits of bf16 x and W_r; the choice by score + bias (torch.topk: ties
    in no stated order, unlike mok's lower id); the losses differentiable."""
    logits = x.float() @ w_router.float().T
    t, e = logits.shape
    s = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    c = s.detach() if bias is None else s.detach() + bias
    if n_group > 1:
        g = c.view(t, n_group, -1)
        gs = g.topk(min(2, g.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(
            1, gs.topk(topk_group, dim=-1).indices, True)
        c = c.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = c.topk(top_k, dim=-1).indices
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    w = w * scale
    counts = torch.bincount(ids.reshape(-1), minlength=e).to(torch.int32)
    p = s if scoring == "softmax" else s / s.sum(-1, keepdim=True)
    aux = e * ((counts.float() / (t * top_k)) * p.mean(0)).sum()
    z = logits.logsumexp(-1).square().mean()
    return ids, w, counts, aux, z


def grouped_mm_available(device):
    """None if torch._grouped_mm runs here (on a tiny problem), else why not."""
    if _GMM is None:
        return "torch._grouped_mm is missing in this torch"
    try:
        a = torch.ones(32, 16, device=device, dtype=torch.bfloat16)
        b = torch.ones(2, 16, 8, device=device, dtype=torch.bfloat16)
        out = _GMM(a, b, offs=torch.tensor([8, 32], device=device, dtype=torch.int32))
        if not torch.equal(out.float(), torch.full((32, 8), 16.0, device=device)):
            return "torch._grouped_mm gave a wrong result on a probe"
    except Exception as e:  # noqa: BLE001 - any failure means: fall back to the loop
        return f"torch._grouped_mm failed: {type(e).__name__}: {str(e).splitlines()[0]}"
    return None
