/*
 * test_numerics.c: the CPU backend against the float64 checker (src/cpu/ref64.c) on fresh random
 * layers: y, dx and d_topk_weights of sampled tokens, and sampled rows of all six weight
 * gradients in both grad modes, each as ||out - ref|| / ||ref|| per tensor.
 *
 * ref64 rounds to bf16 at the same points as the backend, y and dx included, so the two differ by
 * accumulation-order error plus the rare value that rounds to the other bf16 neighbour: measured
 * 3e-5 at most here. The tolerances sit well below what a missing rounding point or a wrong
 * factor gives (1e-3 and more), and the measured errors are printed.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "cpu/ref64.h"
#include "harness.h"

#define TOL_ACT 5e-4   /* y, dx: bf16 outputs compared with bf16-rounded references */
#define TOL_DTW 2e-5   /* d_topk_weights: fp32 output, fp32 sums vs double */
#define TOL_GRAD 5e-4  /* weight grads written as bf16, vs bf16-rounded references */
#define TOL_MAIN 2e-5  /* weight grads added to fp32 main grads */

static double bf(uint16_t b) { return (double)mok_bf16_to_f32(b); }
static double to_bf16(double v) { return bf(mok_f32_to_bf16((float)v)); }

/* y, dx, d_topk_weights of every `stride`-th token vs ref64. */
static void check_tokens(const harness *h, int64_t stride, const char *what, double err[3]) {
  const int64_t H = h->L.shape.hidden, k = h->L.shape.top_k;
  double *y = malloc((size_t)H * sizeof *y), *dx = malloc((size_t)H * sizeof *dx);
  double dtw[64];
  rel_err ey = {0, 0}, edx = {0, 0}, edtw = {0, 0};
  for (int64_t t = stride / 2 % h->T; t < h->T; t += stride) {
    mok_ref64_token(&h->L, t, y, dx, dtw);
    for (int64_t i = 0; i < H; i++) {
      rel_err_add(&ey, bf(h->y[t * H + i]), y[i]);
      rel_err_add(&edx, bf(h->dx[t * H + i]), dx[i]);
    }
    for (int64_t j = 0; j < k; j++) rel_err_add(&edtw, h->dtw[t * k + j], dtw[j]);
  }
  err[0] = rel_err_value(&ey), err[1] = rel_err_value(&edx), err[2] = rel_err_value(&edtw);
  CHECK(err[0] < TOL_ACT, "%s: y rel err %.3g > %.3g", what, err[0], TOL_ACT);
  CHECK(err[1] < TOL_ACT, "%s: dx rel err %.3g > %.3g", what, err[1], TOL_ACT);
  CHECK(err[2] < TOL_DTW, "%s: d_topk_weights rel err %.3g > %.3g", what, err[2], TOL_DTW);
  free(y);
  free(dx);
}

/* The initial value of main-grad element i in ACCUMULATE mode (so the add is checked too). */
static float main_grad_init(int64_t i) { return 0.01f * (float)((i * 7919) % 201 - 100) / 100.0f; }

/* Sampled rows of gradient `which` vs ref64: every `stride`-th row of every `e_stride`-th
 * expert. */
static double check_grad(const harness *h, int which, mok_grad_mode mode, int64_t stride,
                         int64_t e_stride) {
  const mok_shape *s = &h->L.shape;
  const int64_t H = s->hidden, I = s->inter, Is = s->shared_inter;
  const int shared = which >= GS_GATE;
  const int64_t experts = shared ? 1 : s->experts;
  const int64_t rows = which == G_DOWN || which == GS_DOWN ? H : shared ? Is : I;
  const int64_t len = which == G_DOWN ? I : which == GS_DOWN ? Is : H;
  double *ref = malloc((size_t)len * sizeof *ref);
  rel_err err = {0, 0};
  for (int64_t e = 0; e < experts; e += e_stride) {
    for (int64_t row = (e * 3) % stride; row < rows; row += stride) {
      mok_ref64_grad_row(&h->L, (mok_ref_grad)which, e, row, ref);
      const int64_t at = (e * rows + row) * len;
      for (int64_t i = 0; i < len; i++) {
        if (mode == MOK_GRAD_WRITE_BF16) {
          rel_err_add(&err, bf(((const uint16_t *)h->g[which])[at + i]), to_bf16(ref[i]));
        } else {
          double init = main_grad_init(at + i);
          rel_err_add(&err, (double)((const float *)h->g[which])[at + i] - init, ref[i]);
        }
      }
    }
  }
  free(ref);
  return rel_err_value(&err);
}

