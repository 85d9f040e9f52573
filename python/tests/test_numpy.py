"""test_numpy.py: the ctypes layer and the numpy API on the CPU backend (no torch; runs in CI):
results against a float64 numpy layer, determinism, the workspace cache, and error mapping."""
import numpy as np
import pytest

import mok
from ref_layer import GRADS, inputs, layer_f64, make_layer, rel_err

# (T, H, I, E, k, I_s, routing): multiples of 64 for H, I, I_s as the CUDA backend needs them.
CASES = [
    (37, 64, 128, 8, 2, 64, "random"),
    (1, 64, 64, 4, 1, 0, "random"),
    (64, 128, 64, 16, 4, 0, "skewed"),       # half the experts get no rows
    (50, 64, 64, 4, 1, 0, "one_expert"),     # every row on one expert
    (130, 128, 192, 8, 8, 128, "random"),    # k = E
]


def run(L, precision="bf16"):
    y, saved = mok.forward(*inputs(L), precision=precision)
    g = mok.backward(L["dy"], *inputs(L), saved=saved, precision=precision)
    return y, g


def as_f64(a):
    return mok.bf16_to_f32(a) if a.dtype == np.uint16 else a


def errors(y, g, ref):
    out = {"y": rel_err(as_f64(y), ref["y"])}
    for n in GRADS:
        v = getattr(g, n)
        assert (v is None) == (ref[n] is None), n
        if v is not None:
            out[n] = rel_err(as_f64(v), ref[n])
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T%d_H%d_I%d_E%d_k%d_Is%d_%s" % c)
def test_against_float64(case):
    L = make_layer(*case[:6], seed=1, kind=case[6])
    y, g = run(L)
    # Plain float64 math: mok differs by its bf16 roundings of intermediates.
    err = errors(y, g, layer_f64(L))
    assert all(v < 2e-2 for v in err.values()), err
    # Rounded where DESIGN.md §1.1 stores bf16: only accumulation order (and the final bf16 store
    # of each output) remains.
    err = errors(y, g, layer_f64(L, round_like_mok=True))
    bad = {n: v for n, v in err.items() if v >= (1e-3 if n == "d_topk_weights" else 5e-3)}
    assert not bad, err


# FP8 (DESIGN.md §8) against the float64 layer without quantization: relative L2 error per tensor
# below 0.10. e4m3 keeps 3 mantissa bits: a quantized value is off by 2.65 % (L2) over a group of
# Gaussian values, errors that do not average down relative to a product's result, and each
# output passes through about six quantizations: sqrt(6) x 2.65 = 6.5 % (the reasoning in full
# by the same bound in tests/test_fp8_layer.c).
@pytest.mark.parametrize("case", [CASES[0], CASES[4]],
                         ids=lambda c: "T%d_H%d_I%d_E%d_k%d_Is%d_%s" % c)
def test_fp8_against_float64(case):
    L = make_layer(*case[:6], seed=11, kind=case[6])
    y, g = run(L, "fp8")
    err = errors(y, g, layer_f64(L))
    assert all(0.01 < v < 0.10 for v in err.values()), err  # quantized, and as much as e4m3 costs
    y16, g16 = run(L)
    assert not np.array_equal(y, y16)


def test_fp8_repeatable_threads_and_layer():
    L = make_layer(70, 64, 128, 8, 2, 64, seed=12)
    y, g = run(L, "fp8")
    for threads in (1, 2):
        layer = mok.Layer(64, 128, 8, 2, shared_inter=64, max_tokens=70, threads=threads,
                          precision="fp8")
        yl, saved = layer.forward(*inputs(L))
        gl = layer.backward(L["dy"], *inputs(L), saved=saved)
        assert np.array_equal(yl, y), threads
        for n in GRADS:
            assert np.array_equal(getattr(gl, n), getattr(g, n)), (threads, n)


