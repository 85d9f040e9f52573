/*
 * ref64.c: the float64 recomputation behind ref64.h. Written apart from the CPU backend (it is
 * the check of it): no shared code but the bf16 format itself. Every value DESIGN.md §1.1 stores
 * as bf16 (gu, hw, o, dgu, dxr, gus, hs, dgus, y, dx) is rounded to bf16 here, directly from
 * double; every sum and every other value stays in double.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/ref64.h"

/* Round-to-nearest-even of a double to the nearest bf16 value (8 significant bits, exponent
 * range of fp32, subnormals down to 2^-133), in one step: no double rounding through fp32. */
static double rbf16(double v) {
  if (!isfinite(v) || v == 0.0) return v;
  int ex;
  frexp(v, &ex);                    /* |v| in [2^(ex-1), 2^ex) */
  int q = ex - 8;                   /* exponent of the last kept bit */
  if (q < -133) q = -133;           /* bf16 subnormal spacing */
  double r = ldexp(nearbyint(ldexp(v, -q)), q); /* exact scaling; nearbyint rounds to even */
  if (fabs(r) >= 0x1p128) return copysign(INFINITY, v);
  return r;
}

static double bf(uint16_t b) { /* bf16 bits -> value */
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return (double)f;
}

static double silu(double z) { return z / (1.0 + exp(-z)); }
static double sigm(double z) { return 1.0 / (1.0 + exp(-z)); }

/* sum_h a[h] * W[h] over n bf16 weights. */
static double dot_bf(const double *a, const uint16_t *w, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; i++) s += a[i] * bf(w[i]);
  return s;
}

/* One expert (gate/up [I, H], down [H, I]) on one token: the saved g, u (bf16-rounded), and
 * optionally hw and the expert's weighted output o (bf16-rounded, [H]). */
typedef struct ref_expert {
  const uint16_t *wg, *wu, *wd;
  int64_t H, I;
} ref_expert;

/* Rows in parallel when called alone (a weight-gradient row of a down projection needs every g, u
 * of each of its tokens: the checker's longest step); inside a parallel region it runs serially.
 * Each value is one thread's dot product, so the result does not depend on the split. */
static void gate_up(const ref_expert *ex, const double *x, double *g, double *u) {
  #pragma omp parallel for schedule(static) if (ex->I * ex->H >= (1 << 20))
  for (int64_t i = 0; i < ex->I; i++) {
    g[i] = rbf16(dot_bf(x, ex->wg + i * ex->H, ex->H));
    u[i] = rbf16(dot_bf(x, ex->wu + i * ex->H, ex->H));
  }
}

/* SwiGLU backward of one column: d = w dh, s = sigmoid(g); dg, du rounded to bf16 (dgu). */
static void swiglu_grad(double dh, double g, double u, double w, double *dg, double *du) {
  double s = sigm(g), d = w * dh;
  *dg = rbf16(d * u * s * (1.0 + g * (1.0 - s)));
  *du = rbf16(d * g * s);
}

/* Backward of one row: dh, the router gradient <dh, silu(g) u>, and bf16 dg, du. */
static double swiglu_back(const ref_expert *ex, const double *dy, const double *g,
                          const double *u, double w, double *dg, double *du) {
  double dtw = 0.0;
  for (int64_t i = 0; i < ex->I; i++) {
    double dh = 0.0;
    for (int64_t h = 0; h < ex->H; h++) dh += dy[h] * bf(ex->wd[h * ex->I + i]);
    dtw += dh * silu(g[i]) * u[i];
    swiglu_grad(dh, g[i], u[i], w, &dg[i], &du[i]);
  }
  return dtw;
}

/* Scratch for one token: 6 vectors of max(I, I_s) and 3 of H. */
typedef struct ref_buf {
  double *x, *dy, *acc_y, *acc_dx, *g, *u, *hw, *dg, *du;
} ref_buf;

static int buf_init(ref_buf *b, int64_t H, int64_t Im) {
  double *p = malloc((size_t)(4 * H + 5 * Im) * sizeof(double));
  if (!p) return 0;
  b->x = p, b->dy = p + H, b->acc_y = p + 2 * H, b->acc_dx = p + 3 * H;
  b->g = p + 4 * H, b->u = b->g + Im, b->hw = b->u + Im, b->dg = b->hw + Im, b->du = b->dg + Im;
  return 1;
}

/* Adds one expert's contribution for token (x, dy) to the y and dx accumulators: o rounded to
 * bf16 per slot for routed experts (round_rows = 1), unrounded for the shared one. */
