/*
 * test_router.c: the router of DESIGN.md §1.2 on the CPU backend.
 *   - against a float64 recomputation written here (logits, scores, choice, weights, counts,
 *     losses; backward dl, dx and dW_r from the backend's choice), in every configuration;
 *   - the backward formulas themselves: central finite differences of the float64 loss
 *     sum(g * w) + a L_aux + z L_z in x and W_r, with the choice and counts held fixed;
 *   - the choice rules on hand-made rows: ties to the lower id, the bias steering the choice but
 *     not the weights, group-limited choice;
 *   - D1 (repeat), D2 (1 and 3 threads) and D3 (a sub-batch) bit for bit; bad arguments refused
 *     with outputs untouched; the router feeding the layer, its dx added into the layer's.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "harness.h"
#include "internal.h"

/* ---- one case's inputs and outputs ------------------------------------------------------------ */
typedef struct rt_case {
  mok_router_config cfg;
  int64_t T;
  int bias, losses; /* bias given; aux and z losses asked for (and their gradients given) */
} rt_case;

typedef struct rt_io {
  int64_t T, H, E, k;
  uint16_t *x, *w;     /* [T, H], [E, H] */
  float *bias;         /* [E] or NULL */
  float *g;            /* [T, k] d_topk_weights */
  uint16_t *dx_in;     /* [T, H] the layer's dx the router's is added to */
  float d_aux, d_z;
  /* outputs */
  int32_t *ids, *counts;
  float *tw, aux, z;
  void *saved;
  uint16_t *dx;
  float *dw;           /* fp32 (MOK_GRAD_ACCUMULATE_F32 onto zeros) */
} rt_io;

static void io_init(rt_io *io, const rt_case *c, uint64_t seed) {
  const mok_router_config *f = &c->cfg;
  io->T = c->T, io->H = f->hidden, io->E = f->experts, io->k = f->top_k;
  const int64_t T = io->T, H = io->H, E = io->E, k = io->k;
  io->x = test_alloc((size_t)(T * H) * 2);
  io->w = test_alloc((size_t)(E * H) * 2);
  mok_gen_normal_bf16(seed, 1, 1.0f, io->x, (size_t)(T * H));
  mok_gen_normal_bf16(seed, 2, 1.5f / sqrtf((float)H), io->w, (size_t)(E * H));
  io->bias = NULL;
  if (c->bias) {
    uint16_t *b = test_alloc((size_t)E * 2);
    mok_gen_normal_bf16(seed, 3, 0.2f, b, (size_t)E);
    io->bias = test_alloc((size_t)E * 4);
    for (int64_t e = 0; e < E; e++) io->bias[e] = mok_bf16_to_f32(b[e]);
    free(b);
  }
  uint16_t *gb = test_alloc((size_t)(T * k) * 2);
  mok_gen_normal_bf16(seed, 4, 1.0f, gb, (size_t)(T * k));
  io->g = test_alloc((size_t)(T * k) * 4);
  for (int64_t i = 0; i < T * k; i++) io->g[i] = mok_bf16_to_f32(gb[i]);
  free(gb);
  io->dx_in = test_alloc((size_t)(T * H) * 2);
  mok_gen_normal_bf16(seed, 5, 0.05f, io->dx_in, (size_t)(T * H));
  io->d_aux = 0.7f, io->d_z = 0.3f;
  io->ids = test_alloc((size_t)(T * k) * 4);
  io->counts = test_alloc((size_t)E * 4);
  io->tw = test_alloc((size_t)(T * k) * 4);
  io->dx = test_alloc((size_t)(T * H) * 2);
  io->dw = test_alloc((size_t)(E * H) * 4);
  io->saved = NULL;
}

static void io_fini(rt_io *io) {
  free(io->x), free(io->w), free(io->bias), free(io->g), free(io->dx_in), free(io->ids);
  free(io->counts), free(io->tw), free(io->dx), free(io->dw), free(io->saved);
}