def test_fp8_takes_the_weights_as_they_are_now():
    """Each call quantizes the bf16 weights it is given: a weight changed in place is seen."""
    L = make_layer(40, 64, 64, 4, 2, 0, seed=13)
    y1, _ = mok.forward(*inputs(L), precision="fp8")
    assert np.array_equal(mok.forward(*inputs(L), precision="fp8")[0], y1)
    L["w_down"][:] = mok.f32_to_bf16(2.0 * mok.bf16_to_f32(L["w_down"]))  # doubled in place
    y2, _ = mok.forward(*inputs(L), precision="fp8")
    assert np.array_equal(y2, mok.f32_to_bf16(2.0 * mok.bf16_to_f32(y1)))  # FP8 commutes with 2x


def test_bitwise_repeatable():
    L = make_layer(96, 128, 64, 8, 2, 64, seed=2)
    (y1, g1), (y2, g2) = run(L), run(L)
    assert np.array_equal(y1, y2)
    for n in GRADS:
        assert np.array_equal(getattr(g1, n), getattr(g2, n)), n


def test_threads_do_not_change_bits():
    L = make_layer(70, 64, 128, 8, 2, 64, seed=3)
    outs = []
    for threads in (1, 2):
        layer = mok.Layer(64, 128, 8, 2, shared_inter=64, max_tokens=70, threads=threads)
        y, saved = layer.forward(*inputs(L))
        outs.append((y, layer.backward(L["dy"], *inputs(L), saved=saved)))
    assert np.array_equal(outs[0][0], outs[1][0])
    for n in GRADS:
        assert np.array_equal(getattr(outs[0][1], n), getattr(outs[1][1], n)), n


def test_token_rows_do_not_depend_on_the_batch():
    """D3: y[t] and dx[t] of a token are the same bits in a sub-batch."""
    L = make_layer(80, 64, 64, 8, 2, 64, seed=4)
    y, g = run(L)
    sub = dict(L)
    for n in ("x", "topk_ids", "topk_weights", "dy"):
        sub[n] = L[n][17:40].copy()  # a copy: a row slice need not be 16-byte aligned
    ys, gs = run(sub)
    assert np.array_equal(ys, y[17:40])
    assert np.array_equal(gs.dx, g.dx[17:40])
    assert np.array_equal(gs.d_topk_weights, g.d_topk_weights[17:40])


def test_int64_ids_and_schedule_counts():
    L = make_layer(40, 64, 64, 8, 2, 0, seed=5)
    y32, _ = mok.forward(*inputs(L))
    L64 = dict(L, topk_ids=L["topk_ids"].astype(np.int64))
    y64, _ = mok.forward(*inputs(L64))
    assert np.array_equal(y32, y64)
    layer = mok.Layer(64, 64, 8, 2, max_tokens=64)
    _, saved = layer.forward(*inputs(L))
    want = np.bincount(L["topk_ids"].ravel(), minlength=8)
    assert np.array_equal(layer.schedule_counts(saved, 40), want)


def test_int64_ids_outside_int32_refused():
    """int64 ids are not wrapped into int32: 2^32 + 2 would have become expert 2."""
    L = make_layer(40, 64, 64, 8, 2, 0, seed=5)
    for bad in (2 ** 32 + 2, -(2 ** 32) + 1, 2 ** 31):
        ids = L["topk_ids"].astype(np.int64)
        ids[3, 1] = bad
        with pytest.raises(ValueError, match="topk_ids has values in"):
            mok.forward(*inputs(dict(L, topk_ids=ids)))


