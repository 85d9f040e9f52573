/*
 * gemm_kernels.cu: the five products of the layer on the engine of gemm.cuh, each one kernel:
 *   fwd_gateup   [rows, H] x [gate | up]^T  -> gu, hw = w * silu(g) * u      (A, B K-major)
 *   fwd_down     [rows, I] x W_down^T       -> slot rows / fp32 rows          (A, B K-major)
 *   dgrad_down   [rows, H] x W_down         -> dgu (SwiGLU backward), router-gradient partials
 *                                                                              (B MN-major)
 *   dgrad_gateup [rows, 2I] x [W_gate; W_up] -> slot rows / fp32 rows         (B MN-major)
 *   wgrad        per expert: A^T B over its rows -> weight gradient           (A, B MN-major)
 * Every kernel has the same order: error-word check, shared memory and barriers, then the
 * producer warpgroup (TMA) and two consumer warpgroups (wgmma + epilogue), persistent over tiles.
 */
#include "cuda/gemm.cuh"
#include "cuda/kernels.h"

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ == 900
#define GEMM_ARCH_OK 1
#else
#define GEMM_ARCH_OK 0
#endif

/* ---- epilogues ------------------------------------------------------------------------------ */

/* Rows of A x B^T: routed rows go to their slot t*k+j as bf16 (row_src), plain rows (the shared
 * expert) to fp32 rows r < rows_valid. */
MOK_DEV void epi_rows(const gemm_args *g, const gemm_tile *tl, int cw, const float *d) {
  acc_pos p = acc_position(cw);
#pragma unroll
  for (int h = 0; h < 2; h++) {
    int r = tl->m0 + p.row + 8 * h;
    if (g->row_src) {
      int slot = g->row_src[r];
      if (slot < 0) continue;
      __nv_bfloat16 *row = (__nv_bfloat16 *)g->out0 + (size_t)slot * g->ld_out;
#pragma unroll
      for (int j = 0; j < 32; j++) {
        int c = tl->n0 + p.col + 8 * j;
        if (c < g->n) *(uint32_t *)(row + c) = pack_bf16x2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
      }
    } else {
      if (r >= g->rows_valid) continue;
      float *row = (float *)g->out0 + (size_t)r * g->ld_out;
#pragma unroll
      for (int j = 0; j < 32; j++) {
        int c = tl->n0 + p.col + 8 * j;
        if (c < g->n) *(float2 *)(row + c) = make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
      }
    }
  }
}

/* Gate/up forward: tile columns [0,128) are gate and [128,256) up, for i = n0 + c.
 * gu = [bf16(g) | bf16(u)], hw = bf16(w * silu(ĝ) * û) from the rounded values. */
MOK_DEV void epi_swiglu_fwd(const gemm_args *g, const gemm_tile *tl, int cw, const float *d) {
  acc_pos p = acc_position(cw);
  const int I = g->n;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    int r = tl->m0 + p.row + 8 * h;
    if (r >= g->rows_valid) continue;
    float w = g->row_weight ? g->row_weight[r] : 1.0f;
    __nv_bfloat16 *gu = (__nv_bfloat16 *)g->out0 + (size_t)r * 2 * I;
    __nv_bfloat16 *hw = (__nv_bfloat16 *)g->out1 + (size_t)r * I;
#pragma unroll
    for (int j = 0; j < 16; j++) {
      int i = tl->n0 + p.col + 8 * j;
      if (i >= I) continue;
      __nv_bfloat162 gb = __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
      __nv_bfloat162 ub =
          __floats2bfloat162_rn(d[4 * (j + 16) + 2 * h], d[4 * (j + 16) + 2 * h + 1]);
      *(__nv_bfloat162 *)(gu + i) = gb;
      *(__nv_bfloat162 *)(gu + I + i) = ub;
      float2 gf = __bfloat1622float2(gb), uf = __bfloat1622float2(ub);
      *(uint32_t *)(hw + i) =
          pack_bf16x2(w * silu_f(gf.x) * uf.x, w * silu_f(gf.y) * uf.y);
    }
  }
}

/* Down dgrad: the accumulator is dh for (row, i = n0 + c). With the saved ĝ, û:
 * router-gradient partial per 64-column chunk = sum dh * silu(ĝ) * û (thread order, then the
 * quad in xor order: fixed); d = w * dh; dĝ = d û σ (1 + ĝ (1 - σ)), dû = d ĝ σ. */
