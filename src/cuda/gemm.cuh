/*
 * gemm.cuh: mok's Hopper GEMM engine. One persistent, warp-specialised kernel body serves every
 * matrix product of the layer; the kernels in gemm_kernels.cu differ only in where the operands
 * come from (which tensor maps, K-major or MN-major) and in their epilogue.
 *
 * Tile: BM x BN = 128 x 256 output, BK = 64, STAGES-deep TMA -> shared memory pipeline.
 * Warpgroup 0 produces (one thread issues TMA loads), warpgroups 1 and 2 consume: each computes
 * 64 rows x 256 columns with wgmma m64n256k16, 128 fp32 accumulators per thread.
 *
 * Clusters of 2 x cn CTAs (cn = 1 or 2: each kernel is compiled for both; 1 unless the context's
 * cluster knob asks for 2 x 2) take blocks of as many tiles: the two tiles of one N column (128-row
 * halves of a 256-row block) need the same B tile when their rows belong to the same expert, and
 * the cn tiles of one M row always need the same A tile. Each CTA's producer loads its part of a
 * shared tile and multicasts it to the CTAs that share it, which cuts L2 -> SM traffic per FLOP (by
 * a third at 2 x 1, by half at 2 x 2). A stage may be refilled only when the consumers of every CTA
 * of the cluster have released it, so every consumer releases its stage in all of them (empty
 * barriers count 2 cn CTAs x 2 warpgroups), and the CTAs walk their pipelines in lockstep: a CTA
 * without a tile of its own (an odd last M or N tile) runs the k-loop as a "phantom", taking part
 * in the barriers but loading and computing nothing, and its neighbours load their tiles whole. The
 * cluster shape is a compile-time constant: read from the arguments at run time instead, the same
 * kernels ran the backward 14 % (2 x 1) and 35 % (2 x 2) slower (perf-log 2026-12-03).
 *
 * Shared memory (gemm_smem) is 128B-swizzled, as TMA writes it and wgmma reads it:
 *   A, K-major:  [128 rows][64 k]           (cn boxes, one per CTA of the M row)
 *   A, MN-major: 2 x [64 k][64 m]           (consumer w reads box w)
 *   B, K-major:  [256 rows][64 k]           (two boxes of 128 rows, one per CTA of the column)
 *   B, MN-major: 4 x [64 k][64 n]           (LBO = 8 KB between the 64-wide n blocks)
 * The epilogues write from registers: a quad of threads exchanges its words so that each thread
 * stores 16 contiguous bytes (quad_transpose), which fills whole sectors with no shared memory and
 * no barrier, and lets routed rows scatter to their slots.
 *
 * Determinism: each output element is one accumulator summed over K in ascending k-blocks; no
 * split-K, no order-dependent atomics; the tile order, cluster shape and grid size change no bit.
 */
#ifndef MOK_GEMM_CUH
#define MOK_GEMM_CUH

#include <cuda_bf16.h>

#include "cuda/kernels.h"
#include "cuda/ptx.cuh"

/* The kernels trap on any other architecture (the fatbin holds sm_90a code only). */
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ == 900
#define GEMM_ARCH_OK 1
#else
#define GEMM_ARCH_OK 0
#endif

#define GEMM_A_BYTES (GEMM_BM * GEMM_BK * 2)   /* 16 KB */
#define GEMM_B_BYTES (GEMM_BN * GEMM_BK * 2)   /* 32 KB */

typedef struct gemm_smem {
  alignas(1024) __nv_bfloat16 a[GEMM_STAGES][GEMM_BM * GEMM_BK];
  alignas(1024) __nv_bfloat16 b[GEMM_STAGES][GEMM_BN * GEMM_BK];
  uint64_t full[GEMM_STAGES];   /* TMA landed: own producer's arrive + tx bytes */
  uint64_t empty[GEMM_STAGES];  /* released by both consumers of every CTA of the cluster */
} gemm_smem;

/* Dynamic shared memory is only 16-byte aligned; ask for 1 KB more and align by hand. */
#define GEMM_SMEM_BYTES (sizeof(gemm_smem) + 1024)

/* ---- tile scheduling ------------------------------------------------------------------------ */
/* A cluster of GEMM_CM x cn CTAs (cn = 1 or 2, a compile-time constant of each kernel) takes
 * blocks of as many tiles: CTA rank r computes M tile 2 mb + r % 2 and N tile cn nb + r / 2 of
 * block (mb, nb). */
