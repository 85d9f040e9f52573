/*
 * layer_fp8.cu: the CUDA backend's FP8 layer (DESIGN §8): the weights' FP8 buffer
 * (mok_quantize_weights, mok_fp8_weights_import), the arguments of the five FP8 products, and the
 * order of forward and backward after the schedule (and the backward's opening barrier). There
 * is no dispatch: quant.cu reads each routed row of x and dy from its token (from a peer's
 * published rows at ep > 1) as it quantizes it, so the routed rows never exist in bf16. Combine
 * and the router gradient are the BF16 layer's. Each step is a kernel of its own (the BF16
 * forward's single launch has no FP8 form yet).
 *   forward:  Q_row(x rows) -> gate/up (SwiGLU, Q_row(hw)) -> [shared: Q_row(x), gate/up]
 *             -> down -> [shared down] -> combine
 *   backward: Q_row, Q_col(dy rows) -> down dgrad (SwiGLU bwd, router partials)
 *             -> Q_row, Q_col(dgu) -> Q_col(hw) -> down weight grad -> Q_col(x rows)
 *             -> gate/up dgrad -> gate/up weight grad -> [shared expert, likewise] -> combine,
 *             router gradient
 */
#include <string.h>

#include "cuda/backend.h"

/* ---- the weights' FP8 buffer ----------------------------------------------------------------- */
typedef struct w8 {
  const uint8_t *q, *qt;
  const float *s;
  int64_t E, N, K, ng, kg;
} w8;

/* Each weight tensor's view of the buffer fp8, in MOK_W_* order. */
static void w8_all(const call *c, const void *fp8, w8 w[MOK_W_COUNT]) {
  const mok_fp8_layout L = mok_fp8_layout_of(c->ws);
  const char *b = (const char *)fp8;
  for (int i = 0; i < MOK_W_COUNT; i++) {
    const mok_fp8_matrix_layout *m = &L.m[i];
    const w8 v = {(const uint8_t *)(b + m->q), (const uint8_t *)(b + m->qt),
                  (const float *)(b + m->s),   m->experts, m->n, m->k, (m->n + 127) / 128,
                  (m->k + 127) / 128};
    w[i] = v;
  }
}

mok_status cuda_fp8_weights(mok_workspace *ws, const mok_weights *w, const mok_fp8_given *given,
                            void *fp8, void *stream) {
  device_guard guard;
  TRY(device_enter(ws->ctx, &guard));
  const mok_fp8_layout L = mok_fp8_layout_of(ws);
  const void *bf16[MOK_W_COUNT] = {0};
  const mok_fp8_matrix *in[MOK_W_COUNT] = {0};
  if (w) {
    const void *t[MOK_W_COUNT] = {w->w_gate, w->w_up, w->w_down, w->ws_gate, w->ws_up, w->ws_down};
    memcpy(bf16, t, sizeof t);
  } else {
    const mok_fp8_matrix *t[MOK_W_COUNT] = {&given->w_gate,  &given->w_up,  &given->w_down,
                                            &given->ws_gate, &given->ws_up, &given->ws_down};
    memcpy(in, t, sizeof t);
  }
  static const char *names[MOK_W_COUNT] = {"w_gate", "w_up", "w_down", "ws_gate", "ws_up",
                                           "ws_down"};
  /* Every pointer is checked before anything is queued: a refused call leaves fp8 as it was. */
  mok_status st = check_device(fp8, "fp8");
  for (int i = 0; i < MOK_W_COUNT && st == MOK_OK; i++) {
    if (!L.m[i].experts) continue;
    if (w) st = check_device(bf16[i], names[i]);
    if (!w && st == MOK_OK) st = check_device(in[i]->q, names[i]);
    if (!w && st == MOK_OK) st = check_device(in[i]->s, names[i]);
  }
  cudaStream_t s = (cudaStream_t)stream;
  for (int i = 0; i < MOK_W_COUNT && st == MOK_OK; i++) {
    const mok_fp8_matrix_layout *m = &L.m[i];
    if (!m->experts) continue;
    uint8_t *q = (uint8_t *)fp8 + m->q, *qt = (uint8_t *)fp8 + m->qt;
    float *sc = (float *)((char *)fp8 + m->s);
    const size_t codes = (size_t)(m->experts * m->n * m->k);
    const size_t scales = (size_t)(m->experts * ((m->n + 127) / 128) * ((m->k + 127) / 128));
    cudaError_t e;
    if (w) {
      e = quant_weights_launch((const __nv_bfloat16 *)bf16[i], m->experts, m->n, m->k, q, qt, sc,
                               s);
    } else {
      e = cudaMemcpyAsync(q, in[i]->q, codes, cudaMemcpyDeviceToDevice, s);
      if (e == cudaSuccess)
        e = cudaMemcpyAsync(sc, in[i]->s, scales * 4, cudaMemcpyDeviceToDevice, s);
      if (e == cudaSuccess) e = transpose_u8_launch(q, m->experts, m->n, m->k, qt, s);
    }
    if (e != cudaSuccess) st = cuda_fail(e, "FP8 weights");
  }
  device_leave(ws->ctx, &guard);
  return st;
}

