/*
 * test_gradcheck.c: checks the backward formulas of DESIGN.md §1.1 themselves. A small
 * double-precision layer with no rounding at all is written here (apart from the backend and
 * ref64); its analytic gradients, computed with the formulas of the backward table, must match
 * central finite differences of the loss sum(dy * y) for x, topk_weights and entries of all six
 * weight tensors. Then the CPU backend's gradients must match that analytic gradient to bf16-level
 * error, which ties the backend to formulas proven right rather than to ref64 alone.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "check.h"
#include "harness.h"

typedef struct dlayer {
  int64_t T, H, I, Is, k;
  const int32_t *ids;
  double *x, *dy, *tw;          /* [T, H], [T, H], [T, k] */
  double *w[G_COUNT];           /* as mok_host_layer: gate, up, down, shared gate, up, down */
  int64_t len[G_COUNT];
} dlayer;

static double silu(double z) { return z / (1.0 + exp(-z)); }
static double sigm(double z) { return 1.0 / (1.0 + exp(-z)); }

static double *to_double(const uint16_t *b, int64_t n) {
  double *d = malloc((size_t)(n ? n : 1) * sizeof *d);
  for (int64_t i = 0; i < n; i++) d[i] = mok_bf16_to_f32(b[i]);
  return d;
}

static void dlayer_init(dlayer *d, const mok_host_layer *L) {
  const mok_shape *s = &L->shape;
  d->T = L->tokens, d->H = s->hidden, d->I = s->inter, d->Is = s->shared_inter, d->k = s->top_k;
  d->ids = L->topk_ids;
  d->x = to_double(L->x, d->T * d->H);
  d->dy = to_double(L->dy, d->T * d->H);
  d->tw = malloc((size_t)(d->T * d->k) * sizeof(double));
  for (int64_t i = 0; i < d->T * d->k; i++) d->tw[i] = L->topk_weights[i];
  const int64_t E = s->experts, H = d->H, I = d->I, Is = d->Is;
  const uint16_t *src[G_COUNT] = {L->w_gate, L->w_up, L->w_down, L->ws_gate, L->ws_up, L->ws_down};
  const int64_t len[G_COUNT] = {E * I * H, E * I * H, E * H * I, Is * H, Is * H, H * Is};
  for (int g = 0; g < G_COUNT; g++) d->len[g] = len[g], d->w[g] = to_double(src[g], len[g]);
}

static void dlayer_fini(dlayer *d) {
  free(d->x), free(d->dy), free(d->tw);
  for (int g = 0; g < G_COUNT; g++) free(d->w[g]);
}

/* One expert (gate/up [I, H], down [H, I]) on one token, all in double. */
typedef struct mlp {
  const double *wg, *wu, *wd;
  int64_t H, I;
} mlp;

static mlp expert_of(const dlayer *d, int64_t e) {
  mlp m = {d->w[G_GATE] + e * d->I * d->H, d->w[G_UP] + e * d->I * d->H,
           d->w[G_DOWN] + e * d->H * d->I, d->H, d->I};
  return m;
}

static mlp shared_of(const dlayer *d) {
  mlp m = {d->w[GS_GATE], d->w[GS_UP], d->w[GS_DOWN], d->H, d->Is};
  return m;
}

static double pre(const double *w, const double *x, int64_t H) {
  double s = 0.0;
  for (int64_t h = 0; h < H; h++) s += w[h] * x[h];
  return s;
}

/* <dy, w * expert(x)>: this token's and expert's share of the loss. */
static double mlp_loss(const mlp *m, const double *x, const double *dy, double w) {
  double l = 0.0;
  for (int64_t i = 0; i < m->I; i++) {
    double a = silu(pre(m->wg + i * m->H, x, m->H)) * pre(m->wu + i * m->H, x, m->H);
    for (int64_t h = 0; h < m->H; h++) l += dy[h] * m->wd[h * m->I + i] * w * a;
  }
  return l;
}

