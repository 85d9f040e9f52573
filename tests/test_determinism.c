/*
 * test_determinism.c: DESIGN.md §3 on the CPU backend, bit for bit.
 *   D1: two runs of the same inputs give the same outputs, gradients and `saved`.
 *   D2: the thread count (the CPU backend's knob) changes no bit: 1, 2 and 3 threads.
 *   D3: a token's y, dx and d_topk_weights are the same in a sub-batch (with another max_tokens).
 *   Recompute fills `saved` exactly as forward does, and backward from either is the same.
 * Each at MOK_BF16 and at MOK_FP8 (DESIGN §8: the quantizations are per token, per row or per
 * expert segment, so D3 holds for y, dx and d_topk_weights too). A mismatch names the first
 * differing element.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "harness.h"
#include "internal.h"

/* Index of the first differing byte-element of size `elem`, or -1. */
static int64_t first_diff(const void *a, const void *b, int64_t n, size_t elem) {
  const char *p = a, *q = b;
  for (int64_t i = 0; i < n; i++)
    if (memcmp(p + (size_t)i * elem, q + (size_t)i * elem, elem) != 0) return i;
  return -1;
}

#define SAME(what, a, b, n, elem)                                                      \
  do {                                                                                 \
    int64_t at_ = first_diff((a), (b), (n), (elem));                                   \
    CHECK(at_ < 0, "%s: first difference at element %lld", (what), (long long)at_);   \
  } while (0)

static const mok_shape bf16_shape = {96, 160, 96, 64, 8, 4, MOK_BF16, 0};
static const mok_shape fp8_shape = {96, 160, 96, 64, 8, 4, MOK_FP8, 0};

/* Every output of a run of h, kept for comparison. */
typedef struct outputs {
  uint16_t *y, *dx;
  float *dtw;
  void *g[G_COUNT];
  void *saved;
} outputs;

static void keep(outputs *o, const harness *h) {
  const int64_t TH = h->T * h->L.shape.hidden, Tk = h->T * h->L.shape.top_k;
  o->y = malloc((size_t)TH * 2), memcpy(o->y, h->y, (size_t)TH * 2);
  o->dx = malloc((size_t)TH * 2), memcpy(o->dx, h->dx, (size_t)TH * 2);
  o->dtw = malloc((size_t)Tk * 4), memcpy(o->dtw, h->dtw, (size_t)Tk * 4);
  o->saved = malloc(h->saved_bytes), memcpy(o->saved, h->saved, h->saved_bytes);
  for (int g = 0; g < G_COUNT; g++) {
    o->g[g] = malloc((size_t)h->g_len[g] * 4 + 1);
    memcpy(o->g[g], h->g[g] ? h->g[g] : o->g[g], (size_t)h->g_len[g] * 4);
  }
}

static void drop(outputs *o) {
  free(o->y), free(o->dx), free(o->dtw), free(o->saved);
  for (int g = 0; g < G_COUNT; g++) free(o->g[g]);
}

/* The fields of `saved` that the contract defines (the alignment gaps between them are not). */
static void same_saved(const harness *h, const void *a, const void *b, const char *what) {
  const mok_saved_layout L = mok_saved_layout_of(h->ws, h->T);
  const int64_t E = h->L.shape.experts, I = h->L.shape.inter, Is = h->L.shape.shared_inter;
  const struct {
    const char *name;
    size_t at;
    int64_t bytes;
  } f[] = {{"header", L.status, MOK_STATUS_WORDS * 4},
           {"counts", L.counts, E * 4},
           {"offsets", L.offsets, (E + 1) * 4},
           {"row_src", L.row_src, L.rows_cap * 4},
           {"row_weight", L.row_weight, L.rows_cap * 4},
           {"slot_row", L.slot_row, h->T * h->L.shape.top_k * 4},
           {"mblock_expert", L.mblock_expert, L.rows_cap / MOK_TILE_M * 4},
           {"gu", L.gu, L.rows_cap * 2 * I * 2},
           {"hw", L.hw, L.rows_cap * I * 2},
           {"gus", L.gus, h->T * 2 * Is * 2},
           {"hs", L.hs, h->T * Is * 2}};
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
    int64_t at = first_diff((const char *)a + f[i].at, (const char *)b + f[i].at, f[i].bytes, 1);
    CHECK(at < 0, "%s: saved.%s differs first at byte %lld", what, f[i].name, (long long)at);
  }
}

/* grad_bytes: 2 (bf16 grads), 4 (fp32 main grads) or 0 (do not compare grads). */
static void same_outputs(const harness *h, const outputs *o, const char *what, size_t grad_bytes) {
  const int64_t TH = h->T * h->L.shape.hidden, Tk = h->T * h->L.shape.top_k;
  char name[128];
  snprintf(name, sizeof name, "%s: y", what);
  SAME(name, o->y, h->y, TH, 2);
  snprintf(name, sizeof name, "%s: dx", what);
  SAME(name, o->dx, h->dx, TH, 2);
  snprintf(name, sizeof name, "%s: d_topk_weights", what);
  SAME(name, o->dtw, h->dtw, Tk, 4);
  for (int g = 0; grad_bytes && g < G_COUNT; g++) {
    snprintf(name, sizeof name, "%s: weight grad %d", what, g);
    SAME(name, o->g[g], h->g[g], h->g_len[g], grad_bytes);
  }
  same_saved(h, o->saved, h->saved, what);
}

