"""validate.py: the shape rules of the layer (DESIGN.md §1), checked in Python before any C call so
that a mistake raises a ValueError naming the argument. Works on shapes only (tuples), so numpy
arrays, torch tensors and torch.compile's fake tensors share it; dtype, device and layout checks
are the front ends' (numpy_api.py, torch_ops.py).
"""
from .core import Dims

WEIGHTS = ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


def _expect(where, name, shape, want, letters):
    if tuple(shape) != tuple(want):
        raise ValueError(f"{where}: {name} has shape {tuple(shape)}; expected {letters} = "
                         f"{tuple(want)}")


def layer_dims(where, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
               ws_down=None, dy=None, ep=1):
    """Checks the shapes (tuples; None for an absent shared-expert tensor) against each other and
    returns (T, Dims). T, H come from x; k from topk_ids; I from w_gate; E is w_gate's experts
    times ep (a rank of an EP group holds E / ep of them); I_s from ws_gate."""
    if len(x) != 2:
        raise ValueError(f"{where}: x has shape {tuple(x)}; expected 2 dims (T, H)")
    t, h = x
    if len(topk_ids) != 2:
        raise ValueError(f"{where}: topk_ids has shape {tuple(topk_ids)}; expected (T, k)")
    k = topk_ids[1]
    _expect(where, "topk_ids", topk_ids, (t, k), "(T, k)")
    _expect(where, "topk_weights", topk_weights, (t, k), "(T, k) as topk_ids")
    if len(w_gate) != 3:
        raise ValueError(f"{where}: w_gate has shape {tuple(w_gate)}; expected (E, I, H)")
    e, i = w_gate[0], w_gate[1]
    _expect(where, "w_gate", w_gate, (e, i, h), "(E, I, H) with H from x")
    _expect(where, "w_up", w_up, (e, i, h), "(E, I, H) as w_gate")
    _expect(where, "w_down", w_down, (e, h, i), "(E, H, I) with E, I from w_gate")
    shared = [s is not None for s in (ws_gate, ws_up, ws_down)]
    if any(shared) and not all(shared):
        missing = [n for n, s in zip(WEIGHTS[3:], shared) if not s]
        raise ValueError(f"{where}: give all of ws_gate, ws_up, ws_down or none; "
                         f"{', '.join(missing)} missing")
    i_s = 0
    if all(shared):
        if len(ws_gate) != 2:
            raise ValueError(f"{where}: ws_gate has shape {tuple(ws_gate)}; expected (I_s, H)")
        i_s = ws_gate[0]
        _expect(where, "ws_gate", ws_gate, (i_s, h), "(I_s, H) with H from x")
        _expect(where, "ws_up", ws_up, (i_s, h), "(I_s, H) as ws_gate")
        _expect(where, "ws_down", ws_down, (h, i_s), "(H, I_s) with I_s from ws_gate")
        if i_s < 1:
            raise ValueError(f"{where}: ws_gate has shape {tuple(ws_gate)}; I_s must be >= 1 "
                             f"(leave the shared expert out for none)")
    if dy is not None:
        _expect(where, "dy", dy, (t, h), "(T, H) as x")
    for name, v in (("H", h), ("I", i), ("E", e)):
        if v < 1:
            raise ValueError(f"{where}: {name} is {v}; expected >= 1")
    e *= ep
    if not 1 <= k <= e:
        raise ValueError(f"{where}: topk_ids has k = {k} columns; expected 1..E ({e})")
    return t, Dims(h, i, i_s, e, k)


def expert_ids_error(where, lo, hi, experts):
    """The ValueError for topk_ids holding values lo..hi outside 0..E-1. mok routes every slot to
    an expert: padding slots (id -1, as routers with a capacity limit emit) are refused, and the
    message says how to pass them."""
    msg = f"{where}: topk_ids has values in {lo}..{hi}; expected 0..E-1 (E = {experts})"
    if lo < 0:
        msg += ("; padding slots (topk_ids = -1) are not supported: give each any expert id and "
                "weight 0 (e.g. topk_ids.clamp(min=0), topk_weights * (topk_ids >= 0)), or drop "
                "the slot")
    return ValueError(msg)