static double loss(const dlayer *d) {
  double l = 0.0;
  for (int64_t t = 0; t < d->T; t++) {
    const double *x = d->x + t * d->H, *dy = d->dy + t * d->H;
    if (d->Is) {
      mlp s = shared_of(d);
      l += mlp_loss(&s, x, dy, 1.0);
    }
    for (int64_t j = 0; j < d->k; j++) {
      mlp m = expert_of(d, d->ids[t * d->k + j]);
      l += mlp_loss(&m, x, dy, d->tw[t * d->k + j]);
    }
  }
  return l;
}

/* The backward table of §1.1 without rounding: adds into dx and the expert's three weight grads
 * (dwg, dwu at the expert's [I, H], dwd at its [H, I]); returns d_topk_weights. */
static double mlp_backward(const mlp *m, const double *x, const double *dy, double w, double *dx,
                           double *dwg, double *dwu, double *dwd) {
  double dtw = 0.0;
  for (int64_t i = 0; i < m->I; i++) {
    const double g = pre(m->wg + i * m->H, x, m->H), u = pre(m->wu + i * m->H, x, m->H);
    double dh = 0.0;
    for (int64_t h = 0; h < m->H; h++) dh += dy[h] * m->wd[h * m->I + i];
    dtw += dh * silu(g) * u;
    const double d = w * dh, s = sigm(g);
    const double dg = d * u * s * (1.0 + g * (1.0 - s)), du = d * g * s;
    const double hw = w * silu(g) * u;
    for (int64_t h = 0; h < m->H; h++) {
      dx[h] += dg * m->wg[i * m->H + h] + du * m->wu[i * m->H + h];
      dwg[i * m->H + h] += dg * x[h];
      dwu[i * m->H + h] += du * x[h];
      dwd[h * m->I + i] += dy[h] * hw;
    }
  }
  return dtw;
}

/* Analytic gradients: dx [T, H], dtw [T, k], dw[g] like d->w[g]; all zeroed first. */
static void backward(const dlayer *d, double *dx, double *dtw, double *dw[G_COUNT]) {
  const int64_t H = d->H, I = d->I;
  for (int64_t i = 0; i < d->T * H; i++) dx[i] = 0.0;
  for (int g = 0; g < G_COUNT; g++)
    for (int64_t i = 0; i < d->len[g]; i++) dw[g][i] = 0.0;
  for (int64_t t = 0; t < d->T; t++) {
    const double *x = d->x + t * H, *dy = d->dy + t * H;
    if (d->Is) {
      mlp s = shared_of(d);
      mlp_backward(&s, x, dy, 1.0, dx + t * H, dw[GS_GATE], dw[GS_UP], dw[GS_DOWN]);
    }
    for (int64_t j = 0; j < d->k; j++) {
      const int64_t e = d->ids[t * d->k + j];
      mlp m = expert_of(d, e);
      dtw[t * d->k + j] = mlp_backward(&m, x, dy, d->tw[t * d->k + j], dx + t * H,
                                       dw[G_GATE] + e * I * H, dw[G_UP] + e * I * H,
                                       dw[G_DOWN] + e * H * I);
    }
  }
}

/* Central difference of the loss in *p, compared with the analytic value. */
static void check_fd(dlayer *d, double *p, double analytic, const char *what, int64_t i,
                     double *worst) {
  const double h = 1e-5 * fmax(1.0, fabs(*p)), keep = *p;
  *p = keep + h;
  const double lp = loss(d);
  *p = keep - h;
  const double lm = loss(d);
  *p = keep;
  const double fd = (lp - lm) / (2.0 * h);
  const double err = fabs(fd - analytic) / fmax(1e-3, fabs(analytic));
  if (err > *worst) *worst = err;
  CHECK(err < 1e-6, "%s[%lld]: finite difference %.9g, analytic %.9g (rel %.2g)", what,
        (long long)i, fd, analytic, err);
}

static const char *grad_name[G_COUNT] = {"w_gate", "w_up", "w_down", "ws_gate", "ws_up",
                                         "ws_down"};

