/*
 * quant.cu: FP8 quantization on the GPU, the rules of src/fp8.h (DESIGN §8.1) applied to tiles
 * of 128 x 128 bf16 values held in shared memory: per row of the tile (Q_row: one 128-column
 * group), per column (Q_col: one 128-row block) or the whole tile (Q_blk, the weights), codes
 * written row-major and, for Q_col and Q_blk, transposed (the K-major operands of the products
 * that reduce over rows). The scale of a group is the power of two of its amax, so the codes are
 * the CPU reference's byte for byte.
 */
#include "cuda/kernels.h"
#include "cuda/ptx.cuh"
#include "fp8.h"
#include "internal.h"

#define QT 128          /* tile side */
#define QPAD 8          /* bf16 of padding a row of the tile, against bank conflicts */
#define QTHREADS 256    /* two threads a row (or column), 64 values each */

typedef struct __align__(16) quant_tile { /* tile_load stores 16 bytes at a time */
  __nv_bfloat16 v[QT][QT + QPAD];
} quant_tile;

/* Tile (r0, c0) of src [rows, cols] into shared memory, zeros outside. */
MOK_DEV void tile_load(quant_tile *t, const __nv_bfloat16 *src, int64_t ld, int rows, int cols,
                       int r0, int c0) {
  for (int i = threadIdx.x; i < QT * QT / 8; i += QTHREADS) {
    const int r = i / (QT / 8), c = (i % (QT / 8)) * 8;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (r0 + r < rows && c0 + c < cols) /* cols is a multiple of 8 */
      x = __ldg((const uint4 *)(src + (size_t)(r0 + r) * ld + c0 + c));
    *(uint4 *)&t->v[r][c] = x;
  }
  __syncthreads();
}

/* Where routed row r's values are (quant_args: gathered rows), or NULL for zeros. */
MOK_DEV const __nv_bfloat16 *gathered_row(const quant_args *a, int r) {
  if (r >= a->rows) return NULL;
  const int src = a->row_src[r];
  if (src < 0) return NULL; /* padding */
  const int owner = src / a->slots_cap, t = src % a->slots_cap / a->k;
  const __nv_bfloat16 *base =
      owner == a->rank ? a->own : a->dy ? a->peers->dy[owner] : a->peers->x[owner];
  return base + (size_t)t * a->ld_src;
}

/* Tile (r0, c0) of the gathered rows into shared memory, zeros outside. */
MOK_DEV void tile_gather(quant_tile *t, const quant_args *a, int r0, int c0) {
  __shared__ const __nv_bfloat16 *row[QT];
  if (threadIdx.x < QT) row[threadIdx.x] = gathered_row(a, r0 + threadIdx.x);
  __syncthreads();
  for (int i = threadIdx.x; i < QT * QT / 8; i += QTHREADS) {
    const int r = i / (QT / 8), c = (i % (QT / 8)) * 8;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (row[r] && c0 + c < a->cols) x = __ldg((const uint4 *)(row[r] + c0 + c));
    *(uint4 *)&t->v[r][c] = x;
  }
  __syncthreads();
}

MOK_DEV float tile_at(const quant_tile *t, int r, int c) { return __bfloat162float(t->v[r][c]); }

/* The 64 values of this thread (of a row, along=0, or a column, along=1) at half h. */
MOK_DEV float half_amax(const quant_tile *t, int line, int h, int along) {
  float m = 0.0f;
  for (int i = 0; i < 64; i++) {
    const float x = along ? tile_at(t, 64 * h + i, line) : tile_at(t, line, 64 * h + i);
    m = fmaxf(m, fabsf(x));
  }
  return m;
}

/* Encodes the thread's 64 values with 1 / scale `inv` into 64 bytes at dst (16-byte aligned),
 * the first `n` of them (a multiple of 16). */
