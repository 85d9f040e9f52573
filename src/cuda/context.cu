/*
 * context.cu: the CUDA backend's device: which GPUs it runs on, the context (kernel attributes,
 * every kernel loaded, how many CTAs the persistent kernels take), the device guard, and the
 * calls that wait for the device (mok_check, copies to the host).
 */
#include <stdlib.h>
#include <string.h>

#include "cuda/backend.h"

extern "C" int mok_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

mok_status cuda_fail(cudaError_t e, const char *what) {
  return mok_fail(MOK_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

mok_status device_enter(const mok_context *ctx, device_guard *g) {
  g->ok = 0;
  CUDA_TRY(cudaGetDevice(&g->prev), "cudaGetDevice");
  if (g->prev != ctx->cfg.device) CUDA_TRY(cudaSetDevice(ctx->cfg.device), "cudaSetDevice");
  g->ok = 1;
  return MOK_OK;
}

void device_leave(const mok_context *ctx, device_guard *g) {
  if (g->ok && g->prev != ctx->cfg.device) cudaSetDevice(g->prev);
}

mok_status cuda_context_init(mok_context *ctx) {
  int n = mok_cuda_device_count();
  if (n == 0) return mok_fail(MOK_ERR_UNSUPPORTED, "CUDA backend: no CUDA device is visible");
  int dev = ctx->cfg.device;
  if (dev < 0 || dev >= n)
    return mok_fail(MOK_ERR_INVALID_ARG, "device is %d; expected 0..%d", dev, n - 1);
  cudaDeviceProp p;
  CUDA_TRY(cudaGetDeviceProperties(&p, dev), "cudaGetDeviceProperties");
  if (p.major != 9 || p.minor != 0)
    return mok_fail(MOK_ERR_UNSUPPORTED,
                    "device %d (%s) is sm_%d%d; mok's kernels need sm_90 (Hopper)", dev, p.name,
                    p.major, p.minor);
  if (tma_init() != 0)
    return mok_fail(MOK_ERR_UNSUPPORTED,
                    "the CUDA driver has no cuTensorMapEncodeTiled (need 12.0+)");
  device_guard g;
  int max_ctas[2] = {0, 0}, max_ctas8 = 0;
  TRY(device_enter(ctx, &g));
  cudaError_t e = gemm_init(max_ctas);
  if (e == cudaSuccess) e = gemm8_init(&max_ctas8);
  if (e == cudaSuccess) e = quant_preload();
  if (e == cudaSuccess) e = ep_preload();
  if (e == cudaSuccess) e = rows_preload();
  if (e == cudaSuccess) e = schedule_preload();
  if (e == cudaSuccess) e = router_preload();
  if (e == cudaSuccess) e = mxfp8_preload();
  device_leave(ctx, &g);
  if (e != cudaSuccess) return cuda_fail(e, "GEMM kernel attributes");
  ctx->sm_count = p.multiProcessorCount;
  if (ctx->cfg.sms > 0 && ctx->cfg.sms < ctx->sm_count) ctx->sm_count = ctx->cfg.sms;
  /* Emulated ranks share this GPU. A persistent GEMM needs all its CTAs resident at once, and a
   * rank waiting at a barrier holds an SM until its peers arrive: with every rank's GEMM asking
   * for every SM, a peer's GEMM could wait for its last CTA forever. So each rank's GEMMs get an
   * equal share of the clusters left when every rank's barrier spoils one cluster's place (a
   * cluster must fit in one GPC: 4 ranks' GEMMs of 8 clusters of 4 each hung on the H200). They
   * run clusters of 2 (cluster_shape). */
  const int R = ctx->cfg.group && !ctx->cfg.group->nccl ? ctx->cfg.ep_size : 0;
  for (int i = 0; i < 2; i++) {
    const int C = GEMM_CM * (i + 1);
    int n = (ctx->sm_count < max_ctas[i] ? ctx->sm_count : max_ctas[i]) / C;
    if (R) n = (n - R) / R;
    ctx->gemm_ctas[i] = n < 1 ? C : n * C;
  }
  int n8 = (ctx->sm_count < max_ctas8 ? ctx->sm_count : max_ctas8) / GEMM_CM;
  if (R) n8 = (n8 - R) / R;
  ctx->gemm8_ctas = n8 < 1 ? GEMM_CM : n8 * GEMM_CM;
  return MOK_OK;
}

/* Host-checkable: every pointer the kernels touch must be device memory. */
mok_status check_device(const void *p, const char *name) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return mok_fail(MOK_ERR_INVALID_ARG, "%s (%p) is not a CUDA pointer", name, p);
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "%s (%p) is host memory; the CUDA backend needs device pointers", name, p);
  return MOK_OK;
}

mok_status cuda_check(mok_workspace *ws, void *stream, int32_t *bits) {
  cuda_ws *cw = (cuda_ws *)ws->backend;
  device_guard g;
  TRY(device_enter(ws->ctx, &g));
  int32_t *sticky = AT(cw->mem, cw->L.sticky, int32_t);
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
  if (e == cudaSuccess) e = cudaMemcpy(bits, sticky, sizeof *bits, cudaMemcpyDeviceToHost);
  if (e == cudaSuccess) e = cudaMemset(sticky, 0, sizeof *bits);
  device_leave(ws->ctx, &g);
  return e == cudaSuccess ? MOK_OK : cuda_fail(e, "mok_check");
}

mok_status cuda_copy_to_host(mok_workspace *ws, void *dst, const void *src, size_t bytes,
                                    void *stream) {
  device_guard g;
  TRY(device_enter(ws->ctx, &g));
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
  if (e == cudaSuccess) e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
  device_leave(ws->ctx, &g);
  return e == cudaSuccess ? MOK_OK : cuda_fail(e, "copy to host");
}