static void fill_main_grads(harness *h) {
  for (int w = 0; w < G_COUNT; w++)
    for (int64_t i = 0; i < h->g_len[w]; i++) ((float *)h->g[w])[i] = main_grad_init(i);
}

static const char *grad_name[G_COUNT] = {"dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up",
                                         "dws_down"};

/* One layer: forward + backward in `mode`, then every output vs ref64. */
static void run_case(const mok_shape *s, int64_t T, uint64_t seed, mok_grad_mode mode,
                     const char *what) {
  harness h;
  if (harness_init(&h, s, T, seed, 0)) {
    harness_poison(&h, 0xA5);
    if (mode == MOK_GRAD_ACCUMULATE_F32) fill_main_grads(&h);
    CHECK_OK(harness_run(&h, mode));
    double e[3];
    check_tokens(&h, 5, what, e);
    printf("     %s: y %.2e  dx %.2e  d_topk_weights %.2e\n", what, e[0], e[1], e[2]);
    printf("     %s %s:", what, mode == MOK_GRAD_WRITE_BF16 ? "bf16" : "f32+=");
    for (int w = 0; w < G_COUNT; w++) {
      if (h.g_len[w] == 0) continue;
      double g = check_grad(&h, w, mode, 7, 1);
      printf(" %s %.2e", grad_name[w], g);
      const double tol = mode == MOK_GRAD_WRITE_BF16 ? TOL_GRAD : TOL_MAIN;
      CHECK(g < tol, "%s: %s rel err %.3g > %.3g (mode %d)", what, grad_name[w], g, tol,
            (int)mode);
    }
    printf("\n");
  }
  harness_fini(&h);
}

/* I = 160: the router gradient's last 64-column chunk is partial; I_s != I. */
static const mok_shape shape_a = {64, 256, 160, 96, 8, 3, MOK_BF16, 0};
/* No shared expert, k = 1, H not a multiple of 16 (the dot products' tail). */
static const mok_shape shape_b = {48, 200, 64, 0, 6, 1, MOK_BF16, 0};

static void forward_vs_ref64(void) {
  harness h;
  if (harness_init(&h, &shape_a, 64, 101, 0)) {
    harness_poison(&h, 0xA5);
    mok_forward_args f = harness_forward_args(&h);
    CHECK_OK(mok_forward(h.ws, &f, NULL));
    const int64_t H = shape_a.hidden;
    double *y = malloc((size_t)H * sizeof *y);
    rel_err e = {0, 0};
    for (int64_t t = 0; t < h.T; t += 3) {
      mok_ref64_token(&h.L, t, y, NULL, NULL);
      for (int64_t i = 0; i < H; i++) rel_err_add(&e, bf(h.y[t * H + i]), y[i]);
    }
    printf("     forward only: y %.2e\n", rel_err_value(&e));
    CHECK(rel_err_value(&e) < TOL_ACT, "y rel err %.3g", rel_err_value(&e));
    free(y);
  }
  harness_fini(&h);
}

static void grads_bf16_vs_ref64(void) {
  run_case(&shape_a, 64, 202, MOK_GRAD_WRITE_BF16, "shared");
  run_case(&shape_b, 48, 203, MOK_GRAD_WRITE_BF16, "no shared, k=1");
}

static void grads_f32_vs_ref64(void) {
  run_case(&shape_a, 64, 302, MOK_GRAD_ACCUMULATE_F32, "shared");
  run_case(&shape_b, 41, 303, MOK_GRAD_ACCUMULATE_F32, "no shared, k=1, T<max");
}

/* DeepSeek-V3 slice at 1/16 scale (T 256, H 448, I 128, I_s 128, E 32, k 8): timed, with sampled
 * tokens and gradient rows vs ref64. */
