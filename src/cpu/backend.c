/*
 * backend.c: the CPU reference backend's function table and its workspace: every scratch buffer
 * is sized here once, for a max_tokens call, and carved with mok_take (MOK_ALIGN boundaries, so
 * threads writing neighbouring buffers never share a cache line) from one host allocation, so
 * forward and backward never allocate. The steps themselves live in one file each (see cpu.h);
 * layer.c strings them together.
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu.h"

static mok_status cpu_context_init(mok_context *ctx) {
  (void)ctx;
  return MOK_OK;
}

/* Bytes of memory this process may still take: MemAvailable, or less under a cgroup (v2)
 * limit; SIZE_MAX when neither can be read. */
static size_t host_available(void) {
  size_t avail = SIZE_MAX;
  unsigned long long kb, max, cur;
  char line[256];
  FILE *f = fopen("/proc/meminfo", "r");
  if (f) {
    while (fgets(line, sizeof line, f))
      if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) avail = (size_t)kb * 1024;
    fclose(f);
  }
  FILE *m = fopen("/sys/fs/cgroup/memory.max", "r"), *c = fopen("/sys/fs/cgroup/memory.current", "r");
  if (m && c && fscanf(m, "%llu", &max) == 1 && fscanf(c, "%llu", &cur) == 1 && max > cur &&
      max - cur < avail)
    avail = (size_t)(max - cur); /* "max" (no limit) does not scan */
  if (m) fclose(m);
  if (c) fclose(c);
  return avail;
}

static mok_status cpu_workspace_init(mok_workspace *ws) {
  const mok_shape *s = &ws->shape;
  const int64_t T = s->max_tokens, H = s->hidden, I = s->inter, Is = s->shared_inter;
  const int64_t Im = I > Is ? I : Is;
  const int64_t R = mok_saved_layout_of(ws, T).rows_cap;
  cpu_state *st = calloc(1, sizeof *st);
  if (!st) return mok_fail(MOK_ERR_OUT_OF_MEMORY, "no host memory for the CPU workspace");
  st->threads = ws->ctx->cfg.threads > 0 ? ws->ctx->cfg.threads : omp_get_max_threads();
  /* MOK_FP8 adds the published Q_row rows, the routed Q_row rows of dy, and per thread the
   * quantized [dgate | dup] of one row (the gate/up dgrad's operand). */
  const int64_t fp8 = s->precision == MOK_FP8;
  /* A thread's scratch: one output row of H, a second of H, dh of I_m (and FP8's 2 I_m). */
  st->per_thread_len = mok_round_up(2 * H + Im + fp8 * 2 * Im, 16);

  const int64_t S = T * s->top_k;
  size_t c = 0;
  size_t o_sx = mok_take(&c, (T * H) * (int64_t)sizeof(uint16_t));
  size_t o_sdy = mok_take(&c, (T * H) * (int64_t)sizeof(uint16_t));
  size_t o_sids = mok_take(&c, S * (int64_t)sizeof(int32_t));
  size_t o_sw = mok_take(&c, S * (int64_t)sizeof(float));
  size_t o_slot = mok_take(&c, (S * H) * (int64_t)sizeof(uint16_t));
  size_t o_sdtw = mok_take(&c, S * (int64_t)sizeof(float));
  size_t o_sq = mok_take(&c, fp8 * (T * H) * (int64_t)sizeof(float));
  size_t o_xf = mok_take(&c, (T * H) * (int64_t)sizeof(float));
  size_t o_dyf = mok_take(&c, (T * H) * (int64_t)sizeof(float));
  size_t o_xr = mok_take(&c, (R * H) * (int64_t)sizeof(float));
  size_t o_dyr = mok_take(&c, (R * H) * (int64_t)sizeof(float));
  size_t o_dyq = mok_take(&c, fp8 * (R * H) * (int64_t)sizeof(float));
  size_t o_side = mok_take(&c, (T * H) * (int64_t)sizeof(float));
  size_t o_hwf = mok_take(&c, (R * I) * (int64_t)sizeof(float));
  size_t o_dguf = mok_take(&c, (R * 2 * I) * (int64_t)sizeof(float));
  size_t o_hsf = mok_take(&c, (T * Is) * (int64_t)sizeof(float));
  size_t o_dgusf = mok_take(&c, (T * 2 * Is) * (int64_t)sizeof(float));
  size_t o_pgu = mok_take(&c, (2 * Im * H) * (int64_t)sizeof(float));
  size_t o_pdown = mok_take(&c, (H * Im) * (int64_t)sizeof(float));
  size_t o_thr = mok_take(&c, (st->threads * st->per_thread_len) * (int64_t)sizeof(float));
  size_t o_cur = mok_take(&c, (ws->experts_local) * (int64_t)sizeof(int32_t));

  /* Refused here rather than allocated: the kernel commits pages only as they are touched, so
   * a workspace larger than the machine used to be made, then the OOM killer ended the process
   * in the middle of a forward. A saved of max_tokens, which the caller needs too, counts. */
  const size_t need = c + mok_saved_layout_of(ws, T).bytes, avail = host_available();
  if (need > avail) {
    free(st);
    return mok_fail(MOK_ERR_OUT_OF_MEMORY,
                    "CPU workspace: %zu bytes of scratch and %zu of a saved for max_tokens "
                    "(%lld) need %.1f GB; the machine has %.1f GB available; expected a smaller "
                    "max_tokens or shape", c, need - c, (long long)T, need / 1e9, avail / 1e9);
  }
  char *b = aligned_alloc(MOK_ALIGN, c);
  if (!b) {
    free(st);
    return mok_fail(MOK_ERR_OUT_OF_MEMORY,
                    "CPU workspace: no host memory for %zu bytes of scratch (max_tokens %lld)", c,
                    (long long)T);
  }
  st->block = b;
  st->sym_x = (uint16_t *)(b + o_sx);
  st->sym_dy = (uint16_t *)(b + o_sdy);
  st->sym_ids = (int32_t *)(b + o_sids);
  st->sym_w = (float *)(b + o_sw);
  st->slot = (uint16_t *)(b + o_slot);
  st->sym_dtw = (float *)(b + o_sdtw);
  st->sym_q = fp8 ? (float *)(b + o_sq) : NULL;
  st->xf = (float *)(b + o_xf);
  st->dyf = (float *)(b + o_dyf);
  st->xr = (float *)(b + o_xr);
  st->dyr = (float *)(b + o_dyr);
  st->dyq = fp8 ? (float *)(b + o_dyq) : NULL;
  st->side = (float *)(b + o_side);
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

/* A call api.c refused meets the group at the host barrier its forward or backward opens with. */
static mok_status cpu_refuse(mok_workspace *ws, void *stream) {
  (void)stream;
  int32_t bits = MOK_DEVERR_PEER_ARG;
  return mok_group_barrier(ws->ctx->cfg.group, ws->call, &bits);
}

const mok_backend_ops mok_cpu_ops = {
    .name = "cpu",
    .context_init = cpu_context_init,
    .workspace_init = cpu_workspace_init,
    .workspace_fini = cpu_workspace_fini,
    .schedule = cpu_layer_schedule,
    .forward = cpu_layer_forward,
    .backward = cpu_layer_backward,
    .check = cpu_check,
    .copy_to_host = cpu_copy_to_host,
    .group_ready = NULL,
    .refuse = cpu_refuse,
    .device_barriers = 0,
    .fp8_weights = cpu_fp8_weights,
    .mxfp8_to_bf16 = cpu_mxfp8_to_bf16,
};
