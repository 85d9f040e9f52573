/*
 * cpu.h: what the files of the CPU reference backend share: its workspace scratch, a view of the
 * per-call `saved` buffer (pointers carved from mok_saved_layout_of, never from offsets computed
 * here), and one function per step of the dataflow (DESIGN.md §2), in the order they run.
 *
 * Threads: every step runs in an OpenMP team of cpu_state.threads threads, and every output
 * element (and every saved value) is computed whole by one thread in an order fixed by the
 * source, so no bit depends on the thread count (D1, D2) or on the other tokens of the batch (D3).
 */
#ifndef MOK_CPU_H
#define MOK_CPU_H

#include <stdint.h>

#include "internal.h"

/* Scratch of one workspace, sized once for max_tokens by workspace_init (backend.c).
 * Letters: T = max_tokens, R = rows_cap of a max_tokens call, I_m = max(I, I_s).
 * MOK_FP8 (DESIGN §8): the forward's xr holds the tokens' Q_row (sym_q) instead of x, the shared
 * expert reads sym_q instead of xf, and the weight gradients replace xr, dyr, hwf, dguf, xf, dyf,
 * hsf and dgusf by their Q_col in place (wgrad.c); the panels hold the FP8 weights decoded. */
typedef struct cpu_state {
  int threads;        /* team size of every parallel region */
  int32_t sticky;     /* device-error bits raised since the last check (MOK_DEVERR_*) */
  /* Symmetric buffers: what the other ranks of an EP group read (the call's inputs, published at
   * its start) and write (slot rows and router gradients of this rank's tokens). */
  int64_t sym_tokens; /* T of the call in flight */
  uint16_t *sym_x;    /* [T, H] x (bf16), published */
  uint16_t *sym_dy;   /* [T, H] dy (bf16), published by backward */
  int32_t *sym_ids;   /* [T*k] topk_ids, published by forward */
  float *sym_w;       /* [T*k] topk_weights, published by forward */
  uint16_t *slot;     /* [T*k, H] bf16 per-slot rows, pushed by the expert's rank: o forward,
                       * dxr backward */
  float *sym_dtw;     /* [T*k] d_topk_weights, pushed by the expert's rank */
  float *sym_q;       /* MOK_FP8: [T, H] the call's input rows as their FP8 operand, Q_row along H
                       * (x forward, dy backward), quantized once per token, published */
  float *xf;          /* [T, H] x as fp32: the shared expert's input (shared.c) */
  float *dyf;         /* [T, H] dy as fp32, likewise */
  float *xr;          /* [R, H] routed rows of x as fp32 (dispatch; zeros on padding) */
  float *dyr;         /* [R, H] routed rows of dy as fp32 */
  float *dyq;         /* MOK_FP8: [R, H] routed rows of sym_q (the down dgrad's operand; dyr
                       * keeps dy's bf16 values for the weight gradient's Q_col) */
  float *side;        /* [T, H] shared expert's fp32 output: ys forward, dxs backward */
  float *hwf;         /* [R, I] hw of each routed row as fp32 (values of the saved bf16) */
  float *dguf;        /* [R, 2I] bf16-rounded [dgate | dup] of each routed row, as fp32 */
  float *hsf;         /* [T, I_s] hs as fp32 */
  float *dgusf;       /* [T, 2I_s] bf16-rounded [dgate | dup] of the shared expert, as fp32 */
  float *panel_gu;    /* [2 I_m, H] one expert's [W_gate; W_up] as fp32 */
  float *panel_down;  /* [H, I_m] one expert's W_down as fp32 */
  float *per_thread;  /* [threads, per_thread_len] row scratch of each thread */
  int64_t per_thread_len;
  int32_t *cursor;    /* [E_local] next free row of each expert while the schedule is built */
  void *block;        /* the one allocation all of the above are carved from */
} cpu_state;

/* The `saved` buffer of one call, as typed pointers. Backward reads it through the same view
 * (the const of mok_backward_args.saved is dropped here; backward never writes through it). */
