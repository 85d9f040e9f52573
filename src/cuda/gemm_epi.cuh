/*
 * gemm_epi.cuh: the operand loads (TMA, multicast to the CTAs of a cluster that share a tile) and
 * the epilogues of the GEMM products, shared by the bf16 kernels (gemm_kernels.cu) and the FP8
 * ones (gemm_fp8.cu): the loads move bytes, whatever the element type (a K-major box is 128
 * bytes wide: 64 bf16 or 128 e4m3), and every epilogue starts from the same fp32 accumulators.
 */
#ifndef MOK_GEMM_EPI_CUH
#define MOK_GEMM_EPI_CUH

#include "cuda/gemm.cuh"

/* ---- operand loads: shared tiles in parts, one per CTA, multicast to the CTAs that share them */
/* K-major tiles are rows of 128 bytes (64 bf16 or 128 e4m3 of k): the K-major loads take byte
 * addresses and k in the map's elements, and serve both element types. */
#define GEMM_KROW 128

/* K-major A [128 rows][128 bytes of k] of M tile m0: cn boxes of 128 / cn rows (the map's box);
 * when the row's CTAs share it, each loads its own box for all of them. */
MOK_DEV void load_a_kmajor(const gemm_args *g, char *sa, uint64_t *bar, const gemm_tile *tl,
                           int rank, int cn, int k) {
  const int box = GEMM_BM / cn;
#pragma unroll
  for (int j = 0; j < cn; j++) {
    char *dst = sa + j * box * GEMM_KROW;
    const int row = tl->m0 + j * box;
    if (!tl->a_shared) tma_load_2d(dst, &g->a, bar, k, row);
    else if (j == rank_n(rank)) tma_load_2d_multicast(dst, &g->a, bar, k, row, a_mask(rank));
  }
}

/* MN-major A of two [64 k][64 m] boxes at rows m0 + 64j (weight gradients); shared (cn = 2),
 * box j comes from the CTA with rank_n = j. */
MOK_DEV void load_a_mn(const gemm_args *g, char *sa, uint64_t *bar, const gemm_tile *tl,
                       int rank, int k) {
#pragma unroll
  for (int j = 0; j < 2; j++) {
    char *dst = sa + j * 64 * 64 * 2;
    if (!tl->a_shared) tma_load_2d(dst, &g->a, bar, tl->m0 + 64 * j, k);
    else if (j == rank_n(rank))
      tma_load_2d_multicast(dst, &g->a, bar, tl->m0 + 64 * j, k, a_mask(rank));
  }
}

/* K-major B of two 128-row halves: half h from map_h at (k, row_h, expert) into rows 128h.. */
MOK_DEV void load_b_kmajor(char *sb, uint64_t *bar, const gemm_tile *tl, int rank,
                           const CUtensorMap *map0, int row0, const CUtensorMap *map1, int row1,
                           int k) {
  if (tl->b_shared) {
    const int h = rank_m(rank);
    tma_load_3d_multicast(sb + h * 128 * GEMM_KROW, h ? map1 : map0, bar, k, h ? row1 : row0,
                          tl->expert, b_mask(rank));
  } else {
    tma_load_3d(sb, map0, bar, k, row0, tl->expert);
    tma_load_3d(sb + 128 * GEMM_KROW, map1, bar, k, row1, tl->expert);
  }
}

/* The same from one 2D map [N rows][K] (no expert planes): rows n0 and n0 + 128. */
MOK_DEV void load_b_kmajor_2d(char *sb, uint64_t *bar, const gemm_tile *tl, int rank,
                              const CUtensorMap *map, int k) {
  if (tl->b_shared) {
    const int h = rank_m(rank);
    tma_load_2d_multicast(sb + h * 128 * GEMM_KROW, map, bar, k, tl->n0 + 128 * h, b_mask(rank));
  } else {
    tma_load_2d(sb, map, bar, k, tl->n0);
    tma_load_2d(sb + 128 * GEMM_KROW, map, bar, k, tl->n0 + 128);
  }
}

/* MN-major B of four [64 k][64 n] boxes at columns n0 + 64j; half h = boxes 2h and 2h+1.
 * EXPERT: a 3D map, expert e's plane (the dgrads' weights), else a 2D map (rows = k). A template
 * argument, not a test of e at run time: in a launch of several products (wip/split2's backward
 * launches) the compiler merged the two kinds into predicated pairs of loads, which cost gate/up
 * dgrad 0.2-0.3 ms on gpt-oss-120b (perf-log 2026-12-04 at 53149ba). e is unused for 2D. */
