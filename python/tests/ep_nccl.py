"""ep_nccl.py: expert parallelism over NCCL, one process per GPU (DESIGN.md §2.3).

    torchrun --nproc-per-node N python/tests/ep_nccl.py [--skip-failures]

Every rank builds the same global batch (seeded), runs all of it alone on its GPU (no group,
ep = 1), then its own tokens and experts in the group:
  - D4: its rows of y, dx, d_topk_weights and its experts' weight gradients equal the ep = 1 bits,
    in BF16 and in FP8 (whose quantization reads the other ranks' rows through the window);
  - a rank that comes 2 s late: every rank still finishes with the same bits;
  - (N > 1) a rank that never comes: the others raise MokTimeout at mok.check, and mok refuses
    later calls on that group.
One line per check and rank; exit status 1 if any fails. test_torch.py runs it with one rank.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mok  # noqa: E402

T_RANK, H, I, I_S, E, K = 128, 256, 256, 128, 16, 4


def global_batch(ranks, device):
    g = torch.Generator().manual_seed(7)
    t = T_RANK * ranks
    n = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16)  # noqa
    ten = dict(x=n(t, H), w_gate=n(E, I, H, scale=H ** -0.5), w_up=n(E, I, H, scale=H ** -0.5),
               w_down=n(E, H, I, scale=I ** -0.5), ws_gate=n(I_S, H, scale=H ** -0.5),
               ws_up=n(I_S, H, scale=H ** -0.5), ws_down=n(H, I_S, scale=I_S ** -0.5))
    logits = torch.randn(t, E, generator=g)
    tw, ids = torch.softmax(logits, -1).topk(K, -1)
    ten.update(topk_ids=ids.to(torch.int32), topk_weights=tw.float().contiguous(),
               dy=n(t, H))
    return {k: v.to(device).contiguous() for k, v in ten.items()}


NAMES = ("x", "topk_ids", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up",
         "ws_down")
GRADS = ("x", "topk_weights", "w_gate", "w_up", "w_down")


def step(ten, group=None, max_tokens=None, precision="bf16"):
    """y and the gradients of GRADS (bf16/fp32 tensors) of one forward and backward."""
    leaves = {n: ten[n].clone().requires_grad_(n in GRADS) for n in NAMES}
    y = mok.moe(*(leaves[n] for n in NAMES), group=group, max_tokens=max_tokens,
                precision=precision)
    y.backward(ten["dy"])
    return {"y": y.detach(), **{"d" + n: leaves[n].grad for n in GRADS}}


def rank_slice(ten, r, ranks):
    el = E // ranks
    out = dict(ten)
    for n in ("x", "topk_ids", "topk_weights", "dy"):
        out[n] = ten[n][r * T_RANK:(r + 1) * T_RANK].contiguous()
    for n in ("w_gate", "w_up", "w_down"):
        out[n] = ten[n][r * el:(r + 1) * el].contiguous()
    return out


def same(what, a, b):
    ok = a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return [] if ok else [what]


def run(pg, failures=True):
    """Returns the list of failed checks on this rank."""
    rank, ranks = dist.get_rank(pg), dist.get_world_size(pg)
    dev = torch.device("cuda", torch.cuda.current_device())
    ten = global_batch(ranks, dev)
    group = mok.ep_group(pg, timeout_ms=5000)
    mine = rank_slice(ten, rank, ranks)
    el = E // ranks
    bad = []
    for trial in ("D4", "late rank", "fp8 D4"):
        precision = "fp8" if trial.startswith("fp8") else "bf16"
        one = step(ten, precision=precision)
        want = {"y": one["y"][rank * T_RANK:(rank + 1) * T_RANK],
                "dx": one["dx"][rank * T_RANK:(rank + 1) * T_RANK],
                "dtopk_weights": one["dtopk_weights"][rank * T_RANK:(rank + 1) * T_RANK],
                **{"d" + n: one["d" + n][rank * el:(rank + 1) * el] for n in GRADS[2:]}}
        if trial == "late rank" and rank == ranks - 1:
            time.sleep(2.0)
        got = step(mine, group, T_RANK, precision)
        mok.check(dev)
        fails = [f for n in want for f in same(n, got[n], want[n])]
        print(f"rank {rank}/{ranks} {trial}: {'ok' if not fails else 'FAIL ' + ', '.join(fails)}",
              flush=True)
        bad += [f"{trial}: {f}" for f in fails]
    if failures and ranks > 1:
        bad += absent_rank(mine, rank, ranks, pg, dev)
    return bad


def absent_rank(mine, rank, ranks, pg, dev):
    """The last rank skips a call on a group of its own: the others time out."""
    sub = dist.new_group(list(range(ranks)))
    group = mok.ep_group(sub, timeout_ms=1000)
    step(mine, group, T_RANK)  # every rank: the workspace is made together
    mok.check(dev)
    seen = "came"
    if rank != ranks - 1:
        try:
            step(mine, group, T_RANK)
            mok.check(dev)
            seen = "no error"
        except mok.MokTimeout as e:
            print(f"rank {rank}/{ranks} absent rank: the call raised {type(e).__name__}: {e}",
                  flush=True)
            try:
                step(mine, group, T_RANK)
                seen = "a later call was accepted"
            except mok.MokTimeout:
                seen = "timeout"
    ok = seen in ("timeout", "came")
    print(f"rank {rank}/{ranks} absent rank: {'ok' if ok else 'FAIL ' + seen}", flush=True)
    dist.barrier(pg)
    return [] if ok else ["absent rank: " + seen]


def main():
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    bad = run(dist.group.WORLD, failures="--skip-failures" not in sys.argv)
    mok.clear_cache()  # collective (the windows go): every rank here, in the same order
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
