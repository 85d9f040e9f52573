/*
 * gemm_fp8.cu: the five products of the layer on e4m3 operands (DESIGN §8.2), on the engine of
 * gemm.cuh (tiles, pipeline, clusters of 2 x 1 CTAs sharing B) with its FP8 k-loop
 * (gemm8_consume: k-blocks of 128, partial sums promoted into fp32 with the scales every block):
 *   fwd_gateup   x codes [rows, H] x [gate | up]^T -> gu, hw, and hw's codes (Q_row along I)
 *   fwd_down     hw codes [rows, I] x W_down^T     -> slot rows / fp32 rows
 *   dgrad_down   dy codes [rows, H] x W_down       -> dgu (SwiGLU backward), router partials
 *   dgrad_gateup dgu codes [rows, 2I'] x [W_gate; W_up] -> slot rows / fp32 rows
 *   wgrad        per expert: A^T B over its rows, both column-quantized (codes [M | N, rows])
 * Every operand is K-major (8-bit wgmma has no other layout): the dgrads read the weights'
 * transposed codes, the weight gradients codes that quant.cu wrote transposed. The epilogues are
 * the bf16 kernels' (gemm_epi.cuh) except the gate/up forward's, which also quantizes hw.
 * One kernel template over the product kind: its pieces (tile space, loads, B's scales,
 * epilogue) are chosen at compile time, so each kernel holds its own product's code only.
 */
#include "cuda/gemm_epi.cuh"
#include "fp8.h"

#define GEMM8_CTAS GEMM_CM /* clusters of 2 x 1 */

/* ---- tile space ------------------------------------------------------------------------------ */
template <int KIND> MOK_DEV int tile8_bn(void) { return KIND == GEMM8_FWD_GATEUP ? 128 : 256; }

template <int KIND> MOK_DEV int count8(const gemm_args *g, tile_memo *memo) {
  if (KIND == GEMM8_WGRAD) return wgrad_block_count(g, 1);
  return rowgroup_block_count(g, tile8_bn<KIND>(), 1, memo);
}

template <int KIND> MOK_DEV gemm_tile tile8(const gemm_args *g, int q, int rank, tile_memo *memo) {
  if (KIND == GEMM8_WGRAD) return wgrad_tile(g, q, rank, 1, memo, GEMM8_BK);
  return rowgroup_tile(g, q, tile8_bn<KIND>(), rank, 1, memo, GEMM8_BK);
}

/* ---- loads: codes and scales of k-block kb into stage s -------------------------------------- */
template <int KIND>
MOK_DEV void load8(const gemm8_args *a, gemm8_smem *sm, int s, const gemm_tile *tl, int rank,
                   int kb) {
  const gemm_args *g = &a->g;
  uint64_t *bar = &sm->full[s];
  char *sa = (char *)sm->a[s], *sb = (char *)sm->b[s];
  if (KIND == GEMM8_WGRAD) {
    const int k = tl->k_row0 + kb * GEMM8_BK; /* segments start at multiples of 128 */
    tma_load_2d(sa, &g->a, bar, k, tl->m0);
    load_b_kmajor_2d(sb, bar, tl, rank, &g->b0, k);
    tma_load_2d(sm->sa[s], &a->sa, bar, tl->m0, k / GEMM8_BK);
    tma_load_2d(sm->sb[s], &a->sb, bar, tl->n0, k / GEMM8_BK);
    return;
  }
  load_a_kmajor(g, sa, bar, tl, rank, 1, kb * GEMM8_BK);
  tma_load_2d(sm->sa[s], &a->sa, bar, tl->m0, kb);
  if (KIND == GEMM8_FWD_GATEUP) {
    load_b_kmajor(sb, bar, tl, rank, &g->b0, tl->n0, &g->b1, tl->n0, kb * GEMM8_BK);
  } else if (KIND == GEMM8_DGRAD_GATEUP) {
    const int up = kb >= a->ksplit;
    const CUtensorMap *map = up ? &g->b1 : &g->b0;
    const int k = (up ? kb - a->ksplit : kb) * GEMM8_BK;
    load_b_kmajor(sb, bar, tl, rank, map, tl->n0, map, tl->n0 + 128, k);
  } else {
    load_b_kmajor(sb, bar, tl, rank, &g->b0, tl->n0, &g->b0, tl->n0 + 128, kb * GEMM8_BK);
  }
}

template <int KIND> MOK_DEV uint32_t stage8_bytes(void) {
  return GEMM8_A_BYTES + GEMM8_B_BYTES + (KIND == GEMM8_WGRAD ? GEMM8_SB_BYTES : 0);
}

