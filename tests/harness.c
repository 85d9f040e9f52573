/*
 * harness.c: the shared set-up of the CPU tests (see harness.h).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "harness.h"
#include "internal.h"

void *test_alloc(size_t bytes) {
  size_t n = (bytes + 255) / 256 * 256;
  return aligned_alloc(256, n ? n : 256);
}

int harness_init(harness *h, const mok_shape *shape, int64_t T, uint64_t seed, int threads) {
  memset(h, 0, sizeof *h);
  h->T = T;
  mok_status st = mok_host_layer_create(shape, T, seed, &h->L);
  CHECK(st == MOK_OK, "mok_host_layer_create: %s", mok_last_error());
  if (st != MOK_OK) return 0;
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  cfg.threads = threads;
  CHECK_OK(mok_context_create(&cfg, &h->ctx));
  if (!h->ctx) return 0;
  CHECK_OK(mok_workspace_create(h->ctx, shape, &h->ws));
  if (!h->ws) return 0;
  const int64_t H = shape->hidden, I = shape->inter, Is = shape->shared_inter;
  const int64_t E = shape->experts, k = shape->top_k;
  h->saved_bytes = mok_saved_bytes(h->ws, T);
  h->saved = test_alloc(h->saved_bytes);
  h->y = test_alloc((size_t)(T * H) * 2);
  h->dx = test_alloc((size_t)(T * H) * 2);
  h->dtw = test_alloc((size_t)(T * k) * 4);
  const int64_t len[G_COUNT] = {E * I * H, E * I * H, E * H * I, Is * H, Is * H, H * Is};
  int ok = h->saved && h->y && h->dx && h->dtw;
  for (int i = 0; i < G_COUNT; i++) {
    h->g_len[i] = len[i];
    if (len[i]) ok = ok && (h->g[i] = test_alloc((size_t)len[i] * 4)) != NULL;
  }
  if (ok && shape->precision == MOK_FP8) {
    ok = (h->fp8 = test_alloc(mok_fp8_weights_bytes(h->ws))) != NULL;
    if (ok) harness_quantize(h);
  }
  CHECK(ok, "out of host memory");
  return ok;
}

void harness_quantize(harness *h) {
  if (!h->fp8) return;
  const mok_weights w = mok_host_layer_weights(&h->L);
  CHECK_OK(mok_quantize_weights(h->ws, &w, h->fp8, NULL));
}

mok_weights harness_weights(const harness *h) {
  if (!h->fp8) return mok_host_layer_weights(&h->L);
  mok_weights w = {NULL, NULL, NULL, NULL, NULL, NULL, h->fp8};
  return w;
}

void harness_fini(harness *h) {
  mok_workspace_destroy(h->ws);
  mok_context_destroy(h->ctx);
  mok_host_layer_destroy(&h->L);
  free(h->saved);
  free(h->y);
  free(h->dx);
  free(h->dtw);
  free(h->fp8);
  for (int i = 0; i < G_COUNT; i++) free(h->g[i]);
  memset(h, 0, sizeof *h);
}

mok_forward_args harness_forward_args(const harness *h) {
  mok_forward_args a = {h->T, h->L.x, h->L.topk_ids, h->L.topk_weights, harness_weights(h),
                        h->y, h->saved};
  return a;
}

mok_backward_args harness_backward_args(const harness *h, mok_grad_mode mode) {
  mok_backward_args a;
  memset(&a, 0, sizeof a);
  a.tokens = h->T;
  a.x = h->L.x;
  a.topk_ids = h->L.topk_ids;
  a.topk_weights = h->L.topk_weights;
  a.w = harness_weights(h);
  a.saved = h->saved;
  a.dy = h->L.dy;
  a.dx = h->dx;
  a.d_topk_weights = h->dtw;
  mok_grads g = {h->g[G_GATE], h->g[G_UP], h->g[G_DOWN], h->g[GS_GATE], h->g[GS_UP],
                 h->g[GS_DOWN]};
  a.g = g;
  a.grad_mode = mode;
  return a;
}

void harness_poison(harness *h, unsigned char pattern) {
  const int64_t H = h->L.shape.hidden, k = h->L.shape.top_k;
  memset(h->y, pattern, (size_t)(h->T * H) * 2);
  memset(h->dx, pattern, (size_t)(h->T * H) * 2);
  memset(h->dtw, pattern, (size_t)(h->T * k) * 4);
  memset(h->saved, pattern, h->saved_bytes);
  for (int i = 0; i < G_COUNT; i++)
    if (h->g[i]) memset(h->g[i], pattern, (size_t)h->g_len[i] * 4);
}

mok_status harness_run(harness *h, mok_grad_mode mode) {
  mok_forward_args f = harness_forward_args(h);
  mok_status st = mok_forward(h->ws, &f, NULL);
  if (st != MOK_OK) return st;
  mok_backward_args b = harness_backward_args(h, mode);
  return mok_backward(h->ws, &b, NULL);
}

double rel_err_value(const rel_err *r) {
  if (r->ref2 == 0.0) return r->diff2 == 0.0 ? 0.0 : INFINITY;
  return sqrt(r->diff2 / r->ref2);
}

int64_t slot_row_first_wrong(const mok_workspace *ws, const void *saved, int64_t tokens,
                             const int32_t *ids, int rank, int64_t experts_local) {
  const mok_saved_layout S = mok_saved_layout_of(ws, tokens);
  const int32_t *slot_row = (const int32_t *)((const char *)saved + S.slot_row);
  const int32_t *row_src = (const int32_t *)((const char *)saved + S.row_src);
  const int64_t k = ws->shape.top_k, slots_cap = ws->shape.max_tokens * k;
  for (int64_t q = 0; q < tokens * k; q++) {
    const int32_t row = slot_row[q];
    const int ok = ids[q] / experts_local == rank
                       ? row >= 0 && row < S.rows_cap && row_src[row] == rank * slots_cap + q
                       : row == -1;
    if (!ok) return q;
  }
  return -1;
}