def test_schedule_counts_refuses_a_small_or_foreign_saved():
    """A saved smaller than a call of `tokens` needs is refused before mok reads it; a saved of
    another layer shape is refused by mok (its header)."""
    L = make_layer(40, 64, 64, 8, 2, 0, seed=5)
    layer = mok.Layer(64, 64, 8, 2, max_tokens=64)
    _, saved = layer.forward(*inputs(L))
    with pytest.raises(ValueError, match="saved has 256 bytes"):
        layer.schedule_counts(saved[:256], 40)
    other = mok.Layer(128, 64, 8, 2, max_tokens=64)
    _, other_saved = other.forward(*inputs(make_layer(40, 128, 64, 8, 2, 0, seed=6)))
    with pytest.raises(mok.MokInvalidArgument, match="not filled by a call on this workspace"):
        layer.schedule_counts(other_saved, 40)


def test_recompute_gives_the_same_saved():
    L = make_layer(33, 64, 64, 4, 2, 64, seed=6)
    layer = mok.Layer(64, 64, 4, 2, shared_inter=64, max_tokens=33)
    _, saved = layer.forward(*inputs(L))
    again = layer.recompute(*inputs(L))
    g1 = layer.backward(L["dy"], *inputs(L), saved=saved)
    g2 = layer.backward(L["dy"], *inputs(L), saved=again)
    for n in GRADS:
        assert np.array_equal(getattr(g1, n), getattr(g2, n)), n


def test_f32_main_grads_accumulate():
    L = make_layer(30, 64, 64, 4, 2, 64, seed=7)
    y, saved = mok.forward(*inputs(L))
    g = mok.backward(L["dy"], *inputs(L), saved=saved)
    rng = np.random.default_rng(0)
    weights = inputs(L)[3:]
    start = [rng.standard_normal(w.shape).astype(np.float32) for w in weights]
    main = [s.copy() for s in start]
    mok.backward(L["dy"], *inputs(L), saved=saved, grad_mode="f32", main_grads=main)
    for n, s, m in zip(GRADS[2:], start, main):
        bf = mok.bf16_to_f32(getattr(g, n))
        assert rel_err(m - s, bf) < 5e-3, n  # the same sums, rounded to bf16 or not


def test_workspace_cache_grows_and_old_saved_stays_valid():
    mok.clear_cache()
    small = make_layer(5, 64, 64, 4, 2, 0, seed=8)
    y, saved = mok.forward(*inputs(small))
    ws = mok.core.cached_workspaces()
    assert len(ws) == 1 and ws[0].max_tokens >= 5
    big = make_layer(300, 64, 64, 4, 2, 0, seed=9)
    mok.forward(*inputs(big))
    ws2 = mok.core.cached_workspaces()
    assert len(ws2) == 1 and ws2[0].max_tokens >= 300 and ws2[0] is not ws[0]
    mok.forward(*inputs(make_layer(7, 64, 128, 4, 2, 0)))  # other dims: a second workspace
    assert len(mok.core.cached_workspaces()) == 2
    g = mok.backward(small["dy"], *inputs(small), saved=saved)  # through the grown workspace
    ref = layer_f64(small)
    assert rel_err(mok.bf16_to_f32(g.dx), ref["dx"]) < 2e-2


def test_empty_batch():
    L = make_layer(0, 64, 64, 4, 2, 0)
    y, g = run(L)
    assert y.shape == (0, 64) and g.dx.shape == (0, 64) and not g.dw_gate.any()