/* Forward and backward on the CPU backend with `threads` threads; 0 if all went well. */
static int io_run(rt_io *io, const rt_case *c, int threads) {
  mok_context_config cc = MOK_CONTEXT_CONFIG_INIT;
  cc.threads = threads;
  mok_context *ctx = NULL;
  mok_router *r = NULL;
  mok_status st = mok_context_create(&cc, &ctx);
  mok_router_config cfg = c->cfg;
  if (st == MOK_OK) st = mok_router_create(ctx, &cfg, &r);
  CHECK_OK(st);
  if (st != MOK_OK) {
    mok_context_destroy(ctx);
    return 1;
  }
  const int64_t T = io->T, H = io->H, E = io->E, k = io->k;
  free(io->saved);
  io->saved = test_alloc(mok_router_saved_bytes(r, T));
  memset(io->ids, 0xA5, (size_t)(T * k) * 4);
  memset(io->tw, 0xA5, (size_t)(T * k) * 4);
  memset(io->counts, 0xA5, (size_t)E * 4);
  io->aux = io->z = NAN;
  mok_router_forward_args f = {T, io->x, io->w, io->bias, io->ids, io->tw, io->counts,
                               c->losses ? &io->aux : NULL, c->losses ? &io->z : NULL,
                               io->saved};
  st = mok_router_forward(r, &f, NULL);
  CHECK_OK(st);
  memcpy(io->dx, io->dx_in, (size_t)(T * H) * 2);
  memset(io->dw, 0, (size_t)(E * H) * 4);
  mok_router_backward_args b = {T, io->x, io->w, io->saved, io->g,
                                c->losses ? &io->d_aux : NULL, c->losses ? &io->d_z : NULL,
                                io->dx, 1, io->dw, MOK_GRAD_ACCUMULATE_F32};
  if (st == MOK_OK) st = mok_router_backward(r, &b, NULL);
  CHECK_OK(st);
  mok_router_destroy(r);
  mok_context_destroy(ctx);
  return st != MOK_OK;
}

/* ---- float64 reference ------------------------------------------------------------------------ */
typedef struct dref {
  int64_t T, H, E, k;
  const mok_router_config *cfg;
  double *x, *w;           /* [T, H], [E, H] */
  const int32_t *ids;      /* [T, k] the choice, held fixed */
  const int32_t *counts;   /* [E] */
  const float *g;          /* [T, k] */
  double a, z;             /* the losses' gradients (0 when not asked for) */
} dref;

static void d_logits(const dref *d, int64_t t, double *l) {
  for (int64_t e = 0; e < d->E; e++) {
    double s = 0.0;
    for (int64_t h = 0; h < d->H; h++) s += d->x[t * d->H + h] * d->w[e * d->H + h];
    l[e] = s;
  }
}

static double d_lse(const double *l, int64_t E) {
  double m = l[0], s = 0.0;
  for (int64_t e = 1; e < E; e++) m = fmax(m, l[e]);
  for (int64_t e = 0; e < E; e++) s += exp(l[e] - m);
  return m + log(s);
}

static void d_scores(const dref *d, const double *l, double *s) {
  if (d->cfg->scoring == MOK_ROUTER_SIGMOID) {
    for (int64_t e = 0; e < d->E; e++) s[e] = 1.0 / (1.0 + exp(-l[e]));
    return;
  }
  const double lse = d_lse(l, d->E);
  for (int64_t e = 0; e < d->E; e++) s[e] = exp(l[e] - lse);
}

/* sum(g w) + a L_aux + z L_z, the choice and the counts fixed. */
static double d_loss(const dref *d) {
  const int64_t T = d->T, E = d->E, k = d->k;
  double *l = malloc((size_t)E * 8), *s = malloc((size_t)E * 8), *P = calloc((size_t)E, 8);
  double loss = 0.0, zsum = 0.0;
  for (int64_t t = 0; t < T; t++) {
    d_logits(d, t, l);
    d_scores(d, l, s);
    double S = 0.0, Sall = 0.0;
    for (int64_t j = 0; j < k; j++) S += s[d->ids[t * k + j]];
    for (int64_t e = 0; e < E; e++) Sall += s[e];
    for (int64_t j = 0; j < k; j++) {
      double v = s[d->ids[t * k + j]];
      if (d->cfg->renormalize) v /= S;
      loss += d->g[t * k + j] * v * d->cfg->scale;
    }
    for (int64_t e = 0; e < E; e++)
      P[e] += (d->cfg->scoring == MOK_ROUTER_SIGMOID ? s[e] / Sall : s[e]) / (double)T;
    const double lse = d_lse(l, E);
    zsum += lse * lse;
  }
  double aux = 0.0;
  for (int64_t e = 0; e < E; e++) aux += (double)d->counts[e] / (double)(T * k) * P[e];
  loss += d->a * (double)E * aux + d->z * zsum / (double)T;
  free(l), free(s), free(P);
  return loss;
}

