/*
 * test_fp8_weights.c: the FP8 weight buffer of the CPU backend (DESIGN.md §8.3).
 *   mok_quantize_weights against a quantizer written here the slow way (fp8_oracle.h: each
 *   128 x 128 block's amax by a loop, its scale by doubling, each code by nearest search), byte
 *   for byte: codes, transposed codes and scales of all six tensors, on sizes that leave partial
 *   blocks, with a block of zeros and one holding NaN, infinities, -0 and a huge value.
 *   mok_fp8_weights_import of those codes and scales gives the same buffer, and takes scales that
 *   are not powers of two as given.
 *   Refused calls (a MOK_BF16 workspace, a NULL or misaligned buffer, missing tensors, shared
 *   tensors without a shared expert, scales that are not finite and positive) leave the buffer
 *   untouched.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fp8_oracle.h"
#include "harness.h"
#include "internal.h"

#define POISON 0x5a

static int64_t blocks(int64_t n) { return (n + MOK_FP8_GROUP - 1) / MOK_FP8_GROUP; }

/* E_local 3, H 200, I 160, I_s 96: every dimension ends in a partial block. */
static const mok_shape shape = {16, 200, 160, 96, 3, 2, MOK_FP8, 0};

/* The six bf16 tensors of L in MOK_W_* order. */
static void tensors(const mok_host_layer *L, const uint16_t *t[MOK_W_COUNT]) {
  const uint16_t *p[MOK_W_COUNT] = {L->w_gate, L->w_up, L->w_down,
                                    L->ws_gate, L->ws_up, L->ws_down};
  memcpy(t, p, sizeof p);
}

/* Expert 1 of w_gate, block (0, 1): NaN, +-inf, -0, a huge and a tiny value. Expert 0 of w_up,
 * block (1, 1): all zeros. */
static void plant_specials(mok_host_layer *L) {
  const int64_t H = L->shape.hidden, I = L->shape.inter;
  uint16_t *g = L->w_gate + 1 * I * H;
  g[3 * H + 130] = 0x7fc0;                     /* NaN */
  g[4 * H + 131] = 0x7f80;                     /* +inf */
  g[5 * H + 200 - 1] = 0xff80;                 /* -inf */
  g[6 * H + 140] = 0x8000;                     /* -0 */
  g[7 * H + 141] = mok_f32_to_bf16(1e30f);
  g[8 * H + 142] = mok_f32_to_bf16(1e-30f);
  uint16_t *u = L->w_up + 0 * I * H;
  for (int64_t i = 128; i < I; i++)
    for (int64_t h = 128; h < H; h++) u[i * H + h] = 0;
}

/* Tensor m of the buffer against the oracle's Q_blk of the bf16 tensor w; returns mismatches. */
static int check_tensor(const mok_fp8_matrix_layout *m, const uint16_t *w, const char *buf,
                        const char *name) {
  const int64_t N = m->n, K = m->k, bn = blocks(N), bk = blocks(K);
  const uint8_t *q = (const uint8_t *)(buf + m->q), *qt = (const uint8_t *)(buf + m->qt);
  const float *s = (const float *)(buf + m->s);
  int bad = 0;
  for (int64_t e = 0; e < m->experts; e++)
    for (int64_t b = 0; b < bn * bk; b++) {
      const int64_t n0 = b / bk * MOK_FP8_GROUP, k0 = b % bk * MOK_FP8_GROUP;
      float amax = 0.0f;
      for (int64_t n = n0; n < N && n < n0 + MOK_FP8_GROUP; n++)
        for (int64_t k = k0; k < K && k < k0 + MOK_FP8_GROUP; k++) {
          const float v = fabsf(mok_bf16_to_f32(w[(e * N + n) * K + k]));
          if (!isnan(v) && v > amax) amax = v;
        }
      const int ex = oracle_scale_exp(amax);
      const float want_s = (float)ldexp(1.0, ex);
      if (memcmp(&s[e * bn * bk + b], &want_s, 4) != 0 && bad++ < 5)
        CHECK(0, "%s expert %lld block %lld: scale %a, want %a", name, (long long)e,
              (long long)b, s[e * bn * bk + b], want_s);
      for (int64_t n = n0; n < N && n < n0 + MOK_FP8_GROUP; n++)
        for (int64_t k = k0; k < K && k < k0 + MOK_FP8_GROUP; k++) {
          const float v = mok_bf16_to_f32(w[(e * N + n) * K + k]);
          const uint8_t want = oracle_e4m3((float)ldexp((double)v, -ex));
          const uint8_t got = q[(e * N + n) * K + k], got_t = qt[(e * K + k) * N + n];
          if ((got != want || got_t != want) && bad++ < 5)
            CHECK(0, "%s expert %lld (%lld, %lld) = %a: code 0x%02x, transposed 0x%02x, want "
                  "0x%02x", name, (long long)e, (long long)n, (long long)k, v, got, got_t, want);
        }
    }
  return bad;
}