MOK_DEV void epi_swiglu_bwd(const gemm_args *g, const gemm_tile *tl, int cw, const float *d) {
  acc_pos p = acc_position(cw);
  const int I = g->n;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    int r = tl->m0 + p.row + 8 * h;
    bool valid = r < g->rows_valid;
    float w = 1.0f;
    if (valid && g->row_weight) w = g->row_weight[r];
    const __nv_bfloat16 *gu = g->gu_in + (size_t)r * 2 * I;
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
 * bf16 store, or fp32 out = out + acc. */
MOK_DEV void epi_wgrad(const gemm_args *g, const gemm_tile *tl, int cw, const float *d) {
  acc_pos p = acc_position(cw);
  const int split = g->k_split, rest = g->m - g->k_split;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    int m = tl->m0 + p.row + 8 * h;
    if (m >= g->m) continue;
    size_t row = m < split ? ((size_t)tl->expert * split + m) : ((size_t)tl->expert * rest + m - split);
    void *base = m < split ? g->out0 : g->out1;
#pragma unroll
    for (int j = 0; j < 32; j++) {
      int c = tl->n0 + p.col + 8 * j;
      if (c >= g->n) continue;
      float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
      if (g->accumulate) {
        float2 *o = (float2 *)((float *)base + row * g->ld_out + c);
        float2 old = *o;
        *o = make_float2(old.x + v0, old.y + v1);
      } else {
        *(uint32_t *)((__nv_bfloat16 *)base + row * g->ld_out + c) = pack_bf16x2(v0, v1);
      }
    }
  }
}

/* ---- kernels -------------------------------------------------------------------------------- */
/* The body shared by all kernels: `TILE` gives tile t, `LOAD(s, tl, kb)` issues the TMA loads
 * of k-block kb into stage s, `EPI` stores the tile. A macro, not a template: each kernel reads
 * top to bottom with its own loads and epilogue named. */
