/*
 * backend.h: what the host files of the CUDA backend share: the workspace's scratch layout, the
 * per-call view of a call's buffers, the device guard, the product argument builders, and the
 * order of the calls (DESIGN §2):
 *   forward:  schedule -> dispatch x -> gate/up (+SwiGLU) -> [shared gate/up] -> down
 *             -> [shared down] -> combine
 *   backward: check saved -> dispatch x, dy -> down dgrad (+SwiGLU bwd, router partials)
 *             -> down weight grad -> gate/up dgrad -> gate/up weight grad -> [shared expert:
 *             down dgrad, gate/up dgrad, the two weight grads] -> combine, router gradient
 * Files: context.cu (device, context, check), workspace.cu (scratch memory, the EP table, NCCL
 * windows), products.cu (the arguments of each GEMM product), layer.cu (forward, recompute,
 * backward: the order of the launches, the group's barriers; the ops table), mxfp8.cu (MXFP8
 * rows to bf16).
 * The workspace lets buffers whose uses do not overlap in this order share memory
 * (scratch_layout): products run side by side (a side stream, a fused launch) would need them
 * apart again.
 * With an EP group (DESIGN §2.3) each direction also publishes this rank's inputs into its
 * symmetric buffers and meets the group at device barriers (ep.cu): open (inputs published),
 * check (after the schedule: ids, capacity), close (every push into this rank's slots done);
 * routed outputs and router partials are pushed into the slots of the token's own rank.
 * Nothing here synchronises or allocates after workspace creation.
 */
#ifndef MOK_CUDA_BACKEND_H
#define MOK_CUDA_BACKEND_H

#include <cuda_runtime.h>

#include "cuda/kernels.h"
#include "internal.h"

/* ---- errors and the device (context.cu) ------------------------------------------------------ */
mok_status cuda_fail(cudaError_t e, const char *what);

#define CUDA_TRY(expr, what)                           \
  do {                                                 \
    cudaError_t e_ = (expr);                           \
    if (e_ != cudaSuccess) return cuda_fail(e_, what); \
  } while (0)

#define AT(base, off, type) ((type *)((base) + (off)))

/* Makes the context's device current for the length of a call and restores the caller's. */
typedef struct device_guard {
  int prev, ok;
} device_guard;
mok_status device_enter(const mok_context *ctx, device_guard *g);
void device_leave(const mok_context *ctx, device_guard *g);

/* Host-checkable: every pointer the kernels touch must be device memory. */
mok_status check_device(const void *p, const char *name);

/* ---- workspace scratch ----------------------------------------------------------------------- */
/* The FP8 operands of one expert kind (routed: R = rows_cap rows; the shared expert: the call's
 * tokens, R = max_tokens rounded up to 128), DESIGN §8.2. An operand is codes `q` and scales
 * `s`: row codes [R, K] with scales [K / 128][R] (Q_row), or column codes [C, R] with scales
 * [R / 128][C] (Q_col). H' = H rounded up to 128, likewise I'. */
typedef struct fp8_operand {
  size_t q, s;
} fp8_operand;
typedef struct fp8_rows {
  fp8_operand x;   /* Q_row of x rows [R, H]; the backward's dy rows reuse it */
  fp8_operand h;   /* Q_row of hw rows [R, I]; the backward's dgu rows reuse it: [R, 2 I'], the
                    * gate half in columns 0.., the up half from I' (each its own groups; zero
                    * codes between), scales [2 I' / 128][R] */
  fp8_operand dyT; /* Q_col of dy rows: [H, R], [R / 128][H] */
  fp8_operand xT;  /* Q_col of x rows: [H, R] */
  fp8_operand hT;  /* Q_col of hw rows: [I, R] */
  fp8_operand dgT; /* Q_col of dgu rows: [2I, R] */
  int64_t R;       /* rows (the leading dimension of every scale of a row and of a column) */
} fp8_rows;
typedef struct fp8_scratch {
  fp8_rows routed, shared; /* shared: none when I_s = 0 */
} fp8_scratch;

