"""bf16.py: bfloat16 on numpy, carried as uint16 arrays (numpy has no bf16 dtype).

f32_to_bf16 rounds to nearest even like mok_f32_to_bf16 (src/bf16.h): NaN stays a quiet NaN of
the same sign, infinities stay, overflow rounds to infinity. bf16_to_f32 is exact.
"""
import numpy as np


def f32_to_bf16(a):
    """float32 (or anything castable to it) -> uint16 bf16 bits, round-to-nearest-even."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (bits >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def bf16_to_f32(b):
    """uint16 bf16 bits -> float32 (exact)."""
    b = np.asarray(b)
    if b.dtype != np.uint16:
        raise TypeError(f"bf16_to_f32: expected a uint16 array of bf16 bits, got {b.dtype}")
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bf16(a):
    """float values rounded to the nearest bf16, returned as float32 (for reference math)."""
    return bf16_to_f32(f32_to_bf16(a))
