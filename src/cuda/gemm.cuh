/*
 * gemm.cuh: mok's Hopper GEMM engine. One persistent, warp-specialised kernel body serves every
 * matrix product of the layer; the kernels in gemm_kernels.cu differ only in where the operands
 * come from (which tensor maps, K-major or MN-major) and in their epilogue.
 *
 * Tile: BM x BN = 128 x 256 output, BK = 64, STAGES-deep TMA -> shared memory pipeline.
 * Warpgroup 0 produces (one thread issues TMA loads), warpgroups 1 and 2 consume: each computes
 * 64 rows x 256 columns with wgmma m64n256k16, 128 fp32 accumulators per thread.
 * Shared memory (gemm_smem) is 128B-swizzled, as TMA writes it and wgmma reads it:
 *   A, K-major:  [128 rows][64 k]           (one TMA box)
 *   A, MN-major: 2 x [64 k][64 m]           (consumer w reads box w)
 *   B, K-major:  [256 rows][64 k]           (one box, or two of 128 rows: gate | up)
 *   B, MN-major: 4 x [64 k][64 n]           (LBO = 8 KB between the 64-wide n blocks)
 * Determinism: each output element is one accumulator summed over K in ascending k-blocks; no
 * split-K, no atomics; the tile order and the grid size change no bit.
 */
#ifndef MOK_GEMM_CUH
#define MOK_GEMM_CUH

#include <cuda_bf16.h>

#include "cuda/kernels.h"
#include "cuda/ptx.cuh"

#define GEMM_A_BYTES (GEMM_BM * GEMM_BK * 2)   /* 16 KB */
#define GEMM_B_BYTES (GEMM_BN * GEMM_BK * 2)   /* 32 KB */

typedef struct gemm_smem {
  alignas(1024) __nv_bfloat16 a[GEMM_STAGES][GEMM_BM * GEMM_BK];
  alignas(1024) __nv_bfloat16 b[GEMM_STAGES][GEMM_BN * GEMM_BK];
  uint64_t full[GEMM_STAGES];   /* TMA landed: producer arrive + tx bytes */
  uint64_t empty[GEMM_STAGES];  /* both consumers done reading the stage */
} gemm_smem;

/* Dynamic shared memory is only 16-byte aligned; ask for 1 KB more and align by hand. */
#define GEMM_SMEM_BYTES (sizeof(gemm_smem) + 1024)

/* ---- tile scheduling ------------------------------------------------------------------------ */
typedef struct gemm_tile {
  int m0, n0;   /* first output row and column */
  int expert;   /* local expert (0 for the shared expert) */
  int k_row0;   /* weight gradients: first row of the expert's K range */
  int k_blocks; /* number of BK-wide k-blocks */
} gemm_tile;

/* Row-grouped products: M tiles over routed rows, N tiles of width `bn_out`. */
MOK_DEV int rowgroup_tile_count(const gemm_args *g, int bn_out) {
  int m_tiles = g->offsets ? g->offsets[g->experts] / GEMM_BM : g->m_tiles_max;
  return m_tiles * ((g->n + bn_out - 1) / bn_out);
}

MOK_DEV gemm_tile rowgroup_tile(const gemm_args *g, int t, int bn_out) {
  int n_tiles = (g->n + bn_out - 1) / bn_out;
  int mt = t / n_tiles;
  gemm_tile r;
  r.m0 = mt * GEMM_BM;
  r.n0 = (t - mt * n_tiles) * bn_out;
  r.expert = g->mblock_expert ? g->mblock_expert[mt] : 0;
  r.k_row0 = 0;
  r.k_blocks = g->k / GEMM_BK;
  return r;
}

/* Weight-gradient products: every expert has the same output tiles; K = its padded rows. */
MOK_DEV int wgrad_tile_count(const gemm_args *g) {
  return g->experts * g->m_tiles_max * ((g->n + GEMM_BN - 1) / GEMM_BN);
}

MOK_DEV gemm_tile wgrad_tile(const gemm_args *g, int t) {
  int n_tiles = (g->n + GEMM_BN - 1) / GEMM_BN;
  int per_expert = g->m_tiles_max * n_tiles;
  gemm_tile r;
  r.expert = t / per_expert;
  int rest = t - r.expert * per_expert;
  int mt = rest / n_tiles;
  r.m0 = mt * GEMM_BM;
  r.n0 = (rest - mt * n_tiles) * GEMM_BN;
  if (g->offsets) {
    r.k_row0 = g->offsets[r.expert];
    r.k_blocks = (g->offsets[r.expert + 1] - r.k_row0) / GEMM_BK;
  } else {
    r.k_row0 = 0;
    r.k_blocks = (g->k + GEMM_BK - 1) / GEMM_BK;
  }
  return r;
}

