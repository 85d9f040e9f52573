/*
 * test_mxfp8.c: MXFP8 inputs (DESIGN.md §8.5).
 *   The re-base of src/fp8.h: for every code and every shift d = 0..20, re-base then decode gives
 *   the exact value iff DESIGN's condition says lossless (written here from its two statements:
 *   decode(q) a multiple of 2^(d - 9), and the table of trailing zeros); whole groups against a
 *   float64 oracle written here (E by a scan of the blocks' values, each code the nearest e4m3
 *   of its exact value by search).
 *   Q_row of the same values (the layer's own quantization of mok_mxfp8_to_bf16's output)
 *   against the re-base: its scale never above, equal exactly when a block of the largest scale
 *   holds a code of magnitude 240 or more, and then the same codes; else every value at least as
 *   close, and exact wherever the re-base is.
 *   mok_mxfp8_to_bf16 on the CPU backend: every code under every scale byte against float64
 *   (exact iff the value is a multiple of 2^-133, else rounded to nearest even), NaN codes, the
 *   same bytes on a MOK_FP8 workspace and one thread, scales at any byte, and the refusals (a
 *   NaN scale byte, a value of 2^128 or more, k not a multiple of 32, NULL, misaligned codes or
 *   out, overlapping) with out untouched.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "check.h"
#include "fp8_oracle.h"
#include "harness.h"

#define B MOK_MX_BLOCK

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint32_t rnd(void) {
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(rng >> 33);
}

/* A CPU context of `threads` threads and a small workspace of `precision`. */
static mok_workspace *workspace(int threads, mok_precision precision, mok_context **ctx) {
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  cfg.threads = threads;
  mok_shape shape = {1, 128, 128, 0, 1, 1, precision, 0};
  mok_workspace *ws = NULL;
  *ctx = NULL;
  CHECK_OK(mok_context_create(&cfg, ctx));
  if (*ctx) CHECK_OK(mok_workspace_create(*ctx, &shape, &ws));
  return ws;
}

static void release(mok_workspace *ws, mok_context *ctx) {
  mok_workspace_destroy(ws);
  mok_context_destroy(ctx);
}

/* ---- the re-base ---------------------------------------------------------------------------- */

/* DESIGN §8.5, first statement: shifting code q down by d binades is lossless iff decode(q) is a
 * multiple of 2^(d - 9). */
static int lossless_by_value(uint8_t q, int d) {
  return fmod(fabs((double)mok_e4m3_decode(q)), ldexp(1.0, d - 9)) == 0.0;
}

/* Its table: d <= x - 1 + tz(8 + m) for exponent field x >= 1 and mantissa m, d <= tz(m) for a
 * subnormal code, any d for zero. */
static int lossless_by_bits(uint8_t q, int d) {
  static const int tz8[8] = {3, 0, 1, 0, 2, 0, 1, 0}; /* trailing zeros of 8 + m */
  static const int tzm[8] = {0, 0, 1, 0, 2, 0, 1, 0}; /* of m, m > 0 */
  const int x = (q >> 3) & 15, m = q & 7;
  if (x == 0 && m == 0) return 1;
  return d <= (x ? x - 1 + tz8[m] : tzm[m]);
}

