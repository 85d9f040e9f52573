/*
 * backend.cu: the CUDA backend's function table (work in progress: context only).
 */
#include <cuda_runtime.h>

#include "internal.h"

extern "C" int mok_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

static mok_status cuda_context_init(mok_context *ctx) {
  int n = mok_cuda_device_count();
  if (n == 0) return mok_fail(MOK_ERR_UNSUPPORTED, "CUDA backend: no CUDA device is visible");
  int dev = ctx->cfg.device;
  if (dev < 0 || dev >= n)
    return mok_fail(MOK_ERR_INVALID_ARG, "device is %d; expected 0..%d", dev, n - 1);
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, dev) != cudaSuccess)
    return mok_fail(MOK_ERR_CUDA, "cudaGetDeviceProperties(%d) failed", dev);
  if (p.major != 9 || p.minor != 0)
    return mok_fail(MOK_ERR_UNSUPPORTED, "device %d (%s) is sm_%d%d; mok's kernels need sm_90 (Hopper)",
                    dev, p.name, p.major, p.minor);
  ctx->sm_count = p.multiProcessorCount;
  return MOK_OK;
}

static mok_status not_yet(void) {
  return mok_fail(MOK_ERR_UNSUPPORTED, "CUDA backend: not built yet");
}
static mok_status cuda_workspace_init(mok_workspace *) { return not_yet(); }
static void cuda_workspace_fini(mok_workspace *) {}
static mok_status cuda_schedule(mok_workspace *, const mok_forward_args *, void *) { return not_yet(); }
static mok_status cuda_forward(mok_workspace *, const mok_forward_args *, int, void *) { return not_yet(); }
static mok_status cuda_backward(mok_workspace *, const mok_backward_args *, void *) { return not_yet(); }
static mok_status cuda_check(mok_workspace *, void *, int32_t *) { return not_yet(); }
static mok_status cuda_copy_to_host(mok_workspace *, void *, const void *, size_t, void *) { return not_yet(); }

extern "C" const mok_backend_ops mok_cuda_ops = {
    "cuda", cuda_context_init, cuda_workspace_init, cuda_workspace_fini, cuda_schedule,
    cuda_forward, cuda_backward, cuda_check, cuda_copy_to_host};