/* The weights' scale of half h of the tile at k-block kb (gemm8_args says the rule). */
template <int KIND> struct weight_scale {
  const gemm8_args *a;
  const gemm_tile *tl;
  __device__ __forceinline__ float operator()(int h, int kb) const {
    const float *w = a->w0;
    int nb = tl->n0 / 128, k = kb;
    if (KIND == GEMM8_FWD_GATEUP) {
      if (h) w = a->w1;
    } else {
      nb += h;
      if (KIND == GEMM8_DGRAD_GATEUP && kb >= a->ksplit) w = a->w1, k = kb - a->ksplit;
    }
    nb = min(nb, a->ng - 1);
    return __ldg(w + (size_t)tl->expert * a->se + nb * a->sn + k * a->sk);
  }
};

/* ---- the gate/up forward's epilogue ---------------------------------------------------------- */
/* epi_swiglu_fwd's gu and hw, and hw's codes: the tile holds 128 columns of I, one Q_row group,
 * so each row's scale is the amax of its 128 rounded hw values, over the quad that holds them.
 * The quad exchange that gives each thread 8 contiguous columns of hw for its 16-byte store also
 * gives it their 8 codes, stored as 8 bytes. */
MOK_DEV void epi8_swiglu_fwd(const gemm8_args *a, const gemm_tile *tl, int cw, float *d) {
  const gemm_args *g = &a->g;
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
    uint32_t v[4][4];
    float amax = 0.0f;
#pragma unroll
    for (int b = 0; b < 4; b++)
#pragma unroll
      for (int jo = 0; jo < 4; jo++) {
        const float *gv = d + 4 * (4 * b + jo) + 2 * h, *uv = gv + 64;
        v[b][jo] = pack_bf16x2(w * silu_f(gv[0]) * uv[0], w * silu_f(gv[1]) * uv[1]);
        const float2 f = bf16x2_to_float2(v[b][jo]);
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const int e = mok_fp8_scale_exp(amax);
    const float inv = mok_pow2f(-e);
    uint8_t *q = valid ? a->q_out + (size_t)r * I : NULL;
#pragma unroll
    for (int b = 0; b < 4; b++) {
      quad_transpose(v[b]);
      const int col = tl->n0 + 32 * b + 8 * (threadIdx.x % 4);
      store_bf16_own(hw, col, I, v[b], 0);
      uint32_t c[2];
#pragma unroll
      for (int i = 0; i < 2; i++) {
        const float2 x = bf16x2_to_float2(v[b][2 * i]), y = bf16x2_to_float2(v[b][2 * i + 1]);
        c[i] = (uint32_t)cvt_e4m3x2(x.x * inv, x.y * inv) |
               (uint32_t)cvt_e4m3x2(y.x * inv, y.y * inv) << 16;
      }
      if (q && col < I) *(uint2 *)(q + col) = make_uint2(c[0], c[1]);
    }
    if (valid && p.col == 0) a->s_out[(size_t)(tl->n0 / 128) * a->ld_s + r] = mok_pow2f(e);
  }
}

template <int KIND>
MOK_DEV void epi8(const gemm8_args *a, const gemm_tile *tl, int cw, float *d) {
  if (KIND == GEMM8_FWD_GATEUP) epi8_swiglu_fwd(a, tl, cw, d);
  else if (KIND == GEMM8_DGRAD_DOWN) epi_swiglu_bwd(&a->g, tl, cw, d);
  else if (KIND == GEMM8_WGRAD) epi_wgrad(&a->g, tl, cw, d);
  else epi_rows(&a->g, tl, cw, d);
}

/* ---- the kernel ------------------------------------------------------------------------------ */
template <int KIND>
MOK_DEV void produce8(const gemm8_args *a, gemm8_smem *sm, int rank, gemm_pipe *pipe) {
  const gemm_args *g = &a->g;
  prefetch_tensormap(&g->a);
  prefetch_tensormap(&g->b0);
  prefetch_tensormap(&a->sa);
  tile_memo memo = TILE_MEMO_INIT;
  const int total = count8<KIND>(g, &memo);
  for (int q = blockIdx.x / GEMM8_CTAS; q < total; q += gridDim.x / GEMM8_CTAS) {
    const gemm_tile tl = tile8<KIND>(g, q, rank, &memo);
    for (int kb = 0; kb < tl.k_blocks; kb++, pipe->it++) {
      const int s = gemm_produce_begin(sm, pipe, tl.valid, stage8_bytes<KIND>());
      if (tl.valid) load8<KIND>(a, sm, s, &tl, rank, kb);
    }
  }
}

