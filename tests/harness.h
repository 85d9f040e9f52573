/*
 * harness.h: what the CPU tests share: one layer's inputs (mok_host_layer), a context and
 * workspace for them, every output buffer (poisoned before each run so an unwritten element
 * shows), and the relative error ||out - ref|| / ||ref|| the numeric tests report.
 */
#ifndef MOK_TESTS_HARNESS_H
#define MOK_TESTS_HARNESS_H

#include <stddef.h>
#include <stdint.h>

#include "mok.h"
#include "mok_gen.h"

/* The six weight gradients, in the order of mok_grads and mok_ref_grad. */
enum { G_GATE, G_UP, G_DOWN, GS_GATE, GS_UP, GS_DOWN, G_COUNT };

typedef struct harness {
  mok_host_layer L;
  mok_context *ctx;
  mok_workspace *ws;
  int64_t T;
  uint16_t *y, *dx;      /* [T, H] */
  float *dtw;            /* [T, k] */
  void *saved;           /* mok_saved_bytes(ws, T), 256-byte aligned */
  size_t saved_bytes;
  void *g[G_COUNT];      /* weight grads, room for fp32 */
  int64_t g_len[G_COUNT];/* elements of each (0 for the shared ones when I_s = 0) */
  void *fp8;             /* MOK_FP8: the FP8 weight buffer of L's weights (harness_quantize) */
} harness;

/* Inputs from mok_host_layer_create(shape, T, seed); a CPU context of `threads` threads (0 = all)
 * and a workspace of max_tokens = shape->max_tokens; at MOK_FP8 the weights quantized. Returns 0
 * and records a failure if anything fails. */
int harness_init(harness *h, const mok_shape *shape, int64_t T, uint64_t seed, int threads);
void harness_fini(harness *h);
/* MOK_FP8: quantizes L's weights into h->fp8 again (after a test changed them); else nothing. */
void harness_quantize(harness *h);

/* The call's weights: L's bf16 ones, or at MOK_FP8 the FP8 buffer alone (the bf16 pointers NULL,
 * so that a backend reading them fails). */
mok_weights harness_weights(const harness *h);
mok_forward_args harness_forward_args(const harness *h);
mok_backward_args harness_backward_args(const harness *h, mok_grad_mode mode);
/* Fills every output (y, dx, d_topk_weights, grads, saved) with the byte `pattern`. */
void harness_poison(harness *h, unsigned char pattern);

/* Runs forward then backward; returns the first status that is not MOK_OK. */
mok_status harness_run(harness *h, mok_grad_mode mode);

/* An EP rank's slot_row in its saved (in host memory) against the rule: each of its own slots q
 * (of `tokens`, ids[q] its expert) has its row here when the expert is one of the rank's
 * experts_local, and row_src says q back; else -1. The first wrong slot, or -1 if none. */
int64_t slot_row_first_wrong(const mok_workspace *ws, const void *saved, int64_t tokens,
                             const int32_t *ids, int rank, int64_t experts_local);

/* Aligned allocation that the test owns (free with free()). */
void *test_alloc(size_t bytes);

/* ||out - ref|| / ||ref|| accumulated over several calls. */
typedef struct rel_err {
  double diff2, ref2;
} rel_err;
static inline void rel_err_add(rel_err *r, double out, double ref) {
  r->diff2 += (out - ref) * (out - ref);
  r->ref2 += ref * ref;
}
double rel_err_value(const rel_err *r);

#endif