static double add_expert(const ref_expert *ex, ref_buf *b, double w, int round_rows) {
  const int64_t H = ex->H, I = ex->I;
  gate_up(ex, b->x, b->g, b->u);
  for (int64_t i = 0; i < I; i++) b->hw[i] = rbf16(w * silu(b->g[i]) * b->u[i]);
  for (int64_t h = 0; h < H; h++) {
    double o = 0.0;
    for (int64_t i = 0; i < I; i++) o += b->hw[i] * bf(ex->wd[h * I + i]);
    b->acc_y[h] += round_rows ? rbf16(o) : o;
  }
  double dtw = swiglu_back(ex, b->dy, b->g, b->u, w, b->dg, b->du);
  for (int64_t h = 0; h < H; h++) {
    double dx = 0.0;
    for (int64_t i = 0; i < I; i++)
      dx += b->dg[i] * bf(ex->wg[i * H + h]) + b->du[i] * bf(ex->wu[i * H + h]);
    b->acc_dx[h] += round_rows ? rbf16(dx) : dx;
  }
  return dtw;
}

static ref_expert routed(const mok_host_layer *L, int64_t e) {
  const int64_t H = L->shape.hidden, I = L->shape.inter;
  ref_expert r = {L->w_gate + e * I * H, L->w_up + e * I * H, L->w_down + e * H * I, H, I};
  return r;
}

static ref_expert shared(const mok_host_layer *L) {
  ref_expert r = {L->ws_gate, L->ws_up, L->ws_down, L->shape.hidden, L->shape.shared_inter};
  return r;
}

void mok_ref64_token(const mok_host_layer *L, int64_t t, double *y, double *dx,
                     double *d_topk_weights) {
  const int64_t H = L->shape.hidden, I = L->shape.inter, Is = L->shape.shared_inter;
  const int64_t k = L->shape.top_k;
  ref_buf b;
  if (!buf_init(&b, H, I > Is ? I : Is)) abort(); /* a checker without memory cannot answer */
  for (int64_t h = 0; h < H; h++) {
    b.x[h] = bf(L->x[t * H + h]);
    b.dy[h] = bf(L->dy[t * H + h]);
    b.acc_y[h] = b.acc_dx[h] = 0.0;
  }
  if (Is > 0) {
    ref_expert s = shared(L);
    add_expert(&s, &b, 1.0, 0);
  }
  for (int64_t j = 0; j < k; j++) {
    ref_expert r = routed(L, L->topk_ids[t * k + j]);
    double dtw = add_expert(&r, &b, (double)L->topk_weights[t * k + j], 1);
    if (d_topk_weights) d_topk_weights[j] = dtw;
  }
  for (int64_t h = 0; h < H; h++) {
    if (y) y[h] = rbf16(b.acc_y[h]);
    if (dx) dx[h] = rbf16(b.acc_dx[h]);
  }
  free(b.x);
}

/* Adds one routed row's (or shared token's) term to a gradient row. A gate/up row i needs only
 * g_i, u_i and dh_i of the row; a down row needs all of hw. */
static void add_grad_term(const ref_expert *ex, mok_ref_grad which, int64_t row, ref_buf *b,
                          double w, double *out) {
  const int64_t H = ex->H, I = ex->I;
  if (which == MOK_REF_DW_DOWN || which == MOK_REF_DWS_DOWN) {
    gate_up(ex, b->x, b->g, b->u);
    for (int64_t i = 0; i < I; i++) out[i] += b->dy[row] * rbf16(w * silu(b->g[i]) * b->u[i]);
    return;
  }
  const double g = rbf16(dot_bf(b->x, ex->wg + row * H, H));
  const double u = rbf16(dot_bf(b->x, ex->wu + row * H, H));
  double dh = 0.0;
  for (int64_t h = 0; h < H; h++) dh += b->dy[h] * bf(ex->wd[h * I + row]);
  double dg, du;
  swiglu_grad(dh, g, u, w, &dg, &du);
  const double dgu = (which == MOK_REF_DW_GATE || which == MOK_REF_DWS_GATE) ? dg : du;
  for (int64_t h = 0; h < H; h++) out[h] += dgu * b->x[h];
}

void mok_ref64_grad_row(const mok_host_layer *L, mok_ref_grad which, int64_t e, int64_t row,
                        double *out) {
  const int64_t H = L->shape.hidden, I = L->shape.inter, Is = L->shape.shared_inter;
  const int64_t k = L->shape.top_k, T = L->tokens;
  const int is_shared = which >= MOK_REF_DWS_GATE;
  const ref_expert ex = is_shared ? shared(L) : routed(L, e);
  const int64_t len = (which == MOK_REF_DW_DOWN || which == MOK_REF_DWS_DOWN) ? ex.I : H;
  for (int64_t i = 0; i < len; i++) out[i] = 0.0;
  ref_buf b;
  if (!buf_init(&b, H, I > Is ? I : Is)) abort();
  for (int64_t t = 0; t < T; t++) {
    for (int64_t j = 0; j < (is_shared ? 1 : k); j++) {
      if (!is_shared && L->topk_ids[t * k + j] != e) continue;
      for (int64_t h = 0; h < H; h++) {
        b.x[h] = bf(L->x[t * H + h]);
        b.dy[h] = bf(L->dy[t * H + h]);
      }
      double w = is_shared ? 1.0 : (double)L->topk_weights[t * k + j];
      add_grad_term(&ex, which, row, &b, w, out);
    }
  }
  free(b.x);
}