static void quantize_vs_oracle(void) {
  harness h;
  if (harness_init(&h, &shape, shape.max_tokens, 31, 0)) {
    plant_specials(&h.L);
    const mok_fp8_layout L = mok_fp8_layout_of(h.ws);
    CHECK(mok_fp8_weights_bytes(h.ws) == L.bytes && L.bytes > 0, "mok_fp8_weights_bytes");
    char *buf = test_alloc(L.bytes);
    memset(buf, POISON, L.bytes);
    mok_weights w = mok_host_layer_weights(&h.L);
    CHECK_OK(mok_quantize_weights(h.ws, &w, buf, NULL));
    const uint16_t *t[MOK_W_COUNT];
    tensors(&h.L, t);
    const char *names[MOK_W_COUNT] = {"w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"};
    int bad = 0;
    for (int i = 0; i < MOK_W_COUNT; i++) {
      CHECK(L.m[i].experts == (i < MOK_WS_GATE ? shape.experts : 1), "%s: experts", names[i]);
      bad += check_tensor(&L.m[i], t[i], buf, names[i]);
    }
    CHECK(bad == 0, "%d codes or scales differ from the oracle", bad);
    /* the planted block: NaN stays NaN, the infinities saturate, the scale is 2^126 */
    const int64_t H = shape.hidden, I = shape.inter;
    const uint8_t *q = (const uint8_t *)(buf + L.m[MOK_W_GATE].q) + 1 * I * H;
    CHECK(q[3 * H + 130] == 0x7f && q[4 * H + 131] == 0x7e && q[5 * H + 199] == 0xfe,
          "specials: 0x%02x 0x%02x 0x%02x", q[3 * H + 130], q[4 * H + 131], q[5 * H + 199]);
    free(buf);
  }
  harness_fini(&h);
}

/* The given form of the buffer's own codes and scales. */
static mok_fp8_given given_of(const mok_fp8_layout *L, const char *buf) {
  mok_fp8_matrix m[MOK_W_COUNT];
  for (int i = 0; i < MOK_W_COUNT; i++) {
    m[i].q = L->m[i].experts ? buf + L->m[i].q : NULL;
    m[i].s = L->m[i].experts ? (const float *)(buf + L->m[i].s) : NULL;
  }
  mok_fp8_given g = {m[0], m[1], m[2], m[3], m[4], m[5]};
  return g;
}

/* Bytes of the buffer's defined fields that differ, or -1 when none: codes, transposes, scales. */
static int64_t first_field_diff(const mok_fp8_layout *L, const char *a, const char *b) {
  for (int i = 0; i < MOK_W_COUNT; i++) {
    const mok_fp8_matrix_layout *m = &L->m[i];
    const int64_t codes = m->experts * m->n * m->k;
    const int64_t scales = m->experts * blocks(m->n) * blocks(m->k) * 4;
    const struct {
      size_t at;
      int64_t n;
    } f[3] = {{m->q, codes}, {m->qt, codes}, {m->s, scales}};
    for (int j = 0; j < 3; j++)
      for (int64_t x = 0; x < f[j].n; x++)
        if (a[f[j].at + x] != b[f[j].at + x]) return (int64_t)f[j].at + x;
  }
  return -1;
}