typedef struct gemm_tile {
  int m0, n0;   /* first output row and column of this CTA's tile */
  int expert;   /* local expert (0 for the shared expert) */
  int k_row0;   /* weight gradients: first row of the expert's K range */
  int k_blocks; /* number of BK-wide k-blocks (the same for every CTA of the block) */
  int valid;    /* 0: phantom, this CTA has no tile in the block */
  int b_shared; /* both tiles of this CTA's N column exist and use the same B: multicast it */
  int a_shared; /* cn = 2 and both tiles of this CTA's M row exist: multicast A */
} gemm_tile;

static_assert(GEMM_CM == 2, "the B halves, masks and expert pairs below assume clusters 2 tall");
MOK_DEV int rank_m(int rank) { return rank % GEMM_CM; }
MOK_DEV int rank_n(int rank) { return rank / GEMM_CM; }
/* The CTAs that receive this CTA's part of B (its N column) and of A (its M row). */
MOK_DEV uint16_t b_mask(int rank) { return (uint16_t)(3 << (GEMM_CM * rank_n(rank))); }
MOK_DEV uint16_t a_mask(int rank) {
  return (uint16_t)(1 << rank_m(rank) | 1 << (rank_m(rank) + GEMM_CM));
}

/* The order of the tiles: the CTAs running at one time should share their operands in L2. Going
 * along N first, 132 CTAs would cover one or two M tiles of a wide product (mixtral's gate/up has
 * 112 N tiles) and stream all of B from HBM once per M tile. So the blocks are taken in groups of
 * TILE_GROUP M tiles, and within a group M goes first: concurrent CTAs cover about 16 x 8 tiles,
 * each B tile is read once per group. Block q of a space of mb_count x nb_count blocks is
 * (mb, nb). */
#define TILE_GROUP 16
MOK_DEV void tile_order(int q, int mb_count, int nb_count, int *mb, int *nb) {
  const int gp = TILE_GROUP / GEMM_CM;        /* M blocks per group */
  const int first = q / (gp * nb_count) * gp; /* first M block of q's group */
  const int rows = min(gp, mb_count - first);
  const int r = q - first * nb_count;
  *mb = first + r % rows;
  *nb = r / rows;
}

MOK_DEV int ceil_div_dev(int a, int b) { return (a + b - 1) / b; }

/* The words of the schedule a product's tile lookups read, kept across its tiles by each side
 * (producer, consumers): the schedule does not change during a product, but the epilogues' stores
 * might alias it, so the compiler loads it again every tile, and each load stood before the tile
 * for most of a memory latency (tile clock, 2026-12-04 at 4de57f7). */
typedef struct tile_memo {
  int m_tiles;                /* row-grouped: offsets[experts] / BM; -1 until loaded */
  int expert, k_row0, k_rows; /* weight gradients: the last tile's expert (-1: none), its rows */
} tile_memo;
#define TILE_MEMO_INIT {-1, -1, 0, 0}

/* Row-grouped products: M tiles over routed rows, N tiles of width `bn_out`. */
MOK_DEV int rowgroup_m_tiles(const gemm_args *g, tile_memo *memo) {
  if (!g->offsets) return g->m_tiles_max;
  if (memo->m_tiles < 0) memo->m_tiles = g->offsets[g->experts] / GEMM_BM;
  return memo->m_tiles;
}

MOK_DEV int rowgroup_block_count(const gemm_args *g, int bn_out, int cn, tile_memo *memo) {
  return gemm_blocks(rowgroup_m_tiles(g, memo), g->n, bn_out, cn);
}

