/*
 * fp8_oracle.h: the FP8 recipe's scalar rules (DESIGN.md §8.1) written the slow, obvious way, as
 * oracles for src/fp8.h and for the backends' quantizers: the nearest e4m3 value by search over
 * every finite positive code (ties to the even code), and the least power-of-two scale by
 * doubling. Only the decoding of a code is taken from fp8.h (itself checked against constants).
 */
#ifndef MOK_TESTS_FP8_ORACLE_H
#define MOK_TESTS_FP8_ORACLE_H

#include <math.h>
#include <stdint.h>

#include "fp8.h"

/* The e4m3 code nearest to x, by search; saturating, ties to the even code. */
static inline uint8_t oracle_e4m3(float x) {
  if (isnan(x)) return 0x7f;
  const uint8_t sign = signbit(x) ? 0x80 : 0;
  const double a = fabs((double)x);
  if (a >= 448.0) return (uint8_t)(0x7e | sign);
  int best = 0;
  double best_d = a;
  for (int c = 1; c <= 0x7e; c++) {
    const double d = fabs((double)mok_e4m3_decode((uint8_t)c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) best = c, best_d = d;
  }
  return (uint8_t)(best | sign);
}

/* The least e with amax <= 448 2^e, clamped to [-126, 126], by doubling; 0 for amax = 0. */
static inline int oracle_scale_exp(float amax) {
  if (amax == 0.0f) return 0;
  int e = -126;
  while (e < 126 && (double)amax > 448.0 * ldexp(1.0, e)) e++;
  return e;
}

#endif