/* The backward table of §1.2 in float64: dl [T, E], then dx (without dx_in) and dW_r. */
static void d_backward(const dref *d, double *dl, double *dx, double *dw) {
  const int64_t T = d->T, E = d->E, k = d->k, H = d->H;
  const int sig = d->cfg->scoring == MOK_ROUTER_SIGMOID;
  double *l = malloc((size_t)E * 8), *s = malloc((size_t)E * 8), *ds = malloc((size_t)E * 8);
  for (int64_t t = 0; t < T; t++) {
    d_logits(d, t, l);
    d_scores(d, l, s);
    for (int64_t e = 0; e < E; e++) ds[e] = 0.0;
    double S = 0.0, dot = 0.0;
    for (int64_t j = 0; j < k; j++) S += s[d->ids[t * k + j]];
    for (int64_t j = 0; j < k; j++)
      dot += d->g[t * k + j] * d->cfg->scale * s[d->ids[t * k + j]] / S;
    for (int64_t j = 0; j < k; j++) {
      const double dw = d->g[t * k + j] * d->cfg->scale;
      ds[d->ids[t * k + j]] = d->cfg->renormalize ? (dw - dot) / S : dw;
    }
    double Sall = 0.0, pdot = 0.0;
    for (int64_t e = 0; e < E; e++) Sall += s[e];
    for (int64_t e = 0; e < E; e++) {
      const double dp = d->a * (double)E * d->counts[e] / (double)(T * k) / (double)T;
      pdot += dp * s[e] / Sall;
    }
    for (int64_t e = 0; e < E; e++) {
      const double dp = d->a * (double)E * d->counts[e] / (double)(T * k) / (double)T;
      ds[e] += sig ? (dp - pdot) / Sall : dp;
    }
    double sdot = 0.0;
    for (int64_t e = 0; e < E; e++) sdot += ds[e] * s[e];
    const double lse = d_lse(l, E);
    for (int64_t e = 0; e < E; e++) {
      double v = sig ? ds[e] * s[e] * (1.0 - s[e]) : s[e] * (ds[e] - sdot);
      v += d->z * 2.0 * lse * exp(l[e] - lse) / (double)T;
      dl[t * E + e] = v;
    }
  }
  for (int64_t i = 0; i < T * H; i++) dx[i] = 0.0;
  for (int64_t i = 0; i < E * H; i++) dw[i] = 0.0;
  for (int64_t t = 0; t < T; t++)
    for (int64_t e = 0; e < E; e++)
      for (int64_t h = 0; h < H; h++) {
        dx[t * H + h] += dl[t * E + e] * d->w[e * H + h];
        dw[e * H + h] += dl[t * E + e] * d->x[t * H + h];
      }
  free(l), free(s), free(ds);
}

static double *bf16_to_double(const uint16_t *b, int64_t n) {
  double *d = malloc((size_t)n * 8);
  for (int64_t i = 0; i < n; i++) d[i] = mok_bf16_to_f32(b[i]);
  return d;
}

static dref dref_of(const rt_io *io, const rt_case *c) {
  dref d = {io->T, io->H, io->E, io->k, &c->cfg, bf16_to_double(io->x, io->T * io->H),
            bf16_to_double(io->w, io->E * io->H), io->ids, io->counts, io->g,
            c->losses ? io->d_aux : 0.0, c->losses ? io->d_z : 0.0};
  return d;
}

/* The choice in float64: the k allowed experts of highest key (score + bias), best first. */
static void d_choose(const rt_io *io, const rt_case *c, const double *s, int32_t *ids) {
  const int64_t E = io->E;
  const mok_router_config *f = &c->cfg;
  double *key = malloc((size_t)E * 8);
  for (int64_t e = 0; e < E; e++) key[e] = s[e] + (io->bias ? io->bias[e] : 0.0);
  int allowed[64] = {0};
  const int64_t ng = f->n_group > 1 ? f->n_group : 1, G = E / ng;
  if (ng == 1) allowed[0] = 1;
  for (int pick = 0; ng > 1 && pick < f->topk_group; pick++) {
    int64_t bg = -1;
    double best = 0.0;
    for (int64_t g = 0; g < ng; g++) {
      if (allowed[g]) continue;
      double b1 = -INFINITY, b2 = -INFINITY;
      for (int64_t e = g * G; e < (g + 1) * G; e++) {
        if (key[e] > b1) b2 = b1, b1 = key[e];
        else if (key[e] > b2) b2 = key[e];
      }
      const double gs = G == 1 ? b1 : b1 + b2;
      if (bg < 0 || gs > best) best = gs, bg = g;
    }
    allowed[bg] = 1;
  }
  for (int64_t j = 0; j < io->k; j++) {
    int64_t be = -1;
    for (int64_t e = 0; e < E; e++) {
      if (!allowed[e / G]) continue;
      int taken = 0;
      for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
      if (!taken && (be < 0 || key[e] > key[be])) be = e;
    }
    ids[j] = (int32_t)be;
  }
  free(key);
}

