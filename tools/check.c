/*
 * check.c: `mok run`'s comparison of the downloaded outputs with the float64 recomputation of
 * src/cpu/ref64.h, on a sample: --check-tokens tokens spread over the batch (their rows of y and
 * dx and their d_topk_weights) and, for each weight gradient, --check-rows rows (gate, up) or
 * columns (down) at seeded pseudo-random (expert, row) places, or every one there is. Per tensor
 * it reports ||got - ref|| / ||ref|| (L2 over the sampled values) and the largest |got - ref|.
 * The float64 values are computed in parallel and compared in a fixed order, so the table does
 * not depend on the thread count.
 */
#include <math.h>
#include <omp.h>
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

/* One weight gradient, checked by units of H values: rows of a gate or up gradient ([e][i][:]),
 * columns of a down gradient ([e][:][i]), so that every unit costs about the same: a gate/up
 * column of each of the expert's tokens (mok_ref64_down_col), where a row of a down gradient
 * would cost all of gate/up. */
typedef struct grad_units {
  mok_ref_grad which;
  tool_output out;
  int64_t experts, units; /* units = the expert's I (I_s for the shared one) */
  int by_column;
} grad_units;

static const char *unit_name(const grad_units *g) { return g->by_column ? "columns" : "rows"; }

/* Element v (of H) of unit u of expert e, as an index into the gradient. */
static int64_t unit_at(const grad_units *g, int64_t H, int64_t e, int64_t u, int64_t v) {
  return g->by_column ? (e * H + v) * g->units + u : (e * g->units + u) * H + v;
}

/* Unit i of the n checked of gradient g: all of them in order when n covers every unit, else a
 * pseudo-random (expert, unit) from splitmix64 of seed, g and i. */
static void pick(uint64_t seed, int g, int64_t i, int64_t n, const grad_units *gr, int64_t *e,
                 int64_t *u) {
  if (n >= gr->experts * gr->units) {
    *e = i / gr->units, *u = i % gr->units;
    return;
  }
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (uint64_t)(1 + 1000 * g + i);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  *e = (int64_t)(z % (uint64_t)gr->experts);
  *u = (int64_t)((z >> 20) % (uint64_t)gr->units);
}

/* Tokens routed to expert e (all of them for the shared expert). */
static int64_t tokens_of(const tool_layer *L, const grad_units *g, int64_t e) {
  const mok_shape *s = &L->o->shape;
  if (g->experts == 1) return s->max_tokens;
  int64_t n = 0;
  for (int64_t r = 0; r < s->max_tokens * s->top_k; r++) n += L->in.topk_ids[r] == e;
  return n;
}

/* Units per gradient, nu[g]: --check-rows (at most every unit there is), or by default as many
 * of CLI_CHECK_ROWS as CLI_CHECK_BUDGET allows, taken in rounds over the gradients (each keeps
 * at least one). Returns the estimated multiply-adds: about 4 H per token of the unit's expert
 * (its gate and up dot products, dh or dy, and the sum). */
static double plan_units(const tool_layer *L, const grad_units *grads, int ngrads, int64_t *nu) {
  const int fixed = L->o->check_rows != CLI_DEFAULT;
  const int64_t want = fixed ? L->o->check_rows : CLI_CHECK_ROWS, H = L->o->shape.hidden;
  int64_t most = 0, e, u;
  for (int g = 0; g < ngrads; g++) {
    nu[g] = 0;
    if (grads[g].experts * grads[g].units > most) most = grads[g].experts * grads[g].units;
  }
  double work = 0;
  int64_t *tokens = calloc((size_t)L->o->shape.experts, sizeof *tokens);
  for (int g = 0; g < ngrads && tokens; g++)
    for (e = 0; e < grads[g].experts; e++) tokens[e] = tokens_of(L, &grads[g], e);
  for (int64_t i = 0; i < (want < most ? want : most); i++)
    for (int g = 0; g < ngrads; g++) {
      const int64_t all = grads[g].experts * grads[g].units;
      if (nu[g] < i || i >= all) continue; /* stopped by the budget, or every unit taken */
      pick(L->o->seed, g, i, want < all ? want : all, &grads[g], &e, &u);
      const double c = 4.0 * (double)H * (double)(tokens ? tokens[e] : L->o->shape.max_tokens);
      if (!fixed && i > 0 && work + c > CLI_CHECK_BUDGET) continue;
      nu[g] = i + 1;
      work += c;
    }
  free(tokens);
  return work;
}

