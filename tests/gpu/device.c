/*
 * device.c: device copies of a test layer, poisoning, fetching and comparisons (device.h).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "check.h"
#include "device.h"
#include "internal.h"

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
  if (s->precision == MOK_FP8) { /* the FP8 weights, quantized on the GPU */
    d->fp8 = dev_copy(NULL, mok_fp8_weights_bytes(d->ws));
    mok_weights bw = {d->w[G_GATE], d->w[G_UP], d->w[G_DOWN], d->w[GS_GATE], d->w[GS_UP],
                      d->w[GS_DOWN], NULL};
    ok = ok && d->fp8;
    if (ok) CHECK_OK(mok_quantize_weights(d->ws, &bw, d->fp8, 0));
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
  void *all[] = {d->x, d->dy, d->ids, d->tw, d->y, d->dx, d->dtw, d->saved, d->fp8};
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
  mok_weights w8 = {NULL, NULL, NULL, NULL, NULL, NULL, d->fp8};
  a.w = d->fp8 ? w8 : w; /* MOK_FP8 reads the FP8 buffer alone */
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

/* ---- the layer's comparisons, shared by the GPU test files ---------------------------------- */
mok_shape shape_of(int64_t T, int64_t H, int64_t I, int64_t Is, int E, int k) {
  mok_shape s = MOK_SHAPE_INIT;
  s.max_tokens = T;
  s.hidden = H;
  s.inter = I;
  s.shared_inter = Is;
  s.experts = E;
  s.top_k = k;
  return s;
}


/* Deterministic fp32 starting values for accumulate-mode gradients. */
void fill_grads(harness *h) {
  for (int i = 0; i < G_COUNT; i++)
    for (int64_t j = 0; j < h->g_len[i]; j++)
      ((float *)h->g[i])[j] = (float)((j * 2654435761u) % 2001) * 1e-4f - 0.1f;
}

int64_t grad_bytes(const harness *h, int i, mok_grad_mode mode) {
  return h->g_len[i] * (mode == MOK_GRAD_ACCUMULATE_F32 ? 4 : 2);
}


const char *grad_name[G_COUNT] = {"dw_gate", "dw_up", "dw_down",
                                         "dws_gate", "dws_up", "dws_down"};


/* Every output of `out` (GPU) against `ref` (CPU) by relative error, plus NaN checks. */
void compare_outputs(const char *tag, const harness *out, const harness *ref,
                            mok_grad_mode mode) {
  const mok_shape *s = &ref->L.shape;
  const size_t TH = (size_t)(ref->T * s->hidden), Tk = (size_t)(ref->T * s->top_k);
  double e;
  CHECK(nan_count_bf16(out->y, TH) == 0, "%s: y has %zu unwritten/NaN", tag,
        nan_count_bf16(out->y, TH));
  CHECK((e = rel_err_bf16(out->y, ref->y, TH)) < GPU_TOL, "%s: y rel err %.3g", tag, e);
  CHECK((e = rel_err_bf16(out->dx, ref->dx, TH)) < GPU_TOL, "%s: dx rel err %.3g", tag, e);
  CHECK((e = rel_err_f32(out->dtw, ref->dtw, Tk)) < GPU_TOL, "%s: d_topk_weights rel err %.3g", tag,
        e);
  for (int i = 0; i < G_COUNT; i++) {
    if (!ref->g_len[i]) continue;
    size_t n = (size_t)ref->g_len[i];
    e = mode == MOK_GRAD_ACCUMULATE_F32 ? rel_err_f32(out->g[i], ref->g[i], n)
                                        : rel_err_bf16(out->g[i], ref->g[i], n);
    CHECK(e < GPU_TOL, "%s: %s rel err %.3g", tag, grad_name[i], e);
  }
  /* The saved activations: gu, hw and the shared expert's gus. */
  mok_saved_layout S = mok_saved_layout_of(ref->ws, ref->T);
  const int32_t *off = (const int32_t *)((const char *)ref->saved + S.offsets);
  size_t rows = (size_t)off[ref->ws->experts_local];
  const char *a = out->saved, *b = ref->saved;
  CHECK((e = rel_err_bf16((const uint16_t *)(a + S.gu), (const uint16_t *)(b + S.gu),
                          rows * 2 * s->inter)) < GPU_TOL, "%s: saved gu rel err %.3g", tag, e);
  CHECK((e = rel_err_bf16((const uint16_t *)(a + S.hw), (const uint16_t *)(b + S.hw),
                          rows * s->inter)) < GPU_TOL, "%s: saved hw rel err %.3g", tag, e);
  if (s->shared_inter) {
    CHECK((e = rel_err_bf16((const uint16_t *)(a + S.gus), (const uint16_t *)(b + S.gus),
                            TH / s->hidden * 2 * s->shared_inter)) < GPU_TOL,
          "%s: saved gus rel err %.3g", tag, e);
  }
}


