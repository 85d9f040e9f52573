/*
 * products.cu: the arguments of the layer's GEMM products (gemm_args: tensor maps, tile space,
 * epilogue pointers), one builder each. The forward's are phases of its layer launch, so their
 * builders only fill the arguments; the backward's launch their kernel too.
 */
#include <string.h>

#include "cuda/backend.h"

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
mok_status gateup_fwd(const call *c, int routed, const void *a, const void *w_gate,
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
mok_status down_fwd(const call *c, int routed, const void *a, const void *w_down,
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
mok_status down_dgrad(const call *c, int routed, const void *a, const void *w_down,
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
mok_status gateup_dgrad(const call *c, int routed, const void *dgu, const void *w_gate,
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
mok_status wgrad(const call *c, int routed, const void *a, int64_t M, const void *b,
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
