"""train_moe.py: a small decoder-only transformer, every MLP a Mixture-of-Experts layer, trained on
the bytes of the Python standard library's own source files, with mok or with plain PyTorch.

    python3 examples/train_moe.py --moe mok   --steps 300 --out runs/   # on a GPU
    python3 examples/train_moe.py --moe torch --steps 300 --out runs/
    python3 examples/train_moe.py --preset tiny --device cpu --steps 3  # seconds, CPU backend

The model: byte embeddings (vocabulary 256) and learned positions, `layers` blocks of RMSNorm,
causal attention (torch's scaled_dot_product_attention, math backend: deterministic), RMSNorm and an
MoE (router, top-k of `experts` SwiGLU experts, optional shared expert), then an untied output
layer. All weights are bf16; AdamW steps fp32 master copies and writes them back as bf16. Every
op is one whose bits repeat (matmuls, reductions, the math attention; the embedding and the loss
through one-hot matrices rather than index and gather, whose backwards scatter-add).

--moe mok:   mok.MoELayer(..., router=mok.Router(...)): mok's router and layer, one autograd node.
--moe torch: the same math in PyTorch: bench/layers.py's torch_router (fp32 logits, softmax,
             topk) feeding grouped_mm_moe (torch._grouped_mm; a loop of matmuls where it does
             not run), the benchmark's baseline.
Both start from the same weights (each tensor drawn from a generator seeded by its name) and see
the same batches (a generator seeded by --seed). Every run is made deterministic
(torch.use_deterministic_algorithms), so two runs with --moe mok give the same bits, step for step.

Data: every *.py file under sysconfig.get_paths()["stdlib"] (site-packages excluded), sorted by
path and concatenated; the first 95 % of the bytes train, the rest is held out.

Writes <out>/<tag>.json (per-step loss, held-out loss, tokens/s, the MoE layers' share of a step)
and prints a line every --log-every steps. examples/check_training.py runs mok twice and torch
once and checks them against each other (tools/gpu-check.sh train).
"""
import argparse
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from pathlib import Path

# cuBLAS is deterministic only with a fixed workspace, set before it starts (bench/run.py's rule).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
import mok  # noqa: E402
from layers import grouped_mm_available, grouped_mm_moe, loop_moe, torch_router  # noqa: E402

PRESETS = {
    # dim, layers, heads, seq, batch, experts, top_k, inter, shared_inter
    "small": dict(dim=512, layers=8, heads=8, seq=256, batch=32, experts=16, top_k=2, inter=256,
                  shared_inter=256),
    "tiny": dict(dim=64, layers=2, heads=2, seq=64, batch=2, experts=8, top_k=2, inter=64,
                 shared_inter=64),
}


