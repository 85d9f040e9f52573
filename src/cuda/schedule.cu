/*
 * schedule.cu: builds the schedule on the GPU with no host round trip (DESIGN §2, step 1), in
 * one launch of three phases with a grid barrier between them:
 *   count: a block histograms SCHED_CHUNK slots (a chunk) per local expert and validates ids;
 *   scan:  one block turns chunk histograms into per-chunk bases, counts, padded offsets,
 *          the expert of every 128-row block, and marks padding rows; or, over the capacity,
 *          raises MOK_DEVERR_CAPACITY and writes nothing more;
 *   place: per chunk, each slot's row = offsets[e] + chunk base + its rank among earlier slots
 *          of the chunk with the same expert, so every expert's rows come in slot order
 *          (t*k + j); and the inverse for this rank's own slots (slot_row, -1 for another
 *          rank's expert).
 * With an EP group the chunks run over every rank's published ids, rank by rank, so the order is
 * (source rank, t, j) and row_src = rank * slots_cap + t*k + j; every rank checks every id, so
 * all of them agree on a bad one.
 * Only integer atomics whose result does not depend on their order (histogram counts, error
 * bits, the header's sums) are used, so the schedule is identical run after run.
 * saved's header (internal.h) comes with it: scan writes its identity words first, and every
 * thread adds the terms of the own slots' ids and weights it reads (ROUTING) and of every value
 * of the schedule it writes (SCHEDULE), so the sums are of what the schedule holds. After an
 * error (a bad id, over the capacity, or bits from the group's opening barrier) nothing past the
 * header is written.
 */
#include "cuda/kernels.h"
#include "cuda/ptx.cuh"
#include "internal.h"

#define SCHED_THREADS 1024

static __device__ __forceinline__ bool id_valid(int id, int experts) {
  return id >= 0 && id < experts;
}

/* The slot of block `chunk` this thread looks at: its rank's ids and weights, the slot index in
 * that rank, and the number of slots that rank has. */
typedef struct sched_slot {
  const int32_t *ids;
  const float *w;
  int f, n, src;
} sched_slot;

static __device__ sched_slot slot_of(const sched_args *a, int chunk) {
  sched_slot s;
  s.src = chunk / a->chunks_per_rank;
  s.f = chunk % a->chunks_per_rank * SCHED_CHUNK + threadIdx.x;
  if (s.src == a->rank) {
    s.ids = a->topk_ids, s.w = a->topk_weights, s.n = a->slots;
  } else {
    s.ids = a->peers->ids[s.src], s.w = a->peers->w[s.src];
    s.n = *a->peers->tokens[s.src] * a->top_k;
  }
  return s;
}

/* A status word read where other blocks' atomics wrote it before a grid barrier. */
static __device__ __forceinline__ int32_t status_now(const int32_t *status) {
  return *(const volatile int32_t *)status;
}

/* count of one chunk: its histogram over the local experts, in hist (shared, E_local); the
 * routing sum's terms of the own slots into *routing. */
