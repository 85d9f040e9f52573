/*
 * device.c: device copies of a test layer, poisoning, fetching and comparisons (device.h).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "check.h"
#include "device.h"

static void *dev_copy(const void *host, size_t bytes) {
  void *p = NULL;
  if (cudaMalloc(&p, bytes ? bytes : 16) != cudaSuccess) return NULL;
  if (host && cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
    cudaFree(p);
    return NULL;
  }
  return p;
}

int gpu_init(gpu_layer *d, const harness *h, int64_t T, const mok_context_config *knobs) {
  memset(d, 0, sizeof *d);
  const mok_shape *s = &h->L.shape;
  const int64_t H = s->hidden, k = s->top_k;
  d->T = T;
  d->src = h;
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  cfg.backend = MOK_BACKEND_CUDA;
  if (knobs) {
    cfg.sms = knobs->sms;
    cfg.cluster = knobs->cluster;
  }
  CHECK_OK(mok_context_create(&cfg, &d->ctx));
  if (!d->ctx) return 0;
  CHECK_OK(mok_workspace_create(d->ctx, s, &d->ws));
  if (!d->ws) return 0;
  const mok_host_layer *L = &h->L;
  d->x = dev_copy(L->x, (size_t)(T * H) * 2);
  d->dy = dev_copy(L->dy, (size_t)(T * H) * 2);
  d->ids = dev_copy(L->topk_ids, (size_t)(T * k) * 4);
  d->tw = dev_copy(L->topk_weights, (size_t)(T * k) * 4);
  const void *w[G_COUNT] = {L->w_gate, L->w_up, L->w_down, L->ws_gate, L->ws_up, L->ws_down};
  int ok = d->x && d->dy && d->ids && d->tw;
  for (int i = 0; i < G_COUNT; i++) {
    if (!h->g_len[i]) continue;
    d->w[i] = dev_copy(w[i], (size_t)h->g_len[i] * 2);
    d->g[i] = dev_copy(NULL, (size_t)h->g_len[i] * 4);
    ok = ok && d->w[i] && d->g[i];
  }
  d->saved_bytes = mok_saved_bytes(d->ws, T);
  d->y = dev_copy(NULL, (size_t)(T * H) * 2);
  d->dx = dev_copy(NULL, (size_t)(T * H) * 2);
  d->dtw = dev_copy(NULL, (size_t)(T * k) * 4);
  d->saved = dev_copy(NULL, d->saved_bytes);
  ok = ok && d->y && d->dx && d->dtw && d->saved;
  CHECK(ok, "device allocation failed");
  return ok;
}

void gpu_fini(gpu_layer *d) {
  void *all[] = {d->x, d->dy, d->ids, d->tw, d->y, d->dx, d->dtw, d->saved};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) cudaFree(all[i]);
  for (int i = 0; i < G_COUNT; i++) {
    cudaFree(d->w[i]);
    cudaFree(d->g[i]);
  }
  mok_workspace_destroy(d->ws);
  mok_context_destroy(d->ctx);
  memset(d, 0, sizeof *d);
}

mok_forward_args gpu_forward_args(const gpu_layer *d) {
  mok_forward_args a;
  memset(&a, 0, sizeof a);
  a.tokens = d->T;
  a.x = d->x;
  a.topk_ids = (const int32_t *)d->ids;
  a.topk_weights = (const float *)d->tw;
  mok_weights w = {d->w[G_GATE], d->w[G_UP], d->w[G_DOWN], d->w[GS_GATE], d->w[GS_UP],
                   d->w[GS_DOWN], NULL};
  a.w = w;
  a.y = d->y;
  a.saved = d->saved;
  return a;
}

mok_backward_args gpu_backward_args(const gpu_layer *d, mok_grad_mode mode) {
  mok_forward_args f = gpu_forward_args(d);
  mok_backward_args a;
  memset(&a, 0, sizeof a);
  a.tokens = d->T;
  a.x = d->x;
  a.topk_ids = f.topk_ids;
  a.topk_weights = f.topk_weights;
  a.w = f.w;
  a.saved = d->saved;
  a.dy = d->dy;
  a.dx = d->dx;
  a.d_topk_weights = (float *)d->dtw;
  mok_grads g = {d->g[G_GATE], d->g[G_UP], d->g[G_DOWN], d->g[GS_GATE], d->g[GS_UP],
                 d->g[GS_DOWN]};
  a.g = g;
  a.grad_mode = mode;
  return a;
}

/* Both end with the memsets done before the caller's next work: a non-blocking stream does not
 * wait for the legacy stream they ran on. */
