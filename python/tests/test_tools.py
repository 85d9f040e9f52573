"""test_tools.py: tools/kernel_times.py labels the launches of one call and computes GEMM TFLOP/s
from an ncu CSV (a made-up one here, in ncu's column layout); tools/ab.sh runs each build with
its own arguments and compares their bits (stand-in mok scripts); tools/tile_clock.py tabulates
the tile-clock probe's lines (made from the probe's own printf format)."""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import kernel_times  # noqa: E402
import tile_clock  # noqa: E402

FWD = ["schedule(sched_args, int)", "void layer_forward<1>(layer_fwd)"]
BWD = ["saved_open(int const*)", "dispatch_rows(int const*)", "void gemm_dgrad_down<2>(gemm_args)",
       "void gemm_wgrad<2>(gemm_args)", "void gemm_dgrad_gateup<2>(gemm_args)",
       "void gemm_wgrad<2>(gemm_args)", "combine_rows(int const*)", "router_grad(int const*)"]


def fake_ncu(names_us):
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
            '"Metric Value"')
    rows = [f'"{i}","1","mok","h","{n}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","usecond","{us}"'
            for i, (n, us) in enumerate(names_us)]
    return "\n".join(["mok 0.1.0 bench: fine-7b", "==PROF== Connected", head] + rows +
                     ["  kernels per call (CUDA graph kernel nodes): forward 2, backward 8"])


def test_kernel_times_labels_one_call():
    call = [(n, 10.0) for n in FWD] + [(n, 20.0) for n in BWD]
    text = fake_ncu([(n, 99.0) for n in FWD + BWD] + call)  # a reference call, then the timed one
    out = kernel_times.table("fine-7b", text)
    s = next(x for x in kernel_times.SHAPES if x.name == "fine-7b")
    r = 2 * s.T * s.k * s.H * s.I
    assert (f"| forward | dispatch + gate/up + down + combine | layer_forward<1> | 10.0 | "
            f"{3 * r / 10.0 / 1e6:.0f} |" in out)
    assert "| forward | schedule | schedule | 10.0 |  |" in out
    assert f"| backward | gate/up wgrad | gemm_wgrad<2> | 20.0 | {2 * r / 20.0 / 1e6:.0f} |" in out
    assert "| backward | down wgrad | gemm_wgrad<2> |" in out
    assert "| forward | all |  | 20.0 |  |" in out and "| backward | all |  | 160.0 |  |" in out
    assert "99.0" not in out


FAKE_MOK = """#!/usr/bin/env bash
# A stand-in for mok bench: forward 2.000 ms when given --cluster 4, else 1.000; digest $DIGEST.
echo "$0 $*" >> "$(dirname "$0")/argv"
fwd=1.000; [[ " $* " == *" --cluster 4 "* ]] && fwd=2.000
echo "  forward   $fwd 1.0 1.0 1.0"
echo "  backward  3.000 1.0 1.0 1.0"
echo "  repeated bits: identical"
echo "  outputs fnv64: $DIGEST"
"""


def test_ab_passes_a_builds_extra_arguments(tmp_path):
    """tools/ab.sh bench: a build NAME@A,B runs NAME's mok with A B (each = a space), the bits
    column compares every build's digest with the first's, and the last two give bench's min ms."""
    import os
    import subprocess
    for name, digest in (("a", "d1"), ("b", "d2")):
        d = tmp_path / "exp" / name
        d.mkdir(parents=True)
        (d / "mok").write_text(FAKE_MOK.replace("$DIGEST", digest))
        (d / "mok").chmod(0o755)
    env = dict(os.environ, EXP=str(tmp_path / "exp"), OUT=str(tmp_path / "out"), REPS="1",
               SHAPES="s", BUILDS="a a@--cluster=4,--sms=8 b", ARGS="--warmup 0",
               PATH="/usr/bin:/bin")  # no nvidia-smi: the clock and power columns stay empty
    run = subprocess.run(["bash", str(ROOT / "tools" / "ab.sh"), "bench"], env=env,
                         capture_output=True, text=True, check=True)
    rows = [r for r in run.stdout.splitlines() if r.startswith("| 1 |")]
    assert [r.split("|")[3:7] for r in rows[:3]] == [
        [" a ", " 1.000 ", " 3.000 ", " same "],
        [" a@--cluster=4,--sms=8 ", " 2.000 ", " 3.000 ", " same "],
        [" b ", " 1.000 ", " 3.000 ", " other than a "]]
    assert [r.split("|")[9:11] for r in rows[:3]] == [[" 1.0 ", " 1.0 "]] * 3  # bench's min ms
    argv = (tmp_path / "exp" / "a" / "argv").read_text().splitlines()
    assert argv[0].endswith("bench --shape s --warmup 0")
    assert argv[1].endswith("bench --shape s --warmup 0 --cluster 4 --sms 8")
    assert (tmp_path / "out" / "ab" / "a_--cluster_4_--sms_8-s-1.log").exists()


def tile_clock_line(what, product, tiles, kb, kloop, epi, gap, mhz=1500.0, pwait=0.25):
    """A line as src/cuda/tile_clock.cuh prints it, from that file's own printf format."""
    src = (ROOT / "src/cuda/tile_clock.cuh").read_text()
    fmt = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', src[src.index('printf("tile clock'):]
                                                              .split(";")[0]))
    fmt = fmt.replace("%llu", "%d").replace("\\n", "")
    return fmt % (what, product, tiles, kb, kloop, epi, gap, kloop / kb, mhz, pwait)


def test_tile_clock_medians_per_product():
    """tools/tile_clock.py: one row per (launch, product, tiles), medians over the calls, named
    by product for the forward's launch, with the SM clock and the producer's waiting share; the
    two weight gradients stay apart by their tiles."""
    lines = []
    for kloop in (9000.0, 10000.0, 30000.0):  # three calls; the median is the middle one
        lines += [tile_clock_line("forward", 0, 640, 24.0, kloop, 3000.0, 500.0, kloop / 10),
                  tile_clock_line("forward", 2, 384, 4.0, kloop / 6, 2000.0, 100.0,
                                  pwait=kloop / 20000),
                  tile_clock_line("weight gradient", 0, 35328, 8.5, kloop, 2400.0, 300.0),
                  tile_clock_line("weight gradient", 0, 69120, 8.5, kloop, 2400.0, 300.0)]
    out = tile_clock.table("gpt-oss-120b", "noise\n" + "\n".join(lines))
    assert "medians over 3 calls" in out
    assert "| forward gate/up | 640 | 24.0 | 10000 | 417 | 3000 | 500 | 0.74 | 1000 | 0.25 |" in out
    assert "| forward down | 384 | 4.0 | 1667 | 417 | 2000 | 100 | 0.44 | 1500 | 0.50 |" in out
    assert out.count("| weight gradient |") == 2


def test_tile_clock_refuses_a_log_without_lines():
    import pytest
    with pytest.raises(SystemExit):
        tile_clock.table("fine-7b", "mok 0.1.0 bench: fine-7b\n  forward 1.0 1.0 1.0 1.0\n")
