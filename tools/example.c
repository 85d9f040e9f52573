/* example.c: one MoE layer forward on the CPU backend (the README's example; make test runs it). */
#include <stdio.h>
#include <stdlib.h>

#include "mok.h"
#include "mok_gen.h"

int main(void) {
  const int64_t T = 64, H = 256;
  mok_shape shape = {.max_tokens = T, .hidden = H, .inter = 128, .shared_inter = 128,
                     .experts = 8, .top_k = 2, .precision = MOK_BF16};
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT; /* CPU; .backend = MOK_BACKEND_CUDA on Hopper */
  mok_context *ctx = NULL;
  mok_workspace *ws = NULL;
  mok_host_layer in = {0}; /* seeded random inputs in host memory (CUDA takes device pointers) */
  mok_status st = mok_context_create(&cfg, &ctx);
  if (st == MOK_OK) st = mok_workspace_create(ctx, &shape, &ws);
  if (st == MOK_OK) st = mok_host_layer_create(&shape, T, 42, &in);
  void *saved = st == MOK_OK ? aligned_alloc(256, mok_saved_bytes(ws, T)) : NULL;
  uint16_t *y = aligned_alloc(256, (size_t)(T * H) * sizeof *y); /* [T, H] bf16 */
  mok_forward_args f = {.tokens = T, .x = in.x, .topk_ids = in.topk_ids,
                        .topk_weights = in.topk_weights, .w = mok_host_layer_weights(&in),
                        .y = y, .saved = saved};
  if (st == MOK_OK) st = mok_forward(ws, &f, NULL); /* queued on a stream (NULL: default) */
  if (st == MOK_OK) st = mok_check(ws, NULL);       /* device-side errors; synchronises */
  if (st == MOK_OK) printf("y[0] = %g\n", mok_bf16_to_f32(y[0]));
  else fprintf(stderr, "%s: %s\n", mok_status_name(st), mok_last_error());
  free(y);
  free(saved);
  mok_host_layer_destroy(&in);
  mok_workspace_destroy(ws);
  mok_context_destroy(ctx);
  return st != MOK_OK;
}
