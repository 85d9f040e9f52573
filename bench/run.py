"""run.py: the benchmark of DESIGN.md §7 in one process: for every shape, mok (CUDA backend; the
CPU backend at a reduced token count, labelled, if the CUDA backend says MOK_ERR_UNSUPPORTED),
the torch._grouped_mm layer in default and in deterministic mode, a per-expert loop of matmuls,
and the dense bf16 GEMM ceiling. With --precision fp8 (DESIGN.md §8), in the same run: mok's FP8
layer, PyTorch's FP8 layer (bench/fp8.py: torch._scaled_grouped_mm with row-wise scales; its
weight gradients BF16) and the dense FP8 GEMM ceiling, beside the BF16 rows. Writes bench.json,
bench.md and bench.png under --out and prints the table last.

    python3 bench/run.py --out results/          # the full run (aimed at a few minutes on an
                                                 # H200; no new shape starts after --deadline)
    python3 bench/run.py --smoke --out /tmp/r    # tiny shapes: checks the harness, GPU or CPU
    python3 bench/run.py --precision fp8 --out results/
"""
import argparse
import datetime
import functools
import gc
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

# cuBLAS is deterministic only with a fixed workspace; torch refuses matmuls in deterministic mode
# without this. It must be set before cuBLAS starts. (":4096:8" is torch's default size on sm90.)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("PYTHONUNBUFFERED", "1")

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "python")]

import torch  # noqa: E402

import fp8  # noqa: E402
import layers  # noqa: E402
import report  # noqa: E402
from measure import fwd_bwd, measure, dense_gemm_tflops  # noqa: E402
from shapes import SHAPES, SMOKE, Shape, fwd_flops  # noqa: E402

T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


@contextmanager
def deterministic():
    """torch.use_deterministic_algorithms(True). The NaN fill of new memory that it also turns on
    is a debugging aid, not part of determinism, and would be timed: it stays off."""
    prev, fill = torch.are_deterministic_algorithms_enabled(), None
    det = getattr(torch.utils, "deterministic", None)
    torch.use_deterministic_algorithms(True)
    if det is not None:
        fill, det.fill_uninitialized_memory = det.fill_uninitialized_memory, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev)
        if det is not None:
            det.fill_uninitialized_memory = fill


def _rel(a, b):
    a, b = a.double(), b.double()
    d = b.norm().item()
    return (a - b).norm().item() / d if d else (a - b).norm().item()


# FP8 layers against the float32 reference: e4m3's 3 mantissa bits cost about 6.5 % (relative
# L2) on these Gaussian inputs (tests/test_fp8_layer.c says why); 0.10 is the tests' bound.
FP8_TOL = 0.10


def check_baselines(device, mok_fn, gmm_reason, fp8_fns=None):
    """At a small shape, every implementation against the float32 reference and the grouped_mm
    layer against the loop: the largest relative error over y and all gradients. fp8_fns: the
    FP8 implementations by name, held to FP8_TOL."""
    s = Shape("check", 512, 256, 128, 8, 2, 128)
    ins, dy = layers.make_inputs(s, device, seed=7)
    yr, gr = fwd_bwd(layers.reference_moe, ins, dy)
    outs = {"loop": fwd_bwd(layers.loop_moe, ins, dy)}
    if gmm_reason is None:
        outs["grouped_mm"] = fwd_bwd(layers.grouped_mm_moe, ins, dy)
    for name, fn in [("mok", mok_fn), *(fp8_fns or {}).items()]:
        if fn is None:
            continue
        try:
            outs[name] = fwd_bwd(fn, ins, dy)
        except Exception as e:  # noqa: BLE001 - reported, the bench goes on
            log(f"check: {name} failed: {type(e).__name__}: {e}")
    err = lambda o, r: max(_rel(a, b) for a, b in zip((o[0], *o[1]), (r[0], *r[1])))
    res = {f"{n}_vs_reference": err(o, (yr, gr)) for n, o in outs.items()}
    if "grouped_mm" in outs:
        res["grouped_mm_vs_loop"] = err(outs["grouped_mm"], outs["loop"])
    tol = lambda k: 1e-2 if k.endswith("loop") else FP8_TOL if k.startswith("fp8") else 2e-2
    bad = [k for k, v in res.items() if v > tol(k)]
    res["summary"] = ("FAILED: " + ", ".join(bad) if bad else "OK") + " (" + ", ".join(
        f"{k} {v:.1e}" for k, v in res.items()) + ")"
    return res


def _status(e):
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "out of memory"
    if "determinis" in str(e):
        return f"unsupported: {msg[:120]}"
    return f"error: {type(e).__name__}: {msg[:120]}"


