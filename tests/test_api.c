/* test_api.c: status names, version, context and workspace argument checks, size queries. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "mok.h"

static void status_names(void) {
  CHECK(mok_version() == MOK_VERSION, "version %d != %d", mok_version(), MOK_VERSION);
  CHECK(mok_status_name(MOK_ERR_EXPERT_ID)[0] == 'M', "name");
  CHECK(strcmp(mok_status_name(MOK_ERR_CAPACITY), "MOK_ERR_CAPACITY") == 0, "capacity name");
  for (int s = MOK_OK; s <= MOK_ERR_INTERNAL; s++) {
    CHECK(strncmp(mok_status_name((mok_status)s), "MOK_", 4) == 0, "status %d has no name", s);
    CHECK(mok_status_string((mok_status)s)[0] != '\0', "status %d has no message", s);
  }
  CHECK(strcmp(mok_status_name((mok_status)99), "MOK_ERR_UNKNOWN") == 0, "unknown code name");
}

/* `expr` must return `want`, leave a message that contains `word`, and leave *out NULL. */
#define EXPECT_FAIL(expr, want, word, out)                                                   \
  do {                                                                                       \
    mok_status st_ = (expr);                                                                 \
    CHECK(st_ == (want), "%s -> %s (%s), expected %s", #expr, mok_status_name(st_),          \
          mok_last_error(), mok_status_name(want));                                          \
    CHECK(strstr(mok_last_error(), (word)) != NULL, "%s: message '%s' does not say '%s'",    \
          #expr, mok_last_error(), (word));                                                  \
    CHECK((out) == NULL, "%s: out is not NULL after a failure", #expr);                      \
  } while (0)

static void context_arguments(void) {
  mok_context *ctx = (mok_context *)(uintptr_t)1;
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  EXPECT_FAIL(mok_context_create(NULL, &ctx), MOK_ERR_INVALID_ARG, "cfg", ctx);
  CHECK(mok_context_create(&cfg, NULL) == MOK_ERR_INVALID_ARG, "out NULL");

  mok_context_config bad = cfg;
  bad.backend = (mok_backend)7;
  EXPECT_FAIL(mok_context_create(&bad, &ctx), MOK_ERR_INVALID_ARG, "backend", ctx);
  bad = cfg, bad.ep_size = 0;
  EXPECT_FAIL(mok_context_create(&bad, &ctx), MOK_ERR_INVALID_ARG, "ep_size", ctx);
  bad = cfg, bad.ep_rank = -1;
  EXPECT_FAIL(mok_context_create(&bad, &ctx), MOK_ERR_INVALID_ARG, "ep_rank", ctx);
  bad = cfg, bad.ep_rank = 1;
  EXPECT_FAIL(mok_context_create(&bad, &ctx), MOK_ERR_INVALID_ARG, "ep_rank", ctx);
  bad = cfg, bad.threads = -1;
  EXPECT_FAIL(mok_context_create(&bad, &ctx), MOK_ERR_INVALID_ARG, "threads", ctx);
  bad = cfg, bad.cluster = 1;
  EXPECT_FAIL(mok_context_create(&bad, &ctx), MOK_ERR_INVALID_ARG, "cluster is 1", ctx);
  bad = cfg, bad.cluster = 8;
  EXPECT_FAIL(mok_context_create(&bad, &ctx), MOK_ERR_INVALID_ARG, "cluster is 8", ctx);
  bad = cfg, bad.cluster = 4; /* valid: the CPU backend ignores it */
  CHECK_OK(mok_context_create(&bad, &ctx));
  mok_context_destroy(ctx);
  ctx = NULL;
  bad = cfg, bad.ep_size = 2, bad.ep_rank = 1; /* no group to go with it */
  EXPECT_FAIL(mok_context_create(&bad, &ctx), MOK_ERR_INVALID_ARG, "group is NULL", ctx);

  mok_ep_group *grp = (mok_ep_group *)(uintptr_t)1;
  EXPECT_FAIL(mok_ep_group_create_emulated(0, 0, &grp), MOK_ERR_INVALID_ARG, "ranks", grp);
  grp = (mok_ep_group *)(uintptr_t)1;
  EXPECT_FAIL(mok_ep_group_create_emulated(MOK_EP_MAX + 1, 0, &grp), MOK_ERR_INVALID_ARG, "ranks",
              grp);
  grp = (mok_ep_group *)(uintptr_t)1;
  EXPECT_FAIL(mok_ep_group_create_emulated(2, -1, &grp), MOK_ERR_INVALID_ARG, "timeout_ms", grp);
  CHECK(mok_ep_group_create_emulated(2, 0, NULL) == MOK_ERR_INVALID_ARG, "group out NULL");
  CHECK_OK(mok_ep_group_create_emulated(2, 0, &grp));
  bad = cfg, bad.ep_size = 3, bad.ep_rank = 1, bad.group = grp;
  EXPECT_FAIL(mok_context_create(&bad, &ctx), MOK_ERR_INVALID_ARG, "has 2 ranks", ctx);
  bad = cfg, bad.ep_size = 1, bad.group = grp;
  EXPECT_FAIL(mok_context_create(&bad, &ctx), MOK_ERR_INVALID_ARG, "has 2 ranks", ctx);
  bad = cfg, bad.ep_size = 2, bad.ep_rank = 1, bad.group = grp, bad.cluster = 4;
  EXPECT_FAIL(mok_context_create(&bad, &ctx), MOK_ERR_INVALID_ARG, "emulated EP ranks", ctx);
  /* One workspace per rank and group. */
  bad = cfg, bad.ep_size = 2, bad.ep_rank = 1, bad.group = grp;
  CHECK_OK(mok_context_create(&bad, &ctx));
  const mok_shape s = {16, 32, 16, 0, 4, 2, MOK_BF16, 0};
  mok_workspace *w1 = (mok_workspace *)(uintptr_t)1, *w2 = (mok_workspace *)(uintptr_t)1;
  const mok_shape odd = {16, 32, 16, 0, 5, 2, MOK_BF16, 0}; /* 5 experts over 2 ranks */
  EXPECT_FAIL(mok_workspace_create(ctx, &odd, &w1), MOK_ERR_INVALID_ARG,
              "experts (5) is not a multiple of ep_size (2)", w1);
  CHECK_OK(mok_workspace_create(ctx, &s, &w1));
  EXPECT_FAIL(mok_workspace_create(ctx, &s, &w2), MOK_ERR_INVALID_ARG, "already has", w2);
  mok_workspace_destroy(w1);
  CHECK_OK(mok_workspace_create(ctx, &s, &w1)); /* the slot is free again */
  /* Every rank of a group has one shape (compared field by field, not with the padding). */
  mok_context *ctx0 = NULL;
  bad.ep_rank = 0;
  CHECK_OK(mok_context_create(&bad, &ctx0));
  mok_shape other;
  memset(&other, 0xff, sizeof other); /* padding bytes differ from s's */
  other.max_tokens = 16, other.hidden = 32, other.inter = 16, other.shared_inter = 0;
  other.experts = 4, other.top_k = 2, other.precision = MOK_BF16, other.routed_rows = 0;
  mok_workspace *w0 = NULL;
  CHECK_OK(mok_workspace_create(ctx0, &other, &w0));
  mok_workspace_destroy(w0);
  w0 = (mok_workspace *)(uintptr_t)1;
  other.hidden = 64;
  EXPECT_FAIL(mok_workspace_create(ctx0, &other, &w0), MOK_ERR_INVALID_ARG, "another shape", w0);
  mok_context_destroy(ctx0);
  /* Any destroy order (a garbage collector has none): group, context, then the workspace that
   * still uses both. */
  mok_ep_group_destroy(grp);
  mok_context_destroy(ctx);
  mok_workspace_destroy(w1);
  mok_ep_group_destroy(NULL);
  if (mok_cuda_device_count() == 0) {
    bad = cfg, bad.backend = MOK_BACKEND_CUDA;
    EXPECT_FAIL(mok_context_create(&bad, &ctx), MOK_ERR_UNSUPPORTED, "CUDA", ctx);
  }

  CHECK_OK(mok_context_create(&cfg, &ctx));
  CHECK(mok_last_error()[0] == '\0', "a success leaves '%s'", mok_last_error());
  mok_context_destroy(ctx);
  mok_context_destroy(NULL);
  mok_workspace_destroy(NULL);
}

static void workspace_arguments(void) {
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  mok_context *ctx = NULL;
  CHECK_OK(mok_context_create(&cfg, &ctx));
  if (!ctx) return;
  const mok_shape good = {64, 32, 16, 8, 4, 2, MOK_BF16, 0};
  mok_workspace *ws = (mok_workspace *)(uintptr_t)1;
  EXPECT_FAIL(mok_workspace_create(NULL, &good, &ws), MOK_ERR_INVALID_ARG, "ctx", ws);
  ws = (mok_workspace *)(uintptr_t)1;
  EXPECT_FAIL(mok_workspace_create(ctx, NULL, &ws), MOK_ERR_INVALID_ARG, "shape", ws);
  CHECK(mok_workspace_create(ctx, &good, NULL) == MOK_ERR_INVALID_ARG, "out NULL");

  struct {
    const char *word;
    mok_shape s;
    mok_status want;
  } bad[] = {
      {"max_tokens", {0, 32, 16, 8, 4, 2, MOK_BF16, 0}, MOK_ERR_INVALID_ARG},
      {"max_tokens", {(1 << 20) + 1, 32, 16, 8, 4, 2, MOK_BF16, 0}, MOK_ERR_INVALID_ARG},
      {"hidden", {64, 0, 16, 8, 4, 2, MOK_BF16, 0}, MOK_ERR_INVALID_ARG},
      {"inter", {64, 32, 0, 8, 4, 2, MOK_BF16, 0}, MOK_ERR_INVALID_ARG},
      {"shared_inter", {64, 32, 16, -1, 4, 2, MOK_BF16, 0}, MOK_ERR_INVALID_ARG},
      {"experts", {64, 32, 16, 8, 0, 1, MOK_BF16, 0}, MOK_ERR_INVALID_ARG},
      {"experts", {64, 32, 16, 8, 4097, 2, MOK_BF16, 0}, MOK_ERR_INVALID_ARG},
      {"top_k", {64, 32, 16, 8, 4, 0, MOK_BF16, 0}, MOK_ERR_INVALID_ARG},
      {"top_k", {64, 32, 16, 8, 4, 5, MOK_BF16, 0}, MOK_ERR_INVALID_ARG},
      {"max_tokens * top_k", {1 << 20, 32, 16, 8, 128, 128, MOK_BF16, 0}, MOK_ERR_INVALID_ARG},
      {"precision is 9; expected MOK_BF16 (0) or MOK_FP8", {64, 32, 16, 8, 4, 2, (mok_precision)9, 0},
       MOK_ERR_INVALID_ARG},
      {"precision is -1", {64, 32, 16, 8, 4, 2, (mok_precision)-1, 0}, MOK_ERR_INVALID_ARG},
      {"routed_rows", {64, 32, 16, 8, 4, 2, MOK_BF16, -1}, MOK_ERR_INVALID_ARG},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ws = (mok_workspace *)(uintptr_t)1;
    EXPECT_FAIL(mok_workspace_create(ctx, &bad[i].s, &ws), bad[i].want, bad[i].word, ws);
  }

  ws = NULL;
  CHECK_OK(mok_workspace_create(ctx, &good, &ws));
  if (ws) {
    CHECK(mok_workspace_bytes(ws) > 0, "workspace_bytes is 0");
    size_t one = mok_saved_bytes(ws, 1), all = mok_saved_bytes(ws, good.max_tokens);
    CHECK(one > 0 && one % 256 == 0 && all % 256 == 0 && all >= one,
          "saved_bytes: %zu for 1 token, %zu for max_tokens", one, all);
    /* A size query has no status: 0 and a message. */
    CHECK(mok_saved_bytes(ws, 0) == 0, "saved_bytes(0)");
    CHECK(strstr(mok_last_error(), "tokens is 0; expected 1..max_tokens (64)"),
          "saved_bytes(0) left '%s'", mok_last_error());
    CHECK(mok_saved_bytes(ws, -3) == 0, "saved_bytes(-3)");
    CHECK(strstr(mok_last_error(), "tokens is -3"), "saved_bytes(-3) left '%s'",
          mok_last_error());
    CHECK(mok_saved_bytes(ws, good.max_tokens + 1) == 0, "saved_bytes(max_tokens + 1)");
    CHECK(strstr(mok_last_error(), "tokens is 65"), "saved_bytes(65) left '%s'",
          mok_last_error());
    CHECK_OK(mok_check(ws, NULL));

    int32_t counts[4] = {-7, -7, -7, -7};
    void *saved = aligned_alloc(256, all);
    CHECK(mok_schedule_counts(NULL, saved, 1, counts, NULL) == MOK_ERR_INVALID_ARG, "ws NULL");
    CHECK(mok_schedule_counts(ws, saved, 0, counts, NULL) == MOK_ERR_INVALID_ARG, "tokens 0");
    CHECK(mok_schedule_counts(ws, saved, good.max_tokens + 1, counts, NULL) ==
              MOK_ERR_INVALID_ARG && strstr(mok_last_error(), "tokens is 65; expected 1..max"),
          "tokens > max_tokens: '%s'", mok_last_error());
    CHECK(mok_schedule_counts(ws, NULL, 1, counts, NULL) == MOK_ERR_INVALID_ARG, "saved NULL");
    CHECK(mok_schedule_counts(ws, (char *)saved + 64, 1, counts, NULL) == MOK_ERR_ALIGNMENT,
          "saved misaligned");
    CHECK(mok_schedule_counts(ws, saved, 1, NULL, NULL) == MOK_ERR_INVALID_ARG, "counts NULL");
    CHECK(counts[0] == -7 && counts[3] == -7, "a refused mok_schedule_counts wrote counts");
    free(saved);
  }
  CHECK(mok_workspace_bytes(NULL) == 0, "workspace_bytes(NULL)");
  CHECK(mok_saved_bytes(NULL, 1) == 0, "saved_bytes(NULL)");
  CHECK(strstr(mok_last_error(), "ws is NULL"), "saved_bytes(NULL) left '%s'", mok_last_error());
  CHECK(mok_check(NULL, NULL) == MOK_ERR_INVALID_ARG, "check(NULL)");
  mok_workspace_destroy(ws);
  mok_context_destroy(ctx);
}

const test_case tests_api[] = {{"api/status_names", status_names},
                               {"api/context_arguments", context_arguments},
                               {"api/workspace_arguments", workspace_arguments},
                               {NULL, NULL}};
