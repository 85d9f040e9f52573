/*
 * nccl.c: expert-parallel groups of processes, one GPU each, over an NCCL communicator (DESIGN
 * §2.3). NCCL is loaded with dlopen when the first such group is made, so that libmok runs
 * without NCCL wherever no NCCL group is used; the device side only needs NCCL's headers.
 */
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#if NCCL_VERSION_CODE < 22800
#error "NCCL groups need the headers of NCCL 2.28 or later (symmetric windows, device API)"
#endif


/* The NCCL functions mok calls. */
static struct {
  ncclResult_t (*GetVersion)(int *);
  const char *(*GetErrorString)(ncclResult_t);
  const char *(*GetLastError)(ncclComm_t);
  ncclResult_t (*GetUniqueId)(ncclUniqueId *);
  ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommCount)(const ncclComm_t, int *);
  ncclResult_t (*CommUserRank)(const ncclComm_t, int *);
  ncclResult_t (*CommCuDevice)(const ncclComm_t, int *);
  ncclResult_t (*MemAlloc)(void **, size_t);
  ncclResult_t (*MemFree)(void *);
  ncclResult_t (*CommWindowRegister)(ncclComm_t, void *, size_t, ncclWindow_t *, int);
  ncclResult_t (*CommWindowDeregister)(ncclComm_t, ncclWindow_t);
  ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                            cudaStream_t);
  struct lsa_team { int nRanks, rank, stride; } (*TeamLsa)(ncclComm_t); /* struct ncclTeam */
} nccl;
static char load_error[512]; /* "" once loaded */
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

static void load(void) {
  void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(load_error, sizeof load_error, "cannot load libnccl.so.2 (%s)", dlerror());
    return;
  }
  struct { void **fn; const char *name; } syms[] = {
      {(void **)&nccl.GetVersion, "ncclGetVersion"},
      {(void **)&nccl.GetErrorString, "ncclGetErrorString"},
      {(void **)&nccl.GetLastError, "ncclGetLastError"},
      {(void **)&nccl.GetUniqueId, "ncclGetUniqueId"},
      {(void **)&nccl.CommInitRank, "ncclCommInitRank"},
      {(void **)&nccl.CommDestroy, "ncclCommDestroy"},
      {(void **)&nccl.CommCount, "ncclCommCount"},
      {(void **)&nccl.CommUserRank, "ncclCommUserRank"},
      {(void **)&nccl.CommCuDevice, "ncclCommCuDevice"},
      {(void **)&nccl.MemAlloc, "ncclMemAlloc"},
      {(void **)&nccl.MemFree, "ncclMemFree"},
      {(void **)&nccl.CommWindowRegister, "ncclCommWindowRegister"},
      {(void **)&nccl.CommWindowDeregister, "ncclCommWindowDeregister"},
      {(void **)&nccl.AllGather, "ncclAllGather"},
      {(void **)&nccl.TeamLsa, "ncclTeamLsa"},
  };
  int version = 0;
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    *syms[i].fn = dlsym(h, syms[i].name);
    if (!*syms[i].fn) {
      snprintf(load_error, sizeof load_error,
               "libnccl.so.2 has no %s; NCCL groups need NCCL 2.28 or later", syms[i].name);
      return;
    }
  }
  nccl.GetVersion(&version);
  /* The device API is inline code over NCCL's window struct, compiled into mok's kernels from the
   * headers: the NCCL loaded must lay out the fields mok reads (lsaFlatBase, lsaRank, worldRank,
   * stride4G) as the headers do. Later releases have kept them in place (2.30.7's struct begins
   * as 2.28.9's), and ep_table_from_window's mark check fails the workspace should a release move
   * them to where they still read; an earlier release need not match (2.28.3's window under
   * 2.28.9's headers faulted on an H200), so it is refused here. */
  if (version < NCCL_VERSION_CODE)
    snprintf(load_error, sizeof load_error,
             "libnccl.so.2 is NCCL %d.%d.%d; mok's NCCL groups need the NCCL of the headers mok was "
             "built with (%d.%d.%d, NCCL_INC) or a later one: load a later NCCL (LD_LIBRARY_PATH, "
             "or torch's nvidia-nccl wheel) or build mok with the headers of this one",
             version / 10000, version / 100 % 100, version % 100, NCCL_MAJOR, NCCL_MINOR,
             NCCL_PATCH);
}

