/*
 * ptx.cuh: every inline PTX instruction mok uses, one small wrapper each, named after the
 * instruction (and its ordering/scope where it has one). Nothing else in mok writes asm.
 * Section numbers cite the PTX ISA (version 8.x): 9.7.9.25 TMA (cp.async.bulk.tensor),
 * 9.7.13 mbarrier, 9.7.15 wgmma, 9.7.16.5 setmaxnreg, 9.7.12.3 barrier.cluster, 9.7.9.16 mapa,
 * 9.7.3.13 rcp, 9.7.3.21 ex2.
 */
#ifndef MOK_PTX_CUH
#define MOK_PTX_CUH

#include <cuda.h>
#include <stdint.h>

#define MOK_DEV static __device__ __forceinline__

/* ---- arithmetic ---------------------------------------------------------------------------- */
/* 2^x by the hardware approximation, subnormal inputs and results flushed to 0 (9.7.3.21).
 * __expf(x) = ex2.approx(x log2 e) without .ftz: per element, a compare and two conditional
 * multiplies keep its results below 2^-126 subnormal. */
MOK_DEV float ex2_approx_ftz(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

/* 1 / x by the hardware approximation, subnormal results flushed to 0 (9.7.3.13). __fdividef(1,
 * x) gives the same value for |x| <= 2^126. */
MOK_DEV float rcp_approx_ftz(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

/* ---- identity, time ----------------------------------------------------------------------- */
MOK_DEV uint64_t globaltimer_ns(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

MOK_DEV uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* ---- clusters ------------------------------------------------------------------------------- */
MOK_DEV uint32_t cluster_ctarank(void) {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

/* All threads of all CTAs of the cluster: orders barrier inits before peers use them, and keeps
 * a CTA alive until its peer no longer writes into its shared memory. */
MOK_DEV void cluster_sync(void) {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

/* The shared::cluster address of the same variable in CTA `rank` of the cluster. */
MOK_DEV uint32_t mapa_shared(const void *p, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
  return r;
}

/* Named barrier over `threads` threads (a multiple of 32); id 0 is __syncthreads'. */
MOK_DEV void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* Orders this thread's global accesses through the generic proxy (ld, st) with those through
 * the async proxy (TMA), both ways: stores that a later TMA load in another CTA reads. */
MOK_DEV void fence_proxy_async_global(void) {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

MOK_DEV unsigned ld_acquire_gpu(const unsigned *p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

MOK_DEV unsigned atom_add_acq_rel_gpu(unsigned *p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v)
               : "memory");
  return old;
}

MOK_DEV void st_release_gpu(unsigned *p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* 16 bytes from global to shared memory, not through L1 and without holding registers
 * (cp.async.cg, 9.7.9.25.3), in this thread's current group; cp_async_commit closes the group;
 * cp_async_wait<N> waits until at most N of this thread's groups are still in flight. */
MOK_DEV void cp_async_16(void *smem, const void *gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(smem)), "l"(gmem)
               : "memory");
}
MOK_DEV void cp_async_commit(void) { asm volatile("cp.async.commit_group;" ::: "memory"); }
MOK_DEV uint4 ld_shared_u4(const void *p) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_u32(p))
               : "memory");
  return v;
}
MOK_DEV float ld_shared_f32(const void *p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(smem_u32(p)) : "memory");
  return v;
}
MOK_DEV float2 ld_shared_f32x2(const void *p) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(smem_u32(p))
               : "memory");
  return v;
}
template <int N> MOK_DEV void cp_async_wait(void) {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/* ---- phases of one launch: a grid barrier ---------------------------------------------------- */
/* Every thread of every CTA of the grid (a cooperative launch: all resident) meets here between
 * two phases of one launch, as it would at a kernel boundary: sync[0] counts the CTAs
 * arrived, sync[1] the barriers passed (the last to arrive resets the count, then releases the
 * new generation), both zero when the workspace is made and left so by every barrier. Thread 0
 * arrives for its CTA after the CTA's threads have fenced their stores (membar.gl, bar.sync,
 * then its own fence and an acq_rel add), and the last arrival releases what every arrival
 * acquired. A GEMM phase reads the phase before by TMA, so each thread's stores are fenced into
 * the async proxy first, and thread 0 fences again after its acquire. `threads`: the CTA's (the
 * CTA barrier is named barrier 3, which no other code uses). */
MOK_DEV void grid_sync(unsigned *sync, uint32_t threads) {
  fence_proxy_async_global();
  __threadfence();
  named_barrier_sync(3, threads);
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned gen = ld_acquire_gpu(&sync[1]); /* before this CTA arrives */
    if (atom_add_acq_rel_gpu(&sync[0], 1u) == gridDim.x - 1) {
      sync[0] = 0;
      st_release_gpu(&sync[1], gen + 1);
    } else {
      while (ld_acquire_gpu(&sync[1]) == gen) __nanosleep(64);
    }
    __threadfence();
    fence_proxy_async_global();
  }
  named_barrier_sync(3, threads);
}

/* ---- mbarrier (9.7.13) -------------------------------------------------------------------- */
MOK_DEV void mbarrier_init(uint64_t *bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

/* Makes mbarrier.init visible to the async proxy (TMA) before first use. */
MOK_DEV void fence_mbarrier_init(void) {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

MOK_DEV void mbarrier_arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar))
               : "memory");
}

