/*
 * test_fp8_layer.c: the MOK_FP8 layer of the CPU backend (DESIGN.md §8).
 *   Accuracy: the FP8 layer against the BF16 layer on the same inputs (every element of y, dx,
 *   d_topk_weights and the six weight gradients) and against the float64 layer without
 *   quantization (ref64 of the BF16 recipe, on sampled tokens and gradient rows): relative L2
 *   error and cosine per tensor, against tolerances derived below from what e4m3 keeps.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cpu/ref64.h"
#include "harness.h"

static double bf(uint16_t b) { return (double)mok_bf16_to_f32(b); }

/* ||a - b|| / ||b|| and the cosine of a and b, accumulated. */
typedef struct agree {
  double ab, aa, bb, dd;
} agree;

static void agree_add(agree *g, double a, double b) {
  g->ab += a * b, g->aa += a * a, g->bb += b * b, g->dd += (a - b) * (a - b);
}
static double agree_rel(const agree *g) { return g->bb > 0 ? sqrt(g->dd / g->bb) : INFINITY; }
static double agree_cos(const agree *g) {
  return g->aa > 0 && g->bb > 0 ? g->ab / sqrt(g->aa * g->bb) : 0.0;
}

static const char *const names[3 + G_COUNT] = {"y",       "dx",      "d_topk_weights",
                                                "dw_gate", "dw_up",   "dw_down",
                                                "dws_gate", "dws_up", "dws_down"};

/* Tolerance of the FP8 layer against the unquantized ones: relative L2 error per tensor (and a
 * cosine of at least 1 - tol^2 / 2, which that implies).
 *
 * e4m3 keeps 3 mantissa bits, so a quantized value is off by at most 2^-4 of its magnitude; over
 * a group of Gaussian values scaled by a power of two into e4m3's range the relative L2 error
 * is eps = 2.65 % (by enumeration of the codes: the group's small values are still normal, so
 * few lose more than that). A product of two quantized operands sums K terms whose errors are
 * independent: its absolute error grows like sqrt(K), but so does its value when the terms'
 * signs are random, so the errors do not average down relative to the result: a product is off
 * by sqrt(2) eps. The errors of the quantizations an output passes through add in quadrature:
 * y sees x and W_gate, W_up (through g and u: about 2 eps into hw, as g and u share x), then hw
 * and W_down: sqrt(4 + 1 + 1) eps = 6.5 %. dx (dy and W_down into dh, the forward's g and u
 * into dgu, then dgu and W_gu), d_topk_weights (dh against silu(g) u) and every weight gradient
 * (dy or dgu, and hw or x, each quantized along the rows, with hw and dgu already carrying the
 * error of the products that made them) come to about the same. Measured 6.2-7.3 % on every
 * tensor; the bound is 1.5 times the model. It checks what the recipe costs, not that the layer
 * follows it: a quantization skipped or a scale off by a power of two moves these errors little,
 * which the comparison with ref64's FP8 recipe at accumulation-order tolerance catches. */
#define TOL_FP8 0.10

/* Every output of the FP8 run against the BF16 run on the same inputs. */
static void vs_bf16_layer(const harness *f, const harness *b, double rel[3 + G_COUNT],
                          double cosine[3 + G_COUNT]) {
  const int64_t TH = f->T * f->L.shape.hidden, Tk = f->T * f->L.shape.top_k;
  agree g[3 + G_COUNT];
  memset(g, 0, sizeof g);
  for (int64_t i = 0; i < TH; i++) {
    agree_add(&g[0], bf(f->y[i]), bf(b->y[i]));
    agree_add(&g[1], bf(f->dx[i]), bf(b->dx[i]));
  }
  for (int64_t i = 0; i < Tk; i++) agree_add(&g[2], f->dtw[i], b->dtw[i]);
  for (int w = 0; w < G_COUNT; w++)
    for (int64_t i = 0; i < f->g_len[w]; i++)
      agree_add(&g[3 + w], bf(((const uint16_t *)f->g[w])[i]), bf(((const uint16_t *)b->g[w])[i]));
  for (int i = 0; i < 3 + G_COUNT; i++) rel[i] = agree_rel(&g[i]), cosine[i] = agree_cos(&g[i]);
}

/* Sampled tokens and gradient rows of the FP8 run against the float64 layer of the BF16 recipe
 * (L with its precision set to MOK_BF16). */
