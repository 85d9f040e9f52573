/*
 * layer.cu: the CUDA backend's forward, recompute and backward: the order of their launches
 * (backend.h), the EP group's barriers and publishes, and the backend's function table.
 */
#include <string.h>

#include "cuda/backend.h"

/* The group's barrier (no group: nothing); `add`: error bits of this rank. */
static mok_status barrier_with(const call *c, int when, int32_t add) {
  const mok_ep_group *grp = c->ws->ctx->cfg.group;
  if (!grp) return MOK_OK;
  CUDA_TRY(ep_barrier_launch(table_of(c), c->rank, c->ranks, when, c->ws->call, c->status,
                             AT(c->scratch, c->L->sticky, int32_t),
                             AT(c->scratch, c->L->epoch, unsigned),
                             AT(c->scratch, c->L->sym_tokens, int32_t), c->T, add,
                             (long long)grp->timeout_ms * 1000000LL, c->stream),
           "EP barrier");
  return MOK_OK;
}

mok_status barrier(const call *c, int when) { return barrier_with(c, when, 0); }

/* Copies `bytes` of this rank's input into its symmetric buffer at `off` (ep > 1). */
static mok_status publish(const call *c, size_t off, const void *src, size_t bytes) {
  if (c->ranks == 1) return MOK_OK;
  CUDA_TRY(cudaMemcpyAsync(c->scratch + off, src, bytes, cudaMemcpyDeviceToDevice, c->stream),
           "EP publish");
  return MOK_OK;
}

static mok_status check_weights_device(const mok_weights *w) {
  if (w->fp8) return check_device(w->fp8, "w.fp8"); /* MOK_FP8 (api.c has checked which) */
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

/* ---- the layer ------------------------------------------------------------------------------- */
/* Forward and schedule: zero the call's error word, publish ids and weights, open, build the
 * schedule over every rank's ids, check (capacity). */
static mok_status schedule(const call *c, const mok_forward_args *a) {
  CUDA_TRY(cudaMemsetAsync(c->status, 0, MOK_STATUS_WORDS * sizeof(int32_t), c->stream),
           "status");
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
  s.ident = mok_saved_ident(c->ws);
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
dispatch_args dispatch_of(const call *c, const __nv_bfloat16 *src0, __nv_bfloat16 *dst0,
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
combine_args combine_of(const call *c, const float *base, void *out) {
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
  TRY(publish(&c, c.L->sym_x, a->x, (size_t)c.T * c.H * 2));
  TRY(schedule(&c, a));
  if (ws->shape.precision == MOK_FP8) return forward8(&c, a, compute_y);
  __nv_bfloat16 *xr = AT(c.scratch, c.L->xr, __nv_bfloat16);
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
   * saved checked against this call (its header first) before anything else of it is read. */
  c.status = AT(c.scratch, c.L->bstatus, int32_t);
  CUDA_TRY(saved_open_launch(&c.S, c.saved, c.E_local, c.k, mok_saved_ident(ws), a->topk_ids,
                             a->topk_weights, c.status, xr_tag_of(&c), a->x,
                             c.ws->ctx->sm_count, c.stream),
           "status");
  TRY(publish(&c, c.L->sym_x, a->x, (size_t)c.T * c.H * 2));
  TRY(publish(&c, c.L->sym_dy, a->dy, (size_t)c.T * c.H * 2));
  TRY(barrier(&c, EP_OPEN));
  if (ws->shape.precision == MOK_FP8) return backward8(&c, a);
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

/* Every field named, in mok_backend_ops' order (C++ wants it, and -Wextra a new field here). */
extern "C" const mok_backend_ops mok_cuda_ops = {.name = "cuda",
                                                 .context_init = cuda_context_init,
                                                 .workspace_init = cuda_workspace_init,
                                                 .workspace_fini = cuda_workspace_fini,
                                                 .schedule = cuda_schedule,
                                                 .forward = cuda_forward,
                                                 .backward = cuda_backward,
                                                 .check = cuda_check,
                                                 .copy_to_host = cuda_copy_to_host,
                                                 .group_ready = cuda_group_ready,
                                                 .refuse = cuda_refuse,
                                                 .device_barriers = 1,
                                                 .fp8_weights = cuda_fp8_weights,
                                                 .mxfp8_to_bf16 = cuda_mxfp8_to_bf16};

