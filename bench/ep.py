"""ep.py: expert parallelism across GPUs, one process per GPU (issue 7, DESIGN.md §7):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 8 bench/ep.py --out results/ep

Shapes, per GPU at ep = the world size R: dsv3 (32 experts per GPU, so 32 R in all; 4096 tokens
per GPU; top-8; shared expert) and qwen3-235b (128 experts in all, its T per GPU). Every rank
times, on its own tokens and experts:
  - mok: mok.moe with the world group (NCCL symmetric window, device barriers);
  - baseline: all_to_all_single dispatch (split sizes exchanged first, on the host, as Megatron's
    all-to-all dispatcher does), the torch._grouped_mm expert layer of bench/layers.py on the
    received rows, all_to_all_single combine, then the weighted sum and the shared expert.
Forward and backward ms (CUDA events, median of repeats, every rank the same number of them;
the slowest rank), TFLOP/s per GPU (routed + shared FLOPs of one rank's tokens), and the bytes
that cross GPUs in dispatch and combine with the time of the kernels that move them
(bench/ep_table.py says which kernels, and how mok's combine, which has no kernel of its own,
is counted). Rank 0 writes ep.json and ep.md under --out after every measurement (a run cut
short keeps what it measured) and prints the tables at the end.
"""
import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "python")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.nn.functional as dfn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ep_table  # noqa: E402
import layers  # noqa: E402
from measure import measure  # noqa: E402
from shapes import Shape, fwd_flops  # noqa: E402

import mok  # noqa: E402


def ep_shapes(ranks, names):
    """(name, shape of one rank's call: its T, the global E) for each benchmark."""
    every = {"dsv3": Shape("dsv3", 4096, 7168, 2048, 32 * ranks, 8, 2048),
             "qwen3-235b": Shape("qwen3-235b", 32768, 4096, 1536, 128, 8, 0)}
    return [every[n] for n in names]


def rank_inputs(s, rank, ranks, device, seed):
    """This rank's tokens (its own seed) and its experts' weights (slice of one seeded set)."""
    ins, dy = layers.make_inputs(s, device, seed=seed * 1000 + rank)
    el = s.E // ranks
    for n in ("w_gate", "w_up", "w_down"):
        ins[n] = ins[n].detach()[rank * el:(rank + 1) * el].contiguous().requires_grad_()
    return ins, dy


def a2a_moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
            ws_down=None, group=None):
    """The baseline: dispatch and combine by all_to_all_single around torch._grouped_mm."""
    ranks, el = dist.get_world_size(group), w_gate.shape[0]
    order, tok, counts = layers._route(topk_ids, el * ranks)      # rows sorted by global expert
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)      # [source rank, local expert]
    send = counts.view(ranks, el).sum(1).tolist()                 # host sync, as Megatron's
    recv = recv_counts.view(ranks, el).sum(1).tolist()
    xr = dfn.all_to_all_single(x.new_empty(sum(recv), x.shape[1]), x[tok], recv, send, group)
    expert = torch.repeat_interleave(torch.arange(el, device=x.device).repeat(ranks),
                                     recv_counts)                 # of each received row
    perm = torch.argsort(expert, stable=True)
    offs = torch.bincount(expert, minlength=el).cumsum(0).to(torch.int32)
    xe = xr[perm]
    g = layers._GMM(xe, w_gate.transpose(1, 2), offs=offs)
    u = layers._GMM(xe, w_up.transpose(1, 2), offs=offs)
    o = layers._GMM(F.silu(g) * u, w_down.transpose(1, 2), offs=offs)
    back = o[torch.argsort(perm)]                                 # received order again
    ys = dfn.all_to_all_single(x.new_empty(len(tok), x.shape[1]), back, send, recv, group)
    return layers._combine(x, ys, order, tok, topk_weights,
                           layers._shared(x, ws_gate, ws_up, ws_down))


