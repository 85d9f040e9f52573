/*
 * rows.cu: moving whole rows, and the backward's check of saved. dispatch copies token rows into
 * the routed buffer (zeros on padding, so weight-gradient products may sum over padded rows),
 * pulling other ranks' tokens from their published x (dy); combine sums each token's
 * slot rows onto its shared-expert row in fixed j order; router_grad sums the per-chunk partials
 * of d_topk_weights in ascending chunk order. All rows move as 16-byte vectors. At ep = 1
 * without a shared expert nothing overwrites the routed x rows between a forward and its
 * backward, and the backward copies only dy when they are still its forward's (saved_open says).
 */
#include "cuda/kernels.h"
#include "internal.h"

#define ROWS_THREADS 256
#define ROWS_WARPS (ROWS_THREADS / 32)
#define DISPATCH_UNROLL 4 /* 16-byte loads in flight per lane and tensor */

/* Copies row `from` of x0 (and x1) to rows to[0..n-1] of y0 (y1), or zeros there when x0 is
 * NULL; one warp, DISPATCH_UNROLL x 32 vectors at a time: all loads, then all stores. */
static __device__ void copy_row(const int4 *x0, const int4 *x1, size_t from, int4 *y0, int4 *y1,
                                const int *to, int n, int vecs) {
  const int lane = threadIdx.x % 32;
  for (int v0 = 0; v0 < vecs; v0 += 32 * DISPATCH_UNROLL) {
    int4 r0[DISPATCH_UNROLL], r1[DISPATCH_UNROLL];
#pragma unroll
    for (int u = 0; u < DISPATCH_UNROLL; u++) {
      const int v = v0 + 32 * u + lane;
      r0[u] = r1[u] = make_int4(0, 0, 0, 0);
      if (x0 && v < vecs) {
        r0[u] = __ldg(&x0[from + v]);
        if (y1) r1[u] = __ldg(&x1[from + v]);
      }
    }
    for (int j = 0; j < n; j++) {
      const size_t at = (size_t)to[j] * vecs;
#pragma unroll
      for (int u = 0; u < DISPATCH_UNROLL; u++) {
        const int v = v0 + 32 * u + lane;
        if (v < vecs) {
          y0[at + v] = r0[u];
          if (y1) y1[at + v] = r1[u];
        }
      }
    }
  }
}

/* One warp per item. Items [0, T) are this rank's tokens: each token row is read once and
 * written to the rows of its slots here (reading it once per row instead read every token k
 * times from HBM: fine-7b's forward dispatch took 285 us, its combine, which reads as many
 * bytes as that dispatch writes, 160). The other items are groups of `group` routed rows: zeros
 * on padding, other ranks' tokens pulled from their published x (dy); rows of this rank's
 * tokens are skipped, the first kind wrote them. group is 32 at ep = 1, where every row but the
 * padding is skipped, so a warp looks at 32 row_src at once; and 1 in a group, where most rows
 * come from other ranks and each needs a warp of its own. */
__global__ void __launch_bounds__(ROWS_THREADS) dispatch_rows(dispatch_args a, int group) {
  if (*a.status) return;
  /* Backward whose x rows are in place already (saved_open): dy alone, as the one tensor. */
  const bool dy_only = a.x_rows && *a.x_rows;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (a.filled) *a.filled = 1;
    /* What xr holds once this kernel is done, said by the one thread that reads the tags here. */
    if (a.xr_tag && !a.x_rows) { /* forward: number this call, mark its x rows and saved */
      const uint64_t n = ++a.xr_tag[2];
      a.xr_tag[0] = n;
      a.xr_tag[1] = (uintptr_t)a.src0;
      *a.saved_tag = n;
    } else if (a.xr_tag && !dy_only) { /* backward copying x: saved's forward's rows now */
      a.xr_tag[0] = *a.saved_tag;
      a.xr_tag[1] = (uintptr_t)a.src0;
    }
  }
  const int rows = a.offsets[a.experts_local], vecs = a.H / 8, lane = threadIdx.x % 32;
  const int items = a.T + (rows + group - 1) / group;
  const int4 *x0 = (const int4 *)(dy_only ? a.src1 : a.src0);
  const int4 *x1 = dy_only ? NULL : (const int4 *)a.src1;
  int4 *y0 = (int4 *)(dy_only ? a.dst1 : a.dst0), *y1 = dy_only ? NULL : (int4 *)a.dst1;
  __shared__ int to_s[ROWS_WARPS][32];
  int *to = to_s[threadIdx.x / 32];
  for (int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32; w < items;
       w += gridDim.x * ROWS_WARPS) {
    if (w < a.T) {
      for (int j0 = 0; j0 < a.k; j0 += 32) { /* this token's rows here, 32 slots at a time */
        const int j = j0 + lane;
        const int row = j < a.k ? a.slot_row[(size_t)w * a.k + j] : -1;
        const unsigned here = __ballot_sync(0xffffffffu, row >= 0);
        if (!here) continue; /* none here (its experts are on other ranks): nothing to read */
        if (row >= 0) to[__popc(here & ((1u << lane) - 1u))] = row;
        __syncwarp();
        copy_row(x0, x1, (size_t)w * vecs, y0, y1, to, __popc(here), vecs);
        __syncwarp(); /* every lane has read `to` before the next slots overwrite it */
      }
      continue;
    }
    const int r0 = (w - a.T) * group, r = r0 + lane;
    const bool mine = lane < group && r < rows;
    const int src = mine ? a.row_src[r] : 0;
    const int owner = src >= 0 ? src / a.slots_cap : -1; /* -1: padding */
    const unsigned todo = __ballot_sync(0xffffffffu, mine && owner != a.rank);
    for (unsigned m = todo; m; m &= m - 1) {
      const int l = __ffs(m) - 1;
      const int o = __shfl_sync(0xffffffffu, owner, l), sl = __shfl_sync(0xffffffffu, src, l);
      const int4 *p0 = o < 0 ? NULL : (const int4 *)(dy_only ? a.peers->dy[o] : a.peers->x[o]);
      const int4 *p1 = o < 0 || dy_only ? NULL : (const int4 *)a.peers->dy[o];
      if (lane == 0) to[0] = r0 + l;
      __syncwarp();
      copy_row(p0, p1, o < 0 ? 0 : (size_t)(sl % a.slots_cap / a.k) * vecs, y0, y1, to, 1, vecs);
      __syncwarp();
    }
  }
}