# ---- data ---------------------------------------------------------------------------------------
def stdlib_bytes(max_bytes=None):
    """The standard library's *.py sources, sorted by path, as one uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    chunks, n = [], 0
    for p in files:
        data = p.read_bytes()
        chunks.append(data)
        n += len(data)
        if max_bytes and n >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class Batches:
    """Random windows of the training bytes, from a generator of its own (the same for every
    run with the same seed); held-out windows at fixed, evenly spaced offsets."""

    def __init__(self, data, seq, batch, seed, device):
        cut = int(len(data) * 0.95)
        self.train, self.held = data[:cut], data[cut:]
        self.seq, self.batch, self.device = seq, batch, device
        self.gen = torch.Generator().manual_seed(seed)

    def _windows(self, src, starts):
        idx = starts[:, None] + torch.arange(self.seq + 1)[None, :]
        w = src[idx].long().to(self.device)
        return w[:, :-1], w[:, 1:]

    def next(self):
        starts = torch.randint(0, len(self.train) - self.seq - 1, (self.batch,), generator=self.gen)
        return self._windows(self.train, starts)

    def held_out(self, n):
        starts = torch.linspace(0, len(self.held) - self.seq - 2, n * self.batch).long()
        return [self._windows(self.held, starts[i * self.batch:(i + 1) * self.batch])
                for i in range(n)]


# ---- the model ----------------------------------------------------------------------------------
class RMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=torch.bfloat16))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)
                * self.weight.float()).to(x.dtype)


class TorchRouter(torch.nn.Module):
    def __init__(self, dim, experts):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(experts, dim, dtype=torch.bfloat16))


class TorchMoE(torch.nn.Module):
    """The PyTorch MoE of the benchmark's baseline, with mok.MoELayer's parameter names."""

    def __init__(self, dim, inter, experts, top_k, shared_inter):
        super().__init__()
        p = lambda *s: torch.nn.Parameter(torch.empty(*s, dtype=torch.bfloat16))  # noqa: E731
        self.router, self.top_k = TorchRouter(dim, experts), top_k
        self.w_gate, self.w_up, self.w_down = p(experts, inter, dim), p(experts, inter, dim), \
            p(experts, dim, inter)
        self.ws_gate = p(shared_inter, dim) if shared_inter else None
        self.ws_up = p(shared_inter, dim) if shared_inter else None
        self.ws_down = p(dim, shared_inter) if shared_inter else None
        self.counts = self.aux_loss = self.z_loss = None

    def forward(self, x):
        ids, tw, self.counts, self.aux_loss, self.z_loss = torch_router(x, self.router.weight,
                                                                        self.top_k)
        impl = grouped_mm_moe if grouped_mm_available(x.device) is None else loop_moe
        return impl(x, ids, tw, self.w_gate, self.w_up, self.w_down, self.ws_gate, self.ws_up,
                    self.ws_down)


def make_moe(kind, precision, dim, inter, experts, top_k, shared_inter):
    if kind == "torch":
        if precision != "bf16":
            raise SystemExit(f"--moe torch runs bf16 only (asked: {precision})")
        return TorchMoE(dim, inter, experts, top_k, shared_inter)
    router = mok.Router(dim, experts, top_k)
    if precision == "bf16":
        return mok.MoELayer(dim, inter, experts, top_k, shared_inter, router=router)
    # The FP8 hook: mok.MoELayer takes precision= once mok's FP8 layer exists.
    import inspect
    if "precision" not in inspect.signature(mok.MoELayer).parameters:
        raise SystemExit("--precision fp8 needs mok's FP8 layer, which this build lacks")
    return mok.MoELayer(dim, inter, experts, top_k, shared_inter, router=router,
                        precision=precision)


class Block(torch.nn.Module):
    def __init__(self, cfg, moe):
        super().__init__()
        d = cfg["dim"]
        self.heads = cfg["heads"]
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(d, d, bias=False, dtype=torch.bfloat16)
        self.moe = moe

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.moe(self.n2(x).reshape(b * s, d)).view(b, s, d)


class Model(torch.nn.Module):
    def __init__(self, cfg, kind, precision):
        super().__init__()
        d = cfg["dim"]
        self.emb = torch.nn.Parameter(torch.empty(256, d, dtype=torch.bfloat16))
        self.pos = torch.nn.Parameter(torch.empty(cfg["seq"], d, dtype=torch.bfloat16))
        self.blocks = torch.nn.ModuleList(
            Block(cfg, make_moe(kind, precision, d, cfg["inter"], cfg["experts"], cfg["top_k"],
                                cfg["shared_inter"])) for _ in range(cfg["layers"]))
        self.norm = RMSNorm(d)
        self.head = torch.nn.Linear(d, 256, bias=False, dtype=torch.bfloat16)

    def forward(self, idx):
        # One-hot rows times the table: a matmul each way (an index's backward would scatter-add).
        x = F.one_hot(idx, 256).to(self.emb.dtype) @ self.emb + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)).float()

    def moes(self):
        return [blk.moe for blk in self.blocks]


@torch.no_grad()
def init_weights(model, seed):
    """Each tensor from a generator seeded by (seed, its name): the same in either model. Norms
    start at 1; everything else N(0, 1 / fan_in), output layers scaled down by depth."""
    depth = len(model.blocks)
    for name, p in model.named_parameters():
        if name.endswith(("n1.weight", "n2.weight", "norm.weight")):
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        fan_in = p.shape[-1]
        std = fan_in ** -0.5
        if name.endswith(("proj.weight", "w_down", "ws_down")):
            std /= math.sqrt(2 * depth)
        if name in ("emb", "pos"):
            std = 0.02
        p.copy_((torch.randn(p.shape, generator=g) * std).to(p.dtype))


# ---- training -----------------------------------------------------------------------------------
class MasterAdamW:
    """AdamW on fp32 copies of the bf16 parameters; each step writes the copies back as bf16."""

    def __init__(self, params, lr, weight_decay=0.1):
        self.params = list(params)
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=(0.9, 0.95),
                                     weight_decay=weight_decay, foreach=False)

    @torch.no_grad()
    def step(self, lr):
        for group in self.opt.param_groups:
            group["lr"] = lr
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m)
            p.grad = None


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def xent(logits, y):
    """Mean cross-entropy in nats per byte, through a one-hot mask: reductions only (no gather,
    whose backward would scatter)."""
    logp = logits.reshape(-1, 256).log_softmax(-1)
    return -(logp * F.one_hot(y.reshape(-1), 256)).sum(-1).mean()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def held_out_loss(model, batches):
    losses = [xent(model(x), y) for x, y in batches]
    return torch.stack(losses).mean().item()


def moe_share(model, cfg, device, step_s, repeats=5):
    """The MoE layers' forward and backward on activations of a step's size, timed alone, over
    the time of a whole step: their share of it."""
    t = cfg["batch"] * cfg["seq"]
    x = (torch.randn(t, cfg["dim"], generator=torch.Generator().manual_seed(5)) * 0.5).to(
        torch.bfloat16).to(device).requires_grad_()
    dy = torch.ones(t, cfg["dim"], dtype=torch.bfloat16, device=device)

    def once():
        for moe in model.moes():
            moe(x).backward(dy)
    once()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        once()
    sync(device)
    model.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / repeats / step_s


def train(args, log=print):
    """One run; returns its record (also written to <out>/<tag>.json when args.out is set). Runs
    with torch's deterministic algorithms, and leaves that setting as it found it."""
    det = getattr(torch.utils, "deterministic", None)
    prev = torch.are_deterministic_algorithms_enabled(), det and det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    if det is not None:  # a debugging aid (NaN-filled new memory), not part of determinism
        det.fill_uninitialized_memory = False
    try:
        return _train(args, log)
    finally:
        torch.use_deterministic_algorithms(prev[0])
        if det is not None:
            det.fill_uninitialized_memory = prev[1]