/* ---- the consumer's k-loop ------------------------------------------------------------------- */
/* Pipeline position shared by producer and consumers: iteration i uses stage i % STAGES, and
 * waits for phase parity (i / STAGES) & 1. Both sides walk the same tiles in the same order. */
typedef struct gemm_pipe {
  uint32_t it;
} gemm_pipe;

MOK_DEV void acc_zero(float *d) {
#pragma unroll
  for (int i = 0; i < 128; i++) d[i] = 0.0f;
}

MOK_DEV void acc_fence(float *d) {
#pragma unroll
  for (int i = 0; i < 128; i++) fence_operand(d[i]);
}

/* Consumer warpgroup `cw` (0 or 1) multiplies its 64 rows over the tile's k-blocks.
 * a_mn / b_mn: whether A / B lie MN-major in shared memory (compile-time constants). */
MOK_DEV void gemm_consume(gemm_smem *sm, gemm_pipe *p, int k_blocks, int cw, int a_mn, int b_mn,
                          float *d) {
  acc_zero(d);
  int prev = -1;
  for (int kb = 0; kb < k_blocks; kb++, p->it++) {
    int s = (int)(p->it % GEMM_STAGES);
    mbarrier_wait_parity(&sm->full[s], (p->it / GEMM_STAGES) & 1);
    const char *a = (const char *)sm->a[s];
    const char *b = (const char *)sm->b[s];
    acc_fence(d);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < GEMM_BK / 16; kk++) {
      uint64_t da, db;
      if (a_mn) /* box cw holds this warpgroup's 64 rows; a k16 step is 16 K-rows of 128 B */
        da = smem_desc_sw128(a + cw * 8192 + kk * 2048, 8192, 1024);
      else      /* rows 64*cw.. of 128-byte rows; a k16 step is 32 bytes into the row */
        da = smem_desc_sw128(a + cw * 8192 + kk * 32, 16, 1024);
      if (b_mn)
        db = smem_desc_sw128(b + kk * 2048, 8192, 1024);
      else
        db = smem_desc_sw128(b + kk * 32, 16, 1024);
      if (!a_mn && !b_mn) wgmma_256_kk(d, da, db);
      else if (!a_mn) wgmma_256_kt(d, da, db);
      else wgmma_256_tt(d, da, db);
    }
    wgmma_commit_group();
    /* Keep one group in flight: the previous k-block's stage is free once this one is issued. */
    wgmma_wait_group<1>();
    acc_fence(d);
    if (prev >= 0 && threadIdx.x % 128 == 0) mbarrier_arrive(&sm->empty[prev]);
    prev = s;
  }
  wgmma_wait_group<0>();
  acc_fence(d);
  if (prev >= 0 && threadIdx.x % 128 == 0) mbarrier_arrive(&sm->empty[prev]);
}

/* Producer: wait until stage s is free, then announce the bytes that will land in it. */
MOK_DEV int gemm_produce_begin(gemm_smem *sm, gemm_pipe *p) {
  int s = (int)(p->it % GEMM_STAGES);
  if (p->it >= GEMM_STAGES) mbarrier_wait_parity(&sm->empty[s], ((p->it / GEMM_STAGES) - 1) & 1);
  mbarrier_arrive_expect_tx(&sm->full[s], GEMM_A_BYTES + GEMM_B_BYTES);
  return s;
}

/* ---- kernel prologue ------------------------------------------------------------------------ */
MOK_DEV gemm_smem *gemm_smem_init(char *raw) {
  gemm_smem *sm = (gemm_smem *)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
  if (threadIdx.x == 0) {
    for (int s = 0; s < GEMM_STAGES; s++) {
      mbarrier_init(&sm->full[s], 1);
      mbarrier_init(&sm->empty[s], 2);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  return sm;
}

/* ---- epilogue helpers ----------------------------------------------------------------------- */
/* The m64n256 accumulator layout (PTX ISA 9.7.15.5.2, "Matrix fragments for wgmma.m64nNk16"):
 * thread l of warp q holds rows 16q + l/4 and 16q + l/4 + 8; for each 8-column group j,
 * d[4j + 0..1] are columns 8j + 2(l%4) + {0,1} of the first row, d[4j + 2..3] of the second. */
typedef struct acc_pos {
  int row;   /* first of the thread's two rows, relative to the tile */
  int col;   /* column of d[0] relative to the tile; group j adds 8j */
} acc_pos;

MOK_DEV acc_pos acc_position(int cw) {
  int t = threadIdx.x % 128;
  acc_pos p;
  p.row = cw * 64 + (t / 32) * 16 + (t % 32) / 4;
  p.col = (t % 4) * 2;
  return p;
}

MOK_DEV uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *(uint32_t *)&v;
}

MOK_DEV float silu_f(float z) { return z / (1.0f + __expf(-z)); }
MOK_DEV float sigmoid_f(float z) { return 1.0f / (1.0f + __expf(-z)); }

#endif /* MOK_GEMM_CUH */
