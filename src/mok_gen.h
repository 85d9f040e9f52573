/*
 * mok_gen.h: seeded random layer inputs for the tests, the mok command and the Python tests'
 * references. Generation is counter-based (value i of stream s depends only on seed, s and i), so
 * any slice of a tensor can be made alone and in parallel, and the same seed gives the same
 * tensors everywhere. Not part of libmok: built with the float64 recomputation (src/cpu/ref64.c)
 * into build/libmok_check.a, which the tests and the command link.
 */
#ifndef MOK_GEN_H
#define MOK_GEN_H

#include <stddef.h>
#include <stdint.h>

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[i] = bf16(scale * N(0,1)) for the i-th value of stream `stream`. */
void mok_gen_normal_bf16(uint64_t seed, uint64_t stream, float scale, uint16_t *out, size_t n);
/* Router outputs for `tokens` tokens: logits ~ N(0,1) over E experts, softmax, the k most likely
 * experts (ties to the lower id) in descending order, and their softmax probabilities. */
void mok_gen_routing(uint64_t seed, int64_t tokens, int32_t experts, int32_t k, int32_t *ids,
                     float *weights);

/* Host buffers for one layer call (ep = 1): every input of forward and backward. */
typedef struct mok_host_layer {
  mok_shape shape;
  int64_t tokens;
  uint16_t *x, *dy;                  /* [T, H] */
  int32_t *topk_ids;                 /* [T, k] */
  float *topk_weights;               /* [T, k] */
  uint16_t *w_gate, *w_up, *w_down;  /* [E, I, H], [E, I, H], [E, H, I] */
  uint16_t *ws_gate, *ws_up, *ws_down; /* [I_s, H], [I_s, H], [H, I_s]; NULL when I_s = 0 */
} mok_host_layer;

/* Allocates and fills: x, dy ~ N(0,1); gate/up weights ~ N(0,1)/sqrt(H); down weights
 * ~ N(0,1)/sqrt(I) (or /sqrt(I_s)); routing as mok_gen_routing. */
mok_status mok_host_layer_create(const mok_shape *shape, int64_t tokens, uint64_t seed,
                                 mok_host_layer *out);
void mok_host_layer_destroy(mok_host_layer *L); /* accepts NULL and a zeroed struct */
/* The weights of L as a mok_weights (host pointers). */
mok_weights mok_host_layer_weights(const mok_host_layer *L);

#ifdef __cplusplus
}
#endif
#endif /* MOK_GEN_H */