def _train(args, log):
    cfg = dict(PRESETS[args.preset])
    for key in ("experts", "top_k", "layers"):
        if getattr(args, key, None):
            cfg[key] = getattr(args, key)
    device = torch.device(args.device)
    data = stdlib_bytes(args.max_bytes)
    batches = Batches(data, cfg["seq"], cfg["batch"], args.seed, device)
    held = batches.held_out(args.eval_batches)
    model = Model(cfg, args.moe, args.precision).to(device)
    init_weights(model, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    opt = MasterAdamW(model.parameters(), args.lr)
    log(f"[{args.moe}] {n_params / 1e6:.1f}M parameters, {cfg}, {len(data) / 1e6:.1f} MB of "
        f"stdlib source, {device}")
    losses, times = [], []
    tokens = cfg["batch"] * cfg["seq"]
    for step in range(args.steps):
        x, y = batches.next()
        sync(device)
        t0 = time.perf_counter()
        loss = xent(model(x), y)
        aux = sum(m.aux_loss for m in model.moes()) / cfg["layers"]
        z = sum(m.z_loss for m in model.moes()) / cfg["layers"]
        (loss + args.aux_coef * aux + args.z_coef * z).backward()
        opt.step(lr_at(step, args.steps, args.lr, args.warmup))
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            recent = sorted(times[-args.log_every:])[len(times[-args.log_every:]) // 2]
            log(f"[{args.moe}] step {step + 1:4d}  loss {losses[-1]:.4f}  aux {aux.item():.3f}  "
                f"{tokens / recent:,.0f} tokens/s")
    steady = sorted(times[min(len(times) - 1, 5):])
    step_s = steady[len(steady) // 2]
    record = dict(moe=args.moe, precision=args.precision, preset=args.preset, cfg=cfg,
                  steps=args.steps, seed=args.seed, params=n_params, loss=losses,
                  loss_bits=[int.from_bytes(torch.tensor(v).numpy().tobytes(), "little")
                             for v in losses],
                  held_out=held_out_loss(model, held), tokens_per_s=tokens / step_s,
                  step_ms=step_s * 1e3, moe_share=moe_share(model, cfg, device, step_s),
                  device=str(torch.cuda.get_device_name(device)) if device.type == "cuda"
                  else "cpu")
    log(f"[{args.moe}] held-out loss {record['held_out']:.4f}, {record['tokens_per_s']:,.0f} "
        f"tokens/s, MoE layers {100 * record['moe_share']:.0f} % of a step")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        tag = args.tag or f"{args.moe}-{args.precision}"
        (Path(args.out) / f"{tag}.json").write_text(json.dumps(record) + "\n")
    return record


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moe", choices=("mok", "torch"), default="mok")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--preset", choices=tuple(PRESETS), default="small")
    p.add_argument("--experts", type=int, help="experts per layer (8-64; default: the preset's)")
    p.add_argument("--top-k", dest="top_k", type=int, help="experts per token")
    p.add_argument("--layers", type=int)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--aux-coef", dest="aux_coef", type=float, default=0.01)
    p.add_argument("--z-coef", dest="z_coef", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", dest="eval_batches", type=int, default=8)
    p.add_argument("--max-bytes", dest="max_bytes", type=int, default=None,
                   help="read only this many bytes of the standard library")
    p.add_argument("--log-every", dest="log_every", type=int, default=25)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="folder for <tag>.json")
    p.add_argument("--tag", default=None)
    return p


if __name__ == "__main__":
    train(parser().parse_args())
