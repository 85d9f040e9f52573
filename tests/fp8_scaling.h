/*
 * fp8_scaling.h: layers scaled group by group, for the FP8 tests of both backends
 * (tests/test_fp8_layer.c on the CPU, tests/gpu/test_fp8.c on the GPU). With power-of-two
 * scales a quantization commutes with scaling a whole group by a power of two, and with nothing
 * else: a layer whose inputs and weights are scaled group by group (x and dy along H, u and so
 * hw and dû along I, each by its own power of two, undone in the next product's weights block by
 * block) gives the plain layer's outputs times known powers of two, bit for bit, exactly when
 * every quantization takes the groups DESIGN §8.1 says. Likewise each expert's rows scaled block
 * of 128 by block (k = 1: the router weight up, dy down) for the weight gradients' Q_col.
 * Also the relative error and cosine both report.
 */
#ifndef MOK_TESTS_FP8_SCALING_H
#define MOK_TESTS_FP8_SCALING_H

#include <math.h>
#include <string.h>

#include "check.h"
#include "fp8.h"
#include "harness.h"

#define FSG MOK_FP8_GROUP

static inline double fs_bf(uint16_t b) { return (double)mok_bf16_to_f32(b); }
static inline int fs_same_float(float a, float b) {
  return memcmp(&a, &b, sizeof a) == 0 || (a != a && b != b);
}
/* ||a - b|| / ||b|| and the cosine of a and b, accumulated (what FP8 costs against a layer
 * without it). */
typedef struct agree {
  double ab, aa, bb, dd;
} agree;
static inline void agree_add(agree *g, double a, double b) {
  g->ab += a * b, g->aa += a * a, g->bb += b * b, g->dd += (a - b) * (a - b);
}
static inline double agree_rel(const agree *g) {
  return g->bb > 0 ? sqrt(g->dd / g->bb) : INFINITY;
}
static inline double agree_cos(const agree *g) {
  return g->aa > 0 && g->bb > 0 ? g->ab / sqrt(g->aa * g->bb) : 0.0;
}

static const char *const fs_names[3 + G_COUNT] = {"y",       "dx",    "d_topk_weights",
                                                  "dw_gate", "dw_up", "dw_down",
                                                  "dws_gate", "dws_up", "dws_down"};

/* The powers of two a scaled layer's outputs carry (NULL: none): per group of H (the x side: aH,
 * the dy side: cH), of I (bI) and of I_s (bS), and per token (s, k = 1, no shared expert). */
typedef struct scaling {
  const int *aH, *cH, *bI, *bS;
  const int *s; /* [T] or NULL */
} scaling;

/* The exponent of output `out` (0..2: y, dx, d_topk_weights; 3..: the weight gradients in mok_grads
 * order) at [e][r][c] (y, dx: token r, column c; d_topk_weights: token r). */
static inline int out_exp(const scaling *sc, int out, int64_t r, int64_t c) {
  if (!sc) return 0;
  if (sc->s) return out == 0 ? sc->s[r] : out == 2 ? -sc->s[r] : 0;
  const int w = out - 3;
  const int *b = w >= GS_GATE ? sc->bS : sc->bI;
  switch (out) {
  case 0: return sc->cH[c / FSG];
  case 1: return sc->aH[c / FSG];
  case 2: return 0;
  default:
    if (w == G_GATE || w == GS_GATE) return -sc->aH[c / FSG];
    if (w == G_UP || w == GS_UP) return b[r / FSG] - sc->aH[c / FSG];
    return -sc->cH[r / FSG] - b[c / FSG]; /* down: [h][i] */
  }
}

static inline uint16_t times_pow2(uint16_t b, int e) {
  return mok_f32_to_bf16((float)ldexp(mok_bf16_to_f32(b), e));
}

/* Scales L's inputs and weights so that its outputs carry out_exp(sc): x and dy by their H
 * groups, u (so hw and dup) by its I groups through W_up's rows, each undone in the weights of
 * the next product block by block; or, per token, the router weight up and dy down. */