#define GEMM_KERNEL_BODY(COUNT, TILE, LOAD, A_MN, B_MN, EPI)                                \
  extern __shared__ char smem_raw[];                                                         \
  if (!GEMM_ARCH_OK) { __trap(); }                                                           \
  if (*g.status) return;                                                                     \
  gemm_smem *sm = gemm_smem_init(smem_raw);                                                  \
  const int total = COUNT;                                                                   \
  gemm_pipe pipe = {0};                                                                      \
  if (threadIdx.x / 128 == 0) {                                                              \
    setmaxnreg_dec<40>();                                                                    \
    if (threadIdx.x == 0) {                                                                  \
      prefetch_tensormap(&g.a);                                                              \
      prefetch_tensormap(&g.b0);                                                             \
      for (int t = blockIdx.x; t < total; t += gridDim.x) {                                  \
        gemm_tile tl = TILE;                                                              \
        for (int kb = 0; kb < tl.k_blocks; kb++, pipe.it++) {                                \
          int s = gemm_produce_begin(sm, &pipe);                                             \
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
    for (int t = blockIdx.x; t < total; t += gridDim.x) {                                    \
      gemm_tile tl = TILE;                                                                \
      gemm_consume(sm, &pipe, tl.k_blocks, cw, A_MN, B_MN, d);                               \
      EPI(&g, &tl, cw, d);                                                                   \
    }                                                                                        \
  }

#define KERNEL __global__ void __launch_bounds__(GEMM_THREADS, 1)

/* A [rows, H] K-major; B = gate rows i0..i0+127 then up rows i0..i0+127 of expert e. */
KERNEL gemm_fwd_gateup(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(rowgroup_tile_count(&g, 128), rowgroup_tile(&g, t, 128),
                   (tma_load_2d(sa, &g.a, bar, kb * 64, tl.m0),
                    tma_load_3d(sb, &g.b0, bar, kb * 64, tl.n0, tl.expert),
                    tma_load_3d(sb + 128 * 64, &g.b1, bar, kb * 64, tl.n0, tl.expert)),
                   0, 0, epi_swiglu_fwd)
}

/* A [rows, I] K-major; B = W_down[e] [H, I] K-major, 256 rows of H. */
KERNEL gemm_fwd_down(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(rowgroup_tile_count(&g, 256), rowgroup_tile(&g, t, 256),
                   (tma_load_2d(sa, &g.a, bar, kb * 64, tl.m0),
                    tma_load_3d(sb, &g.b0, bar, kb * 64, tl.n0, tl.expert)),
                   0, 0, epi_rows)
}

/* A [rows, H] K-major; B[n = i, k = h] = W_down[e][h, i]: MN-major boxes [64 h][64 i]. */
KERNEL gemm_dgrad_down(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(rowgroup_tile_count(&g, 256), rowgroup_tile(&g, t, 256),
                   (tma_load_2d(sa, &g.a, bar, kb * 64, tl.m0),
                    tma_load_3d(sb, &g.b0, bar, tl.n0, kb * 64, tl.expert),
                    tma_load_3d(sb + 64 * 64, &g.b0, bar, tl.n0 + 64, kb * 64, tl.expert),
                    tma_load_3d(sb + 128 * 64, &g.b0, bar, tl.n0 + 128, kb * 64, tl.expert),
                    tma_load_3d(sb + 192 * 64, &g.b0, bar, tl.n0 + 192, kb * 64, tl.expert)),
                   0, 1, epi_swiglu_bwd)
}

/* Loads B[n = h, k = c] = [W_gate; W_up][e][c, h] for k-block kb: from W_gate while c < I. */
MOK_DEV void load_gateup_mn(const gemm_args *g, __nv_bfloat16 *sb, uint64_t *bar,
                            const gemm_tile *tl, int kb) {
  int c = kb * 64;
  const CUtensorMap *map = c < g->k_split ? &g->b0 : &g->b1;
  if (c >= g->k_split) c -= g->k_split;
#pragma unroll
  for (int j = 0; j < 4; j++) tma_load_3d(sb + j * 64 * 64, map, bar, tl->n0 + 64 * j, c, tl->expert);
}

/* A [rows, 2I] K-major (dgu); B from W_gate then W_up, MN-major. */
KERNEL gemm_dgrad_gateup(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(rowgroup_tile_count(&g, 256), rowgroup_tile(&g, t, 256),
                   (tma_load_2d(sa, &g.a, bar, kb * 64, tl.m0),
                    load_gateup_mn(&g, sb, bar, &tl, kb)),
                   0, 1, epi_rows)
}

/* Per expert e: out[m, n] = sum over its rows r of A[r, m] B[r, n]; both operands are row-major
 * [rows, M] and [rows, N], i.e. MN-major, loaded as [64 r][64 m|n] boxes. */
KERNEL gemm_wgrad(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(wgrad_tile_count(&g), wgrad_tile(&g, t),
                   (tma_load_2d(sa, &g.a, bar, tl.m0, tl.k_row0 + kb * 64),
                    tma_load_2d(sa + 64 * 64, &g.a, bar, tl.m0 + 64, tl.k_row0 + kb * 64),
                    tma_load_2d(sb, &g.b0, bar, tl.n0, tl.k_row0 + kb * 64),
                    tma_load_2d(sb + 64 * 64, &g.b0, bar, tl.n0 + 64, tl.k_row0 + kb * 64),
                    tma_load_2d(sb + 128 * 64, &g.b0, bar, tl.n0 + 128, tl.k_row0 + kb * 64),
                    tma_load_2d(sb + 192 * 64, &g.b0, bar, tl.n0 + 192, tl.k_row0 + kb * 64)),
                   1, 1, epi_wgrad)
}

/* ---- launchers ------------------------------------------------------------------------------ */
/* Raises the kernels' shared-memory limit; once per device, outside any graph capture. */
cudaError_t gemm_init(void) {
  static_assert(GEMM_SMEM_BYTES <= 227 * 1024, "GEMM shared memory exceeds the sm_90 limit");
  const void *fns[] = {(const void *)gemm_fwd_gateup, (const void *)gemm_fwd_down,
                       (const void *)gemm_dgrad_down, (const void *)gemm_dgrad_gateup,
                       (const void *)gemm_wgrad};
  for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
    cudaError_t e = cudaFuncSetAttribute(fns[i], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)GEMM_SMEM_BYTES);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

static cudaError_t launch(const void *fn, const gemm_args *g, int tiles_max, int sm_count,
                          cudaStream_t stream) {
  int grid = tiles_max < sm_count ? tiles_max : sm_count;
  if (grid < 1) grid = 1;
  void *params[] = {(void *)g};
  return cudaLaunchKernel(fn, dim3(grid), dim3(GEMM_THREADS), params, GEMM_SMEM_BYTES, stream);
}

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

cudaError_t gemm_launch(gemm_kind kind, const gemm_args *g, int sm_count, cudaStream_t stream) {
  switch (kind) {
    case GEMM_FWD_GATEUP:
      return launch((const void *)gemm_fwd_gateup, g, g->m_tiles_max * ceil_div(g->n, 128),
                    sm_count, stream);
    case GEMM_FWD_DOWN:
      return launch((const void *)gemm_fwd_down, g, g->m_tiles_max * ceil_div(g->n, 256),
                    sm_count, stream);
    case GEMM_DGRAD_DOWN:
      return launch((const void *)gemm_dgrad_down, g, g->m_tiles_max * ceil_div(g->n, 256),
                    sm_count, stream);
    case GEMM_DGRAD_GATEUP:
      return launch((const void *)gemm_dgrad_gateup, g, g->m_tiles_max * ceil_div(g->n, 256),
                    sm_count, stream);
    case GEMM_WGRAD:
      return launch((const void *)gemm_wgrad, g,
                    g->experts * g->m_tiles_max * ceil_div(g->n, 256), sm_count, stream);
  }
  return cudaErrorInvalidValue;
}