static double seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void dsv3_sixteenth(void) {
  const mok_shape s = {256, 448, 128, 128, 32, 8, MOK_BF16, 0};
  harness h;
  if (harness_init(&h, &s, 256, 404, 0)) {
    harness_poison(&h, 0xA5);
    mok_forward_args f = harness_forward_args(&h);
    mok_backward_args b = harness_backward_args(&h, MOK_GRAD_WRITE_BF16);
    const double t0 = seconds();
    CHECK_OK(mok_forward(h.ws, &f, NULL));
    const double t1 = seconds();
    CHECK_OK(mok_backward(h.ws, &b, NULL));
    const double t2 = seconds();
    printf("     dsv3/16: forward %.3f s, backward %.3f s\n", t1 - t0, t2 - t1);
    double e[3];
    check_tokens(&h, 37, "dsv3/16", e);
    printf("     dsv3/16: y %.2e  dx %.2e  d_topk_weights %.2e  grads:", e[0], e[1], e[2]);
    for (int w = 0; w < G_COUNT; w++) {
      double g = check_grad(&h, w, MOK_GRAD_WRITE_BF16, 41, 5);
      printf(" %.2e", g);
      CHECK(g < TOL_GRAD, "dsv3/16: %s rel err %.3g > %.3g", grad_name[w], g, TOL_GRAD);
    }
    printf("\n");
  }
  harness_fini(&h);
}

/* MOK_FP8: 320 tokens on 4 experts, top-2, so that experts hold more than one block of 128 rows
 * and the shared expert three blocks of tokens; H, I, I_s end in partial groups of 128. */
static const mok_shape fp8_shape = {320, 160, 144, 80, 4, 2, MOK_FP8, 0};
static const mok_shape fp8_shape_b = {48, 200, 64, 0, 6, 1, MOK_FP8, 0};

static void fp8_grads_bf16_vs_ref64(void) {
  run_case(&fp8_shape, 320, 212, MOK_GRAD_WRITE_BF16, "fp8");
  run_case(&fp8_shape_b, 48, 213, MOK_GRAD_WRITE_BF16, "fp8, no shared, k=1");
}

static void fp8_grads_f32_vs_ref64(void) {
  run_case(&fp8_shape, 301, 312, MOK_GRAD_ACCUMULATE_F32, "fp8, T<max");
}

/* ref64's columns of the down gradients are its rows' values to the bit, at BF16 and at FP8
 * (whose groups run along the expert's rows either way): `mok run` checks columns, which cost a
 * gate/up column per token where a row costs all of gate/up. 300 tokens: two blocks of 128 rows
 * and a partial one for the shared expert. */
static void ref64_down_columns_are_rows(void) {
  for (int fp8 = 0; fp8 < 2; fp8++) {
    const mok_shape s = {300, 256, 192, 128, 4, 2, fp8 ? MOK_FP8 : MOK_BF16, 0};
    mok_host_layer L;
    if (mok_host_layer_create(&s, 300, 71, &L) != MOK_OK) {
      CHECK(0, "mok_host_layer_create: %s", mok_last_error());
      continue;
    }
    const int64_t H = s.hidden;
    for (int which = MOK_REF_DW_DOWN; which <= MOK_REF_DWS_DOWN; which += 3) {
      const int64_t I = which == MOK_REF_DW_DOWN ? s.inter : s.shared_inter;
      const int64_t e = which == MOK_REF_DW_DOWN ? 2 : 0, hs[4] = {0, 1, 130, H - 1};
      double row[4][192], col[3][256];
      const int64_t cols[3] = {0, 77, I - 1};
      for (int c = 0; c < 3; c++) mok_ref64_down_col(&L, (mok_ref_grad)which, e, cols[c], col[c]);
      for (int r = 0; r < 4; r++) {
        mok_ref64_grad_row(&L, (mok_ref_grad)which, e, hs[r], row[r]);
        for (int c = 0; c < 3; c++)
          CHECK(col[c][hs[r]] == row[r][cols[c]],
                "%s %s [%lld][%lld]: column gives %.17g, row %.17g", fp8 ? "fp8" : "bf16",
                which == MOK_REF_DW_DOWN ? "dw_down" : "dws_down", (long long)hs[r],
                (long long)cols[c], col[c][hs[r]], row[r][cols[c]]);
      }
    }
    mok_host_layer_destroy(&L);
  }
}

const test_case tests_numerics[] = {
    {"cpu/forward_vs_ref64", forward_vs_ref64},
    {"cpu/grads_bf16_vs_ref64", grads_bf16_vs_ref64},
    {"cpu/grads_f32_vs_ref64", grads_f32_vs_ref64},
    {"cpu/dsv3_sixteenth_vs_ref64", dsv3_sixteenth},
    {"cpu/ref64_down_columns_are_rows", ref64_down_columns_are_rows},
    {"fp8/cpu_grads_bf16_vs_ref64", fp8_grads_bf16_vs_ref64},
    {"fp8/cpu_grads_f32_vs_ref64", fp8_grads_f32_vs_ref64},
    {NULL, NULL}};