static __device__ void count_chunk(const sched_args *a, int chunk, int *hist, uint32_t *routing) {
  for (int e = threadIdx.x; e < a->experts_local; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const sched_slot sl = slot_of(a, chunk);
  if (sl.f < sl.n) {
    int id = sl.ids[sl.f];
    if (sl.src == a->rank)
      *routing += mok_sum_term(MOK_SUM_IDS, sl.f, (uint32_t)id) +
                  mok_sum_term_f(MOK_SUM_WEIGHTS, sl.f, sl.w[sl.f]);
    if (!id_valid(id, a->experts)) {
      atomicOr(a->status, MOK_DEVERR_EXPERT_ID);
      atomicOr(a->sticky, MOK_DEVERR_EXPERT_ID);
    } else {
      int e = id - a->expert_base;
      if (e >= 0 && e < a->experts_local) atomicAdd(&hist[e], 1);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < a->experts_local; e += blockDim.x)
    a->chunk_counts[(size_t)chunk * a->experts_local + e] = hist[e];
  __syncthreads(); /* hist is zeroed again for the next chunk */
}

/* Exclusive prefix sum over the block (one value per thread); returns the block total too. */
static __device__ int block_exclusive_scan(int v, int *total) {
  __shared__ int warp_sums[32];
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int x = v;
  for (int o = 1; o < 32; o *= 2) {
    int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < (int)(blockDim.x / 32) ? warp_sums[lane] : 0;
    for (int o = 1; o < 32; o *= 2) {
      int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    warp_sums[lane] = w;  /* inclusive */
  }
  __syncthreads();
  int before = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[blockDim.x / 32 - 1];
  __syncthreads();
  return before;
}

#define SCAN_BATCH 8 /* chunk counts a thread loads before it uses any of them */

/* Returns `run` plus the counts of expert e in chunks [c0, c1); with `write`, also replaces each
 * count by the running sum before it. Loads go SCAN_BATCH at a time so that a thread waits out
 * one L2 latency per batch, not per chunk; a warp's lanes hold consecutive experts, so each load
 * is coalesced. */
static __device__ int scan_chunks(int *chunk_counts, int E, int e, int c0, int c1, int run,
                                  bool write) {
  for (int c = c0; c < c1; c += SCAN_BATCH) {
    int v[SCAN_BATCH];
#pragma unroll
    for (int u = 0; u < SCAN_BATCH; u++)
      v[u] = c + u < c1 ? chunk_counts[(size_t)(c + u) * E + e] : 0;
#pragma unroll
    for (int u = 0; u < SCAN_BATCH; u++) {
      if (write && c + u < c1) chunk_counts[(size_t)(c + u) * E + e] = run;
      run += v[u];
    }
  }
  return run;
}

/* scan, by one block; cnt (shared, E_local) holds the counts until the capacity is known. The
 * schedule sum's terms of what it writes into *sum. */
static __device__ void scan_block(const sched_args *pa, int chunks, int *cnt, uint32_t *sum) {
  const sched_args &a = *pa;
  __shared__ int part[SCHED_THREADS]; /* [group][expert column]: a group's sum of its chunks */
  const int E = a.experts_local;
  if (threadIdx.x == 0) { /* saved's identity: backward and mok_schedule_counts check it */
    a.status[MOK_STATUS_TOKENS] = a.slots / a.top_k;
    a.status[MOK_STATUS_MAGIC] = MOK_SAVED_MAGIC;
    a.status[MOK_STATUS_IDENT] = (int32_t)a.ident;
  }
  if (status_now(a.status)) return; /* a bad id, or the group's bits: nothing more is written */
  /* Chunk bases. The block takes up to blockDim.x experts at a time, one column of threads per
   * expert and the chunks split among `groups` rows of them: each thread sums its slice, then
   * rewrites it as bases from the sums of the slices before it. A thread walking all of an
   * expert's chunks alone waited out an L2 latency per chunk: 66 us for fine-7b's 192 chunks at
   * ncu's clock (perf-log 2026-12-03 at 1e6ac2e). Integer sums: the same bases. */
  const int cols = min(E, (int)blockDim.x), groups = blockDim.x / cols;
  const int col = threadIdx.x % cols, g = threadIdx.x / cols;
  const int per = (chunks + groups - 1) / groups;
  const int c0 = min(chunks, g * per), c1 = min(chunks, c0 + per);
  for (int eb = 0; eb < E; eb += cols) {
    const int e = eb + col;
    const bool active = g < groups && e < E;
    const int sum = active ? scan_chunks(a.chunk_counts, E, e, c0, c1, 0, false) : 0;
    if (g < groups) part[g * cols + col] = sum;
    __syncthreads();
    if (active) {
      int run = 0;
      for (int h = 0; h < g; h++) run += part[h * cols + col];
      run = scan_chunks(a.chunk_counts, E, e, c0, c1, run, true);
      if (g == groups - 1) cnt[e] = run;
    }
    __syncthreads(); /* part[] is reused; cnt[] is read below by other threads */
  }
  /* Each thread owns a contiguous run of experts: padded sizes and offsets. */
  const int each = (E + blockDim.x - 1) / blockDim.x;
  const int e0 = threadIdx.x * each, e1 = min(E, e0 + each);
  int mine = 0;
  for (int e = e0; e < e1; e++) mine += (cnt[e] + MOK_TILE_M - 1) / MOK_TILE_M * MOK_TILE_M;
  int total;
  int off = block_exclusive_scan(mine, &total);
  if (total > a.rows_cap) { /* over the capacity (shape.routed_rows): every later kernel skips */
    if (threadIdx.x == 0) {
      atomicOr(a.status, MOK_DEVERR_CAPACITY);
      atomicOr(a.sticky, MOK_DEVERR_CAPACITY);
    }
    return;
  }
  uint32_t s = 0;
  for (int e = e0; e < e1; e++) {
    a.counts[e] = cnt[e];
    a.offsets[e] = off;
    s += mok_sum_term(MOK_SUM_COUNTS, e, (uint32_t)cnt[e]) +
         mok_sum_term(MOK_SUM_OFFSETS, e, (uint32_t)off);
    off += (cnt[e] + MOK_TILE_M - 1) / MOK_TILE_M * MOK_TILE_M;
  }
  if (threadIdx.x == 0) {
    a.offsets[E] = total;
    s += mok_sum_term(MOK_SUM_OFFSETS, E, (uint32_t)total);
  }
  __syncthreads();
  /* The expert of each 128-row block, and padding rows marked empty: a warp per expert, so
   * that its lanes store to neighbouring rows (a thread per expert scattered every store). */
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int e = threadIdx.x / 32; e < E; e += warps) {
    const int begin = a.offsets[e], end = a.offsets[e + 1];
    for (int b = begin / MOK_TILE_M + lane; b < end / MOK_TILE_M; b += 32) {
      a.mblock_expert[b] = e;
      s += mok_sum_term(MOK_SUM_MBLOCK, b, (uint32_t)e);
    }
    for (int r = begin + cnt[e] + lane; r < end; r += 32) {
      a.row_src[r] = -1;
      a.row_weight[r] = 0.0f;
      s += mok_sum_term(MOK_SUM_ROW_SRC, r, 0xffffffffu) +
           mok_sum_term_f(MOK_SUM_ROW_WEIGHT, r, 0.0f);
    }
  }
  for (int b = total / MOK_TILE_M + threadIdx.x; b < a.rows_cap / MOK_TILE_M; b += blockDim.x) {
    a.mblock_expert[b] = -1;
    s += mok_sum_term(MOK_SUM_MBLOCK, b, 0xffffffffu);
  }
  for (int r = total + threadIdx.x; r < a.rows_cap; r += blockDim.x) {
    a.row_src[r] = -1;
    a.row_weight[r] = 0.0f;
    s += mok_sum_term(MOK_SUM_ROW_SRC, r, 0xffffffffu) +
         mok_sum_term_f(MOK_SUM_ROW_WEIGHT, r, 0.0f);
  }
  *sum += s;
}

/* place of one chunk; next_row (shared, E_local): the next free row of each expert in it. The
 * schedule sum's terms of what it writes into *sum. */
static __device__ void place_chunk(const sched_args *pa, int chunk, int *next_row,
                                   uint32_t *sum) {
  const sched_args &a = *pa;
  for (int e = threadIdx.x; e < a.experts_local; e += blockDim.x)
    next_row[e] = a.offsets[e] + a.chunk_counts[(size_t)chunk * a.experts_local + e];
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const sched_slot sl = slot_of(&a, chunk);
  int key = -1; /* local expert, or -1: not ours / invalid / past the end */
  if (sl.f < sl.n) {
    int id = sl.ids[sl.f];
    int e = id - a.expert_base;
    if (id_valid(id, a.experts) && e >= 0 && e < a.experts_local) key = e;
  }
  /* Loaded before the turns: read inside its warp's turn, after the row_src store, the weight
   * cost every turn a load's latency, 32 in a row (the kernel took 34 us on fine-7b at ncu's
   * clock, 17 us with this; perf-log 2026-12-03 at 1e6ac2e). */
  const float weight = key >= 0 ? sl.w[sl.f] : 0.0f;
  /* Warps take turns so that rows follow slot order across the whole chunk. */
  for (int w = 0; w < SCHED_THREADS / 32; w++) {
    if (warp == w) {
      unsigned peers = __match_any_sync(0xffffffffu, key);
      int leader = __ffs(peers) - 1;
      int rank = __popc(peers & ((1u << lane) - 1u));
      int base = 0;
      if (lane == leader && key >= 0) {
        base = next_row[key];
        next_row[key] = base + __popc(peers);
      }
      base = __shfl_sync(0xffffffffu, base, leader);
      if (key >= 0) {
        const int src = sl.src * a.slots_cap + sl.f;
        a.row_src[base + rank] = src;
        a.row_weight[base + rank] = weight;
        *sum += mok_sum_term(MOK_SUM_ROW_SRC, base + rank, (uint32_t)src) +
                mok_sum_term_f(MOK_SUM_ROW_WEIGHT, base + rank, weight);
      }
      if (sl.src == a.rank && sl.f < sl.n) {
        const int row = key >= 0 ? base + rank : -1;
        a.slot_row[sl.f] = row;
        *sum += mok_sum_term(MOK_SUM_SLOT_ROW, sl.f, (uint32_t)row);
      }
    }
    __syncthreads();
  }
}

/* The block's sums of r and s (every thread passes its own) added to *to_r and *to_s. */
static __device__ void block_add(uint32_t r, uint32_t s, int32_t *to_r, int32_t *to_s) {
  __shared__ uint32_t wr[32], wsum[32];
  r = __reduce_add_sync(0xffffffffu, r);
  s = __reduce_add_sync(0xffffffffu, s);
  if (threadIdx.x % 32 == 0) wr[threadIdx.x / 32] = r, wsum[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x / 32); w++) r += wr[w], s += wsum[w];
    atomicAdd((unsigned *)to_r, r);
    atomicAdd((unsigned *)to_s, s);
  }
}

