/*
 * fp8.h: the scalar rules of mok's FP8 recipe (DESIGN.md §8), one definition for the CPU
 * reference, the CUDA kernels and the tests: e4m3 encoding and decoding, and the power-of-two
 * scale of a group of values.
 *
 * e4m3 is OCP E4M3FN: bias 7, largest finite 448 (0x7e), no infinity, NaN 0x7f (0xff also
 * reads as NaN), subnormals down to 2^-9. Encoding rounds to nearest, ties to even, and
 * saturates: a finite value or an infinity beyond 448 in magnitude becomes +-448, as PTX's
 * cvt.rn.satfinite does.
 *
 * A group's scale is 2^e with e the least integer such that amax <= 448 * 2^e, kept in
 * [-126, 126] so that 2^e and 2^-e are both normal fp32 numbers; a group of zeros gets e = 0.
 * Dividing by a power of two is exact (short of fp32 underflow, which e4m3 rounds to zero
 * anyway), so a value's e4m3 code depends only on the value and its group's amax.
 *
 * MXFP8 (OCP Microscaling v1.0 with e4m3 elements, DESIGN.md §8.5): a row in blocks of 32
 * consecutive values, each one E8M0 scale byte b, standing for 2^(b - 127) (0xff: NaN), and 32
 * e4m3 codes. Its rules: a block's values in fp32 and bf16, and the re-base of four blocks onto
 * one 1 x 128 group's power of two.
 */
#ifndef MOK_FP8_H
#define MOK_FP8_H

#include <stdint.h>
#include <string.h>

#include "bf16.h"

#ifdef __CUDACC__
#define MOK_FP8_FN __host__ __device__ static inline
#else
#define MOK_FP8_FN static inline
#endif

#define MOK_E4M3_MAX 448.0f
#define MOK_FP8_GROUP 128 /* values per scale along K; weight blocks are GROUP x GROUP */

MOK_FP8_FN uint32_t mok_f32_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return b;
}

MOK_FP8_FN float mok_bits_f32(uint32_t b) {
  float x;
  memcpy(&x, &b, sizeof x);
  return x;
}

/* 2^e for e in [-126, 127]. */
MOK_FP8_FN float mok_pow2f(int e) { return mok_bits_f32((uint32_t)(e + 127) << 23); }

/* The scale exponent of a group whose largest magnitude is amax (>= 0; +inf allowed). */
MOK_FP8_FN int mok_fp8_scale_exp(float amax) {
  const uint32_t b = mok_f32_bits(amax) & 0x7fffffffu;
  if (b == 0) return 0;
  const int biased = (int)(b >> 23);
  if (biased == 0) return -126;  /* subnormal amax: the smallest scale fits it */
  if (biased == 255) return 126; /* infinite: nothing fits; its values saturate */
  /* amax = m 2^E with m in [1, 2); 448 = 1.75 2^8: amax <= 448 2^e iff e >= E - 8 when
   * m <= 1.75, else e >= E - 7. */
  int e = biased - 127 - 8 + ((b & 0x7fffffu) > 0x600000u);
  if (e < -126) e = -126;
  if (e > 126) e = 126;
  return e;
}

/* e4m3 code of x: round to nearest even, saturating. */
MOK_FP8_FN uint8_t mok_e4m3_encode(float x) {
  const uint32_t b = mok_f32_bits(x);
  const uint8_t sign = (uint8_t)((b >> 24) & 0x80);
  const uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f; /* NaN, whatever its sign (as cvt gives it) */
  /* From 464 (448 + half an ulp) up, rounding would leave the finite range: saturate. Below
   * it, rounding gives at most 448. */
  if (a >= 0x43e80000u) return (uint8_t)(0x7e | sign);
  const int E = (int)(a >> 23) - 127; /* unbiased exponent of x (-127: zero or subnormal) */
  if (E >= -6) {                      /* normal e4m3: 3 mantissa bits kept of 23 */
    const uint32_t m = a & 0x7fffffu;
    uint32_t code = (uint32_t)(E + 7) << 3 | m >> 20;
    const uint32_t rest = m & 0xfffffu, half = 0x80000u;
    if (rest > half || (rest == half && (code & 1))) code++; /* may carry into the exponent */
    return (uint8_t)(code | sign);
  }
  /* Subnormal e4m3: value = c 2^-9, c in 0..7 (c = 8 is the smallest normal, 0x08). x's
   * significand with its leading one, shifted right by -6 - E + 20 bits, gives c. */
  if (E < -11) return sign; /* below 2^-11, a quarter of the smallest step: rounds to zero */
  const uint32_t sig = (a & 0x7fffffu) | 0x800000u;
  const int shift = 20 + (-6 - E); /* 21..25 */
  uint32_t c = sig >> shift;
  const uint32_t rest = sig & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (c & 1))) c++;
  return (uint8_t)(c | sign);
}

