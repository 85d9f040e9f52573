/*
 * test_router.c (GPU): the CUDA router against the CPU reference on the same inputs, and D1-D3
 * bit for bit on the GPU. Logits, weights, losses and gradients to fp32-order error; the chosen
 * experts equal except where two candidates' keys tie to float rounding (the backends' expf
 * differ in the last bit); outputs poisoned before every run, so an unwritten element shows.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"
#include "internal.h"

typedef struct rcase {
  const char *name;
  mok_router_config cfg;
  int64_t T;
  int bias;
  mok_grad_mode mode;
} rcase;

static const rcase cases[] = {
    /* cfg: max_tokens, H, E, k, scoring, n_group, topk_group, renormalize, scale */
    {"small softmax", {1000, 128, 8, 2, MOK_ROUTER_SOFTMAX, 0, 0, 0, 1.0f}, 1000, 0,
     MOK_GRAD_WRITE_BF16},
    {"fine-7b-like", {2100, 1536, 128, 8, MOK_ROUTER_SOFTMAX, 0, 0, 1, 1.0f}, 2100, 1,
     MOK_GRAD_ACCUMULATE_F32},
    {"dsv3-like", {1500, 1024, 256, 8, MOK_ROUTER_SIGMOID, 8, 4, 1, 2.5f}, 1500, 1,
     MOK_GRAD_WRITE_BF16},
};

/* Host inputs and outputs of one run. */
typedef struct rbuf {
  int64_t T, H, E, k;
  uint16_t *x, *w, *dx;
  float *bias, *g, *tw, *dw, loss[2], dloss[2];
  int32_t *ids, *counts;
  void *saved;
  size_t saved_bytes;
} rbuf;

static void rbuf_init(rbuf *b, const rcase *c, int64_t T) {
  b->T = T, b->H = c->cfg.hidden, b->E = c->cfg.experts, b->k = c->cfg.top_k;
  const int64_t H = b->H, E = b->E, k = b->k;
  b->x = test_alloc((size_t)(T * H) * 2);
  b->w = test_alloc((size_t)(E * H) * 2);
  b->dx = test_alloc((size_t)(T * H) * 2);
  mok_gen_normal_bf16(11, 1, 1.0f, b->x, (size_t)(T * H));
  mok_gen_normal_bf16(11, 2, 1.5f / sqrtf((float)H), b->w, (size_t)(E * H));
  mok_gen_normal_bf16(11, 3, 0.05f, b->dx, (size_t)(T * H)); /* the layer's dx to add to */
  b->bias = NULL;
  if (c->bias) {
    b->bias = test_alloc((size_t)E * 4);
    for (int64_t e = 0; e < E; e++) b->bias[e] = 0.02f * (float)((e * 37) % 11) - 0.1f;
  }
  b->g = test_alloc((size_t)(T * k) * 4);
  for (int64_t i = 0; i < T * k; i++) b->g[i] = (float)((i * 7919) % 2001) / 1000.0f - 1.0f;
  b->tw = test_alloc((size_t)(T * k) * 4);
  b->ids = test_alloc((size_t)(T * k) * 4);
  b->counts = test_alloc((size_t)E * 4);
  b->dw = test_alloc((size_t)(E * H) * 4);
  b->dloss[0] = 0.7f, b->dloss[1] = 0.3f;
  b->saved = NULL;
}

static void rbuf_fini(rbuf *b) {
  free(b->x), free(b->w), free(b->dx), free(b->bias), free(b->g), free(b->tw), free(b->ids);
  free(b->counts), free(b->dw), free(b->saved);
}

static void *dev_copy(const void *src, size_t n) {
  void *p = NULL;
  CUDA_CHECK(cudaMalloc(&p, n ? n : 16));
  if (src) CUDA_CHECK(cudaMemcpy(p, src, n, cudaMemcpyHostToDevice));
  return p;
}

/* Forward and backward (dx accumulated onto b->dx, dW_r onto zeros in f32 mode); outputs back in
 * b. With losses, both losses and their gradients. cuda: the CUDA backend with `sms`. */
