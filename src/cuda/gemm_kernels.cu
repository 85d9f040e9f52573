/*
 * gemm_kernels.cu: the five products of the layer on the engine of gemm.cuh (the forward's two
 * as phases of its layer launch, layer_forward, with dispatch and combine; the backward's one
 * kernel each):
 *   fwd_gateup   [rows, H] x [gate | up]^T  -> gu, hw = w * silu(g) * u      (A, B K-major)
 *   fwd_down     [rows, I] x W_down^T       -> slot rows / fp32 rows          (A, B K-major)
 *   dgrad_down   [rows, H] x W_down         -> dgu (SwiGLU backward), router-gradient partials
 *                                                                              (B MN-major)
 *   dgrad_gateup [rows, 2I] x [W_gate; W_up] -> slot rows / fp32 rows         (B MN-major)
 *   wgrad        per expert: A^T B over its rows -> weight gradient           (A, B MN-major)
 * Every kernel has the same order: error-word check, shared memory and barriers, then the
 * producer warpgroup (TMA) and two consumer warpgroups (wgmma + epilogue), persistent over blocks
 * of 2 x cn tiles, launched as clusters of 2 x cn CTAs; each is compiled for cn = 1 and 2.
 */
#include "cuda/gemm_epi.cuh"
#include "cuda/rows.cuh"
#include "cuda/tile_clock.cuh"

/* ---- combine beside the last weight gradient ------------------------------------------------ */
/* The producer warpgroup's warps 1-3 of the backward's last weight gradient (kernels.h) combine
 * dx while the consumers compute: the slot rows and the shared expert's rows are complete at
 * that launch's start, so the 16-byte vectors of dx are split among the grid's combine lanes
 * with no synchronisation, and each sum is combine_vecs' (the same bits). A lane copies its
 * vector's k slot pieces and its 32 bytes of base to shared memory (cp.async: bytes in flight
 * without registers, which the producer warpgroup has 40 of) and copies its next vector's while
 * it adds these up. A warp's buffer: piece j of lane l at 512 j + 16 l, then base at 32 l. */
#define WC_BASE (GEMM_COMBINE_K * 32 * 16)
#define WC_BUF (WC_BASE + 32 * 32)
static_assert(GEMM_COMBINE_SMEM == 3 * 2 * WC_BUF, "kernels.h's GEMM_COMBINE_SMEM");

MOK_DEV void wc_issue(const combine_args *c, char *buf, int lane, size_t i, int vecs) {
  const size_t t = i / vecs, v = i - t * vecs;
  const __nv_bfloat16 *src = c->slots + (t * c->k * vecs + v) * 8;
  for (int j = 0; j < c->k; j++)
    cp_async_16(buf + j * 512 + lane * 16, src + (size_t)j * vecs * 8);
  if (c->base) {
    const float *base = c->base + i * 8; /* vector i of [T, H]: row t, columns 8v.. */
    cp_async_16(buf + WC_BASE + lane * 32, base);
    cp_async_16(buf + WC_BASE + lane * 32 + 16, base + 4);
  }
  cp_async_commit();
}

MOK_DEV void wc_work(const combine_args *c, char *stage) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32 - 1, vecs = c->H / 8;
  const size_t n = (size_t)c->T * vecs, stride = (size_t)gridDim.x * 3 * 32;
  char *bufs = stage + w * 2 * WC_BUF; /* this warp's two buffers */
  size_t i = ((size_t)blockIdx.x * 3 + w) * 32 + lane;
  if (i < n) wc_issue(c, bufs, lane, i, vecs);
  for (int b = 0; i < n; i += stride, b ^= 1) {
    if (i + stride < n) {
      wc_issue(c, bufs + (b ^ 1) * WC_BUF, lane, i + stride, vecs);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    const char *buf = bufs + b * WC_BUF;
    float acc[8];
    if (c->base) {
      const uint4 lo = ld_shared_u4(buf + WC_BASE + lane * 32);
      const uint4 hi = ld_shared_u4(buf + WC_BASE + lane * 32 + 16);
      acc[0] = __uint_as_float(lo.x), acc[1] = __uint_as_float(lo.y);
      acc[2] = __uint_as_float(lo.z), acc[3] = __uint_as_float(lo.w);
      acc[4] = __uint_as_float(hi.x), acc[5] = __uint_as_float(hi.y);
      acc[6] = __uint_as_float(hi.z), acc[7] = __uint_as_float(hi.w);
    } else {
#pragma unroll
      for (int e = 0; e < 8; e++) acc[e] = 0.0f;
    }
    for (int j = 0; j < c->k; j++) {
      const uint4 raw = ld_shared_u4(buf + j * 512 + lane * 16);
      combine_add(acc, make_int4((int)raw.x, (int)raw.y, (int)raw.z, (int)raw.w));
    }
    ((int4 *)c->out)[i] = combine_pack(acc);
  }
}