/* Every code in a block d binades below the group's scale (another block holds 448 at E = 5). */
static void test_lossless_condition(void) {
  int bad = 0, most = -1;
  for (int c = 0; c < 256; c++)
    for (int d = 0; d <= 20; d++) {
      uint8_t q[2 * B] = {0}, out[2 * B];
      const uint8_t b[2] = {127 + 5, (uint8_t)(127 + 5 - d)};
      q[0] = 0x7e;
      q[B + 7] = (uint8_t)c;
      const int E = mok_mx_rebase(q, b, 2, out);
      CHECK(E == 5, "E is %d; want 5", E);
      if ((c & 0x7f) == 0x7f) {
        CHECK(out[B + 7] == 0x7f, "NaN code 0x%02x became 0x%02x", c, out[B + 7]);
        continue;
      }
      const double exact = ldexp((double)mok_e4m3_decode((uint8_t)c), -d);
      const int got = (double)mok_e4m3_decode(out[B + 7]) == exact;
      if ((out[B + 7] & 0x80) != (c & 0x80) && bad++ < 10)
        CHECK(0, "code 0x%02x shifted %d: 0x%02x lost its sign", c, d, out[B + 7]);
      if ((got != lossless_by_value((uint8_t)c, d) || got != lossless_by_bits((uint8_t)c, d)) &&
          bad++ < 10)
        CHECK(0, "code 0x%02x shifted %d: re-base %s, the rule says %d / %d", c, d,
              got ? "exact" : "inexact", lossless_by_value((uint8_t)c, d),
              lossless_by_bits((uint8_t)c, d));
      if (got && (c & 0x7f) && d > most) most = d;
    }
  CHECK(most == 17, "the largest lossless shift of a nonzero code is %d; DESIGN says 17", most);
}

/* Blocks of zeros do not count; a group of zeros keeps its codes (-0 too) and gets E = 0. */
static void test_zero_blocks(void) {
  uint8_t q[4 * B], out[4 * B];
  memset(q, 0, sizeof q);
  q[3] = 0x80;
  q[B + 9] = 0x80;
  const uint8_t b[4] = {254, 3, 200, 127};
  CHECK(mok_mx_rebase(q, b, 4, out) == 0, "a group of zeros: E is not 0");
  CHECK(memcmp(q, out, sizeof q) == 0, "a group of zeros changed");
  q[2 * B + 1] = 0x39; /* block 2 (byte 200) holds the only value: E = 73, d = 0 */
  CHECK(mok_mx_rebase(q, b, 4, out) == 73, "E is not block 2's");
  CHECK(memcmp(q, out, sizeof q) == 0, "blocks of zeros (one of scale 2^127) changed codes");
}

/* The oracle: E by a scan of the blocks' values, codes by nearest search of the exact value. */
static int oracle_rebase(const uint8_t *q, const uint8_t *b, int nb, uint8_t *out) {
  int E = 0, any = 0;
  for (int j = 0; j < nb; j++) {
    int nonzero = 0;
    for (int i = 0; i < B; i++) nonzero |= mok_e4m3_decode(q[j * B + i]) != 0.0f; /* NaN too */
    if (nonzero && (!any || b[j] - 127 > E)) E = b[j] - 127, any = 1;
  }
  for (int j = 0; j < nb; j++)
    for (int i = 0; i < B; i++)
      out[j * B + i] =
          oracle_e4m3((float)ldexp((double)mok_e4m3_decode(q[j * B + i]), b[j] - 127 - E));
  return E;
}

static void test_rebase_vs_oracle(void) {
  int bad = 0;
  for (int t = 0; t < 3000; t++) {
    const int nb = 1 + (int)(rnd() % 4), top = (int)(rnd() % 255);
    uint8_t q[4 * B], b[4], got[4 * B], want[4 * B];
    for (int j = 0; j < nb; j++) {
      const int spread = rnd() % 4 == 0 ? (int)(rnd() % 255) : (int)(rnd() % 12);
      const int near = top - spread < 0 ? 0 : top - spread;
      b[j] = (uint8_t)(rnd() % 8 == 0 ? (int)(rnd() % 255) : near);
      const int zeros = rnd() % 8 == 0;
      for (int i = 0; i < B; i++) q[j * B + i] = (uint8_t)(zeros ? rnd() % 2 * 0x80 : rnd() % 256);
    }
    const int E = mok_mx_rebase(q, b, nb, got), Ew = oracle_rebase(q, b, nb, want);
    if ((E != Ew || memcmp(got, want, (size_t)nb * B)) && bad++ < 10) {
      int i = 0;
      while (i < nb * B - 1 && got[i] == want[i]) i++;
      CHECK(0, "group %d: E %d (oracle %d); code %d: 0x%02x became 0x%02x, oracle 0x%02x", t, E,
            Ew, i, q[i], got[i], want[i]);
    }
  }
}