static const rt_case cases[] = {
    /* cfg: max_tokens, H, E, k, scoring, n_group, topk_group, renormalize, scale */
    {{40, 72, 8, 2, MOK_ROUTER_SOFTMAX, 0, 0, 0, 1.0f}, 40, 0, 1},
    {{40, 64, 16, 4, MOK_ROUTER_SOFTMAX, 0, 0, 1, 1.0f}, 33, 1, 1},
    {{48, 96, 32, 8, MOK_ROUTER_SIGMOID, 4, 2, 1, 2.5f}, 48, 1, 1},
    {{20, 40, 12, 3, MOK_ROUTER_SIGMOID, 0, 0, 0, 1.0f}, 17, 0, 0},
    {{24, 48, 64, 6, MOK_ROUTER_SOFTMAX, 8, 3, 1, 1.0f}, 24, 1, 0},
};
#define CASES ((int)(sizeof cases / sizeof cases[0]))

static double rel(double num2, double den2) { return sqrt(num2 / fmax(den2, 1e-300)); }

static void router_vs_float64(void) {
  for (int ci = 0; ci < CASES; ci++) {
    const rt_case *c = &cases[ci];
    rt_io io;
    io_init(&io, c, 100 + (uint64_t)ci);
    if (io_run(&io, c, 0) == 0) {
      const int64_t T = io.T, H = io.H, E = io.E, k = io.k;
      dref d = dref_of(&io, c);
      double *l = malloc((size_t)E * 8), *s = malloc((size_t)E * 8), *P = calloc((size_t)E, 8);
      int32_t *ids = malloc((size_t)k * 4), *counts = calloc((size_t)E, 4);
      const mok_router_layout L = mok_router_layout_of(&(mok_router){.cfg = c->cfg}, T);
      const float *logits = (const float *)((char *)io.saved + L.logits);
      double lg2 = 0, lgr2 = 0, w2 = 0, wr2 = 0, zsum = 0;
      int bad_choice = 0;
      for (int64_t t = 0; t < T; t++) {
        d_logits(&d, t, l);
        for (int64_t e = 0; e < E; e++)
          lg2 += pow(logits[t * E + e] - l[e], 2), lgr2 += l[e] * l[e];
        d_scores(&d, l, s);
        d_choose(&io, c, s, ids);
        double S = 0.0, Sall = 0.0;
        for (int64_t e = 0; e < E; e++) Sall += s[e];
        for (int64_t j = 0; j < k; j++) {
          /* Another expert only where the two tie to float rounding. */
          const int32_t got = io.ids[t * k + j];
          const double kg = s[got] + (io.bias ? io.bias[got] : 0.0);
          const double kr = s[ids[j]] + (io.bias ? io.bias[ids[j]] : 0.0);
          if (got != ids[j] && fabs(kg - kr) > 1e-6) bad_choice++;
          S += s[got];
          counts[got]++;
        }
        for (int64_t j = 0; j < k; j++) {
          double v = s[io.ids[t * k + j]];
          if (c->cfg.renormalize) v /= S;
          v *= c->cfg.scale;
          w2 += pow(io.tw[t * k + j] - v, 2), wr2 += v * v;
        }
        for (int64_t e = 0; e < E; e++)
          P[e] += (c->cfg.scoring == MOK_ROUTER_SIGMOID ? s[e] / Sall : s[e]) / (double)T;
        zsum += pow(d_lse(l, E), 2);
      }
      CHECK(bad_choice == 0, "case %d: %d chosen experts differ from float64's", ci, bad_choice);
      CHECK(rel(lg2, lgr2) < 1e-5, "case %d: logits rel err %.3g", ci, rel(lg2, lgr2));
      CHECK(rel(w2, wr2) < 1e-5, "case %d: topk_weights rel err %.3g", ci, rel(w2, wr2));
      CHECK(memcmp(counts, io.counts, (size_t)E * 4) == 0, "case %d: counts differ", ci);
      if (c->losses) {
        double aux = 0.0;
        for (int64_t e = 0; e < E; e++) aux += (double)counts[e] / (double)(T * k) * P[e];
        aux *= (double)E;
        CHECK(fabs(io.aux - aux) < 1e-5 * fabs(aux), "case %d: aux loss %.9g, float64 %.9g", ci,
              (double)io.aux, aux);
        CHECK(fabs(io.z - zsum / T) < 1e-5 * (zsum / T), "case %d: z-loss %.9g, float64 %.9g",
              ci, (double)io.z, zsum / T);
      }
      /* Backward from the backend's choice. */
      double *dl = malloc((size_t)(T * E) * 8), *dx = malloc((size_t)(T * H) * 8);
      double *dw = malloc((size_t)(E * H) * 8);
      d_backward(&d, dl, dx, dw);
      double x2 = 0, xr2 = 0, g2 = 0, gr2 = 0;
      for (int64_t i = 0; i < T * H; i++) {
        const double ref = mok_bf16_to_f32(io.dx_in[i]) + dx[i];
        x2 += pow(mok_bf16_to_f32(io.dx[i]) - ref, 2), xr2 += ref * ref;
      }
      for (int64_t i = 0; i < E * H; i++) g2 += pow(io.dw[i] - dw[i], 2), gr2 += dw[i] * dw[i];
      CHECK(rel(x2, xr2) < 5e-3, "case %d: dx rel err %.3g", ci, rel(x2, xr2));
      CHECK(rel(g2, gr2) < 1e-5, "case %d: dW_r rel err %.3g", ci, rel(g2, gr2));
      printf("     case %d: logits %.1e, weights %.1e, dx %.1e, dW_r %.1e\n", ci,
             rel(lg2, lgr2), rel(w2, wr2), rel(x2, xr2), rel(g2, gr2));
      free(l), free(s), free(P), free(ids), free(counts), free(dl), free(dx), free(dw);
      free(d.x), free(d.w);
    }
    io_fini(&io);
  }
}

