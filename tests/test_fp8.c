/*
 * test_fp8.c: the scalar rules of the FP8 recipe (src/fp8.h, DESIGN.md §8.1) against oracles
 * written another way (fp8_oracle.h): the nearest e4m3 value found by search over all 126 finite
 * positive codes (ties to the even code), and the least power-of-two scale found by doubling.
 */
#include <math.h>
#include <stdint.h>

#include "check.h"
#include "fp8.h"
#include "fp8_oracle.h"

static void test_decode(void) {
  CHECK(mok_e4m3_decode(0x7e) == 448.0f, "0x7e is %g", mok_e4m3_decode(0x7e));
  CHECK(mok_e4m3_decode(0x01) == 0x1p-9f, "0x01 is %a", mok_e4m3_decode(0x01));
  CHECK(mok_e4m3_decode(0x08) == 0x1p-6f, "0x08 is %a", mok_e4m3_decode(0x08));
  CHECK(mok_e4m3_decode(0x38) == 1.0f, "0x38 is %g", mok_e4m3_decode(0x38));
  CHECK(mok_e4m3_decode(0xb8) == -1.0f, "0xb8 is %g", mok_e4m3_decode(0xb8));
  CHECK(isnan(mok_e4m3_decode(0x7f)) && isnan(mok_e4m3_decode(0xff)), "NaN codes");
  for (int c = 0; c < 256; c++) { /* every finite code encodes back to itself (-0 to 0x80) */
    if ((c & 0x7f) == 0x7f) continue;
    CHECK(mok_e4m3_encode(mok_e4m3_decode((uint8_t)c)) == c, "code 0x%02x round trip", c);
  }
}

/* Every code's neighbourhood: the code, the midpoints to its neighbours and a step either side
 * of them, in fp32, and a pseudo-random sweep over every fp32 exponent that can matter. */
static void test_encode(void) {
  int bad = 0;
  for (int c = 0; c < 0x7e; c++) {
    const float lo = mok_e4m3_decode((uint8_t)c), hi = mok_e4m3_decode((uint8_t)(c + 1));
    const float mid = 0.5f * (lo + hi);
    const float probe[] = {lo, mid, nextafterf(mid, 0.0f), nextafterf(mid, 1e9f), hi};
    for (int i = 0; i < 5; i++)
      for (int s = 0; s < 2; s++) {
        const float x = s ? -probe[i] : probe[i];
        if (mok_e4m3_encode(x) != oracle_e4m3(x) && bad++ < 10)
          CHECK(0, "encode(%a) = 0x%02x, nearest 0x%02x", x, mok_e4m3_encode(x),
                oracle_e4m3(x));
      }
  }
  uint64_t r = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < 200000; i++) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    /* exponents 2^-20 .. 2^12 and the specials */
    uint32_t bits = (uint32_t)(r >> 32);
    bits = (bits & 0x807fffffu) | (uint32_t)(107 + (r >> 20) % 33) << 23;
    const float x = mok_bits_f32(bits);
    if (mok_e4m3_encode(x) != oracle_e4m3(x) && bad++ < 10)
      CHECK(0, "encode(%a) = 0x%02x, nearest 0x%02x", x, mok_e4m3_encode(x), oracle_e4m3(x));
  }
  CHECK(mok_e4m3_encode(INFINITY) == 0x7e && mok_e4m3_encode(-INFINITY) == 0xfe, "infinities");
  CHECK(mok_e4m3_encode(NAN) == 0x7f && mok_e4m3_encode(-NAN) == 0x7f, "NaN");
  CHECK(mok_e4m3_encode(1e30f) == 0x7e && mok_e4m3_encode(464.0f) == 0x7e, "saturation");
  CHECK(mok_e4m3_encode(-0.0f) == 0x80 && mok_e4m3_encode(0x1p-10f) == 0, "zeros");
  CHECK(mok_e4m3_encode(nextafterf(0x1p-10f, 1.0f)) == 1, "above half the smallest step");
}

static void test_scale(void) {
  const float probe[] = {448.0f,     nextafterf(448.0f, 1e9f), 1.0f,     0.75f,    1.75f,
                         nextafterf(1.75f, 9.0f), 0x1p-130f, 0x1p-126f, 3.0e38f, INFINITY,
                         7.0f,       0.0f,       1e-30f,    123.456f};
  for (unsigned i = 0; i < sizeof probe / sizeof probe[0]; i++)
    CHECK(mok_fp8_scale_exp(probe[i]) == oracle_scale_exp(probe[i]), "scale of %a: %d, want %d",
          probe[i], mok_fp8_scale_exp(probe[i]), oracle_scale_exp(probe[i]));
  uint64_t r = 12345;
  for (int i = 0; i < 20000; i++) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    const float a = mok_bits_f32((uint32_t)(r >> 33)); /* positive, every exponent */
    if (isnan(a)) continue;
    CHECK(mok_fp8_scale_exp(a) == oracle_scale_exp(a), "scale of %a: %d, want %d", a,
          mok_fp8_scale_exp(a), oracle_scale_exp(a));
  }
  CHECK(mok_pow2f(-126) == 0x1p-126f && mok_pow2f(126) == 0x1p126f && mok_pow2f(0) == 1.0f,
        "pow2f");
}

const test_case tests_fp8[] = {
    {"fp8/e4m3_decode", test_decode},
    {"fp8/e4m3_encode_is_nearest_even_saturating", test_encode},
    {"fp8/scale_is_least_power_of_two", test_scale},
    {NULL, NULL},
};