void gpu_poison_backward(gpu_layer *d, unsigned char pattern) {
  const int64_t H = d->src->L.shape.hidden, k = d->src->L.shape.top_k;
  CUDA_CHECK(cudaMemset(d->dx, pattern, (size_t)(d->T * H) * 2));
  CUDA_CHECK(cudaMemset(d->dtw, pattern, (size_t)(d->T * k) * 4));
  for (int i = 0; i < G_COUNT; i++)
    if (d->g[i]) CUDA_CHECK(cudaMemset(d->g[i], pattern, (size_t)d->src->g_len[i] * 4));
  CUDA_CHECK(cudaDeviceSynchronize());
}

void gpu_poison(gpu_layer *d, unsigned char pattern) {
  CUDA_CHECK(cudaMemset(d->y, pattern, (size_t)(d->T * d->src->L.shape.hidden) * 2));
  CUDA_CHECK(cudaMemset(d->saved, pattern, d->saved_bytes));
  gpu_poison_backward(d, pattern);
}

void gpu_set_grads(gpu_layer *d, const harness *h) {
  for (int i = 0; i < G_COUNT; i++)
    if (d->g[i])
      CUDA_CHECK(cudaMemcpy(d->g[i], h->g[i], (size_t)h->g_len[i] * 4, cudaMemcpyHostToDevice));
}

mok_status gpu_run(gpu_layer *d, mok_grad_mode mode, cudaStream_t stream) {
  mok_forward_args f = gpu_forward_args(d);
  mok_status st = mok_forward(d->ws, &f, stream);
  if (st != MOK_OK) return st;
  mok_backward_args b = gpu_backward_args(d, mode);
  return mok_backward(d->ws, &b, stream);
}

void gpu_fetch(const gpu_layer *d, harness *h) {
  const int64_t H = h->L.shape.hidden, k = h->L.shape.top_k;
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(h->y, d->y, (size_t)(d->T * H) * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(h->dx, d->dx, (size_t)(d->T * H) * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(h->dtw, d->dtw, (size_t)(d->T * k) * 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(h->saved, d->saved, d->saved_bytes, cudaMemcpyDeviceToHost));
  for (int i = 0; i < G_COUNT; i++)
    if (d->g[i])
      CUDA_CHECK(cudaMemcpy(h->g[i], d->g[i], (size_t)h->g_len[i] * 4, cudaMemcpyDeviceToHost));
}

int same_bits(const char *what, const void *a, const void *b, size_t bytes) {
  const unsigned char *p = a, *q = b;
  for (size_t i = 0; i < bytes; i++) {
    if (p[i] != q[i]) {
      check_fail(__FILE__, __LINE__, "%s: first differing byte %zu of %zu (%02x vs %02x)", what,
                 i, bytes, p[i], q[i]);
      return 0;
    }
  }
  return 1;
}

void same_layer_bits(const char *tag, const harness *a, const harness *b, int grads) {
  const int64_t T = a->T, H = a->L.shape.hidden, k = a->L.shape.top_k;
  static const char *names[G_COUNT] = {"dw_gate", "dw_up", "dw_down",
                                       "dws_gate", "dws_up", "dws_down"};
  char what[128];
  snprintf(what, sizeof what, "%s: y", tag);
  same_bits(what, a->y, b->y, (size_t)(T * H) * 2);
  snprintf(what, sizeof what, "%s: dx", tag);
  same_bits(what, a->dx, b->dx, (size_t)(T * H) * 2);
  snprintf(what, sizeof what, "%s: d_topk_weights", tag);
  same_bits(what, a->dtw, b->dtw, (size_t)(T * k) * 4);
  for (int i = 0; i < grads; i++) {
    snprintf(what, sizeof what, "%s: %s", tag, names[i]);
    same_bits(what, a->g[i], b->g[i], (size_t)a->g_len[i] * 2);
  }
}

double rel_err_bf16(const uint16_t *out, const uint16_t *ref, size_t n) {
  rel_err r = {0, 0};
  for (size_t i = 0; i < n; i++) rel_err_add(&r, bf16_to_f32(out[i]), bf16_to_f32(ref[i]));
  return rel_err_value(&r);
}

double rel_err_f32(const float *out, const float *ref, size_t n) {
  rel_err r = {0, 0};
  for (size_t i = 0; i < n; i++) rel_err_add(&r, out[i], ref[i]);
  return rel_err_value(&r);
}

size_t nan_count_bf16(const uint16_t *p, size_t n) {
  size_t c = 0;
  for (size_t i = 0; i < n; i++) c += isnan(bf16_to_f32(p[i]));
  return c;
}
