/*
 * router_math.h: the router's per-token math (DESIGN.md §1.2), one token's row at a time: scores,
 * the choice of experts, the weights and, backward, d_logits. The CPU backend and the CUDA
 * kernels (a thread per token) run this same code, so they differ only in the logits' summation
 * order and in their expf/logf. Rows live in the caller's memory (E up to 1024 floats would not
 * fit a GPU thread's registers); every loop runs in ascending index order.
 */
#ifndef MOK_ROUTER_MATH_H
#define MOK_ROUTER_MATH_H

#include <math.h>
#include <stdint.h>

#include "internal.h"

typedef struct rt_params {
  int E, k, scoring, n_group, topk_group, renormalize;
  float scale;
} rt_params;

static inline rt_params rt_params_of(const mok_router_config *c) {
  rt_params p = {c->experts, c->top_k, (int)c->scoring, c->n_group, c->topk_group,
                 c->renormalize, c->scale};
  return p;
}

/* s[0..E) from the logits l: softmax over the row, or a sigmoid each. */
MOK_HOST_DEVICE static inline void rt_scores(const float *l, const rt_params *p, float *s) {
  const int E = p->E;
  if (p->scoring == MOK_ROUTER_SIGMOID) {
    for (int e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-l[e]));
    return;
  }
  float m = l[0];
  for (int e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
  float sum = 0.0f;
  for (int e = 0; e < E; e++) {
    s[e] = expf(l[e] - m);
    sum += s[e];
  }
  for (int e = 0; e < E; e++) s[e] = s[e] / sum;
}

