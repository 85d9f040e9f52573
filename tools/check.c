/*
 * check.c: `mok run`'s comparison of the downloaded outputs with the float64 recomputation of
 * src/cpu/ref64.h, on a sample: --check-tokens tokens spread over the batch (their rows of y and
 * dx and their d_topk_weights) and, for each weight gradient, rows at seeded pseudo-random
 * (expert, row) places. Per tensor it reports ||got - ref|| / ||ref|| (L2 over the sampled
 * values) and the largest |got - ref|. The float64 rows are computed in parallel and compared in
 * a fixed order, so the table does not depend on the thread count.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/ref64.h"
#include "layer.h"

typedef struct error_sum {
  double err2, ref2, max_abs; /* sums of squares; largest |got - ref| */
} error_sum;

static double value_at(const tool_tensor *t, int64_t i) {
  if (t->elem == 2) return mok_bf16_to_f32(((const uint16_t *)t->host)[i]);
  return ((const float *)t->host)[i];
}

/* got[off .. off+n) against ref[0 .. n). */
static void add_errors(error_sum *e, const tool_tensor *t, int64_t off, const double *ref,
                       int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    double d = value_at(t, off + i) - ref[i];
    if (!(fabs(d) <= e->max_abs)) e->max_abs = fabs(d); /* keeps a NaN */
    e->err2 += d * d;
    e->ref2 += ref[i] * ref[i];
  }
}

/* Prints one row of the table; returns 1 if the tensor fails. */
static int report(const char *name, int64_t n, const char *what, const error_sum *e, double tol) {
  if (n == 0) return 0;
  double rel = e->ref2 > 0 ? sqrt(e->err2 / e->ref2) : e->err2 == 0 ? 0.0 : INFINITY;
  int bad = !(rel <= tol);
  char sampled[32];
  snprintf(sampled, sizeof sampled, "%lld %s", (long long)n, what);
  printf("  %-15s %-12s %10.2e %10.2e   %s\n", name, sampled, rel, e->max_abs,
         bad ? "FAIL" : "ok");
  return bad;
}

/* i-th of n samples spread over 0..count-1, first and last included. */
static int64_t spread(int64_t i, int64_t n, int64_t count) {
  return n <= 1 ? 0 : i * (count - 1) / (n - 1);
}

/* One weight gradient: which ref64 row, which output, and its shape. */
typedef struct grad_rows {
  mok_ref_grad which;
  tool_output out;
  int64_t experts, rows, width, inter; /* inter: the expert's I (I_s for the shared one) */
} grad_rows;

/* Sample i of gradient g: a pseudo-random (expert, row) from splitmix64 of seed, g and i. */
static void pick(uint64_t seed, int g, int64_t i, const grad_rows *gr, int64_t *e, int64_t *row) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (uint64_t)(1 + 1000 * g + i);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  *e = (int64_t)(z % (uint64_t)gr->experts);
  *row = (int64_t)((z >> 20) % (uint64_t)gr->rows);
}

/* Multiply-adds of ref64's recomputation of one gradient row: each token through the expert
 * recomputes its gate/up and SwiGLU backward, about 3 * I * H. */
static double row_cost(const tool_layer *L, const grad_rows *g, int64_t e) {
  const mok_shape *s = &L->o->shape;
  int64_t tokens = s->max_tokens;
  if (g->experts > 1) {
    tokens = 0;
    for (int64_t r = 0; r < s->max_tokens * s->top_k; r++) tokens += L->in.topk_ids[r] == e;
  }
  return 3.0 * (double)tokens * (double)g->inter * (double)s->hidden;
}

/* Rows per gradient, nr[g]: --check-rows, or by default as many of CLI_CHECK_ROWS as
 * CLI_CHECK_BUDGET allows, taken in rounds over the gradients (each keeps at least one).
 * Returns the estimated multiply-adds. */
static double plan_rows(const tool_layer *L, const grad_rows *grads, int ngrads, int64_t *nr) {
  const int fixed = L->o->check_rows != CLI_DEFAULT;
  const int64_t max_rows = fixed ? L->o->check_rows : CLI_CHECK_ROWS;
  double work = 0;
  int64_t e, row;
  for (int g = 0; g < ngrads; g++) nr[g] = 0;
  for (int64_t i = 0; i < max_rows; i++)
    for (int g = 0; g < ngrads; g++) {
      if (nr[g] < i) continue; /* stopped by the budget */
      pick(L->o->seed, g, i, &grads[g], &e, &row);
      const double c = row_cost(L, &grads[g], e);
      if (!fixed && i > 0 && work + c > CLI_CHECK_BUDGET) continue;
      nr[g] = i + 1;
      work += c;
    }
  return work;
}