template <int KIND>
MOK_DEV void consume8(const gemm8_args *a, gemm8_smem *sm, int rank, int cw, gemm_pipe *pipe) {
  const gemm_args *g = &a->g;
  tile_memo memo = TILE_MEMO_INIT;
  float d[128];
  const int total = count8<KIND>(g, &memo);
  for (int q = blockIdx.x / GEMM8_CTAS; q < total; q += gridDim.x / GEMM8_CTAS) {
    const gemm_tile tl = tile8<KIND>(g, q, rank, &memo);
    if (!tl.valid) {
      gemm_consume_phantom(sm, pipe, tl.k_blocks, GEMM8_CTAS, cw);
      continue;
    }
    const weight_scale<KIND> ws = {a, &tl};
    gemm8_consume<KIND == GEMM8_WGRAD ? BSCALE_ROWS : BSCALE_BLOCK>(sm, pipe, tl.k_blocks,
                                                                     GEMM8_CTAS, cw, ws, d);
    epi8<KIND>(a, &tl, cw, d);
  }
}

template <int KIND>
__global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm8_kernel(const __grid_constant__ gemm8_args a) {
  if (*a.g.status) return; /* the same word for every CTA: the whole grid leaves */
  extern __shared__ char smem_raw[];
  if (!GEMM_ARCH_OK) __trap();
  gemm8_smem *sm = gemm_smem_init<gemm8_smem>(smem_raw, GEMM8_CTAS);
  const int rank = (int)cluster_ctarank();
  gemm_pipe pipe = {0};
  if (threadIdx.x / 128 == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) produce8<KIND>(&a, sm, rank, &pipe);
  } else {
    setmaxnreg_inc<232>();
    consume8<KIND>(&a, sm, rank, threadIdx.x / 128 - 1, &pipe);
  }
  cluster_sync(); /* peers may still multicast into us or release our stages */
}

/* ---- launchers ------------------------------------------------------------------------------- */
typedef void (*gemm8_fn)(gemm8_args);
static const gemm8_fn gemm8_fns[GEMM8_KINDS] = {
    gemm8_kernel<GEMM8_FWD_GATEUP>, gemm8_kernel<GEMM8_FWD_DOWN>, gemm8_kernel<GEMM8_DGRAD_DOWN>,
    gemm8_kernel<GEMM8_DGRAD_GATEUP>, gemm8_kernel<GEMM8_WGRAD>};

static cudaLaunchConfig_t launch8_config(int ctas, cudaStream_t stream, cudaLaunchAttribute *attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(GEMM_THREADS);
  cfg.dynamicSmemBytes = GEMM8_SMEM_BYTES;
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = GEMM8_CTAS;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

cudaError_t gemm8_init(int *max_ctas) {
  static_assert(GEMM8_SMEM_BYTES <= 227 * 1024, "FP8 GEMM shared memory exceeds the sm_90 limit");
  int fewest = 1 << 30;
  for (int i = 0; i < GEMM8_KINDS; i++) {
    cudaError_t e = cudaFuncSetAttribute((const void *)gemm8_fns[i],
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)GEMM8_SMEM_BYTES);
    if (e != cudaSuccess) return e;
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t cfg = launch8_config(GEMM8_CTAS, 0, &attr);
    int clusters = 0;
    e = cudaOccupancyMaxActiveClusters(&clusters, (const void *)gemm8_fns[i], &cfg);
    if (e != cudaSuccess) return e;
    fewest = clusters < fewest ? clusters : fewest;
  }
  *max_ctas = GEMM8_CTAS * fewest;
  return cudaSuccess;
}

cudaError_t gemm8_launch(gemm8_kind kind, const gemm8_args *a, int max_ctas,
                         cudaStream_t stream) {
  const gemm_args *g = &a->g;
  const int bn = kind == GEMM8_FWD_GATEUP ? 128 : 256;
  const int blocks =
      (kind == GEMM8_WGRAD ? g->experts : 1) * gemm_blocks(g->m_tiles_max, g->n, bn, 1);
  int ctas = GEMM8_CTAS * blocks < max_ctas ? GEMM8_CTAS * blocks : max_ctas;
  if (ctas < GEMM8_CTAS) ctas = GEMM8_CTAS;
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg = launch8_config(ctas, stream, &attr);
  return cudaLaunchKernelEx(&cfg, gemm8_fns[kind], *a);
}
