/*
 * ref64.c: the float64 recomputation behind ref64.h. Written apart from the CPU backend (it is
 * the check of it): no shared code but the formats themselves (bf16, and fp8.h's e4m3 and scale
 * rule). Every value DESIGN.md §1.1 stores as bf16 (gu, hw, o, dgu, dxr, gus, hs, dgus, y, dx)
 * is rounded to bf16 here, directly from double; every sum and every other value stays in double.
 *
 * At MOK_FP8 (L->shape.precision) every product's operands are replaced by their quantized values
 * as DESIGN §8 says, each quantized from the bf16 value this recomputation holds: the weights'
 * 128 x 128 blocks, x and dy along H per token, hw along I per row, dgate and dup along I each,
 * and for the weight gradients each operand along the expert's rows in blocks of 128 (its rows
 * in canonical order, token then slot; the shared expert's tokens from token 0).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/ref64.h"
#include "fp8.h"

#define G MOK_FP8_GROUP

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

/* ---- FP8 quantization of bf16 values held in double ----------------------------------------- */

/* What v (a bf16 value) stands for once quantized in a group of scale 2^e: v / 2^e is exact in
 * double and, short of underflow, in float, where e4m3 takes it. */
static double q8(double v, int e) {
  const double s = ldexp(1.0, e);
  return (double)mok_e4m3_decode(mok_e4m3_encode((float)(v / s))) * s;
}

/* The scale exponent of n values `stride` apart (bf16 values: their amax is a float). */
static int group_exp(const double *v, int64_t n, int64_t stride) {
  double m = 0.0;
  for (int64_t i = 0; i < n; i++)
    if (fabs(v[i * stride]) > m) m = fabs(v[i * stride]); /* NaN ignored */
  return mok_fp8_scale_exp((float)m);
}

/* One group quantized in place. */
static void q_group(double *v, int64_t n, int64_t stride) {
  const int e = group_exp(v, n, stride);
  for (int64_t i = 0; i < n; i++) v[i * stride] = q8(v[i * stride], e);
}

/* Q_row in place: groups of 128 consecutive values from v[0]. */
static void q_row(double *v, int64_t n) {
  for (int64_t g0 = 0; g0 < n; g0 += G) q_group(v + g0, n - g0 < G ? n - g0 : G, 1);
}

/* A weight tensor [N, K] of bf16, and at MOK_FP8 what its codes stand for (Q_blk), made once per
 * use of the expert (each weight is read by every token the caller runs through it). */
typedef struct ref_w {
  const uint16_t *w;
  int64_t K;
  float *deq; /* [N, K], exact in float; NULL: the bf16 values themselves */
} ref_w;

/* Element (n, k): its bf16 value, or what its e4m3 code stands for. */
static inline double wv(const ref_w *m, int64_t n, int64_t k) {
  return m->deq ? (double)m->deq[n * m->K + k] : bf(m->w[n * m->K + k]);
}

/* w [N, K], dequantized block by block when fp8. Aborts without memory: a checker that cannot
 * answer must not seem to. */
static ref_w ref_w_of(const uint16_t *w, int64_t N, int64_t K, int fp8) {
  ref_w m = {w, K, NULL};
  if (!fp8) return m;
  m.deq = malloc((size_t)(N * K) * sizeof(float));
  if (!m.deq) abort();
  double *blk = malloc(G * G * sizeof(double));
  if (!blk) abort();
  for (int64_t n0 = 0; n0 < N; n0 += G)
    for (int64_t k0 = 0; k0 < K; k0 += G) {
      const int64_t rows = N - n0 < G ? N - n0 : G, cols = K - k0 < G ? K - k0 : G;
      for (int64_t n = 0; n < rows; n++)
        for (int64_t k = 0; k < cols; k++) blk[n * cols + k] = bf(w[(n0 + n) * K + k0 + k]);
      q_group(blk, rows * cols, 1); /* one group: the whole block */
      for (int64_t n = 0; n < rows; n++)
        for (int64_t k = 0; k < cols; k++) m.deq[(n0 + n) * K + k0 + k] = (float)blk[n * cols + k];
    }
  free(blk);
  return m;
}

