/*
 * test_misuse.c: misuse of the API that mok.h says it catches: too many threads, one workspace
 * called from several threads at once, handles used after destroy or destroyed twice, and the
 * rule that mok_last_error() is "" once a later call succeeds. Each refused call returns
 * MOK_ERR_INVALID_ARG with a message and leaves its outputs untouched.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "harness.h"
#include "internal.h"

#define POISON 0x3c

static int all_bytes(const void *p, size_t n, unsigned char b) {
  const unsigned char *c = p;
  for (size_t i = 0; i < n; i++)
    if (c[i] != b) return 0;
  return 1;
}

/* threads above MOK_MAX_THREADS: an OpenMP team of 40 000 ended the process, 100 000 overflowed
 * the stack; now the context is refused. */
static void threads_capped(void) {
  const int bad[] = {MOK_MAX_THREADS + 1, 40000, 100000, -1};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
    cfg.threads = bad[i];
    mok_context *ctx = (mok_context *)&cfg;
    mok_status st = mok_context_create(&cfg, &ctx);
    CHECK(st == MOK_ERR_INVALID_ARG && ctx == NULL && strstr(mok_last_error(), "threads"),
          "threads %d: %s (%s)", bad[i], mok_status_name(st), mok_last_error());
    mok_context_destroy(ctx);
  }
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  cfg.threads = MOK_MAX_THREADS;
  mok_context *ctx = NULL;
  CHECK_OK(mok_context_create(&cfg, &ctx));
  mok_context_destroy(ctx);
}

/* ---- one caller per workspace -------------------------------------------------------------- */
static const mok_shape small = {32, 64, 64, 64, 4, 2, MOK_BF16, 0};

/* While a call holds the workspace (its busy flag, set here as another thread's call would),
 * every call on it is refused at once and writes nothing. */
static void busy_workspace_refused(void) {
  harness h;
  if (harness_init(&h, &small, 32, 61, 1)) {
    CHECK_OK(harness_run(&h, MOK_GRAD_WRITE_BF16)); /* a saved for the backward below */
    void *keep = malloc(h.saved_bytes);
    if (keep) {
      memcpy(keep, h.saved, h.saved_bytes);
      memset(h.y, POISON, (size_t)(h.T * small.hidden) * 2);
      memset(h.dx, POISON, (size_t)(h.T * small.hidden) * 2);
      __atomic_store_n(&h.ws->busy, 1, __ATOMIC_RELEASE);
      mok_forward_args f = harness_forward_args(&h);
      mok_backward_args b = harness_backward_args(&h, MOK_GRAD_WRITE_BF16);
      int32_t counts[4];
      memset(counts, POISON, sizeof counts);
      const mok_status got[6] = {
          mok_forward(h.ws, &f, NULL),  mok_recompute(h.ws, &f, NULL),
          mok_schedule(h.ws, &f, NULL), mok_backward(h.ws, &b, NULL),
          mok_check(h.ws, NULL),        mok_schedule_counts(h.ws, h.saved, h.T, counts, NULL)};
      for (int i = 0; i < 6; i++)
        CHECK(got[i] == MOK_ERR_INVALID_ARG, "call %d on a busy workspace: %s", i,
              mok_status_name(got[i]));
      CHECK(strstr(mok_last_error(), "in use by a call of another thread"), "message '%s'",
            mok_last_error());
      CHECK(all_bytes(h.y, (size_t)(h.T * small.hidden) * 2, POISON), "y written");
      CHECK(all_bytes(h.dx, (size_t)(h.T * small.hidden) * 2, POISON), "dx written");
      CHECK(all_bytes(counts, sizeof counts, POISON), "counts written");
      CHECK(memcmp(keep, h.saved, h.saved_bytes) == 0, "saved written");
      mok_workspace_destroy(h.ws); /* refused too: the call in flight still uses it */
      CHECK(strstr(mok_last_error(), "in use"), "destroy of a busy workspace: '%s'",
            mok_last_error());
      __atomic_store_n(&h.ws->busy, 0, __ATOMIC_RELEASE);
      CHECK_OK(harness_run(&h, MOK_GRAD_WRITE_BF16));
      free(keep);
    }
  }
  harness_fini(&h);
}

typedef struct hammer {
  mok_workspace *ws;
  mok_forward_args f; /* its own y and saved */
  const uint16_t *want_y;
  int64_t y_bytes;
  int ok, refused, wrong, other;
} hammer;