static void finite_differences(void) {
  const mok_shape s = {4, 16, 8, 6, 4, 2, MOK_BF16, 0};
  mok_host_layer L;
  CHECK_OK(mok_host_layer_create(&s, 4, 4242, &L));
  dlayer d;
  dlayer_init(&d, &L);
  double *dx = malloc((size_t)(d.T * d.H) * sizeof *dx);
  double *dtw = malloc((size_t)(d.T * d.k) * sizeof *dtw);
  double *dw[G_COUNT];
  for (int g = 0; g < G_COUNT; g++) dw[g] = malloc((size_t)(d.len[g] + 1) * sizeof(double));
  backward(&d, dx, dtw, dw);

  double worst = 0.0;
  for (int64_t i = 0; i < d.T * d.H; i++) check_fd(&d, &d.x[i], dx[i], "x", i, &worst);
  for (int64_t i = 0; i < d.T * d.k; i++) check_fd(&d, &d.tw[i], dtw[i], "topk_weights", i, &worst);
  /* Entries of every weight tensor: a stride that visits every expert and several rows. */
  for (int g = 0; g < G_COUNT; g++)
    for (int64_t i = 3; i < d.len[g]; i += 37)
      check_fd(&d, &d.w[g][i], dw[g][i], grad_name[g], i, &worst);
  printf("     finite differences vs analytic: worst rel err %.2e\n", worst);

  for (int g = 0; g < G_COUNT; g++) free(dw[g]);
  free(dx), free(dtw);
  dlayer_fini(&d);
  mok_host_layer_destroy(&L);
}

/* The backend's gradients vs the unrounded analytic ones: bf16 rounding of the intermediates is
 * the only difference (about 1e-3 relative); a wrong formula is off by O(1). */
static void backend_vs_analytic(void) {
  const mok_shape s = {32, 64, 48, 32, 6, 2, MOK_BF16, 0};
  harness h;
  if (harness_init(&h, &s, 32, 777, 0)) {
    harness_poison(&h, 0x5A);
    CHECK_OK(harness_run(&h, MOK_GRAD_WRITE_BF16));
    dlayer d;
    dlayer_init(&d, &h.L);
    double *dx = malloc((size_t)(d.T * d.H) * sizeof *dx);
    double *dtw = malloc((size_t)(d.T * d.k) * sizeof *dtw);
    double *dw[G_COUNT];
    for (int g = 0; g < G_COUNT; g++) dw[g] = malloc((size_t)(d.len[g] + 1) * sizeof(double));
    backward(&d, dx, dtw, dw);
    rel_err e = {0, 0};
    for (int64_t i = 0; i < d.T * d.H; i++) rel_err_add(&e, mok_bf16_to_f32(h.dx[i]), dx[i]);
    printf("     backend vs analytic: dx %.2e", rel_err_value(&e));
    CHECK(rel_err_value(&e) < 1e-2, "dx rel err %.3g", rel_err_value(&e));
    e = (rel_err){0, 0};
    for (int64_t i = 0; i < d.T * d.k; i++) rel_err_add(&e, h.dtw[i], dtw[i]);
    printf(" d_topk_weights %.2e", rel_err_value(&e));
    CHECK(rel_err_value(&e) < 1e-2, "d_topk_weights rel err %.3g", rel_err_value(&e));
    for (int g = 0; g < G_COUNT; g++) {
      e = (rel_err){0, 0};
      for (int64_t i = 0; i < d.len[g]; i++)
        rel_err_add(&e, mok_bf16_to_f32(((const uint16_t *)h.g[g])[i]), dw[g][i]);
      printf(" d%s %.2e", grad_name[g], rel_err_value(&e));
      CHECK(rel_err_value(&e) < 1e-2, "d%s rel err %.3g", grad_name[g], rel_err_value(&e));
    }
    printf("\n");
    for (int g = 0; g < G_COUNT; g++) free(dw[g]);
    free(dx), free(dtw);
    dlayer_fini(&d);
  }
  harness_fini(&h);
}

const test_case tests_gradcheck[] = {
    {"cpu/gradcheck_finite_differences", finite_differences},
    {"cpu/gradcheck_backend_vs_analytic", backend_vs_analytic},
    {NULL, NULL}};