def remote_rows(ins, rank, el):
    return int((ins["topk_ids"] // el != rank).sum())


def kernel_ms(fn, ins, dy, impl):
    """{what: milliseconds per forward+backward} of the kernels that move rows between GPUs
    (ep_table.MOVERS), by the profiler."""
    from torch.profiler import ProfilerActivity, profile
    reps = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            y = fn(**ins)
            torch.autograd.grad(y, [v for v in ins.values()
                                    if isinstance(v, torch.Tensor) and v.requires_grad], dy)
        torch.cuda.synchronize()
    per_call = [(e.key, e.device_time_total / reps) for e in prof.key_averages()]
    return ep_table.kernel_ms_by_mover(impl, per_call)


def agree_min(n):
    """The fewest of every rank's n: every rank must run as many calls, or the group's calls
    (NCCL's and mok's barriers) pair up wrongly and hang."""
    t = torch.tensor([n], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather(row):
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="results/ep")
    p.add_argument("--shapes", default="dsv3,qwen3-235b")
    p.add_argument("--tokens", type=int, default=0, help="tokens per GPU (default: the shape's)")
    p.add_argument("--budget", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    group = mok.ep_group()
    results = []
    for s in ep_shapes(ranks, args.shapes.split(",")):
        if args.tokens:
            s = s._replace(T=args.tokens)
        if rank == 0:
            print(f"--- {s.name}: ep {ranks}, T {s.T} per GPU, E {s.E}, k {s.k}, H {s.H}, I {s.I}, "
                  f"I_s {s.I_s}", flush=True)
        ins, dy = rank_inputs(s, rank, ranks, dev, args.seed)
        rows = remote_rows(ins, rank, s.E // ranks)
        impls = {"mok": functools.partial(mok.moe, group=group, max_tokens=s.T),
                 "all_to_all + grouped_mm": functools.partial(a2a_moe, group=dist.group.WORLD)}
        for name, fn in impls.items():
            dist.barrier()
            m = measure(fn, ins, dy, budget_s=args.budget, agree=agree_min)
            dist.barrier()
            comm = kernel_ms(fn, ins, dy, name)
            row = dict(shape=s.name, impl=name, ep=ranks, tokens=s.T, rank=rank,
                       fwd_ms=m["fwd_ms"], bwd_ms=m["bwd_ms"], repeats=m["repeats"],
                       bits_equal=m["bits_equal"], remote_bytes=rows * s.H * 2, comm_ms=comm)
            every = gather(row)
            if rank == 0:
                slow = dict(row, fwd_ms=max(r["fwd_ms"] for r in every),
                            bwd_ms=max(r["bwd_ms"] for r in every),
                            bits_equal=all(r["bits_equal"] for r in every),
                            remote_bytes=max(r["remote_bytes"] for r in every),
                            comm_ms={w: max(r["comm_ms"][w] for r in every) for w in comm})
                f = fwd_flops(s)
                slow["fwd_tflops"] = f / slow["fwd_ms"] / 1e9
                slow["bwd_tflops"] = 2 * f / slow["bwd_ms"] / 1e9
                results.append(slow)
                moved = "  ".join(
                    f"{w} {slow['comm_ms'][w]:.3f} ms "
                    f"{ep_table.gbs(slow['remote_bytes'], n, slow['comm_ms'][w]) or 0:.0f} GB/s"
                    for w, _, n, _ in ep_table.MOVERS[name])
                print(f"{s.name:11s} {name:24s} fwd {slow['fwd_ms']:8.3f} ms "
                      f"{slow['fwd_tflops']:6.0f} TF/s  bwd {slow['bwd_ms']:8.3f} ms "
                      f"{slow['bwd_tflops']:6.0f} TF/s  bits {slow['bits_equal']}  "
                      f"remote {slow['remote_bytes'] / 1e6:.1f} MB  {moved}", flush=True)
                write(args.out, ranks, results, quiet=True)
            if name == "mok":
                mok.clear_cache()  # collective: every rank frees the window here
        del ins, dy
        torch.cuda.empty_cache()
    if rank == 0:
        write(args.out, ranks, results)
    dist.destroy_process_group()


def write(out, ranks, results, quiet=False):
    """ep.json and ep.md under out (rank 0); the tables on stdout unless quiet."""
    Path(out).mkdir(parents=True, exist_ok=True)
    commit = os.environ.get("MOK_COMMIT", "unknown")
    (Path(out) / "ep.json").write_text(json.dumps(dict(commit=commit, ranks=ranks,
                                                       results=results), indent=1))
    md = ep_table.tables(ranks, torch.cuda.get_device_name(), commit, results)
    (Path(out) / "ep.md").write_text(md)
    if not quiet:
        print(md, end="")


if __name__ == "__main__":
    main()