/* ---- kernels -------------------------------------------------------------------------------- */
/* The pieces every kernel is made of (macros, not function templates: each kernel reads top to
 * bottom with its own loads and epilogue; the kernels are templates over one int only, CN: their
 * clusters are 2 x CN CTAs). GEMM_SETUP: shared memory, its barriers and the pipeline position,
 * which runs on through every product of a launch. For the product of `g` (a gemm_args in
 * scope): GEMM_PRODUCE, by thread 0, the TMA loads (`LOAD`: k-block kb into stage s, with sa, sb,
 * bar) of its `COUNT` blocks of tiles (`TILE`: block q's tile for this CTA); GEMM_CONSUME, by
 * each consumer warpgroup, the k-loops and the epilogue `EPI`. */
#define GEMM_SETUP                                                                           \
  extern __shared__ char smem_raw[];                                                         \
  if (!GEMM_ARCH_OK) { __trap(); }                                                           \
  const int ctas = GEMM_CM * CN;                                                             \
  gemm_smem *sm = gemm_smem_init(smem_raw, ctas);                                            \
  const int rank = (int)cluster_ctarank();                                                   \
  gemm_pipe pipe = {0};                                                                      \
  TCLK(int tclk_product = 0;)

#define GEMM_PRODUCE(COUNT, TILE, LOAD)                                                      \
  {                                                                                          \
    prefetch_tensormap(&g.a);                                                                \
    prefetch_tensormap(&g.b0);                                                               \
    tile_memo memo = TILE_MEMO_INIT; /* COUNT and TILE read and fill it */                   \
    const int total = COUNT;                                                                 \
    TCLK(TCLK_PSTART)                                                                        \
    for (int q = blockIdx.x / ctas; q < total; q += gridDim.x / ctas) {                      \
      gemm_tile tl = TILE;                                                                   \
      for (int kb = 0; kb < tl.k_blocks; kb++, pipe.it++) {                                  \
        TCLK(const unsigned pw0 = tclk_now();)                                               \
        int s = gemm_produce_begin(sm, &pipe, tl.valid, GEMM_A_BYTES + GEMM_B_BYTES);       \
        TCLK(p_wait += tclk_now() - pw0;)                                                    \
        if (!tl.valid) continue;                                                             \
        uint64_t *bar = &sm->full[s];                                                        \
        char *sa = (char *)sm->a[s], *sb = (char *)sm->b[s];                                \
        LOAD;                                                                                \
      }                                                                                      \
      TCLK(if (q + gridDim.x / ctas >= total) TCLK_PFLUSH(tclk_product);)                   \
    }                                                                                        \
  }

#define GEMM_CONSUME(COUNT, TILE, A_MN, B_MN, EPI)                                           \
  {                                                                                          \
    tile_memo memo = TILE_MEMO_INIT; /* COUNT and TILE read and fill it */                   \
    const int total = COUNT;                                                                 \
    TCLK(TCLK_START)                                                                         \
    for (int q = blockIdx.x / ctas; q < total; q += gridDim.x / ctas) {                      \
      gemm_tile tl = TILE;                                                                   \
      if (!tl.valid) {                                                                       \
        gemm_consume_phantom(sm, &pipe, tl.k_blocks, ctas, cw);                              \
        TCLK(if (q + gridDim.x / ctas >= total) TCLK_FLUSH(tclk_product);)                  \
        continue;                                                                            \
      }                                                                                      \
      TCLK(const unsigned t0 = tclk_now(); c_gap += t0 - t_last;)                            \
      gemm_consume(sm, &pipe, tl.k_blocks, ctas, cw, A_MN, B_MN, d);                         \
      TCLK(const unsigned t1 = tclk_now(); c_kloop += t1 - t0;)                              \
      EPI(&g, &tl, cw, d);                                                                   \
      TCLK(t_last = tclk_now(); c_epi += t_last - t1; c_tiles++; c_kb += tl.k_blocks;        \
           if (q + gridDim.x / ctas >= total) TCLK_FLUSH(tclk_product);)                    \
    }                                                                                        \
  }