int tool_check_ref(const tool_layer *L) {
  const cli_options *o = L->o;
  const mok_shape *s = &o->shape;
  const int64_t T = s->max_tokens, H = s->hidden, I = s->inter, Is = s->shared_inter;
  const int64_t E = s->experts, k = s->top_k;
  const int64_t nt = o->check_tokens < T ? o->check_tokens : T;
  const grad_rows grads[6] = {
      {MOK_REF_DW_GATE, OUT_DW_GATE, E, I, H, I},    {MOK_REF_DW_UP, OUT_DW_UP, E, I, H, I},
      {MOK_REF_DW_DOWN, OUT_DW_DOWN, E, H, I, I},    {MOK_REF_DWS_GATE, OUT_DWS_GATE, 1, Is, H, Is},
      {MOK_REF_DWS_UP, OUT_DWS_UP, 1, Is, H, Is},    {MOK_REF_DWS_DOWN, OUT_DWS_DOWN, 1, H, Is, Is},
  };
  const int ngrads = Is > 0 ? 6 : 3;
  int64_t nr[6], max_rows = 0, rows_total = 0, wmax = H, e, row;
  const double work = plan_rows(L, grads, ngrads, nr);
  for (int g = 0; g < ngrads; g++) {
    rows_total += nr[g];
    if (nr[g] > max_rows) max_rows = nr[g];
    if (grads[g].width > wmax) wmax = grads[g].width;
  }
  /* tok: per sampled token y[H], dx[H], d_topk_weights[k]; rows: [g][i] gradient rows. */
  double *tok = malloc((size_t)(nt * (2 * H + k) + 1) * sizeof(double));
  double *rows = malloc((size_t)(ngrads * max_rows * wmax + 1) * sizeof(double));
  if (!tok || !rows) {
    free(tok);
    free(rows);
    tool_error("no host memory for the float64 check");
    return 1;
  }

  double t0 = tool_step("float64 check of %lld tokens and %lld weight-gradient rows (rows: "
                        "%.2g multiply-adds)", (long long)nt, (long long)rows_total, work);
  #pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < nt; i++) {
    double *r = tok + i * (2 * H + k);
    mok_ref64_token(&L->in, spread(i, nt, T), r, r + H, r + 2 * H);
  }
  #pragma omp parallel for schedule(dynamic, 1) private(e, row)
  for (int64_t j = 0; j < ngrads * max_rows; j++) {
    const int g = (int)(j / max_rows);
    if (j % max_rows >= nr[g]) continue;
    pick(o->seed, g, j % max_rows, &grads[g], &e, &row);
    mok_ref64_grad_row(&L->in, grads[g].which, e, row, rows + j * wmax);
  }
  tool_done(t0);

  printf("\ncheck against the float64 recomputation (src/cpu/ref64.h), tolerance %.1e on the\n"
         "relative L2 error ||got - ref|| / ||ref|| of the sampled values\n",
         o->tol);
  printf("  %-15s %-12s %10s %10s\n", "tensor", "sampled", "rel.err", "max|err|");
  int failed = 0;
  const tool_output tok_out[3] = {OUT_Y, OUT_DX, OUT_DTW};
  const int64_t tok_at[3] = {0, H, 2 * H}, tok_n[3] = {H, H, k};
  for (int c = 0; c < 3; c++) {
    error_sum err = {0, 0, 0};
    for (int64_t i = 0; i < nt; i++)
      add_errors(&err, &L->out[tok_out[c]], spread(i, nt, T) * tok_n[c],
                 tok + i * (2 * H + k) + tok_at[c], tok_n[c]);
    failed += report(L->out[tok_out[c]].name, nt, "tokens", &err, o->tol);
  }
  for (int g = 0; g < ngrads; g++) {
    const grad_rows *gr = &grads[g];
    error_sum err = {0, 0, 0};
    for (int64_t i = 0; i < nr[g]; i++) {
      pick(o->seed, g, i, gr, &e, &row);
      add_errors(&err, &L->out[gr->out], (e * gr->rows + row) * gr->width,
                 rows + (g * max_rows + i) * wmax, gr->width);
    }
    failed += report(L->out[gr->out].name, nr[g], "rows", &err, o->tol);
  }
  free(tok);
  free(rows);
  return failed;
}