/* The value of an e4m3 code (exact in fp32). */
MOK_FP8_FN float mok_e4m3_decode(uint8_t q) {
  const uint32_t sign = (uint32_t)(q & 0x80) << 24;
  const uint32_t e = (q >> 3) & 0xf, m = q & 7;
  if (e == 0xf && m == 7) return mok_bits_f32(sign | 0x7fc00000u); /* NaN */
  if (e == 0) return mok_bits_f32(sign | mok_f32_bits((float)m * (1.0f / 512.0f)));
  return mok_bits_f32(sign | (e - 7 + 127) << 23 | m << 20);
}

/* ---- MXFP8 ----------------------------------------------------------------------------------- */
#define MOK_MX_BLOCK 32    /* values per E8M0 scale, along a row */
#define MOK_E8M0_NAN 0xff
/* Up to this scale byte no code's value reaches 2^128 (448 * 2^119 < 2^128 <= 448 * 2^120), so
 * the block fits fp32 and bf16 whatever its codes. */
#define MOK_E8M0_FITS 246

/* decode(q) * 2^(b - 127) in fp32, for b != 0xff: exact below 2^128 in magnitude (its step,
 * 2^-136 at the least, is above fp32's 2^-149), +-inf from 2^128 on. Two multiplications by
 * powers of two in [2^-64, 2^64], the first exact, since 2^(b - 127) is no normal fp32 for b = 0.
 * A NaN code gives the NaN of its sign without arithmetic, which need not keep the sign (the
 * GPU's multiply gives one canonical NaN), so that both backends write the same bytes. */
MOK_FP8_FN float mok_mx_decode(uint8_t q, uint8_t b) {
  if ((q & 0x7f) == 0x7f) return mok_e4m3_decode(q);
  const int e = (int)b - 127, e1 = e / 2;
  return mok_e4m3_decode(q) * mok_pow2f(e1) * mok_pow2f(e - e1);
}

/* The bf16 bits of that value: exact unless it is not a multiple of 2^-133, bf16's least step
 * (only for b <= 2), where it rounds to nearest even. */
MOK_FP8_FN uint16_t mok_mx_to_bf16(uint8_t q, uint8_t b) {
  return f32_to_bf16(mok_mx_decode(q, b));
}

/* Whether a block (32 codes q, scale byte b) can be decoded: b is not NaN and no value reaches
 * 2^128 (no bf16 or fp32 holds it). Reads the codes only for bytes above MOK_E8M0_FITS. */
MOK_FP8_FN int mok_mx_block_ok(const uint8_t *q, uint8_t b) {
  if (b == MOK_E8M0_NAN) return 0;
  if (b <= MOK_E8M0_FITS) return 1;
  for (int i = 0; i < MOK_MX_BLOCK; i++)
    if ((mok_f32_bits(mok_mx_decode(q[i], b)) & 0x7fffffffu) == 0x7f800000u) return 0;
  return 1;
}

/* e4m3(decode(q) * 2^-d), d >= 0, rounded as mok_e4m3_encode: a code of a block whose scale is
 * 2^d times below the one it is re-based onto. Zero codes stay as they are (a block of zeros may
 * have any scale, d < 0 included), NaN becomes 0x7f, and from d = 25 on every other code
 * rounds to zero (448 * 2^-25 < 2^-10). */
MOK_FP8_FN uint8_t mok_mx_shift(uint8_t q, int d) {
  if ((q & 0x7f) == 0) return q;
  if ((q & 0x7f) == 0x7f) return 0x7f;
  if (d > 24) return (uint8_t)(q & 0x80);
  return mok_e4m3_encode(mok_e4m3_decode(q) * mok_pow2f(-d));
}

/* Re-bases one 1 x 128 group of MXFP8 onto one power of two 2^E: nb = 1..4 blocks of codes
 * q[32 nb] and scale bytes b[nb] (none 0xff). E is the largest b_j - 127 of a block whose codes
 * are not all zeros (0 when all are, mok's scale of zeros), and code i of block j becomes
 * mok_mx_shift(q[i], E - (b_j - 127)) in out[i]. Returns E, in [-127, 127]. DESIGN §8.5 says
 * when this is lossless and how it compares with Q_row of the same values. */
MOK_FP8_FN int mok_mx_rebase(const uint8_t *q, const uint8_t *b, int nb, uint8_t *out) {
  int E = -128;
  for (int j = 0; j < nb; j++) {
    int zeros = 1;
    for (int i = 0; i < MOK_MX_BLOCK; i++) zeros &= (q[j * MOK_MX_BLOCK + i] & 0x7f) == 0;
    if (!zeros && (int)b[j] - 127 > E) E = (int)b[j] - 127;
  }
  if (E == -128) E = 0;
  for (int j = 0; j < nb; j++)
    for (int i = 0; i < MOK_MX_BLOCK; i++)
      out[j * MOK_MX_BLOCK + i] = mok_mx_shift(q[j * MOK_MX_BLOCK + i], E - ((int)b[j] - 127));
  return E;
}

#endif /* MOK_FP8_H */