/* One expert: gate/up [I, H], down [H, I]. */
typedef struct ref_expert {
  ref_w wg, wu, wd;
  int64_t H, I;
  int fp8;
} ref_expert;

static void expert_free(ref_expert *ex) {
  free(ex->wg.deq), free(ex->wu.deq), free(ex->wd.deq);
}

/* sum_h a[h] * W[row, h] over the n columns of W. */
static double dot_w(const double *a, const ref_w *m, int64_t row, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; i++) s += a[i] * wv(m, row, i);
  return s;
}

/* dh[i] = sum_h dy[h] W_down[h, i], for one column i. */
static double down_col(const ref_expert *ex, const double *dy, int64_t i) {
  double dh = 0.0;
  for (int64_t h = 0; h < ex->H; h++) dh += dy[h] * wv(&ex->wd, h, i);
  return dh;
}

/* Rows in parallel when called alone (a weight-gradient row of a down projection needs every g, u
 * of each of its tokens: the checker's longest step); inside a parallel region it runs serially.
 * Each value is one thread's dot product, so the result does not depend on the split. */
static void gate_up(const ref_expert *ex, const double *x, double *g, double *u) {
  #pragma omp parallel for schedule(static) if (ex->I * ex->H >= (1 << 20))
  for (int64_t i = 0; i < ex->I; i++) {
    g[i] = rbf16(dot_w(x, &ex->wg, i, ex->H));
    u[i] = rbf16(dot_w(x, &ex->wu, i, ex->H));
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
    const double dh = down_col(ex, dy, i);
    dtw += dh * silu(g[i]) * u[i];
    swiglu_grad(dh, g[i], u[i], w, &dg[i], &du[i]);
  }
  return dtw;
}

/* Scratch for one token: 5 vectors of max(I, I_s) and 4 of H. */
typedef struct ref_buf {
  double *x, *dy, *acc_y, *acc_dx, *g, *u, *hw, *dg, *du;
} ref_buf;

static void buf_init(ref_buf *b, int64_t H, int64_t Im) {
  double *p = malloc((size_t)(4 * H + 5 * Im) * sizeof(double));
  if (!p) abort();
  b->x = p, b->dy = p + H, b->acc_y = p + 2 * H, b->acc_dx = p + 3 * H;
  b->g = p + 4 * H, b->u = b->g + Im, b->hw = b->u + Im, b->dg = b->hw + Im, b->du = b->dg + Im;
}

/* x and dy of token t into b: their bf16 values, or at fp8 their Q_row along H. */
static void load_token(const mok_host_layer *L, int64_t t, int fp8, double *x, double *dy) {
  const int64_t H = L->shape.hidden;
  for (int64_t h = 0; h < H; h++) {
    x[h] = bf(L->x[t * H + h]);
    dy[h] = bf(L->dy[t * H + h]);
  }
  if (fp8) q_row(x, H), q_row(dy, H);
}

/* Adds one expert's contribution for token (x, dy) to the y and dx accumulators: o rounded to
 * bf16 per slot for routed experts (round_rows = 1), unrounded for the shared one. */
static double add_expert(const ref_expert *ex, ref_buf *b, double w, int round_rows) {
  const int64_t H = ex->H, I = ex->I;
  gate_up(ex, b->x, b->g, b->u);
  for (int64_t i = 0; i < I; i++) b->hw[i] = rbf16(w * silu(b->g[i]) * b->u[i]);
  if (ex->fp8) q_row(b->hw, I);
  for (int64_t h = 0; h < H; h++) {
    double o = 0.0;
    for (int64_t i = 0; i < I; i++) o += b->hw[i] * wv(&ex->wd, h, i);
    b->acc_y[h] += round_rows ? rbf16(o) : o;
  }
  double dtw = swiglu_back(ex, b->dy, b->g, b->u, w, b->dg, b->du);
  if (ex->fp8) q_row(b->dg, I), q_row(b->du, I);
  for (int64_t h = 0; h < H; h++) {
    double dx = 0.0;
    for (int64_t i = 0; i < I; i++) dx += b->dg[i] * wv(&ex->wg, i, h) + b->du[i] * wv(&ex->wu, i, h);
    b->acc_dx[h] += round_rows ? rbf16(dx) : dx;
  }
  return dtw;
}

