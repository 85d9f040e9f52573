/*
 * gen.c: seeded, counter-based random inputs (see mok_gen.h). A value depends only on
 * (seed, stream, index), through splitmix64 and Box-Muller in double precision.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "internal.h"
#include "mok_gen.h"

static uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* The pair (z0, z1) of standard normals number p of (seed, stream). */
static void normal_pair(uint64_t seed, uint64_t stream, uint64_t p, double *z0, double *z1) {
  uint64_t r = splitmix64(splitmix64(seed ^ splitmix64(stream)) + p);
  double u1 = ((double)(r >> 40) + 1.0) / 16777216.0;          /* (0, 1] */
  double u2 = (double)((r >> 16) & 0xffffffull) / 16777216.0;  /* [0, 1) */
  double rad = sqrt(-2.0 * log(u1));
  *z0 = rad * cos(6.283185307179586 * u2);
  *z1 = rad * sin(6.283185307179586 * u2);
}

void mok_gen_normal_bf16(uint64_t seed, uint64_t stream, float scale, uint16_t *out, size_t n) {
  #pragma omp parallel for schedule(static)
  for (size_t p = 0; p < (n + 1) / 2; p++) {
    double z0, z1;
    normal_pair(seed, stream, p, &z0, &z1);
    out[2 * p] = f32_to_bf16((float)(scale * z0));
    if (2 * p + 1 < n) out[2 * p + 1] = f32_to_bf16((float)(scale * z1));
  }
}

void mok_gen_routing(uint64_t seed, int64_t tokens, int32_t experts, int32_t k, int32_t *ids,
                     float *weights) {
  #pragma omp parallel
  {
    double *prob = malloc((size_t)experts * sizeof *prob);
    char *taken = malloc((size_t)experts);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
      if (!prob || !taken) continue;
      double mx = -INFINITY, sum = 0.0;
      for (int32_t e = 0; e < experts; e++) {
        uint64_t i = (uint64_t)t * (uint64_t)experts + (uint64_t)e;
        double z0, z1;
        normal_pair(seed, 1000003, i / 2, &z0, &z1);
        prob[e] = (i & 1) ? z1 : z0;
        if (prob[e] > mx) mx = prob[e];
      }
      for (int32_t e = 0; e < experts; e++) sum += (prob[e] = exp(prob[e] - mx));
      memset(taken, 0, (size_t)experts);
      for (int32_t j = 0; j < k; j++) {
        int32_t best = -1;
        for (int32_t e = 0; e < experts; e++)
          if (!taken[e] && (best < 0 || prob[e] > prob[best])) best = e;
        taken[best] = 1;
        ids[t * k + j] = best;
        weights[t * k + j] = (float)(prob[best] / sum);
      }
    }
    free(prob);
    free(taken);
  }
}

void mok_host_layer_destroy(mok_host_layer *L) {
  if (!L) return;
  free(L->x); free(L->dy); free(L->topk_ids); free(L->topk_weights);
  free(L->w_gate); free(L->w_up); free(L->w_down);
  free(L->ws_gate); free(L->ws_up); free(L->ws_down);
  memset(L, 0, sizeof *L);
}

/* 64-byte aligned, so every tensor meets the API's 16-byte rule. */
static void *alloc_tensor(size_t bytes) {
  return aligned_alloc(64, (size_t)mok_round_up((int64_t)(bytes ? bytes : 1), 64));
}

mok_status mok_host_layer_create(const mok_shape *s, int64_t tokens, uint64_t seed,
                                 mok_host_layer *L) {
  if (!s || !L || tokens < 1)
    return mok_fail(MOK_ERR_INVALID_ARG, "mok_host_layer_create: NULL shape/out or tokens < 1");
  memset(L, 0, sizeof *L);
  L->shape = *s;
  L->tokens = tokens;
  const size_t T = (size_t)tokens, H = (size_t)s->hidden, I = (size_t)s->inter;
  const size_t Is = (size_t)s->shared_inter, E = (size_t)s->experts, k = (size_t)s->top_k;
  L->x = alloc_tensor(T * H * 2);
  L->dy = alloc_tensor(T * H * 2);
  L->topk_ids = alloc_tensor(T * k * 4);
  L->topk_weights = alloc_tensor(T * k * 4);
  L->w_gate = alloc_tensor(E * I * H * 2);
  L->w_up = alloc_tensor(E * I * H * 2);
  L->w_down = alloc_tensor(E * H * I * 2);
  int ok = L->x && L->dy && L->topk_ids && L->topk_weights && L->w_gate && L->w_up && L->w_down;
  if (Is) {
    L->ws_gate = alloc_tensor(Is * H * 2);
    L->ws_up = alloc_tensor(Is * H * 2);
    L->ws_down = alloc_tensor(H * Is * 2);
    ok = ok && L->ws_gate && L->ws_up && L->ws_down;
  }
  if (!ok) {
    mok_host_layer_destroy(L);
    return mok_fail(MOK_ERR_OUT_OF_MEMORY, "no host memory for the layer's inputs");
  }
  const float sh = (float)(1.0 / sqrt((double)H)), si = (float)(1.0 / sqrt((double)I));
  mok_gen_normal_bf16(seed, 1, 1.0f, L->x, T * H);
  mok_gen_normal_bf16(seed, 2, 1.0f, L->dy, T * H);
  mok_gen_normal_bf16(seed, 3, sh, L->w_gate, E * I * H);
  mok_gen_normal_bf16(seed, 4, sh, L->w_up, E * I * H);
  mok_gen_normal_bf16(seed, 5, si, L->w_down, E * H * I);
  if (Is) {
    const float ss = (float)(1.0 / sqrt((double)Is));
    mok_gen_normal_bf16(seed, 6, sh, L->ws_gate, Is * H);
    mok_gen_normal_bf16(seed, 7, sh, L->ws_up, Is * H);
    mok_gen_normal_bf16(seed, 8, ss, L->ws_down, H * Is);
  }
  mok_gen_routing(seed, tokens, s->experts, s->top_k, L->topk_ids, L->topk_weights);
  return MOK_OK;
}

mok_weights mok_host_layer_weights(const mok_host_layer *L) {
  mok_weights w = {L->w_gate, L->w_up, L->w_down, L->ws_gate, L->ws_up, L->ws_down, NULL};
  return w;
}