/* log Σ_e exp(l[e]), from the row's maximum. */
MOK_HOST_DEVICE static inline float rt_lse(const float *l, int E) {
  float m = l[0];
  for (int e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
  float sum = 0.0f;
  for (int e = 0; e < E; e++) sum += expf(l[e] - m);
  return m + logf(sum);
}

/* The value expert e is chosen by: its score plus its bias; NaN ranks below everything, so a
 * row of NaN still names k distinct experts. */
MOK_HOST_DEVICE static inline float rt_key(const float *s, const float *bias, int e) {
  const float c = bias ? s[e] + bias[e] : s[e];
  return c != c ? -INFINITY : c;
}

/* The choice order: a higher key first, then the lower index. A strict total order, so the j-th
 * pick is the best element after the (j-1)-th, found in one pass without a mask. */
MOK_HOST_DEVICE static inline int rt_before(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

/* A group's score: the sum of its top min(2, G) keys (DeepSeek-V3). */
MOK_HOST_DEVICE static inline float rt_group_score(const float *s, const float *bias, int e0,
                                                   int G) {
  float b1 = -INFINITY, b2 = -INFINITY;
  for (int e = e0; e < e0 + G; e++) {
    const float c = rt_key(s, bias, e);
    if (c > b1) {
      b2 = b1;
      b1 = c;
    } else if (c > b2) {
      b2 = c;
    }
  }
  return G == 1 ? b1 : b1 + b2;
}

/* ids[0..k): the k allowed experts of highest key, best first. */
MOK_HOST_DEVICE static inline void rt_select(const float *s, const float *bias, const rt_params *p,
                                             int32_t *ids) {
  uint64_t allowed = 1; /* bit g: group g may be chosen; without groups, one group of E */
  int G = p->E;
  if (p->n_group > 1) {
    G = p->E / p->n_group;
    allowed = 0;
    float prev = 0.0f;
    int prev_g = -1;
    for (int pick = 0; pick < p->topk_group; pick++) {
      float best = 0.0f;
      int bg = -1;
      for (int g = 0; g < p->n_group; g++) {
        const float gs = rt_group_score(s, bias, g * G, G);
        if (prev_g >= 0 && !rt_before(prev, prev_g, gs, g)) continue;
        if (bg < 0 || rt_before(gs, g, best, bg)) best = gs, bg = g;
      }
      allowed |= (uint64_t)1 << bg;
      prev = best, prev_g = bg;
    }
  }
  float prev = 0.0f;
  int prev_e = -1;
  for (int j = 0; j < p->k; j++) {
    float best = 0.0f;
    int be = -1;
    for (int e = 0; e < p->E; e++) {
      if (!((allowed >> (e / G)) & 1)) continue;
      const float c = rt_key(s, bias, e);
      if (prev_e >= 0 && !rt_before(prev, prev_e, c, e)) continue;
      if (be < 0 || rt_before(c, e, best, be)) best = c, be = e;
    }
    ids[j] = be;
    prev = best, prev_e = be;
  }
}

/* The k weights of the chosen ids. */
MOK_HOST_DEVICE static inline void rt_weights(const float *s, const int32_t *ids,
                                              const rt_params *p, float *w) {
  float S = 0.0f;
  if (p->renormalize)
    for (int j = 0; j < p->k; j++) S += s[ids[j]];
  for (int j = 0; j < p->k; j++) {
    float v = s[ids[j]];
    if (p->renormalize) v = v / S;
    w[j] = v * p->scale;
  }
}

/* What the load-balancing loss's probabilities are: s itself (softmax), or s over its sum
 * (sigmoid). p_row gets them. */
MOK_HOST_DEVICE static inline void rt_aux_probs(const float *s, const rt_params *p, float *p_row) {
  float S = 1.0f;
  if (p->scoring == MOK_ROUTER_SIGMOID) {
    S = 0.0f;
    for (int e = 0; e < p->E; e++) S += s[e];
  }
  for (int e = 0; e < p->E; e++) p_row[e] = p->scoring == MOK_ROUTER_SIGMOID ? s[e] / S : s[e];
}

/* f[e] · P[e] of the load-balancing loss, from the count n of expert e and psum = Σ_t p[t, e]. */
MOK_HOST_DEVICE static inline float rt_aux_term(int32_t n, float psum, int64_t T, int k) {
  return ((float)n / (float)(T * k)) * (psum / (float)T);
}

/* dp[e] = a · E · f[e] / T: the load-balancing loss's gradient in p[t, e] (any t). */
MOK_HOST_DEVICE static inline float rt_aux_grad(float a, int E, int32_t n, int64_t T, int k) {
  return a * (float)E * ((float)n / (float)(T * k)) / (float)T;
}

/* Backward of one token: dl[0..E) from the logits l, the chosen ids, g = d_topk_weights[t, :];
 * with counts (non-NULL), the load-balancing loss's term of gradient a; with has_z, the z-loss's
 * of gradient z. s is scratch of E floats (it gets the scores). */
MOK_HOST_DEVICE static inline void rt_dlogits(const float *l, const int32_t *ids, const float *g,
                                              const rt_params *p, const int32_t *counts, float a,
                                              int64_t T, int has_z, float z, float *s,
                                              float *dl) {
  const int E = p->E, k = p->k;
  const int sigmoid = p->scoring == MOK_ROUTER_SIGMOID;
  rt_scores(l, p, s);
  for (int e = 0; e < E; e++) dl[e] = 0.0f; /* ds first */
  if (p->renormalize) {
    float S = 0.0f, dot = 0.0f;
    for (int j = 0; j < k; j++) S += s[ids[j]];
    for (int j = 0; j < k; j++) dot += (g[j] * p->scale) * (s[ids[j]] / S);
    for (int j = 0; j < k; j++) dl[ids[j]] = (g[j] * p->scale - dot) / S;
  } else {
    for (int j = 0; j < k; j++) dl[ids[j]] = g[j] * p->scale;
  }
  if (counts) {
    if (!sigmoid) {
      for (int e = 0; e < E; e++) dl[e] += rt_aux_grad(a, E, counts[e], T, k);
    } else {
      float S = 0.0f, dot = 0.0f;
      for (int e = 0; e < E; e++) S += s[e];
      for (int e = 0; e < E; e++) dot += rt_aux_grad(a, E, counts[e], T, k) * (s[e] / S);
      for (int e = 0; e < E; e++) dl[e] += (rt_aux_grad(a, E, counts[e], T, k) - dot) / S;
    }
  }
  if (!sigmoid) {
    float dot = 0.0f;
    for (int e = 0; e < E; e++) dot += dl[e] * s[e];
    for (int e = 0; e < E; e++) dl[e] = s[e] * (dl[e] - dot);
  } else {
    for (int e = 0; e < E; e++) dl[e] = dl[e] * s[e] * (1.0f - s[e]);
  }
  if (has_z) {
    const float lse = rt_lse(l, E), c = z * 2.0f / (float)T;
    for (int e = 0; e < E; e++) dl[e] += c * lse * expf(l[e] - lse);
  }
}

#endif /* MOK_ROUTER_MATH_H */