# ---- errors -------------------------------------------------------------------------------------
def test_python_checks_name_the_argument():
    L = make_layer(8, 64, 64, 4, 2, 64)
    args = inputs(L)
    with pytest.raises(ValueError, match="w_down has shape"):
        mok.forward(*args[:5], np.ascontiguousarray(args[5][:, :, :32]), *args[6:])
    with pytest.raises(TypeError, match="x has dtype float32"):
        mok.forward(mok.bf16_to_f32(args[0]), *args[1:])
    with pytest.raises(ValueError, match="topk_weights has shape"):
        mok.forward(*args[:2], args[2][:4].copy(), *args[3:])
    with pytest.raises(ValueError, match="ws_down missing"):
        mok.forward(*args[:8], None)
    with pytest.raises(ValueError, match="w_up is not C-contiguous"):
        mok.forward(*args[:4], np.asfortranarray(args[4]), *args[5:])
    bad = args[1].copy()
    bad[3, 1] = 4
    with pytest.raises(ValueError, match=r"topk_ids has values in 0\.\.4; expected 0\.\.E-1"):
        mok.forward(args[0], bad, *args[2:])
    bad[3, 1] = -1  # a router's padding slot
    with pytest.raises(ValueError, match=r"values in -1\.\..*padding slots \(topk_ids = -1\) "
                                         r"are not supported: give each any expert id and "
                                         r"weight 0"):
        mok.forward(args[0], bad, *args[2:])
    with pytest.raises(ValueError, match="precision is 'fp16'; expected 'bf16' or 'fp8'"):
        mok.forward(*args, precision="fp16")
    with pytest.raises(ValueError, match="precision is 'fp16'"):
        mok.Layer(64, 64, 4, 2, precision="fp16")


def test_c_errors_carry_the_library_message():
    with pytest.raises(mok.MokInvalidArgument, match="max_tokens is 0; expected 1") as e:
        mok.Layer(64, 64, 4, 2, max_tokens=0)
    assert e.value.status == 1 and e.value.name == "MOK_ERR_INVALID_ARG"
    assert isinstance(e.value, ValueError)
    with pytest.raises(mok.MokInvalidArgument, match="top_k is 5; expected 1..E"):
        mok.Layer(64, 64, 4, 5)
    layer = mok.Layer(64, 64, 4, 2, max_tokens=4)
    L = make_layer(5, 64, 64, 4, 2, 0)
    with pytest.raises(mok.MokInvalidArgument, match=r"tokens is 5; expected 1..max_tokens \(4\)"):
        layer.forward(*inputs(L))
    # The same through the raw call, past the Python size query.
    saved = mok.aligned_empty(layer.ws.saved_bytes(4))
    y = np.empty((5, 64), np.uint16)
    addr = lambda a: 0 if a is None else a.ctypes.data
    with pytest.raises(mok.MokInvalidArgument, match=r"tokens is 5; expected 1..max_tokens \(4\)"):
        layer.ws.forward(5, *map(addr, inputs(L)[:3]), [addr(w) for w in inputs(L)[3:]],
                         y.ctypes.data, saved.ctypes.data)
    with pytest.raises(mok.MokInvalidArgument, match="saved is NULL"):
        layer.ws.forward(4, *map(addr, inputs(L)[:3]), [addr(w) for w in inputs(L)[3:]],
                         y.ctypes.data, 0)
    # A view 2 bytes into an allocation: mok reports the pointer it rejects.
    buf = np.zeros(L["x"].size + 1, dtype=np.uint16)
    x = buf[1:].reshape(L["x"].shape)
    x[...] = L["x"]
    with pytest.raises(mok.MokAlignmentError, match="x .* is not 16-byte aligned"):
        mok.forward(x, *inputs(L)[1:])


def test_expert_id_out_of_range_reported_by_the_library():
    L = make_layer(8, 64, 64, 4, 2, 0)
    L["topk_ids"][2, 0] = 7
    layer = mok.Layer(64, 64, 4, 2, max_tokens=8)
    with pytest.raises(mok.MokExpertIdError):
        layer.forward(*inputs(L), check_ids=False)
        layer.check()  # a backend may report it from the call or at the next check


@pytest.mark.skipif(mok.cuda_device_count() > 0, reason="a GPU is visible")
def test_cuda_backend_without_gpu():
    with pytest.raises(mok.MokUnsupported, match="no CUDA device"):
        mok.Context("cuda")


