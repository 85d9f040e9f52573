/*
 * layout.c: the layout of the per-call `saved` buffers (the layer's and the router's) and of the
 * FP8 weight buffer. Sizes and offsets are computed here and nowhere else; backends carve their
 * pointers from the returned structs.
 */
#include "fp8.h"
#include "internal.h"

/* Routed rows on this rank, padding included: every non-empty expert pads its segment by at most
 * MOK_TILE_M - 1 rows, and at most min(E_local, rows) experts are non-empty. The worst case takes
 * every slot of this call (ep = 1) or of every rank's largest call (ep > 1: peers may pass up to
 * max_tokens); shape.routed_rows, when set, caps it. */
static int64_t rows_capacity(const mok_workspace *ws, int64_t tokens) {
  const int ep = ws->ctx->cfg.ep_size;
  const int64_t rows = (ep == 1 ? tokens : ws->shape.max_tokens) * ws->shape.top_k * ep;
  const int64_t pads = mok_min64(ws->experts_local, rows) * (MOK_TILE_M - 1);
  int64_t cap = mok_round_up(rows + pads, MOK_TILE_M);
  if (ws->shape.routed_rows > 0)
    cap = mok_min64(cap, mok_round_up(ws->shape.routed_rows, MOK_TILE_M));
  return cap;
}

mok_saved_layout mok_saved_layout_of(const mok_workspace *ws, int64_t tokens) {
  const mok_shape *s = &ws->shape;
  mok_saved_layout L;
  size_t c = 0;
  L.tokens = tokens;
  L.rows_cap = rows_capacity(ws, tokens);
  L.status = mok_take(&c, MOK_STATUS_WORDS * sizeof(int32_t));
  L.tag = mok_take(&c, sizeof(uint64_t));
  L.counts = mok_take(&c, ws->experts_local * (int64_t)sizeof(int32_t));
  L.offsets = mok_take(&c, (ws->experts_local + 1) * (int64_t)sizeof(int32_t));
  L.row_src = mok_take(&c, L.rows_cap * (int64_t)sizeof(int32_t));
  L.row_weight = mok_take(&c, L.rows_cap * (int64_t)sizeof(float));
  L.slot_row = mok_take(&c, tokens * s->top_k * (int64_t)sizeof(int32_t));
  L.mblock_expert = mok_take(&c, L.rows_cap / MOK_TILE_M * (int64_t)sizeof(int32_t));
  L.gu = mok_take(&c, L.rows_cap * 2 * s->inter * 2);
  L.hw = mok_take(&c, L.rows_cap * s->inter * 2);
  L.gus = mok_take(&c, tokens * 2 * s->shared_inter * 2);
  L.hs = mok_take(&c, tokens * s->shared_inter * 2);
  L.bytes = c;
  return L;
}

mok_fp8_layout mok_fp8_layout_of(const mok_workspace *ws) {
  const mok_shape *s = &ws->shape;
  const int64_t H = s->hidden, I = s->inter, Is = s->shared_inter, E = ws->experts_local;
  const int on = s->precision == MOK_FP8, shared = on && Is > 0;
  /* [E, N, K] of each tensor, in MOK_W_* order */
  const int64_t dims[MOK_W_COUNT][3] = {{E, I, H},  {E, I, H},  {E, H, I},
                                        {1, Is, H}, {1, Is, H}, {1, H, Is}};
  mok_fp8_layout L;
  size_t c = 0;
  for (int i = 0; i < MOK_W_COUNT; i++) {
    mok_fp8_matrix_layout *m = &L.m[i];
    const int here = i < MOK_WS_GATE ? on : shared;
    m->experts = here ? dims[i][0] : 0;
    m->n = dims[i][1];
    m->k = dims[i][2];
    const int64_t codes = m->experts * m->n * m->k;
    const int64_t blocks = m->experts * ((m->n + MOK_FP8_GROUP - 1) / MOK_FP8_GROUP) *
                           ((m->k + MOK_FP8_GROUP - 1) / MOK_FP8_GROUP);
    m->q = mok_take(&c, codes);
    m->qt = mok_take(&c, codes);
    m->s = mok_take(&c, blocks * (int64_t)sizeof(float));
  }
  L.bytes = on ? c : 0;
  return L;
}

mok_router_layout mok_router_layout_of(const mok_router *r, int64_t tokens) {
  const mok_router_config *c = &r->cfg;
  mok_router_layout L;
  size_t at = 0;
  L.counts = mok_take(&at, c->experts * (int64_t)sizeof(int32_t));
  L.ids = mok_take(&at, tokens * c->top_k * (int64_t)sizeof(int32_t));
  L.logits = mok_take(&at, tokens * c->experts * (int64_t)sizeof(float));
  L.bytes = at;
  return L;
}

uint32_t mok_saved_ident(const mok_workspace *ws) {
  const mok_shape *s = &ws->shape;
  const int ep = ws->ctx->cfg.ep_size;
  const int64_t v[] = {ep == 1 ? 0 : s->max_tokens, s->hidden, s->inter, s->shared_inter,
                       s->experts, s->top_k, s->precision, s->routed_rows, ep,
                       ws->ctx->cfg.ep_rank};
  uint32_t h = 0;
  for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
    h = mok_mix32(h ^ mok_mix32((uint32_t)v[i]) ^ (uint32_t)(v[i] >> 32) * 0x9e3779b9u);
  return h;
}

uint32_t mok_routing_sum(const int32_t *ids, const float *weights, int64_t slots) {
  uint32_t sum = 0;
  for (int64_t q = 0; q < slots; q++)
    sum += mok_sum_term(MOK_SUM_IDS, q, (uint32_t)ids[q]) +
           mok_sum_term_f(MOK_SUM_WEIGHTS, q, weights[q]);
  return sum;
}

/* Adds the terms of n int32 values. */
static uint32_t sum_i32(uint32_t array, const char *at, int64_t n) {
  const int32_t *p = (const int32_t *)at;
  uint32_t sum = 0;
  for (int64_t i = 0; i < n; i++) sum += mok_sum_term(array, i, (uint32_t)p[i]);
  return sum;
}

uint32_t mok_schedule_sum(const mok_workspace *ws, const void *saved, int64_t tokens) {
  const mok_saved_layout L = mok_saved_layout_of(ws, tokens);
  const char *b = (const char *)saved;
  const int64_t E = ws->experts_local;
  const float *rw = (const float *)(b + L.row_weight);
  uint32_t sum = sum_i32(MOK_SUM_COUNTS, b + L.counts, E) +
                 sum_i32(MOK_SUM_OFFSETS, b + L.offsets, E + 1) +
                 sum_i32(MOK_SUM_ROW_SRC, b + L.row_src, L.rows_cap) +
                 sum_i32(MOK_SUM_SLOT_ROW, b + L.slot_row, tokens * ws->shape.top_k) +
                 sum_i32(MOK_SUM_MBLOCK, b + L.mblock_expert, L.rows_cap / MOK_TILE_M);
  for (int64_t r = 0; r < L.rows_cap; r++) sum += mok_sum_term_f(MOK_SUM_ROW_WEIGHT, r, rw[r]);
  return sum;
}
