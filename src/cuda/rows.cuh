/*
 * rows.cuh: the row movers as device functions, for their own kernels (rows.cu) and for the
 * forward's layer launch (gemm_kernels.cu), which runs them as phases. Each takes its share of
 * the work by a warp (dispatch) or thread (combine) index and a stride, so any grid runs them
 * and the bits do not depend on it. All rows move as 16-byte vectors.
 */
#ifndef MOK_CUDA_ROWS_CUH
#define MOK_CUDA_ROWS_CUH

#include "cuda/kernels.h"
#include "internal.h"

#define COMBINE_BATCH 8   /* slot rows a thread loads before it adds any of them */

/* Copies row from[n] of x0 (and x1) to the rows of y0 (y1) held in to[n] by the lanes of lanes[n],
 * N rows at once (lanes[n] = 0: none), or zeros there when x0 is NULL; one warp, U x 32 vectors
 * of each row at a time: all loads, then all stores. The rows pass by shuffle, so a warp needs
 * no shared memory. U is the 16-byte loads in flight per lane, row and tensor: 4 where a full
 * grid of row kernels moves rows; in the layer launch, whose 12 warps an SM move a token each at
 * a time, 8 for one row (48 KB in flight an SM, a row of up to 4 KB in one round trip; perf-log
 * 2026-12-04, wip/rowpipe: fine-7b's forward 0.05 ms faster, but qwen3-30b-a3b's backward
 * 0.12-0.14 ms slower with 8 in the row kernel) and now 6 for two (dispatch_warp). */
template <int U, int N>
static __device__ void copy_rows(const int4 *x0, const int4 *x1, const size_t from[N], int4 *y0,
                                 int4 *y1, const unsigned lanes[N], const int to[N], int vecs) {
  const int lane = threadIdx.x % 32;
  for (int v0 = 0; v0 < vecs; v0 += 32 * U) {
    int4 r0[N][U], r1[N][U];
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int v = v0 + 32 * u + lane;
        r0[n][u] = r1[n][u] = make_int4(0, 0, 0, 0);
        if (x0 && lanes[n] && v < vecs) {
          r0[n][u] = __ldg(&x0[from[n] + v]);
          if (y1) r1[n][u] = __ldg(&x1[from[n] + v]);
        }
      }
#pragma unroll
    for (int n = 0; n < N; n++)
      for (unsigned m = lanes[n]; m; m &= m - 1) {
        const size_t at = (size_t)__shfl_sync(0xffffffffu, to[n], __ffs(m) - 1) * vecs;
#pragma unroll
        for (int u = 0; u < U; u++) {
          const int v = v0 + 32 * u + lane;
          if (v < vecs) {
            y0[at + v] = r0[n][u];
            if (y1) y1[at + v] = r1[n][u];
          }
        }
      }
  }
}

/* The call's number and marks (dispatch_args.xr_tag), by the one thread that reads the tags;
 * its filled word. Before any row moves. */
static __device__ void dispatch_marks(const dispatch_args *a) {
  if (a->filled) *a->filled = MOK_FILLED_ACTIVATIONS;
  const bool dy_only = a->x_rows && *a->x_rows;
  if (a->xr_tag && !a->x_rows) { /* forward: number this call, mark its x rows and saved */
    const uint64_t n = ++a->xr_tag[2];
    a->xr_tag[0] = n;
    a->xr_tag[1] = (uintptr_t)a->src0;
    *a->saved_tag = n;
  } else if (a->xr_tag && !dy_only) { /* backward copying x: saved's forward's rows now */
    a->xr_tag[0] = *a->saved_tag;
    a->xr_tag[1] = (uintptr_t)a->src0;
  }
}

/* Warp `w` of `warps` takes items w, w + warps, ... Items [0, T) are this rank's tokens: each
 * token row is read once and written to the rows of its slots here (reading it once per row
 * instead read every token k times from HBM: fine-7b's forward dispatch took 285 us, its
 * combine, which reads as many bytes as that dispatch writes, 160). A warp takes its tokens N at
 * a time, w, w + warps, ...: all N tokens' slot rows, then all N rows' loads, are in flight
 * before the first store. The layer launch's warps (15 tokens each on fine-7b) take 2, and wait
 * out half as many chains of two memory latencies: its forward 1 % faster (perf-log 2026-12-04,
 * 7c4872d); the row kernel, with a full grid of warps, did not gain and takes 1. The other items
 * are groups of a->group routed rows: zeros on padding, other ranks' tokens pulled from their
 * published x (dy); rows of this rank's tokens are skipped, the first kind wrote them. group is
 * 32 at ep = 1, where every row but the padding is skipped, so a warp looks at 32 row_src at
 * once; and 1 in a group, where most rows come from other ranks and each needs a warp of its own.
 * DY: the call may move dy beside x (the backward's kernel); the forward's layer launch moves x
 * alone, and without dy's registers its two rows in flight do not spill. */
