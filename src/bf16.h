/*
 * bf16.h: inline bf16 <-> fp32 conversion for the CPU backend, the generator and the kernels that
 * must write the CPU's bytes (mxfp8.cu). Round-to-nearest-even, NaN kept with its sign (made
 * quiet), Inf kept, by bit operations alone: the same bytes on the host and the device. The GPU's
 * __float2bfloat16_rn rounds numbers the same way.
 */
#ifndef MOK_BF16_H
#define MOK_BF16_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define MOK_BF16_FN __host__ __device__ static inline
#else
#define MOK_BF16_FN static inline
#endif

MOK_BF16_FN float bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

MOK_BF16_FN uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* The value f takes once stored as bf16. */
MOK_BF16_FN float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#endif /* MOK_BF16_H */