/* Central differences of d_loss in x and W_r against d_backward. */
static void router_finite_differences(void) {
  for (int ci = 0; ci < CASES; ci++) {
    rt_case c = cases[ci];
    c.T = 6, c.cfg.max_tokens = 6, c.cfg.hidden = 10;
    c.losses = 1; /* every term of the loss */
    rt_io io;
    io_init(&io, &c, 200 + (uint64_t)ci);
    if (io_run(&io, &c, 1) == 0) {
      dref d = dref_of(&io, &c);
      const int64_t T = io.T, H = io.H, E = io.E;
      double *dl = malloc((size_t)(T * E) * 8), *dx = malloc((size_t)(T * H) * 8);
      double *dw = malloc((size_t)(E * H) * 8);
      d_backward(&d, dl, dx, dw);
      double worst = 0.0;
      for (int which = 0; which < 2; which++) {
        double *p = which ? d.w : d.x, *an = which ? dw : dx;
        const int64_t n = which ? E * H : T * H;
        for (int64_t i = 0; i < n; i += which ? 7 : 3) {
          const double keep = p[i], h = 1e-6;
          p[i] = keep + h;
          const double lp = d_loss(&d);
          p[i] = keep - h;
          const double lm = d_loss(&d);
          p[i] = keep;
          const double fd = (lp - lm) / (2 * h), err = fabs(fd - an[i]) / fmax(1e-3, fabs(an[i]));
          worst = fmax(worst, err);
          CHECK(err < 1e-5, "case %d: %s[%lld]: finite difference %.9g, analytic %.9g", ci,
                which ? "W_r" : "x", (long long)i, fd, an[i]);
        }
      }
      printf("     case %d: finite differences vs analytic: worst rel err %.2e\n", ci, worst);
      free(dl), free(dx), free(dw), free(d.x), free(d.w);
    }
    io_fini(&io);
  }
}

/* ---- the choice on hand-made rows ------------------------------------------------------------- */
/* One token whose logits are set through x = e_0 (one-hot) and W_r[e, 0] = the logit. */
static void choose(const mok_router_config *cfg0, const float *logit, const float *bias,
                   int32_t *ids, float *tw) {
  mok_router_config cfg = *cfg0;
  cfg.max_tokens = 1, cfg.hidden = 8;
  const int64_t E = cfg.experts, k = cfg.top_k;
  uint16_t *x = test_alloc(16), *w = test_alloc((size_t)E * 16);
  memset(x, 0, 16), memset(w, 0, (size_t)E * 16);
  x[0] = mok_f32_to_bf16(1.0f);
  for (int64_t e = 0; e < E; e++) w[e * 8] = mok_f32_to_bf16(logit[e]);
  float *b = NULL;
  if (bias) {
    b = test_alloc((size_t)E * 4);
    memcpy(b, bias, (size_t)E * 4);
  }
  mok_context_config cc = MOK_CONTEXT_CONFIG_INIT;
  mok_context *ctx = NULL;
  mok_router *r = NULL;
  CHECK_OK(mok_context_create(&cc, &ctx));
  CHECK_OK(mok_router_create(ctx, &cfg, &r));
  int32_t *oid = test_alloc((size_t)k * 4), *counts = test_alloc((size_t)E * 4);
  float *otw = test_alloc((size_t)k * 4);
  void *saved = test_alloc(mok_router_saved_bytes(r, 1));
  mok_router_forward_args f = {1, x, w, b, oid, otw, counts, NULL, NULL, saved};
  CHECK_OK(mok_router_forward(r, &f, NULL));
  memcpy(ids, oid, (size_t)k * 4);
  memcpy(tw, otw, (size_t)k * 4);
  mok_router_destroy(r);
  mok_context_destroy(ctx);
  free(x), free(w), free(b), free(oid), free(counts), free(otw), free(saved);
}

