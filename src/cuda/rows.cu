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

/* Backward's first kernel (saved_open_launch in kernels.h says what it decides). Every block
 * checks the header before it reads anything else of saved: a saved of another workspace or of
 * other tokens would be read at the wrong places, or past the end of a smaller buffer. Then the
 * blocks sum the terms of this call's routing and of saved's schedule (the terms of
 * mok_routing_sum and mok_schedule_sum, internal.h) and the last one compares. Every later kernel
 * skips on the bits; router_grad reports them. */
typedef struct saved_open_args {
  const char *saved;
  size_t counts, offsets, row_src, row_weight, slot_row, mblock_expert, tag;
  int experts_local, rows_cap, slots, tokens;
  uint32_t ident;
  const int32_t *topk_ids;
  const float *topk_weights;
  int32_t *status;
  uint64_t *xr_tag;
  const void *x;
} saved_open_args;

template <typename T>
static __device__ __forceinline__ const T *saved_at(const saved_open_args &a, size_t off) {
  return (const T *)(a.saved + off);
}

__global__ void __launch_bounds__(ROWS_THREADS) saved_open(saved_open_args a) {
  const int32_t *h = saved_at<int32_t>(a, 0);
  const int why = mok_saved_check(h, a.ident, a.tokens);
  const bool sums = why == MOK_SAVED_OK && h[MOK_STATUS_BITS] == 0;
  uint32_t r = 0, s = 0;
  if (sums) {
    const int stride = gridDim.x * blockDim.x, i0 = blockIdx.x * blockDim.x + threadIdx.x;
    const int32_t *slot_row = saved_at<int32_t>(a, a.slot_row);
    for (int i = i0; i < a.slots; i += stride)
      r += mok_sum_term(MOK_SUM_IDS, i, (uint32_t)a.topk_ids[i]) +
           mok_sum_term_f(MOK_SUM_WEIGHTS, i, a.topk_weights[i]),
      s += mok_sum_term(MOK_SUM_SLOT_ROW, i, (uint32_t)slot_row[i]);
    const int32_t *row_src = saved_at<int32_t>(a, a.row_src);
    const float *row_weight = saved_at<float>(a, a.row_weight);
    for (int i = i0; i < a.rows_cap; i += stride)
      s += mok_sum_term(MOK_SUM_ROW_SRC, i, (uint32_t)row_src[i]) +
           mok_sum_term_f(MOK_SUM_ROW_WEIGHT, i, row_weight[i]);
    const int32_t *mblock = saved_at<int32_t>(a, a.mblock_expert);
    for (int i = i0; i < a.rows_cap / MOK_TILE_M; i += stride)
      s += mok_sum_term(MOK_SUM_MBLOCK, i, (uint32_t)mblock[i]);
    const int32_t *counts = saved_at<int32_t>(a, a.counts);
    const int32_t *offsets = saved_at<int32_t>(a, a.offsets);
    for (int i = i0; i <= a.experts_local; i += stride) {
      if (i < a.experts_local) s += mok_sum_term(MOK_SUM_COUNTS, i, (uint32_t)counts[i]);
      s += mok_sum_term(MOK_SUM_OFFSETS, i, (uint32_t)offsets[i]);
    }
  }
  __shared__ uint32_t wr[ROWS_WARPS], wsum[ROWS_WARPS];
  r = __reduce_add_sync(0xffffffffu, r);
  s = __reduce_add_sync(0xffffffffu, s);
  if (threadIdx.x % 32 == 0) wr[threadIdx.x / 32] = r, wsum[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < ROWS_WARPS; w++) r += wr[w], s += wsum[w];
  unsigned *acc = (unsigned *)a.status;
  atomicAdd(&acc[MOK_BSTATUS_ROUTING], r);
  atomicAdd(&acc[MOK_BSTATUS_SCHEDULE], s);
  __threadfence();
  if (atomicAdd(&acc[MOK_BSTATUS_DONE], 1u) != gridDim.x - 1) return;
  __threadfence(); /* the last block: every block's sums are in */
  const uint32_t routing = atomicExch(&acc[MOK_BSTATUS_ROUTING], 0u);
  const uint32_t schedule = atomicExch(&acc[MOK_BSTATUS_SCHEDULE], 0u);
  acc[MOK_BSTATUS_DONE] = 0;
  int32_t bits = why == MOK_SAVED_OK ? h[MOK_STATUS_BITS] : MOK_DEVERR_SAVED;
  if (sums && (routing != (uint32_t)h[MOK_STATUS_ROUTING] ||
               schedule != (uint32_t)h[MOK_STATUS_SCHEDULE]))
    bits |= MOK_DEVERR_SAVED;
  a.status[MOK_STATUS_BITS] = bits;
  a.status[MOK_STATUS_OPEN] = 0;
  const uint64_t *saved_tag = saved_at<uint64_t>(a, a.tag);
  a.status[MOK_BSTATUS_X_ROWS] = !bits && a.xr_tag && *saved_tag != 0 &&
                                 a.xr_tag[0] == *saved_tag && a.xr_tag[1] == (uintptr_t)a.x;
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

cudaError_t saved_open_launch(const mok_saved_layout *S, const void *saved, int experts_local,
                              int top_k, uint32_t ident, const int32_t *topk_ids,
                              const float *topk_weights, int32_t *status, uint64_t *xr_tag,
                              const void *x, int max_blocks, cudaStream_t stream) {
  saved_open_args a;
  a.saved = (const char *)saved + S->status;
  a.counts = S->counts - S->status, a.offsets = S->offsets - S->status;
  a.row_src = S->row_src - S->status, a.row_weight = S->row_weight - S->status;
  a.slot_row = S->slot_row - S->status, a.mblock_expert = S->mblock_expert - S->status;
  a.tag = S->tag - S->status;
  a.experts_local = experts_local;
  a.rows_cap = (int)S->rows_cap;
  a.tokens = (int)S->tokens;
  a.slots = (int)S->tokens * top_k;
  a.ident = ident;
  a.topk_ids = topk_ids, a.topk_weights = topk_weights;
  a.status = status, a.xr_tag = xr_tag, a.x = x;
  const size_t most = (size_t)(a.slots > a.rows_cap ? a.slots : a.rows_cap);
  int grid = grid_for(most, ROWS_THREADS);
  if (grid > max_blocks) grid = max_blocks < 1 ? 1 : max_blocks;
  saved_open<<<grid, ROWS_THREADS, 0, stream>>>(a);
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
