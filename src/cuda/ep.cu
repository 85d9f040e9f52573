/*
 * ep.cu: the barrier of an expert-parallel group on the GPU (DESIGN §2.3). One thread per rank:
 * it writes (epoch, error bits) into its slot of every rank's flag words, then waits for every
 * rank's word of the same epoch in its own. The words of epoch e live in half e % 2 of the flags:
 * a rank can be at most one barrier ahead of another (it cannot pass e + 1 before the other has
 * arrived there), so its next word never overwrites one still to be read.
 * Stores are .release and loads .acquire at .sys scope: what a rank wrote before the barrier
 * (published inputs, pushed slot rows) is visible to every rank after it, within one GPU or
 * across GPUs. The epoch counts on the device, so a captured CUDA graph replays correctly.
 * The table of every rank's buffers is written by the host for emulated ranks (workspace.cu) and
 * read here from the NCCL window for a group of processes.
 */
#include <nccl_device.h>

#include "cuda/kernels.h"
#include "cuda/ptx.cuh"
#include "internal.h"

static __device__ __forceinline__ void st_release_sys(unsigned long long *p,
                                                      unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ unsigned long long ld_acquire_sys(
    const unsigned long long *p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__global__ void ep_barrier(const ep_table *tb, int rank, int ranks, int when, int call,
                           int32_t *status, int32_t *sticky, unsigned *epoch, int32_t *tokens_out,
                           int tokens, int32_t add, long long timeout_ns) {
  status[MOK_STATUS_BITS] |= add;
  if (when == EP_CHECK && status[MOK_STATUS_OPEN]) return;
  if (when == EP_CLOSE && status[MOK_STATUS_BITS]) return;
  if (when == EP_OPEN) *tokens_out = tokens;
  const unsigned e = ++*epoch;
  const int half = (int)(e & 1) * EP_MAX;
  const unsigned long long mine = ((unsigned long long)e << 32) |
                                 (uint32_t)status[MOK_STATUS_BITS] |
                                 (1u << (MOK_CALL_SHIFT + call));
  for (int q = 0; q < ranks; q++) st_release_sys(tb->flags[q] + half + rank, mine);
  const unsigned long long *own = tb->flags[rank] + half;
  int32_t bits = 0;
  const uint64_t start = globaltimer_ns();
  for (int q = 0; q < ranks; q++) {
    unsigned long long v;
    while ((unsigned)((v = ld_acquire_sys(own + q)) >> 32) != e) {
      if ((long long)(globaltimer_ns() - start) > timeout_ns) {
        /* Said on the device, where it is known: which barrier and which rank never came (the
         * host sees only MOK_ERR_TIMEOUT). Printed at the caller's next synchronisation. */
        printf("mok: EP rank %d of %d: the %s barrier (epoch %u) timed out; rank %d is at epoch "
               "%u\n", rank, ranks, when == EP_OPEN ? "open" : when == EP_CHECK ? "check" : "close",
               e, q, (unsigned)(v >> 32));
        bits |= MOK_DEVERR_TIMEOUT;
        break;
      }
      __nanosleep(256);
    }
    if ((unsigned)(v >> 32) == e) bits |= (int32_t)(uint32_t)v;
  }
  const int32_t calls = bits & MOK_CALL_MASK; /* the kinds of call the ranks made */
  bits &= ~MOK_CALL_MASK;
  if (calls & (calls - 1)) bits |= MOK_DEVERR_PEER_CALL;
  status[MOK_STATUS_BITS] |= bits;
  if (when == EP_OPEN) status[MOK_STATUS_OPEN] = status[MOK_STATUS_BITS];
  if (bits) atomicOr(sticky, bits | (bits & MOK_DEVERR_PEER_CALL ? calls : 0));
}

cudaError_t ep_barrier_launch(const ep_table *tb, int rank, int ranks, int when, int call,
                              int32_t *status, int32_t *sticky, unsigned *epoch,
                              int32_t *tokens_out, int tokens, int32_t add, long long timeout_ns,
                              cudaStream_t stream) {
  ep_barrier<<<1, 1, 0, stream>>>(tb, rank, ranks, when, call, status, sticky, epoch, tokens_out,
                                  tokens, add, timeout_ns);
  return cudaGetLastError();
}

__global__ void ep_table_from_window(ncclWindow_t win, ep_offsets o, int ranks, size_t mark_at,
                                     ep_table *out, int32_t *bad) {
  for (int r = threadIdx.x; r < ranks; r += blockDim.x) {
    char *base = (char *)ncclGetPeerPointer(win, 0, r);
    ep_table_set(out, r, base, &o);
    if (*(volatile const int32_t *)(base + mark_at) != EP_MARK + r) *bad = 1;
  }
}

cudaError_t ep_table_from_window_launch(void *win, const ep_offsets *o, int ranks, size_t mark_at,
                                        ep_table *out, int32_t *bad, cudaStream_t stream) {
  ep_table_from_window<<<1, EP_MAX, 0, stream>>>((ncclWindow_t)win, *o, ranks, mark_at, out, bad);
  return cudaGetLastError();
}

/* Loads the kernels of this file now (see ep_preload in kernels.h for why). */
cudaError_t ep_preload(void) {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, (const void *)ep_barrier);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&a, (const void *)ep_table_from_window);
  return e;
}