/* One product, the kernel's parameter g. IDLE: what the producer warpgroup's other threads do. */
#define GEMM_KERNEL_BODY(COUNT, TILE, LOAD, A_MN, B_MN, EPI, IDLE)                          \
  if (*g.status) return; /* the same word for every CTA: the whole grid leaves */            \
  GEMM_SETUP                                                                                 \
  if (threadIdx.x / 128 == 0) {                                                              \
    setmaxnreg_dec<40>();                                                                    \
    if (threadIdx.x == 0) GEMM_PRODUCE(COUNT, TILE, LOAD)                                    \
    else IDLE;                                                                               \
  } else {                                                                                   \
    setmaxnreg_inc<232>();                                                                   \
    const int cw = threadIdx.x / 128 - 1;                                                    \
    float d[128];                                                                            \
    GEMM_CONSUME(COUNT, TILE, A_MN, B_MN, EPI)                                               \
  }                                                                                          \
  cluster_sync(); /* peers may still multicast into us or release our stages */

#define KERNEL template <int CN> __global__ void __launch_bounds__(GEMM_THREADS, 1)

/* A row-grouped product's COUNT and TILE, of tiles `BN` wide (the product's gemm_args g, the
 * block q, and the side's memo in scope). */
#define ROWGROUP_COUNT(BN) rowgroup_block_count(&g, BN, CN, &memo)
#define ROWGROUP_TILE(BN) rowgroup_tile(&g, q, BN, rank, CN, &memo)

/* A [rows, H] K-major; B[n = i, k = h] = W_down[e][h, i]: MN-major boxes [64 h][64 i]. */
KERNEL gemm_dgrad_down(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(ROWGROUP_COUNT(GEMM_BN), ROWGROUP_TILE(GEMM_BN),
                   (load_a_kmajor(&g, sa, bar, &tl, rank, CN, kb * 64),
                    load_b_mn<true>(sb, bar, &tl, rank, &g.b0, kb * 64, tl.expert)),
                   0, 1, epi_swiglu_bwd, (void)0)
}

/* B[n = h, k = c] = [W_gate; W_up][e][c, h] for k-block kb: from W_gate while c < I. */
MOK_DEV void load_gateup_mn(const gemm_args *g, char *sb, uint64_t *bar,
                            const gemm_tile *tl, int rank, int kb) {
  int c = kb * 64;
  const CUtensorMap *map = c < g->k_split ? &g->b0 : &g->b1;
  load_b_mn<true>(sb, bar, tl, rank, map, c < g->k_split ? c : c - g->k_split, tl->expert);
}

/* A [rows, 2I] K-major (dgu); B from W_gate then W_up, MN-major. */
KERNEL gemm_dgrad_gateup(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(ROWGROUP_COUNT(GEMM_BN), ROWGROUP_TILE(GEMM_BN),
                   (load_a_kmajor(&g, sa, bar, &tl, rank, CN, kb * 64),
                    load_gateup_mn(&g, sb, bar, &tl, rank, kb)),
                   0, 1, epi_rows, (void)0)
}

/* The forward after the schedule as phases of one launch (layer_fwd), a grid barrier where a
 * kernel boundary was: dispatch by every warp; gate/up (A and B K-major, the SwiGLU epilogue);
 * down (A and B K-major, rows to their slots; it reads hw, which gate/up wrote); combine by the
 * consumer threads (the producer warpgroup keeps 40 registers). One pipeline runs on through
 * the products. */
#define FWD_GATEUP_TILE ROWGROUP_TILE(GEMM_BN_GATEUP)
#define FWD_GATEUP_LOAD                                                                      \
  (load_a_kmajor(&g, sa, bar, &tl, rank, CN, kb * 64),                                       \
   load_b_kmajor(sb, bar, &tl, rank, &g.b0, tl.n0, &g.b1, tl.n0, kb * 64))
#define FWD_DOWN_TILE ROWGROUP_TILE(GEMM_BN)
#define FWD_DOWN_LOAD                                                                        \
  (load_a_kmajor(&g, sa, bar, &tl, rank, CN, kb * 64),                                       \
   load_b_kmajor(sb, bar, &tl, rank, &g.b0, tl.n0, &g.b0, tl.n0 + 128, kb * 64))
#define PRODUCE_FWD_GATEUP                                                                   \
  GEMM_PRODUCE(ROWGROUP_COUNT(GEMM_BN_GATEUP), FWD_GATEUP_TILE, FWD_GATEUP_LOAD)