static mok_status loaded(void) {
  pthread_once(&load_once, load);
  return load_error[0] ? mok_fail(MOK_ERR_UNSUPPORTED, "%s", load_error) : MOK_OK;
}

static mok_status nccl_fail(ncclResult_t r, ncclComm_t comm, const char *what) {
  const char *last = comm ? nccl.GetLastError(comm) : "";
  return mok_fail(MOK_ERR_NCCL, "%s: %s%s%s", what, nccl.GetErrorString(r),
                  last && last[0] ? ": " : "", last ? last : "");
}

#define NCCL_TRY(expr, comm, what)                              \
  do {                                                          \
    ncclResult_t r_ = (expr);                                   \
    if (r_ != ncclSuccess) return nccl_fail(r_, (comm), (what)); \
  } while (0)

mok_status mok_nccl_id(unsigned char id[MOK_NCCL_ID_BYTES]) {
  if (!id) return mok_fail(MOK_ERR_INVALID_ARG, "id is NULL; expected %d bytes",
                           MOK_NCCL_ID_BYTES);
  mok_status st = loaded();
  if (st != MOK_OK) return st;
  ncclUniqueId u;
  NCCL_TRY(nccl.GetUniqueId(&u), NULL, "ncclGetUniqueId");
  memcpy(id, u.internal, MOK_NCCL_ID_BYTES);
  mok_clear_error();
  return MOK_OK;
}

/* The group's release: the communicator mok made from an id goes with it. */
static void destroy_comm(mok_ep_group *g) { nccl.CommDestroy((ncclComm_t)g->nccl); }

/* The group of `comm`: its size and this process's rank and device. */
static mok_status group_of(ncclComm_t comm, int owns, int timeout_ms, mok_ep_group **out) {
  int ranks = 0, rank = 0, device = 0;
  NCCL_TRY(nccl.CommCount(comm, &ranks), comm, "ncclCommCount");
  NCCL_TRY(nccl.CommUserRank(comm, &rank), comm, "ncclCommUserRank");
  NCCL_TRY(nccl.CommCuDevice(comm, &device), comm, "ncclCommCuDevice");
  if (ranks > MOK_EP_MAX)
    return mok_fail(MOK_ERR_UNSUPPORTED, "the communicator has %d ranks; mok's EP groups hold at "
                                         "most %d", ranks, MOK_EP_MAX);
  /* Dispatch and combine load and store peers' memory directly: every rank must reach every
   * other's (NCCL's LSA team, one NVLink or PCIe peer domain, is the whole communicator). */
  const int reach = nccl.TeamLsa(comm).nRanks;
  if (reach != ranks)
    return mok_fail(MOK_ERR_UNSUPPORTED, "rank %d of the communicator reaches the memory of %d of "
                                         "its %d ranks; mok's NCCL groups need all of them (one "
                                         "node, NVLink or PCIe peer access)", rank, reach, ranks);
  mok_status st = mok_group_alloc(ranks, timeout_ms, out);
  if (st != MOK_OK) return st;
  (*out)->nccl = comm;
  (*out)->nccl_rank = rank;
  (*out)->nccl_device = device;
  (*out)->release = owns ? destroy_comm : NULL;
  return MOK_OK;
}

mok_status mok_ep_group_create_nccl(struct ncclComm *comm, int timeout_ms, mok_ep_group **out) {
  if (!out) return mok_fail(MOK_ERR_INVALID_ARG, "out is NULL; expected a place for the group");
  *out = NULL;
  if (!comm) return mok_fail(MOK_ERR_INVALID_ARG, "comm is NULL; expected an NCCL communicator");
  mok_status st = loaded();
  if (st != MOK_OK) return st;
  st = group_of(comm, 0, timeout_ms, out);
  if (st == MOK_OK) mok_clear_error();
  return st;
}

