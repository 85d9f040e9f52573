/*
 * gemm_kernels.cu: the five products of the layer on the engine of gemm.cuh, each one kernel:
 *   fwd_gateup   [rows, H] x [gate | up]^T  -> gu, hw = w * silu(g) * u      (A, B K-major)
 *   fwd_down     [rows, I] x W_down^T       -> slot rows / fp32 rows          (A, B K-major)
 *   dgrad_down   [rows, H] x W_down         -> dgu (SwiGLU backward), router-gradient partials
 *                                                                              (B MN-major)
 *   dgrad_gateup [rows, 2I] x [W_gate; W_up] -> slot rows / fp32 rows         (B MN-major)
 *   wgrad        per expert: A^T B over its rows -> weight gradient           (A, B MN-major)
 * Every kernel has the same order: error-word check, shared memory and barriers, then the
 * producer warpgroup (TMA) and two consumer warpgroups (wgmma + epilogue), persistent over groups
 * of GEMM_CLUSTER tiles, launched as clusters of GEMM_CLUSTER CTAs.
 */
#include "cuda/gemm.cuh"
#include "cuda/kernels.h"

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ == 900
#define GEMM_ARCH_OK 1
#else
#define GEMM_ARCH_OK 0
#endif

#define BOTH_CTAS ((uint16_t)0x3)

/* ---- B operand loads: two halves, one per CTA when the pair shares them -------------------- */
/* K-major B of two 128-row halves: half h from map_h at (k, row_h, expert) into rows 128h.. */
MOK_DEV void load_b_kmajor(__nv_bfloat16 *sb, uint64_t *bar, const gemm_tile *tl, int rank,
                           const CUtensorMap *map0, int row0, const CUtensorMap *map1, int row1,
                           int k) {
  if (tl->shared) {
    tma_load_3d_multicast(sb + rank * 128 * 64, rank ? map1 : map0, bar, k, rank ? row1 : row0,
                          tl->expert, BOTH_CTAS);
  } else {
    tma_load_3d(sb, map0, bar, k, row0, tl->expert);
    tma_load_3d(sb + 128 * 64, map1, bar, k, row1, tl->expert);
  }
}

/* MN-major B of four [64 k][64 n] boxes at columns n0 + 64j; half h = boxes 2h and 2h+1.
 * `e` < 0: a 2D map (rows = k), else a 3D map per expert. */
MOK_DEV void load_b_mn(__nv_bfloat16 *sb, uint64_t *bar, const gemm_tile *tl, int rank,
                       const CUtensorMap *map, int k, int e) {
#pragma unroll
  for (int j = 0; j < 4; j++) {
    int half = j / 2;
    if (tl->shared && half != rank) continue;
    __nv_bfloat16 *dst = sb + j * 64 * 64;
    int n = tl->n0 + 64 * j;
    if (tl->shared) {
      if (e < 0) tma_load_2d_multicast(dst, map, bar, n, k, BOTH_CTAS);
      else tma_load_3d_multicast(dst, map, bar, n, k, e, BOTH_CTAS);
    } else {
      if (e < 0) tma_load_2d(dst, map, bar, n, k);
      else tma_load_3d(dst, map, bar, n, k, e);
    }
  }
}

/* ---- epilogues ------------------------------------------------------------------------------ */
/* Rows of A x B^T: routed rows go to their slot t*k+j as bf16 (row_src), plain rows (the shared
 * expert) to fp32 rows r < rows_valid. */