typedef struct cpu_saved {
  void *base;             /* saved itself */
  int64_t rows_cap;
  int32_t *status;        /* [MOK_STATUS_WORDS]: the header, MOK_STATUS_* (internal.h) */
  int32_t *counts;        /* [E_local] */
  int32_t *offsets;       /* [E_local + 1] */
  int32_t *row_src;       /* [rows_cap] rank * max_tokens * k + slot t*k + j, -1 on padding */
  float *row_weight;      /* [rows_cap] */
  int32_t *slot_row;      /* [T * k] routed row of each own slot, -1: on another rank */
  int32_t *mblock_expert; /* [rows_cap / MOK_TILE_M] */
  uint16_t *gu;           /* [rows_cap, 2I] */
  uint16_t *hw;           /* [rows_cap, I] */
  uint16_t *gus;          /* [T, 2I_s] */
  uint16_t *hs;           /* [T, I_s] */
} cpu_saved;

static inline cpu_state *cpu_state_of(const mok_workspace *ws) { return (cpu_state *)ws->backend; }
/* The state of rank `rank` of ws's EP group (ws's own at ep = 1): its symmetric buffers. */
static inline cpu_state *cpu_peer(const mok_workspace *ws, int64_t rank) {
  const mok_ep_group *g = ws->ctx->cfg.group;
  return g ? cpu_state_of(g->ws[rank]) : cpu_state_of(ws);
}
/* mok_group_barrier of ws's group; a timeout is also kept in the sticky bits for mok_check. */
static inline mok_status cpu_barrier(mok_workspace *ws, int32_t *bits) {
  mok_status s = mok_group_barrier(ws->ctx->cfg.group, ws->call, bits);
  if (s == MOK_ERR_TIMEOUT) cpu_state_of(ws)->sticky |= MOK_DEVERR_TIMEOUT;
  return s;
}
/* A routed row's source: rank and slot t*k + j there (row_src = rank * max_tokens * k + slot). */
static inline int64_t cpu_src_rank(const mok_workspace *ws, int32_t src) {
  return src / (ws->shape.max_tokens * ws->shape.top_k);
}
static inline int64_t cpu_src_slot(const mok_workspace *ws, int32_t src) {
  return src % (ws->shape.max_tokens * ws->shape.top_k);
}
/* common.c */
cpu_saved cpu_saved_view(const mok_workspace *ws, const void *saved, int64_t tokens);

/* ---- layer.c: the ops entry points, each the steps below in order ------------------------- */
mok_status cpu_layer_schedule(mok_workspace *ws, const mok_forward_args *a, void *stream);
mok_status cpu_layer_forward(mok_workspace *ws, const mok_forward_args *a, int compute_y,
                             void *stream);
mok_status cpu_layer_backward(mok_workspace *ws, const mok_backward_args *a, void *stream);

/* ---- steps (one file each) ------------------------------------------------------------------ */
/* schedule.c: publishes the call's ids and weights, checks every rank's ids (the group's first
 * barrier), then writes status, counts, offsets, row_src, row_weight and mblock_expert over the
 * ids of every rank, and checks the capacity (second barrier). On a bad id anywhere, or a rank
 * over capacity, every rank sets status[0] and its sticky bits, returns the error and leaves the
 * rest of saved (and every output) as it was. */
mok_status cpu_schedule_build(mok_workspace *ws, const int32_t *topk_ids,
                              const float *topk_weights, int64_t tokens, const cpu_saved *sv);
/* dispatch.c: routed row r of xr (and of dyr when dy is set) gets its source token's row, read
 * from the source rank's published x (dy); padding rows get zeros. */
void cpu_dispatch(mok_workspace *ws, const cpu_saved *sv, int with_dy);

/* common.c: dst[i] = (float)src[i] over n values, by a team of its own. */
void cpu_bf16_to_f32(const mok_workspace *ws, float *dst, const uint16_t *src, int64_t n);

/* expert.c: routed forward. gu and hw of every routed row into saved (padding rows zeroed);
 * with compute_y, also o_r = bf16(W_down hw_r) into slot[t*k + j] of the row's source rank. */
void cpu_expert_forward(mok_workspace *ws, const mok_weights *w, const cpu_saved *sv,
                        int compute_y);
/* shared.c: shared expert forward (x into xf; gus, hs into saved; with compute_y, ys into side)
 * and backward (x, dy into xf, dyf; dxs into side, dgus into dgusf, hs into hsf). No-ops when
 * I_s = 0. */
void cpu_shared_forward(mok_workspace *ws, const mok_weights *w, const cpu_saved *sv,
                        const uint16_t *x, int64_t tokens, int compute_y);
void cpu_shared_backward(mok_workspace *ws, const mok_weights *w, const cpu_saved *sv,
                         const uint16_t *x, const uint16_t *dy, int64_t tokens);