typedef struct scratch_layout {
  size_t sticky;        /* int32: error bits until mok_check */
  size_t bstatus;       /* int32 [MOK_BSTATUS_WORDS]: backward's status, the forward's as checked
                         * by saved_open (the group's barrier adds to it without touching saved) */
  size_t rstatus;       /* int32 [4]: the error word of a call refused on the host */
  size_t mx;            /* int32: the verdict of the mok_mxfp8_to_bf16 call in flight (mxfp8.cu) */
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
  size_t xr;            /* bf16 [rows_cap, H] routed x rows; then f32 [T, H] rows_f32 (FP8:
                         * rows_f32 alone, it has no bf16 rows) */
  size_t dyr;           /* bf16 [rows_cap, H] routed dy rows (bwd); at ep = 1 also slots (FP8:
                         * slots alone) */
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
  fp8_scratch f8;       /* MOK_FP8 only (sizes 0 otherwise) */
  size_t bytes;
} scratch_layout;

typedef struct cuda_ws {
  char *mem;
  void *win;        /* NCCL group: mem as a symmetric window (ncclWindow_t) */
  scratch_layout L;
  int64_t rows_cap; /* of max_tokens */
} cuda_ws;

/* workspace.cu */
mok_status cuda_workspace_init(mok_workspace *ws);
void cuda_workspace_fini(mok_workspace *ws);
mok_status cuda_group_ready(mok_workspace *ws);
/* context.cu */
mok_status cuda_context_init(mok_context *ctx);
mok_status cuda_check(mok_workspace *ws, void *stream, int32_t *bits);
mok_status cuda_copy_to_host(mok_workspace *ws, void *dst, const void *src, size_t bytes,
                             void *stream);

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

static inline call call_of(mok_workspace *ws, int64_t tokens, const void *saved, void *stream) {
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

static inline const int32_t *status_of(const call *c) { return c->status; }
static inline const ep_table *table_of(const call *c) {
  return AT(c->scratch, c->L->table, ep_table);
}
/* Whose routed x rows xr holds (rows.cu), where they outlive the forward: ep = 1 (a group's rows
 * come from other ranks' inputs) without a shared expert (its fp32 rows go over them), BF16;
 * else NULL. */
static inline uint64_t *xr_tag_of(const call *c) {
  const int fp8 = c->ws->shape.precision == MOK_FP8; /* its routed rows are never in bf16 */
  return c->ranks == 1 && !c->Is && !fp8 ? AT(c->scratch, c->L->xr_tag, uint64_t) : NULL;
}

/* ---- the products (products.cu): each fills a gemm_args, and the backward's also launch it -- */
mok_status gateup_fwd(const call *c, int routed, const void *a, const void *w_gate,
                      const void *w_up, int64_t experts, int64_t I, void *gu, void *hw,
                      gemm_args *out);
mok_status down_fwd(const call *c, int routed, const void *a, const void *w_down,
                    int64_t experts, int64_t I, void *out, gemm_args *args);
mok_status down_dgrad(const call *c, int routed, const void *a, const void *w_down,
                      int64_t experts, int64_t I, const void *gu, void *dgu, int part);
mok_status gateup_dgrad(const call *c, int routed, const void *dgu, const void *w_gate,
                        const void *w_up, int64_t experts, int64_t I, void *out);
mok_status wgrad(const call *c, int routed, const void *a, int64_t M, const void *b, int64_t N,
                 int64_t split, void *out0, void *out1, int accumulate, const combine_args *comb);

/* ---- the layer (layer.cu), and its FP8 form (layer_fp8.cu) --------------------------------- */
mok_status barrier(const call *c, int when);
dispatch_args dispatch_of(const call *c, const __nv_bfloat16 *src0, __nv_bfloat16 *dst0,
                          const __nv_bfloat16 *src1, __nv_bfloat16 *dst1, int32_t *filled);
combine_args combine_of(const call *c, const float *base, void *out);
/* After the schedule: the rest of an FP8 forward. After the backward's opening barrier: the
 * rest of an FP8 backward. */
mok_status forward8(const call *c, const mok_forward_args *a, int compute_y);
mok_status backward8(const call *c, const mok_backward_args *a);
mok_status cuda_fp8_weights(mok_workspace *ws, const mok_weights *w, const mok_fp8_given *given,
                            void *fp8, void *stream);
/* mxfp8.cu */
mok_status cuda_mxfp8_to_bf16(mok_workspace *ws, int64_t rows, int64_t k, const void *q,
                              const void *scales, void *out, void *stream);

#endif /* MOK_CUDA_BACKEND_H */
