/*
 * backend.c: the CPU reference backend's function table and its workspace: every scratch buffer
 * is sized here once, for a max_tokens call, and carved from one host allocation, so forward and
 * backward never allocate. The steps themselves live in one file each (see cpu.h); layer.c
 * strings them together.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu.h"

static mok_status cpu_context_init(mok_context *ctx) {
  (void)ctx;
  return MOK_OK;
}

/* Buffers carved from one block, each on a 64-byte boundary (a cache line: threads writing
 * neighbouring buffers never share one). */
static size_t carve(size_t *cursor, int64_t count, size_t elem) {
  size_t at = *cursor;
  *cursor += (size_t)mok_round_up(count * (int64_t)elem, 64);
  return at;
}

static mok_status cpu_workspace_init(mok_workspace *ws) {
  const mok_shape *s = &ws->shape;
  const int64_t T = s->max_tokens, H = s->hidden, I = s->inter, Is = s->shared_inter;
  const int64_t Im = I > Is ? I : Is;
  const int64_t R = mok_saved_layout_of(ws, T).rows_cap;
  cpu_state *st = calloc(1, sizeof *st);
  if (!st) return mok_fail(MOK_ERR_OUT_OF_MEMORY, "no host memory for the CPU workspace");
  st->threads = ws->ctx->cfg.threads > 0 ? ws->ctx->cfg.threads : omp_get_max_threads();
  /* A thread's scratch: one output row of H, a second of H, and dh of I_m. */
  st->per_thread_len = mok_round_up(2 * H + Im, 16);

  size_t c = 0;
  size_t o_xf = carve(&c, T * H, sizeof(float));
  size_t o_dyf = carve(&c, T * H, sizeof(float));
  size_t o_side = carve(&c, T * H, sizeof(float));
  size_t o_slot = carve(&c, T * s->top_k * H, sizeof(uint16_t));
  size_t o_hwf = carve(&c, R * I, sizeof(float));
  size_t o_dguf = carve(&c, R * 2 * I, sizeof(float));
  size_t o_hsf = carve(&c, T * Is, sizeof(float));
  size_t o_dgusf = carve(&c, T * 2 * Is, sizeof(float));
  size_t o_pgu = carve(&c, 2 * Im * H, sizeof(float));
  size_t o_pdown = carve(&c, H * Im, sizeof(float));
  size_t o_thr = carve(&c, st->threads * st->per_thread_len, sizeof(float));
  size_t o_cur = carve(&c, ws->experts_local, sizeof(int32_t));

  char *b = aligned_alloc(64, c);
  if (!b) {
    free(st);
    return mok_fail(MOK_ERR_OUT_OF_MEMORY,
                    "CPU workspace: no host memory for %zu bytes of scratch (max_tokens %lld)", c,
                    (long long)T);
  }
  st->block = b;
  st->xf = (float *)(b + o_xf);
  st->dyf = (float *)(b + o_dyf);
  st->side = (float *)(b + o_side);
  st->slot = (uint16_t *)(b + o_slot);
  st->hwf = (float *)(b + o_hwf);
  st->dguf = (float *)(b + o_dguf);
  st->hsf = (float *)(b + o_hsf);
  st->dgusf = (float *)(b + o_dgusf);
  st->panel_gu = (float *)(b + o_pgu);
  st->panel_down = (float *)(b + o_pdown);
  st->per_thread = (float *)(b + o_thr);
  st->cursor = (int32_t *)(b + o_cur);
  ws->backend = st;
  ws->bytes = c + sizeof *st;
  return MOK_OK;
}

static void cpu_workspace_fini(mok_workspace *ws) {
  cpu_state *st = cpu_state_of(ws);
  if (!st) return;
  free(st->block);
  free(st);
  ws->backend = NULL;
}

/* The CPU backend runs synchronously, so its sticky bits are current on return of every call. */
static mok_status cpu_check(mok_workspace *ws, void *stream, int32_t *bits) {
  (void)stream;
  cpu_state *st = cpu_state_of(ws);
  *bits = st->sticky;
  st->sticky = 0;
  return MOK_OK;
}

static mok_status cpu_copy_to_host(mok_workspace *ws, void *dst, const void *src, size_t bytes,
                                   void *stream) {
  (void)ws;
  (void)stream;
  memcpy(dst, src, bytes);
  return MOK_OK;
}

const mok_backend_ops mok_cpu_ops = {
    "cpu",           cpu_context_init,  cpu_workspace_init, cpu_workspace_fini, cpu_layer_schedule,
    cpu_layer_forward, cpu_layer_backward, cpu_check,        cpu_copy_to_host};