template <bool EXPERT>
MOK_DEV void load_b_mn(char *sb, uint64_t *bar, const gemm_tile *tl, int rank,
                       const CUtensorMap *map, int k, int e) {
#pragma unroll
  for (int j = 0; j < 4; j++) {
    int half = j / 2;
    if (tl->b_shared && half != rank_m(rank)) continue;
    char *dst = sb + j * 64 * 64 * 2;
    int n = tl->n0 + 64 * j;
    if (tl->b_shared) {
      if (!EXPERT) tma_load_2d_multicast(dst, map, bar, n, k, b_mask(rank));
      else tma_load_3d_multicast(dst, map, bar, n, k, e, b_mask(rank));
    } else {
      if (!EXPERT) tma_load_2d(dst, map, bar, n, k);
      else tma_load_3d(dst, map, bar, n, k, e);
    }
  }
}

/* ---- epilogues ------------------------------------------------------------------------------ */
/* Every epilogue writes straight from registers (stores, or one fp32 add per element), with no
 * shared memory and no barrier: the thread writes its own two rows (acc_position). */

/* Rows of A x B^T: routed rows go to their slot t*k+j on their token's rank as bf16 (row_src),
 * plain rows (the shared expert) to fp32 rows r < rows_valid. Both routed rows' destinations are
 * found before either is stored: a load after a store may alias it, so row 1's two dependent
 * loads (row_src, then peer_out) otherwise waited behind row 0's stores, in turn. */
MOK_DEV void epi_rows(const gemm_args *g, const gemm_tile *tl, int cw, float *d) {
  const acc_pos p = acc_position();
  const int r0 = tl->m0 + cw * 64 + p.row;
  if (g->row_src) {
    int src[2];
    char *row[2];
#pragma unroll
    for (int h = 0; h < 2; h++) src[h] = g->row_src[r0 + 8 * h];
#pragma unroll
    for (int h = 0; h < 2; h++) /* pushed into the slot on the token's own rank */
      row[h] = src[h] >= 0 ? (char *)g->peer_out[src[h] / g->slots_cap] +
                                 (size_t)(src[h] % g->slots_cap) * g->ld_out * 2
                           : NULL;
#pragma unroll
    for (int h = 0; h < 2; h++) store_bf16_row(row[h], tl->n0, g->n, d, h, 0, 8, 0);
  } else {
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int r = r0 + 8 * h;
      float *row = r < g->rows_valid ? (float *)g->out0 + (size_t)r * g->ld_out : NULL;
      store_f32_row(row, tl->n0, g->n, d, h, 0);
    }
  }
}

/* Gate/up forward: tile columns [0,128) are gate and [128,256) up, for i = n0 + c.
 * gu = [bf16(g) | bf16(u)], hw = bf16(w * silu(ĝ) * û) from the rounded values, which replace
 * the accumulators (no second copy of the tile in registers). Only the backward reads gu, so it
 * is stored evict-first; down reads hw next, from L2 where it can. */
MOK_DEV void epi_swiglu_fwd(const gemm_args *g, const gemm_tile *tl, int cw, float *d) {
  const acc_pos p = acc_position();
  const int I = g->n;
  float wr[2]; /* both rows' router weights before any store (epi_rows says why) */
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int r = tl->m0 + cw * 64 + p.row + 8 * h;
    wr[h] = r >= g->rows_valid ? 0.0f : g->row_weight ? g->row_weight[r] : 1.0f;
  }
#pragma unroll
  for (int i = 0; i < 128; i++) d[i] = __bfloat162float(__float2bfloat16_rn(d[i]));
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int r = tl->m0 + cw * 64 + p.row + 8 * h;
    const bool valid = r < g->rows_valid;
    char *gu = valid ? (char *)g->out0 + (size_t)r * 2 * I * 2 : NULL;
    char *hw = valid ? (char *)g->out1 + (size_t)r * I * 2 : NULL;
    const float w = wr[h];
    store_bf16_row(gu, tl->n0, I, d, h, 0, 4, 1);
    store_bf16_row(gu ? gu + (size_t)I * 2 : NULL, tl->n0, I, d, h, 16, 4, 1);
