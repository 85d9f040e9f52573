/*
 * test_nccl.c: EP groups over NCCL (one process per GPU) on the one GPU the tests have: a group
 * of one rank, whose workspace is an NCCL symmetric window, whose peer table comes from the
 * window through NCCL's device API, and whose barriers run as at ep > 1. It must give the bits of
 * a context without a group, twice in a row (the barriers' epochs carry over), with every output
 * written (poisoned first). Both ways in: mok's own communicator from an id, and the caller's.
 * Several ranks need several GPUs (tests/ep_nccl.py under torchrun; DESIGN §2.3).
 */
#include <dlfcn.h>
#include <nccl.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "device.h"

/* 256 tokens, H 128, I 128, I_s 64, 16 experts, top-4. */
static const mok_shape nccl_shape = {256, 128, 128, 64, 16, 4, MOK_BF16, 0};

/* Forward and backward of d's inputs on a workspace of `group`, into d's outputs (poisoned
 * first), twice; the outputs of the second go to `got`. 0 if something failed (recorded). */
static int step_in_group(mok_ep_group *group, gpu_layer *d, harness *got, const char *what) {
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  cfg.backend = MOK_BACKEND_CUDA;
  cfg.group = group;
  mok_context *ctx = NULL;
  mok_workspace *ws = NULL;
  const int failures = check_failures;
  CHECK_OK(mok_context_create(&cfg, &ctx));
  if (ctx) CHECK_OK(mok_workspace_create(ctx, &nccl_shape, &ws));
  if (ws) {
    mok_forward_args f = gpu_forward_args(d);
    mok_backward_args b = gpu_backward_args(d, MOK_GRAD_WRITE_BF16);
    for (int i = 0; i < 2; i++) {
      gpu_poison(d, 0xff);
      mok_status fs = mok_forward(ws, &f, 0), bs = mok_backward(ws, &b, 0);
      mok_status cs = mok_check(ws, 0);
      CHECK(fs == MOK_OK && bs == MOK_OK && cs == MOK_OK, "%s, step %d: %s, %s, %s (%s)", what,
            i, mok_status_name(fs), mok_status_name(bs), mok_status_name(cs), mok_last_error());
    }
    gpu_fetch(d, got);
  }
  mok_workspace_destroy(ws);
  mok_context_destroy(ctx);
  return ws && check_failures == failures;
}

/* The caller's communicator: the test loads NCCL itself, as an application linking it would. */
typedef ncclResult_t (*get_id_fn)(ncclUniqueId *);
typedef ncclResult_t (*init_fn)(ncclComm_t *, int, ncclUniqueId, int);
typedef ncclResult_t (*destroy_fn)(ncclComm_t);
typedef ncclResult_t (*version_fn)(int *);

static void one_rank_same_bits(void) {
  harness h, one, got;
  if (!harness_init(&h, &nccl_shape, 256, 31, 0) || !harness_init(&one, &nccl_shape, 256, 31, 0) ||
      !harness_init(&got, &nccl_shape, 256, 31, 0))
    return;
  gpu_layer d;
  if (gpu_init(&d, &h, 256, NULL)) {
    gpu_poison(&d, 0xff);
    CHECK_OK(gpu_run(&d, MOK_GRAD_WRITE_BF16, 0));
    CHECK_OK(mok_check(d.ws, 0));
    gpu_fetch(&d, &one);
    CHECK(nan_count_bf16(one.y, (size_t)(256 * nccl_shape.hidden)) == 0, "reference y has NaNs");

    /* mok's communicator, from an id. */
    unsigned char id[MOK_NCCL_ID_BYTES];
    mok_ep_group *g = NULL;
    CHECK_OK(mok_nccl_id(id));
    CHECK_OK(mok_ep_group_create_nccl_id(id, 0, 1, 0, 2000, &g));
    if (g) {
      if (step_in_group(g, &d, &got, "NCCL group from an id"))
        same_layer_bits("NCCL group from an id against no group", &got, &one, G_COUNT);
      /* What a context of an NCCL group refuses. */
      mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
      cfg.group = g;
      mok_context *ctx = NULL;
      mok_status st = mok_context_create(&cfg, &ctx);
      CHECK(st == MOK_ERR_UNSUPPORTED && !ctx, "an NCCL group on the CPU backend gave %s",
            mok_status_name(st));
      cfg.backend = MOK_BACKEND_CUDA, cfg.device = 1;
      st = mok_context_create(&cfg, &ctx);
      CHECK(st == MOK_ERR_INVALID_ARG && strstr(mok_last_error(), "NCCL communicator is on device"),
            "an NCCL group on another device gave %s: %s", mok_status_name(st), mok_last_error());
      mok_context_destroy(ctx);
    }
    mok_ep_group_destroy(g);
    mok_status st = mok_ep_group_create_nccl_id(id, 1, 1, 0, 0, &g);
    CHECK(st == MOK_ERR_INVALID_ARG && !g, "rank 1 of 1 gave %s", mok_status_name(st));

    /* The caller's communicator. */
    void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    CHECK(lib != NULL, "dlopen libnccl.so.2: %s", dlerror());
    if (lib) {
      /* Which NCCL this run tests (gpu-check.sh runs it with each it finds). */
      int loaded = 0;
      ((version_fn)dlsym(lib, "ncclGetVersion"))(&loaded);
      printf("     NCCL %d.%d.%d loaded, mok built with the headers of %d.%d.%d\n", loaded / 10000,
             loaded / 100 % 100, loaded % 100, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
      get_id_fn get_id = (get_id_fn)dlsym(lib, "ncclGetUniqueId");
      init_fn init = (init_fn)dlsym(lib, "ncclCommInitRank");
      destroy_fn destroy = (destroy_fn)dlsym(lib, "ncclCommDestroy");
      ncclUniqueId u;
      ncclComm_t comm = NULL;
      CHECK(get_id(&u) == ncclSuccess && init(&comm, 1, u, 0) == ncclSuccess,
            "the test's own NCCL communicator");
      g = NULL;
      if (comm) CHECK_OK(mok_ep_group_create_nccl(comm, 0, &g));
      if (g) {
        if (step_in_group(g, &d, &got, "the caller's NCCL communicator"))
          same_layer_bits("the caller's NCCL communicator against no group", &got, &one, G_COUNT);
      }
      mok_ep_group_destroy(g);
      if (comm) destroy(comm);
      dlclose(lib);
    }
  }
  gpu_fini(&d);
  harness_fini(&h);
  harness_fini(&one);
  harness_fini(&got);
}

const test_case tests_gpu_nccl[] = {
    {"gpu/nccl_one_rank_same_bits", one_rank_same_bits},
    {NULL, NULL},
};