static void router_choice_rules(void) {
  int32_t ids[4];
  float tw[4];
  /* Ties go to the lower id: experts 1, 3, 5 tie at the top, 0 and 6 below them. */
  mok_router_config c = {1, 8, 8, 4, MOK_ROUTER_SOFTMAX, 0, 0, 0, 1.0f};
  const float tie[8] = {1, 2, 0, 2, -1, 2, 1.5f, -3};
  choose(&c, tie, NULL, ids, tw);
  CHECK(ids[0] == 1 && ids[1] == 3 && ids[2] == 5 && ids[3] == 6,
        "ties: ids %d %d %d %d; expected 1 3 5 6", ids[0], ids[1], ids[2], ids[3]);
  CHECK(tw[0] == tw[1] && tw[1] == tw[2] && tw[3] < tw[0], "ties: weights %g %g %g %g", tw[0],
        tw[1], tw[2], tw[3]);
  /* The bias steers the choice, and the weights stay the scores: sigmoid, k = 2. */
  c.scoring = MOK_ROUTER_SIGMOID, c.top_k = 2;
  const float lg[8] = {3, 2, 1, 0, -1, -2, -3, -4};
  const float bias[8] = {0, 0, 0, 0, 0, 0, 0, 5};
  choose(&c, lg, bias, ids, tw);
  CHECK(ids[0] == 7 && ids[1] == 0, "bias: ids %d %d; expected 7 0", ids[0], ids[1]);
  const float s7 = 1.0f / (1.0f + expf(4.0f)), s0 = 1.0f / (1.0f + expf(-3.0f));
  CHECK(fabsf(tw[0] - s7) < 1e-6f && fabsf(tw[1] - s0) < 1e-6f,
        "bias: weights %g %g; expected the scores %g %g", tw[0], tw[1], s7, s0);
  /* Groups: 4 groups of 2 scored by the sum of both sigmoids: 1.245, 0.955, 1.421, 1.399. The
   * best expert (logit 2.9) is in a group that loses: with topk_group 2 the choice is from
   * groups 2 and 3 only, and experts 4 and 5 tie (to the lower id). */
  mok_router_config g = {1, 8, 8, 3, MOK_ROUTER_SIGMOID, 4, 2, 1, 2.0f};
  const float gl[8] = {0.5f, 0.5f, 2.9f, -5, 0.9f, 0.9f, 1.0f, 0.7f};
  choose(&g, gl, NULL, ids, tw);
  CHECK(ids[0] == 6 && ids[1] == 4 && ids[2] == 5, "groups: ids %d %d %d; expected 6 4 5",
        ids[0], ids[1], ids[2]);
  CHECK(fabsf(tw[0] + tw[1] + tw[2] - 2.0f) < 1e-5f,
        "groups: renormalised weights times 2 sum to %g; expected 2", tw[0] + tw[1] + tw[2]);
}

/* ---- determinism ------------------------------------------------------------------------------ */
static int64_t first_diff(const void *a, const void *b, int64_t n, size_t elem) {
  for (int64_t i = 0; i < n; i++)
    if (memcmp((const char *)a + i * elem, (const char *)b + i * elem, elem)) return i;
  return -1;
}

#define SAME(what, a, b, n, elem)                                                     \
  do {                                                                                \
    int64_t at_ = first_diff((a), (b), (n), (elem));                                  \
    CHECK(at_ < 0, "%s: first difference at element %lld", (what), (long long)at_);  \
  } while (0)