/* backward.c: routed backward dgrad: dgu rows into dguf, hw rows into hwf; to the row's source
 * rank, d_topk_weights into sym_dtw[t*k + j] and dxr_r = bf16(W_gu^T dgu_r) into slot[t*k + j]. */
void cpu_expert_backward(mok_workspace *ws, const mok_weights *w, const cpu_saved *sv);
/* combine.c: out[t] = bf16(((side[t] or 0) + slot[t*k]) + ... + slot[t*k + k-1]). */
void cpu_combine(mok_workspace *ws, int64_t tokens, int with_side, uint16_t *out);
/* wgrad.c: the six weight gradients. */
void cpu_weight_grads(mok_workspace *ws, const cpu_saved *sv, int64_t tokens,
                      const mok_grads *g, mok_grad_mode mode);

/* mlp.c: one row of one expert (routed or shared; w = 1 for the shared expert).
 * Forward: gu[c] = bf16(x . Wgu[c]) for c < 2I, hw[i] = bf16(w silu(g_i) u_i), and when out is
 * not NULL out[h] = W_down[h] . hw (fp32), with fp8 on Q_row(hw). hwf gets hw as fp32 (with fp8
 * and out, Q_row(hw)). */
void cpu_mlp_forward_row(const float *x, const float *panel_gu, const float *panel_down,
                         int64_t H, int64_t I, float w, int fp8, uint16_t *gu, uint16_t *hw,
                         float *hwf, float *out);
/* Backward of one row from dy and the saved gu: returns <dh, silu(g) u> summed in 64-column
 * chunks (the router gradient), writes dgu (bf16-rounded, as fp32) and dx[h] = W_gu^T dgu (fp32).
 * dh is scratch of I floats (the down dgrad, never stored). With dgu_q (scratch of 2I floats,
 * MOK_FP8) dx is W_gu^T of Q_row(dgate), Q_row(dup) instead. */
float cpu_mlp_backward_row(const float *dy, const float *panel_gu, const float *panel_down,
                           int64_t H, int64_t I, float w, const uint16_t *gu, float *dh,
                           float *dgu, float *dgu_q, float *dx);
/* Expert e's weights of w (e < 0: the shared expert's) as fp32 panels: bf16 converted, or at
 * MOK_FP8 the FP8 buffer's codes decoded with their block scales. By the whole team (call from
 * inside a parallel region; ends with a barrier). */
void cpu_load_panels(const mok_workspace *ws, const mok_weights *w, int64_t e);

/* common.c: this thread's row scratch (per_thread_len floats). Call inside a parallel region. */
float *cpu_thread_scratch(const mok_workspace *ws);

/* ---- quant.c: the FP8 recipe (DESIGN §8) ----------------------------------------------------- */
/* The backend op fp8_weights: fp8 <- Q_blk of the bf16 weights w, or the codes and scales given
 * (refused, fp8 untouched, if a scale is not finite and positive), with the transposed codes. */
mok_status cpu_fp8_weights(mok_workspace *ws, const mok_weights *w, const mok_fp8_given *given,
                           void *fp8, void *stream);
/* dst[i] = decode(q[i]) * s[i / 128]: a row of a weight tensor's codes and its blocks' scales. */
void cpu_fp8_decode_row(float *dst, const uint8_t *q, const float *s, int64_t n);
/* Q_row in place: each group of 128 consecutive values from v[0] (the last may be shorter)
 * replaced by what its e4m3 codes stand for. */
void cpu_q_row(float *v, int64_t n);
/* dst[r] = Q_row of the bf16 row src[r], for `rows` rows of n values, by a team of its own. */
void cpu_q_rows_bf16(const mok_workspace *ws, float *dst, const uint16_t *src, int64_t rows,
                     int64_t n);
/* Q_col in place of one column: `rows` values `stride` apart, in groups of 128 rows from the
 * first. */
void cpu_q_col(float *v, int64_t rows, int64_t stride);

/* ---- mxfp8.c: MXFP8 inputs (DESIGN §8.5) ----------------------------------------------------- */
/* The backend op mxfp8_to_bf16: every block checked first (mok_mx_block_ok), then decoded; a
 * refused call writes nothing. */
mok_status cpu_mxfp8_to_bf16(mok_workspace *ws, int64_t rows, int64_t k, const void *q,
                             const void *scales, void *out, void *stream);

#endif /* MOK_CPU_H */