static int run(rbuf *b, const rcase *c, int cuda, int sms, int losses) {
  mok_context_config cc = MOK_CONTEXT_CONFIG_INIT;
  cc.backend = cuda ? MOK_BACKEND_CUDA : MOK_BACKEND_CPU;
  cc.sms = sms;
  mok_context *ctx = NULL;
  mok_router *r = NULL;
  mok_router_config cfg = c->cfg;
  mok_status st = mok_context_create(&cc, &ctx);
  if (st == MOK_OK) st = mok_router_create(ctx, &cfg, &r);
  CHECK_OK(st);
  if (st != MOK_OK) return mok_context_destroy(ctx), 1;
  const int64_t T = b->T, H = b->H, E = b->E, k = b->k;
  const size_t sb = mok_router_saved_bytes(r, T), wsz = c->mode ? 4 : 2;
  free(b->saved);
  b->saved = test_alloc(sb);
  b->saved_bytes = sb;
  memset(b->dw, 0, (size_t)(E * H) * 4);
  void *x = b->x, *w = b->w, *bias = b->bias, *ids = b->ids, *tw = b->tw, *counts = b->counts;
  void *loss = b->loss, *dloss = b->dloss, *saved = b->saved, *g = b->g, *dx = b->dx;
  void *dw = b->dw;
  if (cuda) {
    x = dev_copy(b->x, (size_t)(T * H) * 2), w = dev_copy(b->w, (size_t)(E * H) * 2);
    bias = b->bias ? dev_copy(b->bias, (size_t)E * 4) : NULL;
    ids = dev_copy(NULL, (size_t)(T * k) * 4), tw = dev_copy(NULL, (size_t)(T * k) * 4);
    counts = dev_copy(NULL, (size_t)E * 4), loss = dev_copy(NULL, 8);
    dloss = dev_copy(b->dloss, 8), saved = dev_copy(NULL, sb);
    g = dev_copy(b->g, (size_t)(T * k) * 4), dx = dev_copy(b->dx, (size_t)(T * H) * 2);
    dw = dev_copy(NULL, (size_t)(E * H) * 4);
    CUDA_CHECK(cudaMemset(ids, 0xff, (size_t)(T * k) * 4));
    CUDA_CHECK(cudaMemset(tw, 0xff, (size_t)(T * k) * 4));
    CUDA_CHECK(cudaMemset(counts, 0xff, (size_t)E * 4));
    CUDA_CHECK(cudaMemset(loss, 0xff, 8));
    CUDA_CHECK(cudaMemset(dw, c->mode ? 0 : 0xff, (size_t)(E * H) * 4));
  } else {
    memset(b->ids, 0xff, (size_t)(T * k) * 4), memset(b->tw, 0xff, (size_t)(T * k) * 4);
    memset(b->counts, 0xff, (size_t)E * 4), memset(b->loss, 0xff, 8);
    if (!c->mode) memset(b->dw, 0xff, (size_t)(E * H) * 4);
  }
  float *lo = loss;
  mok_router_forward_args f = {T, x, w, bias, ids, tw, counts, losses ? lo : NULL,
                               losses ? lo + 1 : NULL, saved};
  st = mok_router_forward(r, &f, NULL);
  CHECK_OK(st);
  const float *dl = dloss;
  mok_router_backward_args bw = {T, x, w, saved, g, losses ? dl : NULL, losses ? dl + 1 : NULL,
                                 dx, 1, dw, c->mode};
  if (st == MOK_OK) st = mok_router_backward(r, &bw, NULL);
  CHECK_OK(st);
  if (cuda) {
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(b->ids, ids, (size_t)(T * k) * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b->tw, tw, (size_t)(T * k) * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b->counts, counts, (size_t)E * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b->loss, loss, 8, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b->saved, saved, sb, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b->dx, dx, (size_t)(T * H) * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b->dw, dw, (size_t)(E * H) * wsz, cudaMemcpyDeviceToHost));
    void *all[] = {x, w, bias, ids, tw, counts, loss, dloss, saved, g, dx, dw};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) cudaFree(all[i]);
  }
  mok_router_destroy(r);
  mok_context_destroy(ctx);
  return st != MOK_OK;
}

static const float *logits_of(const rbuf *b, const rcase *c) {
  const mok_router_layout L = mok_router_layout_of(&(mok_router){.cfg = c->cfg}, b->T);
  return (const float *)((const char *)b->saved + L.logits);
}

/* The key (score + bias) of expert e of token t, in float64 from the logits. */
static double key_of(const rbuf *b, const rcase *c, const float *l, int64_t e) {
  double s;
  if (c->cfg.scoring == MOK_ROUTER_SIGMOID) {
    s = 1.0 / (1.0 + exp(-(double)l[e]));
  } else {
    double m = l[0], sum = 0.0;
    for (int64_t i = 1; i < b->E; i++) m = fmax(m, l[i]);
    for (int64_t i = 0; i < b->E; i++) sum += exp(l[i] - m);
    s = exp(l[e] - m) / sum;
  }
  return s + (b->bias ? b->bias[e] : 0.0);
}