MOK_DEV gemm_tile rowgroup_tile(const gemm_args *g, int q, int bn_out, int rank, int cn,
                                tile_memo *memo, int bk = GEMM_BK) {
  const int n_tiles = ceil_div_dev(g->n, bn_out), m_tiles = rowgroup_m_tiles(g, memo);
  int mb, nb;
  tile_order(q, ceil_div_dev(m_tiles, GEMM_CM), ceil_div_dev(n_tiles, cn), &mb, &nb);
  const int m_first = GEMM_CM * mb, mt = m_first + rank_m(rank);
  const int n_first = cn * nb, nt = n_first + rank_n(rank);
  gemm_tile r;
  r.m0 = mt * GEMM_BM;
  r.n0 = nt * bn_out;
  r.valid = mt < m_tiles && nt < n_tiles;
  const int e0 = g->mblock_expert ? g->mblock_expert[m_first] : 0;
  int e1 = -1;
  if (m_first + 1 < m_tiles) e1 = g->mblock_expert ? g->mblock_expert[m_first + 1] : 0;
  r.b_shared = e1 == e0 && nt < n_tiles;
  r.a_shared = cn == 2 && n_first + 1 < n_tiles && mt < m_tiles;
  r.expert = rank_m(rank) ? e1 : e0;
  r.k_row0 = 0;
  r.k_blocks = g->k / bk; /* k: a multiple of bk (FP8 products round theirs up) */
  return r;
}

/* Weight-gradient products: every expert has the same output tiles; K = its routed rows, rounded
 * up to a k-block (up to 63 padding rows walked, zeros in both operands). The padding past that,
 * 64 rows of an expert or none, adds nothing and is not walked: 11.5 % of gpt-oss-120b's rows are
 * padding, about half a k-block an expert. offsets and counts come from the same schedule; after
 * a capacity overflow only counts is written, and the status word stops the kernel first. */
MOK_DEV int wgrad_block_count(const gemm_args *g, int cn) {
  return g->experts * gemm_blocks(g->m_tiles_max, g->n, GEMM_BN, cn);
}

MOK_DEV gemm_tile wgrad_tile(const gemm_args *g, int q, int rank, int cn, tile_memo *memo,
                             int bk = GEMM_BK) {
  const int n_tiles = ceil_div_dev(g->n, GEMM_BN), m_tiles = g->m_tiles_max;
  const int mb_count = ceil_div_dev(m_tiles, GEMM_CM), nb_count = ceil_div_dev(n_tiles, cn);
  gemm_tile r;
  r.expert = q / (mb_count * nb_count);
  int mb, nb;
  tile_order(q - r.expert * mb_count * nb_count, mb_count, nb_count, &mb, &nb);
  const int mt = GEMM_CM * mb + rank_m(rank), nt = cn * nb + rank_n(rank);
  r.m0 = mt * GEMM_BM;
  r.n0 = nt * GEMM_BN;
  r.valid = mt < m_tiles && nt < n_tiles;
  r.b_shared = GEMM_CM * mb + 1 < m_tiles && nt < n_tiles;
  r.a_shared = cn == 2 && cn * nb + 1 < n_tiles && mt < m_tiles;
  if (g->offsets) {
    if (memo->expert != r.expert) { /* a CTA's next tile often has the same expert */
      memo->expert = r.expert;
      memo->k_row0 = g->offsets[r.expert];
      memo->k_rows = g->counts[r.expert];
    }
    r.k_row0 = memo->k_row0;
    r.k_blocks = ceil_div_dev(memo->k_rows, bk);
  } else {
    r.k_row0 = 0;
    r.k_blocks = (g->k + bk - 1) / bk;
  }
  return r;
}

/* ---- the pipeline ---------------------------------------------------------------------------- */
/* Pipeline position shared by producer and consumers (and by every CTA of the cluster):
 * iteration i uses stage i % STAGES and waits for phase parity (i / STAGES) & 1. */
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

/* One thread per consumer warpgroup frees stage s in every CTA of the cluster (`ctas`, a
 * compile-time constant). SM: gemm_smem (bf16) or gemm8_smem (FP8). */
template <class SM> MOK_DEV void stage_release(SM *sm, int s, int ctas) {
  if (threadIdx.x % 128 == 0) {
#pragma unroll
    for (int r = 0; r < ctas; r++) mbarrier_arrive_cluster(mapa_shared(&sm->empty[s], r));
  }
}

/* Consumer warpgroup `cw` (0 or 1) multiplies its 64 rows over the tile's k-blocks.
 * ctas: of the cluster; a_mn / b_mn: whether A / B lie MN-major in shared memory (all three
 * compile-time constants). */
MOK_DEV void gemm_consume(gemm_smem *sm, gemm_pipe *p, int k_blocks, int ctas, int cw, int a_mn,
                          int b_mn, float *d) {
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
    if (prev >= 0) stage_release(sm, prev, ctas);
    prev = s;
  }
  wgmma_wait_group<0>();
  acc_fence(d);
  if (prev >= 0) stage_release(sm, prev, ctas);
}