static ref_expert routed(const mok_host_layer *L, int64_t e) {
  const int64_t H = L->shape.hidden, I = L->shape.inter;
  const int fp8 = L->shape.precision == MOK_FP8;
  ref_expert r = {ref_w_of(L->w_gate + e * I * H, I, H, fp8),
                  ref_w_of(L->w_up + e * I * H, I, H, fp8),
                  ref_w_of(L->w_down + e * H * I, H, I, fp8), H, I, fp8};
  return r;
}

static ref_expert shared(const mok_host_layer *L) {
  const int64_t H = L->shape.hidden, Is = L->shape.shared_inter;
  const int fp8 = L->shape.precision == MOK_FP8;
  ref_expert r = {ref_w_of(L->ws_gate, Is, H, fp8), ref_w_of(L->ws_up, Is, H, fp8),
                  ref_w_of(L->ws_down, H, Is, fp8), H, Is, fp8};
  return r;
}

void mok_ref64_token(const mok_host_layer *L, int64_t t, double *y, double *dx,
                     double *d_topk_weights) {
  const int64_t H = L->shape.hidden, I = L->shape.inter, Is = L->shape.shared_inter;
  const int64_t k = L->shape.top_k;
  ref_buf b;
  buf_init(&b, H, I > Is ? I : Is);
  load_token(L, t, L->shape.precision == MOK_FP8, b.x, b.dy);
  for (int64_t h = 0; h < H; h++) b.acc_y[h] = b.acc_dx[h] = 0.0;
  if (Is > 0) {
    ref_expert s = shared(L);
    add_expert(&s, &b, 1.0, 0);
    expert_free(&s);
  }
  for (int64_t j = 0; j < k; j++) {
    ref_expert r = routed(L, L->topk_ids[t * k + j]);
    double dtw = add_expert(&r, &b, (double)L->topk_weights[t * k + j], 1);
    expert_free(&r);
    if (d_topk_weights) d_topk_weights[j] = dtw;
  }
  for (int64_t h = 0; h < H; h++) {
    if (y) y[h] = rbf16(b.acc_y[h]);
    if (dx) dx[h] = rbf16(b.acc_dx[h]);
  }
  free(b.x);
}

/* A weight-gradient row sums a_r * v_r[0..len) over the expert's rows r in canonical order. One
 * row's terms: for a down row h, a = dy_r[h] and v = hw_r; for a gate (up) row i, a = dgate_r[i]
 * (dup_r[i]) and v = x_r. At fp8 both are quantized along the rows afterwards, by the caller. */
static double grad_term(const ref_expert *ex, mok_ref_grad which, int64_t row,
                        const mok_host_layer *L, int64_t t, double w, ref_buf *b, double *v) {
  const int64_t H = ex->H, I = ex->I;
  load_token(L, t, ex->fp8, b->x, b->dy); /* the products' operands */
  if (which == MOK_REF_DW_DOWN || which == MOK_REF_DWS_DOWN) {
    gate_up(ex, b->x, b->g, b->u);
    for (int64_t i = 0; i < I; i++) v[i] = rbf16(w * silu(b->g[i]) * b->u[i]);
    return bf(L->dy[t * H + row]);
  }
  const double g = rbf16(dot_w(b->x, &ex->wg, row, H));
  const double u = rbf16(dot_w(b->x, &ex->wu, row, H));
  double dg, du;
  swiglu_grad(down_col(ex, b->dy, row), g, u, w, &dg, &du);
  for (int64_t h = 0; h < H; h++) v[h] = bf(L->x[t * H + h]);
  return which == MOK_REF_DW_GATE || which == MOK_REF_DWS_GATE ? dg : du;
}

