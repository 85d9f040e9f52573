/* example.c: one MoE layer forward on the CPU backend (the README's C quickstart; make test builds
 * it against an installed mok with pkg-config and runs it). */
#include <stdio.h>
#include <stdlib.h>

#include <mok.h>

/* n bf16 values in [-scale, scale), 256-byte aligned (mok needs 16): a stand-in for real data. */
static uint16_t *bf16_tensor(size_t n, float scale, uint32_t seed) {
  uint16_t *p = aligned_alloc(256, (n * sizeof *p + 255) / 256 * 256);
  for (size_t i = 0; p && i < n; i++) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed * 40503u;
    p[i] = mok_f32_to_bf16(scale * ((float)((h ^ h >> 15) % 2048) / 1024.0f - 1.0f));
  }
  return p;
}

int main(void) {
  enum { T = 64, H = 256, I = 128, I_S = 128, E = 8, K = 2 };
  mok_shape shape = {.max_tokens = T, .hidden = H, .inter = I, .shared_inter = I_S,
                     .experts = E, .top_k = K, .precision = MOK_BF16};
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT; /* CPU; .backend = MOK_BACKEND_CUDA on Hopper */
  mok_context *ctx = NULL;
  mok_workspace *ws = NULL;
  mok_status st = mok_context_create(&cfg, &ctx);
  if (st == MOK_OK) st = mok_workspace_create(ctx, &shape, &ws);

  /* Inputs in host memory (the CUDA backend takes device pointers): x [T, H], each token routed
   * to experts t % E and (t + 1) % E with weights 0.75 and 0.25, and bf16 weights. */
  static int32_t topk_ids[T * K];
  static float topk_weights[T * K];
  for (int t = 0; t < T; t++) {
    topk_ids[t * K] = t % E, topk_weights[t * K] = 0.75f;
    topk_ids[t * K + 1] = (t + 1) % E, topk_weights[t * K + 1] = 0.25f;
  }
  mok_weights w = {.w_gate = bf16_tensor((size_t)E * I * H, 0.0625f, 1),
                   .w_up = bf16_tensor((size_t)E * I * H, 0.0625f, 2),
                   .w_down = bf16_tensor((size_t)E * H * I, 0.09f, 3),
                   .ws_gate = bf16_tensor((size_t)I_S * H, 0.0625f, 4),
                   .ws_up = bf16_tensor((size_t)I_S * H, 0.0625f, 5),
                   .ws_down = bf16_tensor((size_t)H * I_S, 0.09f, 6)};
  uint16_t *x = bf16_tensor((size_t)T * H, 1.0f, 7);
  uint16_t *y = bf16_tensor((size_t)T * H, 0.0f, 0); /* [T, H] bf16, out */
  void *saved = st == MOK_OK ? aligned_alloc(256, mok_saved_bytes(ws, T)) : NULL;

  mok_forward_args f = {.tokens = T, .x = x, .topk_ids = topk_ids, .topk_weights = topk_weights,
                        .w = w, .y = y, .saved = saved};
  if (st == MOK_OK) st = mok_forward(ws, &f, NULL); /* queued on a stream (NULL: default) */
  if (st == MOK_OK) st = mok_check(ws, NULL);       /* device-side errors; synchronises */
  if (st == MOK_OK) printf("y[0] = %g\n", mok_bf16_to_f32(y[0]));
  else fprintf(stderr, "%s: %s\n", mok_status_name(st), mok_last_error());

  free(saved), free(x), free(y);
  free((void *)w.w_gate), free((void *)w.w_up), free((void *)w.w_down);
  free((void *)w.ws_gate), free((void *)w.ws_up), free((void *)w.ws_down);
  mok_workspace_destroy(ws);
  mok_context_destroy(ctx);
  return st != MOK_OK;
}