static void router_determinism(void) {
  const rt_case *c = &cases[2]; /* sigmoid, bias, groups, renormalised, losses */
  rt_io a, b;
  io_init(&a, c, 7);
  io_init(&b, c, 7);
  if (io_run(&a, c, 3) == 0 && io_run(&b, c, 1) == 0) { /* D1 and D2 at once */
    const int64_t T = a.T, H = a.H, E = a.E, k = a.k;
    SAME("topk_ids", a.ids, b.ids, T * k, 4);
    SAME("topk_weights", a.tw, b.tw, T * k, 4);
    SAME("counts", a.counts, b.counts, E, 4);
    SAME("aux loss", &a.aux, &b.aux, 1, 4);
    SAME("z-loss", &a.z, &b.z, 1, 4);
    SAME("dx", a.dx, b.dx, T * H, 2);
    SAME("dW_r", a.dw, b.dw, E * H, 4);
    /* D3: the last 11 tokens alone give their rows' ids, weights and dx. */
    rt_io s;
    rt_case sc = *c;
    sc.T = 11;
    io_init(&s, &sc, 7);
    const int64_t off = T - 11;
    memcpy(s.x, a.x + off * H, (size_t)(11 * H) * 2);
    memcpy(s.g, a.g + off * k, (size_t)(11 * k) * 4);
    memcpy(s.dx_in, a.dx_in + off * H, (size_t)(11 * H) * 2);
    sc.losses = 0; /* the losses' gradients depend on the batch, as they must */
    rt_io full;
    rt_case fc = *c;
    fc.losses = 0;
    io_init(&full, &fc, 7);
    if (io_run(&s, &sc, 2) == 0 && io_run(&full, &fc, 2) == 0) {
      SAME("D3 topk_ids", s.ids, full.ids + off * k, 11 * k, 4);
      SAME("D3 topk_weights", s.tw, full.tw + off * k, 11 * k, 4);
      SAME("D3 dx", s.dx, full.dx + off * H, 11 * H, 2);
    }
    io_fini(&s);
    io_fini(&full);
  }
  io_fini(&a);
  io_fini(&b);
}

/* ---- bad arguments ---------------------------------------------------------------------------- */
static void router_bad_arguments(void) {
  mok_context_config cc = MOK_CONTEXT_CONFIG_INIT;
  mok_context *ctx = NULL;
  CHECK_OK(mok_context_create(&cc, &ctx));
  const mok_router_config good = {8, 16, 8, 2, MOK_ROUTER_SOFTMAX, 0, 0, 0, 1.0f};
  struct { const char *what; mok_router_config c; } bad[] = {
      {"max_tokens 0", {0, 16, 8, 2, MOK_ROUTER_SOFTMAX, 0, 0, 0, 1.0f}},
      {"experts over the limit", {8, 16, 2048, 2, MOK_ROUTER_SOFTMAX, 0, 0, 0, 1.0f}},
      {"top_k > E", {8, 16, 8, 9, MOK_ROUTER_SOFTMAX, 0, 0, 0, 1.0f}},
      {"scoring 2", {8, 16, 8, 2, (mok_router_scoring)2, 0, 0, 0, 1.0f}},
      {"E % n_group", {8, 16, 8, 2, MOK_ROUTER_SOFTMAX, 3, 1, 0, 1.0f}},
      {"topk_group > n_group", {8, 16, 8, 2, MOK_ROUTER_SOFTMAX, 4, 5, 0, 1.0f}},
      {"k > allowed experts", {8, 16, 8, 5, MOK_ROUTER_SOFTMAX, 4, 2, 0, 1.0f}},
      {"renormalize 2", {8, 16, 8, 2, MOK_ROUTER_SOFTMAX, 0, 0, 2, 1.0f}},
      {"scale 0", {8, 16, 8, 2, MOK_ROUTER_SOFTMAX, 0, 0, 0, 0.0f}},
      {"scale NaN", {8, 16, 8, 2, MOK_ROUTER_SOFTMAX, 0, 0, 0, NAN}},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    mok_router *r = (mok_router *)1;
    mok_status st = mok_router_create(ctx, &bad[i].c, &r);
    CHECK(st == MOK_ERR_INVALID_ARG && r == NULL, "%s: %s", bad[i].what, mok_status_name(st));
    CHECK(strlen(mok_last_error()) > 0, "%s: no message", bad[i].what);
  }
  mok_router *r = NULL;
  CHECK_OK(mok_router_create(ctx, &good, &r));
  CHECK(mok_router_saved_bytes(r, 9) == 0, "saved bytes for 9 > max_tokens tokens");
  rt_case c = {good, 8, 0, 1};
  rt_io io;
  io_init(&io, &c, 3);
  io.saved = test_alloc(mok_router_saved_bytes(r, 8));
  memset(io.ids, 0x5A, 8 * 2 * 4);
  mok_router_forward_args f = {8, io.x, io.w, NULL, io.ids, io.tw, io.counts, NULL, NULL,
                               io.saved};
  mok_router_forward_args b1 = f, b2 = f, b3 = f;
  b1.tokens = 9;
  b2.w_router = NULL;
  b3.saved = (char *)io.saved + 16;
  CHECK(mok_router_forward(r, &b1, NULL) == MOK_ERR_INVALID_ARG, "tokens 9 accepted");
  CHECK(mok_router_forward(r, &b2, NULL) == MOK_ERR_INVALID_ARG, "w_router NULL accepted");
  CHECK(mok_router_forward(r, &b3, NULL) == MOK_ERR_ALIGNMENT, "unaligned saved accepted");
  CHECK(io.ids[0] == 0x5A5A5A5A, "a refused forward wrote topk_ids");
  CHECK_OK(mok_router_forward(r, &f, NULL));
  mok_router_backward_args b = {8, io.x, io.w, io.saved, io.g, NULL, NULL, io.dx, 2, io.dw,
                                MOK_GRAD_WRITE_BF16};
  memset(io.dx, 0x5A, 8 * 16 * 2);
  CHECK(mok_router_backward(r, &b, NULL) == MOK_ERR_INVALID_ARG, "accumulate_dx 2 accepted");
  b.accumulate_dx = 0, b.grad_mode = (mok_grad_mode)5;
  CHECK(mok_router_backward(r, &b, NULL) == MOK_ERR_INVALID_ARG, "grad_mode 5 accepted");
  CHECK(io.dx[0] == 0x5A5A, "a refused backward wrote dx");
  CHECK(mok_router_forward(NULL, &f, NULL) == MOK_ERR_INVALID_ARG, "router NULL accepted");
  io_fini(&io);
  mok_router_destroy(r);
  mok_router_destroy(NULL);
  mok_context_destroy(ctx);
}