void mok_ref64_grad_row(const mok_host_layer *L, mok_ref_grad which, int64_t e, int64_t row,
                        double *out) {
  const int64_t H = L->shape.hidden, I = L->shape.inter, Is = L->shape.shared_inter;
  const int64_t k = L->shape.top_k, T = L->tokens;
  const int is_shared = which >= MOK_REF_DWS_GATE;
  ref_expert ex = is_shared ? shared(L) : routed(L, e);
  const int64_t len = (which == MOK_REF_DW_DOWN || which == MOK_REF_DWS_DOWN) ? ex.I : H;
  for (int64_t i = 0; i < len; i++) out[i] = 0.0;
  ref_buf b;
  buf_init(&b, H, I > Is ? I : Is);
  /* One block of up to 128 of the expert's rows at a time: its a and v, quantized along the
   * block's rows at fp8 (each column its own group), then summed in row order. */
  double *a = malloc(G * sizeof(double)), *v = malloc((size_t)(G * len) * sizeof(double));
  if (!a || !v) abort();
  int64_t n = 0; /* rows in the block */
  for (int64_t q = 0; q <= T * k; q++) {
    const int last = q == T * k;
    if (!last) {
      const int64_t t = q / k, j = q % k;
      if (is_shared ? j != 0 : L->topk_ids[q] != e) continue;
      const double w = is_shared ? 1.0 : (double)L->topk_weights[q];
      a[n] = grad_term(&ex, which, row, L, t, w, &b, v + n * len);
      n++;
    }
    if (n < G && !last) continue;
    if (ex.fp8 && n > 0) {
      q_group(a, n, 1);
      for (int64_t i = 0; i < len; i++) q_group(v + i, n, len);
    }
    for (int64_t r = 0; r < n; r++)
      for (int64_t i = 0; i < len; i++) out[i] += a[r] * v[r * len + i];
    n = 0;
  }
  free(a), free(v), free(b.x);
  expert_free(&ex);
}

/* A down gradient's column: the row version's terms a_r * v_r[col] for every row h at once, in
 * the same order and, at fp8, quantized in the same groups (v_r[col] over the block's rows, a
 * over the block's rows for each h), so every value is the row version's to the bit. */
void mok_ref64_down_col(const mok_host_layer *L, mok_ref_grad which, int64_t e, int64_t col,
                        double *out) {
  const int64_t H = L->shape.hidden, I = L->shape.inter, Is = L->shape.shared_inter;
  const int64_t k = L->shape.top_k, T = L->tokens;
  const int is_shared = which == MOK_REF_DWS_DOWN;
  ref_expert ex = is_shared ? shared(L) : routed(L, e);
  for (int64_t h = 0; h < H; h++) out[h] = 0.0;
  ref_buf b;
  buf_init(&b, H, I > Is ? I : Is);
  double *a = malloc((size_t)(G * H) * sizeof(double)), v[G]; /* a[r * H + h] = dy_r[h] */
  if (!a) abort();
  int64_t n = 0;
  for (int64_t q = 0; q <= T * k; q++) {
    const int last = q == T * k;
    if (!last) {
      const int64_t t = q / k, j = q % k;
      if (is_shared ? j != 0 : L->topk_ids[q] != e) continue;
      const double w = is_shared ? 1.0 : (double)L->topk_weights[q];
      load_token(L, t, ex.fp8, b.x, b.dy);
      const double g = rbf16(dot_w(b.x, &ex.wg, col, H)), u = rbf16(dot_w(b.x, &ex.wu, col, H));
      v[n] = rbf16(w * silu(g) * u);
      for (int64_t h = 0; h < H; h++) a[n * H + h] = bf(L->dy[t * H + h]);
      n++;
    }
    if (n < G && !last) continue;
    if (ex.fp8 && n > 0) {
      q_group(v, n, 1);
      for (int64_t h = 0; h < H; h++) q_group(a + h, n, H);
    }
    for (int64_t r = 0; r < n; r++)
      for (int64_t h = 0; h < H; h++) out[h] += a[r * H + h] * v[r];
    n = 0;
  }
  free(a), free(b.x);
  expert_free(&ex);
}