# ---- expert parallelism, emulated ranks (DESIGN.md §2.3) ----------------------------------------
def _ep_ranks(L, ep, group, max_tokens, **kw):
    """One mok.Layer per rank (kw: more of its arguments); rank r holds experts r*E/ep.. and
    tokens r*T/ep.."""
    t, h = L["x"].shape
    e, i = L["w_gate"].shape[:2]
    k = L["topk_ids"].shape[1]
    i_s = 0 if L["ws_gate"] is None else L["ws_gate"].shape[0]
    layers = [mok.Layer(h, i, e, k, i_s, max_tokens=max_tokens, threads=1, group=group, rank=r,
                        **kw) for r in range(ep)]

    def rank_inputs(r):
        tok, ex = slice(r * t // ep, (r + 1) * t // ep), slice(r * e // ep, (r + 1) * e // ep)
        return dict(x=L["x"][tok], topk_ids=L["topk_ids"][tok], topk_weights=L["topk_weights"][tok],
                    w_gate=L["w_gate"][ex], w_up=L["w_up"][ex], w_down=L["w_down"][ex],
                    ws_gate=L["ws_gate"], ws_up=L["ws_up"], ws_down=L["ws_down"]), L["dy"][tok]
    return layers, rank_inputs


def _on_threads(fns):
    """Runs each fn on its own thread; returns their results or raised exceptions."""
    import threading
    out = [None] * len(fns)

    def run(j):
        try:
            out[j] = fns[j]()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[j] = e
    th = [threading.Thread(target=run, args=(j,)) for j in range(len(fns))]
    for x in th:
        x.start()
    for x in th:
        x.join()
    return out


@pytest.mark.parametrize("ep,precision", [(2, "bf16"), (4, "bf16"), (4, "fp8")])
def test_ep_emulated_same_bits_as_one_rank(ep, precision):
    L = make_layer(64, 64, 64, 8, 2, 64, seed=5)
    y1, g1 = run(L, precision)
    group = mok.EPGroup(ep)
    layers, rank_inputs = _ep_ranks(L, ep, group, 64 // ep, precision=precision)

    def rank(r):
        a, dy = rank_inputs(r)
        y, saved = layers[r].forward(**a)
        return y, layers[r].backward(dy, **a, saved=saved)
    res = _on_threads([lambda r=r: rank(r) for r in range(ep)])
    for r, got in enumerate(res):
        assert not isinstance(got, Exception), got
        y, g = got
        tok, ex = slice(r * 64 // ep, (r + 1) * 64 // ep), slice(r * 8 // ep, (r + 1) * 8 // ep)
        assert np.array_equal(y, y1[tok]), r
        assert np.array_equal(g.dx, g1.dx[tok]), r
        assert np.array_equal(g.d_topk_weights, g1.d_topk_weights[tok]), r
        for n in ("dw_gate", "dw_up", "dw_down"):
            assert np.array_equal(getattr(g, n), getattr(g1, n)[ex]), (r, n)
    del layers


def test_ep_mistake_on_one_rank_fails_every_rank_at_once():
    import time
    L = make_layer(32, 64, 64, 4, 2, 0, seed=6)
    group = mok.EPGroup(2, timeout_ms=20000)
    layers, rank_inputs = _ep_ranks(L, 2, group, 16)
    a0, _ = rank_inputs(0)
    a1, _ = rank_inputs(1)
    a1["x"] = np.ascontiguousarray(a1["x"][:, :32])  # a shape mistake, found in Python
    t0 = time.perf_counter()
    res = _on_threads([lambda: layers[0].forward(**a0), lambda: layers[1].forward(**a1)])
    assert time.perf_counter() - t0 < 5, "the healthy rank waited for a timeout"
    assert isinstance(res[1], ValueError) and "H from x" in str(res[1]), res[1]
    assert isinstance(res[0], mok.MokInvalidArgument) and "another rank" in str(res[0]), res[0]
    # The group still works.
    a1, _ = rank_inputs(1)
    res = _on_threads([lambda: layers[0].forward(**a0), lambda: layers[1].forward(**a1)])
    assert not any(isinstance(x, Exception) for x in res), res