/* ---- arguments ------------------------------------------------------------------------------- */
static mok_status map8(CUtensorMap *m, const void *p, int64_t rows, int64_t cols, int64_t ld) {
  const int r = tma_map_2d_u8(m, p, rows, cols, ld, 128);
  if (r) return mok_fail(MOK_ERR_CUDA, "cuTensorMapEncodeTiled (e4m3 %lld x %lld) failed: %d",
                         (long long)rows, (long long)cols, r);
  return MOK_OK;
}

static mok_status map8_w(CUtensorMap *m, const uint8_t *p, int64_t E, int64_t rows,
                         int64_t cols) {
  const int r = tma_map_3d_u8(m, p, E, rows, cols, 128);
  if (r) return mok_fail(MOK_ERR_CUDA, "cuTensorMapEncodeTiled (e4m3 %lld x %lld x %lld): %d",
                         (long long)E, (long long)rows, (long long)cols, r);
  return MOK_OK;
}

static mok_status map_scales(CUtensorMap *m, const float *p, int64_t groups, int64_t ld,
                             int box) {
  const int r = tma_map_scales(m, p, groups, ld, box);
  if (r) return mok_fail(MOK_ERR_CUDA, "cuTensorMapEncodeTiled (scales %lld x %lld): %d",
                         (long long)groups, (long long)ld, r);
  return MOK_OK;
}

static uint8_t *Q(const call *c, fp8_operand o) { return AT(c->scratch, o.q, uint8_t); }
static float *S(const call *c, fp8_operand o) { return AT(c->scratch, o.s, float); }
static int64_t up128(int64_t v) { return (v + 127) / 128 * 128; }

static mok_status run8(const call *c, gemm8_kind kind, const gemm8_args *a, const char *what) {
  const cudaError_t e = gemm8_launch(kind, a, c->ws->ctx->gemm8_ctas, c->stream);
  return e == cudaSuccess ? MOK_OK : cuda_fail(e, what);
}

/* Tile space and the A operand of a row-grouped product: routed rows, or the shared expert's T
 * rows; A's codes [rows, K] (row length ld) and scales [K / 128][F->R]. */
static mok_status rows8(const call *c, int routed, const fp8_rows *F, fp8_operand A, int64_t K,
                        int64_t ld, gemm8_args *a) {
  gemm_args *g = &a->g;
  if (routed) {
    g->peer_out = table_of(c)->slots;
    g->slots_cap = c->slots_cap;
    g->offsets = AT(c->saved, c->S.offsets, int32_t);
    g->mblock_expert = AT(c->saved, c->S.mblock_expert, int32_t);
    g->experts = c->E_local;
    g->m_tiles_max = (int)(c->S.rows_cap / GEMM_BM);
    g->rows_valid = (int)c->S.rows_cap;
  } else {
    g->experts = 1;
    g->m_tiles_max = (c->T + GEMM_BM - 1) / GEMM_BM;
    g->rows_valid = c->T;
  }
  g->status = c->status;
  g->cn = 1;
  g->k = (int)up128(K);
  TRY(map8(&g->a, Q(c, A), routed ? c->S.rows_cap : c->T, K, ld));
  return map_scales(&a->sa, S(c, A), up128(K) / 128, F->R, 128);
}

/* B's block scales (gemm8_args): N-block stride sn, k-block stride sk. */
static void wscales(gemm8_args *a, const w8 *w0, const w8 *w1, int transposed) {
  a->w0 = w0->s;
  a->w1 = w1 ? w1->s : NULL;
  a->se = (int)(w0->ng * w0->kg);
  a->sn = transposed ? 1 : (int)w0->kg;
  a->sk = transposed ? (int)w0->kg : 1;
  a->ng = (int)(transposed ? w0->kg : w0->ng);
  a->ksplit = 1 << 30;
}