MOK_DEV void epi_rows(const gemm_args *g, const gemm_tile *tl, gemm_smem *sm, int cw,
                      float *d) {
  const acc_pos p = acc_position();
  char *stage = epi_stage(sm, cw);
  const int me = threadIdx.x % 128;
  char *row = NULL; /* the destination row this thread sends (me < 64) */
  if (me < 64) {
    int r = tl->m0 + cw * 64 + me;
    if (g->row_src) {
      int slot = g->row_src[r];
      if (slot >= 0) row = (char *)g->out0 + (size_t)slot * g->ld_out * 2;
    } else if (r < g->rows_valid) {
      row = (char *)g->out0 + (size_t)r * g->ld_out * 4;
    }
  }
  if (g->row_src) { /* bf16: four rounds of 64 columns */
#pragma unroll
    for (int q = 0; q < 4; q++) {
      int c0 = tl->n0 + 64 * q;
      if (c0 >= g->n) break;
      epi_round_begin(cw);
#pragma unroll
      for (int jj = 0; jj < 8; jj++) {
        int j = 8 * q + jj;
#pragma unroll
        for (int h = 0; h < 2; h++)
          epi_put_bf16x2(stage, p.row + 8 * h, 8 * jj + p.col,
                         pack_bf16x2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
      }
      epi_round_send(stage, cw, row ? row + (size_t)c0 * 2 : NULL, 0);
    }
  } else { /* fp32: eight rounds of 32 columns */
#pragma unroll
    for (int q = 0; q < 8; q++) {
      int c0 = tl->n0 + 32 * q;
      if (c0 >= g->n) break;
      epi_round_begin(cw);
#pragma unroll
      for (int jj = 0; jj < 4; jj++) {
        int j = 4 * q + jj;
#pragma unroll
        for (int h = 0; h < 2; h++)
          epi_put_f32x2(stage, p.row + 8 * h, 8 * jj + p.col, d[4 * j + 2 * h],
                        d[4 * j + 2 * h + 1]);
      }
      epi_round_send(stage, cw, row ? row + (size_t)c0 * 4 : NULL, 0);
    }
  }
}

/* Gate/up forward: tile columns [0,128) are gate and [128,256) up, for i = n0 + c.
 * gu = [bf16(g) | bf16(u)], hw = bf16(w * silu(ĝ) * û) from the rounded values.
 * The accumulators are rounded in place first (no second copy of the tile in registers), then
 * six rounds send gate, up and hw, each in two 64-column halves. */
MOK_DEV void epi_swiglu_fwd(const gemm_args *g, const gemm_tile *tl, gemm_smem *sm, int cw,
                            float *d) {
  const acc_pos p = acc_position();
  const int I = g->n;
  char *stage = epi_stage(sm, cw);
  const int me = threadIdx.x % 128;
  char *gu = NULL, *hw = NULL;
  if (me < 64 && tl->m0 + cw * 64 + me < g->rows_valid) {
    size_t r = (size_t)(tl->m0 + cw * 64 + me);
    gu = (char *)g->out0 + r * 2 * I * 2;
    hw = (char *)g->out1 + r * I * 2;
  }
#pragma unroll
  for (int i = 0; i < 128; i++) d[i] = __bfloat162float(__float2bfloat16_rn(d[i]));
#pragma unroll
  for (int part = 0; part < 3; part++) { /* 0 gate, 1 up, 2 hw */
#pragma unroll
    for (int q = 0; q < 2; q++) {
      const int i0 = tl->n0 + 64 * q;
      if (i0 >= I) break;
      epi_round_begin(cw);
#pragma unroll
      for (int h = 0; h < 2; h++) {
        float w = 1.0f;
        if (part == 2 && g->row_weight) {
          int r = tl->m0 + cw * 64 + p.row + 8 * h;
          w = r < g->rows_valid ? g->row_weight[r] : 0.0f;
        }
#pragma unroll
        for (int jj = 0; jj < 8; jj++) {
          const float *gv = d + 4 * (8 * q + jj) + 2 * h, *uv = d + 4 * (16 + 8 * q + jj) + 2 * h;
          uint32_t v = part == 0   ? pack_bf16x2(gv[0], gv[1])
                       : part == 1 ? pack_bf16x2(uv[0], uv[1])
                                   : pack_bf16x2(w * silu_f(gv[0]) * uv[0],
                                                 w * silu_f(gv[1]) * uv[1]);
          epi_put_bf16x2(stage, p.row + 8 * h, 8 * jj + p.col, v);
        }
      }
      char *dst = part == 2 ? hw : gu;
      size_t off = (size_t)(part == 1 ? I + i0 : i0) * 2;
      epi_round_send(stage, cw, dst ? dst + off : NULL, 0);
    }
  }
}

/* Down dgrad, one pass: ĝ, û read once per element, dgu stored directly from registers; the
 * router-gradient partial per 64-column chunk summed in thread order, then the quad in xor
 * order (fixed). */
MOK_DEV void epi_swiglu_bwd(const gemm_args *g, const gemm_tile *tl, gemm_smem *sm,
                                   int cw, float *d) {
  (void)sm;
  const acc_pos p = acc_position();
  const int I = g->n;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    int r = tl->m0 + cw * 64 + p.row + 8 * h;
    bool valid = r < g->rows_valid;
    float w = 1.0f;
    if (valid && g->row_weight) w = g->row_weight[r];
    const __nv_bfloat16 *gu = g->gu_in + (size_t)(valid ? r : 0) * 2 * I;
    __nv_bfloat16 *dgu = (__nv_bfloat16 *)g->out0 + (size_t)r * 2 * I;
#pragma unroll
    for (int q = 0; q < 4; q++) {
      float part = 0.0f;
#pragma unroll
      for (int jj = 0; jj < 8; jj++) {
        int j = 8 * q + jj;
        int i = tl->n0 + p.col + 8 * j;
        if (!valid || i >= I) continue;
        float2 gf = __bfloat1622float2(*(const __nv_bfloat162 *)(gu + i));
        float2 uf = __bfloat1622float2(*(const __nv_bfloat162 *)(gu + I + i));
        float dh0 = d[4 * j + 2 * h], dh1 = d[4 * j + 2 * h + 1];
        float s0 = sigmoid_f(gf.x), s1 = sigmoid_f(gf.y);
        part = part + dh0 * silu_f(gf.x) * uf.x;
        part = part + dh1 * silu_f(gf.y) * uf.y;
        float d0 = w * dh0, d1 = w * dh1;
        *(uint32_t *)(dgu + i) = pack_bf16x2(d0 * uf.x * s0 * (1.0f + gf.x * (1.0f - s0)),
                                             d1 * uf.y * s1 * (1.0f + gf.y * (1.0f - s1)));
        *(uint32_t *)(dgu + I + i) = pack_bf16x2(d0 * gf.x * s0, d1 * gf.y * s1);
      }
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      int chunk = tl->n0 / 64 + q;
      if (valid && g->aux && p.col == 0 && chunk * 64 < I) {
        int slot = g->row_src[r];
        if (slot >= 0) g->aux[(size_t)slot * (I / 64) + chunk] = part;
      }
    }
  }
}
/* Weight gradient of expert e: row m < k_split goes to out0[e][m], else out1[e][m - k_split];
 * bf16 store (four rounds of 64 columns), or fp32 out += acc (eight rounds of 32, added by the
 * memory system: one add per element, so the result does not depend on timing). */