static void import_equals_quantize(void) {
  harness h;
  if (harness_init(&h, &shape, shape.max_tokens, 32, 0)) {
    const mok_fp8_layout L = mok_fp8_layout_of(h.ws);
    char *a = test_alloc(L.bytes), *b = test_alloc(L.bytes);
    memset(a, POISON, L.bytes);
    memset(b, 0xa5, L.bytes);
    mok_weights w = mok_host_layer_weights(&h.L);
    CHECK_OK(mok_quantize_weights(h.ws, &w, a, NULL));
    mok_fp8_given g = given_of(&L, a);
    CHECK_OK(mok_fp8_weights_import(h.ws, &g, b, NULL));
    const int64_t at = first_field_diff(&L, a, b);
    CHECK(at < 0, "import of quantize's codes and scales differs at byte %lld", (long long)at);

    /* scales that are not powers of two are taken as given */
    const int64_t ns = L.m[MOK_W_DOWN].experts * blocks(L.m[MOK_W_DOWN].n) *
                       blocks(L.m[MOK_W_DOWN].k);
    float *s = (float *)(a + L.m[MOK_W_DOWN].s);
    for (int64_t i = 0; i < ns; i++) s[i] = 0.3f + 0.01f * (float)i;
    CHECK_OK(mok_fp8_weights_import(h.ws, &g, b, NULL));
    CHECK(first_field_diff(&L, a, b) < 0, "import of other scales");
    free(a);
    free(b);
  }
  harness_fini(&h);
}

static int untouched(const char *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)p[i] != POISON) return 0;
  return 1;
}

/* `call` must fail with `want` and leave buf's n bytes as POISON. */
#define REFUSED(call, want, buf, n, what)                                                     \
  do {                                                                                        \
    mok_status st_ = (call);                                                                  \
    CHECK(st_ == (want), "%s: %s, expected %s (%s)", (what), mok_status_name(st_),            \
          mok_status_name(want), mok_last_error());                                           \
    CHECK(untouched((buf), (n)), "%s: the buffer was written", (what));                       \
  } while (0)

