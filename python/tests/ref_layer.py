"""ref_layer.py: random layer inputs and a plain numpy float64 implementation of the layer,
forward and backward (DESIGN.md §1), to check mok against. With round_like_mok=True it rounds to
bf16 where DESIGN.md §1.1 stores bf16, so mok differs from it by accumulation order only.
"""
import numpy as np

import mok

NAMES = ("x", "topk_ids", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up",
         "ws_down")
GRADS = ("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")


def routing(rng, t, e, k, kind="random"):
    """topk_ids [T, k] int32 and topk_weights [T, k] float32 (softmax probabilities)."""
    logits = rng.standard_normal((t, e))
    if kind == "one_expert":  # every token's first choice is expert e-1
        logits[:, e - 1] += 100.0
    elif kind == "skewed":  # experts 0..e/2-1 never chosen when k <= e/2
        logits[:, : e // 2] -= 100.0
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k].astype(np.int32)
    return ids, np.take_along_axis(p, ids, 1).astype(np.float32)


def make_layer(t, h, i, e, k, i_s=0, seed=0, kind="random"):
    """Inputs of one call as a dict: bf16 tensors as uint16 bits, plus dy."""
    rng = np.random.default_rng(seed)
    bf = lambda shape, scale: mok.f32_to_bf16(rng.standard_normal(shape) * scale)
    ids, tw = routing(rng, t, e, k, kind)
    L = dict(x=bf((t, h), 1.0), topk_ids=ids, topk_weights=tw,
             w_gate=bf((e, i, h), h ** -0.5), w_up=bf((e, i, h), h ** -0.5),
             w_down=bf((e, h, i), i ** -0.5), ws_gate=None, ws_up=None, ws_down=None,
             dy=bf((t, h), 1.0))
    if i_s:
        L.update(ws_gate=bf((i_s, h), h ** -0.5), ws_up=bf((i_s, h), h ** -0.5),
                 ws_down=bf((h, i_s), i_s ** -0.5))
    return L


def inputs(L):
    return [L[n] for n in NAMES]


def _f64(a):
    return None if a is None else mok.bf16_to_f32(a).astype(np.float64)


def layer_f64(L, round_like_mok=False):
    """y and every gradient of the layer in float64: dict of arrays (None for absent ones)."""
    rb = (lambda a: mok.round_bf16(a).astype(np.float64)) if round_like_mok else (lambda a: a)
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))
    x, dy = _f64(L["x"]), _f64(L["dy"])
    ids, tw = L["topk_ids"], L["topk_weights"].astype(np.float64)
    wg, wu, wd = _f64(L["w_gate"]), _f64(L["w_up"]), _f64(L["w_down"])
    t, h = x.shape
    out = {"y": np.zeros((t, h)), "dx": np.zeros((t, h)), "d_topk_weights": np.zeros(ids.shape),
           "dw_gate": np.zeros(wg.shape), "dw_up": np.zeros(wu.shape),
           "dw_down": np.zeros(wd.shape), "dws_gate": None, "dws_up": None, "dws_down": None}
    for e in range(wg.shape[0]):
        tok, slot = np.nonzero(ids == e)  # canonical order: token, then slot
        if tok.size == 0:
            continue
        xr, dyr, w = x[tok], dy[tok], tw[tok, slot][:, None]
        g, u = rb(xr @ wg[e].T), rb(xr @ wu[e].T)
        a = g * sig(g) * u
        hw = rb(w * a)
        np.add.at(out["y"], tok, rb(hw @ wd[e].T))
        dh = dyr @ wd[e]
        out["d_topk_weights"][tok, slot] = (dh * a).sum(1)
        d, s = w * dh, sig(g)
        dg, du = rb(d * u * s * (1 + g * (1 - s))), rb(d * g * s)
        np.add.at(out["dx"], tok, rb(dg @ wg[e] + du @ wu[e]))
        out["dw_down"][e] = dyr.T @ hw
        out["dw_gate"][e], out["dw_up"][e] = dg.T @ xr, du.T @ xr
    if L["ws_gate"] is not None:
        sg, su, sd = _f64(L["ws_gate"]), _f64(L["ws_up"]), _f64(L["ws_down"])
        g, u = rb(x @ sg.T), rb(x @ su.T)
        hs = rb(g * sig(g) * u)
        out["y"] += hs @ sd.T
        dh, s = dy @ sd, sig(g)
        dg, du = rb(dh * u * s * (1 + g * (1 - s))), rb(dh * g * s)
        out["dx"] += dg @ sg + du @ su
        out["dws_down"], out["dws_gate"], out["dws_up"] = dy.T @ hs, dg.T @ x, du.T @ x
    return out


def rel_err(got, want):
    """||got - want|| / ||want|| (0 when both are zero)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    den = np.linalg.norm(want)
    num = np.linalg.norm(got - want)
    return num / den if den else num