MOK_DEV void epi_wgrad(const gemm_args *g, const gemm_tile *tl, gemm_smem *sm, int cw,
                       float *d) {
  const acc_pos p = acc_position();
  char *stage = epi_stage(sm, cw);
  const int me = threadIdx.x % 128;
  const int split = g->k_split, rest = g->m - g->k_split, esz = g->accumulate ? 4 : 2;
  char *row = NULL;
  int m = tl->m0 + cw * 64 + me;
  if (me < 64 && m < g->m) {
    size_t r = m < split ? (size_t)tl->expert * split + m : (size_t)tl->expert * rest + m - split;
    row = (char *)(m < split ? g->out0 : g->out1) + r * g->ld_out * esz;
  }
  if (!g->accumulate) {
#pragma unroll
    for (int q = 0; q < 4; q++) {
      int c0 = tl->n0 + 64 * q;
      if (c0 >= g->n) break;
      epi_round_begin(cw);
#pragma unroll
      for (int jj = 0; jj < 8; jj++) {
        int j = 8 * q + jj;
#pragma unroll
        for (int h = 0; h < 2; h++)
          epi_put_bf16x2(stage, p.row + 8 * h, 8 * jj + p.col,
                         pack_bf16x2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
      }
      epi_round_send(stage, cw, row ? row + (size_t)c0 * 2 : NULL, 0);
    }
  } else {
#pragma unroll
    for (int q = 0; q < 8; q++) {
      int c0 = tl->n0 + 32 * q;
      if (c0 >= g->n) break;
      epi_round_begin(cw);
#pragma unroll
      for (int jj = 0; jj < 4; jj++) {
        int j = 4 * q + jj;
#pragma unroll
        for (int h = 0; h < 2; h++)
          epi_put_f32x2(stage, p.row + 8 * h, 8 * jj + p.col, d[4 * j + 2 * h],
                        d[4 * j + 2 * h + 1]);
      }
      epi_round_send(stage, cw, row ? row + (size_t)c0 * 4 : NULL, 1);
    }
  }
}
/* ---- kernels -------------------------------------------------------------------------------- */
/* The body shared by all kernels: `COUNT` pairs of tiles, `TILE` the tile of pair q for this
 * CTA, `LOAD` the TMA loads of k-block kb into stage s (sa, sb, bar), `EPI` the epilogue.
 * A macro, not a template: each kernel reads top to bottom with its own loads and epilogue. */
#define GEMM_KERNEL_BODY(COUNT, TILE, LOAD, A_MN, B_MN, EPI)                                \
  extern __shared__ char smem_raw[];                                                         \
  if (!GEMM_ARCH_OK) { __trap(); }                                                           \
  if (*g.status) return; /* the same word for every CTA: the whole grid leaves */            \
  gemm_smem *sm = gemm_smem_init(smem_raw);                                                  \
  const int rank = (int)cluster_ctarank();                                                   \
  const int total = COUNT;                                                                   \
  gemm_pipe pipe = {0};                                                                      \
  if (threadIdx.x / 128 == 0) {                                                              \
    setmaxnreg_dec<40>();                                                                    \
    if (threadIdx.x == 0) {                                                                  \
      prefetch_tensormap(&g.a);                                                              \
      prefetch_tensormap(&g.b0);                                                             \
      for (int q = cluster_id(); q < total; q += cluster_count()) {                          \
        gemm_tile tl = TILE;                                                                 \
        for (int kb = 0; kb < tl.k_blocks; kb++, pipe.it++) {                                \
          int s = gemm_produce_begin(sm, &pipe, tl.valid);                                   \
          if (!tl.valid) continue;                                                           \
          uint64_t *bar = &sm->full[s];                                                      \
          __nv_bfloat16 *sa = sm->a[s], *sb = sm->b[s];                                      \
          LOAD;                                                                              \
        }                                                                                    \
      }                                                                                      \
    }                                                                                        \
  } else {                                                                                   \
    setmaxnreg_inc<232>();                                                                   \
    const int cw = threadIdx.x / 128 - 1;                                                    \
    float d[128];                                                                            \
    for (int q = cluster_id(); q < total; q += cluster_count()) {                            \
      gemm_tile tl = TILE;                                                                   \
      if (!tl.valid) {                                                                       \
        gemm_consume_phantom(sm, &pipe, tl.k_blocks, cw);                                    \
        continue;                                                                            \
      }                                                                                      \
      gemm_consume(sm, &pipe, tl.k_blocks, cw, A_MN, B_MN, d);                               \
      EPI(&g, &tl, sm, cw, d);                                                               \
    }                                                                                        \
    epi_drain();                                                                             \
  }                                                                                          \
  cluster_sync(); /* the peer may still multicast into us or release our stages */

#define KERNEL __global__ void __launch_bounds__(GEMM_THREADS, 1)

/* A [rows, H] K-major; B = gate rows i0..i0+127 then up rows i0..i0+127 of expert e. */
KERNEL gemm_fwd_gateup(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(rowgroup_pair_count(&g, 128), rowgroup_tile(&g, q, 128, rank),
                   (tma_load_2d(sa, &g.a, bar, kb * 64, tl.m0),
                    load_b_kmajor(sb, bar, &tl, rank, &g.b0, tl.n0, &g.b1, tl.n0, kb * 64)),
                   0, 0, epi_swiglu_fwd)
}

/* A [rows, I] K-major; B = W_down[e] [H, I] K-major, rows n0..n0+255 in two halves. */
KERNEL gemm_fwd_down(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(rowgroup_pair_count(&g, 256), rowgroup_tile(&g, q, 256, rank),
                   (tma_load_2d(sa, &g.a, bar, kb * 64, tl.m0),
                    load_b_kmajor(sb, bar, &tl, rank, &g.b0, tl.n0, &g.b0, tl.n0 + 128,
                                  kb * 64)),
                   0, 0, epi_rows)
}

/* A [rows, H] K-major; B[n = i, k = h] = W_down[e][h, i]: MN-major boxes [64 h][64 i]. */
KERNEL gemm_dgrad_down(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(rowgroup_pair_count(&g, 256), rowgroup_tile(&g, q, 256, rank),
                   (tma_load_2d(sa, &g.a, bar, kb * 64, tl.m0),
                    load_b_mn(sb, bar, &tl, rank, &g.b0, kb * 64, tl.expert)),
                   0, 1, epi_swiglu_bwd)
}

/* B[n = h, k = c] = [W_gate; W_up][e][c, h] for k-block kb: from W_gate while c < I. */
MOK_DEV void load_gateup_mn(const gemm_args *g, __nv_bfloat16 *sb, uint64_t *bar,
                            const gemm_tile *tl, int rank, int kb) {
  int c = kb * 64;
  const CUtensorMap *map = c < g->k_split ? &g->b0 : &g->b1;
  load_b_mn(sb, bar, tl, rank, map, c < g->k_split ? c : c - g->k_split, tl->expert);
}

/* A [rows, 2I] K-major (dgu); B from W_gate then W_up, MN-major. */
KERNEL gemm_dgrad_gateup(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(rowgroup_pair_count(&g, 256), rowgroup_tile(&g, q, 256, rank),
                   (tma_load_2d(sa, &g.a, bar, kb * 64, tl.m0),
                    load_gateup_mn(&g, sb, bar, &tl, rank, kb)),
                   0, 1, epi_rows)
}

/* Per expert e: out[m, n] = sum over its rows r of A[r, m] B[r, n]; both operands are row-major
 * [rows, M] and [rows, N], i.e. MN-major, loaded as [64 r][64 m|n] boxes. */
KERNEL gemm_wgrad(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(wgrad_pair_count(&g), wgrad_tile(&g, q, rank),
                   (tma_load_2d(sa, &g.a, bar, tl.m0, tl.k_row0 + kb * 64),
                    tma_load_2d(sa + 64 * 64, &g.a, bar, tl.m0 + 64, tl.k_row0 + kb * 64),
                    load_b_mn(sb, bar, &tl, rank, &g.b0, tl.k_row0 + kb * 64, -1)),
                   1, 1, epi_wgrad)
}

/* ---- launchers ------------------------------------------------------------------------------ */
typedef void (*gemm_fn)(gemm_args);

static const gemm_fn gemm_fns[] = {gemm_fwd_gateup, gemm_fwd_down, gemm_dgrad_down,
                                   gemm_dgrad_gateup, gemm_wgrad};

static cudaLaunchConfig_t launch_config(int ctas, cudaStream_t stream, cudaLaunchAttribute *attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(GEMM_THREADS);
  cfg.dynamicSmemBytes = GEMM_SMEM_BYTES;
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = GEMM_CLUSTER;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

/* Raises the kernels' shared-memory limit and returns how many CTAs (in clusters of
 * GEMM_CLUSTER) can be resident at once; once per device, outside any graph capture. */
cudaError_t gemm_init(int *max_ctas) {
  static_assert(GEMM_SMEM_BYTES <= 227 * 1024, "GEMM shared memory exceeds the sm_90 limit");
  for (size_t i = 0; i < sizeof gemm_fns / sizeof gemm_fns[0]; i++) {
    cudaError_t e = cudaFuncSetAttribute((const void *)gemm_fns[i],
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)GEMM_SMEM_BYTES);
    if (e != cudaSuccess) return e;
  }
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg = launch_config(GEMM_CLUSTER, 0, &attr);
  int clusters = 0;
  cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, (const void *)gemm_fns[0], &cfg);
  if (e != cudaSuccess) return e;
  *max_ctas = GEMM_CLUSTER * clusters;
  return cudaSuccess;
}

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

cudaError_t gemm_launch(gemm_kind kind, const gemm_args *g, int max_ctas, cudaStream_t stream) {
  const int C = GEMM_CLUSTER;
  int pairs;
  switch (kind) {
    case GEMM_FWD_GATEUP: pairs = ceil_div(g->m_tiles_max, C) * ceil_div(g->n, 128); break;
    case GEMM_WGRAD: pairs = g->experts * ceil_div(g->m_tiles_max, C) * ceil_div(g->n, 256); break;
    default: pairs = ceil_div(g->m_tiles_max, C) * ceil_div(g->n, 256); break;
  }
  int ctas = C * pairs < max_ctas ? C * pairs : max_ctas;
  if (ctas < C) ctas = C;
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg = launch_config(ctas, stream, &attr);
  return cudaLaunchKernelEx(&cfg, gemm_fns[kind], *g);
}