#pragma unroll
    for (int b = 0; b < 4; b++) {
      uint32_t v[4];
#pragma unroll
      for (int jo = 0; jo < 4; jo++) {
        const float *gv = d + 4 * (4 * b + jo) + 2 * h, *uv = gv + 64;
        v[jo] = pack_bf16x2(w * silu_f(gv[0]) * uv[0], w * silu_f(gv[1]) * uv[1]);
      }
      store_bf16_quad(hw, tl->n0 + 32 * b, I, v, 0);
    }
  }
}

/* Down dgrad, one pass: ĝ, û read once per element, dgu stored straight from registers; the
 * router-gradient partial per 64-column chunk summed in thread order, then the quad in xor
 * order (fixed).
 * The thread's 128 elements come in 8 groups (its two rows x four 64-column chunks). Loads and
 * stores are 16 bytes per thread, 8 columns in a run; the accumulators (dh) are moved to that
 * layout by quad_transpose, their x and y words apart, so that ĝ, û and dgu need none: 4
 * transposes a group instead of 8, of 16 instructions each (a quarter of this epilogue's
 * instructions went to them). Each half of group c (16 bytes of ĝ and of û) is computed into
 * registers, then the same half of group c + 2 is loaded into them, then the half's dgu is
 * stored: a load after a store may alias it, so with loads and stores interleaved every pair
 * waited out a full memory latency in turn, and this epilogue cost more than the k-loop (ncu,
 * perf-log 2026-12-02 86bffbf: 311 TF/s on mixtral, 213 on gpt-oss). Two groups in flight, not
 * one: with one, each of the 8 groups waited out a load in turn, and the epilogue was a fifth of
 * mixtral's down dgrad (perf-log 2026-12-02 394766a; two: 2026-12-03). Computing and storing
 * half a group at a time keeps 8 words of dgu in registers, not 16 (16 made ptxas spill). */
typedef struct gu_group {
  uint32_t g[8], u[8]; /* as loaded: words 4b.. hold columns 32b + 8t .. + 7 of the chunk */
} gu_group;

/* Half b of group c: columns 32b + 8t .. + 7 of its chunk, into words 4b.. of v. */
MOK_DEV void gu_group_load(const gemm_args *g, const gemm_tile *tl, acc_pos p, int cw, int c,
                           int b, gu_group *v) {
  const int I = g->n, h = c / 4, q = c % 4;
  const int r = tl->m0 + cw * 64 + p.row + 8 * h;
  const bool valid = r < g->rows_valid;
  const __nv_bfloat16 *gu = g->gu_in + (size_t)(valid ? r : 0) * 2 * I;
  const int i = tl->n0 + 64 * q + 32 * b + 8 * (threadIdx.x % 4);
  const bool ok = valid && i < I;
  const uint4 z = make_uint4(0, 0, 0, 0);
  const uint4 x = ok ? __ldg((const uint4 *)(gu + i)) : z;
  const uint4 y = ok ? __ldg((const uint4 *)(gu + I + i)) : z;
  v->g[4 * b] = x.x, v->g[4 * b + 1] = x.y, v->g[4 * b + 2] = x.z, v->g[4 * b + 3] = x.w;
  v->u[4 * b] = y.x, v->u[4 * b + 1] = y.y, v->u[4 * b + 2] = y.z, v->u[4 * b + 3] = y.w;
}

MOK_DEV float2 bf16x2_to_float2(uint32_t w) {
  return __bfloat1622float2(*(const __nv_bfloat162 *)&w);
}

/* Row half h's router weight and the slot of its router-gradient partials (-1: none). */
MOK_DEV void row_words(const gemm_args *g, const gemm_tile *tl, acc_pos p, int cw, int h,
                       float *w, int *slot) {
  const int r = tl->m0 + cw * 64 + p.row + 8 * h;
  const bool valid = r < g->rows_valid;
  *w = valid && g->row_weight ? g->row_weight[r] : 1.0f;
  *slot = valid && g->peer_aux ? g->row_src[r] : -1;
}