/* A CTA without a tile in the block keeps its pipeline in step with the cluster's. Only thread 0
 * releases, so the warpgroup meets at a barrier first: otherwise warps 1-3, which no wgmma ties
 * to warp 0 here, can fall two phases behind on full[s] and later wait, with the right parity,
 * for phases that never come (the 2-CTA hang of perf-log 2026-12-02). */
template <class SM>
MOK_DEV void gemm_consume_phantom(SM *sm, gemm_pipe *p, int k_blocks, int ctas, int cw) {
  for (int kb = 0; kb < k_blocks; kb++, p->it++) {
    int s = (int)(p->it % GEMM_STAGES);
    mbarrier_wait_parity(&sm->full[s], (p->it / GEMM_STAGES) & 1);
    named_barrier_sync(1 + cw, 128);
    stage_release(sm, s, ctas);
  }
}

/* Producer: waits until stage s is free in every CTA of the cluster. Returns s. For a real tile
 * it announces the bytes that will land in this CTA's stage (`bytes`: all of A and B, parts of
 * them from its peers when shared, and FP8's scales); for a phantom it just arrives. */
template <class SM>
MOK_DEV int gemm_produce_begin(SM *sm, gemm_pipe *p, int valid, uint32_t bytes) {
  int s = (int)(p->it % GEMM_STAGES);
  if (p->it >= GEMM_STAGES)
    mbarrier_wait_parity(&sm->empty[s], ((p->it / GEMM_STAGES) - 1) & 1);
  if (valid)
    mbarrier_arrive_expect_tx(&sm->full[s], bytes);
  else
    mbarrier_arrive(&sm->full[s]);
  return s;
}

/* ---- kernel prologue and end ----------------------------------------------------------------- */
template <class SM = gemm_smem> MOK_DEV SM *gemm_smem_init(char *raw, int ctas) {
  SM *sm = (SM *)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
  if (threadIdx.x == 0) {
    for (int s = 0; s < GEMM_STAGES; s++) {
      mbarrier_init(&sm->full[s], 1);
      mbarrier_init(&sm->empty[s], 2 * ctas);
    }
    fence_mbarrier_init();
  }
  cluster_sync(); /* the peers' barriers exist before anyone arrives on them */
  return sm;
}

/* ---- epilogue: accumulator layout and row stores --------------------------------- */
/* The m64n256 accumulator layout (PTX ISA 9.7.15.5.2, "Matrix fragments for wgmma.m64nNk16"):
 * thread l of warp q holds rows 16q + l/4 and 16q + l/4 + 8; for each 8-column group j,
 * d[4j + 0..1] are columns 8j + 2(l%4) + {0,1} of the first row, d[4j + 2..3] of the second. */
typedef struct acc_pos {
  int row;   /* first of the thread's two rows, relative to the warpgroup's 64 rows */
  int col;   /* column of d[0] relative to the tile; group j adds 8j */
} acc_pos;

MOK_DEV acc_pos acc_position(void) {
  int t = threadIdx.x % 128;
  acc_pos p;
  p.row = (t / 32) * 16 + (t % 32) / 4;
  p.col = (t % 4) * 2;
  return p;
}

MOK_DEV uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *(uint32_t *)&v;
}

/* exp and the reciprocal by the hardware approximations (ex2.approx, rcp.approx: a few ulp). An
 * IEEE division here cost a slow-path check and branch per element, and made the SwiGLU
 * epilogues, not the k-loop, the larger part of the down-dgrad kernel (perf-log 2026-12-02).
 * The .ftz forms (ptx.cuh says what they save) change no bit: exp(-z) below 2^-126 only ever
 * meets 1 + exp(-z). 1 + exp(-z) = inf gives 0, as the exact formula does. */
#define MOK_LOG2E 1.4426950408889634f
MOK_DEV float sigmoid_f(float z) { return rcp_approx_ftz(1.0f + ex2_approx_ftz(-z * MOK_LOG2E)); }
MOK_DEV float silu_f(float z) { return z * sigmoid_f(z); }

/* The four threads of a quad hold, for one row, 8-column groups 4b..4b+3 as bf16 pairs: thread t
 * has columns 8j + 2t, 8j + 2t + 1 of each group j. Two xor exchanges transpose that 4 x 4 block
 * of words, after which thread t holds all 8 columns of group 4b + t: one 16-byte store each, 64
 * contiguous bytes per quad, whole sectors. */
