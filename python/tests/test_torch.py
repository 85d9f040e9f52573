"""test_torch.py: mok.moe / mok.MoELayer against a plain float32 PyTorch layer, on the CPU backend
and (with a GPU) the CUDA backend: forward and every gradient, bitwise repeats, the workspace
cache, bad input, torch.compile(fullgraph=True), CUDA streams and graph capture.
Skipped without torch. CUDA cases are skipped without a GPU, and while mok's CUDA backend reports
MOK_ERR_UNSUPPORTED unless MOK_REQUIRE_CUDA=1 (then they fail instead)."""
import os

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import mok  # noqa: E402
from mok import torch_ops  # noqa: E402


def _cuda_reason():
    if not torch.cuda.is_available() or mok.cuda_device_count() == 0:
        return "no GPU"
    try:
        mok.core.workspace(mok.Dims(64, 64, 0, 4, 2), 8, "cuda", 0)
    except mok.MokUnsupported as e:
        if os.environ.get("MOK_REQUIRE_CUDA") == "1":
            raise
        return f"mok CUDA backend: {e.message}"
    return None


_CUDA_SKIP = _cuda_reason()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(_CUDA_SKIP is not None,
                                                                reason=str(_CUDA_SKIP)))]
needs_cuda = pytest.mark.skipif(_CUDA_SKIP is not None, reason=str(_CUDA_SKIP))