/* gu, hw and hw's codes <- x codes x [gate | up]^T. */
static mok_status gateup8(const call *c, int routed, const fp8_rows *F, const w8 *wg,
                          const w8 *wu, void *gu, void *hw) {
  gemm8_args a;
  memset(&a, 0, sizeof a);
  TRY(rows8(c, routed, F, F->x, c->H, c->H, &a));
  TRY(map8_w(&a.g.b0, wg->q, wg->E, wg->N, wg->K));
  TRY(map8_w(&a.g.b1, wu->q, wu->E, wu->N, wu->K));
  wscales(&a, wg, wu, 0);
  a.g.n = (int)wg->N;
  a.g.row_weight = routed ? AT(c->saved, c->S.row_weight, float) : NULL;
  a.g.out0 = gu;
  a.g.out1 = hw;
  a.q_out = Q(c, F->h);
  a.s_out = S(c, F->h);
  a.ld_s = (int)F->R;
  return run8(c, GEMM8_FWD_GATEUP, &a, "FP8 gate/up");
}

/* out <- hw codes x W_down^T: bf16 slot rows (routed) or fp32 rows (shared). */
static mok_status down8(const call *c, int routed, const fp8_rows *F, const w8 *wd, void *out) {
  gemm8_args a;
  memset(&a, 0, sizeof a);
  TRY(rows8(c, routed, F, F->h, wd->K, wd->K, &a));
  TRY(map8_w(&a.g.b0, wd->q, wd->E, wd->N, wd->K));
  wscales(&a, wd, NULL, 0);
  a.g.n = c->H;
  a.g.row_src = routed ? AT(c->saved, c->S.row_src, int32_t) : NULL;
  a.g.out0 = out;
  a.g.ld_out = c->H;
  return run8(c, GEMM8_FWD_DOWN, &a, "FP8 down");
}

/* dgu, router partials <- dy codes x W_down (its transposed codes [E, I, H]). */
static mok_status down_dgrad8(const call *c, int routed, const fp8_rows *F, const w8 *wd,
                              const void *gu, void *dgu, int part) {
  gemm8_args a;
  memset(&a, 0, sizeof a);
  TRY(rows8(c, routed, F, F->x, c->H, c->H, &a));
  TRY(map8_w(&a.g.b0, wd->qt, wd->E, wd->K, wd->N));
  wscales(&a, wd, NULL, 1);
  a.g.n = (int)wd->K;
  a.g.row_weight = routed ? AT(c->saved, c->S.row_weight, float) : NULL;
  a.g.row_src = routed ? AT(c->saved, c->S.row_src, int32_t) : NULL;
  a.g.gu_in = (const __nv_bfloat16 *)gu;
  a.g.out0 = dgu;
  a.g.peer_aux = part ? table_of(c)->dtw : NULL;
  return run8(c, GEMM8_DGRAD_DOWN, &a, "FP8 down dgrad");
}

/* out <- dgu codes [rows, 2 I'] x [W_gate; W_up] (their transposed codes [E, H, I]). */
static mok_status gateup_dgrad8(const call *c, int routed, const fp8_rows *F, const w8 *wg,
                                const w8 *wu, void *out) {
  gemm8_args a;
  memset(&a, 0, sizeof a);
  const int64_t Ip = up128(wg->N);
  TRY(rows8(c, routed, F, F->h, 2 * Ip, 2 * Ip, &a));
  TRY(map8_w(&a.g.b0, wg->qt, wg->E, wg->K, wg->N));
  TRY(map8_w(&a.g.b1, wu->qt, wu->E, wu->K, wu->N));
  wscales(&a, wg, wu, 1);
  a.ksplit = (int)(Ip / 128);
  a.g.n = c->H;
  a.g.row_src = routed ? AT(c->saved, c->S.row_src, int32_t) : NULL;
  a.g.out0 = out;
  a.g.ld_out = c->H;
  return run8(c, GEMM8_DGRAD_GATEUP, &a, "FP8 gate/up dgrad");
}

/* Per expert: out[m, n] = sum over its rows r of A[r, m] B[r, n], from the column codes A [M, R]
 * and B [N, R]; rows m < split go to out0, the rest to out1. */