#define CONSUME_FWD_GATEUP                                                                   \
  GEMM_CONSUME(ROWGROUP_COUNT(GEMM_BN_GATEUP), FWD_GATEUP_TILE, 0, 0, epi_swiglu_fwd)
#define PRODUCE_FWD_DOWN                                                                     \
  GEMM_PRODUCE(ROWGROUP_COUNT(GEMM_BN), FWD_DOWN_TILE, FWD_DOWN_LOAD)
#define CONSUME_FWD_DOWN                                                                     \
  GEMM_CONSUME(ROWGROUP_COUNT(GEMM_BN), FWD_DOWN_TILE, 0, 0, epi_rows)
/* The products in order, by one side (the threads where WHO holds; PRODUCE or CONSUME: both
 * walk the same ones): gate/up (p[0], the shared expert's p[1]), then every thread at a grid
 * barrier, then down (p[2], p[3]) and a grid barrier before combine; a recompute stops after
 * gate/up. */
#define FWD_PRODUCTS(WHO, SIDE)                                                              \
  for (int i = 0; i < 2; i++) {                                                              \
    if (WHO) {                                                                               \
      for (int j = 2 * i; j < 2 * i + 1 + f.shared; j++) {                                   \
        const gemm_args &g = f.p[j];                                                         \
        TCLK(tclk_product = j;)                                                              \
        if (i == 0) SIDE##_FWD_GATEUP else SIDE##_FWD_DOWN                                   \
      }                                                                                      \
    }                                                                                        \
    if (i == 0 && !f.down) break;                                                            \
    grid_sync(f.sync, GEMM_THREADS);                                                         \
  }
#define WARPS (GEMM_THREADS / 32)

KERNEL layer_forward(const __grid_constant__ layer_fwd f) {
  if (*f.p[0].status) return; /* one word for every phase and CTA: the whole grid leaves */
  GEMM_SETUP
  if (blockIdx.x == 0 && threadIdx.x == 0) dispatch_marks(&f.d);
  dispatch_warp<6, 2, false>(&f.d, blockIdx.x * WARPS + threadIdx.x / 32, gridDim.x * WARPS);
  grid_sync(f.sync, GEMM_THREADS);
  if (threadIdx.x / 128 == 0) {
    setmaxnreg_dec<40>();
    FWD_PRODUCTS(threadIdx.x == 0, PRODUCE)
  } else {
    setmaxnreg_inc<232>();
    const int cw = threadIdx.x / 128 - 1;
    float d[128];
    FWD_PRODUCTS(true, CONSUME)
    if (f.combine) {
      const size_t n = (size_t)f.c.T * (f.c.H / 8), stride = (size_t)gridDim.x * 256;
      for (size_t v = blockIdx.x * 256 + threadIdx.x - 128; v < n; v += 2 * stride)
        combine_vecs<2>(&f.c, v, stride, n); /* two vectors a thread: more loads in flight */
    }
  }
  cluster_sync(); /* peers may still multicast into us or release our stages */
}

/* Per expert e: out[m, n] = sum over its rows r of A[r, m] B[r, n]; both operands are row-major
 * [rows, M] and [rows, N], i.e. MN-major, loaded as [64 r][64 m|n] boxes. */
KERNEL gemm_wgrad(const __grid_constant__ gemm_args g) {
  GEMM_KERNEL_BODY(wgrad_block_count(&g, CN), wgrad_tile(&g, q, rank, CN, &memo),
                   (load_a_mn(&g, sa, bar, &tl, rank, tl.k_row0 + kb * 64),
                    load_b_mn<false>(sb, bar, &tl, rank, &g.b0, tl.k_row0 + kb * 64, -1)),
                   1, 1, epi_wgrad,
                   if (g.comb.out && threadIdx.x >= 32) wc_work(&g.comb, (char *)(sm + 1)))
}

/* ---- launchers ------------------------------------------------------------------------------ */
typedef void (*gemm_fn)(gemm_args);

/* [kind - GEMM_DGRAD_DOWN][cn - 1]: the backward's products (the forward's: layer_forward) */
static const gemm_fn gemm_fns[][2] = {{gemm_dgrad_down<1>, gemm_dgrad_down<2>},
                                      {gemm_dgrad_gateup<1>, gemm_dgrad_gateup<2>},
                                      {gemm_wgrad<1>, gemm_wgrad<2>}};
#define GEMM_KINDS (int)(sizeof gemm_fns / sizeof gemm_fns[0])
typedef void (*layer_forward_fn)(layer_fwd);
static const layer_forward_fn layer_forward_fns[2] = {layer_forward<1>, layer_forward<2>};

