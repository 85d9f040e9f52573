/*
 * workspace.cu: the CUDA backend's workspace: one device allocation carved by scratch_layout_of,
 * the table of every EP rank's symmetric buffers, and, for an NCCL group, the workspace as a
 * symmetric window read through NCCL's device API.
 */
#include <nccl.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/backend.h"

/* An expert kind's FP8 operands for R rows, K = H, inner size I (0: none). */
static fp8_rows fp8_rows_of(size_t *c, int64_t R, int64_t H, int64_t I) {
  fp8_rows f;
  memset(&f, 0, sizeof f);
  if (I == 0) return f;
  const int64_t Hg = (H + 127) / 128, Ig = (I + 127) / 128, blocks = R / 128;
  f.R = R;
  f.x.q = mok_take(c, R * H);
  f.x.s = mok_take(c, Hg * R * 4);
  f.h.q = mok_take(c, R * 2 * Ig * 128);
  f.h.s = mok_take(c, 2 * Ig * R * 4);
  f.dyT.q = mok_take(c, H * R);
  f.dyT.s = mok_take(c, blocks * H * 4);
  f.xT.q = mok_take(c, H * R);
  f.xT.s = mok_take(c, blocks * H * 4);
  f.hT.q = mok_take(c, I * R);
  f.hT.s = mok_take(c, blocks * I * 4);
  f.dgT.q = mok_take(c, 2 * I * R);
  f.dgT.s = mok_take(c, blocks * 2 * I * 4);
  return f;
}

static scratch_layout scratch_layout_of(const mok_workspace *ws, int64_t rows_cap) {
  const mok_shape *s = &ws->shape;
  const int64_t T = s->max_tokens, slots = T * s->top_k;
  scratch_layout L;
  size_t c = 0;
  const int64_t ranks = ws->ctx->cfg.ep_size, pub = ranks > 1;
  L.sticky = mok_take(&c, 16);
  L.bstatus = mok_take(&c, MOK_BSTATUS_WORDS * 4);
  L.rstatus = mok_take(&c, 16);
  L.mx = mok_take(&c, 16);
  L.table = mok_take(&c, sizeof(ep_table));
  L.flags = mok_take(&c, 2 * EP_MAX * 8);
  L.epoch = mok_take(&c, 16);
  L.gsync = mok_take(&c, 16);
  L.mark = mok_take(&c, 16);
  L.sym_tokens = mok_take(&c, 16);
  L.sym_ids = mok_take(&c, pub * slots * 4);
  L.sym_w = mok_take(&c, pub * slots * 4);
  L.sym_x = mok_take(&c, pub * T * s->hidden * 2);
  L.sym_dy = mok_take(&c, pub * T * s->hidden * 2);
  L.chunk_counts =
      mok_take(&c, ranks * ((slots + SCHED_CHUNK - 1) / SCHED_CHUNK) * ws->experts_local * 4);
  L.xr_tag = mok_take(&c, 3 * 8);
  const int64_t f32_bytes = (s->shared_inter ? T : 0) * s->hidden * 4;
  /* FP8 quantizes routed rows straight from their tokens: it has no bf16 x or dy rows */
  const int64_t slot_bytes = slots * s->hidden * 2,
                row_bytes = s->precision == MOK_FP8 ? 0 : rows_cap * s->hidden * 2;
  L.xr = mok_take(&c, mok_max64(row_bytes, f32_bytes));
  L.rows_f32 = L.xr;
  L.dyr = mok_take(&c, pub ? row_bytes : mok_max64(row_bytes, slot_bytes));
  L.slots = pub ? mok_take(&c, slot_bytes) : L.dyr;
  L.dgu = mok_take(&c, rows_cap * 2 * s->inter * 2);
  L.dtw_part = mok_take(&c, slots * (s->inter / 64) * 4);
  L.dgus = mok_take(&c, T * 2 * s->shared_inter * 2);
  memset(&L.f8, 0, sizeof L.f8);
  if (s->precision == MOK_FP8) {
    L.f8.routed = fp8_rows_of(&c, rows_cap, s->hidden, s->inter);
    L.f8.shared = fp8_rows_of(&c, mok_round_up(T, 128), s->hidden, s->shared_inter);
  }
  L.bytes = c;
  return L;
}

static mok_status table_write(mok_workspace *ws);
static mok_status window_open(mok_workspace *ws);

static int in_nccl_group(const mok_workspace *ws) {
  return ws->ctx->cfg.group && ws->ctx->cfg.group->nccl;
}

