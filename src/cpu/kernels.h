/*
 * kernels.h: the inner loops of the CPU backend. Their summation order is written in the source,
 * not left to the compiler: plain -O2 (no -ffast-math, no FMA contraction under -std=c11) may
 * vectorise across independent lanes only, so the same binary gives the same bits on any input
 * position and thread count.
 *
 * Two shapes of fp32 reduction:
 *   cpu_dot:  out = a . b with 16 interleaved partial sums (lane l takes elements l, l+16, ...),
 *             folded by a fixed halving tree, then the n % 16 tail in ascending order.
 *   cpu_axpy: acc[n] += a * b[n], one output per lane; called over k in ascending order, each
 *             acc[n] is a plain sequential sum. cpu_axpy4 does four steps in one pass with the
 *             same per-element order (((acc + a0 b0) + a1 b1) + a2 b2) + a3 b3.
 */
#ifndef MOK_CPU_KERNELS_H
#define MOK_CPU_KERNELS_H

#include <stdint.h>

#define CPU_DOT_LANES 16

static inline float cpu_dot(const float *restrict a, const float *restrict b, int64_t n) {
  float s[CPU_DOT_LANES] = {0};
  int64_t i = 0;
  for (; i + CPU_DOT_LANES <= n; i += CPU_DOT_LANES) {
    #pragma omp simd
    for (int l = 0; l < CPU_DOT_LANES; l++) s[l] += a[i + l] * b[i + l];
  }
  for (int half = CPU_DOT_LANES / 2; half > 0; half /= 2)
    for (int l = 0; l < half; l++) s[l] += s[l + half];
  float r = s[0];
  for (; i < n; i++) r += a[i] * b[i];
  return r;
}

static inline void cpu_axpy(float *restrict acc, float a, const float *restrict b, int64_t n) {
  #pragma omp simd
  for (int64_t i = 0; i < n; i++) acc[i] += a * b[i];
}

static inline void cpu_axpy4(float *restrict acc, const float a[4], const float *restrict b0,
                             const float *restrict b1, const float *restrict b2,
                             const float *restrict b3, int64_t n) {
  const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
  #pragma omp simd
  for (int64_t i = 0; i < n; i++)
    acc[i] = (((acc[i] + a0 * b0[i]) + a1 * b1[i]) + a2 * b2[i]) + a3 * b3[i];
}

static inline void cpu_zero(float *restrict p, int64_t n) {
  for (int64_t i = 0; i < n; i++) p[i] = 0.0f;
}

#endif /* MOK_CPU_KERNELS_H */