static void *hammer_main(void *p) {
  hammer *m = p;
  for (int i = 0; i < 20; i++) {
    memset(m->f.y, POISON, (size_t)m->y_bytes);
    mok_status st = mok_forward(m->ws, &m->f, NULL);
    if (st == MOK_OK) {
      m->ok++;
      m->wrong += memcmp(m->f.y, m->want_y, (size_t)m->y_bytes) != 0;
    } else if (st == MOK_ERR_INVALID_ARG && strstr(mok_last_error(), "in use") &&
               all_bytes(m->f.y, (size_t)m->y_bytes, POISON)) {
      m->refused++;
    } else {
      m->other++;
    }
  }
  return NULL;
}

/* Four threads calling forward on one workspace at once, each with its own y and saved: every
 * call either gives the serial run's y or is refused with y untouched (they used to share the
 * workspace's scratch and nearly every result was wrong). */
static void concurrent_forwards(void) {
  harness h;
  if (harness_init(&h, &small, 32, 62, 1)) {
    mok_forward_args f = harness_forward_args(&h);
    CHECK_OK(mok_forward(h.ws, &f, NULL));
    hammer m[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
      m[i] = (hammer){h.ws, f, h.y, h.T * small.hidden * 2, 0, 0, 0, 0};
      m[i].f.y = test_alloc((size_t)m[i].y_bytes);
      m[i].f.saved = test_alloc(h.saved_bytes);
      pthread_create(&th[i], NULL, hammer_main, &m[i]);
    }
    int ok = 0, refused = 0;
    for (int i = 0; i < 4; i++) {
      pthread_join(th[i], NULL);
      CHECK(m[i].wrong == 0 && m[i].other == 0,
            "thread %d: %d of %d forwards gave a wrong y, %d another error", i, m[i].wrong,
            m[i].ok, m[i].other);
      ok += m[i].ok, refused += m[i].refused;
      free(m[i].f.y);
      free(m[i].f.saved);
    }
    CHECK(ok > 0, "no forward succeeded (%d refused)", refused);
  }
  harness_fini(&h);
}

/* ---- lifetimes ------------------------------------------------------------------------------ */
/* A context (group) destroyed by its caller but still held by a workspace (context) is alive:
 * a second destroy is refused with a message and frees nothing, and it makes no new workspace
 * (context). */
static void destroyed_handles_still_held(void) {
  mok_ep_group *g = NULL;
  CHECK_OK(mok_ep_group_create_emulated(1, 0, &g));
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  cfg.group = g;
  mok_context *ctx = NULL;
  CHECK_OK(mok_context_create(&cfg, &ctx));
  mok_workspace *ws = NULL;
  if (ctx) CHECK_OK(mok_workspace_create(ctx, &small, &ws));
  if (!ws) return;
  mok_ep_group_destroy(g);
  mok_ep_group_destroy(g);
  CHECK(strstr(mok_last_error(), "not a live group"), "second group destroy: '%s'",
        mok_last_error());
  mok_context *ctx2 = (mok_context *)&cfg;
  mok_status st = mok_context_create(&cfg, &ctx2);
  CHECK(st == MOK_ERR_INVALID_ARG && !ctx2 && strstr(mok_last_error(), "not a live EP group"),
        "a context on a destroyed group: %s (%s)", mok_status_name(st), mok_last_error());
  mok_context_destroy(ctx);
  mok_context_destroy(ctx);
  CHECK(strstr(mok_last_error(), "not a live context"), "second context destroy: '%s'",
        mok_last_error());
  mok_workspace *ws2 = ws;
  st = mok_workspace_create(ctx, &small, &ws2);
  CHECK(st == MOK_ERR_INVALID_ARG && !ws2 && strstr(mok_last_error(), "not a live context"),
        "a workspace on a destroyed context: %s (%s)", mok_status_name(st), mok_last_error());
  mok_workspace_destroy(ws); /* frees the context, then the group */
}

/* A workspace used after destroy, or destroyed twice: refused with a message. Best effort (mok.h):
 * the handle's memory is freed, so this reads freed memory, which AddressSanitizer reports
 * itself; the sanitized build leaves this test out. */