mok_status cuda_workspace_init(mok_workspace *ws) {
  const mok_shape *s = &ws->shape;
  if (s->hidden % 64 || s->inter % 64 || s->shared_inter % 64)
    return mok_fail(MOK_ERR_UNSUPPORTED,
                    "CUDA backend: H (%lld), I (%lld) and I_s (%lld) must be multiples of 64",
                    (long long)s->hidden, (long long)s->inter, (long long)s->shared_inter);
  cuda_ws *cw = (cuda_ws *)calloc(1, sizeof *cw);
  if (!cw) return mok_fail(MOK_ERR_OUT_OF_MEMORY, "no host memory for the CUDA workspace");
  device_guard g;
  mok_status st = device_enter(ws->ctx, &g);
  if (st != MOK_OK) {
    free(cw);
    return st;
  }
  cw->rows_cap = mok_saved_layout_of(ws, s->max_tokens).rows_cap;
  cw->L = scratch_layout_of(ws, cw->rows_cap);
  /* An NCCL group's workspace becomes a symmetric window: NCCL must allocate it. */
  cudaError_t e = cudaSuccess;
  if (in_nccl_group(ws)) st = mok_nccl_mem_alloc((void **)&cw->mem, cw->L.bytes);
  else e = cudaMalloc((void **)&cw->mem, cw->L.bytes);
  if (st == MOK_OK && e == cudaSuccess) e = cudaMemset(cw->mem, 0, cw->L.bytes);
  /* Forward numbers (rows.cu) count from a base of this workspace's own: a saved of a workspace
   * since destroyed never names a later one at the same address. */
  static uint64_t workspaces_made;
  const uint64_t base = __atomic_add_fetch(&workspaces_made, 1, __ATOMIC_RELAXED) << 32;
  if (st == MOK_OK && e == cudaSuccess)
    e = cudaMemcpy(cw->mem + cw->L.xr_tag + 16, &base, sizeof base, cudaMemcpyHostToDevice);
  device_leave(ws->ctx, &g);
  ws->backend = cw;
  ws->bytes = cw->L.bytes;
  if (st != MOK_OK || e != cudaSuccess) {
    size_t bytes = cw->L.bytes;
    cudaGetLastError();
    cuda_workspace_fini(ws);
    if (st != MOK_OK) return st;
    return mok_fail(e == cudaErrorMemoryAllocation ? MOK_ERR_OUT_OF_MEMORY : MOK_ERR_CUDA,
                    "CUDA workspace of %zu bytes: %s", bytes, cudaGetErrorString(e));
  }
  st = in_nccl_group(ws) ? window_open(ws) : table_write(ws);
  if (st != MOK_OK) {
    cuda_workspace_fini(ws);
    return st;
  }
  return MOK_OK;
}

void cuda_workspace_fini(mok_workspace *ws) {
  cuda_ws *cw = (cuda_ws *)ws->backend;
  if (!cw) return;
  device_guard g;
  if (device_enter(ws->ctx, &g) == MOK_OK) {
    if (in_nccl_group(ws)) {
      mok_nccl_window_deregister(ws->ctx->cfg.group, cw->win); /* collective */
      mok_nccl_mem_free(cw->mem);
    } else {
      cudaFree(cw->mem);
    }
    device_leave(ws->ctx, &g);
  }
  free(cw);
  ws->backend = NULL;
}

/* ---- the EP table ---------------------------------------------------------------------------- */
static ep_offsets offsets_of(const scratch_layout *L) {
  ep_offsets o = {L->sym_x, L->sym_dy,  L->sym_ids,  L->sym_w,
                  L->sym_tokens, L->slots, L->dtw_part, L->flags};
  return o;
}

/* Rank r's entries, from its workspace. */
static void table_entry(ep_table *t, int r, const mok_workspace *ws) {
  const cuda_ws *cw = (const cuda_ws *)ws->backend;
  const ep_offsets o = offsets_of(&cw->L);
  ep_table_set(t, r, cw->mem, &o);
}

/* Writes `ws`'s table: every rank of a complete group, else only its own entry. Called at
 * creation and whenever the group's table changes (outside any capture). */
static mok_status table_write(mok_workspace *ws) {
  const mok_context *ctx = ws->ctx;
  cuda_ws *cw = (cuda_ws *)ws->backend;
  ep_table t;
  memset(&t, 0, sizeof t);
  mok_ep_group *grp = ctx->cfg.group;
  mok_workspace *members[EP_MAX] = {0};
  if (grp && mok_group_members(grp, members))
    for (int r = 0; r < ctx->cfg.ep_size; r++) table_entry(&t, r, members[r]);
  else
    table_entry(&t, ctx->cfg.ep_rank, ws);
  device_guard g;
  TRY(device_enter(ctx, &g));
  cudaError_t e = cudaMemcpy(cw->mem + cw->L.table, &t, sizeof t, cudaMemcpyHostToDevice);
  device_leave(ctx, &g);
  return e == cudaSuccess ? MOK_OK : cuda_fail(e, "EP table");
}

/* The group has every rank's workspace now: each rank's table gets all of them. (An NCCL
 * group's table was read from its window when the workspace was made.) */