static void gpu_router_vs_cpu(void) {
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const rcase *c = &cases[ci];
    rbuf gb, cb;
    rbuf_init(&gb, c, c->T);
    rbuf_init(&cb, c, c->T);
    if (run(&gb, c, 1, 0, 1) == 0 && run(&cb, c, 0, 0, 1) == 0) {
      const int64_t T = c->T, H = gb.H, E = gb.E, k = gb.k;
      const float *lg = logits_of(&gb, c), *lc = logits_of(&cb, c);
      CHECK(rel_err_f32(lg, lc, (size_t)(T * E)) < 1e-5, "%s: logits rel err %.3g", c->name,
            rel_err_f32(lg, lc, (size_t)(T * E)));
      int64_t differ = 0, bad = 0;
      int32_t *hist = calloc((size_t)E, 4);
      for (int64_t t = 0; t < T; t++) {
        for (int64_t j = 0; j < k; j++) {
          const int32_t a = gb.ids[t * k + j], bb = cb.ids[t * k + j];
          CHECK(a >= 0 && a < E, "%s: token %lld slot %lld: id %d", c->name, (long long)t,
                (long long)j, a);
          if (a < 0 || a >= E) continue;
          hist[a]++;
          if (a == bb) continue;
          differ++;
          if (fabs(key_of(&cb, c, lc + t * E, a) - key_of(&cb, c, lc + t * E, bb)) > 1e-5) bad++;
        }
      }
      CHECK(bad == 0, "%s: %lld chosen experts differ from the CPU's with keys apart", c->name,
            (long long)bad);
      CHECK(memcmp(hist, gb.counts, (size_t)E * 4) == 0, "%s: counts are not the ids' histogram",
            c->name);
      free(hist);
      if (differ == 0) {
        CHECK(memcmp(gb.counts, cb.counts, (size_t)E * 4) == 0, "%s: counts differ", c->name);
        CHECK(rel_err_f32(gb.tw, cb.tw, (size_t)(T * k)) < 1e-5, "%s: weights rel err %.3g",
              c->name, rel_err_f32(gb.tw, cb.tw, (size_t)(T * k)));
      }
      /* A choice that differs at a tie moves two counts by one: the aux loss by ~1/(T k). */
      const float tol = differ ? 1e-3f : 1e-4f;
      for (int i = 0; i < 2; i++)
        CHECK(fabsf(gb.loss[i] - cb.loss[i]) < tol * fabsf(cb.loss[i]),
              "%s: %s %.9g, CPU %.9g", c->name, i ? "z-loss" : "aux loss", (double)gb.loss[i],
              (double)cb.loss[i]);
      const double ex = rel_err_bf16(gb.dx, cb.dx, (size_t)(T * H));
      const double ew = c->mode ? rel_err_f32(gb.dw, cb.dw, (size_t)(E * H))
                                : rel_err_bf16((uint16_t *)gb.dw, (uint16_t *)cb.dw,
                                               (size_t)(E * H));
      CHECK(ex < 1e-2, "%s: dx rel err %.3g", c->name, ex);
      CHECK(ew < (c->mode ? 1e-4 : 1e-2), "%s: dW_r rel err %.3g", c->name, ew);
      CHECK(nan_count_bf16(gb.dx, (size_t)(T * H)) == 0, "%s: NaN in dx", c->name);
      printf("     %s: %lld near-tie choices differ; dx %.1e, dW_r %.1e\n", c->name,
             (long long)differ, ex, ew);
    }
    rbuf_fini(&gb);
    rbuf_fini(&cb);
  }
}

/* D1 (two runs), D2 (sms 16 against all) and D3 (the last 100 tokens alone) on the GPU. */
static void gpu_router_determinism(void) {
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const rcase *c = &cases[ci];
    rbuf a, b;
    rbuf_init(&a, c, c->T);
    rbuf_init(&b, c, c->T);
    if (run(&a, c, 1, 0, 1) == 0 && run(&b, c, 1, 16, 1) == 0) {
      const int64_t T = c->T, H = a.H, E = a.E, k = a.k;
      same_bits("D1/D2 topk_ids", a.ids, b.ids, (size_t)(T * k) * 4);
      same_bits("D1/D2 topk_weights", a.tw, b.tw, (size_t)(T * k) * 4);
      same_bits("D1/D2 counts", a.counts, b.counts, (size_t)E * 4);
      same_bits("D1/D2 losses", a.loss, b.loss, 8);
      same_bits("D1/D2 logits", logits_of(&a, c), logits_of(&b, c), (size_t)(T * E) * 4);
      same_bits("D1/D2 dx", a.dx, b.dx, (size_t)(T * H) * 2);
      same_bits("D1/D2 dW_r", a.dw, b.dw, (size_t)(E * H) * (c->mode ? 4 : 2));
      /* D3: without the losses (whose gradients depend on the batch, as they must). */
      rbuf full, sub;
      rbuf_init(&full, c, c->T);
      rbuf_init(&sub, c, 100);
      const int64_t off = T - 100;
      memcpy(sub.x, full.x + off * H, (size_t)(100 * H) * 2);
      memcpy(sub.dx, full.dx + off * H, (size_t)(100 * H) * 2);
      memcpy(sub.g, full.g + off * k, (size_t)(100 * k) * 4);
      if (run(&full, c, 1, 0, 0) == 0 && run(&sub, c, 1, 0, 0) == 0) {
        same_bits("D3 topk_ids", sub.ids, full.ids + off * k, (size_t)(100 * k) * 4);
        same_bits("D3 topk_weights", sub.tw, full.tw + off * k, (size_t)(100 * k) * 4);
        same_bits("D3 dx", sub.dx, full.dx + off * H, (size_t)(100 * H) * 2);
      }
      rbuf_fini(&full);
      rbuf_fini(&sub);
    }
    rbuf_fini(&a);
    rbuf_fini(&b);
  }
}

const test_case tests_gpu_router[] = {
    {"gpu/router_vs_cpu", gpu_router_vs_cpu},
    {"gpu/router_determinism_d1_d2_d3", gpu_router_determinism},
    {NULL, NULL},
};