/* ---- Q_row of mok_mxfp8_to_bf16's values against the re-base -------------------------------- */

static void test_q_row_vs_rebase(void) {
  enum { R = 2000, K = 480 }; /* groups of 4, 4, 4 and 3 blocks */
  mok_context *ctx;
  mok_workspace *ws = workspace(0, MOK_BF16, &ctx);
  uint8_t *q = test_alloc(R * K), *s = test_alloc(R * K / B);
  uint16_t *v = test_alloc(R * K * 2);
  for (int r = 0; r < R; r++) {
    const int top = 3 + 20 + (int)(rnd() % (246 - 3 - 20 + 1)); /* bytes stay in 3..246 */
    for (int j = 0; j < K / B; j++) {
      s[r * K / B + j] = (uint8_t)(top - (int)(rnd() % 8 == 0 ? rnd() % 21 : rnd() % 6));
      const int lim = rnd() % 2 ? 0x7e : 1 + (int)(rnd() % 0x7e), zeros = rnd() % 10 == 0;
      for (int i = 0; i < B; i++) {
        uint8_t c = (uint8_t)(rnd() % (lim + 1) | (rnd() % 2) << 7);
        if (rnd() % 512 == 0) c = 0x7f;
        q[(int64_t)r * K + j * B + i] = zeros ? 0 : c;
      }
    }
  }
  CHECK_OK(mok_mxfp8_to_bf16(ws, R, K, q, s, v, NULL));
  int64_t same = 0, below = 0, lossy = 0, bad = 0;
  for (int r = 0; r < R; r++)
    for (int g0 = 0; g0 < K; g0 += MOK_FP8_GROUP) {
      const int n = K - g0 < MOK_FP8_GROUP ? K - g0 : MOK_FP8_GROUP, nb = n / B;
      const uint8_t *gq = q + (int64_t)r * K + g0, *gb = s + r * K / B + g0 / B;
      const uint16_t *gv = v + (int64_t)r * K + g0;
      uint8_t rq[MOK_FP8_GROUP];
      const int E = mok_mx_rebase(gq, gb, nb, rq);
      float amax = 0.0f;
      int top = 0;   /* a block of scale 2^E holds a code of magnitude >= 240 (0x77) */
      int zeros = 1; /* a group of zeros: both scales are 1 */
      for (int i = 0; i < n; i++) {
        const float a = fabsf(bf16_to_f32(gv[i]));
        if (a > amax) amax = a;
        const int m = gq[i] & 0x7f;
        top |= gb[i / B] - 127 == E && m >= 0x77 && m <= 0x7e;
        zeros &= m == 0;
      }
      const int e = mok_fp8_scale_exp(amax); /* Q_row's scale (DESIGN §8.1) */
      if (e > E || (e == E) != (top || zeros) || (zeros && E != 0)) {
        if (bad++ < 10)
          CHECK(0, "row %d group %d: Q_row's e %d, re-base's E %d, top %d", r, g0, e, E, top);
        continue;
      }
      if (e == E) same++;
      else below++;
      for (int i = 0; i < n; i++) {
        const float x = bf16_to_f32(gv[i]);
        const uint8_t qq = mok_e4m3_encode(x * mok_pow2f(-e));
        if (isnan(x)) {
          CHECK(qq == 0x7f && rq[i] == 0x7f, "NaN: Q_row 0x%02x, re-base 0x%02x", qq, rq[i]);
          continue;
        }
        const double dq = ldexp((double)mok_e4m3_decode(qq), e);
        const double dr = ldexp((double)mok_e4m3_decode(rq[i]), E);
        lossy += dr != x;
        if (e == E ? qq != rq[i] : (fabs(dq - x) > fabs(dr - x) || (dr == x && dq != x)))
          if (bad++ < 10)
            CHECK(0, "row %d value %d (%a): Q_row 0x%02x at e %d, re-base 0x%02x at E %d", r,
                  g0 + i, (double)x, qq, e, rq[i], E);
      }
    }
  /* both cases, and lossy re-bases, must have been met for the checks above to mean anything */
  CHECK(same > 1000 && below > 1000 && lossy > 1000, "groups: %lld same scale, %lld below; %lld "
        "lossy values", (long long)same, (long long)below, (long long)lossy);
  free(q), free(s), free(v);
  release(ws, ctx);
}