MOK_DEV void epi_swiglu_bwd(const gemm_args *g, const gemm_tile *tl, int cw, float *d) {
  const acc_pos p = acc_position();
  const int I = g->n;
  gu_group v[2];
#pragma unroll
  for (int b = 0; b < 2; b++) {
    gu_group_load(g, tl, p, cw, 0, b, &v[0]);
    gu_group_load(g, tl, p, cw, 1, b, &v[1]);
  }
  float w[2];   /* per row: router weight, and the slot of its router-gradient partials */
  int slot[2];
  row_words(g, tl, p, cw, 0, &w[0], &slot[0]);
#pragma unroll
  for (int c = 0; c < 8; c++) {
    /* Row 1's words two groups before their first use: loaded with row 0's, they were held
     * through groups 0-3, and with the tile memo ptxas spilled. */
    if (c == 2) row_words(g, tl, p, cw, 1, &w[1], &slot[1]);
    const int h = c / 4, q = c % 4;
    const int r = tl->m0 + cw * 64 + p.row + 8 * h;
    const bool valid = r < g->rows_valid;
    gu_group *vc = &v[c % 2];
    char *dgu = valid ? (char *)g->out0 + (size_t)r * 2 * I * 2 : NULL;
    float part = 0.0f;
#pragma unroll
    for (int b = 0; b < 2; b++) {
      /* dh of groups 4b.. of the chunk: word i of x (y) is column 8i + 2t (+ 1); transposed in
       * place, word k is column 8t + 2k (+ 1), as the loaded word k of ĝ and û */
      float *dh = d + 4 * (8 * q + 4 * b) + 2 * h; /* word i of x at dh[4i], of y at dh[4i + 1] */
#pragma unroll
      for (int xy = 0; xy < 2; xy++) {
        uint32_t t[4];
#pragma unroll
        for (int i = 0; i < 4; i++) t[i] = __float_as_uint(dh[4 * i + xy]);
        quad_transpose(t);
#pragma unroll
        for (int i = 0; i < 4; i++) dh[4 * i + xy] = __uint_as_float(t[i]);
      }
      uint32_t dg[4], du[4];
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const float2 gf = bf16x2_to_float2(vc->g[4 * b + k]);
        const float2 uf = bf16x2_to_float2(vc->u[4 * b + k]);
        const float dh0 = dh[4 * k], dh1 = dh[4 * k + 1];
        float s0 = sigmoid_f(gf.x), s1 = sigmoid_f(gf.y);
        part = part + dh0 * silu_f(gf.x) * uf.x; /* zero where the load was skipped */
        part = part + dh1 * silu_f(gf.y) * uf.y;
        float d0 = w[h] * dh0, d1 = w[h] * dh1;
        dg[k] = pack_bf16x2(d0 * uf.x * s0 * (1.0f + gf.x * (1.0f - s0)),
                            d1 * uf.y * s1 * (1.0f + gf.y * (1.0f - s1)));
        du[k] = pack_bf16x2(d0 * gf.x * s0, d1 * gf.y * s1);
      }
      if (c + 2 < 8) gu_group_load(g, tl, p, cw, c + 2, b, vc);
      const int col = tl->n0 + 64 * q + 32 * b + 8 * (threadIdx.x % 4);
      store_bf16_own(dgu, col, I, dg, 0);
      store_bf16_own(dgu ? dgu + (size_t)I * 2 : NULL, col, I, du, 0);
    }
    part += __shfl_xor_sync(0xffffffffu, part, 1);
    part += __shfl_xor_sync(0xffffffffu, part, 2);
    const int chunk = tl->n0 / 64 + q;
    if (slot[h] >= 0 && p.col == 0 && chunk * 64 < I)
      g->peer_aux[slot[h] / g->slots_cap][(size_t)(slot[h] % g->slots_cap) * (I / 64) + chunk] =
          part;
  }
}

/* Weight gradient of expert e: row m < k_split goes to out0[e][m], else out1[e][m - k_split];
 * a bf16 store (evict-first: mok never reads it), or fp32 out += acc: one add per element by the
 * memory system, so the result does not depend on timing. */
MOK_DEV void epi_wgrad(const gemm_args *g, const gemm_tile *tl, int cw, float *d) {
  const acc_pos p = acc_position();
  const int split = g->k_split, rest = g->m - g->k_split, esz = g->accumulate ? 4 : 2;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int m = tl->m0 + cw * 64 + p.row + 8 * h;
    char *row = NULL;
    if (m < g->m) {
      size_t r = m < split ? (size_t)tl->expert * split + m : (size_t)tl->expert * rest + m - split;
      row = (char *)(m < split ? g->out0 : g->out1) + r * g->ld_out * esz;
    }
    if (g->accumulate) store_f32_row((float *)row, tl->n0, g->n, d, h, 1);
    else store_bf16_row(row, tl->n0, g->n, d, h, 0, 8, 1);
  }
}

#endif /* MOK_GEMM_EPI_CUH */
