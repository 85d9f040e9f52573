/*
 * rows.cu: moving whole rows, and the backward's check of saved. dispatch copies token rows into
 * the routed buffer (zeros on padding, so weight-gradient products may sum over padded rows),
 * pulling other ranks' tokens from their published x (dy); combine sums each token's
 * slot rows onto its shared-expert row in fixed j order; router_grad sums the per-chunk partials
 * of d_topk_weights in ascending chunk order. All rows move as 16-byte vectors. At ep = 1
 * without a shared expert nothing overwrites the routed x rows between a forward and its
 * backward, and the backward copies only dy when they are still its forward's (saved_open says).
 */
#include "cuda/rows.cuh"
#include "internal.h"

#define ROWS_THREADS 256
#define ROWS_WARPS (ROWS_THREADS / 32)

__global__ void __launch_bounds__(ROWS_THREADS) dispatch_rows(dispatch_args a) {
  if (*a.status) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) dispatch_marks(&a);
  const int w = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  dispatch_warp<4, 1, true>(&a, w, gridDim.x * ROWS_WARPS);
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

__global__ void __launch_bounds__(ROWS_THREADS) combine_rows(combine_args c) {
  if (*c.status) return;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)c.T * (c.H / 8);
       i += (size_t)gridDim.x * blockDim.x)
    combine_vecs<1>(&c, i, 0, (size_t)c.T * (c.H / 8));
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

cudaError_t dispatch_launch(const dispatch_args *a, cudaStream_t stream) {
  const size_t items = (size_t)a->T + (size_t)(a->rows_cap + a->group - 1) / a->group;
  dispatch_rows<<<grid_for(items, ROWS_WARPS), ROWS_THREADS, 0, stream>>>(*a);
  return cudaGetLastError();
}

cudaError_t saved_open_launch(const int32_t *saved_status, int32_t *status, int tokens,
                              const uint64_t *saved_tag, uint64_t *xr_tag, const void *x,
                              cudaStream_t stream) {
  saved_open<<<1, 1, 0, stream>>>(saved_status, status, tokens, saved_tag, xr_tag, x);
  return cudaGetLastError();
}

cudaError_t combine_launch(const combine_args *c, cudaStream_t stream) {
  combine_rows<<<grid_for((size_t)c->T * c->H / 8, ROWS_THREADS), ROWS_THREADS, 0, stream>>>(*c);
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