static cudaLaunchConfig_t launch_config(int ctas, int cluster, cudaStream_t stream,
                                        cudaLaunchAttribute *attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(GEMM_THREADS);
  cfg.dynamicSmemBytes = GEMM_SMEM_BYTES; /* the 196 KB configuration, with 60 KB of L1 */
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = cluster;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

/* Raises the kernels' shared-memory limit and gives, for clusters of 2 x cn CTAs (cn = 1, 2),
 * how many CTAs can be resident at once (a cluster must fit in one GPC, so clusters of 4 may
 * leave SMs idle); once per device, outside any graph capture. */
cudaError_t gemm_init(int max_ctas[2]) {
  static_assert(GEMM_SMEM_BYTES + GEMM_COMBINE_SMEM <= 227 * 1024,
                "GEMM shared memory exceeds the sm_90 limit");
  for (int i = 0; i < GEMM_KINDS * 2; i++) {
    cudaError_t e = cudaFuncSetAttribute((const void *)gemm_fns[i / 2][i % 2],
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)(GEMM_SMEM_BYTES + GEMM_COMBINE_SMEM));
    if (e != cudaSuccess) return e;
  }
  for (int i = 0; i < 2; i++) {
    cudaError_t e = cudaFuncSetAttribute((const void *)layer_forward_fns[i],
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)GEMM_SMEM_BYTES);
    if (e != cudaSuccess) return e;
  }
  for (int cn = 1; cn <= 2; cn++) {
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t cfg = launch_config(GEMM_CM * cn, GEMM_CM * cn, 0, &attr);
    int clusters = 0, fused = 0; /* the forward's launch must fit whole: the smaller count */
    cudaError_t e =
        cudaOccupancyMaxActiveClusters(&clusters, (const void *)gemm_fns[0][cn - 1], &cfg);
    if (e == cudaSuccess)
      e = cudaOccupancyMaxActiveClusters(&fused, (const void *)layer_forward_fns[cn - 1], &cfg);
    if (e != cudaSuccess) return e;
    max_ctas[cn - 1] = GEMM_CM * cn * (fused < clusters ? fused : clusters);
  }
  return cudaSuccess;
}

cudaError_t gemm_launch(gemm_kind kind, const gemm_args *g, int max_ctas, cudaStream_t stream) {
  const int C = GEMM_CM * g->cn;
  if (kind < GEMM_DGRAD_DOWN) return cudaErrorInvalidValue; /* layer_forward_launch's */
  /* The most blocks the kernel can walk, one per cluster at a time. */
  const int blocks =
      (kind == GEMM_WGRAD ? g->experts : 1) * gemm_blocks(g->m_tiles_max, g->n, GEMM_BN, g->cn);
  int ctas = C * blocks < max_ctas ? C * blocks : max_ctas;
  if (ctas < C) ctas = C;
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg = launch_config(ctas, C, stream, &attr);
  if (g->comb.out) cfg.dynamicSmemBytes += GEMM_COMBINE_SMEM; /* the combine lanes' copies */
  cudaError_t e = cudaLaunchKernelEx(&cfg, gemm_fns[kind - GEMM_DGRAD_DOWN][g->cn - 1], *g);
  TCLK(if (e == cudaSuccess) tclk_report<<<1, 1, 0, stream>>>(1 + kind - GEMM_DGRAD_DOWN, ctas);)
  return e;
}

/* Every CTA that can be resident: the row phases use them all. */
cudaError_t layer_forward_launch(const layer_fwd *f, int ctas, cudaStream_t stream) {
  const int cn = f->p[0].cn, on[4] = {1, f->shared, f->down, f->down && f->shared};
  for (int j = 1; j < 4; j++)
    if (on[j] && f->p[j].cn != cn) return cudaErrorInvalidValue; /* one cluster shape a launch */
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t cfg = launch_config(ctas, GEMM_CM * cn, stream, &attr[0]);
  /* Cooperative: every CTA resident at once, or no launch, as the grid barrier needs (a CTA
   * waiting for an SM would leave the others spinning). */
  attr[1].id = cudaLaunchAttributeCooperative;
  attr[1].val.cooperative = 1;
  cfg.numAttrs = 2;
  cudaError_t e = cudaLaunchKernelEx(&cfg, layer_forward_fns[cn - 1], *f);
  TCLK(if (e == cudaSuccess) tclk_report<<<1, 1, 0, stream>>>(0, ctas);)
  return e;
}