static mok_status wgrad8(const call *c, int routed, const fp8_rows *F, fp8_operand A, int64_t M,
                         fp8_operand B, int64_t N, int64_t split, void *out0, void *out1,
                         int accumulate) {
  gemm8_args a;
  memset(&a, 0, sizeof a);
  gemm_args *g = &a.g;
  TRY(map8(&g->a, Q(c, A), M, F->R, F->R));
  TRY(map8(&g->b0, Q(c, B), N, F->R, F->R));
  TRY(map_scales(&a.sa, S(c, A), F->R / 128, M, 128));
  TRY(map_scales(&a.sb, S(c, B), F->R / 128, N, 256));
  g->offsets = routed ? AT(c->saved, c->S.offsets, int32_t) : NULL;
  g->counts = routed ? AT(c->saved, c->S.counts, int32_t) : NULL;
  g->experts = routed ? c->E_local : 1;
  g->status = c->status;
  g->cn = 1;
  g->m_tiles_max = (int)((M + GEMM_BM - 1) / GEMM_BM);
  g->m = (int)M;
  g->n = (int)N;
  g->k = routed ? 0 : c->T;
  g->k_split = (int)split;
  g->out0 = out0;
  g->out1 = out1;
  g->ld_out = (int)N;
  g->accumulate = accumulate;
  return run8(c, GEMM8_WGRAD, &a, "FP8 weight gradient");
}

/* The quantization launch of quant8 and quant8_gather. */
static mok_status quant8_as(const call *c, int routed, const fp8_rows *F, const void *src,
                            const void *own, int dy, int32_t *filled, int64_t cols, int64_t ld,
                            const fp8_operand *row, int64_t ld_q, int64_t row_at,
                            const fp8_operand *col, int64_t ld_st, int64_t col_at) {
  quant_args q;
  memset(&q, 0, sizeof q);
  q.status = c->status;
  q.filled = filled;
  q.src = (const __nv_bfloat16 *)src;
  if (!src) { /* the routed rows of x (dy), gathered from their tokens */
    q.row_src = AT(c->saved, c->S.row_src, int32_t);
    q.own = (const __nv_bfloat16 *)own;
    q.peers = table_of(c);
    q.dy = dy;
    q.slots_cap = c->slots_cap;
    q.k = c->k;
    q.rank = c->rank;
  }
  q.rows = routed ? (int)c->S.rows_cap : c->T;
  q.cols = (int)cols;
  q.ld_src = (int)ld;
  q.live = routed ? AT(c->saved, c->S.offsets, int32_t) + c->E_local : NULL;
  if (row) {
    q.q = Q(c, *row) + row_at;
    q.s = S(c, *row) + row_at / 128 * F->R;
    q.ld_q = (int)ld_q;
    q.ld_s = (int)F->R;
  }
  if (col) {
    q.qt = Q(c, *col) + col_at * F->R;
    q.st = S(c, *col) + col_at;
    q.ld_qt = (int)F->R;
    q.ld_st = (int)ld_st;
  }
  CUDA_TRY(quant_launch(&q, c->stream), "FP8 quantization");
  return MOK_OK;
}

/* Q_row (into row, when given) and Q_col (into col) of bf16 src [rows, cols] (row length ld):
 * the routed rows (up to the schedule's offsets[E_local]) or the shared expert's T. The row
 * codes go `row_at` columns into F's row operand `row` of row length ld_q, their scales
 * row_at / 128 groups in; the column codes `col_at` rows into `col`, their scales `col_at`
 * columns in (of ld_st). */
static mok_status quant8(const call *c, int routed, const fp8_rows *F, const void *src,
                         int64_t cols, int64_t ld, const fp8_operand *row, int64_t ld_q,
                         int64_t row_at, const fp8_operand *col, int64_t ld_st, int64_t col_at) {
  return quant8_as(c, routed, F, src, NULL, 0, NULL, cols, ld, row, ld_q, row_at, col, ld_st,
                   col_at);
}

/* The same of the routed rows of this call's x (dy when `dy`), gathered from their tokens: this
 * rank's from `own`, the others' from their published rows (quant_args); `filled` as there. */
static mok_status quant8_gather(const call *c, const fp8_rows *F, const void *own, int dy,
                                int32_t *filled, const fp8_operand *row, const fp8_operand *col) {
  return quant8_as(c, 1, F, NULL, own, dy, filled, c->H, c->H, row, c->H, 0, col, c->H, 0);
}

