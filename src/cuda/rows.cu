/*
 * rows.cu: moving whole rows, and the backward's check of saved. dispatch copies token rows into
 * the routed buffer (zeros on padding, so weight-gradient products may sum over padded rows),
 * pulling other ranks' tokens from their published x (dy); combine sums each token's
 * slot rows onto its shared-expert row in fixed j order; router_grad sums the per-chunk partials
 * of d_topk_weights in ascending chunk order. All rows move as 16-byte vectors.
 */
#include "cuda/kernels.h"
#include "internal.h"

#define ROWS_THREADS 256

__global__ void __launch_bounds__(ROWS_THREADS)
dispatch_rows(const int32_t *status, const int32_t *offsets, int experts_local,
              const int32_t *row_src, int k, int H, const ep_table *peers, int rank,
              int slots_cap, const int4 *src0, int4 *dst0, const int4 *src1, int4 *dst1,
              int32_t *filled) {
  if (*status) return;
  if (filled && blockIdx.x == 0 && threadIdx.x == 0) *filled = 1;
  const int total = offsets[experts_local];
  const int vecs = H / 8;
  const int lane = threadIdx.x % 32;
  for (int r = (blockIdx.x * blockDim.x + threadIdx.x) / 32; r < total;
       r += gridDim.x * blockDim.x / 32) {
    const int src = row_src[r];
    const int owner = src >= 0 ? src / slots_cap : rank; /* the rank that published the token */
    const int4 *a = src0, *b = src1;
    if (owner != rank) {
      a = (const int4 *)peers->x[owner];
      b = (const int4 *)peers->dy[owner];
    }
    size_t from = src >= 0 ? (size_t)(src % slots_cap / k) * vecs : 0, to = (size_t)r * vecs;
    for (int v = lane; v < vecs; v += 32) {
      int4 z = make_int4(0, 0, 0, 0);
      dst0[to + v] = src >= 0 ? a[from + v] : z;
      if (dst1) dst1[to + v] = src >= 0 ? b[from + v] : z;
    }
  }
}

/* Backward's first kernel: its own error bits, the forward's (the group's barrier may add to
 * them without touching saved), with MOK_DEVERR_SAVED added where saved was not filled by a
 * forward or recompute of `tokens` tokens. Every later kernel then skips; router_grad reports
 * it. The backward reads no other word of its status but the barrier's. */
__global__ void saved_open(const int32_t *saved_status, int32_t *status, int tokens) {
  int32_t bits = saved_status[MOK_STATUS_BITS];
  if (mok_saved_check(saved_status, tokens) != MOK_SAVED_OK) bits |= MOK_DEVERR_SAVED;
  status[MOK_STATUS_BITS] = bits;
  status[MOK_STATUS_OPEN] = 0;
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

cudaError_t dispatch_launch(const int32_t *status, const int32_t *offsets, int experts_local,
                            const int32_t *row_src, int k, int H, int rows_cap,
                            const ep_table *peers, int rank, int slots_cap,
                            const __nv_bfloat16 *src0, __nv_bfloat16 *dst0,
                            const __nv_bfloat16 *src1, __nv_bfloat16 *dst1, int32_t *filled,
                            cudaStream_t stream) {
  dispatch_rows<<<grid_for(rows_cap, ROWS_THREADS / 32), ROWS_THREADS, 0, stream>>>(
      status, offsets, experts_local, row_src, k, H, peers, rank, slots_cap, (const int4 *)src0,
      (int4 *)dst0, (const int4 *)src1, (int4 *)dst1, filled);
  return cudaGetLastError();
}

cudaError_t saved_open_launch(const int32_t *saved_status, int32_t *status, int tokens,
                              cudaStream_t stream) {
  saved_open<<<1, 1, 0, stream>>>(saved_status, status, tokens);
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

/* Loads the kernels of this file now (see kernels_preload in kernels.h). */
cudaError_t rows_preload(void) {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, (const void *)dispatch_rows);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, (const void *)saved_open);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, (const void *)combine_rows);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, (const void *)router_grad);
  return e;
}