/* ---- mok_mxfp8_to_bf16 ---------------------------------------------------------------------- */

/* Code c under scale byte b as bf16 bits `got`, against float64. */
static int check_value(int b, int c, uint16_t got) {
  if ((c & 0x7f) == 0x7f) return got == ((c & 0x80) << 8 | 0x7fc0);
  const double exact = ldexp((double)mok_e4m3_decode((uint8_t)c), b - 127);
  /* DESIGN: exact iff a multiple of 2^-133, which is every code from byte 3 on, and below it
   * the codes that are multiples of 2^(-6 - b) */
  const int on_grid = fmod(fabs(exact), 0x1p-133) == 0.0;
  const double dq = fabs((double)mok_e4m3_decode((uint8_t)c));
  const int rule = b >= 3 || fmod(dq, ldexp(1.0, -6 - b)) == 0.0;
  const double want = on_grid ? exact : ldexp(nearbyint(ldexp(exact, 133)), -133);
  const double x = bf16_to_f32(got);
  return on_grid == rule && x == want && signbit(x) == signbit(want);
}

static void test_every_code_and_scale(void) {
  enum { K = 256 }; /* a row: the 256 codes, under one scale byte (its row number) */
  mok_context *ctx;
  mok_workspace *ws = workspace(0, MOK_BF16, &ctx);
  uint8_t *q = test_alloc(255 * K), *s = test_alloc(255 * K / B);
  uint16_t *out = test_alloc(255 * K * 2), *keep = test_alloc(K * 2);
  for (int r = 0; r < 255; r++) {
    for (int c = 0; c < K; c++) q[r * K + c] = (uint8_t)c;
    memset(s + r * K / B, r, K / B);
  }
  int bad = 0;
  CHECK_OK(mok_mxfp8_to_bf16(ws, MOK_E8M0_FITS + 1, K, q, s, out, NULL));
  for (int b = 0; b <= MOK_E8M0_FITS; b++)
    for (int c = 0; c < K; c++)
      if (!check_value(b, c, out[b * K + c]) && bad++ < 10)
        CHECK(0, "code 0x%02x, scale byte %d: bf16 0x%04x", c, b, out[b * K + c]);
  /* from byte 247 on, 448 reaches 2^128: refused whole; without the codes that reach it, exact */
  for (int b = MOK_E8M0_FITS + 1; b < 255; b++) {
    memset(out, 0x5a, K * 2);
    memcpy(keep, out, K * 2);
    const mok_status st = mok_mxfp8_to_bf16(ws, 1, K, q + b * K, s + b * K / B, out, NULL);
    CHECK(st == MOK_ERR_INVALID_ARG && memcmp(out, keep, K * 2) == 0,
          "scale byte %d with code 0x7e: %s, out %s", b, mok_status_name(st),
          memcmp(out, keep, K * 2) ? "written" : "untouched");
    int fit = 0;
    for (int c = 0; c < K; c++) {
      const int over = fabs(ldexp((double)mok_e4m3_decode((uint8_t)c), b - 127)) >= 0x1p128;
      q[b * K + c] = over ? 0 : (uint8_t)c;
      fit += !over;
    }
    CHECK(fit > 2, "byte %d: %d codes fit", b, fit);
    CHECK_OK(mok_mxfp8_to_bf16(ws, 1, K, q + b * K, s + b * K / B, out, NULL));
    for (int c = 0; c < K; c++)
      if (!check_value(b, q[b * K + c], out[c]) && bad++ < 10)
        CHECK(0, "code 0x%02x, scale byte %d: bf16 0x%04x", q[b * K + c], b, out[c]);
  }
  free(q), free(s), free(out), free(keep);
  release(ws, ctx);
}