MOK_DEV void quad_transpose(uint32_t w[4]) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int s = 1; s <= 2; s <<= 1) {
    const bool hi_is_mine = t & s;
#pragma unroll
    for (int lo = 0; lo < 4; lo++) {
      if (lo & s) continue;
      const uint32_t send = hi_is_mine ? w[lo] : w[lo | s];
      const uint32_t recv = __shfl_xor_sync(0xffffffffu, send, s);
      if (hi_is_mine) w[lo] = recv;
      else w[lo | s] = recv;
    }
  }
}

/* store_bf16_own stores a thread's 16 bytes v, bf16 columns col.. of `row` (NULL or columns
 * >= n: nothing); store_bf16_quad the quad's words v (groups 4b.. of a row, as above) at
 * columns col0 + 8t.., and every thread of the warp must call it. last: nothing in this launch
 * reads the rows again, so they are stored evict-first (st.global.cs) and leave L2 to the
 * operands that are read again. */
MOK_DEV void store_bf16_own(char *row, int col, int n, const uint32_t v[4], int last) {
  if (!row || col >= n) return;
  uint4 *p = (uint4 *)(row + (size_t)col * 2);
  const uint4 x = make_uint4(v[0], v[1], v[2], v[3]);
  if (last) __stcs(p, x);
  else *p = x;
}

MOK_DEV void store_bf16_quad(char *row, int col0, int n, uint32_t v[4], int last) {
  quad_transpose(v);
  store_bf16_own(row, col0 + 8 * (threadIdx.x % 4), n, v, last);
}

/* Row half h of the accumulators, groups j0 .. j0 + 4 * blocks - 1, as bf16 at columns
 * col0 + 8(j - j0).. of `row` (NULL: nothing, but the quad exchange still runs). */
MOK_DEV void store_bf16_row(char *row, int col0, int n, const float *d, int h, int j0,
                            int blocks, int last) {
#pragma unroll
  for (int b = 0; b < blocks; b++) {
    uint32_t v[4];
#pragma unroll
    for (int jo = 0; jo < 4; jo++) {
      const float *x = d + 4 * (j0 + 4 * b + jo) + 2 * h;
      v[jo] = pack_bf16x2(x[0], x[1]);
    }
    store_bf16_quad(row, col0 + 32 * b, n, v, last);
  }
}

/* Row half h of the accumulators as fp32 at columns col0.. of `row`: a quad writes 32 contiguous
 * bytes per group. add: out += acc by the memory system (one add per element). */
MOK_DEV void store_f32_row(float *row, int col0, int n, const float *d, int h, int add) {
  if (!row) return;
  const acc_pos p = acc_position();
#pragma unroll
  for (int j = 0; j < 32; j++) {
    const int col = col0 + 8 * j + p.col;
    if (col >= n) break;
    const float2 v = make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
    if (add) atomicAdd((float2 *)(row + col), v);
    else *(float2 *)(row + col) = v;
  }
}

/* ---- FP8 (DESIGN §8.2) ---------------------------------------------------------------------- */
/* The same pipeline and tiles, with e4m3 operands: a k-block is 128 of K (one 128-byte swizzle
 * row, as a bf16 k-block of 64), and each stage also holds A's scales for the block's 128 rows
 * (and, for the weight gradients, B's for its 256 rows), which TMA brings with the tile. */
#define GEMM8_BK 128
typedef struct gemm8_smem {
  alignas(1024) uint8_t a[GEMM_STAGES][GEMM_BM * GEMM8_BK];
  alignas(1024) uint8_t b[GEMM_STAGES][GEMM_BN * GEMM8_BK];
  alignas(128) float sa[GEMM_STAGES][GEMM_BM]; /* A's scale of each row for this k-block */
  alignas(128) float sb[GEMM_STAGES][GEMM_BN]; /* BSCALE_ROWS: B's scale of each row */
  uint64_t full[GEMM_STAGES];
  uint64_t empty[GEMM_STAGES];
} gemm8_smem;
#define GEMM8_SMEM_BYTES (sizeof(gemm8_smem) + 1024)
#define GEMM8_A_BYTES (GEMM_BM * GEMM8_BK + GEMM_BM * 4) /* codes and scales of A */
#define GEMM8_B_BYTES (GEMM_BN * GEMM8_BK)
#define GEMM8_SB_BYTES (GEMM_BN * 4)

