/*
 * test_mxfp8.c: mok_mxfp8_to_bf16 on the CUDA backend (DESIGN §8.5) against the CPU backend's
 * bytes: every code under every scale byte that fits, random rows from one block to more
 * threads than the grid holds (its grid-stride loop), blocks of scale bytes 247..254 holding
 * only values that fit, scales at an odd address; a NaN scale byte and a value of 2^128
 * reported by mok_check with out untouched, and the next call (the verdict cleared) right; the
 * call captured in a CUDA graph and replayed on new inputs.
 */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"
#include "fp8.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(rng >> 33);
}

/* One CPU and one CUDA workspace of a small shape. */
typedef struct pair {
  mok_context *cpu_ctx, *gpu_ctx;
  mok_workspace *cpu, *gpu;
} pair;

static int pair_init(pair *p) {
  memset(p, 0, sizeof *p);
  mok_shape s = {1, 128, 128, 0, 1, 1, MOK_BF16, 0};
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  CHECK_OK(mok_context_create(&cfg, &p->cpu_ctx));
  cfg.backend = MOK_BACKEND_CUDA;
  CHECK_OK(mok_context_create(&cfg, &p->gpu_ctx));
  if (!p->cpu_ctx || !p->gpu_ctx) return 0;
  CHECK_OK(mok_workspace_create(p->cpu_ctx, &s, &p->cpu));
  CHECK_OK(mok_workspace_create(p->gpu_ctx, &s, &p->gpu));
  return p->cpu && p->gpu;
}

static void pair_fini(pair *p) {
  mok_workspace_destroy(p->cpu);
  mok_workspace_destroy(p->gpu);
  mok_context_destroy(p->cpu_ctx);
  mok_context_destroy(p->gpu_ctx);
}

/* Random MX rows: every code; scale bytes 0..254, where a byte above MOK_E8M0_FITS gets codes
 * of magnitude 1.0 at most (its values stay below 2^128). */
static void fill(uint8_t *q, uint8_t *s, int64_t rows, int64_t k) {
  for (int64_t i = 0; i < rows * k / MOK_MX_BLOCK; i++) {
    s[i] = (uint8_t)(rnd() % 255);
    for (int j = 0; j < MOK_MX_BLOCK; j++)
      q[i * MOK_MX_BLOCK + j] = (uint8_t)(s[i] > MOK_E8M0_FITS ? (rnd() % 0x39) | (rnd() % 2) << 7
                                                                : rnd() % 256);
  }
}