mok_status cuda_group_ready(mok_workspace *ws) {
  if (in_nccl_group(ws)) return MOK_OK;
  mok_workspace *members[EP_MAX] = {0};
  if (!mok_group_members(ws->ctx->cfg.group, members)) return MOK_OK;
  for (int r = 0; r < ws->ctx->cfg.ep_size; r++) TRY(table_write(members[r]));
  return MOK_OK;
}

/* An NCCL group's workspace (collective, one process per rank): every rank checks that all have
 * its shape, registers its memory as a symmetric window, and reads every rank's buffers into its
 * table through the window. The shape check gathers through the (still unused) table. */
static mok_status window_setup(mok_workspace *ws, cudaStream_t stream) {
  cuda_ws *cw = (cuda_ws *)ws->backend;
  mok_ep_group *grp = ws->ctx->cfg.group;
  const int rank = ws->ctx->cfg.ep_rank, R = ws->ctx->cfg.ep_size;
  const mok_shape *s = &ws->shape;
  enum { N = 8 };
  const int64_t mine[N] = {s->max_tokens, s->hidden,   s->inter,           s->shared_inter,
                           s->experts,    s->top_k,    (int64_t)s->precision, s->routed_rows};
  int64_t all[EP_MAX][N];
  static_assert(sizeof all <= sizeof(ep_table), "the shape gather uses the table's room");
  char *room = cw->mem + cw->L.table;
  CUDA_TRY(cudaMemcpyAsync(room + rank * sizeof mine, mine, sizeof mine, cudaMemcpyHostToDevice,
                           stream), "shape check");
  TRY(mok_nccl_all_gather(grp, room + rank * sizeof mine, room, sizeof mine, stream));
  CUDA_TRY(cudaMemcpyAsync(all, room, R * sizeof mine, cudaMemcpyDeviceToHost, stream),
           "shape check");
  CUDA_TRY(cudaMemsetAsync(room, 0, R * sizeof mine, stream), "shape check");
  CUDA_TRY(cudaStreamSynchronize(stream), "shape check");
  for (int r = 0; r < R; r++)
    if (memcmp(all[r], mine, sizeof mine))
      return mok_fail(MOK_ERR_INVALID_ARG,
                      "rank %d's workspace has another shape than rank %d's: (T, H, I, I_s, E, k) "
                      "= (%lld, %lld, %lld, %lld, %lld, %lld) against (%lld, %lld, %lld, %lld, "
                      "%lld, %lld), or another precision or routed_rows; every rank of an NCCL "
                      "group makes its workspace with the same shape", r, rank,
                      (long long)all[r][0], (long long)all[r][1], (long long)all[r][2],
                      (long long)all[r][3], (long long)all[r][4], (long long)all[r][5],
                      (long long)mine[0], (long long)mine[1], (long long)mine[2],
                      (long long)mine[3], (long long)mine[4], (long long)mine[5]);
  /* This rank's mark, which every rank reads back through the window. */
  const size_t mark_at = cw->L.mark;
  const int32_t mark = EP_MARK + rank;
  int32_t *bad = AT(cw->mem, cw->L.sticky, int32_t), seen = 0;
  CUDA_TRY(cudaMemcpyAsync(cw->mem + mark_at, &mark, sizeof mark, cudaMemcpyHostToDevice, stream),
           "EP mark");
  CUDA_TRY(cudaStreamSynchronize(stream), "EP mark");
  TRY(mok_nccl_window_register(grp, cw->mem, cw->L.bytes, &cw->win));
  const ep_offsets o = offsets_of(&cw->L);
  CUDA_TRY(ep_table_from_window_launch(cw->win, &o, R, mark_at,
                                       AT(cw->mem, cw->L.table, ep_table), bad, stream),
           "EP table from the NCCL window");
  CUDA_TRY(cudaMemcpyAsync(&seen, bad, sizeof seen, cudaMemcpyDeviceToHost, stream), "EP table");
  CUDA_TRY(cudaMemsetAsync(bad, 0, sizeof seen, stream), "EP table");
  CUDA_TRY(cudaStreamSynchronize(stream), "EP table");
  if (seen)
    return mok_fail(MOK_ERR_UNSUPPORTED, "the NCCL window does not show every rank's workspace "
                                         "where NCCL's device API says (NCCL %d loaded, mok built "
                                         "with the headers of %d.%d.%d)",
                    mok_nccl_version(), NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
  return MOK_OK;
}

static mok_status window_open(mok_workspace *ws) {
  device_guard g;
  TRY(device_enter(ws->ctx, &g));
  cudaStream_t stream;
  mok_status st = MOK_OK;
  cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) {
    st = window_setup(ws, stream);
    cudaStreamDestroy(stream);
  } else {
    st = cuda_fail(e, "a stream for the NCCL window");
  }
  device_leave(ws->ctx, &g);
  return st;
}