/* An FP8 workspace, and one thread, give the same bytes. */
static void test_any_workspace(void) {
  enum { R = 37, K = 7 * B };
  mok_context *c0, *c1;
  mok_workspace *w0 = workspace(0, MOK_BF16, &c0), *w1 = workspace(1, MOK_FP8, &c1);
  uint8_t *q = test_alloc(R * K), *s = test_alloc(R * K / B);
  uint16_t *a = test_alloc(R * K * 2), *b = test_alloc(R * K * 2);
  for (int i = 0; i < R * K; i++) q[i] = (uint8_t)rnd();
  for (int i = 0; i < R * K / B; i++) s[i] = (uint8_t)(rnd() % (MOK_E8M0_FITS + 1));
  CHECK_OK(mok_mxfp8_to_bf16(w0, R, K, q, s, a, NULL));
  CHECK_OK(mok_mxfp8_to_bf16(w1, R, K, q, s, b, NULL));
  CHECK(memcmp(a, b, R * K * 2) == 0, "MOK_FP8 workspace of one thread: other bytes");
  for (int i = 0; i < R * K; i++)
    if (!check_value(s[i / B], q[i], a[i])) {
      CHECK(0, "value %d: code 0x%02x, scale byte %d: bf16 0x%04x", i, q[i], s[i / B], a[i]);
      break;
    }
  free(q), free(s), free(a), free(b);
  release(w0, c0);
  release(w1, c1);
}