MOK_DEV void half_encode(const quant_tile *t, int line, int h, int along, float inv, uint8_t *dst,
                         int n) {
  for (int i = 0; i < n; i += 16) {
    uint32_t w[4];
    for (int k = 0; k < 4; k++) {
      float x[4];
      for (int j = 0; j < 4; j++) {
        const int at = 64 * h + i + 4 * k + j;
        x[j] = along ? tile_at(t, at, line) : tile_at(t, line, at);
      }
      w[k] = (uint32_t)cvt_e4m3x2(x[0] * inv, x[1] * inv) |
             (uint32_t)cvt_e4m3x2(x[2] * inv, x[3] * inv) << 16;
    }
    *(uint4 *)(dst + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

/* Activations (quant_args): grid (row tiles, column tiles): rows may pass 65535 tiles, which
 * grid.y cannot hold. */
__global__ void __launch_bounds__(QTHREADS) quant_kernel(const quant_args a) {
  if (a.status && *a.status) return;
  const int r0 = blockIdx.x * QT, c0 = blockIdx.y * QT;
  if (a.filled && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    *a.filled = MOK_FILLED_ACTIVATIONS;
  if (a.live && r0 >= *a.live) return;
  __shared__ quant_tile t;
  if (a.src) tile_load(&t, a.src, a.ld_src, a.rows, a.cols, r0, c0);
  else tile_gather(&t, &a, r0, c0);
  const int line = threadIdx.x / 2, h = threadIdx.x % 2;
  if (a.q) { /* Q_row: the row's group c0 / 128 (both threads of a row take the same branch) */
    float m = half_amax(&t, line, h, 0);
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    const int e = mok_fp8_scale_exp(m);
    /* codes up to the row's end (ld_q from a.q: the dû half's q starts I' in, and its column
     * tiles stop at I'), zero codes past cols */
    const int n = min(64, a.ld_q - c0 - 64 * h);
    if (r0 + line < a.rows) {
      if (n > 0)
        half_encode(&t, line, h, 0, mok_pow2f(-e),
                    a.q + (size_t)(r0 + line) * a.ld_q + c0 + 64 * h, n);
      if (h == 0) a.s[(size_t)(c0 / QT) * a.ld_s + r0 + line] = mok_pow2f(e);
    }
  }
  if (a.qt) { /* Q_col: the column's block r0 / 128, every row of the tile written */
    float m = half_amax(&t, line, h, 1);
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    const int e = mok_fp8_scale_exp(m);
    if (c0 + line < a.cols) {
      half_encode(&t, line, h, 1, mok_pow2f(-e),
                  a.qt + (size_t)(c0 + line) * a.ld_qt + r0 + 64 * h, 64);
      if (h == 0) a.st[(size_t)(r0 / QT) * a.ld_st + c0 + line] = mok_pow2f(e);
    }
  }
}

cudaError_t quant_launch(const quant_args *a, cudaStream_t stream) {
  const dim3 grid((a->rows + QT - 1) / QT, (a->cols + QT - 1) / QT);
  quant_kernel<<<grid, QTHREADS, 0, stream>>>(*a);
  return cudaGetLastError();
}

/* Weights: grid (K tiles, N tiles, E); one scale for the whole 128 x 128 block. Codes of the
 * rows that exist go to q; qt gets the transpose. */
__global__ void __launch_bounds__(QTHREADS)
    quant_weights_kernel(const __nv_bfloat16 *w, int N, int K, uint8_t *q, uint8_t *qt,
                         float *s) {
  const int e = blockIdx.z, n0 = blockIdx.y * QT, k0 = blockIdx.x * QT;
  const size_t plane = (size_t)N * K;
  __shared__ quant_tile t;
  __shared__ float warp_max[QTHREADS / 32];
  tile_load(&t, w + e * plane, K, N, K, n0, k0);
  const int line = threadIdx.x / 2, h = threadIdx.x % 2;
  float m = half_amax(&t, line, h, 0);
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  m = 0.0f;
  for (int i = 0; i < QTHREADS / 32; i++) m = fmaxf(m, warp_max[i]);
  const int ex = mok_fp8_scale_exp(m);
  const float inv = mok_pow2f(-ex);
  const int kn = min(64, K - k0 - 64 * h), nn = min(64, N - n0 - 64 * h);
  if (n0 + line < N && kn > 0) /* K and N are multiples of 16 (of 64, the CUDA backend's rule) */
    half_encode(&t, line, h, 0, inv, q + e * plane + (size_t)(n0 + line) * K + k0 + 64 * h, kn);
  if (k0 + line < K && nn > 0)
    half_encode(&t, line, h, 1, inv, qt + e * plane + (size_t)(k0 + line) * N + n0 + 64 * h, nn);
  if (threadIdx.x == 0) {
    const int ng = (N + QT - 1) / QT, kg = (K + QT - 1) / QT;
    s[((size_t)e * ng + blockIdx.y) * kg + blockIdx.x] = mok_pow2f(ex);
  }
}

cudaError_t quant_weights_launch(const __nv_bfloat16 *w, int64_t E, int64_t N, int64_t K,
                                 uint8_t *q, uint8_t *qt, float *s, cudaStream_t stream) {
  const dim3 grid((unsigned)((K + QT - 1) / QT), (unsigned)((N + QT - 1) / QT), (unsigned)E);
  quant_weights_kernel<<<grid, QTHREADS, 0, stream>>>(w, (int)N, (int)K, q, qt, s);
  return cudaGetLastError();
}

/* qt [E, K, N] <- q [E, N, K]: 64 x 64 byte tiles through shared memory. */
__global__ void __launch_bounds__(256)
    transpose_u8_kernel(const uint8_t *q, int N, int K, uint8_t *qt) {
  const int e = blockIdx.z, n0 = blockIdx.y * 64, k0 = blockIdx.x * 64;
  const size_t plane = (size_t)N * K;
  __shared__ uint8_t tile[64][64 + 4];
  for (int i = threadIdx.x; i < 64 * 64; i += 256) {
    const int n = i / 64, k = i % 64;
    tile[n][k] = n0 + n < N && k0 + k < K ? q[e * plane + (size_t)(n0 + n) * K + k0 + k] : 0;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 64 * 64; i += 256) {
    const int k = i / 64, n = i % 64;
    if (k0 + k < K && n0 + n < N) qt[e * plane + (size_t)(k0 + k) * N + n0 + n] = tile[n][k];
  }
}

cudaError_t transpose_u8_launch(const uint8_t *q, int64_t E, int64_t N, int64_t K, uint8_t *qt,
                                cudaStream_t stream) {
  const dim3 grid((unsigned)((K + 63) / 64), (unsigned)((N + 63) / 64), (unsigned)E);
  transpose_u8_kernel<<<grid, 256, 0, stream>>>(q, (int)N, (int)K, qt);
  return cudaGetLastError();
}

cudaError_t quant_preload(void) {
  cudaFuncAttributes f;
  cudaError_t e = cudaFuncGetAttributes(&f, quant_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&f, quant_weights_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&f, transpose_u8_kernel);
  return e;
}