/* How B is scaled: a weight's 128 x 128 blocks (one scale per half of the tile and k-block, read
 * from global memory by the consumers: `bscale`), or one scale per B row and k-block (the
 * weight gradients' activations, in the stage with the tile). */
enum { BSCALE_BLOCK, BSCALE_ROWS };

/* Consumer warpgroup `cw`: its 64 rows x 256 columns over the tile's k-blocks into d. A k-block
 * runs as two halves of 128 columns, four m64n128k32 wgmma each into tmp, which is promoted into
 * d at once: d += tmp * (s_A[row] * s_B). The halves take 64 registers of partial sums where a
 * whole m64n256 tile would need 128 beside d's 128; while one warpgroup promotes, the other's
 * wgmma keep the tensor cores busy. BSCALE_BLOCK: bscale(h, kb) gives half h's scale at k-block
 * kb (a functor, called before the stage is waited for, so its load overlaps the wait). */
template <int BSCALE, class BS>
MOK_DEV void gemm8_consume(gemm8_smem *sm, gemm_pipe *p, int k_blocks, int ctas, int cw,
                           const BS &bscale, float *d) {
  acc_zero(d);
  const acc_pos ps = acc_position();
  const int r0 = cw * 64 + ps.row;
  float tmp[64];
  for (int kb = 0; kb < k_blocks; kb++, p->it++) {
    const int s = (int)(p->it % GEMM_STAGES);
    float sbw[2] = {1.0f, 1.0f};
    if (BSCALE == BSCALE_BLOCK) sbw[0] = bscale(0, kb), sbw[1] = bscale(1, kb);
    mbarrier_wait_parity(&sm->full[s], (p->it / GEMM_STAGES) & 1);
    const float sa0 = ld_shared_f32(&sm->sa[s][r0]), sa1 = ld_shared_f32(&sm->sa[s][r0 + 8]);
    const uint8_t *a = sm->a[s] + cw * 64 * GEMM8_BK, *b = sm->b[s];
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
      for (int i = 0; i < 64; i++) fence_operand(tmp[i]);
      wgmma_fence();
      /* tmp is not read by the first wgmma (accumulate = 0), so it needs no zeroing */
#pragma unroll
      for (int kk = 0; kk < GEMM8_BK / 32; kk++) /* k32 steps are 32 bytes into the rows */
        wgmma_128_e4m3(tmp, smem_desc_sw128(a + kk * 32, 16, 1024),
                       smem_desc_sw128(b + h * 128 * GEMM8_BK + kk * 32, 16, 1024), kk > 0);
      wgmma_commit_group();
      wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < 64; i++) fence_operand(tmp[i]);
      float *dh = d + 64 * h; /* m64n128's fragment is groups 16h.. of m64n256's (acc_position) */
      if (BSCALE == BSCALE_BLOCK) {
        const float s0 = sa0 * sbw[h], s1 = sa1 * sbw[h];
#pragma unroll
        for (int j = 0; j < 16; j++) {
          dh[4 * j] = fmaf(tmp[4 * j], s0, dh[4 * j]);
          dh[4 * j + 1] = fmaf(tmp[4 * j + 1], s0, dh[4 * j + 1]);
          dh[4 * j + 2] = fmaf(tmp[4 * j + 2], s1, dh[4 * j + 2]);
          dh[4 * j + 3] = fmaf(tmp[4 * j + 3], s1, dh[4 * j + 3]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 16; j++) { /* columns 8j + col, + 1 of the half */
          const float2 sb = ld_shared_f32x2(&sm->sb[s][128 * h + 8 * j + ps.col]);
          dh[4 * j] = fmaf(tmp[4 * j], sa0 * sb.x, dh[4 * j]);
          dh[4 * j + 1] = fmaf(tmp[4 * j + 1], sa0 * sb.y, dh[4 * j + 1]);
          dh[4 * j + 2] = fmaf(tmp[4 * j + 2], sa1 * sb.x, dh[4 * j + 2]);
          dh[4 * j + 3] = fmaf(tmp[4 * j + 3], sa1 * sb.y, dh[4 * j + 3]);
        }
      }
    }
    stage_release(sm, s, ctas); /* the stage's codes and scales are all read */
  }
}

#endif /* MOK_GEMM_CUH */
