/*
 * tile_clock.cuh: a probe of where a GEMM tile's cycles go, compiled only with
 * -DMOK_TILE_CLOCK (tools/tile-clock.sh builds and runs it; the default build's SASS does not
 * change). Thread 0 of each consumer warpgroup adds, per product of a launch, the SM cycles of its
 * tiles' k-loops, their epilogues and what comes before each tile since the last (its first:
 * since the product began; phantom tiles fall there), the tiles and k-blocks, and the product's
 * span in cycles and in ns of the global timer (so the SM clock it ran at); the producer thread,
 * its cycles waiting for a free stage against its span (near 0: the loads are issued as late as
 * the consumers need them, the producer or the TMA unit behind it is the limit).
 * tclk_report, a one-thread kernel queued after each GEMM launch, prints the means per tile and
 * zeroes the counters. A printf inside a GEMM kernel would make ptxas serialise its wgmma (C7510),
 * hence the kernel of its own. The counters are global: one call at a time, one stream.
 */
#ifndef MOK_CUDA_TILE_CLOCK_CUH
#define MOK_CUDA_TILE_CLOCK_CUH

#ifdef MOK_TILE_CLOCK
#include <cstdio>

#include "cuda/ptx.cuh"

enum { TCLK_KLOOP, TCLK_EPI, TCLK_GAP, TCLK_TILES, TCLK_KB, TCLK_SPAN, TCLK_NS, TCLK_N };
#define TCLK_PRODUCTS 4
#define TCLK_SLOTS 320 /* two consumer warpgroups of up to 160 CTAs */

__device__ unsigned long long tclk[TCLK_PRODUCTS][TCLK_N][TCLK_SLOTS];
/* The producer thread's, per CTA: cycles waiting for a free stage, and its span of a product. */
__device__ unsigned long long tclk_p[TCLK_PRODUCTS][2][TCLK_SLOTS / 2];

static __device__ __forceinline__ unsigned tclk_now(void) {
  unsigned c;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(c));
  return c;
}

/* The counts are kept in registers through a product's tiles (32-bit: a difference of two clock
 * readings is right across a wrap) and added here once, at its last tile, by thread 0 of a consumer
 * warpgroup (the others return): a global add per tile put its load's latency, some 1000 cycles,
 * into the very times it measured. */
static __device__ __forceinline__ void tclk_add(int product, int what, unsigned long long v) {
  if (threadIdx.x % 128 == 0) tclk[product][what][blockIdx.x * 2 + threadIdx.x / 128 - 1] += v;
}

/* At a product's last tile, real or phantom (in the loop: code after a consumer's tile loop made
 * ptxas spill 800 bytes in down dgrad's epilogue); a last phantom's own cycles are not counted. */
static __device__ __forceinline__ void tclk_flush(int product, unsigned kloop, unsigned epi,
                                                  unsigned gap, unsigned tiles, unsigned kb,
                                                  unsigned span, unsigned long long ns) {
  tclk_add(product, TCLK_KLOOP, kloop);
  tclk_add(product, TCLK_EPI, epi);
  tclk_add(product, TCLK_GAP, gap);
  tclk_add(product, TCLK_TILES, tiles);
  tclk_add(product, TCLK_KB, kb);
  tclk_add(product, TCLK_SPAN, span);
  tclk_add(product, TCLK_NS, ns);
}

/* The producer's, at its last tile of a product. */
static __device__ __forceinline__ void tclk_pflush(int product, unsigned wait, unsigned span) {
  tclk_p[product][0][blockIdx.x] += wait;
  tclk_p[product][1][blockIdx.x] += span;
}
#define TCLK_PSTART                                                                           \
  unsigned p_wait = 0;                                                                        \
  const unsigned p_start = tclk_now();
#define TCLK_PFLUSH(P) tclk_pflush(P, p_wait, tclk_now() - p_start)

/* A consumer's counters over one product's tiles (TCLK_START before its tile loop), and their
 * flush (TCLK_FLUSH(P) at its last tile): the product's span in SM cycles and in ns of the
 * global timer too, so that the report can give the SM clock the product ran at. */
#define TCLK_START                                                                            \
  unsigned t_last = tclk_now(), c_kloop = 0, c_epi = 0, c_gap = 0, c_tiles = 0, c_kb = 0;     \
  const unsigned c_start = t_last;                                                            \
  const unsigned long long g_start = globaltimer_ns();
#define TCLK_FLUSH(P)                                                                         \
  tclk_flush(P, c_kloop, c_epi, c_gap, c_tiles, c_kb, tclk_now() - c_start,                  \
             globaltimer_ns() - g_start)

/* launch: 0 the forward's, 1 + gemm_kind - GEMM_DGRAD_DOWN a backward product's (names here:
 * a host string would be an illegal address on the device). */
static __global__ void tclk_report(int launch, int ctas) {
  const char *names[] = {"forward", "down dgrad", "gate/up dgrad", "weight gradient"};
  const char *what = names[launch];
  for (int p = 0; p < TCLK_PRODUCTS; p++) {
    unsigned long long s[TCLK_N] = {0}, pw = 0, ps = 0;
    for (int i = 0; i < 2 * ctas && i < TCLK_SLOTS; i++)
      for (int j = 0; j < TCLK_N; j++) s[j] += tclk[p][j][i], tclk[p][j][i] = 0;
    for (int i = 0; i < ctas && i < TCLK_SLOTS / 2; i++)
      pw += tclk_p[p][0][i], ps += tclk_p[p][1][i], tclk_p[p][0][i] = tclk_p[p][1][i] = 0;
    if (!s[TCLK_TILES]) continue;
    const double t = (double)s[TCLK_TILES];
    printf("tile clock | %s | product %d | tiles %llu | k-blocks/tile %.2f | cycles/tile: "
           "k-loop %.0f, epilogue %.0f, before %.0f | k-loop cycles/k-block %.0f | SM MHz %.0f | "
           "producer waiting %.2f\n",
           what, p, s[TCLK_TILES] / 2, s[TCLK_KB] / t, s[TCLK_KLOOP] / t, s[TCLK_EPI] / t,
           s[TCLK_GAP] / t, s[TCLK_KB] ? (double)s[TCLK_KLOOP] / s[TCLK_KB] : 0.0,
           s[TCLK_NS] ? 1e3 * s[TCLK_SPAN] / s[TCLK_NS] : 0.0, ps ? (double)pw / ps : 0.0);
  }
}

#define TCLK(...) __VA_ARGS__
#else
#define TCLK(...)
#endif

#endif
