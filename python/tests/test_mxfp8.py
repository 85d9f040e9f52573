"""test_mxfp8.py: mok.mxfp8_to_bf16 (DESIGN.md §8.5) on the CPU backend: every e4m3 code under
every scale byte whose values fit, against float64 rounded to bf16 by bf16.py; a NaN scale byte
and a value of 2^128 refused with MokInvalidArgument; shapes and dtypes checked before the call."""
import numpy as np
import pytest

import mok


def e4m3_values():
    """The 256 codes' values in float64 (OCP E4M3FN), written from the format: NaN at 0x7f/0xff."""
    c = np.arange(256)
    sign = np.where(c & 0x80, -1.0, 1.0)
    x, m = (c >> 3) & 15, c & 7
    v = np.where(x == 0, m * 2.0 ** -9, (8 + m) * 2.0 ** (x - 10.0))
    return np.where((c & 0x7F) == 0x7F, np.nan, sign * v)


def test_every_code_and_scale_byte():
    q = np.tile(np.arange(256, dtype=np.uint8), (247, 1))            # row b: every code
    s = np.repeat(np.arange(247, dtype=np.uint8)[:, None], 8, axis=1)  # under scale byte b
    got = mok.mxfp8_to_bf16(q, s)
    assert got.shape == q.shape and got.dtype == np.uint16
    exact = e4m3_values()[None, :] * 2.0 ** (np.arange(247)[:, None] - 127.0)
    want = mok.f32_to_bf16(exact.astype(np.float32))  # fp32 holds every value: one rounding
    num = ~np.isnan(exact)
    assert np.array_equal(got[num], want[num])
    # exact (no rounding) from scale byte 3 on
    back = mok.bf16_to_f32(got).astype(np.float64)
    assert np.array_equal(back[3:][num[3:]], exact[3:][num[3:]])
    assert not np.array_equal(back[:3][num[:3]], exact[:3][num[:3]])  # bytes 0..2 round some
    # NaN codes: the bf16 NaN of their sign
    assert (got[:, 0x7F] == 0x7FC0).all() and (got[:, 0xFF] == 0xFFC0).all()


def test_leading_axes_and_refusals():
    rng = np.random.default_rng(1)
    q = rng.integers(0, 0x7F, (2, 3, 64), dtype=np.uint8)
    s = np.full((2, 3, 2), 127, dtype=np.uint8)
    got = mok.mxfp8_to_bf16(q, s)
    assert np.array_equal(mok.bf16_to_f32(got), e4m3_values()[q].astype(np.float32))
    bad = s.copy()
    bad[1, 2, 1] = 0xFF
    with pytest.raises(mok.MokInvalidArgument, match="row 5, block 1"):
        mok.mxfp8_to_bf16(q, bad)
    big = s.copy()
    big[0, 0, 0] = 250  # 2^123: codes of 32 or more reach 2^128
    q2 = q.copy()
    q2[0, 0, 0] = 0x60  # 32
    with pytest.raises(mok.MokInvalidArgument, match="2\\^128"):
        mok.mxfp8_to_bf16(q2, big)
    with pytest.raises(ValueError, match="multiple of 32"):
        mok.mxfp8_to_bf16(q[..., :48], s)
    with pytest.raises(ValueError, match="scales has shape"):
        mok.mxfp8_to_bf16(q, s[..., :1])
    with pytest.raises(TypeError, match="uint8"):
        mok.mxfp8_to_bf16(q.astype(np.int16), s)
