/*
 * router.c: the CPU reference of the router (DESIGN.md §1.2). The per-token math is
 * router_math.h's, shared with the CUDA kernels; here are the products (logits, dx, dW_r) and the
 * reductions over tokens. Every output element is computed whole by one thread in an order fixed
 * by the source (cpu_dot for a logit, tokens or experts ascending for every other sum), so no bit
 * depends on the thread count (D2) and a token's ids, weights and dx depend on its row alone (D3).
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "cpu/kernels.h"
#include "router_math.h"

/* Scratch of one router, sized for max_tokens at creation (T = max_tokens). */
typedef struct cpu_router {
  int threads;
  float *wf;    /* [E, H] W_r as fp32 (the call's) */
  float *xf;    /* [T, H] x as fp32 */
  float *rows;  /* [T, E] p (forward, for the load-balancing loss) or dl (backward) */
  float *lse;   /* [T] (forward, for the z-loss) */
  float *srow;  /* [threads, max(E, H)] each thread's row */
  int64_t srow_len;
  void *block;  /* the one allocation the above are carved from */
} cpu_router;

static mok_status cpu_router_init(mok_router *r) {
  const int64_t T = r->cfg.max_tokens, H = r->cfg.hidden, E = r->cfg.experts;
  cpu_router *st = calloc(1, sizeof *st);
  if (!st) return mok_fail(MOK_ERR_OUT_OF_MEMORY, "no host memory for the CPU router");
  st->threads = r->ctx->cfg.threads > 0 ? r->ctx->cfg.threads : omp_get_max_threads();
  st->srow_len = mok_round_up(mok_max64(E, H), 16);
  size_t c = 0;
  const size_t o_wf = mok_take(&c, E * H * (int64_t)sizeof(float));
  const size_t o_xf = mok_take(&c, T * H * (int64_t)sizeof(float));
  const size_t o_rows = mok_take(&c, T * E * (int64_t)sizeof(float));
  const size_t o_lse = mok_take(&c, T * (int64_t)sizeof(float));
  const size_t o_srow = mok_take(&c, st->threads * st->srow_len * (int64_t)sizeof(float));
  char *b = aligned_alloc(MOK_ALIGN, c);
  if (!b) {
    free(st);
    return mok_fail(MOK_ERR_OUT_OF_MEMORY, "CPU router: no host memory for %zu bytes of scratch",
                    c);
  }
  st->block = b;
  st->wf = (float *)(b + o_wf);
  st->xf = (float *)(b + o_xf);
  st->rows = (float *)(b + o_rows);
  st->lse = (float *)(b + o_lse);
  st->srow = (float *)(b + o_srow);
  r->backend = st;
  r->bytes = c + sizeof *st;
  return MOK_OK;
}

static void cpu_router_fini(mok_router *r) {
  cpu_router *st = r->backend;
  if (!st) return;
  free(st->block);
  free(st);
  r->backend = NULL;
}

static float *thread_row(const cpu_router *st) {
  return st->srow + (int64_t)omp_get_thread_num() * st->srow_len;
}

/* x and W_r as fp32 (exact). */
static void load_inputs(const mok_router *r, const cpu_router *st, int64_t T, const uint16_t *x,
                        const uint16_t *w) {
  const int64_t H = r->cfg.hidden, E = r->cfg.experts;
  #pragma omp parallel for schedule(static) num_threads(st->threads)
  for (int64_t i = 0; i < T * H; i++) st->xf[i] = bf16_to_f32(x[i]);
  for (int64_t i = 0; i < E * H; i++) st->wf[i] = bf16_to_f32(w[i]);
}