/* The three steps as phases of one cooperative launch, each block taking chunks blockIdx.x,
 * blockIdx.x + gridDim.x, ..., with every block at a grid barrier between them. */
__global__ void __launch_bounds__(SCHED_THREADS, 1) schedule(sched_args a, int chunks) {
  extern __shared__ int per_expert[]; /* [E_local]: count's hist, scan's counts, place's next_row */
  uint32_t routing = 0, sum = 0;
  for (int c = blockIdx.x; c < chunks; c += gridDim.x) count_chunk(&a, c, per_expert, &routing);
  grid_sync(a.sync, SCHED_THREADS);
  if (blockIdx.x == 0) scan_block(&a, chunks, per_expert, &sum);
  grid_sync(a.sync, SCHED_THREADS);
  if (status_now(a.status)) return; /* an error: the offsets were not written */
  for (int c = blockIdx.x; c < chunks; c += gridDim.x) place_chunk(&a, c, per_expert, &sum);
  block_add(routing, sum, a.status + MOK_STATUS_ROUTING, a.status + MOK_STATUS_SCHEDULE);
  if (blockIdx.x == 0 && threadIdx.x == 0) a.status[MOK_STATUS_FILLED] = MOK_FILLED_SCHEDULE;
}

cudaError_t schedule_launch(const sched_args *a, int max_ctas, cudaStream_t stream) {
  const int chunks = a->ranks * a->chunks_per_rank;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(chunks < max_ctas ? chunks : max_ctas);
  cfg.blockDim = dim3(SCHED_THREADS);
  cfg.dynamicSmemBytes = (size_t)a->experts_local * sizeof(int);
  cfg.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeCooperative; /* every block resident: the grid barriers */
  attr.val.cooperative = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, schedule, *a, chunks);
}

/* Loads the kernel of this file now (see ep_preload in kernels.h for why). */
cudaError_t schedule_preload(void) {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, (const void *)schedule);
}