/* Arrives on an mbarrier of any CTA of the cluster (address from mapa_shared). The default
 * .release.cta is enough: what the arrival publishes is that our wgmma reads of the stage are
 * complete (wgmma.wait_group), not any write; a .cluster-scope release would fence every k-block
 * (measured: 40 % slower, perf-log 2026-12-02). */
MOK_DEV void mbarrier_arrive_cluster(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr) : "memory");
}

/* Arrives and tells the barrier to wait for `bytes` more bytes of TMA traffic. */
MOK_DEV void mbarrier_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;"
               ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

MOK_DEV int mbarrier_try_wait_parity(uint64_t *bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n"
      " mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  return (int)done;
}

/* Waits for the phase with this parity to complete. A pipeline bug must not hang the GPU: after
 * ~10 s of waiting the kernel traps (the launch then fails with an error). */
MOK_DEV void mbarrier_wait_parity(uint64_t *bar, uint32_t parity) {
  if (mbarrier_try_wait_parity(bar, parity)) return;
  uint64_t start = globaltimer_ns();
  for (uint32_t spins = 1;; spins++) {
    if (mbarrier_try_wait_parity(bar, parity)) return;
    if ((spins & 1023u) == 0 && globaltimer_ns() - start > 10000000000ull) __trap();
  }
}

/* ---- TMA: bulk tensor copies global -> shared, completing on an mbarrier (9.7.9.25) ------- */
MOK_DEV void tma_load_2d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1) : "memory");
}

MOK_DEV void tma_load_3d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1,
                         int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];"
      ::"r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

/* Multicast: the box lands at the same offset in every CTA of `cta_mask`, each completing its
 * own mbarrier at the same offset. */
MOK_DEV void tma_load_2d_multicast(void *dst, const CUtensorMap *map, uint64_t *bar, int c0,
                                   int c1, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;"
      ::"r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

MOK_DEV void tma_load_3d_multicast(void *dst, const CUtensorMap *map, uint64_t *bar, int c0,
                                   int c1, int c2, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4, %5}], [%2], %6;"
      ::"r"(smem_u32(dst)), "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2),
        "h"(cta_mask)
      : "memory");
}

MOK_DEV void prefetch_tensormap(const CUtensorMap *map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

/* ---- register reallocation between warpgroups (9.7.16.5) --------------------------------- */
template <int N> MOK_DEV void setmaxnreg_inc(void) {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N> MOK_DEV void setmaxnreg_dec(void) {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

/* ---- wgmma (9.7.15) ----------------------------------------------------------------------- */
/* Shared-memory matrix descriptor (9.7.15.5.1): start address, leading and stride byte offsets
 * (all >> 4), 128-byte swizzle (mode 1 in bits 62-63). For the 128B-swizzled layouts mok uses:
 *   K-major:  rows of 64 bf16 (128 B); SBO = 1024 B between 8-row groups; LBO unused.
 *   MN-major: 64 M/N-contiguous bf16 per 128 B K-row; SBO = 1024 B between 8-K-row groups,
 *             LBO = bytes between 64-wide M/N blocks. */
MOK_DEV uint64_t smem_desc_sw128(const void *start, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t d = 0;
  d |= (uint64_t)((smem_u32(start) & 0x3ffff) >> 4);
  d |= (uint64_t)((lbo_bytes >> 4) & 0x3fff) << 16;
  d |= (uint64_t)((sbo_bytes >> 4) & 0x3fff) << 32;
  d |= (uint64_t)1 << 62;
  return d;
}

MOK_DEV void wgmma_fence(void) { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
MOK_DEV void wgmma_commit_group(void) {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> MOK_DEV void wgmma_wait_group(void) {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

/* Keeps the compiler from moving accumulator reads/writes across wgmma boundaries. */
MOK_DEV void fence_operand(float &r) { asm volatile("" : "+f"(r)::"memory"); }

/* D[64x256] += A[64x16] * B[16x256], bf16 in, fp32 accumulate, A and B from shared memory.
 * The suffix says how A and B lie in shared memory: k = K-major, t = MN-major ("transposed"). */
#define MOK_WGMMA_M64N256K16(NAME, TA, TB)                                                      \
  MOK_DEV void NAME(float *d, uint64_t da, uint64_t db) {                                      \
    asm volatile(                                                                              \
        "{\n"                                                                                  \
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "                              \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, 1, 1, 1, " #TA ", " #TB ";\n"                                     \
        "}\n"                                                                                  \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),\
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),\
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),\
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),\
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),\
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),\
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),\
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),\
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),\
      "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),\
      "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),\
      "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),\
      "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),\
      "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),\
      "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),\
      "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                                                                                 \
        : "l"(da), "l"(db));                                                                   \
  }
MOK_WGMMA_M64N256K16(wgmma_256_kk, 0, 0)
MOK_WGMMA_M64N256K16(wgmma_256_kt, 0, 1)
MOK_WGMMA_M64N256K16(wgmma_256_tt, 1, 1)
#undef MOK_WGMMA_M64N256K16

/* D[64x128] = A[64x32] * B[32x128] (+ D when accumulate), e4m3 in, fp32 accumulate, A and B
 * K-major in shared memory (8-bit wgmma takes no other layout). scale-d is a predicate: 0 gives
 * D = A B without reading D (9.7.15.5.1). */
MOK_DEV void wgmma_128_e4m3(float *d, uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(accumulate));
}

/* Two e4m3 codes, lo in the low byte: round to nearest even, saturating (9.7.8.21, cvt); the
 * rule of mok_e4m3_encode (src/fp8.h). */
MOK_DEV uint16_t cvt_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

#endif /* MOK_PTX_CUH */