/* ---- the router feeding the layer ------------------------------------------------------------- */
/* Router forward -> layer forward -> layer backward -> router backward adding into the layer's
 * dx: the layer's outputs are those of a run given the same ids and weights, and the final dx is
 * bf16(layer dx + router dx), the router's dx taken from a run without accumulation. */
static void router_feeds_layer(void) {
  const mok_shape s = {32, 64, 48, 0, 8, 2, MOK_BF16, 0};
  harness h;
  if (!harness_init(&h, &s, 32, 99, 0)) return;
  const mok_router_config rc = {32, 64, 8, 2, MOK_ROUTER_SOFTMAX, 0, 0, 1, 1.0f};
  mok_router *r = NULL;
  CHECK_OK(mok_router_create(h.ctx, &rc, &r));
  uint16_t *wr = test_alloc(8 * 64 * 2);
  mok_gen_normal_bf16(5, 9, 0.125f, wr, 8 * 64);
  void *rs = test_alloc(mok_router_saved_bytes(r, 32));
  int32_t *counts = test_alloc(8 * 4);
  mok_router_forward_args f = {32, h.L.x, wr, NULL, h.L.topk_ids, h.L.topk_weights, counts,
                               NULL, NULL, rs};
  CHECK_OK(mok_router_forward(r, &f, NULL)); /* the layer's routing is the router's now */
  CHECK_OK(harness_run(&h, MOK_GRAD_WRITE_BF16));
  uint16_t *alone = test_alloc(32 * 64 * 2);
  float *dw = test_alloc(8 * 64 * 4);
  mok_router_backward_args b = {32, h.L.x, wr, rs, h.dtw, NULL, NULL, alone, 0, dw,
                                MOK_GRAD_ACCUMULATE_F32};
  memset(dw, 0, 8 * 64 * 4);
  CHECK_OK(mok_router_backward(r, &b, NULL));
  uint16_t *layer_dx = test_alloc(32 * 64 * 2);
  memcpy(layer_dx, h.dx, 32 * 64 * 2);
  b.dx = h.dx, b.accumulate_dx = 1;
  CHECK_OK(mok_router_backward(r, &b, NULL));
  /* The sum is exact to bf16 rounding of (layer + router); the router's own dx was rounded. */
  double d2 = 0, r2 = 0;
  int nonzero = 0;
  for (int i = 0; i < 32 * 64; i++) {
    const double want = (double)mok_bf16_to_f32(layer_dx[i]) + mok_bf16_to_f32(alone[i]);
    d2 += pow(mok_bf16_to_f32(h.dx[i]) - want, 2), r2 += want * want;
    nonzero += alone[i] != 0;
  }
  CHECK(nonzero > 32 * 64 / 2, "the router's dx is mostly zero (%d of %d non-zero)", nonzero,
        32 * 64);
  CHECK(rel(d2, r2) < 4e-3, "dx: rel err %.3g against layer dx + router dx", rel(d2, r2));
  free(wr), free(rs), free(counts), free(alone), free(dw), free(layer_dx);
  mok_router_destroy(r);
  harness_fini(&h);
}

const test_case tests_router[] = {
    {"router/vs_float64", router_vs_float64},
    {"router/finite_differences", router_finite_differences},
    {"router/choice_rules", router_choice_rules},
    {"router/determinism_d1_d2_d3", router_determinism},
    {"router/bad_arguments", router_bad_arguments},
    {"router/feeds_the_layer", router_feeds_layer},
    {NULL, NULL},
};