/* Multiply-adds of ref64's recomputation of one token: per expert (the shared one and its k
 * routed ones), gate/up (2 I H), down (I H), down's dgrad (I H) and gate/up's dgrad (2 I H). */
static double token_cost(const mok_shape *s) {
  return 6.0 * (double)s->hidden * ((double)s->top_k * s->inter + (double)s->shared_inter);
}

int tool_check_ref(const tool_layer *L) {
  const cli_options *o = L->o;
  const mok_shape *s = &o->shape;
  const int64_t T = s->max_tokens, H = s->hidden, I = s->inter, Is = s->shared_inter;
  const int64_t E = s->experts, k = s->top_k;
  const int64_t nt = o->check_tokens < T ? o->check_tokens : T;
  const grad_units grads[6] = {
      {MOK_REF_DW_GATE, OUT_DW_GATE, E, I, 0},    {MOK_REF_DW_UP, OUT_DW_UP, E, I, 0},
      {MOK_REF_DW_DOWN, OUT_DW_DOWN, E, I, 1},    {MOK_REF_DWS_GATE, OUT_DWS_GATE, 1, Is, 0},
      {MOK_REF_DWS_UP, OUT_DWS_UP, 1, Is, 0},     {MOK_REF_DWS_DOWN, OUT_DWS_DOWN, 1, Is, 1},
  };
  const int ngrads = Is > 0 ? 6 : 3;
  int64_t nu[6], units = 0, e, u;
  const double work = plan_units(L, grads, ngrads, nu);
  for (int g = 0; g < ngrads; g++) units += nu[g];
  /* tok: per sampled token y[H], dx[H], d_topk_weights[k]; ref: a batch of units, H each. */
  const int threads = omp_get_max_threads();
  const int64_t batch = 4 * (int64_t)threads;
  double *tok = malloc((size_t)(nt * (2 * H + k) + 1) * sizeof(double));
  double *ref = malloc((size_t)(batch * H) * sizeof(double));
  if (!tok || !ref) {
    free(tok);
    free(ref);
    tool_error("no host memory for the float64 check");
    return 1;
  }

  const double tok_work = (double)nt * token_cost(s);
  double t0 = tool_step("float64 check of %lld tokens (%.2g multiply-adds) and %lld weight-"
                        "gradient rows and columns (%.2g), about %.0f s on %d threads",
                        (long long)nt, tok_work, (long long)units, work,
                        (tok_work + work) / (CLI_CHECK_RATE * threads), threads);
  #pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < nt; i++) {
    double *r = tok + i * (2 * H + k);
    mok_ref64_token(&L->in, spread(i, nt, T), r, r + H, r + 2 * H);
  }
  /* Units a batch at a time (in parallel), their errors added in order: the sums do not depend
   * on the thread count. */
  error_sum gerr[6] = {{0, 0, 0}};
  for (int g = 0; g < ngrads; g++) {
    const grad_units *gr = &grads[g];
    const int64_t all = gr->experts * gr->units, n = nu[g] < all ? nu[g] : all;
    for (int64_t i0 = 0; i0 < n; i0 += batch) {
      const int64_t m = n - i0 < batch ? n - i0 : batch;
      #pragma omp parallel for schedule(dynamic, 1) private(e, u)
      for (int64_t j = 0; j < m; j++) {
        pick(o->seed, g, i0 + j, n, gr, &e, &u);
        if (gr->by_column) mok_ref64_down_col(&L->in, gr->which, e, u, ref + j * H);
        else mok_ref64_grad_row(&L->in, gr->which, e, u, ref + j * H);
      }
      for (int64_t j = 0; j < m; j++) {
        pick(o->seed, g, i0 + j, n, gr, &e, &u);
        for (int64_t v = 0; v < H; v++)
          add_errors(&gerr[g], &L->out[gr->out], unit_at(gr, H, e, u, v), ref + j * H + v, 1);
      }
    }
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
  for (int g = 0; g < ngrads; g++)
    failed += report(L->out[grads[g].out].name, nu[g], unit_name(&grads[g]), &gerr[g], o->tol);
  free(tok);
  free(ref);
  return failed;
}
