"""ep_table.py: the accounting and tables of bench/ep.py, without torch (so that they are tested
on any machine): which kernels move rows between GPUs, how many times per forward+backward
each moves a rank's remote rows, and the two tables ep.md holds."""

# The kernels that move rows between GPUs, per implementation: (what, does kernel name k belong,
# how many times per forward+backward they move a rank's remote rows, note). The profiler names
# kernels with their arguments ("dispatch_rows(dispatch_args, int)"), so names are matched by
# their start or by a part.
#   mok: dispatch_rows pulls the backward's x and dy. The forward's dispatch runs in its layer
#   launch (layer_forward), and combine has no kernel: the down GEMM's forward epilogue and the
#   gate/up dgrad's epilogue push each row to its token's rank, y and dx. So the forward's x,
#   y and the backward's dx are rated together over the whole time of the launches they run
#   in (layer_forward, gemm_dgrad_gateup; the GEMMs compute there too): a lower bound.
#   all_to_all + grouped_mm: NCCL's all-to-all kernels carry the rows out and back, forward and
#   backward; dispatch and combine share the kernel names, so they are counted together.
MOVERS = {
    "mok": [
        ("dispatch", lambda k: k.startswith("dispatch_rows"), 2, "the backward's x and dy"),
        ("combine", lambda k: "layer_forward" in k or "gemm_dgrad_gateup" in k, 3,
         "the forward's dispatch and combine, the backward's combine, in the layer launch and the "
         "gate/up dgrad: GB/s over those launches, a lower bound"),
    ],
    "all_to_all + grouped_mm": [
        ("dispatch + combine",
         lambda k: "nccl" in k.lower() and ("SendRecv" in k or "AllToAll" in k), 4,
         "NCCL all-to-all kernels"),
    ],
}


def kernel_ms_by_mover(impl, key_us):
    """{what: ms} from (kernel name, microseconds) pairs of one forward+backward."""
    out = {}
    for what, pick, _, _ in MOVERS[impl]:
        out[what] = sum(us for k, us in key_us if pick(k)) / 1e3
    return out


def gbs(remote_bytes, moves, ms):
    """GB/s of `moves` x `remote_bytes` over `ms`, or None without a time."""
    return remote_bytes * moves / ms / 1e6 if ms else None


def tables(ranks, device, commit, results):
    """ep.md: the times, then the traffic between GPUs; results as bench/ep.py collects them."""
    lines = [f"ep = {ranks}, one process per GPU ({device}), mok {commit}; times: the slowest "
             f"rank; TF/s per GPU: one rank's routed and shared FLOPs over that time", "",
             "| shape | impl | fwd ms | bwd ms | fwd TF/s/GPU | bwd TF/s/GPU | bits identical |",
             "|" + "---|" * 7]
    for r in results:
        lines.append(f"| {r['shape']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | "
                     f"{r['fwd_tflops']:.0f} | {r['bwd_tflops']:.0f} | "
                     f"{'yes' if r['bits_equal'] else 'NO'} |")
    lines += ["", "Traffic between GPUs per forward+backward: remote MB, the rows of a rank's "
              "tokens routed to experts on other GPUs (H bf16 each; the most of any rank); moved "
              "MB, that times the moves; kernel ms, the kernels that move them (the slowest "
              "rank); GB/s, moved over kernel ms, per GPU.", "",
              "| shape | impl | what | remote MB | moves | moved MB | kernel ms | GB/s | note |",
              "|" + "---|" * 9]
    for r in results:
        for what, _, moves, note in MOVERS[r["impl"]]:
            ms = r["comm_ms"].get(what, 0.0)
            rate = gbs(r["remote_bytes"], moves, ms)
            lines.append(f"| {r['shape']} | {r['impl']} | {what} | {r['remote_bytes'] / 1e6:.1f} | "
                         f"{moves} | {r['remote_bytes'] * moves / 1e6:.1f} | {ms:.3f} | "
                         f"{'-' if rate is None else f'{rate:.0f}'} | {note} |")
    return "\n".join(lines) + "\n"