static void workspace_after_destroy(void) {
#if defined(__SANITIZE_ADDRESS__)
  return;
#else
  harness h;
  if (harness_init(&h, &small, 32, 63, 1)) {
    mok_workspace *dead = h.ws;
    mok_workspace_destroy(dead);
    h.ws = NULL; /* harness_fini must not destroy it again */
    memset(h.y, POISON, (size_t)(h.T * small.hidden) * 2);
    mok_forward_args f = harness_forward_args(&h);
    mok_status st = mok_forward(dead, &f, NULL);
    CHECK(st == MOK_ERR_INVALID_ARG && strstr(mok_last_error(), "not a live workspace"),
          "forward on a destroyed workspace: %s (%s)", mok_status_name(st), mok_last_error());
    CHECK(all_bytes(h.y, (size_t)(h.T * small.hidden) * 2, POISON), "y written");
    CHECK(mok_saved_bytes(dead, 32) == 0, "saved_bytes of a destroyed workspace");
    mok_workspace_destroy(dead);
    CHECK(strstr(mok_last_error(), "not a live workspace"), "second destroy: '%s'",
          mok_last_error());
  }
  harness_fini(&h);
#endif
}

/* A CPU workspace that would not fit in the memory still available is refused when it is made,
 * with a message saying what it needs and what there is (the kernel commits pages only when
 * they are touched: it used to be made, and the OOM killer ended the process mid-forward). The
 * shape asks for about 1.2 x MemAvailable, and nothing of it is allocated. */
static void workspace_larger_than_memory(void) {
  FILE *f = fopen("/proc/meminfo", "r");
  unsigned long long kb = 0;
  char line[256];
  while (f && fgets(line, sizeof line, f)) sscanf(line, "MemAvailable: %llu kB", &kb);
  if (f) fclose(f);
  if (!kb) return; /* not Linux: nothing to compare with */
  const double per_token = 26.0 * 65536; /* scratch of one token at H = 65536, k = 1 */
  double t = 1.2 * (double)kb * 1024 / per_token;
  mok_shape big = {t > (1 << 20) ? 1 << 20 : (int64_t)t + 1, 65536, 64, 0, 8, 1, MOK_BF16, 0};
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  mok_context *ctx = NULL;
  CHECK_OK(mok_context_create(&cfg, &ctx));
  mok_workspace *ws = (mok_workspace *)&cfg;
  mok_status st = ctx ? mok_workspace_create(ctx, &big, &ws) : MOK_ERR_INTERNAL;
  CHECK(st == MOK_ERR_OUT_OF_MEMORY && ws == NULL && strstr(mok_last_error(), "GB available"),
        "max_tokens %lld at H 65536 with %.1f GB available: %s (%s)", (long long)big.max_tokens,
        kb / 1e6, mok_status_name(st), mok_last_error());
  if (st == MOK_OK) mok_workspace_destroy(ws);
  mok_context_destroy(ctx);
}

/* mok_last_error() keeps a failed call's message only until a later call on the thread succeeds. */
static void last_error_cleared_by_success(void) {
  harness h;
  if (harness_init(&h, &small, 32, 64, 1)) {
    mok_forward_args f = harness_forward_args(&h);
    f.tokens = 0;
    CHECK(mok_forward(h.ws, &f, NULL) == MOK_ERR_INVALID_ARG, "tokens 0 accepted");
    CHECK(mok_last_error()[0] != '\0', "no message for the failure");
    f.tokens = h.T;
    CHECK_OK(mok_forward(h.ws, &f, NULL));
    CHECK(mok_last_error()[0] == '\0', "forward succeeded but the message is '%s'",
          mok_last_error());
    static const char *const names[3] = {"mok_check", "mok_saved_bytes", "mok_workspace_bytes"};
    for (int i = 0; i < 3; i++) {
      CHECK(mok_saved_bytes(h.ws, 0) == 0 && mok_last_error()[0], "tokens 0 has a size");
      const int ok = i == 0   ? mok_check(h.ws, NULL) == MOK_OK
                     : i == 1 ? mok_saved_bytes(h.ws, h.T) > 0
                              : mok_workspace_bytes(h.ws) > 0;
      CHECK(ok && mok_last_error()[0] == '\0', "%s succeeded, message '%s'", names[i],
            mok_last_error());
    }
  }
  harness_fini(&h);
}

const test_case tests_misuse[] = {
    {"misuse/threads_capped", threads_capped},
    {"misuse/busy_workspace_refused", busy_workspace_refused},
    {"misuse/concurrent_forwards_one_workspace", concurrent_forwards},
    {"misuse/destroyed_handles_still_held", destroyed_handles_still_held},
    {"misuse/workspace_after_destroy", workspace_after_destroy},
    {"misuse/workspace_larger_than_memory", workspace_larger_than_memory},
    {"misuse/last_error_cleared_by_success", last_error_cleared_by_success},
    {NULL, NULL},
};