static void vs_float64(const harness *f, double rel[3 + G_COUNT], double cosine[3 + G_COUNT]) {
  mok_host_layer L = f->L;
  L.shape.precision = MOK_BF16;
  const mok_shape *s = &L.shape;
  const int64_t H = s->hidden, I = s->inter, Is = s->shared_inter, k = s->top_k;
  agree g[3 + G_COUNT];
  memset(g, 0, sizeof g);
  double *y = malloc((size_t)H * sizeof *y), *dx = malloc((size_t)H * sizeof *dx);
  double *row = malloc((size_t)(H > I ? (H > Is ? H : Is) : (I > Is ? I : Is)) * sizeof *row);
  double dtw[64];
  for (int64_t t = 0; t < f->T; t += 3) {
    mok_ref64_token(&L, t, y, dx, dtw);
    for (int64_t i = 0; i < H; i++) {
      agree_add(&g[0], bf(f->y[t * H + i]), y[i]);
      agree_add(&g[1], bf(f->dx[t * H + i]), dx[i]);
    }
    for (int64_t j = 0; j < k; j++) agree_add(&g[2], f->dtw[t * k + j], dtw[j]);
  }
  for (int w = 0; w < G_COUNT; w++) {
    if (f->g_len[w] == 0) continue;
    const int shared = w >= GS_GATE;
    const int64_t experts = shared ? 1 : s->experts;
    const int64_t rows = w == G_DOWN || w == GS_DOWN ? H : shared ? Is : I;
    const int64_t len = w == G_DOWN ? I : w == GS_DOWN ? Is : H;
    for (int64_t e = 0; e < experts; e += experts > 8 ? 3 : 1) /* 3 rows an expert */
      for (int64_t r = e % 7; r < rows; r += rows / 3 + 1) {
        mok_ref64_grad_row(&L, (mok_ref_grad)w, e, r, row);
        for (int64_t i = 0; i < len; i++)
          agree_add(&g[3 + w], bf(((const uint16_t *)f->g[w])[(e * rows + r) * len + i]), row[i]);
      }
  }
  for (int i = 0; i < 3 + G_COUNT; i++) rel[i] = agree_rel(&g[i]), cosine[i] = agree_cos(&g[i]);
  free(y), free(dx), free(row);
}

static void report(const char *what, const harness *f, const double rel[], const double cosine[]) {
  printf("     %s: rel.err / cosine:", what);
  for (int i = 0; i < 3 + G_COUNT; i++) {
    if (i >= 3 && f->g_len[i - 3] == 0) continue;
    printf(" %s %.3f/%.5f", names[i], rel[i], cosine[i]);
    CHECK(rel[i] < TOL_FP8, "%s: %s rel err %.3g > %.3g", what, names[i], rel[i], TOL_FP8);
    CHECK(cosine[i] > 1.0 - TOL_FP8 * TOL_FP8 / 2,
          "%s: %s cosine %.6f < %.6f", what, names[i], cosine[i], 1.0 - TOL_FP8 * TOL_FP8 / 2);
  }
  printf("\n");
}

static void accuracy_case(const mok_shape *s, int64_t T, uint64_t seed, const char *what) {
  mok_shape sb = *s, sf = *s;
  sb.precision = MOK_BF16, sf.precision = MOK_FP8;
  harness b, f;
  memset(&f, 0, sizeof f);
  if (harness_init(&b, &sb, T, seed, 0) && harness_init(&f, &sf, T, seed, 0)) {
    harness_poison(&b, 0xA5);
    harness_poison(&f, 0x5A);
    CHECK_OK(harness_run(&b, MOK_GRAD_WRITE_BF16));
    CHECK_OK(harness_run(&f, MOK_GRAD_WRITE_BF16));
    double rel[3 + G_COUNT], cosine[3 + G_COUNT];
    char name[96];
    vs_bf16_layer(&f, &b, rel, cosine);
    snprintf(name, sizeof name, "%s, vs BF16 layer", what);
    report(name, &f, rel, cosine);
    vs_float64(&f, rel, cosine);
    snprintf(name, sizeof name, "%s, vs float64", what);
    report(name, &f, rel, cosine);
  }
  harness_fini(&b);
  harness_fini(&f);
}

static void accuracy(void) {
  /* a shared expert of another size, partial groups along every K (H 200, I 160, I_s 96) */
  const mok_shape a = {96, 200, 160, 96, 8, 3, MOK_FP8, 0};
  accuracy_case(&a, 96, 801, "H 200 I 160 I_s 96");
  /* DeepSeek-V3 at 1/16 (H 448, I 128, I_s 128, E 32, k 8) */
  const mok_shape d = {256, 448, 128, 128, 32, 8, MOK_FP8, 0};
  accuracy_case(&d, 256, 802, "dsv3/16");
}

const test_case tests_fp8_layer[] = {
    {"fp8/cpu_accuracy_vs_bf16_and_float64", accuracy},
    {NULL, NULL},
};