def run_impl(name, fn, shape, ins, dy, args, ctx=None, note=None):
    tokens = ins["x"].shape[0]
    row = dict(shape=shape.name, impl=name, tokens=tokens, device=ins["x"].device.type,
               fwd_flops=fwd_flops(shape, tokens), note=note)
    try:
        with ctx or nullcontext():
            row.update(measure(fn, ins, dy, budget_s=args.budget, min_reps=args.min_reps,
                               max_reps=args.max_reps, warmup=args.warmup))
        row["fwd_tflops"] = row["fwd_flops"] / row["fwd_ms"] / 1e9
        row["bwd_tflops"] = 2 * row["fwd_flops"] / row["bwd_ms"] / 1e9
        row["tflops"] = 3 * row["fwd_flops"] / (row["fwd_ms"] + row["bwd_ms"]) / 1e9  # fwd+bwd
        row["status"] = "ok"
        log(f"{shape.name:14s} {name:34s} fwd {row['fwd_ms']:9.3f} ms {row['fwd_tflops']:6.0f} "
            f"TF/s | bwd {row['bwd_ms']:9.3f} ms {row['bwd_tflops']:6.0f} TF/s | "
            f"bits {'same' if row['bits_equal'] else 'DIFFER'} | x{row['repeats']}")
    except Exception as e:  # noqa: BLE001 - a failing implementation is a row, not a crash
        row["status"] = _status(e)
        log(f"{shape.name:14s} {name:34s} {row['status']}")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def run_mok(mok, shape, ins, dy, args, precision="bf16"):
    """mok on the inputs' device; on MOK_ERR_UNSUPPORTED from the CUDA backend, the CPU backend
    at a token count that keeps it to about --cpu-flops per forward. Rows of precision fp8 are
    called "fp8 mok"."""
    name = "mok" if precision == "bf16" else f"{precision} mok"
    if mok is None:
        return dict(shape=shape.name, impl=name, tokens=shape.T, status=f"error: {MOK_ERR}")
    moe = functools.partial(mok.moe, precision=precision)
    note = "no GPU"
    if ins["x"].is_cuda:
        try:
            with torch.no_grad():  # the CUDA backend may not do this shape (or anything) yet
                moe(**ins)
        except mok.MokUnsupported as e:
            note = f"CUDA backend: {e.message}"
            log(f"{shape.name:14s} mok: {note}; CPU backend at reduced scale")
        except Exception as e:  # noqa: BLE001 - a row, not a crash
            log(f"{shape.name:14s} {name}: {_status(e)}")
            mok.clear_cache()
            return dict(shape=shape.name, impl=name, tokens=shape.T, device="cuda",
                        status=_status(e))
        else:
            row = run_impl(name, moe, shape, ins, dy, args)
            if row["status"] == "ok":  # the workspace is cudaMalloc'ed: not in torch's peak
                row["workspace_bytes"] = sum(w.bytes for w in mok.core.cached_workspaces("cuda"))
                row["peak_bytes_torch"] = row["peak_bytes"]
                row["peak_bytes"] += row["workspace_bytes"]
            mok.clear_cache()
            return row
    t = max(1, min(shape.T, int(args.cpu_flops // fwd_flops(shape, 1))))
    cpu = {}
    for n, v in ins.items():
        if v is not None:
            v = v.detach()[:t] if n in ("x", "topk_ids", "topk_weights") else v.detach()
            v = v.cpu().requires_grad_(v.is_floating_point())
        cpu[n] = v
    cargs = argparse.Namespace(**{**vars(args), "min_reps": 2, "max_reps": 5, "warmup": 1,
                                  "budget": args.cpu_budget})
    row = run_impl(f"{name} (CPU backend, reduced T)", moe, shape, cpu, dy[:t].cpu(), cargs,
                   note=f"{note}; CPU backend with T={t} of {shape.T} tokens")
    mok.clear_cache()
    return row


MOK_ERR = None


def main():
    global MOK_ERR
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="results", help="folder for bench.json, bench.md, bench.png")
    p.add_argument("--shapes", default="", help="comma-separated names (default: all of §7)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: test the harness itself")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of repeats per measure")
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--max-reps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cpu-flops", type=float, default=2e10,
                   help="forward FLOPs per call for the CPU-backend fallback (sets its T)")
    p.add_argument("--cpu-budget", type=float, default=3.0)
    p.add_argument("--no-loop", action="store_true", help="skip the per-expert loop baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=420,
                   help="seconds after which the remaining shapes are skipped")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: also mok's FP8 layer, PyTorch's FP8 layer and the FP8 ceiling")
    args = p.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = SMOKE if args.smoke else SHAPES
    if args.shapes:
        want = args.shapes.split(",")
        shapes = [s for s in SHAPES + SMOKE if s.name in want]
    try:
        import mok
    except Exception as e:  # noqa: BLE001 - the baselines still run
        mok, MOK_ERR = None, f"{type(e).__name__}: {e}"
        log(f"mok unavailable: {MOK_ERR}")

    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                commit=os.environ.get("MOK_COMMIT") or _git("rev-parse", "--short", "HEAD") + (
                    "-dirty" if _git("status", "--porcelain", "--untracked-files=no") else ""),
                device_name=torch.cuda.get_device_name() if device == "cuda" else
                platform.processor() or "cpu",
                torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                mok=getattr(mok, "__version__", None), mok_lib=str(mok.library_path()) if mok else
                None, args=vars(args), notes=[
                    "deterministic mode: torch.use_deterministic_algorithms(True) with "
                    "fill_uninitialized_memory off; CUBLAS_WORKSPACE_CONFIG="
                    + os.environ["CUBLAS_WORKSPACE_CONFIG"]])
    if device != "cuda":
        meta["notes"].append("no GPU: everything ran on the CPU (harness test only)")
    log(f"{meta['device_name']}, torch {meta['torch']}, commit {meta['commit']}, "
        f"shapes {[s.name for s in shapes]}")

    n = 8192 if device == "cuda" else 512
    ceiling = dense_gemm_tflops(device, n=n)
    # The same product kept up for as long as an implementation's timed loop (--budget): how
    # far the rate falls when the GPU is loaded that long. Reported, not used for the ratios.
    ceiling["sustained"] = dense_gemm_tflops(
        device, n=n, reps=max(20, int(args.budget * 1e3 / ceiling["ms"])))
    log(f"ceiling: dense bf16 GEMM {n}^3 {ceiling['tflops']:.0f} TFLOP/s "
        f"({ceiling['reps']} in a row), {ceiling['sustained']['tflops']:.0f} TFLOP/s over "
        f"{ceiling['sustained']['reps']}")
    with_fp8 = args.precision == "fp8"
    fp8_fns = {}
    if with_fp8:
        ceiling["fp8"] = fp8.fp8_gemm_tflops(device, n=n if device == "cuda" else 128)
        log(f"ceiling: dense fp8 GEMM (torch._scaled_mm) {ceiling['fp8']['n']}^3 "
            f"{ceiling['fp8']['tflops']:.0f} TFLOP/s ({ceiling['fp8']['reps']} in a row)")
        meta["notes"].append(
            "fp8 torch: torch._scaled_grouped_mm (torch._scaled_mm for the shared expert) with "
            "row-wise scales for the forward products and the dgrads; the weight gradients are "
            "BF16 (torch._grouped_mm), torch having no FP8 form of them for this layer on sm_90")
        loop = fp8.use(device)
        if loop:
            meta["notes"].append(f"fp8 torch ran a loop of torch._scaled_mm per expert: {loop}")
            log(loop.splitlines()[0][:160])
        fp8_fns = {"fp8 torch": fp8.fp8_grouped_mm_moe,
                   "fp8 mok": functools.partial(mok.moe, precision="fp8") if mok else None}
    gmm_reason = layers.grouped_mm_available(device)
    if gmm_reason:
        meta["notes"].append(f"grouped_mm baselines ran the loop instead: {gmm_reason}")
        log(gmm_reason)
    grouped = layers.loop_moe if gmm_reason else layers.grouped_mm_moe
    check = check_baselines(device, mok.moe if mok else None, gmm_reason, fp8_fns)
    log(f"baseline check: {check['summary']}")

    results = []
    for s in shapes:
        if time.perf_counter() - T0 > args.deadline:
            log(f"--- {s.name}: skipped, past the --deadline of {args.deadline:.0f} s")
            results.append(dict(shape=s.name, impl="all", tokens=s.T, status="skipped: time"))
            continue
        log(f"--- {s.name}: T={s.T} H={s.H} I={s.I} E={s.E} k={s.k} I_s={s.I_s}, "
            f"fwd {fwd_flops(s) / 1e12:.2f} TFLOP")
        ins, dy = layers.make_inputs(s, device, seed=args.seed)
        results.append(run_mok(mok, s, ins, dy, args))
        results.append(run_impl("torch grouped_mm", grouped, s, ins, dy, args))
        results.append(run_impl("torch grouped_mm deterministic", grouped, s, ins, dy, args,
                                ctx=deterministic()))
        if not args.no_loop:
            results.append(run_impl("torch loop", layers.loop_moe, s, ins, dy, args))
        if with_fp8:
            results.append(run_mok(mok, s, ins, dy, args, precision="fp8"))
            results.append(run_impl("fp8 torch scaled_grouped_mm", fp8.fp8_grouped_mm_moe, s,
                                    ins, dy, args))
            fp8.forget()
        del ins, dy
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        report.add_ratios(results, ceiling if device == "cuda" else None)
        report.write(args.out, meta, ceiling, check, results, draw=False)  # if killed later

    report.add_ratios(results, ceiling if device == "cuda" else None)
    md, written = report.write(args.out, meta, ceiling, check, results)
    log("wrote " + ", ".join(str(p) for p in written))
    print()
    print(md, end="")


def _git(*cmd):
    try:
        return subprocess.run(["git", *cmd], cwd=HERE, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - no git: no commit id
        return ""


if __name__ == "__main__":
    main()
