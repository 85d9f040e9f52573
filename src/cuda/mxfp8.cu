/*
 * mxfp8.cu: mok_mxfp8_to_bf16 on the GPU (DESIGN §8.5), by the rules of src/fp8.h, so the bytes
 * are the CPU backend's. A refused call must leave out untouched, and which blocks are bad is
 * known only on the device: mx_check looks at every block first and raises MOK_DEVERR_MXFP8 in
 * the call's verdict word and the workspace's sticky bits (mok_check reports it); mx_decode,
 * after it on the stream, writes out only if the verdict is clear. The verdict is zeroed on the
 * stream before them, so the call never waits for the host and may be captured in a graph.
 */
#include "cuda/backend.h"
#include "fp8.h"

#define MX_THREADS 256
#define MX_MAX_CTAS 4096 /* grid-stride beyond this */

static unsigned mx_grid(int64_t items) {
  const int64_t n = (items + MX_THREADS - 1) / MX_THREADS;
  return (unsigned)(n < MX_MAX_CTAS ? n : MX_MAX_CTAS);
}

/* One thread a block of 32 values; only scale bytes above MOK_E8M0_FITS make it read the codes. */
__global__ void __launch_bounds__(MX_THREADS)
    mx_check(const uint8_t *q, const uint8_t *scales, int64_t blocks, int32_t *verdict,
             int32_t *sticky) {
  for (int64_t i = blockIdx.x * (int64_t)MX_THREADS + threadIdx.x; i < blocks;
       i += (int64_t)gridDim.x * MX_THREADS) {
    const uint8_t b = scales[i];
    if (b <= MOK_E8M0_FITS) continue;
    const uint4 *src = (const uint4 *)(q + i * MOK_MX_BLOCK); /* 16-byte aligned: k % 32 == 0 */
    uint4 c[2] = {src[0], src[1]};
    if (!mok_mx_block_ok((const uint8_t *)c, b)) {
      atomicOr(verdict, MOK_DEVERR_MXFP8);
      atomicOr(sticky, MOK_DEVERR_MXFP8);
    }
  }
}

/* One thread 8 values (a quarter of a block): 8 code bytes in, 16 bytes of bf16 out. */
__global__ void __launch_bounds__(MX_THREADS)
    mx_decode(const uint8_t *q, const uint8_t *scales, int64_t eighths, const int32_t *verdict,
              uint16_t *out) {
  if (*verdict) return;
  for (int64_t i = blockIdx.x * (int64_t)MX_THREADS + threadIdx.x; i < eighths;
       i += (int64_t)gridDim.x * MX_THREADS) {
    const uint8_t b = scales[i / (MOK_MX_BLOCK / 8)];
    const uint2 in = ((const uint2 *)q)[i];
    uint32_t w[4];
    for (int j = 0; j < 4; j++) {
      const uint32_t word = j < 2 ? in.x : in.y, sh = 16 * (j & 1);
      w[j] = (uint32_t)mok_mx_to_bf16((uint8_t)(word >> sh), b) |
             (uint32_t)mok_mx_to_bf16((uint8_t)(word >> (sh + 8)), b) << 16;
    }
    ((uint4 *)out)[i] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

cudaError_t mxfp8_preload(void) {
  cudaFuncAttributes f;
  cudaError_t e = cudaFuncGetAttributes(&f, mx_check);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&f, mx_decode);
  return e;
}

mok_status cuda_mxfp8_to_bf16(mok_workspace *ws, int64_t rows, int64_t k, const void *q,
                              const void *scales, void *out, void *stream) {
  device_guard g;
  TRY(device_enter(ws->ctx, &g));
  mok_status st = check_device(q, "q");
  if (st == MOK_OK) st = check_device(scales, "scales");
  if (st == MOK_OK) st = check_device(out, "out");
  if (st == MOK_OK) {
    cuda_ws *cw = (cuda_ws *)ws->backend;
    int32_t *verdict = AT(cw->mem, cw->L.mx, int32_t), *sticky = AT(cw->mem, cw->L.sticky, int32_t);
    const cudaStream_t s = (cudaStream_t)stream;
    const int64_t blocks = rows * (k / MOK_MX_BLOCK), eighths = rows * k / 8;
    cudaError_t e = cudaMemsetAsync(verdict, 0, sizeof *verdict, s);
    if (e == cudaSuccess) {
      mx_check<<<mx_grid(blocks), MX_THREADS, 0, s>>>((const uint8_t *)q, (const uint8_t *)scales,
                                                     blocks, verdict, sticky);
      mx_decode<<<mx_grid(eighths), MX_THREADS, 0, s>>>((const uint8_t *)q,
                                                        (const uint8_t *)scales, eighths, verdict,
                                                        (uint16_t *)out);
      e = cudaGetLastError();
    }
    if (e != cudaSuccess) st = cuda_fail(e, "mok_mxfp8_to_bf16");
  }
  device_leave(ws->ctx, &g);
  return st;
}