/* The GPU's bytes for (q, s + s_off) against the CPU's; out poisoned first. */
static void compare(pair *p, const char *tag, const uint8_t *q, const uint8_t *s, int64_t rows,
                    int64_t k, int s_off) {
  const size_t n = (size_t)(rows * k), ns = n / MOK_MX_BLOCK;
  uint16_t *ref = test_alloc(n * 2), *got = test_alloc(n * 2);
  CHECK_OK(mok_mxfp8_to_bf16(p->cpu, rows, k, q, s, ref, NULL));
  uint8_t *dq = NULL, *ds = NULL;
  uint16_t *dout = NULL;
  CUDA_CHECK(cudaMalloc((void **)&dq, n));
  CUDA_CHECK(cudaMalloc((void **)&ds, ns + 16));
  CUDA_CHECK(cudaMalloc((void **)&dout, n * 2));
  if (dq && ds && dout) {
    CUDA_CHECK(cudaMemcpy(dq, q, n, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(ds + s_off, s, ns, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(dout, 0xff, n * 2));
    CHECK_OK(mok_mxfp8_to_bf16(p->gpu, rows, k, dq, ds + s_off, dout, NULL));
    CHECK_OK(mok_check(p->gpu, NULL));
    CUDA_CHECK(cudaMemcpy(got, dout, n * 2, cudaMemcpyDeviceToHost));
    same_bits(tag, got, ref, n * 2);
  }
  cudaFree(dq), cudaFree(ds), cudaFree(dout);
  free(ref), free(got);
}

static void vs_cpu(void) {
  pair p;
  if (pair_init(&p)) {
    /* every code under every byte that fits whatever the codes */
    enum { K = 256, R = MOK_E8M0_FITS + 1 };
    uint8_t *q = test_alloc(R * K), *s = test_alloc(R * K / MOK_MX_BLOCK);
    for (int r = 0; r < R; r++) {
      for (int c = 0; c < K; c++) q[r * K + c] = (uint8_t)c;
      memset(s + r * K / MOK_MX_BLOCK, r, K / MOK_MX_BLOCK);
    }
    compare(&p, "every code and scale byte", q, s, R, K, 0);
    free(q), free(s);
    const int64_t shapes[][2] = {{1, 32}, {7, 96}, {300, 7168}, {2048, 7168}, {33, 2880}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
      const int64_t rows = shapes[i][0], k = shapes[i][1];
      q = test_alloc((size_t)(rows * k));
      s = test_alloc((size_t)(rows * k / MOK_MX_BLOCK));
      fill(q, s, rows, k);
      char tag[64];
      snprintf(tag, sizeof tag, "%lld x %lld", (long long)rows, (long long)k);
      compare(&p, tag, q, s, rows, k, (int)(i % 2)); /* odd shapes: scales at an odd byte */
      free(q), free(s);
    }
  }
  pair_fini(&p);
}

/* A bad block makes mok_check fail and leaves out as it was; the next good call is right. */
static void refusals(void) {
  pair p;
  if (pair_init(&p)) {
    enum { R = 64, K = 1024 };
    const size_t n = R * K, ns = n / MOK_MX_BLOCK;
    uint8_t *q = test_alloc(n), *s = test_alloc(ns);
    uint16_t *ref = test_alloc(n * 2), *got = test_alloc(n * 2), *poison = test_alloc(n * 2);
    fill(q, s, R, K);
    memset(poison, 0x5a, n * 2);
    CHECK_OK(mok_mxfp8_to_bf16(p.cpu, R, K, q, s, ref, NULL));
    uint8_t *dq = NULL, *ds = NULL;
    uint16_t *dout = NULL;
    CUDA_CHECK(cudaMalloc((void **)&dq, n));
    CUDA_CHECK(cudaMalloc((void **)&ds, ns));
    CUDA_CHECK(cudaMalloc((void **)&dout, n * 2));
    for (int bad = 0; bad < 2 && dq && ds && dout; bad++) {
      const size_t at = ns - 1 - 7 * (size_t)bad; /* a block near the end */
      uint8_t *q2 = test_alloc(n), *s2 = test_alloc(ns);
      memcpy(q2, q, n), memcpy(s2, s, ns);
      if (bad == 0) s2[at] = MOK_E8M0_NAN;
      else s2[at] = 250, q2[at * MOK_MX_BLOCK + 3] = 0x60; /* 32 * 2^123 = 2^128 */
      CUDA_CHECK(cudaMemcpy(dq, q2, n, cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(ds, s2, ns, cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(dout, poison, n * 2, cudaMemcpyHostToDevice));
      CHECK_OK(mok_mxfp8_to_bf16(p.gpu, R, K, dq, ds, dout, NULL));
      const mok_status st = mok_check(p.gpu, NULL);
      CHECK(st == MOK_ERR_INVALID_ARG, "%s: mok_check gave %s", bad ? "2^128" : "NaN byte",
            mok_status_name(st));
      CUDA_CHECK(cudaMemcpy(got, dout, n * 2, cudaMemcpyDeviceToHost));
      same_bits(bad ? "2^128: out untouched" : "NaN byte: out untouched", got, poison, n * 2);
      /* the good inputs again: the verdict of the refused call does not stay */
      CUDA_CHECK(cudaMemcpy(dq, q, n, cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(ds, s, ns, cudaMemcpyHostToDevice));
      CHECK_OK(mok_mxfp8_to_bf16(p.gpu, R, K, dq, ds, dout, NULL));
      CHECK_OK(mok_check(p.gpu, NULL));
      CUDA_CHECK(cudaMemcpy(got, dout, n * 2, cudaMemcpyDeviceToHost));
      same_bits("after a refused call", got, ref, n * 2);
      free(q2), free(s2);
    }
    /* host memory is refused at once */
    const mok_status st = mok_mxfp8_to_bf16(p.gpu, R, K, q, ds, dout, NULL);
    CHECK(st == MOK_ERR_INVALID_ARG, "host q: %s", mok_status_name(st));
    cudaFree(dq), cudaFree(ds), cudaFree(dout);
    free(q), free(s), free(ref), free(got), free(poison);
  }
  pair_fini(&p);
}

/* Captured once, replayed on two sets of inputs written into the same buffers. */
static void graph(void) {
  pair p;
  if (pair_init(&p)) {
    enum { R = 100, K = 2048 };
    const size_t n = R * K, ns = n / MOK_MX_BLOCK;
    uint8_t *q = test_alloc(n), *s = test_alloc(ns);
    uint16_t *ref = test_alloc(n * 2), *got = test_alloc(n * 2);
    uint8_t *dq = NULL, *ds = NULL;
    uint16_t *dout = NULL;
    CUDA_CHECK(cudaMalloc((void **)&dq, n));
    CUDA_CHECK(cudaMalloc((void **)&ds, ns));
    CUDA_CHECK(cudaMalloc((void **)&dout, n * 2));
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    CHECK_OK(mok_mxfp8_to_bf16(p.gpu, R, K, dq, ds, dout, st));
    CUDA_CHECK(cudaStreamEndCapture(st, &g));
    if (g) CUDA_CHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int rep = 0; rep < 2 && ge; rep++) {
      fill(q, s, R, K);
      CHECK_OK(mok_mxfp8_to_bf16(p.cpu, R, K, q, s, ref, NULL));
      CUDA_CHECK(cudaMemcpy(dq, q, n, cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(ds, s, ns, cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemset(dout, 0xff, n * 2));
      CUDA_CHECK(cudaGraphLaunch(ge, st));
      CHECK_OK(mok_check(p.gpu, st));
      CUDA_CHECK(cudaMemcpy(got, dout, n * 2, cudaMemcpyDeviceToHost));
      same_bits(rep ? "graph replay 2" : "graph replay 1", got, ref, n * 2);
    }
    if (ge) cudaGraphExecDestroy(ge);
    if (g) cudaGraphDestroy(g);
    cudaStreamDestroy(st);
    cudaFree(dq), cudaFree(ds), cudaFree(dout);
    free(q), free(s), free(ref), free(got);
  }
  pair_fini(&p);
}

const test_case tests_gpu_mxfp8[] = {
    {"gpu/mxfp8_to_bf16_vs_cpu", vs_cpu},
    {"gpu/mxfp8_to_bf16_refusals", refusals},
    {"gpu/mxfp8_to_bf16_graph", graph},
    {NULL, NULL},
};
