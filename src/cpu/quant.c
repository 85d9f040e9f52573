/*
 * quant.c: the FP8 recipe on the CPU backend (DESIGN.md §8): the workspace's FP8 weight buffer
 * (Q_blk of the bf16 weights, or codes and scales given, with the transposed codes), the decoded
 * weight rows the panels are made of, and Q_row and Q_col of fp32 values.
 *
 * The CPU computes every FP8 product as the BF16 layer's dot product on dequantized operands:
 * a value quantized in a group of scale 2^e is replaced by decode(q) * 2^e, which fp32 holds
 * exactly (DESIGN §8.2). The scalar rules (e4m3, the scale) are src/fp8.h's alone.
 */
#include <math.h>
#include <string.h>

#include "bf16.h"
#include "cpu/cpu.h"
#include "fp8.h"

#define G MOK_FP8_GROUP

/* What v stands for once quantized in a group of scale exponent e. */
static inline float q_value(float v, int e) {
  return mok_e4m3_decode(mok_e4m3_encode(v * mok_pow2f(-e))) * mok_pow2f(e);
}

/* The largest magnitude of n values `stride` apart; NaN ignored (a comparison with NaN is
 * false). */
static inline float amax_of(const float *v, int64_t n, int64_t stride) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    const float a = fabsf(v[i * stride]);
    if (a > m) m = a;
  }
  return m;
}

void cpu_q_row(float *v, int64_t n) {
  for (int64_t g0 = 0; g0 < n; g0 += G) {
    const int64_t len = n - g0 < G ? n - g0 : G;
    const int e = mok_fp8_scale_exp(amax_of(v + g0, len, 1));
    for (int64_t i = g0; i < g0 + len; i++) v[i] = q_value(v[i], e);
  }
}

void cpu_q_rows_bf16(const mok_workspace *ws, float *dst, const uint16_t *src, int64_t rows,
                     int64_t n) {
  #pragma omp parallel for schedule(static) num_threads(cpu_state_of(ws)->threads)
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t i = 0; i < n; i++) dst[r * n + i] = bf16_to_f32(src[r * n + i]);
    cpu_q_row(dst + r * n, n);
  }
}

void cpu_q_col(float *v, int64_t rows, int64_t stride) {
  for (int64_t r0 = 0; r0 < rows; r0 += G) {
    const int64_t len = rows - r0 < G ? rows - r0 : G;
    float *b = v + r0 * stride;
    const int e = mok_fp8_scale_exp(amax_of(b, len, stride));
    for (int64_t r = 0; r < len; r++) b[r * stride] = q_value(b[r * stride], e);
  }
}

void cpu_fp8_decode_row(float *dst, const uint8_t *q, const float *s, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] = mok_e4m3_decode(q[i]) * s[i / G];
}

/* ---- the weight buffer ---------------------------------------------------------------------- */

static int64_t blocks(int64_t n) { return (n + G - 1) / G; }

/* One 128 x 128 block (bn, bk) of expert e of a bf16 tensor [E, N, K] into codes and scale. */
static void quantize_block(const mok_fp8_matrix_layout *m, const uint16_t *w, char *buf,
                           int64_t e, int64_t bn, int64_t bk) {
  const int64_t N = m->n, K = m->k;
  const int64_t n0 = bn * G, n1 = n0 + G < N ? n0 + G : N;
  const int64_t k0 = bk * G, k1 = k0 + G < K ? k0 + G : K;
  const uint16_t *src = w + e * N * K;
  float amax = 0.0f;
  for (int64_t n = n0; n < n1; n++)
    for (int64_t k = k0; k < k1; k++) {
      const float a = fabsf(bf16_to_f32(src[n * K + k]));
      if (a > amax) amax = a;
    }
  const int ex = mok_fp8_scale_exp(amax);
  const float down = mok_pow2f(-ex);
  uint8_t *q = (uint8_t *)(buf + m->q) + e * N * K;
  for (int64_t n = n0; n < n1; n++)
    for (int64_t k = k0; k < k1; k++) q[n * K + k] = mok_e4m3_encode(bf16_to_f32(src[n * K + k]) * down);
  float *s = (float *)(buf + m->s) + (e * blocks(N) + bn) * blocks(K);
  s[bk] = mok_pow2f(ex);
}

/* The first scale of a given tensor that is not finite and positive, or -1. */
static int64_t bad_scale(const mok_fp8_matrix_layout *m, const float *s) {
  const int64_t n = m->experts * blocks(m->n) * blocks(m->k);
  for (int64_t i = 0; i < n; i++)
    if (!(s[i] > 0.0f && isfinite(s[i]))) return i;
  return -1;
}

static const char *const tensor_names[MOK_W_COUNT] = {"w_gate",  "w_up",  "w_down",
                                                      "ws_gate", "ws_up", "ws_down"};

mok_status cpu_fp8_weights(mok_workspace *ws, const mok_weights *w, const mok_fp8_given *given,
                           void *fp8, void *stream) {
  (void)stream;
  const mok_fp8_layout L = mok_fp8_layout_of(ws);
  const void *bf16[MOK_W_COUNT] = {0};
  mok_fp8_matrix in[MOK_W_COUNT] = {{0}};
  if (w) {
    const void *p[MOK_W_COUNT] = {w->w_gate, w->w_up, w->w_down, w->ws_gate, w->ws_up,
                                  w->ws_down};
    memcpy(bf16, p, sizeof p);
  } else {
    const mok_fp8_matrix p[MOK_W_COUNT] = {given->w_gate,  given->w_up,  given->w_down,
                                           given->ws_gate, given->ws_up, given->ws_down};
    memcpy(in, p, sizeof p);
    /* Checked whole before anything is written, so a refused call leaves fp8 as it was. */
    for (int i = 0; i < MOK_W_COUNT; i++) {
      if (L.m[i].experts == 0) continue;
      const int64_t at = bad_scale(&L.m[i], in[i].s);
      if (at >= 0)
        return mok_fail(MOK_ERR_INVALID_ARG,
                        "%s.s[%lld] is %g; expected a finite positive scale per 128 x 128 block "
                        "(fp8 left untouched)",
                        tensor_names[i], (long long)at, (double)in[i].s[at]);
    }
  }
  char *buf = fp8;
  #pragma omp parallel num_threads(cpu_state_of(ws)->threads)
  for (int i = 0; i < MOK_W_COUNT; i++) {
    const mok_fp8_matrix_layout *m = &L.m[i];
    if (m->experts == 0) continue;
    const int64_t N = m->n, K = m->k, bn = blocks(N), bk = blocks(K);
    if (w) {
      #pragma omp for schedule(static)
      for (int64_t b = 0; b < m->experts * bn * bk; b++)
        quantize_block(m, bf16[i], buf, b / (bn * bk), b / bk % bn, b % bk);
    } else {
      #pragma omp single
      {
        memcpy(buf + m->q, in[i].q, (size_t)(m->experts * N * K));
        memcpy(buf + m->s, in[i].s, (size_t)(m->experts * bn * bk) * sizeof(float));
      }
    }
    /* (each omp for ends with a barrier: the codes are complete before they are transposed) */
    const uint8_t *q = (const uint8_t *)(buf + m->q);
    uint8_t *qt = (uint8_t *)(buf + m->qt);
    #pragma omp for schedule(static)
    for (int64_t row = 0; row < m->experts * K; row++) { /* row (e, k) of qt [E, K, N] */
      const int64_t e = row / K, k = row % K;
      for (int64_t n = 0; n < N; n++) qt[row * N + n] = q[(e * N + n) * K + k];
    }
  }
  return MOK_OK;
}
