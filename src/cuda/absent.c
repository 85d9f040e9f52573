/*
 * absent.c: the CUDA backend and the NCCL groups of a libmok built without the CUDA toolkit (make
 * WITH_CUDA=0, or no nvcc found). Every entry point says so: a context for MOK_BACKEND_CUDA and
 * an NCCL group fail with MOK_ERR_UNSUPPORTED, and no CUDA device is visible. Since no CUDA
 * context is ever made, no other function of the table is reached.
 */
#include "internal.h"

#define ABSENT                                                                                \
  "this libmok was built without the CUDA backend (no nvcc where it was built); build it "   \
  "where the CUDA toolkit is (make, or pip install with nvcc on PATH), or use "              \
  "MOK_BACKEND_CPU"

int mok_cuda_device_count(void) { return 0; }

static mok_status absent_context_init(mok_context *ctx) {
  (void)ctx;
  return mok_fail(MOK_ERR_UNSUPPORTED, "%s", ABSENT);
}

const mok_backend_ops mok_cuda_ops = {.name = "cuda (not built)",
                                      .context_init = absent_context_init};

/* Never reached either: a router needs a context. */
const mok_router_ops mok_cuda_router_ops = {.init = NULL};

mok_status mok_nccl_id(unsigned char id[MOK_NCCL_ID_BYTES]) {
  (void)id;
  return mok_fail(MOK_ERR_UNSUPPORTED, "NCCL groups: %s", ABSENT);
}

mok_status mok_ep_group_create_nccl(struct ncclComm *comm, int timeout_ms, mok_ep_group **out) {
  (void)comm, (void)timeout_ms;
  if (out) *out = NULL;
  return mok_fail(MOK_ERR_UNSUPPORTED, "NCCL groups: %s", ABSENT);
}

mok_status mok_ep_group_create_nccl_id(const unsigned char id[MOK_NCCL_ID_BYTES], int rank,
                                       int ranks, int device, int timeout_ms,
                                       mok_ep_group **out) {
  (void)id, (void)rank, (void)ranks, (void)device, (void)timeout_ms;
  if (out) *out = NULL;
  return mok_fail(MOK_ERR_UNSUPPORTED, "NCCL groups: %s", ABSENT);
}
