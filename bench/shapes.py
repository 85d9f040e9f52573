"""shapes.py: the benchmark shapes of DESIGN.md §7 (python/tests/test_bench.py checks that this
table and DESIGN.md's agree) and their FLOP counts."""
from collections import namedtuple

Shape = namedtuple("Shape", "name T H I E k I_s")

SHAPES = [
    Shape("dsv3", 4096, 7168, 2048, 32, 8, 2048),
    Shape("qwen3-30b-a3b", 16384, 2048, 768, 128, 8, 0),
    Shape("qwen3-235b", 32768, 4096, 1536, 128, 8, 0),
    Shape("mixtral-8x7b", 8192, 4096, 14336, 8, 2, 0),
    Shape("gpt-oss-120b", 16384, 2880, 2880, 128, 4, 0),
    Shape("fine-7b", 24576, 1536, 256, 128, 8, 0),
]

# Tiny shapes for `run.py --smoke`: the whole harness in seconds, on a GPU or on the CPU.
SMOKE = [
    Shape("smoke-shared", 256, 128, 128, 8, 2, 128),
    Shape("smoke-routed", 192, 64, 192, 16, 4, 0),
]


def fwd_flops(s, tokens=None):
    """DESIGN.md §7: 6*T*k*H*I + 6*T*H*I_s (backward is twice that)."""
    t = s.T if tokens is None else tokens
    return 6 * t * s.k * s.H * s.I + 6 * t * s.H * s.I_s


def gemm_products(s):
    """(label, FLOPs) of the GEMM launches of one forward and one backward, in the order
    src/cuda/layer.cu queues them (ep = 1); the shared expert's only when I_s > 0."""
    r = 2 * s.T * s.k * s.H * s.I     # one routed product I wide
    sh = 2 * s.T * s.H * s.I_s
    fwd = [("gate/up", 2 * r)] + ([("shared gate/up", 2 * sh)] if s.I_s else []) + \
        [("down", r)] + ([("shared down", sh)] if s.I_s else [])
    bwd = [("down dgrad", r), ("down wgrad", r), ("gate/up dgrad", 2 * r),
           ("gate/up wgrad", 2 * r)]
    if s.I_s:
        bwd += [("shared down dgrad", sh), ("shared gate/up dgrad", 2 * sh),
                ("shared down wgrad", sh), ("shared gate/up wgrad", 2 * sh)]
    return fwd, bwd