static void test_refusals(void) {
  enum { R = 3, K = 3 * B, N = R * K };
  mok_context *ctx;
  mok_workspace *ws = workspace(0, MOK_BF16, &ctx);
  uint8_t *q = test_alloc(N + 32), *s = test_alloc(N / B + 32);
  uint16_t *out = test_alloc(N * 2 + 32), *keep = test_alloc(N * 2 + 32);
  for (int i = 0; i < N; i++) q[i] = (uint8_t)(rnd() % 0x7f);
  memset(s, 127, N / B + 32);
  memset(out, 0x5a, N * 2 + 32);
  memcpy(keep, out, N * 2 + 32);
  mok_status st;
#define REFUSED(call, want, why)                                                               \
  do {                                                                                         \
    st = (call);                                                                               \
    CHECK(st == (want), "%s: %s, want %s (%s)", why, mok_status_name(st),                      \
          mok_status_name(want), mok_last_error());                                            \
    CHECK(memcmp(out, keep, N * 2 + 32) == 0, "%s: out written", why);                        \
    CHECK(*mok_last_error() != '\0', "%s: no message", why);                                   \
  } while (0)
  s[N / B - 1] = 0xff; /* the last block of the last row */
  REFUSED(mok_mxfp8_to_bf16(ws, R, K, q, s, out, NULL), MOK_ERR_INVALID_ARG, "NaN scale byte");
  CHECK(strstr(mok_last_error(), "row 2, block 2") != NULL, "message: %s", mok_last_error());
  s[N / B - 1] = 127;
  memset(q + 4 * B, 0x38, B); /* row 1, block 1: ones, under 2^123 */
  s[4] = 250, q[4 * B + 5] = 0x60; /* 32 * 2^123 = 2^128 */
  REFUSED(mok_mxfp8_to_bf16(ws, R, K, q, s, out, NULL), MOK_ERR_INVALID_ARG, "2^128");
  q[4 * B + 5] = 0x5f; /* 30 * 2^123 = 1.875 * 2^127: fits */
  CHECK_OK(mok_mxfp8_to_bf16(ws, R, K, q, s, out, NULL));
  CHECK(out[4 * B + 5] == 0x7f70, "1.875 * 2^127 is bf16 0x%04x", out[4 * B + 5]);
  s[4] = 127;
  memset(out, 0x5a, N * 2 + 32);
  REFUSED(mok_mxfp8_to_bf16(ws, R, 48, q, s, out, NULL), MOK_ERR_INVALID_ARG, "k = 48");
  REFUSED(mok_mxfp8_to_bf16(ws, R, 0, q, s, out, NULL), MOK_ERR_INVALID_ARG, "k = 0");
  REFUSED(mok_mxfp8_to_bf16(ws, R, -32, q, s, out, NULL), MOK_ERR_INVALID_ARG, "k = -32");
  REFUSED(mok_mxfp8_to_bf16(ws, 0, K, q, s, out, NULL), MOK_ERR_INVALID_ARG, "rows = 0");
  REFUSED(mok_mxfp8_to_bf16(ws, (int64_t)1 << 60, K, q, s, out, NULL), MOK_ERR_INVALID_ARG,
          "rows * k beyond 2^60");
  REFUSED(mok_mxfp8_to_bf16(NULL, R, K, q, s, out, NULL), MOK_ERR_INVALID_ARG, "ws NULL");
  REFUSED(mok_mxfp8_to_bf16(ws, R, K, NULL, s, out, NULL), MOK_ERR_INVALID_ARG, "q NULL");
  REFUSED(mok_mxfp8_to_bf16(ws, R, K, q, NULL, out, NULL), MOK_ERR_INVALID_ARG, "scales NULL");
  REFUSED(mok_mxfp8_to_bf16(ws, R, K, q, s, NULL, NULL), MOK_ERR_INVALID_ARG, "out NULL");
  REFUSED(mok_mxfp8_to_bf16(ws, R, K, q + 1, s, out, NULL), MOK_ERR_ALIGNMENT, "q + 1");
  memcpy(keep, out, N * 2 + 32);
  st = mok_mxfp8_to_bf16(ws, R, K, q, s, out + 1, NULL);
  CHECK(st == MOK_ERR_ALIGNMENT && memcmp(out, keep, N * 2 + 32) == 0, "out + 1: %s",
        mok_status_name(st));
  /* out over the inputs: q itself, and the last scales under out's tail */
  uint8_t *qkeep = test_alloc(N);
  memcpy(qkeep, q, N);
  st = mok_mxfp8_to_bf16(ws, R, K, q, s, q, NULL);
  CHECK(st == MOK_ERR_INVALID_ARG && memcmp(q, qkeep, N) == 0, "out = q: %s",
        mok_status_name(st));
  uint16_t *big = test_alloc(N * 2 + 256);
  st = mok_mxfp8_to_bf16(ws, R, K, q, (uint8_t *)big + N * 2 - 16, big, NULL);
  CHECK(st == MOK_ERR_INVALID_ARG, "scales inside out: %s", mok_status_name(st));
#undef REFUSED
  free(q), free(s), free(out), free(keep), free(qkeep), free(big);
  release(ws, ctx);
}

const test_case tests_mxfp8[] = {
    {"mxfp8/rebase_lossless_iff_design_condition", test_lossless_condition},
    {"mxfp8/rebase_zero_blocks", test_zero_blocks},
    {"mxfp8/rebase_vs_float64_oracle", test_rebase_vs_oracle},
    {"mxfp8/q_row_of_decoded_vs_rebase", test_q_row_vs_rebase},
    {"mxfp8/to_bf16_every_code_and_scale", test_every_code_and_scale},
    {"mxfp8/to_bf16_any_workspace_or_threads", test_any_workspace},
    {"mxfp8/to_bf16_refusals_leave_out_untouched", test_refusals},
    {NULL, NULL},
};