static inline void scale_layer(mok_host_layer *L, const scaling *sc) {
  const int64_t H = L->shape.hidden, I = L->shape.inter, Is = L->shape.shared_inter;
  const int64_t E = L->shape.experts, T = L->tokens;
  if (sc->s) { /* k = 1 */
    for (int64_t t = 0; t < T; t++) {
      L->topk_weights[t] = (float)ldexp(L->topk_weights[t], sc->s[t]);
      for (int64_t h = 0; h < H; h++) L->dy[t * H + h] = times_pow2(L->dy[t * H + h], -sc->s[t]);
    }
    return;
  }
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < H; h++) {
      L->x[t * H + h] = times_pow2(L->x[t * H + h], -sc->aH[h / FSG]);
      L->dy[t * H + h] = times_pow2(L->dy[t * H + h], -sc->cH[h / FSG]);
    }
  for (int64_t e = 0; e <= E; e++) { /* e = E: the shared expert */
    const int64_t n = e < E ? I : Is;
    if (n == 0) continue;
    const int *b = e < E ? sc->bI : sc->bS;
    uint16_t *wg = e < E ? L->w_gate + e * I * H : L->ws_gate;
    uint16_t *wu = e < E ? L->w_up + e * I * H : L->ws_up;
    uint16_t *wd = e < E ? L->w_down + e * H * I : L->ws_down;
    for (int64_t i = 0; i < n; i++)
      for (int64_t h = 0; h < H; h++) {
        wg[i * H + h] = times_pow2(wg[i * H + h], sc->aH[h / FSG]);
        wu[i * H + h] = times_pow2(wu[i * H + h], sc->aH[h / FSG] - b[i / FSG]);
        wd[h * n + i] = times_pow2(wd[h * n + i], sc->cH[h / FSG] + b[i / FSG]);
      }
  }
}

/* Every output of the scaled run against the plain run's times 2^out_exp, bit for bit. */
static inline void check_scaled_bits(const harness *plain, const harness *scaled, const scaling *sc,
                              const char *what) {
  const mok_shape *s = &plain->L.shape;
  const int64_t H = s->hidden, I = s->inter, Is = s->shared_inter, k = s->top_k, T = plain->T;
  int bad = 0;
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < H; h++) {
      const uint16_t y = times_pow2(plain->y[t * H + h], out_exp(sc, 0, t, h));
      const uint16_t dx = times_pow2(plain->dx[t * H + h], out_exp(sc, 1, t, h));
      if ((y != scaled->y[t * H + h] || dx != scaled->dx[t * H + h]) && bad++ < 5)
        CHECK(0, "%s: token %lld column %lld: y %g dx %g, want %g and %g", what, (long long)t,
              (long long)h, fs_bf(scaled->y[t * H + h]), fs_bf(scaled->dx[t * H + h]), fs_bf(y),
              fs_bf(dx));
    }
    for (int64_t j = 0; j < k; j++) {
      const float d = (float)ldexp(plain->dtw[t * k + j], out_exp(sc, 2, t, j));
      if (!fs_same_float(d, scaled->dtw[t * k + j]) && bad++ < 5)
        CHECK(0, "%s: d_topk_weights[%lld][%lld] %a, want %a", what, (long long)t, (long long)j,
              scaled->dtw[t * k + j], d);
    }
  }
  for (int w = 0; w < G_COUNT; w++) {
    const int shared = w >= GS_GATE;
    const int64_t rows = w == G_DOWN || w == GS_DOWN ? H : shared ? Is : I;
    const int64_t len = w == G_DOWN ? I : w == GS_DOWN ? Is : H;
    const uint16_t *a = plain->g[w], *b = scaled->g[w];
    for (int64_t x = 0; x < plain->g_len[w]; x++) {
      const int64_t r = x / len % rows, c = x % len;
      const uint16_t want = times_pow2(a[x], out_exp(sc, 3 + w, r, c));
      if (want != b[x] && bad++ < 5)
        CHECK(0, "%s: %s[%lld][%lld][%lld] %g, want %g", what, fs_names[3 + w],
              (long long)(x / len / rows), (long long)r, (long long)c, fs_bf(b[x]), fs_bf(want));
    }
  }
  CHECK(bad == 0, "%s: %d values differ from the plain layer's, scaled", what, bad);
}


#endif