/* D1 and D2: runs with 0 (all), 1, 2 and 3 threads, in both grad modes (main grads start at 0). */
static void repeat_and_threads(const mok_shape *s) {
  const mok_shape shape = *s;
  for (int mode = 0; mode < 2; mode++) {
    outputs first;
    int have = 0;
    const int threads[] = {0, 0, 1, 2, 3};
    for (int r = 0; r < 5; r++) {
      harness h;
      if (harness_init(&h, &shape, 96, 500 + (uint64_t)mode, threads[r])) {
        harness_poison(&h, (unsigned char)(0x11 * (r + 1)));
        for (int g = 0; g < G_COUNT && mode; g++)
          if (h.g[g]) memset(h.g[g], 0, (size_t)h.g_len[g] * 4);
        CHECK_OK(harness_run(&h, (mok_grad_mode)mode));
        if (!have) {
          keep(&first, &h), have = 1;
        } else {
          char what[64];
          snprintf(what, sizeof what, "mode %d, run %d (%d threads)", mode, r, threads[r]);
          same_outputs(&h, &first, what, mode ? 4 : 2);
        }
      }
      harness_fini(&h);
    }
    if (have) drop(&first);
  }
}

/* Recompute into a differently poisoned `saved` gives forward's bits, and backward from it gives
 * the same gradients. */
static void recompute_matches_forward(const mok_shape *s) {
  const mok_shape shape = *s;
  harness h;
  if (harness_init(&h, &shape, 80, 601, 0)) {
    harness_poison(&h, 0x3C);
    CHECK_OK(harness_run(&h, MOK_GRAD_WRITE_BF16));
    outputs o;
    keep(&o, &h);
    harness_poison(&h, 0xC3);
    mok_forward_args f = harness_forward_args(&h);
    f.y = NULL;
    CHECK_OK(mok_recompute(h.ws, &f, NULL));
    same_saved(&h, o.saved, h.saved, "recompute");
    mok_backward_args b = harness_backward_args(&h, MOK_GRAD_WRITE_BF16);
    CHECK_OK(mok_backward(h.ws, &b, NULL));
    memcpy(h.y, o.y, (size_t)(h.T * shape.hidden) * 2); /* recompute computes no y */
    same_outputs(&h, &o, "backward after recompute", 2);
    drop(&o);
  }
  harness_fini(&h);
}

/* D3: tokens picked from a batch, run alone in a smaller batch (and workspace), keep their bits. */
static void batch_subset(const mok_shape *s) {
  const mok_shape shape = *s;
  const int64_t T = 96, pick[] = {0, 5, 6, 17, 40, 41, 63, 95};
  const int64_t n = sizeof pick / sizeof pick[0], H = shape.hidden, k = shape.top_k;
  harness full, part;
  mok_shape small = shape;
  small.max_tokens = 11;
  int ok = harness_init(&full, &shape, T, 701, 0) && harness_init(&part, &small, n, 702, 1);
  if (ok) {
    CHECK_OK(harness_run(&full, MOK_GRAD_WRITE_BF16));
    mok_host_layer *a = &full.L, *b = &part.L;
    const int64_t E = shape.experts, I = shape.inter, Is = shape.shared_inter;
    memcpy(b->w_gate, a->w_gate, (size_t)(E * I * H) * 2);
    memcpy(b->w_up, a->w_up, (size_t)(E * I * H) * 2);
    memcpy(b->w_down, a->w_down, (size_t)(E * H * I) * 2);
    memcpy(b->ws_gate, a->ws_gate, (size_t)(Is * H) * 2);
    memcpy(b->ws_up, a->ws_up, (size_t)(Is * H) * 2);
    memcpy(b->ws_down, a->ws_down, (size_t)(H * Is) * 2);
    for (int64_t i = 0; i < n; i++) {
      memcpy(b->x + i * H, a->x + pick[i] * H, (size_t)H * 2);
      memcpy(b->dy + i * H, a->dy + pick[i] * H, (size_t)H * 2);
      memcpy(b->topk_ids + i * k, a->topk_ids + pick[i] * k, (size_t)k * 4);
      memcpy(b->topk_weights + i * k, a->topk_weights + pick[i] * k, (size_t)k * 4);
    }
    harness_quantize(&part);
    CHECK_OK(harness_run(&part, MOK_GRAD_WRITE_BF16));
    for (int64_t i = 0; i < n; i++) {
      char what[64];
      snprintf(what, sizeof what, "token %lld: y", (long long)pick[i]);
      SAME(what, full.y + pick[i] * H, part.y + i * H, H, 2);
      snprintf(what, sizeof what, "token %lld: dx", (long long)pick[i]);
      SAME(what, full.dx + pick[i] * H, part.dx + i * H, H, 2);
      snprintf(what, sizeof what, "token %lld: d_topk_weights", (long long)pick[i]);
      SAME(what, full.dtw + pick[i] * k, part.dtw + i * k, k, 4);
    }
  }
  harness_fini(&full);
  harness_fini(&part);
}

static void repeat_and_threads_bf16(void) { repeat_and_threads(&bf16_shape); }
static void recompute_bf16(void) { recompute_matches_forward(&bf16_shape); }
static void batch_subset_bf16(void) { batch_subset(&bf16_shape); }
static void repeat_and_threads_fp8(void) { repeat_and_threads(&fp8_shape); }
static void recompute_fp8(void) { recompute_matches_forward(&fp8_shape); }
static void batch_subset_fp8(void) { batch_subset(&fp8_shape); }

const test_case tests_determinism[] = {
    {"cpu/determinism_repeat_and_threads", repeat_and_threads_bf16},
    {"cpu/determinism_recompute", recompute_bf16},
    {"cpu/determinism_batch_subset", batch_subset_bf16},
    {"fp8/cpu_determinism_repeat_and_threads", repeat_and_threads_fp8},
    {"fp8/cpu_determinism_recompute", recompute_fp8},
    {"fp8/cpu_determinism_batch_subset", batch_subset_fp8},
    {NULL, NULL}};