/* The schedule fields of two saved buffers are identical (integers and copied weights). */
void compare_schedule(const char *tag, const harness *out, const harness *ref) {
  mok_saved_layout S = mok_saved_layout_of(ref->ws, ref->T);
  const char *a = out->saved, *b = ref->saved;
  char what[160];
  int64_t E = ref->ws->experts_local;
  snprintf(what, sizeof what, "%s: header", tag); /* identity and sums: the CPU's words */
  same_bits(what, a + S.status, b + S.status, MOK_STATUS_WORDS * 4);
  snprintf(what, sizeof what, "%s: counts", tag);
  same_bits(what, a + S.counts, b + S.counts, (size_t)E * 4);
  snprintf(what, sizeof what, "%s: offsets", tag);
  same_bits(what, a + S.offsets, b + S.offsets, (size_t)(E + 1) * 4);
  snprintf(what, sizeof what, "%s: row_src", tag);
  same_bits(what, a + S.row_src, b + S.row_src, (size_t)S.rows_cap * 4);
  snprintf(what, sizeof what, "%s: row_weight", tag);
  same_bits(what, a + S.row_weight, b + S.row_weight, (size_t)S.rows_cap * 4);
  snprintf(what, sizeof what, "%s: slot_row", tag);
  same_bits(what, a + S.slot_row, b + S.slot_row, (size_t)ref->T * ref->ws->shape.top_k * 4);
  snprintf(what, sizeof what, "%s: mblock_expert", tag);
  same_bits(what, a + S.mblock_expert, b + S.mblock_expert, (size_t)S.rows_cap / 128 * 4);
}


/* Outputs of two runs are the same to the bit (y, dx, d_topk_weights, gradients). */
void compare_bits(const char *tag, const harness *a, const harness *b, mok_grad_mode mode) {
  const mok_shape *s = &a->L.shape;
  char what[160];
  snprintf(what, sizeof what, "%s: y", tag);
  same_bits(what, a->y, b->y, (size_t)(a->T * s->hidden) * 2);
  snprintf(what, sizeof what, "%s: dx", tag);
  same_bits(what, a->dx, b->dx, (size_t)(a->T * s->hidden) * 2);
  snprintf(what, sizeof what, "%s: d_topk_weights", tag);
  same_bits(what, a->dtw, b->dtw, (size_t)(a->T * s->top_k) * 4);
  for (int i = 0; i < G_COUNT; i++) {
    if (!a->g_len[i]) continue;
    snprintf(what, sizeof what, "%s: %s", tag, grad_name[i]);
    same_bits(what, a->g[i], b->g[i], (size_t)grad_bytes(a, i, mode));
  }
}


/* Runs the layer on the CPU (into ref) and the GPU (into out), both from poisoned outputs.
 * Returns 0, after recording the failure, when the GPU layer could not be set up: then there is
 * nothing to compare (ref's poisoned offsets are no row count). */
int run_both(harness *ref, harness *out, mok_grad_mode mode,
                    const mok_context_config *knobs) {
  gpu_layer d;
  if (!gpu_init(&d, ref, ref->T, knobs)) {
    gpu_fini(&d);
    return 0;
  }
  harness_poison(ref, 0xff);
  if (mode == MOK_GRAD_ACCUMULATE_F32) fill_grads(ref);
  gpu_poison(&d, 0xff);
  if (mode == MOK_GRAD_ACCUMULATE_F32) gpu_set_grads(&d, ref);
  CHECK_OK(harness_run(ref, mode));
  CHECK_OK(gpu_run(&d, mode, 0));
  gpu_fetch(&d, out);
  CHECK_OK(mok_check(d.ws, 0));
  gpu_fini(&d);
  return 1;
}


/* Runs the GPU layer on h's inputs with the tuning knobs of `knobs` (NULL: defaults) into `out`. */
void gpu_once(harness *h, harness *out, const mok_context_config *knobs,
                     mok_grad_mode mode) {
  gpu_layer d;
  if (gpu_init(&d, h, h->T, knobs)) {
    gpu_poison(&d, 0xff);
    if (mode == MOK_GRAD_ACCUMULATE_F32) gpu_set_grads(&d, h);
    CHECK_OK(gpu_run(&d, mode, 0));
    gpu_fetch(&d, out);
  }
  gpu_fini(&d);
}