static mok_status cpu_router_forward(mok_router *r, const mok_router_forward_args *a,
                                     void *stream) {
  (void)stream;
  cpu_router *st = r->backend;
  const mok_router_config *c = &r->cfg;
  const rt_params p = rt_params_of(c);
  const int64_t T = a->tokens, H = c->hidden, E = c->experts, k = c->top_k;
  const mok_router_layout L = mok_router_layout_of(r, T);
  char *saved = a->saved;
  float *logits = (float *)(saved + L.logits);
  int32_t *ids = (int32_t *)(saved + L.ids);
  int32_t *counts = (int32_t *)(saved + L.counts);
  load_inputs(r, st, T, a->x, a->w_router);

  #pragma omp parallel for schedule(static) num_threads(st->threads)
  for (int64_t t = 0; t < T; t++) {
    float *l = logits + t * E, *s = thread_row(st);
    for (int64_t e = 0; e < E; e++) l[e] = cpu_dot(st->xf + t * H, st->wf + e * H, H);
    rt_scores(l, &p, s);
    rt_select(s, a->bias, &p, ids + t * k);
    rt_weights(s, ids + t * k, &p, a->topk_weights + t * k);
    if (a->aux_loss) rt_aux_probs(s, &p, st->rows + t * E);
    if (a->z_loss) st->lse[t] = rt_lse(l, (int)E);
  }
  memset(counts, 0, (size_t)E * sizeof *counts);
  for (int64_t i = 0; i < T * k; i++) counts[ids[i]]++;
  memcpy(a->topk_ids, ids, (size_t)(T * k) * sizeof *ids);
  memcpy(a->counts, counts, (size_t)E * sizeof *counts);
  if (a->aux_loss) {
    float sum = 0.0f;
    for (int64_t e = 0; e < E; e++) {
      float psum = 0.0f;
      for (int64_t t = 0; t < T; t++) psum += st->rows[t * E + e];
      sum += rt_aux_term(counts[e], psum, T, (int)k);
    }
    *a->aux_loss = (float)E * sum;
  }
  if (a->z_loss) {
    float sum = 0.0f;
    for (int64_t t = 0; t < T; t++) sum += st->lse[t] * st->lse[t];
    *a->z_loss = sum / (float)T;
  }
  return MOK_OK;
}

static mok_status cpu_router_backward(mok_router *r, const mok_router_backward_args *a,
                                      void *stream) {
  (void)stream;
  cpu_router *st = r->backend;
  const mok_router_config *c = &r->cfg;
  const rt_params p = rt_params_of(c);
  const int64_t T = a->tokens, H = c->hidden, E = c->experts, k = c->top_k;
  const mok_router_layout L = mok_router_layout_of(r, T);
  const char *saved = a->saved;
  const float *logits = (const float *)(saved + L.logits);
  const int32_t *ids = (const int32_t *)(saved + L.ids);
  const int32_t *counts = a->d_aux_loss ? (const int32_t *)(saved + L.counts) : NULL;
  const float aux = a->d_aux_loss ? *a->d_aux_loss : 0.0f;
  const float z = a->d_z_loss ? *a->d_z_loss : 0.0f;
  float *dl = st->rows;
  load_inputs(r, st, T, a->x, a->w_router);

  uint16_t *dx = a->dx;
  #pragma omp parallel for schedule(static) num_threads(st->threads)
  for (int64_t t = 0; t < T; t++) {
    float *acc = thread_row(st);
    rt_dlogits(logits + t * E, ids + t * k, a->d_topk_weights + t * k, &p, counts, aux, T,
               a->d_z_loss != NULL, z, acc, dl + t * E);
    cpu_zero(acc, H);
    for (int64_t e = 0; e < E; e++) cpu_axpy(acc, dl[t * E + e], st->wf + e * H, H);
    for (int64_t h = 0; h < H; h++) {
      const float in = a->accumulate_dx ? bf16_to_f32(dx[t * H + h]) : 0.0f;
      dx[t * H + h] = f32_to_bf16(in + acc[h]);
    }
  }
  #pragma omp parallel for schedule(static) num_threads(st->threads)
  for (int64_t e = 0; e < E; e++) {
    float *acc = thread_row(st);
    cpu_zero(acc, H);
    for (int64_t t = 0; t < T; t++) cpu_axpy(acc, dl[t * E + e], st->xf + t * H, H);
    if (a->grad_mode == MOK_GRAD_ACCUMULATE_F32) {
      float *g = (float *)a->dw_router + e * H;
      for (int64_t h = 0; h < H; h++) g[h] += acc[h];
    } else {
      uint16_t *g = (uint16_t *)a->dw_router + e * H;
      for (int64_t h = 0; h < H; h++) g[h] = f32_to_bf16(acc[h]);
    }
  }
  return MOK_OK;
}

const mok_router_ops mok_cpu_router_ops = {.init = cpu_router_init,
                                           .fini = cpu_router_fini,
                                           .forward = cpu_router_forward,
                                           .backward = cpu_router_backward};