/* ---- forward and backward -------------------------------------------------------------------- */
mok_status forward8(const call *c, const mok_forward_args *a, int compute_y) {
  const fp8_rows *F = &c->L->f8.routed, *Fs = &c->L->f8.shared;
  w8 w[MOK_W_COUNT];
  w8_all(c, a->w.fp8, w);
  void *slots = AT(c->scratch, c->L->slots, void);
  float *ys = AT(c->scratch, c->L->rows_f32, float);
  TRY(quant8_gather(c, F, a->x, 0, c->status + MOK_STATUS_FILLED, &F->x, NULL));
  TRY(gateup8(c, 1, F, &w[MOK_W_GATE], &w[MOK_W_UP], c->saved + c->S.gu, c->saved + c->S.hw));
  if (c->Is) {
    TRY(quant8(c, 0, Fs, a->x, c->H, c->H, &Fs->x, c->H, 0, NULL, 0, 0));
    TRY(gateup8(c, 0, Fs, &w[MOK_WS_GATE], &w[MOK_WS_UP], c->saved + c->S.gus,
                c->saved + c->S.hs));
  }
  if (compute_y) {
    TRY(down8(c, 1, F, &w[MOK_W_DOWN], slots));
    if (c->Is) TRY(down8(c, 0, Fs, &w[MOK_WS_DOWN], ys));
  }
  TRY(barrier(c, EP_CLOSE));
  if (compute_y) {
    const combine_args m = combine_of(c, c->Is ? ys : NULL, a->y);
    CUDA_TRY(combine_launch(&m, c->stream), "combine");
  }
  return MOK_OK;
}

/* One expert kind's backward from the call's dy and x (routed: their rows gathered by token) and
 * saved activations (gu, hw): dgrads, then weight gradients. dgu: its bf16 scratch; out: the dx
 * rows (slots or fp32). */
static mok_status expert_backward8(const call *c, int routed, const fp8_rows *F, const w8 *wg,
                                   const w8 *wu, const w8 *wd, const void *dy, const void *x,
                                   const void *gu, const void *hw, void *dgu, void *out,
                                   const mok_grads *gr, int acc) {
  const int64_t H = c->H, I = wg->N, Ip = up128(I);
  void *dw_gate = routed ? gr->dw_gate : gr->dws_gate, *dw_up = routed ? gr->dw_up : gr->dws_up;
  void *dw_down = routed ? gr->dw_down : gr->dws_down;
  if (routed) TRY(quant8_gather(c, F, dy, 1, NULL, &F->x, &F->dyT));
  else TRY(quant8(c, 0, F, dy, H, H, &F->x, H, 0, &F->dyT, H, 0));
  TRY(down_dgrad8(c, routed, F, wd, gu, dgu, routed));
  for (int half = 0; half < 2; half++) /* dĝ and dû, each its own groups */
    TRY(quant8(c, routed, F, (const __nv_bfloat16 *)dgu + half * I, I, 2 * I, &F->h, 2 * Ip,
               half * Ip, &F->dgT, 2 * I, half * I));
  TRY(quant8(c, routed, F, hw, I, I, NULL, 0, 0, &F->hT, I, 0));
  TRY(wgrad8(c, routed, F, F->dyT, H, F->hT, I, H, dw_down, NULL, acc));
  if (routed) TRY(quant8_gather(c, F, x, 0, NULL, NULL, &F->xT));
  else TRY(quant8(c, 0, F, x, H, H, NULL, 0, 0, &F->xT, H, 0));
  TRY(gateup_dgrad8(c, routed, F, wg, wu, out));
  return wgrad8(c, routed, F, F->dgT, 2 * I, F->xT, H, I, dw_gate, dw_up, acc);
}

mok_status backward8(const call *c, const mok_backward_args *a) {
  const fp8_rows *F = &c->L->f8.routed, *Fs = &c->L->f8.shared;
  w8 w[MOK_W_COUNT];
  w8_all(c, a->w.fp8, w);
  const int acc = a->grad_mode == MOK_GRAD_ACCUMULATE_F32;
  float *dxs = AT(c->scratch, c->L->rows_f32, float);
  TRY(expert_backward8(c, 1, F, &w[MOK_W_GATE], &w[MOK_W_UP], &w[MOK_W_DOWN], a->dy, a->x,
                       c->saved + c->S.gu, c->saved + c->S.hw, AT(c->scratch, c->L->dgu, void),
                       AT(c->scratch, c->L->slots, void), &a->g, acc));
  if (c->Is)
    TRY(expert_backward8(c, 0, Fs, &w[MOK_WS_GATE], &w[MOK_WS_UP], &w[MOK_WS_DOWN], a->dy, a->x,
                         c->saved + c->S.gus, c->saved + c->S.hs,
                         AT(c->scratch, c->L->dgus, void), dxs, &a->g, acc));
  TRY(barrier(c, EP_CLOSE));
  const combine_args m = combine_of(c, c->Is ? dxs : NULL, a->dx);
  CUDA_TRY(combine_launch(&m, c->stream), "combine");
  CUDA_TRY(router_grad_launch(status_of(c), AT(c->scratch, c->L->sticky, int32_t), c->T * c->k,
                              c->I / 64, AT(c->scratch, c->L->dtw_part, float),
                              a->d_topk_weights, c->stream),
           "router gradient");
  return MOK_OK;
}
