/*
 * backend.cu: the CUDA backend: device checks, the workspace's scratch memory, and the order in
 * which forward, recompute and backward queue their kernels (DESIGN §2):
 *   forward:  schedule -> dispatch x -> gate/up (+SwiGLU) -> [shared gate/up] -> down
 *             -> [shared down] -> combine
 *   backward: check saved -> dispatch x, dy -> down dgrad (+SwiGLU bwd, router partials)
 *             -> down weight grad -> gate/up dgrad -> gate/up weight grad -> [shared expert:
 *             down dgrad, gate/up dgrad, the two weight grads] -> combine, router gradient
 * The workspace lets buffers whose uses do not overlap in this order share memory
 * (scratch_layout): products run side by side (a side stream, a fused launch) would need them
 * apart again.
 * With an EP group (DESIGN §2.3) each direction also publishes this rank's inputs into its
 * symmetric buffers and meets the group at device barriers (ep.cu): open (inputs published),
 * check (after the schedule: ids, capacity), close (every push into this rank's slots done);
 * routed outputs and router partials are pushed into the slots of the token's own rank.
 * Nothing here synchronises or allocates after workspace creation.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "internal.h"

/* ---- device -------------------------------------------------------------------------------- */
extern "C" int mok_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

static mok_status cuda_fail(cudaError_t e, const char *what) {
  return mok_fail(MOK_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

#define CUDA_TRY(expr, what)                          \
  do {                                                \
    cudaError_t e_ = (expr);                          \
    if (e_ != cudaSuccess) return cuda_fail(e_, what); \
  } while (0)

#define TRY(expr)                  \
  do {                             \
    mok_status st_ = (expr);       \
    if (st_ != MOK_OK) return st_; \
  } while (0)

#define AT(base, off, type) ((type *)((base) + (off)))

/* Makes the context's device current for the length of a call and restores the caller's. */
typedef struct device_guard {
  int prev, ok;
} device_guard;

static mok_status device_enter(const mok_context *ctx, device_guard *g) {
  g->ok = 0;
  CUDA_TRY(cudaGetDevice(&g->prev), "cudaGetDevice");
  if (g->prev != ctx->cfg.device) CUDA_TRY(cudaSetDevice(ctx->cfg.device), "cudaSetDevice");
  g->ok = 1;
  return MOK_OK;
}

static void device_leave(const mok_context *ctx, device_guard *g) {
  if (g->ok && g->prev != ctx->cfg.device) cudaSetDevice(g->prev);
}

static mok_status cuda_context_init(mok_context *ctx) {
  int n = mok_cuda_device_count();
  if (n == 0) return mok_fail(MOK_ERR_UNSUPPORTED, "CUDA backend: no CUDA device is visible");
  int dev = ctx->cfg.device;
  if (dev < 0 || dev >= n)
    return mok_fail(MOK_ERR_INVALID_ARG, "device is %d; expected 0..%d", dev, n - 1);
  cudaDeviceProp p;
  CUDA_TRY(cudaGetDeviceProperties(&p, dev), "cudaGetDeviceProperties");
  if (p.major != 9 || p.minor != 0)
    return mok_fail(MOK_ERR_UNSUPPORTED,
                    "device %d (%s) is sm_%d%d; mok's kernels need sm_90 (Hopper)", dev, p.name,
                    p.major, p.minor);
  if (tma_init() != 0)
    return mok_fail(MOK_ERR_UNSUPPORTED,
                    "the CUDA driver has no cuTensorMapEncodeTiled (need 12.0+)");
  device_guard g;
  int max_ctas[2] = {0, 0};
  TRY(device_enter(ctx, &g));
  cudaError_t e = gemm_init(max_ctas);
  if (e == cudaSuccess) e = ep_preload();
  if (e == cudaSuccess) e = rows_preload();
  if (e == cudaSuccess) e = schedule_preload();
  device_leave(ctx, &g);
  if (e != cudaSuccess) return cuda_fail(e, "GEMM kernel attributes");
  ctx->sm_count = p.multiProcessorCount;
  if (ctx->cfg.sms > 0 && ctx->cfg.sms < ctx->sm_count) ctx->sm_count = ctx->cfg.sms;
  /* Emulated ranks share this GPU. A persistent GEMM needs all its CTAs resident at once, and a
   * rank waiting at a barrier holds an SM until its peers arrive: with every rank's GEMM asking
   * for every SM, a peer's GEMM could wait for its last CTA forever. So each rank's GEMMs get an
   * equal share of the clusters left when every rank's barrier spoils one cluster's place (a
   * cluster must fit in one GPC: 4 ranks' GEMMs of 8 clusters of 4 each hung on the H200). They
   * run clusters of 2 (cluster_shape). */
  const int R = ctx->cfg.group && !ctx->cfg.group->nccl ? ctx->cfg.ep_size : 0;
  for (int i = 0; i < 2; i++) {
    const int C = GEMM_CM * (i + 1);
    int n = (ctx->sm_count < max_ctas[i] ? ctx->sm_count : max_ctas[i]) / C;
    if (R) n = (n - R) / R;
    ctx->gemm_ctas[i] = n < 1 ? C : n * C;
  }
  return MOK_OK;
}

/* ---- workspace scratch ----------------------------------------------------------------------- */
typedef struct scratch_layout {
  size_t sticky;        /* int32: error bits until mok_check */
  size_t bstatus;       /* int32 [4]: backward's status, the forward's as checked by saved_open
                         * (the group's barrier adds to it without touching saved) */
  size_t rstatus;       /* int32 [4]: the error word of a call refused on the host */
  size_t table;         /* ep_table: every rank's symmetric buffers */
  size_t flags;         /* u64 [2][EP_MAX]: barrier words the ranks write here (ep.cu) */
  size_t epoch;         /* u32: barriers passed */
  size_t gsync;         /* u32 [2]: the grid barrier of the phased launches (grid_sync) */
  size_t mark;          /* int32: NCCL group, EP_MARK + rank, read by every rank through the
                         * window when the workspace is made (ep_table_from_window) */
  size_t sym_tokens;    /* int32: published T */
  size_t sym_ids, sym_w;  /* [max_tokens * k] published topk_ids, topk_weights (ep > 1) */
  size_t sym_x, sym_dy;   /* bf16 [max_tokens, H] published x, dy (ep > 1) */
  size_t chunk_counts;  /* int32 [chunks, E_local] */
  size_t xr_tag;        /* u64 [3]: whose routed x rows xr holds (saved_open_launch) */
  /* Regions that hold two things in turn share memory (the backward's order keeps their uses
   * apart, see the header). */
  size_t xr;            /* bf16 [rows_cap, H] routed x rows; then f32 [T, H] rows_f32 */
  size_t dyr;           /* bf16 [rows_cap, H] routed dy rows (bwd); at ep = 1 also slots */
  size_t slots;         /* bf16 [T*k, H] expert output (fwd) / dx (bwd) per slot. At ep = 1 it
                         * is dyr: the forward has no dy rows, and the backward's gate/up dgrad
                         * writes it after the last reader of dy rows (down's weight gradient).
                         * At ep > 1 it is memory of its own: peers write their rows into it
                         * while this rank may still read its dy rows. */
  size_t dgu;           /* bf16 [rows_cap, 2I] */
  size_t dtw_part;      /* f32 [T*k, I/64] router-gradient partials */
  size_t rows_f32;      /* f32 [T, H] shared-expert output (fwd) / dx (bwd); none if I_s = 0.
                         * It is xr: written by the shared expert's second product, which runs
                         * after the last reader of x rows (the routed gate/up forward; the
                         * routed gate/up weight gradient) */
  size_t dgus;          /* bf16 [T, 2I_s] */
  size_t bytes;
} scratch_layout;

typedef struct cuda_ws {
  char *mem;
  void *win;        /* NCCL group: mem as a symmetric window (ncclWindow_t) */
  scratch_layout L;
  int64_t rows_cap; /* of max_tokens */
} cuda_ws;

static scratch_layout scratch_layout_of(const mok_workspace *ws, int64_t rows_cap) {
  const mok_shape *s = &ws->shape;
  const int64_t T = s->max_tokens, slots = T * s->top_k;
  scratch_layout L;
  size_t c = 0;
  const int64_t ranks = ws->ctx->cfg.ep_size, pub = ranks > 1;
  L.sticky = mok_take(&c, 16);
  L.bstatus = mok_take(&c, 16);
  L.rstatus = mok_take(&c, 16);
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
  const int64_t slot_bytes = slots * s->hidden * 2, row_bytes = rows_cap * s->hidden * 2;
  L.xr = mok_take(&c, mok_max64(row_bytes, f32_bytes));
  L.rows_f32 = L.xr;
  L.dyr = mok_take(&c, pub ? row_bytes : mok_max64(row_bytes, slot_bytes));
  L.slots = pub ? mok_take(&c, slot_bytes) : L.dyr;
  L.dgu = mok_take(&c, rows_cap * 2 * s->inter * 2);
  L.dtw_part = mok_take(&c, slots * (s->inter / 64) * 4);
  L.dgus = mok_take(&c, T * 2 * s->shared_inter * 2);
  L.bytes = c;
  return L;
}

static void cuda_workspace_fini(mok_workspace *ws);
static mok_status table_write(mok_workspace *ws);
static mok_status window_open(mok_workspace *ws);

static int in_nccl_group(const mok_workspace *ws) {
  return ws->ctx->cfg.group && ws->ctx->cfg.group->nccl;
}

static mok_status cuda_workspace_init(mok_workspace *ws) {
  const mok_shape *s = &ws->shape;
  if (s->precision == MOK_FP8)
    return mok_fail(MOK_ERR_UNSUPPORTED, "the CUDA backend does not run MOK_FP8 yet");
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

static void cuda_workspace_fini(mok_workspace *ws) {
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
static mok_status cuda_group_ready(mok_workspace *ws) {
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

/* ---- per-call views -------------------------------------------------------------------------- */
typedef struct call {
  mok_workspace *ws;
  cudaStream_t stream;
  mok_saved_layout S;
  char *saved;
  char *scratch;
  const scratch_layout *L;
  int T, H, I, Is, k, E_local;
  int rank, ranks, slots_cap; /* EP: this rank, the group's size (1 without a group) */
  int32_t *status;            /* the error word the kernels of this call check */
} call;

static call call_of(mok_workspace *ws, int64_t tokens, const void *saved, void *stream) {
  cuda_ws *cw = (cuda_ws *)ws->backend;
  call c;
  c.ws = ws;
  c.stream = (cudaStream_t)stream;
  c.S = mok_saved_layout_of(ws, tokens);
  c.saved = (char *)saved;
  c.scratch = cw->mem;
  c.L = &cw->L;
  c.T = (int)tokens;
  c.H = (int)ws->shape.hidden;
  c.I = (int)ws->shape.inter;
  c.Is = (int)ws->shape.shared_inter;
  c.k = ws->shape.top_k;
  c.E_local = (int)ws->experts_local;
  c.rank = ws->ctx->cfg.ep_rank;
  c.ranks = ws->ctx->cfg.ep_size;
  c.slots_cap = (int)(ws->shape.max_tokens * c.k);
  c.status = saved ? AT(c.saved, c.S.status, int32_t) : NULL;
  return c;
}

static const int32_t *status_of(const call *c) { return c->status; }
static const ep_table *table_of(const call *c) { return AT(c->scratch, c->L->table, ep_table); }
/* Whose routed x rows xr holds (rows.cu), where they outlive the forward: ep = 1 (a group's rows
 * come from other ranks' inputs) without a shared expert (its fp32 rows go over them); else
 * NULL. */
static uint64_t *xr_tag_of(const call *c) {
  return c->ranks == 1 && !c->Is ? AT(c->scratch, c->L->xr_tag, uint64_t) : NULL;
}

/* The group's barrier (no group: nothing); `add`: error bits of this rank. */
static mok_status barrier_with(const call *c, int when, int32_t add) {
  const mok_ep_group *grp = c->ws->ctx->cfg.group;
  if (!grp) return MOK_OK;
  CUDA_TRY(ep_barrier_launch(table_of(c), c->rank, c->ranks, when, c->status,
                             AT(c->scratch, c->L->sticky, int32_t),
                             AT(c->scratch, c->L->epoch, unsigned),
                             AT(c->scratch, c->L->sym_tokens, int32_t), c->T, add,
                             (long long)grp->timeout_ms * 1000000LL, c->stream),
           "EP barrier");
  return MOK_OK;
}

static mok_status barrier(const call *c, int when) { return barrier_with(c, when, 0); }

/* Copies `bytes` of this rank's input into its symmetric buffer at `off` (ep > 1). */
static mok_status publish(const call *c, size_t off, const void *src, size_t bytes) {
  if (c->ranks == 1) return MOK_OK;
  CUDA_TRY(cudaMemcpyAsync(c->scratch + off, src, bytes, cudaMemcpyDeviceToDevice, c->stream),
           "EP publish");
  return MOK_OK;
}

/* Host-checkable: every pointer the kernels touch must be device memory. */
static mok_status check_device(const void *p, const char *name) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return mok_fail(MOK_ERR_INVALID_ARG, "%s (%p) is not a CUDA pointer", name, p);
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "%s (%p) is host memory; the CUDA backend needs device pointers", name, p);
  return MOK_OK;
}

static mok_status check_weights_device(const mok_weights *w) {
  TRY(check_device(w->w_gate, "w.w_gate"));
  TRY(check_device(w->w_up, "w.w_up"));
  TRY(check_device(w->w_down, "w.w_down"));
  if (w->ws_gate) {
    TRY(check_device(w->ws_gate, "w.ws_gate"));
    TRY(check_device(w->ws_up, "w.ws_up"));
    TRY(check_device(w->ws_down, "w.ws_down"));
  }
  return MOK_OK;
}

/* ---- launching products ---------------------------------------------------------------------- */
static mok_status map2(CUtensorMap *m, const void *p, int64_t rows, int64_t cols, int box_rows) {
  int r = tma_map_2d(m, p, rows, cols, box_rows);
  if (r) return mok_fail(MOK_ERR_CUDA, "cuTensorMapEncodeTiled (2D %lld x %lld) failed: %d",
                         (long long)rows, (long long)cols, r);
  return MOK_OK;
}

static mok_status map3(CUtensorMap *m, const void *p, int64_t b, int64_t rows, int64_t cols,
                       int box_rows) {
  int r = tma_map_3d(m, p, b, rows, cols, box_rows);
  if (r) return mok_fail(MOK_ERR_CUDA, "cuTensorMapEncodeTiled (3D %lld x %lld x %lld) failed: %d",
                         (long long)b, (long long)rows, (long long)cols, r);
  return MOK_OK;
}

/* The cluster shape of every product (gemm.cuh): the context's knob, else 2 x 1 CTAs. Clusters
 * of 2 x 2 move a quarter less data from L2 to the SMs, but only 30 of them fit on an H200 (120
 * CTAs) and a product with an odd number of N tiles leaves two CTAs of a cluster idle. Measured
 * side by side (DESIGN §2.2), 2 x 1 made the backward 3.8-6.9 % faster than 2 x 2 on the four
 * large shapes and forward + backward faster on all six. Emulated ranks get 2 x 1 too: the context
 * refuses the knob at 4 for them. Sets g->cn. */
static void cluster_shape(const call *c, gemm_args *g) {
  const int cluster = c->ws->ctx->cfg.cluster;
  g->cn = cluster ? cluster / GEMM_CM : 1;
}

static mok_status run(const call *c, gemm_kind kind, const gemm_args *g, const char *what) {
  cudaError_t e = gemm_launch(kind, g, c->ws->ctx->gemm_ctas[g->cn - 1], c->stream);
  return e == cudaSuccess ? MOK_OK : cuda_fail(e, what);
}

/* Row-grouped tile space: routed rows from the schedule, or T plain rows (shared expert). */
static void rows_routed(const call *c, gemm_args *g) {
  g->peer_out = table_of(c)->slots;
  g->slots_cap = c->slots_cap;
  g->offsets = AT(c->saved, c->S.offsets, int32_t);
  g->mblock_expert = AT(c->saved, c->S.mblock_expert, int32_t);
  g->experts = c->E_local;
  g->m_tiles_max = (int)(c->S.rows_cap / GEMM_BM);
  g->rows_valid = (int)c->S.rows_cap;
}

static void rows_plain(const call *c, gemm_args *g) {
  g->offsets = NULL;
  g->mblock_expert = NULL;
  g->experts = 1;
  g->m_tiles_max = (c->T + GEMM_BM - 1) / GEMM_BM;
  g->rows_valid = c->T;
}

/* gu, hw <- A [rows, H] x [gate | up]^T (rows routed, or the shared expert's T rows): the
 * arguments of that phase of the forward's launch. */
static mok_status gateup_fwd(const call *c, int routed, const void *a, const void *w_gate,
                             const void *w_up, int64_t experts, int64_t I, void *gu, void *hw,
                             gemm_args *out) {
  gemm_args g;
  memset(&g, 0, sizeof g);
  int64_t rows = routed ? c->S.rows_cap : c->T;
  TRY(map3(&g.b0, w_gate, experts, I, c->H, 128));
  TRY(map3(&g.b1, w_up, experts, I, c->H, 128));
  if (routed) rows_routed(c, &g); else rows_plain(c, &g);
  g.status = c->status;
  g.n = (int)I;
  g.k = c->H;
  g.row_weight = routed ? AT(c->saved, c->S.row_weight, float) : NULL;
  g.out0 = gu;
  g.out1 = hw;
  cluster_shape(c, &g);
  TRY(map2(&g.a, a, rows, c->H, GEMM_BM / g.cn));
  *out = g;
  return MOK_OK;
}

/* out <- A [rows, I] x W_down^T: bf16 slot rows (routed) or fp32 rows (shared): the arguments
 * of that phase of the forward's launch. */
static mok_status down_fwd(const call *c, int routed, const void *a, const void *w_down,
                           int64_t experts, int64_t I, void *out, gemm_args *args) {
  gemm_args g;
  memset(&g, 0, sizeof g);
  int64_t rows = routed ? c->S.rows_cap : c->T;
  TRY(map3(&g.b0, w_down, experts, c->H, I, 128));
  if (routed) rows_routed(c, &g); else rows_plain(c, &g);
  g.status = c->status;
  g.n = c->H;
  g.k = (int)I;
  g.row_src = routed ? AT(c->saved, c->S.row_src, int32_t) : NULL;
  g.out0 = out;
  g.ld_out = c->H;
  cluster_shape(c, &g);
  TRY(map2(&g.a, a, rows, I, GEMM_BM / g.cn));
  *args = g;
  return MOK_OK;
}

/* dgu, router partials <- A [rows, H] x W_down, SwiGLU backward with the saved gu. */
static mok_status down_dgrad(const call *c, int routed, const void *a, const void *w_down,
                             int64_t experts, int64_t I, const void *gu, void *dgu, int part) {
  gemm_args g;
  memset(&g, 0, sizeof g);
  int64_t rows = routed ? c->S.rows_cap : c->T;
  TRY(map3(&g.b0, w_down, experts, c->H, I, 64));
  if (routed) rows_routed(c, &g); else rows_plain(c, &g);
  g.status = c->status;
  g.n = (int)I;
  g.k = c->H;
  g.row_weight = routed ? AT(c->saved, c->S.row_weight, float) : NULL;
  g.row_src = routed ? AT(c->saved, c->S.row_src, int32_t) : NULL;
  g.gu_in = (const __nv_bfloat16 *)gu;
  g.out0 = dgu;
  g.peer_aux = part ? table_of(c)->dtw : NULL;
  cluster_shape(c, &g);
  TRY(map2(&g.a, a, rows, c->H, GEMM_BM / g.cn));
  return run(c, GEMM_DGRAD_DOWN, &g, "down dgrad");
}

/* out <- dgu [rows, 2I] x [W_gate; W_up]: bf16 slot rows (routed) or fp32 rows (shared). */
static mok_status gateup_dgrad(const call *c, int routed, const void *dgu, const void *w_gate,
                               const void *w_up, int64_t experts, int64_t I, void *out) {
  gemm_args g;
  memset(&g, 0, sizeof g);
  int64_t rows = routed ? c->S.rows_cap : c->T;
  TRY(map3(&g.b0, w_gate, experts, I, c->H, 64));
  TRY(map3(&g.b1, w_up, experts, I, c->H, 64));
  if (routed) rows_routed(c, &g); else rows_plain(c, &g);
  g.status = c->status;
  g.n = c->H;
  g.k = (int)(2 * I);
  g.k_split = (int)I;
  g.row_src = routed ? AT(c->saved, c->S.row_src, int32_t) : NULL;
  g.out0 = out;
  g.ld_out = c->H;
  cluster_shape(c, &g);
  TRY(map2(&g.a, dgu, rows, 2 * I, GEMM_BM / g.cn));
  return run(c, GEMM_DGRAD_GATEUP, &g, "gate/up dgrad");
}

/* Per expert: out[m, n] = sum over its rows r of A[r, m] B[r, n]. Rows m < split go to out0,
 * the rest to out1. A is [rows, M], B is [rows, N] row-major. */
static mok_status wgrad(const call *c, int routed, const void *a, int64_t M, const void *b,
                        int64_t N, int64_t split, void *out0, void *out1, int accumulate,
                        const combine_args *comb) {
  gemm_args g;
  memset(&g, 0, sizeof g);
  int64_t rows = routed ? c->S.rows_cap : c->T;
  TRY(map2(&g.a, a, rows, M, 64));
  TRY(map2(&g.b0, b, rows, N, 64));
  g.offsets = routed ? AT(c->saved, c->S.offsets, int32_t) : NULL;
  g.counts = routed ? AT(c->saved, c->S.counts, int32_t) : NULL;
  g.experts = routed ? c->E_local : 1;
  g.status = c->status;
  g.m_tiles_max = (int)((M + GEMM_BM - 1) / GEMM_BM);
  g.m = (int)M;
  g.n = (int)N;
  g.k = routed ? 0 : c->T;
  g.k_split = (int)split;
  g.out0 = out0;
  g.out1 = out1;
  g.ld_out = (int)N;
  g.accumulate = accumulate;
  cluster_shape(c, &g);
  if (comb) g.comb = *comb; /* the backward's last weight gradient also combines dx */
  return run(c, GEMM_WGRAD, &g, "weight gradient");
}

/* ---- the layer ------------------------------------------------------------------------------- */
/* Forward and schedule: zero the call's error word, publish ids and weights, open, build the
 * schedule over every rank's ids, check (capacity). */
static mok_status schedule(const call *c, const mok_forward_args *a) {
  CUDA_TRY(cudaMemsetAsync(c->status, 0, 4 * sizeof(int32_t), c->stream), "status");
  const size_t slots_bytes = (size_t)c->T * c->k * 4;
  TRY(publish(c, c->L->sym_ids, a->topk_ids, slots_bytes));
  TRY(publish(c, c->L->sym_w, a->topk_weights, slots_bytes));
  TRY(barrier(c, EP_OPEN));
  sched_args s;
  s.topk_ids = a->topk_ids;
  s.topk_weights = a->topk_weights;
  s.slots = c->T * c->k;
  s.peers = table_of(c);
  s.rank = c->ranks > 1 ? c->rank : 0;
  s.ranks = c->ranks;
  s.slots_cap = c->slots_cap;
  s.top_k = c->k;
  s.chunks_per_rank = ((c->ranks > 1 ? c->slots_cap : s.slots) + SCHED_CHUNK - 1) / SCHED_CHUNK;
  s.experts = c->ws->shape.experts;
  s.experts_local = c->E_local;
  s.expert_base = (int)c->ws->expert_base;
  s.rows_cap = (int)c->S.rows_cap;
  s.status = AT(c->saved, c->S.status, int32_t);
  s.sticky = AT(c->scratch, c->L->sticky, int32_t);
  s.counts = AT(c->saved, c->S.counts, int32_t);
  s.offsets = AT(c->saved, c->S.offsets, int32_t);
  s.row_src = AT(c->saved, c->S.row_src, int32_t);
  s.mblock_expert = AT(c->saved, c->S.mblock_expert, int32_t);
  s.row_weight = AT(c->saved, c->S.row_weight, float);
  s.slot_row = AT(c->saved, c->S.slot_row, int32_t);
  s.chunk_counts = AT(c->scratch, c->L->chunk_counts, int32_t);
  s.sync = AT(c->scratch, c->L->gsync, unsigned);
  /* As many blocks as a GEMM has CTAs (one an SM; a share of them for emulated ranks). */
  CUDA_TRY(schedule_launch(&s, c->ws->ctx->gemm_ctas[0], c->stream), "schedule");
  return barrier(c, EP_CHECK);
}

/* The call's routed rows of src0 (and src1) into dst0 (dst1), from the saved schedule. */
static dispatch_args dispatch_of(const call *c, const __nv_bfloat16 *src0, __nv_bfloat16 *dst0,
                                 const __nv_bfloat16 *src1, __nv_bfloat16 *dst1,
                                 int32_t *filled) {
  dispatch_args d;
  d.status = status_of(c);
  d.offsets = AT(c->saved, c->S.offsets, int32_t);
  d.row_src = AT(c->saved, c->S.row_src, int32_t);
  d.slot_row = AT(c->saved, c->S.slot_row, int32_t);
  d.experts_local = c->E_local;
  d.T = c->T;
  d.k = c->k;
  d.H = c->H;
  d.rows_cap = (int)c->S.rows_cap;
  d.rank = c->rank;
  d.slots_cap = c->slots_cap;
  d.group = c->ranks > 1 ? 1 : 32;
  d.peers = table_of(c);
  d.src0 = src0, d.dst0 = dst0, d.src1 = src1, d.dst1 = dst1;
  d.filled = filled;
  /* The forward moves x alone and marks it; the backward moves x and dy, x unless marked. */
  d.xr_tag = xr_tag_of(c);
  d.saved_tag = d.xr_tag ? AT(c->saved, c->S.tag, uint64_t) : NULL;
  d.x_rows = src1 && d.xr_tag ? c->status + MOK_BSTATUS_X_ROWS : NULL;
  return d;
}

/* Each token's slot rows summed onto base (fp32 [T, H], or NULL) into out. */
static combine_args combine_of(const call *c, const float *base, void *out) {
  combine_args m;
  m.status = status_of(c);
  m.T = c->T;
  m.k = c->k;
  m.H = c->H;
  m.base = base;
  m.slots = AT(c->scratch, c->L->slots, __nv_bfloat16);
  m.out = (__nv_bfloat16 *)out;
  return m;
}

static mok_status check_forward_device(const mok_forward_args *a, int compute_y) {
  TRY(check_device(a->x, "x"));
  TRY(check_device(a->topk_ids, "topk_ids"));
  TRY(check_device(a->topk_weights, "topk_weights"));
  TRY(check_device(a->saved, "saved"));
  if (compute_y) TRY(check_device(a->y, "y"));
  return check_weights_device(&a->w);
}

static mok_status forward_on_device(mok_workspace *ws, const mok_forward_args *a, int compute_y,
                                    void *stream) {
  TRY(check_forward_device(a, compute_y));
  call c = call_of(ws, a->tokens, a->saved, stream);
  const int64_t E = c.E_local;
  __nv_bfloat16 *xr = AT(c.scratch, c.L->xr, __nv_bfloat16);
  TRY(publish(&c, c.L->sym_x, a->x, (size_t)c.T * c.H * 2));
  TRY(schedule(&c, a));
  /* The rest in one launch (layer_forward_launch): dispatch, gate/up, down, and combine where no
   * group barrier must come between down and combine. */
  layer_fwd set;
  layer_fwd *fs = &set;
  memset(fs, 0, sizeof *fs);
  __nv_bfloat16 *slots = AT(c.scratch, c.L->slots, __nv_bfloat16);
  float *ys = AT(c.scratch, c.L->rows_f32, float);
  fs->d = dispatch_of(&c, (const __nv_bfloat16 *)a->x, xr, NULL, NULL,
                      c.status + MOK_STATUS_FILLED);
  TRY(gateup_fwd(&c, 1, xr, a->w.w_gate, a->w.w_up, E, c.I, c.saved + c.S.gu, c.saved + c.S.hw,
                 &fs->p[0]));
  if (c.Is)
    TRY(gateup_fwd(&c, 0, a->x, a->w.ws_gate, a->w.ws_up, 1, c.Is, c.saved + c.S.gus,
                   c.saved + c.S.hs, &fs->p[1]));
  if (compute_y) {
    TRY(down_fwd(&c, 1, c.saved + c.S.hw, a->w.w_down, E, c.I, slots, &fs->p[2]));
    if (c.Is) TRY(down_fwd(&c, 0, c.saved + c.S.hs, a->w.ws_down, 1, c.Is, ys, &fs->p[3]));
  }
  fs->c = combine_of(&c, c.Is ? ys : NULL, a->y);
  fs->sync = AT(c.scratch, c.L->gsync, unsigned);
  fs->shared = c.Is > 0;
  fs->down = compute_y;
  fs->combine = compute_y && !c.ws->ctx->cfg.group;
  CUDA_TRY(layer_forward_launch(fs, c.ws->ctx->gemm_ctas[fs->p[0].cn - 1], c.stream),
           "layer forward");
  TRY(barrier(&c, EP_CLOSE));
  if (compute_y && !fs->combine) CUDA_TRY(combine_launch(&fs->c, c.stream), "combine");
  return MOK_OK;
}

static mok_status cuda_forward(mok_workspace *ws, const mok_forward_args *a, int compute_y,
                               void *stream) {
  device_guard g;
  TRY(device_enter(ws->ctx, &g));
  mok_status st = forward_on_device(ws, a, compute_y, stream);
  device_leave(ws->ctx, &g);
  return st;
}

static mok_status cuda_schedule(mok_workspace *ws, const mok_forward_args *a, void *stream) {
  device_guard g;
  TRY(device_enter(ws->ctx, &g));
  mok_status st = check_device(a->topk_ids, "topk_ids");
  if (st == MOK_OK) st = check_device(a->topk_weights, "topk_weights");
  if (st == MOK_OK) st = check_device(a->saved, "saved");
  if (st == MOK_OK) {
    call c = call_of(ws, a->tokens, a->saved, stream);
    st = schedule(&c, a);
  }
  device_leave(ws->ctx, &g);
  return st;
}

static mok_status check_backward_device(const mok_backward_args *a) {
  TRY(check_device(a->x, "x"));
  TRY(check_device(a->dy, "dy"));
  TRY(check_device(a->saved, "saved"));
  TRY(check_device(a->dx, "dx"));
  TRY(check_device(a->d_topk_weights, "d_topk_weights"));
  TRY(check_device(a->g.dw_gate, "g.dw_gate"));
  TRY(check_device(a->g.dw_up, "g.dw_up"));
  TRY(check_device(a->g.dw_down, "g.dw_down"));
  if (a->g.dws_gate) {
    TRY(check_device(a->g.dws_gate, "g.dws_gate"));
    TRY(check_device(a->g.dws_up, "g.dws_up"));
    TRY(check_device(a->g.dws_down, "g.dws_down"));
  }
  return check_weights_device(&a->w);
}

static mok_status backward_on_device(mok_workspace *ws, const mok_backward_args *a,
                                     void *stream) {
  TRY(check_backward_device(a));
  call c = call_of(ws, a->tokens, a->saved, stream);
  const int64_t E = c.E_local;
  const int acc = a->grad_mode == MOK_GRAD_ACCUMULATE_F32;
  /* The forward's error word, copied so the barrier may add to it without touching saved, and
   * checked against this call's tokens before anything else of saved is read. */
  c.status = AT(c.scratch, c.L->bstatus, int32_t);
  CUDA_TRY(saved_open_launch(AT(c.saved, c.S.status, int32_t), c.status, (int)c.T,
                             AT(c.saved, c.S.tag, uint64_t), xr_tag_of(&c), a->x, c.stream),
           "status");
  TRY(publish(&c, c.L->sym_x, a->x, (size_t)c.T * c.H * 2));
  TRY(publish(&c, c.L->sym_dy, a->dy, (size_t)c.T * c.H * 2));
  TRY(barrier(&c, EP_OPEN));
  __nv_bfloat16 *xr = AT(c.scratch, c.L->xr, __nv_bfloat16);
  __nv_bfloat16 *dyr = AT(c.scratch, c.L->dyr, __nv_bfloat16);
  __nv_bfloat16 *dgu = AT(c.scratch, c.L->dgu, __nv_bfloat16);
  __nv_bfloat16 *slots = AT(c.scratch, c.L->slots, __nv_bfloat16);
  float *part = AT(c.scratch, c.L->dtw_part, float);
  float *dxs = AT(c.scratch, c.L->rows_f32, float);
  __nv_bfloat16 *dgus = AT(c.scratch, c.L->dgus, __nv_bfloat16);

  const dispatch_args d = dispatch_of(&c, (const __nv_bfloat16 *)a->x, xr,
                                      (const __nv_bfloat16 *)a->dy, dyr, NULL);
  CUDA_TRY(dispatch_launch(&d, c.stream), "dispatch");
  /* Routed experts, each product after the last reader of the memory it writes (scratch_layout):
   * down's dgrad and weight gradient read the dy rows, then gate/up's dgrad may write slots over
   * them; gate/up's weight gradient is the last to read the x rows. */
  TRY(down_dgrad(&c, 1, dyr, a->w.w_down, E, c.I, c.saved + c.S.gu, dgu, 1));
  /* At ep = 1 (and top_k <= GEMM_COMBINE_K) the last weight gradient also combines dx: the
   * slot rows and the shared expert's rows are complete by then (kernels.h). At ep > 1 combine
   * comes after the close barrier, as peers write the slot rows; and where dx overlaps x, after
   * the shared expert's gate/up weight gradient, which reads x while it would write dx. */
  const combine_args m = combine_of(&c, c.Is ? dxs : NULL, a->dx);
  const size_t xh = (size_t)c.T * c.H * 2;
  const char *dx_at = (const char *)a->dx, *x_at = (const char *)a->x;
  const int dx_over_x = c.Is && dx_at < x_at + xh && x_at < dx_at + xh;
  const int fused = !c.ws->ctx->cfg.group && c.k <= GEMM_COMBINE_K && !dx_over_x;
  TRY(wgrad(&c, 1, dyr, c.H, c.saved + c.S.hw, c.I, c.H, a->g.dw_down, NULL, acc, NULL));
  TRY(gateup_dgrad(&c, 1, dgu, a->w.w_gate, a->w.w_up, E, c.I, slots));
  TRY(wgrad(&c, 1, dgu, 2 * c.I, xr, c.H, c.I, a->g.dw_gate, a->g.dw_up, acc,
            fused && !c.Is ? &m : NULL));
  /* Shared expert on all T rows, w = 1; its dx rows (fp32) go over the x rows. */
  if (c.Is) {
    TRY(down_dgrad(&c, 0, a->dy, a->w.ws_down, 1, c.Is, c.saved + c.S.gus, dgus, 0));
    TRY(gateup_dgrad(&c, 0, dgus, a->w.ws_gate, a->w.ws_up, 1, c.Is, dxs));
    TRY(wgrad(&c, 0, a->dy, c.H, c.saved + c.S.hs, c.Is, c.H, a->g.dws_down, NULL, acc, NULL));
    TRY(wgrad(&c, 0, dgus, 2 * c.Is, a->x, c.H, c.Is, a->g.dws_gate, a->g.dws_up, acc,
              fused ? &m : NULL));
  }
  TRY(barrier(&c, EP_CLOSE));
  if (!fused) CUDA_TRY(combine_launch(&m, c.stream), "combine");
  CUDA_TRY(router_grad_launch(status_of(&c), AT(c.scratch, c.L->sticky, int32_t), c.T * c.k,
                              c.I / 64, part, a->d_topk_weights, c.stream),
           "router gradient");
  return MOK_OK;
}

static mok_status cuda_backward(mok_workspace *ws, const mok_backward_args *a, void *stream) {
  device_guard g;
  TRY(device_enter(ws->ctx, &g));
  mok_status st = backward_on_device(ws, a, stream);
  device_leave(ws->ctx, &g);
  return st;
}

static mok_status cuda_check(mok_workspace *ws, void *stream, int32_t *bits) {
  cuda_ws *cw = (cuda_ws *)ws->backend;
  device_guard g;
  TRY(device_enter(ws->ctx, &g));
  int32_t *sticky = AT(cw->mem, cw->L.sticky, int32_t);
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
  if (e == cudaSuccess) e = cudaMemcpy(bits, sticky, sizeof *bits, cudaMemcpyDeviceToHost);
  if (e == cudaSuccess) e = cudaMemset(sticky, 0, sizeof *bits);
  device_leave(ws->ctx, &g);
  return e == cudaSuccess ? MOK_OK : cuda_fail(e, "mok_check");
}

static mok_status cuda_copy_to_host(mok_workspace *ws, void *dst, const void *src, size_t bytes,
                                    void *stream) {
  device_guard g;
  TRY(device_enter(ws->ctx, &g));
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
  if (e == cudaSuccess) e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
  device_leave(ws->ctx, &g);
  return e == cudaSuccess ? MOK_OK : cuda_fail(e, "copy to host");
}

/* A call api.c refused: this rank meets the group's opening barrier with MOK_DEVERR_PEER_ARG on
 * an error word of its own (the call's arguments may be unusable), so every rank skips the call. */
static mok_status cuda_refuse(mok_workspace *ws, void *stream) {
  device_guard g;
  TRY(device_enter(ws->ctx, &g));
  call c = call_of(ws, 1, NULL, stream);
  c.T = 0;
  c.status = AT(c.scratch, c.L->rstatus, int32_t);
  cudaError_t e = cudaMemsetAsync(c.status, 0, 4 * sizeof(int32_t), c.stream);
  mok_status st = e == cudaSuccess ? barrier_with(&c, EP_OPEN, MOK_DEVERR_PEER_ARG)
                                   : cuda_fail(e, "status");
  device_leave(ws->ctx, &g);
  return st;
}

static mok_status cuda_fp8_weights(mok_workspace *ws, const mok_weights *w,
                                   const mok_fp8_given *given, void *fp8, void *stream) {
  (void)ws, (void)w, (void)given, (void)fp8, (void)stream;
  return mok_fail(MOK_ERR_UNSUPPORTED, "the CUDA backend does not run MOK_FP8 yet");
}

/* (Positional: C++17 has no designated initializers; the order is mok_backend_ops'.) */
extern "C" const mok_backend_ops mok_cuda_ops = {
    "cuda",         cuda_context_init, cuda_workspace_init, cuda_workspace_fini, cuda_schedule,
    cuda_forward,   cuda_backward,     cuda_check,          cuda_copy_to_host,
    cuda_group_ready, cuda_refuse,     cuda_fp8_weights};