mok_status mok_ep_group_create_nccl_id(const unsigned char id[MOK_NCCL_ID_BYTES], int rank,
                                       int ranks, int device, int timeout_ms,
                                       mok_ep_group **out) {
  if (!out) return mok_fail(MOK_ERR_INVALID_ARG, "out is NULL; expected a place for the group");
  *out = NULL;
  if (!id) return mok_fail(MOK_ERR_INVALID_ARG, "id is NULL; expected mok_nccl_id's bytes");
  if (ranks < 1 || ranks > MOK_EP_MAX)
    return mok_fail(MOK_ERR_INVALID_ARG, "ranks is %d; expected 1..%d", ranks, MOK_EP_MAX);
  if (rank < 0 || rank >= ranks)
    return mok_fail(MOK_ERR_INVALID_ARG, "rank is %d; expected 0..ranks-1 (%d)", rank, ranks - 1);
  if (timeout_ms < 0)
    return mok_fail(MOK_ERR_INVALID_ARG, "timeout_ms is %d; expected >= 0 (0 = 10 s)", timeout_ms);
  mok_status st = loaded();
  if (st != MOK_OK) return st;
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return mok_fail(MOK_ERR_INVALID_ARG, "device %d: cannot make it current", device);
  }
  ncclUniqueId u;
  memcpy(u.internal, id, MOK_NCCL_ID_BYTES);
  ncclComm_t comm = NULL;
  ncclResult_t r = nccl.CommInitRank(&comm, ranks, u, rank);
  cudaSetDevice(prev);
  if (r != ncclSuccess) return nccl_fail(r, NULL, "ncclCommInitRank");
  st = group_of(comm, 1, timeout_ms, out);
  if (st != MOK_OK) {
    nccl.CommDestroy(comm);
    return st;
  }
  mok_clear_error();
  return MOK_OK;
}

mok_status mok_nccl_mem_alloc(void **p, size_t bytes) {
  NCCL_TRY(nccl.MemAlloc(p, bytes), NULL, "ncclMemAlloc");
  return MOK_OK;
}

void mok_nccl_mem_free(void *p) {
  if (p) nccl.MemFree(p);
}

int mok_nccl_version(void) {
  int v = 0;
  if (loaded() == MOK_OK) nccl.GetVersion(&v);
  return v;
}

mok_status mok_nccl_window_register(mok_ep_group *g, void *p, size_t bytes, void **win) {
  ncclComm_t comm = (ncclComm_t)g->nccl;
  ncclWindow_t w = NULL;
  NCCL_TRY(nccl.CommWindowRegister(comm, p, bytes, &w, NCCL_WIN_COLL_SYMMETRIC), comm,
           "ncclCommWindowRegister");
  /* Without symmetric memory support NCCL may register without giving a window. (That the
   * window maps every rank's memory is checked on the device: ep_table_from_window.) */
  if (!w)
    return mok_fail(MOK_ERR_UNSUPPORTED, "NCCL registered no symmetric window: mok's NCCL groups "
                                         "need GPUs that reach each other's memory (NVLink or "
                                         "PCIe peer access) and CUDA VMM");
  *win = w;
  return MOK_OK;
}

void mok_nccl_window_deregister(mok_ep_group *g, void *win) {
  if (win) nccl.CommWindowDeregister((ncclComm_t)g->nccl, (ncclWindow_t)win);
}

mok_status mok_nccl_all_gather(mok_ep_group *g, const void *send, void *recv, size_t bytes,
                               void *stream) {
  ncclComm_t comm = (ncclComm_t)g->nccl;
  NCCL_TRY(nccl.AllGather(send, recv, bytes, ncclUint8, comm, (cudaStream_t)stream), comm,
           "ncclAllGather");
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
  if (e != cudaSuccess)
    return mok_fail(MOK_ERR_CUDA, "after ncclAllGather: %s", cudaGetErrorString(e));
  return MOK_OK;
}
