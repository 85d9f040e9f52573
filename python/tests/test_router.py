"""test_router.py: mok.route / mok.Router / MoELayer(router=...) against the plain PyTorch router
of bench/layers.py (same math in float32) and mok.moe: the choice, weights, counts and losses;
every gradient (through topk_weights and both losses); the router's dx added into the layer's;
bitwise repeats. CPU backend here; the same cases on CUDA where a GPU and mok's CUDA backend are.
Skipped without torch."""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import mok  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from layers import torch_router  # noqa: E402

from test_torch import DEVICES  # noqa: E402

CONFIGS = [  # (E, k, options, bias)
    (8, 2, dict(), False),
    (16, 4, dict(renormalize=True), True),
    (32, 8, dict(scoring="sigmoid", n_group=4, topk_group=2, renormalize=True, scale=2.5), True),
    (12, 3, dict(scoring="sigmoid"), False),
]


def _inputs(t, h, e, device, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device).requires_grad_()
    w = (torch.randn(e, h, generator=g) * 1.5 * h ** -0.5).to(torch.bfloat16).to(device)
    b = (torch.randn(e, generator=g) * 0.2).to(device) if bias else None
    return x, w.requires_grad_(), b


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("e,k,opts,bias", CONFIGS)
def test_route_matches_torch(device, e, k, opts, bias):
    t, h = 64, 96
    x, w, b = _inputs(t, h, e, device, bias)
    out = mok.route(x, w, k, b, **opts)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ids, tw, counts, aux, z = torch_router(x2, w2, k, b, **opts)
    assert torch.equal(out.topk_ids.long(), ids)
    assert _rel(out.topk_weights, tw) < 1e-5
    assert torch.equal(out.counts, counts)
    assert abs(out.aux_loss.item() - aux.item()) < 1e-5 * aux.item()
    assert abs(out.z_loss.item() - z.item()) < 1e-5 * z.item()
    g = torch.randn(t, k, generator=torch.Generator().manual_seed(1)).to(device)
    loss = (out.topk_weights * g).sum() + 0.7 * out.aux_loss + 0.3 * out.z_loss
    loss.backward()
    ((tw * g).sum() + 0.7 * aux + 0.3 * z).backward()
    assert _rel(x.grad, x2.grad) < 1e-2  # mok's dx is bf16
    assert _rel(w.grad, w2.grad) < 1e-2  # and so is dW_r
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
def test_router_module_and_bitwise_repeat(device):
    torch.manual_seed(0)
    r = mok.Router(64, 16, 4, scoring="sigmoid", bias=True, renormalize=True).to(device)
    x = torch.randn(3, 20, 64).to(torch.bfloat16).to(device)
    r.bias.copy_(torch.linspace(-0.1, 0.1, 16))
    outs = [r(x) for _ in range(2)]
    assert outs[0].topk_ids.shape == (3, 20, 4) and outs[0].counts.sum().item() == 240
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)
    r.update_bias(torch.tensor([30] + [14] * 15, dtype=torch.int32, device=device), rate=0.01)
    assert r.bias[0].item() == pytest.approx(-0.1 - 0.01)  # took more than its share: less likely
    assert r.bias[1].item() == pytest.approx(torch.linspace(-0.1, 0.1, 16)[1].item() + 0.01)
    with pytest.raises(ValueError):
        mok.Router(64, 16, 4).update_bias(outs[0].counts)
    with pytest.raises(TypeError):
        mok.route(x.reshape(-1, 64).float(), r.weight, 4)
    with pytest.raises(ValueError):
        mok.route(x.reshape(-1, 64), r.weight, 17)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared", [0, 32])
def test_layer_with_router(device, shared):
    """MoELayer(router=...) against mok.route + mok.moe composed by autograd: the same y, counts
    and losses bit for bit; gradients equal to bf16 rounding (the layer's node adds the router's
    dx into the layer's in place; autograd adds two bf16 tensors); repeats bitwise."""
    t, h, i, e, k = 48, 64, 32, 8, 2
    torch.manual_seed(3)
    router = mok.Router(h, e, k, renormalize=True)
    layer = mok.MoELayer(h, i, e, k, shared, router=router).to(device)
    x = torch.randn(t, h).to(torch.bfloat16).to(device)
    dy = torch.randn(t, h).to(torch.bfloat16).to(device)

    def run():
        xi = x.clone().requires_grad_()
        layer.zero_grad()
        y = layer(xi)
        (y.float() * dy.float()).sum().add(0.5 * layer.aux_loss + 0.1 * layer.z_loss).backward()
        return y, xi.grad, [p.grad.clone() for p in layer.parameters()]

    y1, dx1, g1 = run()
    y2, dx2, g2 = run()
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert layer.counts.sum().item() == t * k

    xc = x.clone().requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    wg, wu, wd, *ws, wr = params  # the layer's own parameters, then its router's
    out = mok.route(xc, wr, k, renormalize=True)
    yc = mok.moe(xc, out.topk_ids, out.topk_weights, wg, wu, wd, *(ws or [None] * 3))
    assert torch.equal(y1, yc) and torch.equal(layer.counts, out.counts)
    assert torch.equal(layer.aux_loss, out.aux_loss) and torch.equal(layer.z_loss, out.z_loss)
    (yc.float() * dy.float()).sum().add(0.5 * out.aux_loss + 0.1 * out.z_loss).backward()
    assert _rel(dx1, xc.grad) < 1e-2
    for a, p in zip(g1, params):
        assert torch.equal(a, p.grad) or _rel(a, p.grad) < 1e-2
    with pytest.raises(ValueError):
        layer(x, out.topk_ids, out.topk_weights)