static void refused_calls_leave_buffer(void) {
  harness h, plain, bf;
  memset(&plain, 0, sizeof plain);
  memset(&bf, 0, sizeof bf);
  mok_shape no_shared = shape, bf16 = shape;
  no_shared.shared_inter = 0;
  bf16.precision = MOK_BF16;
  if (harness_init(&h, &shape, 8, 33, 0) && harness_init(&plain, &no_shared, 8, 34, 0) &&
      harness_init(&bf, &bf16, 8, 35, 0)) {
    const mok_fp8_layout L = mok_fp8_layout_of(h.ws);
    const size_t n = L.bytes + 512;
    char *buf = test_alloc(n);
    memset(buf, POISON, n);
    const mok_weights w = mok_host_layer_weights(&h.L);
    mok_weights v = w;

    CHECK(mok_fp8_weights_bytes(bf.ws) == 0, "a MOK_BF16 workspace has an FP8 buffer");
    CHECK(mok_fp8_weights_bytes(NULL) == 0, "NULL workspace");
    REFUSED(mok_quantize_weights(bf.ws, &w, buf, NULL), MOK_ERR_INVALID_ARG, buf, n, "BF16 ws");
    REFUSED(mok_quantize_weights(NULL, &w, buf, NULL), MOK_ERR_INVALID_ARG, buf, n, "NULL ws");
    REFUSED(mok_quantize_weights(h.ws, NULL, buf, NULL), MOK_ERR_INVALID_ARG, buf, n,
            "NULL weights");
    REFUSED(mok_quantize_weights(h.ws, &w, NULL, NULL), MOK_ERR_INVALID_ARG, buf, n,
            "NULL buffer");
    REFUSED(mok_quantize_weights(h.ws, &w, buf + 16, NULL), MOK_ERR_ALIGNMENT, buf, n,
            "misaligned buffer");
    v.w_down = NULL;
    REFUSED(mok_quantize_weights(h.ws, &v, buf, NULL), MOK_ERR_INVALID_ARG, buf, n, "no w_down");
    v = w, v.ws_up = NULL;
    REFUSED(mok_quantize_weights(h.ws, &v, buf, NULL), MOK_ERR_INVALID_ARG, buf, n, "no ws_up");
    v = mok_host_layer_weights(&plain.L), v.ws_gate = h.L.ws_gate;
    REFUSED(mok_quantize_weights(plain.ws, &v, buf, NULL), MOK_ERR_INVALID_ARG, buf, n,
            "ws_gate with I_s = 0");

    /* import: the given codes and scales of a good buffer, one thing spoilt at a time */
    char *good = test_alloc(L.bytes);
    CHECK_OK(mok_quantize_weights(h.ws, &w, good, NULL));
    const mok_fp8_given g = given_of(&L, good);
    mok_fp8_given x = g;
    REFUSED(mok_fp8_weights_import(bf.ws, &g, buf, NULL), MOK_ERR_INVALID_ARG, buf, n,
            "import, BF16 ws");
    REFUSED(mok_fp8_weights_import(h.ws, &g, buf + 16, NULL), MOK_ERR_ALIGNMENT, buf, n,
            "import, misaligned buffer");
    x.w_up.q = NULL;
    REFUSED(mok_fp8_weights_import(h.ws, &x, buf, NULL), MOK_ERR_INVALID_ARG, buf, n,
            "import, no w_up codes");
    x = g, x.ws_down.s = NULL;
    REFUSED(mok_fp8_weights_import(h.ws, &x, buf, NULL), MOK_ERR_INVALID_ARG, buf, n,
            "import, no ws_down scales");
    const mok_fp8_layout P = mok_fp8_layout_of(plain.ws);
    char *pgood = test_alloc(P.bytes);
    CHECK_OK(mok_quantize_weights(plain.ws, &(mok_weights){plain.L.w_gate, plain.L.w_up,
                                                           plain.L.w_down, NULL, NULL, NULL,
                                                           NULL},
                                  pgood, NULL));
    x = given_of(&P, pgood), x.ws_gate = g.ws_gate;
    REFUSED(mok_fp8_weights_import(plain.ws, &x, buf, NULL), MOK_ERR_INVALID_ARG, buf, n,
            "import, ws_gate with I_s = 0");
    /* scales: zero, negative, NaN, infinite; the last scale of the last tensor, so that every
     * tensor before it would have been written by a backend that checks as it goes */
    const mok_fp8_matrix_layout *m = &L.m[MOK_WS_DOWN];
    float *last = (float *)(good + m->s) + m->experts * blocks(m->n) * blocks(m->k) - 1;
    const float keep = *last, spoilt[4] = {0.0f, -1.0f, NAN, INFINITY};
    for (int i = 0; i < 4; i++) {
      char what[64];
      snprintf(what, sizeof what, "import, a scale of %g", (double)spoilt[i]);
      *last = spoilt[i];
      REFUSED(mok_fp8_weights_import(h.ws, &g, buf, NULL), MOK_ERR_INVALID_ARG, buf, n, what);
    }
    *last = keep;
    CHECK_OK(mok_fp8_weights_import(h.ws, &g, buf, NULL));
    free(pgood);
    free(good);
    free(buf);
  }
  harness_fini(&h);
  harness_fini(&plain);
  harness_fini(&bf);
}

const test_case tests_fp8_weights[] = {
    {"fp8/cpu_quantize_weights_vs_oracle", quantize_vs_oracle},
    {"fp8/cpu_import_equals_quantize", import_equals_quantize},
    {"fp8/cpu_refused_weight_calls_leave_buffer", refused_calls_leave_buffer},
    {NULL, NULL},
};