template <int U, int N, bool DY>
static __device__ void dispatch_warp(const dispatch_args *a, int w, int warps) {
  /* Backward whose x rows are in place already (saved_open): dy alone, as the one tensor. */
  const bool dy_only = a->x_rows && *a->x_rows;
  const int rows = a->offsets[a->experts_local], vecs = a->H / 8, lane = threadIdx.x % 32;
  const int group = a->group, items = a->T + (rows + group - 1) / group;
  const int4 *x0 = (const int4 *)(dy_only ? a->src1 : a->src0);
  const int4 *x1 = dy_only || !DY ? NULL : (const int4 *)a->src1;
  int4 *y0 = (int4 *)(dy_only ? a->dst1 : a->dst0), *y1 = dy_only || !DY ? NULL : (int4 *)a->dst1;
  for (; w < a->T; w += N * warps) {
    for (int j0 = 0; j0 < a->k; j0 += 32) { /* the tokens' rows here, 32 slots at a time */
      const int j = j0 + lane;
      int row[N];
      unsigned here[N], any = 0;
      size_t from[N];
#pragma unroll
      for (int n = 0; n < N; n++) {
        const int t = w + n * warps;
        row[n] = j < a->k && t < a->T ? a->slot_row[(size_t)t * a->k + j] : -1;
        from[n] = (size_t)t * vecs;
      }
#pragma unroll
      for (int n = 0; n < N; n++) any |= here[n] = __ballot_sync(0xffffffffu, row[n] >= 0);
      if (any) copy_rows<U, N>(x0, x1, from, y0, y1, here, row, vecs);
    }
  }
  /* This warp's first item past the tokens (the loop above went N warps at a time). */
  while (w - warps >= a->T) w -= warps;
  for (; w < items; w += warps) {
    const int r0 = (w - a->T) * group, r = r0 + lane;
    const bool mine = lane < group && r < rows;
    const int src = mine ? a->row_src[r] : 0;
    const int owner = src >= 0 ? src / a->slots_cap : -1; /* -1: padding */
    const unsigned todo = __ballot_sync(0xffffffffu, mine && owner != a->rank);
    for (unsigned m = todo; m; m &= m - 1) {
      const int l = __ffs(m) - 1;
      const int o = __shfl_sync(0xffffffffu, owner, l), sl = __shfl_sync(0xffffffffu, src, l);
      const int4 *p0 = o < 0 ? NULL : (const int4 *)(dy_only ? a->peers->dy[o] : a->peers->x[o]);
      const int4 *p1 = o < 0 || dy_only ? NULL : (const int4 *)a->peers->dy[o];
      const size_t from[1] = {o < 0 ? 0 : (size_t)(sl % a->slots_cap / a->k) * vecs};
      const unsigned one[1] = {1u};
      const int to[1] = {r0 + l};
      copy_rows<U, 1>(p0, p1, from, y0, y1, one, to, vecs);
    }
  }
}

/* One slot piece (8 bf16) added into a vector's sums, and the sums as the vector of y: what
 * combine_vecs and the combine beside the last weight gradient (gemm_kernels.cu) both do. */
static __device__ __forceinline__ void combine_add(float acc[8], int4 raw) {
  const __nv_bfloat162 *p = (const __nv_bfloat162 *)&raw;
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const float2 f = __bfloat1622float2(p[e]);
    acc[2 * e] += f.x;
    acc[2 * e + 1] += f.y;
  }
}

static __device__ __forceinline__ int4 combine_pack(const float acc[8]) {
  int4 res;
  __nv_bfloat162 *r = (__nv_bfloat162 *)&res;
#pragma unroll
  for (int e = 0; e < 4; e++) r[e] = __floats2bfloat162_rn(acc[2 * e], acc[2 * e + 1]);
  return res;
}

/* Vectors i, i + stride, ... (V of them, those below n) of y: y[t] = bf16(((base[t] +
 * slot[t,0]) + slot[t,1]) + ...), the slot rows of all V loaded COMBINE_BATCH at a time before
 * any is added, and added in j order. V > 1 keeps more loads in flight a thread where few
 * threads combine (the layer launch's consumer warps). */
template <int V>
static __device__ void combine_vecs(const combine_args *c, size_t i, size_t stride, size_t n) {
  const int vecs = c->H / 8, k = c->k;
  float acc[V][8];
  const int4 *slots[V];
#pragma unroll
  for (int q = 0; q < V; q++) {
    const size_t iq = i + q * stride < n ? i + q * stride : i; /* past n: a copy of vector i */
    const size_t t = iq / vecs, v = iq - t * vecs;
    if (c->base) {
      const float4 *b = (const float4 *)(c->base + t * c->H + v * 8);
      const float4 lo = b[0], hi = b[1];
      acc[q][0] = lo.x, acc[q][1] = lo.y, acc[q][2] = lo.z, acc[q][3] = lo.w;
      acc[q][4] = hi.x, acc[q][5] = hi.y, acc[q][6] = hi.z, acc[q][7] = hi.w;
    } else {
#pragma unroll
      for (int e = 0; e < 8; e++) acc[q][e] = 0.0f;
    }
    slots[q] = (const int4 *)c->slots + t * k * vecs + v;
  }
  for (int j0 = 0; j0 < k; j0 += COMBINE_BATCH) {
    int4 raw[V][COMBINE_BATCH];
#pragma unroll
    for (int q = 0; q < V; q++)
#pragma unroll
      for (int u = 0; u < COMBINE_BATCH; u++)
        if (j0 + u < k) raw[q][u] = slots[q][(size_t)(j0 + u) * vecs];
#pragma unroll
    for (int q = 0; q < V; q++) {
#pragma unroll
      for (int u = 0; u < COMBINE_BATCH; u++) {
        if (j0 + u >= k) break;
        combine_add(acc[q], raw[q][u]);
      }
    }
  }
#pragma unroll
  for (int q = 0; q < V; q++) {
    if (i + q * stride >= n) break;
    ((int4 *)c->out)[i + q * stride] = combine_pack(acc[q]);
  }
}

#endif
