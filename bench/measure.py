"""measure.py: how one implementation of the layer is measured (DESIGN.md §7): forward and
backward times (CUDA events after warm-up, median of many repeats; perf_counter on the CPU),
the GPU's mean SM clock and power meanwhile, peak memory, and whether two runs give the same bits
(a fingerprint of y and every gradient).
"""
import shutil
import statistics
import subprocess
import time

import torch

DIFF = ("x", "topk_weights", "w_router", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")


class Clock:
    """Start/stop marks on a device: CUDA events on a GPU, perf_counter (synchronous) on the CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, pairs):
        """Milliseconds of each (start, stop) pair, after waiting for the device."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1e3 for a, b in pairs]

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def mean_samples(text):
    """Means of nvidia-smi's "MHz, W" sample lines: (MHz, W), or (None, None) if none parse."""
    rows = []
    for line in text.splitlines():
        try:
            rows.append([float(v) for v in line.split(",")][:2])
        except ValueError:
            continue
    rows = [r for r in rows if len(r) == 2]
    if not rows:
        return None, None
    return sum(r[0] for r in rows) / len(rows), sum(r[1] for r in rows) / len(rows)


class GpuSamples:
    """The GPU's mean SM clock (MHz) and board power (W) while a block runs, from nvidia-smi
    samples every 20 ms: the H200 behaves as power-bound (DESIGN.md §7), so a time says more
    with its clock. nvidia-smi needs a few tenths of a second to start, so short blocks get few
    or no samples; the block should end with the device's work done (a synchronize). On the CPU,
    or without nvidia-smi, mhz and watts stay None."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.proc = self.mhz = self.watts = None

    def __enter__(self):
        if self.device.type == "cuda" and shutil.which("nvidia-smi"):
            props = torch.cuda.get_device_properties(self.device)
            pci = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
            # nvidia-smi numbers GPUs without CUDA_VISIBLE_DEVICES; a PCI address is the same
            # GPU for both.
            gpu = (f"{pci[0]:08X}:{pci[1]:02X}:{pci[2]:02X}.0" if None not in pci
                   else str(self.device.index or 0))
            self.proc = subprocess.Popen(
                ["nvidia-smi", "-i", str(gpu), "--query-gpu=clocks.sm,power.draw",
                 "--format=csv,noheader,nounits", "-lms", "20"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate()
            self.mhz, self.watts = mean_samples(out)
        return False


def _leaves(ins):
    return [ins[n] for n in DIFF if ins.get(n) is not None]


def _call(fn, ins):
    return fn(**ins)


def fwd_bwd(fn, ins, dy):
    """y and the gradients of every differentiable input (autograd.grad: nothing accumulates)."""
    y = _call(fn, ins)
    return y, torch.autograd.grad(y, _leaves(ins), dy)


_MULT = {}


def fingerprint(tensors):
    """A 64-bit hash of the bits of `tensors`, computed on their device: sum over 32-bit words of
    word * pseudo-random multiplier, mod 2^64. Integer sums are exact in any order, so the hash is
    itself deterministic; any changed bit changes it (but for a 2^-64 chance)."""
    total = 0
    for t in tensors:
        b = t.detach().contiguous().view(-1).view(torch.uint8)
        if b.numel() % 4 or b.storage_offset() % 4:
            b = torch.cat([b, b.new_zeros(-b.numel() % 4)])  # a fresh, padded copy
        words = b.view(torch.int32)
        chunk = 1 << 24
        key = (words.device, chunk)
        if key not in _MULT:
            g = torch.Generator(device=words.device).manual_seed(12345)
            _MULT[key] = torch.randint(1, 2 ** 31 - 1, (chunk,), generator=g, device=words.device,
                                       dtype=torch.int64) | 1  # odd: no change vanishes mod 2^64
        acc = torch.zeros((), dtype=torch.int64, device=words.device)
        for i in range(0, words.numel(), chunk):
            w = words[i:i + chunk].to(torch.int64)
            acc += (w * _MULT[key][: w.numel()]).sum()
        total = (total * 1000003 + int(acc.item())) % (1 << 64)
    return f"{total:016x}"


def measure(fn, ins, dy, budget_s=1.0, min_reps=5, max_reps=50, warmup=2, agree=None):
    """Times fn's forward and backward; returns a dict (times in ms, bytes, bits). agree: maps
    this process's number of repeats to the one every process of a group uses (bench/ep.py)."""
    clock = Clock(dy.device)
    cuda = clock.cuda
    t0 = time.perf_counter()
    for _ in range(warmup):
        y, g = fwd_bwd(fn, ins, dy)
        del y, g
    clock.sync()
    per_iter = max((time.perf_counter() - t0) / max(warmup, 1), 1e-4)
    if per_iter * min_reps > 4 * budget_s:  # very slow: fewer repeats rather than minutes
        min_reps = 2
    reps = int(min(max_reps, max(min_reps, budget_s / per_iter)))
    if agree is not None:
        reps = agree(reps)

    pairs = []
    with GpuSamples(dy.device) as fwd_gpu:
        for _ in range(reps):
            a = clock.mark()
            y = _call(fn, ins)
            pairs.append((a, clock.mark()))
            del y
        fwd = clock.ms(pairs)

    pairs = []
    with GpuSamples(dy.device) as bwd_gpu:
        for _ in range(reps):
            y = _call(fn, ins)
            a = clock.mark()
            g = torch.autograd.grad(y, _leaves(ins), dy)
            pairs.append((a, clock.mark()))
            del y, g
        bwd = clock.ms(pairs)

    peak = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    y, g = fwd_bwd(fn, ins, dy)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    first = fingerprint([y, *g])
    del y, g
    y, g = fwd_bwd(fn, ins, dy)
    second = fingerprint([y, *g])
    del y, g
    return dict(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd),
                fwd_ms_min=min(fwd), bwd_ms_min=min(bwd), repeats=reps, peak_bytes=peak,
                fwd_mhz=fwd_gpu.mhz, fwd_watts=fwd_gpu.watts, bwd_mhz=bwd_gpu.mhz,
                bwd_watts=bwd_gpu.watts,
                fingerprint=first, bits_equal=first == second)


def dense_gemm_tflops(device, n=8192, reps=20):
    """The ceiling: torch.matmul of two random n x n bf16 matrices (cuBLAS on a GPU), `reps` in
    a row, with the GPU's mean clock and power meanwhile."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    clock = Clock(device)
    for _ in range(3):
        a @ b
    clock.sync()
    pairs = []
    with GpuSamples(device) as gpu:
        for _ in range(reps):
            s = clock.mark()
            a @ b
            pairs.append((s, clock.mark()))
        ms = statistics.median(clock.ms(pairs))
    return dict(n=n, ms=ms, tflops=2 * n ** 3 / ms / 1e9, reps=reps, mhz=gpu.mhz,
                watts=gpu.watts)