/* Backward's first kernel: its own error bits, the forward's (the group's barrier may add to
 * them without touching saved), with MOK_DEVERR_SAVED added where saved was not filled by a
 * forward or recompute of `tokens` tokens. Every later kernel then skips; router_grad reports
 * it. The backward reads no other word of its status but the barrier's. */
__global__ void saved_open(const int32_t *saved_status, int32_t *status, int tokens,
                           const uint64_t *saved_tag, uint64_t *xr_tag, const void *x) {
  int32_t bits = saved_status[MOK_STATUS_BITS];
  if (mok_saved_check(saved_status, tokens) != MOK_SAVED_OK) bits |= MOK_DEVERR_SAVED;
  status[MOK_STATUS_BITS] = bits;
  status[MOK_STATUS_OPEN] = 0;
  status[MOK_BSTATUS_X_ROWS] =
      xr_tag && *saved_tag != 0 && xr_tag[0] == *saved_tag && xr_tag[1] == (uintptr_t)x;
}

__global__ void __launch_bounds__(ROWS_THREADS)
combine_rows(const int32_t *status, int T, int k, int H, const float *base, const int4 *slots,
             int4 *out) {
  if (*status) return;
  const int vecs = H / 8;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)T * vecs;
       i += (size_t)gridDim.x * blockDim.x) {
    size_t t = i / vecs, v = i - t * vecs;
    float acc[8];
    if (base) {
      const float4 *b = (const float4 *)(base + t * H + v * 8);
      float4 lo = b[0], hi = b[1];
      acc[0] = lo.x; acc[1] = lo.y; acc[2] = lo.z; acc[3] = lo.w;
      acc[4] = hi.x; acc[5] = hi.y; acc[6] = hi.z; acc[7] = hi.w;
    } else {
      for (int c = 0; c < 8; c++) acc[c] = 0.0f;
    }
    for (int j = 0; j < k; j++) {
      int4 raw = slots[(t * k + j) * vecs + v];
      const __nv_bfloat162 *p = (const __nv_bfloat162 *)&raw;
      for (int c = 0; c < 4; c++) {
        float2 f = __bfloat1622float2(p[c]);
        acc[2 * c] += f.x;
        acc[2 * c + 1] += f.y;
      }
    }
    int4 res;
    __nv_bfloat162 *q = (__nv_bfloat162 *)&res;
    for (int c = 0; c < 4; c++) q[c] = __floats2bfloat162_rn(acc[2 * c], acc[2 * c + 1]);
    out[i] = res;
  }
}

__global__ void __launch_bounds__(ROWS_THREADS)
router_grad(const int32_t *status, int32_t *sticky, int slots, int chunks, const float *part,
            float *out) {
  if (*status) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(sticky, *status);
    return;
  }
  for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < slots; s += gridDim.x * blockDim.x) {
    float acc = 0.0f;
    for (int c = 0; c < chunks; c++) acc += part[(size_t)s * chunks + c];
    out[s] = acc;
  }
}

static int grid_for(size_t work, int per_block) {
  size_t g = (work + per_block - 1) / per_block;
  return (int)(g < 1 ? 1 : (g > 8192 ? 8192 : g));
}

cudaError_t dispatch_launch(const dispatch_args *a, int ranks, cudaStream_t stream) {
  const int group = ranks > 1 ? 1 : 32;
  const size_t items = (size_t)a->T + (size_t)(a->rows_cap + group - 1) / group;
  dispatch_rows<<<grid_for(items, ROWS_WARPS), ROWS_THREADS, 0, stream>>>(*a, group);
  return cudaGetLastError();
}

cudaError_t saved_open_launch(const int32_t *saved_status, int32_t *status, int tokens,
                              const uint64_t *saved_tag, uint64_t *xr_tag, const void *x,
                              cudaStream_t stream) {
  saved_open<<<1, 1, 0, stream>>>(saved_status, status, tokens, saved_tag, xr_tag, x);
  return cudaGetLastError();
}

cudaError_t combine_launch(const int32_t *status, int T, int k, int H, const float *base,
                           const __nv_bfloat16 *slots, __nv_bfloat16 *out, cudaStream_t stream) {
  combine_rows<<<grid_for((size_t)T * H / 8, ROWS_THREADS), ROWS_THREADS, 0, stream>>>(
      status, T, k, H, base, (const int4 *)slots, (int4 *)out);
  return cudaGetLastError();
}

cudaError_t router_grad_launch(const int32_t *status, int32_t *sticky, int slots, int chunks,
                               const float *part, float *out, cudaStream_t stream) {
  router_grad<<<grid_for(slots, ROWS_THREADS), ROWS_THREADS, 0, stream>>>(status, sticky, slots,
                                                                         chunks, part, out);
  return cudaGetLastError();
}

/* Loads the kernels of this file now (see ep_preload in kernels.h for why). */
cudaError_t rows_preload(void) {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, (const void *)dispatch_rows);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, (const void *)saved_open);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, (const void *)combine_rows);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, (const void *)router_grad);
  return e;
}