def make(t, h, i, e, k, i_s, device, seed=0):
    """Leaf tensors of one call (bf16 weights, fp32 router weights) and dy."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(torch.bfloat16)
    p = torch.randn(t, e, generator=g).softmax(-1)
    tw, ids = p.topk(k, dim=-1)
    ten = dict(x=rn(t, h), topk_ids=ids.to(torch.int32), topk_weights=tw,
               w_gate=rn(e, i, h, sc=h ** -0.5), w_up=rn(e, i, h, sc=h ** -0.5),
               w_down=rn(e, h, i, sc=i ** -0.5), ws_gate=None, ws_up=None, ws_down=None)
    if i_s:
        ten.update(ws_gate=rn(i_s, h, sc=h ** -0.5), ws_up=rn(i_s, h, sc=h ** -0.5),
                   ws_down=rn(h, i_s, sc=i_s ** -0.5))
    ten = {n: None if v is None else v.to(device) for n, v in ten.items()}
    for n in ("x", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"):
        if ten[n] is not None:
            ten[n].requires_grad_()
    return ten, rn(t, h).to(device)


DIFF = ("x", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


def ref_moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
            ws_down=None):
    """The layer in float32 PyTorch, one expert at a time."""
    xf = x.float()
    y = torch.zeros_like(xf)
    for e in range(w_gate.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        xe = xf[tok]
        a = F.silu(xe @ w_gate[e].float().T) * (xe @ w_up[e].float().T)
        y = y.index_add(0, tok, (a @ w_down[e].float().T) * topk_weights[tok, slot, None])
    if ws_gate is not None:
        a = F.silu(xf @ ws_gate.float().T) * (xf @ ws_up.float().T)
        y = y + a @ ws_down.float().T
    return y


def fwd_bwd(fn, ten, dy):
    y = fn(**ten)
    leaves = [ten[n] for n in DIFF if ten[n] is not None]
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return y, grads


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item() if b.norm() > 0 else a.norm().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(64, 128, 128, 8, 2, 64), (33, 64, 192, 4, 1, 0)])
def test_matches_float32_reference(device, shape):
    ten, dy = make(*shape, device)
    y, g = fwd_bwd(mok.moe, ten, dy)
    yr, gr = fwd_bwd(ref_moe, ten, dy)
    assert y.dtype == torch.bfloat16 and rel(y, yr) < 2e-2
    names = [n for n in DIFF if ten[n] is not None]
    for n, a, b in zip(names, g, gr):
        assert a.dtype == ten[n].dtype and a.shape == ten[n].shape, n
        assert rel(a, b) < 2e-2, (n, rel(a, b))


@pytest.mark.parametrize("device", DEVICES)
def test_int64_ids_and_repeatable_bits(device):
    ten, dy = make(48, 64, 64, 8, 2, 64, device, seed=1)
    y1, g1 = fwd_bwd(mok.moe, ten, dy)
    y2, g2 = fwd_bwd(mok.moe, dict(ten, topk_ids=ten["topk_ids"].long()), dy)
    assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize("device", DEVICES)
def test_int64_ids_outside_int32_refused(device):
    """int64 ids are not wrapped into int32 (2^32 + 2 would have become expert 2): values outside
    int32 reach mok as ids it refuses, with no host synchronisation."""
    ten, _ = make(48, 64, 64, 8, 2, 64, device, seed=1)
    for bad in (2 ** 32 + 2, -(2 ** 32) + 1):
        ids = ten["topk_ids"].long()
        ids[3, 1] = bad
        with pytest.raises((ValueError, mok.MokExpertIdError)):
            y = mok.moe(**dict(ten, topk_ids=ids))
            if y.is_cuda:
                mok.check(y.device)


@pytest.mark.parametrize("device", DEVICES)
def test_undefined_dy_gives_no_gradients(device):
    """A y whose gradient is undefined (not zeros) reaches backward as None, and every input's
    gradient is None: autograd does not materialise zeros for y (the same switch keeps it from
    making them for the uint8 `saved`, which the CUDA peak test below sees)."""
    ten, _ = make(40, 64, 64, 8, 2, 64, device, seed=2)
    y = torch._C._functions.UndefinedGrad()(mok.moe(**ten))
    leaves = [ten[n] for n in DIFF if ten[n] is not None]
    grads = torch.autograd.grad(y.float().sum(), leaves, allow_unused=True)
    assert all(g is None for g in grads)


@pytest.mark.parametrize("device", DEVICES)
def test_module(device):
    layer = mok.MoELayer(64, 128, 8, 2, shared_inter=64, device=device)
    x = torch.randn(2, 16, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    tw, ids = torch.randn(2, 16, 8, device=device).softmax(-1).topk(2, dim=-1)
    y = layer(x, ids, tw)
    assert y.shape == x.shape
    y.float().square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16, name
        assert p.grad.float().norm() > 0, name
    assert x.grad.shape == x.shape
    assert "experts=8" in repr(layer)


@pytest.mark.parametrize("device", DEVICES)
def test_workspace_reused_across_calls_and_shapes(device):
    mok.clear_cache()
    kind = torch.device(device).type
    ours = lambda: [w for w in mok.core.cached_workspaces() if w.backend == kind]
    calls = {t: make(t, 64, 64, 4, 2, 0, device, seed=t) for t in (10, 7, 5, 64)}
    fwd_bwd(mok.moe, *calls[10])
    (ws,) = ours()
    fwd_bwd(mok.moe, *calls[7])
    assert ours() == [ws]                       # fewer tokens: the same workspace
    ten5, dy5 = calls[5]
    y5 = mok.moe(**ten5)                        # forward now, backward after the cache grew
    fwd_bwd(mok.moe, *calls[64])
    (grown,) = ours()
    assert grown is not ws and grown.max_tokens >= 64
    (dx,) = torch.autograd.grad(y5, [ten5["x"]], dy5)
    (ref,) = torch.autograd.grad(ref_moe(**ten5), [ten5["x"]], dy5.float())
    assert rel(dx, ref) < 2e-2
    fwd_bwd(mok.moe, *make(16, 64, 128, 4, 2, 0, device))
    assert len(ours()) == 2                     # another layer shape: its own workspace


def test_bad_input_names_the_argument():
    ten, _ = make(8, 64, 64, 4, 2, 64, "cpu")
    call = lambda **kw: mok.moe(**dict(ten, **kw))
    with pytest.raises(TypeError, match="x has dtype torch.float32"):
        call(x=ten["x"].float())
    with pytest.raises(TypeError, match="topk_weights has dtype torch.float16; expected "
                                        "torch.float32 or torch.bfloat16"):
        call(topk_weights=ten["topk_weights"].half())
    with pytest.raises(TypeError, match="topk_ids has dtype torch.int16"):
        call(topk_ids=ten["topk_ids"].short())
    with pytest.raises(ValueError, match=r"w_up has shape \(4, 32, 64\)"):
        call(w_up=ten["w_up"][:, :32].contiguous())
    with pytest.raises(ValueError, match="w_down is not contiguous"):
        call(w_down=torch.empty(4, 64, 64, dtype=torch.bfloat16).transpose(1, 2))
    with pytest.raises(ValueError, match="ws_up, ws_down missing"):
        call(ws_up=None, ws_down=None)
    with pytest.raises(ValueError, match=r"topk_ids has values in 0\.\.4; expected 0\.\.E-1"):
        call(topk_ids=torch.where(ten["topk_ids"] == 3, 4, ten["topk_ids"]))
    flat = torch.empty(8 * 64 + 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x .* is not 16-byte aligned"):
        call(x=flat[1:].view(8, 64))
    with pytest.raises(TypeError, match="w_gate is a ndarray"):
        call(w_gate=ten["w_gate"].detach().float().numpy())
    with pytest.raises(TypeError, match="MoELayer: dtype"):
        mok.MoELayer(64, 64, 4, 2, dtype=torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_topk_weights(device):
    """bf16 router weights are taken as their fp32 values; their gradient comes back bf16."""
    ten, dy = make(40, 64, 64, 8, 2, 64, device, seed=3)
    tw16 = ten["topk_weights"].detach().bfloat16().requires_grad_()
    tw32 = tw16.detach().float().requires_grad_()
    y16, g16 = fwd_bwd(mok.moe, dict(ten, topk_weights=tw16), dy)
    y32, g32 = fwd_bwd(mok.moe, dict(ten, topk_weights=tw32), dy)
    assert torch.equal(y16, y32)
    assert g16[1].dtype == torch.bfloat16 and torch.equal(g16[1], g32[1].bfloat16())
    assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(g16, g32)) if i != 1)


def test_padding_slots_are_refused_clearly():
    """topk_ids = -1 (a router's padding slot) is not taken: the message says so and how to pass
    such a slot (any expert, weight 0), on the torch and the numpy API."""
    ten, _ = make(8, 64, 64, 4, 2, 0, "cpu")
    ids = ten["topk_ids"].clone()
    ids[3, 1] = -1
    with pytest.raises(ValueError, match=r"padding slots \(topk_ids = -1\) are not supported: "
                                         r"give each any expert id and weight 0"):
        mok.moe(**dict(ten, topk_ids=ids))
    arr = {n: None if v is None else v.detach() for n, v in ten.items()}
    bits = {n: (v.view(torch.int16).numpy().view("uint16") if v.dtype == torch.bfloat16
                else v.numpy()) for n, v in arr.items() if v is not None}
    with pytest.raises(ValueError, match=r"padding slots \(topk_ids = -1\) are not supported"):
        mok.forward(bits["x"], ids.numpy(), bits["topk_weights"], bits["w_gate"], bits["w_up"],
                    bits["w_down"])


@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_grad_and_vjp(device):
    """torch.func.grad and vjp go through the layer and give autograd's gradients."""
    ten, dy = make(24, 64, 64, 4, 2, 64, device, seed=4)
    names = [n for n in DIFF if ten[n] is not None]
    _, want = fwd_bwd(mok.moe, ten, dy)
    leaves = tuple(ten[n].detach() for n in names)

    def loss(*leaves):
        return (mok.moe(**dict(ten, **dict(zip(names, leaves)))).float() * dy.float()).sum()

    got = torch.func.grad(loss, argnums=tuple(range(len(names))))(*leaves)
    for n, a, b in zip(names, got, want):
        assert torch.equal(a, b), n
    y, vjp = torch.func.vjp(lambda x: mok.moe(**dict(ten, x=x)), ten["x"].detach())
    assert torch.equal(vjp(dy)[0], want[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("i_s", [64, 0])
def test_main_grads_accumulate_in_fp32(device, i_s):
    """main_grads (Megatron's param.main_grad): backward adds the weight gradients to fp32
    buffers, the weights get no .grad, and x, topk_weights get theirs as before. One step from
    zeros holds the fp32 sums whose bf16 rounding the bf16 gradients are; a second step adds the
    same again (here exactly: twice a float is exact)."""
    ten, dy = make(40, 64, 64, 8, 2, i_s, device, seed=5)
    names = [n for n in DIFF[2:] if ten[n] is not None]
    _, want = fwd_bwd(mok.moe, ten, dy)
    main = [torch.zeros(ten[n].shape, dtype=torch.float32, device=device) for n in names]
    for step in (1, 2):
        x = ten["x"].detach().requires_grad_()
        y = mok.moe(**dict(ten, x=x), main_grads=main)
        y.backward(dy)
        assert torch.equal(x.grad, want[0]) and all(ten[n].grad is None for n in names)
        for n, m, w in zip(names, main, want[2:]):
            assert torch.equal(m.bfloat16(), w) if step == 1 else torch.equal(m, 2 * m1[n]), n
        m1 = {n: m.clone() for n, m in zip(names, main)}
    with pytest.raises(TypeError, match="the main grad of w_up is torch.bfloat16; expected "
                                        "torch.float32"):
        mok.moe(**ten, main_grads=[main[0], main[1].bfloat16(), *main[2:]])
    with pytest.raises(ValueError, match=f"main_grads has 2 tensors; expected one per weight "
                                         f"\\({len(names)}"):
        mok.moe(**ten, main_grads=main[:2])


def test_layer_main_grad():
    """MoELayer(main_grad=True) makes each weight's fp32 main_grad and adds to it step by step."""
    torch.manual_seed(0)
    layer = mok.MoELayer(64, 64, 4, 2, shared_inter=64, main_grad=True)
    x = torch.randn(16, 64).bfloat16()
    tw, ids = torch.randn(16, 4).softmax(-1).topk(2, -1)
    layer(x, ids, tw).float().sum().backward()
    first = [p.main_grad.clone() for p in layer.parameters()]
    assert len(first) == 6 and all(p.grad is None for p in layer.parameters())
    assert all(m.dtype == torch.float32 and m.abs().sum() > 0 for m in first)
    layer(x, ids, tw).float().sum().backward()
    assert all(torch.equal(p.main_grad, 2 * m) for p, m in zip(layer.parameters(), first))


def test_layer_main_grad_under_compile():
    """Under torch.compile (not fullgraph) the main-grad layer runs eagerly and adds the same."""
    torch.manual_seed(0)
    layer = mok.MoELayer(64, 64, 4, 2, main_grad=True)
    x = torch.randn(16, 64).bfloat16()
    tw, ids = torch.randn(16, 4).softmax(-1).topk(2, -1)
    layer(x, ids, tw).float().sum().backward()
    eager = [p.main_grad.clone() for p in layer.parameters()]
    for p in layer.parameters():
        p.main_grad.zero_()
    torch.compile(lambda x: layer(x, ids, tw), backend="aot_eager")(x).float().sum().backward()
    assert all(torch.equal(p.main_grad, m) for p, m in zip(layer.parameters(), eager))


def test_meta_tensors_give_shapes():
    layer = mok.MoELayer(64, 128, 8, 2, shared_inter=64, device="meta")
    x = torch.empty(3, 5, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.empty(3, 5, 2, device="meta", dtype=torch.int64)
    tw = torch.empty(3, 5, 2, device="meta", requires_grad=True)
    y = layer(x, ids, tw)
    assert y.shape == x.shape and y.device.type == "meta"
    y.sum().backward()
    assert x.grad.shape == x.shape and layer.w_down.grad.shape == layer.w_down.shape


@needs_cuda
def test_bad_device_names_the_argument():
    ten, _ = make(8, 64, 64, 4, 2, 0, "cuda")
    with pytest.raises(ValueError, match="w_up is on cpu; expected x's device cuda"):
        mok.moe(**dict(ten, w_up=ten["w_up"].cpu()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend,precision", [("aot_eager", "bf16"), ("inductor", "bf16"),
                                               ("aot_eager", "fp8")])
def test_torch_compile_fullgraph(device, backend, precision):
    torch._dynamo.reset()
    layer = mok.MoELayer(64, 128, 8, 2, shared_inter=64, device=device, precision=precision)
    x = torch.randn(40, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    tw, ids = torch.randn(40, 8, device=device).softmax(-1).topk(2, dim=-1)
    tw.requires_grad_()
    dy = torch.randn(40, 64, device=device, dtype=torch.bfloat16)
    wrt = [x, tw, *layer.parameters()]

    def step(x, ids, tw):
        return layer(x, ids, tw) * 2.0

    y = step(x, ids, tw)
    g = torch.autograd.grad(y, wrt, dy)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    yc = compiled(x, ids, tw)
    gc = torch.autograd.grad(yc, wrt, dy)
    assert torch.equal(y, yc)
    assert all(torch.equal(a, b) for a, b in zip(g, gc))


def test_opcheck():
    ten, _ = make(16, 64, 64, 4, 2, 64, "cpu")
    args = tuple(ten[n] for n in ("x", "topk_ids", "topk_weights", "w_gate", "w_up", "w_down",
                                  "ws_gate", "ws_up", "ws_down"))
    # Not test_aot_dispatch_dynamic: it compares every output bitwise, and the padding bytes of
    # `saved` are left unwritten (test_torch_compile_* compare y and the gradients instead).
    torch.library.opcheck(torch.ops.mok.forward.default, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_dynamic_tokens(device):
    torch._dynamo.reset()
    layer = mok.MoELayer(64, 64, 4, 2, device=device)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for t in (9, 23, 40):
        ten, dy = make(t, 64, 64, 4, 2, 0, device, seed=t)
        args = (ten["x"], ten["topk_ids"], ten["topk_weights"])
        y, yc = layer(*args), compiled(*args)
        (g,) = torch.autograd.grad(y, [ten["x"]], dy)
        (gc,) = torch.autograd.grad(yc, [ten["x"]], dy)
        assert torch.equal(y, yc) and torch.equal(g, gc)


# ---- FP8 (DESIGN.md §8) -------------------------------------------------------------------------
def test_fp8_cpu_same_bits_as_numpy_api():
    ten, dy = make(48, 64, 128, 8, 2, 64, "cpu", seed=5)
    y, g = fwd_bwd(lambda **t: mok.moe(**t, precision="fp8"), ten, dy)
    bits = lambda t: None if t is None else t.detach().view(torch.int16).numpy().view("uint16")
    args = [bits(ten[n]) if n != "topk_ids" and n != "topk_weights" else ten[n].detach().numpy()
            for n in ("x", "topk_ids", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate",
                      "ws_up", "ws_down")]
    yn, saved = mok.forward(*args, precision="fp8")
    gn = mok.backward(bits(dy), *args, saved=saved, precision="fp8")
    assert (bits(y) == yn).all()
    assert (bits(g[0]) == gn.dx).all() and (g[1].detach().numpy() == gn.d_topk_weights).all()
    for a, n in zip(g[2:], ("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")):
        assert (bits(a) == getattr(gn, n)).all(), n


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_against_float32_reference(device):
    """Every output within what e4m3 costs (0.10: the bound of test_numpy.py's FP8 test), and
    quantized (over 0.01); the weights' gradients are bf16, as the parameters are."""
    ten, dy = make(64, 128, 128, 8, 2, 64, device, seed=6)
    y, g = fwd_bwd(lambda **t: mok.moe(**t, precision="fp8"), ten, dy)
    yr, gr = fwd_bwd(ref_moe, ten, dy)
    assert 0.01 < rel(y, yr) < 0.10
    for n, a, b in zip([n for n in DIFF if ten[n] is not None], g, gr):
        assert a.dtype == ten[n].dtype and 0.01 < rel(a, b) < 0.10, (n, rel(a, b))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_weights_quantized_once_until_they_change(device, monkeypatch):
    calls = []
    quantize = mok.core.Workspace.quantize_weights
    monkeypatch.setattr(mok.core.Workspace, "quantize_weights",
                        lambda self, *a, **k: (calls.append(1), quantize(self, *a, **k))[1])
    torch.manual_seed(7)
    make_layer = lambda: mok.MoELayer(64, 128, 8, 2, shared_inter=64, device=device,
                                      precision="fp8")
    layer, other = make_layer(), make_layer()
    x = torch.randn(40, 64, device=device, dtype=torch.bfloat16)
    tw, ids = torch.randn(40, 8, device=device).softmax(-1).topk(2, dim=-1)
    y1 = layer(x, ids, tw)
    y1.float().square().sum().backward()
    assert len(calls) == 1  # the backward found the forward's copy current
    assert torch.equal(layer(x, ids, tw), y1) and len(calls) == 1
    other(x, ids, tw)
    layer(x, ids, tw)
    assert len(calls) == 2  # each layer's weights have their own copy
    torch.optim.SGD(layer.parameters(), lr=0.01).step()  # in place: the versions move
    y2 = layer(x, ids, tw)
    assert len(calls) == 3 and not torch.equal(y2, y1)
    fresh = make_layer()
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x, ids, tw), y2)  # the new weights, not a stale copy
    with torch.no_grad():
        layer.w_down.data = layer.w_down.data * 2  # another tensor behind the same parameter
    y3 = layer(x, ids, tw)
    assert len(calls) == 5 and not torch.equal(y3, y2)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x, ids, tw), y3)
    mok.MoELayer(64, 128, 8, 2, device=device)(x, ids, tw)
    assert len(calls) == 6  # bf16: no copy


def test_fp8_router_layer_and_bad_precision():
    torch.manual_seed(8)
    layers = {p: mok.MoELayer(64, 64, 8, 2, router=mok.Router(64, 8, 2), precision=p)
              for p in ("bf16", "fp8")}
    layers["fp8"].load_state_dict(layers["bf16"].state_dict())
    x = torch.randn(24, 64, dtype=torch.bfloat16)
    y = {p: layer(x) for p, layer in layers.items()}
    assert 0.01 < rel(y["fp8"], y["bf16"]) < 0.10
    y["fp8"].float().square().sum().backward()
    assert all(p.grad is not None for p in layers["fp8"].parameters())
    ten, _ = make(8, 64, 64, 4, 2, 0, "cpu")
    with pytest.raises(ValueError, match="precision is 'fp16'; expected 'bf16' or 'fp8'"):
        mok.moe(**ten, precision="fp16")
    with pytest.raises(ValueError, match="MoELayer: precision is 'e4m3'"):
        mok.MoELayer(64, 64, 4, 2, precision="e4m3")


@needs_cuda
def test_cuda_fp8_agrees_with_cpu_backend():
    ten, dy = make(96, 128, 128, 8, 2, 64, "cpu", seed=9)
    fp8 = lambda **t: mok.moe(**t, precision="fp8")
    y, g = fwd_bwd(fp8, ten, dy)
    tc = {n: None if v is None else v.detach().cuda().requires_grad_(v.requires_grad)
          for n, v in ten.items()}
    yc, gc = fwd_bwd(fp8, tc, dy.cuda())
    assert rel(yc.cpu(), y) < 1e-2
    for a, b in zip(gc, g):
        assert rel(a.cpu(), b) < 1e-2


@needs_cuda
def test_cuda_fp8_graph_replay_quantizes_the_weights_of_then():
    """A captured FP8 call quantizes the weights in the graph: a replay after the weights changed
    in place gives what an eager call with the new weights gives."""
    ten, dy = make(64, 128, 128, 8, 2, 64, "cuda", seed=10)
    args = [ten[n] if n == "topk_ids" or ten[n] is None else ten[n].detach() for n in
            ("x", "topk_ids", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up",
             "ws_down")]
    call = lambda: torch.ops.mok.forward(*args, 0, 0, "fp8")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g, _ = call()
    with torch.no_grad():
        args[5].mul_(-1.5)  # w_down, in place
        args[3].copy_(args[3].flip(0))  # w_gate, in place
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_g, call()[0])


@needs_cuda
def test_cuda_backward_peak_is_saved_outputs_and_grads():
    """The memory torch holds at the peak of one forward + backward is y, `saved`, dx,
    d_topk_weights and the weight gradients, nothing more (1 MB of slack): before the binding
    kept autograd from materialising a gradient for `saved`, a zero tensor of saved's size came
    on top (perf-log 2026-12-03)."""
    ten, dy = make(4096, 256, 1024, 8, 2, 0, "cuda", seed=4)
    mok.moe(**ten)  # the cached workspace (cudaMalloc'ed, outside torch) exists before the count
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    # Requested bytes, not allocated ones: the allocator's rounding and block reuse do not count.
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    y, g = fwd_bwd(mok.moe, ten, dy)
    torch.cuda.synchronize()
    peak = torch.cuda.memory_stats()["requested_bytes.all.peak"] - base
    dev = ten["x"].device.index or 0
    ws = mok.core.workspace(mok.Dims(256, 1024, 0, 8, 2), 4096, "cuda", dev)  # the one it used
    expected = y.nbytes + torch_ops._saved_len(ws, 4096) + sum(t.nbytes for t in g)
    assert expected <= peak <= expected + (1 << 20), (peak, expected)


@needs_cuda
def test_cuda_agrees_with_cpu_backend():
    ten, dy = make(96, 128, 128, 8, 2, 64, "cpu", seed=3)
    y, g = fwd_bwd(mok.moe, ten, dy)
    tc = {n: None if v is None else v.detach().cuda().requires_grad_(v.requires_grad)
          for n, v in ten.items()}
    yc, gc = fwd_bwd(mok.moe, tc, dy.cuda())
    assert rel(yc.cpu(), y) < 1e-2
    for a, b in zip(gc, g):
        assert rel(a.cpu(), b) < 1e-2


@needs_cuda
def test_cuda_side_stream_and_graph_capture():
    ten, dy = make(64, 128, 128, 8, 2, 64, "cuda", seed=4)
    args = [ten[n] if n == "topk_ids" or ten[n] is None else ten[n].detach() for n in
            ("x", "topk_ids", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up",
             "ws_down")]
    y, saved = torch.ops.mok.forward(*args)
    g = torch.ops.mok.backward(dy, *args, saved)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on the side stream, as torch.cuda.graph wants
        y_side, saved_side = torch.ops.mok.forward(*args)
        g_side = torch.ops.mok.backward(dy, *args, saved_side)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g, saved_g = torch.ops.mok.forward(*args)
        g_g = torch.ops.mok.backward(dy, *args, saved_g)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    for got in ((y_side, *g_side), (y_g, *g_g)):
        for a, b in zip(got, (y, *g)):
            assert torch.equal(a, b)


@needs_cuda
def test_cuda_expert_id_out_of_range():
    ten, _ = make(16, 64, 64, 4, 2, 0, "cuda")
    bad = torch.where(ten["topk_ids"] == 3, 4, ten["topk_ids"])
    mok.check("cuda")  # nothing pending
    try:
        mok.set_debug(True)
        with pytest.raises(ValueError, match="topk_ids has values in"):
            mok.moe(**dict(ten, topk_ids=bad))
        mok.set_debug(False)
        mok.moe(**dict(ten, topk_ids=bad))  # queued; the device flags it
        with pytest.raises(mok.MokExpertIdError):
            mok.check("cuda")
        mok.check("cuda")  # reported once, then cleared
    finally:
        mok.set_debug(os.environ.get("MOK_DEBUG", "0") not in ("", "0"))


@needs_cuda
def test_ep_group_of_one_process():
    """ep_nccl.py's checks (D4 against the ungrouped run, a late rank) on a torch.distributed
    group of one process: mok's NCCL group, its symmetric window and its device barriers."""
    import torch.distributed as dist
    import ep_nccl
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    try:
        assert ep_nccl.run(dist.group.WORLD) == []
        with pytest.raises(ValueError, match="exceeds max_tokens"):  # the workspace cannot grow
            ep_nccl.step(ep_nccl.global_batch(2, torch.device("cuda")), dist.group.WORLD)
    finally:
        mok.clear_cache()
        dist.destroy_process_group()
