"""test_ep_table.py: bench/ep_table.py, the accounting of bench/ep.py that needs no GPU: which
profiler kernel names move rows between GPUs, the sums per kind, and the tables' numbers."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import ep_table  # noqa: E402

# Kernel names as torch.profiler gives them: demangled, with their arguments.
MOK_CALL = [("sched_count(sched_args)", 3.0), ("dispatch_rows(dispatch_args, int)", 40.0),
            ("void layer_forward<1>(layer_fwd)", 750.0),
            ("combine_rows(int const*, int, int, int, float const*, int4 const*, int4*)", 30.0),
            ("dispatch_rows(dispatch_args, int)", 70.0),
            ("void gemm_dgrad_down<2>(gemm_args)", 300.0),
            ("void gemm_wgrad<2>(gemm_args)", 280.0),
            ("void gemm_dgrad_gateup<2>(gemm_args)", 600.0)]
A2A_CALL = [("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 120.0),
            ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16>(Params)", 900.0),
            ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 80.0)]


def test_movers_pick_the_row_moving_kernels():
    mok = ep_table.kernel_ms_by_mover("mok", MOK_CALL)
    assert mok == {"dispatch": 0.110, "combine": 1.350}, mok
    base = ep_table.kernel_ms_by_mover("all_to_all + grouped_mm", A2A_CALL)
    assert base == {"dispatch + combine": 0.200}, base


def test_tables_rates():
    common = dict(shape="dsv3", fwd_ms=2.0, bwd_ms=4.0, fwd_tflops=100.0, bwd_tflops=200.0,
                  bits_equal=True, remote_bytes=400e6)
    results = [dict(common, impl="mok", comm_ms={"dispatch": 0.5, "combine": 0.0}),
               dict(common, impl="all_to_all + grouped_mm", comm_ms={"dispatch + combine": 8.0},
                    bits_equal=False)]
    md = ep_table.tables(8, "NVIDIA H200", "abc1234", results)
    assert "ep = 8, one process per GPU (NVIDIA H200), mok abc1234" in md
    assert "| dsv3 | mok | 2.000 | 4.000 | 100 | 200 | yes |" in md
    assert "| dsv3 | all_to_all + grouped_mm | 2.000 | 4.000 | 100 | 200 | NO |" in md
    # 2 moves of 400 MB in 0.5 ms: 1600 GB/s; no combine time: no rate
    assert "| dsv3 | mok | dispatch | 400.0 | 2 | 800.0 | 0.500 | 1600 |" in md
    assert "| dsv3 | mok | combine | 400.0 | 3 | 1200.0 | 0.000 | - |" in md
    assert ("| dsv3 | all_to_all + grouped_mm | dispatch + combine | 400.0 | 4 | 1600.0 | 8.000 "
            "| 200 |") in md
