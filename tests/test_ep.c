/*
 * test_ep.c: expert parallelism with emulated ranks on the CPU backend (DESIGN §2, §3).
 * Each rank has its own context and workspace and runs forward and backward from its own thread,
 * as a process per GPU would; the group's barriers and peer table join them.
 *   D4: a global batch split over ep = 1, 2, 4 and 8 ranks gives, on every rank, y, dx,
 *       d_topk_weights and the routed weight gradients of its experts with the bits of one rank
 *       running the whole batch (the shared expert's weight gradients are each rank's own partial
 *       sums, reduced by the caller's data parallelism, so they are not compared).
 *   A rank that never arrives: the others fail with MOK_ERR_TIMEOUT, outputs untouched, and the
 *   group stays failed. A bad expert id on one rank, or one rank over its capacity, fails every
 *   rank with that error and leaves every output untouched.
 *   Turns (how emulated ranks on the CUDA backend enqueue): threads arriving in any order take
 *   them in rank order, on the group and through api.c's calls; a late rank holds its successor
 *   back for the timeout only, and a failed group for no time.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "harness.h"
#include "internal.h"

#define POISON 0x5a

typedef struct rank_run {
  mok_context *ctx;
  mok_workspace *ws;
  mok_forward_args f;
  mok_backward_args b;
  int64_t y_bytes, dtw_bytes, g_bytes[G_COUNT];
  void *fp8;               /* MOK_FP8: this rank's FP8 weight buffer */
  int absent;              /* never calls (the timeout test) */
  mok_status fwd, bwd;
  char bwd_msg[256];       /* mok_last_error() on the rank's thread after backward */
} rank_run;

typedef struct ep_setup {
  int ep;
  mok_ep_group *group;
  rank_run run[8];
} ep_setup;

static int64_t first_diff(const void *a, const void *b, int64_t bytes) {
  const unsigned char *p = a, *q = b;
  for (int64_t i = 0; i < bytes; i++)
    if (p[i] != q[i]) return i;
  return -1;
}

static int untouched(const void *p, int64_t bytes) {
  const unsigned char *c = p;
  for (int64_t i = 0; i < bytes; i++)
    if (c[i] != POISON) return 0;
  return 1;
}

/* Every output of the rank to POISON. */
static void rank_poison(rank_run *u) {
  memset(u->f.y, POISON, (size_t)u->y_bytes);
  memset(u->b.dx, POISON, (size_t)u->y_bytes);
  memset(u->b.d_topk_weights, POISON, (size_t)u->dtw_bytes);
  void *grads[G_COUNT] = {u->b.g.dw_gate,  u->b.g.dw_up,  u->b.g.dw_down,
                          u->b.g.dws_gate, u->b.g.dws_up, u->b.g.dws_down};
  for (int g = 0; g < G_COUNT; g++)
    if (grads[g]) memset(grads[g], POISON, (size_t)u->g_bytes[g]);
}

/* Rank r of `ep` takes split[r] tokens of L (NULL: T/ep each), in rank order, and experts
 * [r E/ep, (r+1) E/ep); max_tokens is the largest split. */
static int setup_split(ep_setup *s, const mok_host_layer *L, int ep, int64_t routed_rows,
                       int timeout_ms, const int64_t *split, int threads) {
  memset(s, 0, sizeof *s);
  s->ep = ep;
  CHECK_OK(mok_ep_group_create_emulated(ep, timeout_ms, &s->group));
  if (!s->group) return 0;
  const mok_shape *gs = &L->shape;
  const int64_t H = gs->hidden, I = gs->inter, Is = gs->shared_inter;
  const int64_t El = gs->experts / ep, k = gs->top_k;
  int64_t max_tokens = 0, first[9] = {0};
  for (int r = 0; r < ep; r++) {
    const int64_t n = split ? split[r] : L->tokens / ep;
    first[r + 1] = first[r] + n;
    if (n > max_tokens) max_tokens = n;
  }
  for (int r = 0; r < ep; r++) {
    rank_run *u = &s->run[r];
    const int64_t Tr = first[r + 1] - first[r], t0 = first[r];
    mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
    cfg.ep_rank = r, cfg.ep_size = ep, cfg.group = s->group, cfg.threads = threads;
    CHECK_OK(mok_context_create(&cfg, &u->ctx));
    mok_shape shape = *gs;
    shape.max_tokens = max_tokens;
    shape.routed_rows = routed_rows;
    if (u->ctx) CHECK_OK(mok_workspace_create(u->ctx, &shape, &u->ws));
    if (!u->ws) return 0;
    mok_weights w = mok_host_layer_weights(L);
    w.w_gate = L->w_gate + r * El * I * H;
    w.w_up = L->w_up + r * El * I * H;
    w.w_down = L->w_down + r * El * H * I;
    if (shape.precision == MOK_FP8) { /* each rank quantizes its own experts' weights */
      u->fp8 = test_alloc(mok_fp8_weights_bytes(u->ws));
      CHECK_OK(mok_quantize_weights(u->ws, &w, u->fp8, NULL));
      w = (mok_weights){NULL, NULL, NULL, NULL, NULL, NULL, u->fp8};
    }
    u->y_bytes = Tr * H * 2, u->dtw_bytes = Tr * k * 4;
    const int64_t g_len[G_COUNT] = {El * I * H, El * I * H, El * H * I, Is * H, Is * H, H * Is};
    for (int g = 0; g < G_COUNT; g++) u->g_bytes[g] = g_len[g] * 2;
    u->f = (mok_forward_args){Tr, L->x + t0 * H, L->topk_ids + t0 * k,
                              L->topk_weights + t0 * k, w, test_alloc((size_t)u->y_bytes),
                              test_alloc(mok_saved_bytes(u->ws, Tr))};
    mok_grads gr = {0};
    void **gp[G_COUNT] = {&gr.dw_gate, &gr.dw_up, &gr.dw_down, &gr.dws_gate, &gr.dws_up,
                          &gr.dws_down};
    for (int g = 0; g < G_COUNT; g++)
      if (g_len[g]) *gp[g] = test_alloc((size_t)u->g_bytes[g]);
    u->b = (mok_backward_args){Tr, u->f.x, u->f.topk_ids, u->f.topk_weights, w, u->f.saved,
                               L->dy + t0 * H, test_alloc((size_t)u->y_bytes),
                               test_alloc((size_t)u->dtw_bytes), gr, MOK_GRAD_WRITE_BF16};
    rank_poison(u);
  }
  return 1;
}

static int setup(ep_setup *s, const mok_host_layer *L, int ep, int64_t routed_rows,
                 int timeout_ms) {
  return setup_split(s, L, ep, routed_rows, timeout_ms, NULL, 1);
}

static void teardown(ep_setup *s) {
  for (int r = 0; r < s->ep; r++) {
    rank_run *u = &s->run[r];
    free(u->f.y), free(u->f.saved), free(u->b.dx), free(u->b.d_topk_weights);
    free(u->b.g.dw_gate), free(u->b.g.dw_up), free(u->b.g.dw_down);
    free(u->b.g.dws_gate), free(u->b.g.dws_up), free(u->b.g.dws_down);
    free(u->fp8);
    mok_workspace_destroy(u->ws);
    mok_context_destroy(u->ctx);
  }
  mok_ep_group_destroy(s->group);
}

/* What a rank's thread runs: forward, then backward (status kept for each). */
static void *forward_main(void *p) {
  rank_run *u = p;
  u->fwd = mok_forward(u->ws, &u->f, NULL);
  return NULL;
}

static void *backward_main(void *p) {
  rank_run *u = p;
  u->bwd = mok_backward(u->ws, &u->b, NULL);
  snprintf(u->bwd_msg, sizeof u->bwd_msg, "%s", mok_last_error());
  return NULL;
}

static void *step_main(void *p) {
  forward_main(p);
  return backward_main(p);
}

static void *schedule_main(void *p) {
  rank_run *u = p;
  u->fwd = mok_schedule(u->ws, &u->f, NULL);
  return NULL;
}

/* Every rank that is not absent runs fn at once, each on its own thread. */
static void run_all(ep_setup *s, void *(*fn)(void *)) {
  pthread_t th[8];
  for (int r = 0; r < s->ep; r++)
    if (!s->run[r].absent) pthread_create(&th[r], NULL, fn, &s->run[r]);
  for (int r = 0; r < s->ep; r++)
    if (!s->run[r].absent) pthread_join(th[r], NULL);
}

/* The global batch: 96 tokens, 8 experts, top-2, a shared expert. */
static const mok_shape global_shape = {96, 64, 32, 32, 8, 2, MOK_BF16, 0};
/* MOK_FP8: 512 tokens, so that experts hold more than one block of 128 rows along which the weight
 * gradients' operands are quantized (Q_col, per expert segment: the same blocks at every ep),
 * and H, I, I_s that end in partial groups of 128. */
static const mok_shape fp8_shape = {512, 160, 144, 80, 8, 2, MOK_FP8, 0};

static void d4_across_ep_of(const mok_shape *gs) {
  const mok_shape global_shape = *gs;
  harness ref;
  if (!harness_init(&ref, &global_shape, global_shape.max_tokens, 11, 1)) return;
  CHECK_OK(harness_run(&ref, MOK_GRAD_WRITE_BF16));
  const int64_t H = global_shape.hidden, I = global_shape.inter, k = global_shape.top_k;
  const int eps[] = {1, 2, 4, 8};
  for (size_t n = 0; n < sizeof eps / sizeof eps[0]; n++) {
    const int ep = eps[n];
    ep_setup s;
    if (setup(&s, &ref.L, ep, 0, 0)) {
      run_all(&s, step_main);
      const int64_t Tr = ref.T / ep, El = global_shape.experts / ep;
      for (int r = 0; r < ep; r++) {
        const rank_run *u = &s.run[r];
        CHECK(u->fwd == MOK_OK && u->bwd == MOK_OK, "ep %d rank %d: forward %s, backward %s (%s)",
              ep, r, mok_status_name(u->fwd), mok_status_name(u->bwd), mok_last_error());
        const struct {
          const char *name;
          const void *got, *want;
          int64_t bytes;
        } c[] = {
            {"y", u->f.y, ref.y + r * Tr * H, Tr * H * 2},
            {"dx", u->b.dx, ref.dx + r * Tr * H, Tr * H * 2},
            {"d_topk_weights", u->b.d_topk_weights, ref.dtw + r * Tr * k, Tr * k * 4},
            {"dw_gate", u->b.g.dw_gate, (uint16_t *)ref.g[G_GATE] + r * El * I * H, El * I * H * 2},
            {"dw_up", u->b.g.dw_up, (uint16_t *)ref.g[G_UP] + r * El * I * H, El * I * H * 2},
            {"dw_down", u->b.g.dw_down, (uint16_t *)ref.g[G_DOWN] + r * El * H * I, El * H * I * 2},
        };
        for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
          int64_t at = first_diff(c[i].got, c[i].want, c[i].bytes);
          CHECK(at < 0, "ep %d rank %d: %s differs from ep = 1 first at byte %lld", ep, r,
                c[i].name, (long long)at);
        }
        CHECK(!untouched(u->b.g.dws_gate, u->g_bytes[GS_GATE]), "ep %d rank %d: dws_gate unwritten",
              ep, r);
      }
    }
    teardown(&s);
  }
  harness_fini(&ref);
}

/* D4 again with uneven token counts (each below max_tokens but the largest), two threads per
 * rank, and three calls in a row on the same workspaces. */
static void d4_uneven_repeated_of(const mok_shape *gs, const int64_t split[4]) {
  const mok_shape global_shape = *gs;
  harness ref;
  if (!harness_init(&ref, &global_shape, global_shape.max_tokens, 15, 1)) return;
  CHECK_OK(harness_run(&ref, MOK_GRAD_WRITE_BF16));
  const int64_t H = global_shape.hidden, k = global_shape.top_k;
  ep_setup s;
  if (setup_split(&s, &ref.L, 4, 0, 0, split, 2)) {
    for (int rep = 0; rep < 3; rep++) {
      for (int r = 0; r < 4; r++) rank_poison(&s.run[r]);
      run_all(&s, step_main);
      int64_t t0 = 0;
      for (int r = 0; r < 4; r++) {
        const rank_run *u = &s.run[r];
        CHECK(u->fwd == MOK_OK && u->bwd == MOK_OK, "rep %d rank %d: %s / %s", rep, r,
              mok_status_name(u->fwd), mok_status_name(u->bwd));
        int64_t a = first_diff(u->f.y, ref.y + t0 * H, split[r] * H * 2);
        int64_t b = first_diff(u->b.dx, ref.dx + t0 * H, split[r] * H * 2);
        int64_t c = first_diff(u->b.d_topk_weights, ref.dtw + t0 * k, split[r] * k * 4);
        CHECK(a < 0 && b < 0 && c < 0, "rep %d rank %d: y/dx/dtw differ at bytes %lld/%lld/%lld",
              rep, r, (long long)a, (long long)b, (long long)c);
        t0 += split[r];
      }
      const int64_t El = global_shape.experts / 4, I = global_shape.inter;
      for (int r = 0; r < 4; r++) {
        int64_t d = first_diff(s.run[r].b.g.dw_down, (uint16_t *)ref.g[G_DOWN] + r * El * H * I,
                               El * H * I * 2);
        CHECK(d < 0, "rep %d rank %d: dw_down differs at byte %lld", rep, r, (long long)d);
      }
    }
  }
  teardown(&s);
  harness_fini(&ref);
}

static void d4_across_ep(void) { d4_across_ep_of(&global_shape); }
static void d4_across_ep_fp8(void) { d4_across_ep_of(&fp8_shape); }
static void d4_uneven_repeated(void) {
  const int64_t split[4] = {40, 8, 30, 18};
  d4_uneven_repeated_of(&global_shape, split);
}
static void d4_uneven_repeated_fp8(void) {
  const int64_t split[4] = {200, 40, 150, 122};
  d4_uneven_repeated_of(&fp8_shape, split);
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void absent_rank_times_out(void) {
  mok_host_layer L;
  if (mok_host_layer_create(&global_shape, global_shape.max_tokens, 12, &L) != MOK_OK) return;
  ep_setup s;
  if (setup(&s, &L, 4, 0, 200)) {
    s.run[2].absent = 1;
    const double t0 = now_s();
    run_all(&s, forward_main);
    const double took = now_s() - t0;
    for (int r = 0; r < 4; r++) {
      if (r == 2) continue;
      CHECK(s.run[r].fwd == MOK_ERR_TIMEOUT, "rank %d: forward %s, expected MOK_ERR_TIMEOUT", r,
            mok_status_name(s.run[r].fwd));
      CHECK(untouched(s.run[r].f.y, s.run[r].y_bytes), "rank %d: y written after a timeout", r);
      CHECK(mok_check(s.run[r].ws, NULL) == MOK_ERR_TIMEOUT, "rank %d: mok_check after a timeout",
            r);
    }
    CHECK(took > 0.15 && took < 5.0, "the timeout took %.3f s; expected about 0.2 s", took);
    /* The late rank now finds the group failed at once, and so does everyone's next call. */
    const double t1 = now_s();
    s.run[2].fwd = mok_forward(s.run[2].ws, &s.run[2].f, NULL);
    CHECK(s.run[2].fwd == MOK_ERR_TIMEOUT, "late rank: %s", mok_status_name(s.run[2].fwd));
    CHECK(now_s() - t1 < 0.1, "a failed group still waited %.3f s", now_s() - t1);
    CHECK(untouched(s.run[2].f.y, s.run[2].y_bytes), "late rank: y written");
  }
  teardown(&s);
  mok_host_layer_destroy(&L);
}

/* Turns, on the group: each of 4 ranks' threads takes 3 turns, sleeping a pseudo-random while
 * before each and while holding it (up to 2 ms, so that without turns they would interleave at
 * random), and writes its rank into the next place of `order` while it holds the turn. */
typedef struct turn_run {
  mok_ep_group *g;
  int rank;
  unsigned seed;
  int *order;
  int *next;
  pthread_mutex_t *mu;
} turn_run;

static void nap(unsigned *seed) {
  *seed = *seed * 1103515245u + 12345u;
  const struct timespec t = {0, (long)((*seed >> 8) % 2000u) * 1000L};
  nanosleep(&t, NULL);
}

static void *turn_main(void *p) {
  turn_run *u = p;
  for (int call = 0; call < 3; call++) {
    nap(&u->seed);
    mok_group_turn_take(u->g, u->rank);
    pthread_mutex_lock(u->mu);
    u->order[(*u->next)++] = u->rank;
    pthread_mutex_unlock(u->mu);
    nap(&u->seed);
    mok_group_turn_give(u->g, u->rank);
  }
  return NULL;
}

/* The places of `order` hold ranks 0, 1, .., ranks - 1 over and over. */
static void check_rank_order(const int *order, int n, int want, int ranks, const char *what) {
  CHECK(n == want, "%s: %d calls seen, expected %d", what, n, want);
  for (int i = 0; i < n; i++)
    CHECK(order[i] == i % ranks, "%s: call %d was rank %d's, expected rank %d's", what, i,
          order[i], i % ranks);
}

static void turns_in_rank_order(void) {
  mok_ep_group *g = NULL;
  CHECK_OK(mok_group_alloc(4, 5000, &g));
  if (!g) return;
  int order[12], next = 0;
  pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  turn_run u[4];
  pthread_t th[4];
  for (int r = 3; r >= 0; r--) { /* started last rank first */
    u[r] = (turn_run){g, r, 7u + 31u * (unsigned)r, order, &next, &mu};
    pthread_create(&th[r], NULL, turn_main, &u[r]);
  }
  for (int r = 0; r < 4; r++) pthread_join(th[r], NULL);
  check_rank_order(order, next, 12, 4, "turns");
  mok_ep_group_destroy(g);

  /* Rank 0 is late: rank 1 waits out the timeout and skips it; the late call then goes at once,
   * and the next calls go in turn again without waiting. */
  CHECK_OK(mok_group_alloc(2, 200, &g));
  if (!g) return;
  double t0 = now_s();
  mok_group_turn_take(g, 1);
  const double skipped = now_s() - t0;
  mok_group_turn_give(g, 1);
  t0 = now_s();
  mok_group_turn_take(g, 0), mok_group_turn_give(g, 0); /* the late call */
  for (int call = 0; call < 2; call++)
    for (int r = 0; r < 2; r++) mok_group_turn_take(g, r), mok_group_turn_give(g, r);
  const double after = now_s() - t0;
  CHECK(skipped > 0.15 && skipped < 5.0, "the late rank's turn was waited for %.3f s; expected "
        "about 0.2 s", skipped);
  CHECK(after < 0.1, "the calls after the skipped one waited %.3f s", after);
  /* A failed group waits for no turn: rank 1's next call is not given by rank 0's. */
  mok_group_break(g);
  t0 = now_s();
  mok_group_turn_take(g, 1);
  CHECK(now_s() - t0 < 0.1, "a failed group's turn waited %.3f s", now_s() - t0);
  mok_ep_group_destroy(g);
}

/* Turns, through api.c: 4 CPU ranks whose backend poses as one with device barriers, with
 * stubs for the calls that record whose call reached the backend. Each rank's thread
 * makes forward, backward, recompute and schedule calls, one of them refused on one rank (its
 * refusal still reaches the backend, as a device barrier would need): the backend sees them in
 * rank order, call by call. */
static struct {
  pthread_mutex_t mu;
  int order[16], next;
} seen = {PTHREAD_MUTEX_INITIALIZER, {0}, 0};

static mok_status seen_call(mok_workspace *ws) {
  const int r = ws->ctx->cfg.ep_rank;
  const struct timespec t = {0, (long)((3 - r) * 400 + 100) * 1000L}; /* the low ranks slowest */
  nanosleep(&t, NULL);
  pthread_mutex_lock(&seen.mu);
  if (seen.next < 16) seen.order[seen.next++] = r;
  pthread_mutex_unlock(&seen.mu);
  return MOK_OK;
}

static mok_status stub_forward(mok_workspace *ws, const mok_forward_args *a, int y, void *st) {
  (void)a, (void)y, (void)st;
  return seen_call(ws);
}

static mok_status stub_backward(mok_workspace *ws, const mok_backward_args *a, void *st) {
  (void)a, (void)st;
  return seen_call(ws);
}

static mok_status stub_schedule(mok_workspace *ws, const mok_forward_args *a, void *st) {
  (void)a, (void)st;
  return seen_call(ws);
}

static mok_status stub_refuse(mok_workspace *ws, void *st) {
  (void)st;
  return seen_call(ws);
}

static void *four_calls_main(void *p) {
  rank_run *u = p;
  u->fwd = mok_forward(u->ws, &u->f, NULL);
  u->bwd = mok_backward(u->ws, &u->b, NULL);
  mok_forward_args f = u->f;
  if (u->ws->ctx->cfg.ep_rank == 2) f.saved = NULL; /* refused on the host */
  mok_status rec = mok_recompute(u->ws, &f, NULL);
  CHECK(rec == (f.saved ? MOK_OK : MOK_ERR_INVALID_ARG), "rank %d: recompute gave %s",
        u->ws->ctx->cfg.ep_rank, mok_status_name(rec));
  CHECK_OK(mok_schedule(u->ws, &u->f, NULL));
  return NULL;
}

static void api_calls_take_turns(void) {
  mok_host_layer L;
  if (mok_host_layer_create(&global_shape, global_shape.max_tokens, 13, &L) != MOK_OK) return;
  ep_setup s;
  if (setup(&s, &L, 4, 0, 5000)) {
    mok_backend_ops stub = *s.run[0].ctx->ops;
    const mok_backend_ops *cpu = s.run[0].ctx->ops;
    stub.forward = stub_forward, stub.backward = stub_backward, stub.schedule = stub_schedule;
    stub.refuse = stub_refuse, stub.device_barriers = 1;
    for (int r = 0; r < 4; r++) s.run[r].ctx->ops = &stub;
    seen.next = 0;
    pthread_t th[4];
    for (int r = 3; r >= 0; r--) pthread_create(&th[r], NULL, four_calls_main, &s.run[r]);
    for (int r = 0; r < 4; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < 4; r++) {
      CHECK(s.run[r].fwd == MOK_OK && s.run[r].bwd == MOK_OK, "rank %d: forward %s, backward %s",
            r, mok_status_name(s.run[r].fwd), mok_status_name(s.run[r].bwd));
      s.run[r].ctx->ops = cpu;
    }
    check_rank_order(seen.order, seen.next, 16, 4, "api calls");
  }
  teardown(&s);
  mok_host_layer_destroy(&L);
}

/* `want` was every rank's status and is what mok_check reports, and every rank's outputs still
 * hold the poison. */
static void all_failed_untouched(const ep_setup *s, mok_status want, const char *what) {
  for (int r = 0; r < s->ep; r++) {
    const rank_run *u = &s->run[r];
    CHECK(mok_check(u->ws, NULL) == want, "%s: rank %d: mok_check", what, r);
    CHECK(u->fwd == want, "%s: rank %d forward %s, expected %s", what, r, mok_status_name(u->fwd),
          mok_status_name(want));
    CHECK(u->bwd == want, "%s: rank %d backward %s, expected %s", what, r,
          mok_status_name(u->bwd), mok_status_name(want));
    CHECK(untouched(u->f.y, u->y_bytes) && untouched(u->b.dx, u->y_bytes) &&
              untouched(u->b.d_topk_weights, u->dtw_bytes),
          "%s: rank %d wrote an output", what, r);
    const void *grads[G_COUNT] = {u->b.g.dw_gate,  u->b.g.dw_up,  u->b.g.dw_down,
                                  u->b.g.dws_gate, u->b.g.dws_up, u->b.g.dws_down};
    for (int g = 0; g < G_COUNT; g++)
      CHECK(!grads[g] || untouched(grads[g], u->g_bytes[g]), "%s: rank %d wrote gradient %d",
            what, r, g);
  }
}

static void bad_id_on_one_rank(void) {
  mok_host_layer L;
  if (mok_host_layer_create(&global_shape, global_shape.max_tokens, 13, &L) != MOK_OK) return;
  L.topk_ids[(3 * 24 + 2) * 2 + 1] = global_shape.experts; /* rank 3's token 2, slot 1 */
  ep_setup s;
  if (setup(&s, &L, 4, 0, 0)) {
    run_all(&s, step_main);
    all_failed_untouched(&s, MOK_ERR_EXPERT_ID, "bad id on rank 3");
  }
  teardown(&s);
  mok_host_layer_destroy(&L);
}

static void capacity_overflow(void) {
  mok_host_layer L;
  if (mok_host_layer_create(&global_shape, global_shape.max_tokens, 14, &L) != MOK_OK) return;
  /* Every token of every rank picks experts 0 and 1, both on rank 0: 2 x 96 rows there, 256
   * with padding, against a capacity of 128. */
  for (int64_t t = 0; t < L.tokens; t++) L.topk_ids[2 * t] = 0, L.topk_ids[2 * t + 1] = 1;
  ep_setup s;
  if (setup(&s, &L, 4, 128, 0)) {
    run_all(&s, step_main);
    all_failed_untouched(&s, MOK_ERR_CAPACITY, "rank 0 over capacity");
  }
  teardown(&s);
  /* The same routing fits in a capacity of 256. */
  if (setup(&s, &L, 4, 256, 0)) {
    run_all(&s, step_main);
    for (int r = 0; r < 4; r++)
      CHECK(s.run[r].fwd == MOK_OK && s.run[r].bwd == MOK_OK, "rank %d: %s / %s", r,
            mok_status_name(s.run[r].fwd), mok_status_name(s.run[r].bwd));
  }
  teardown(&s);
  mok_host_layer_destroy(&L);
}

/* One rank's call refused by the argument checks: every rank fails it at once with
 * MOK_ERR_INVALID_ARG (no timeout), nothing is written, and the group stays usable. */
static void refused_arguments_on_one_rank(void) {
  mok_host_layer L;
  if (mok_host_layer_create(&global_shape, global_shape.max_tokens, 16, &L) != MOK_OK) return;
  ep_setup s;
  if (setup(&s, &L, 4, 0, 5000)) {
    const int64_t good_tokens = s.run[1].f.tokens;
    s.run[1].f.tokens = 0;
    const double t0 = now_s();
    run_all(&s, forward_main);
    CHECK(now_s() - t0 < 2.0, "the refusal took %.3f s (a timeout?)", now_s() - t0);
    for (int r = 0; r < 4; r++) {
      CHECK(s.run[r].fwd == MOK_ERR_INVALID_ARG, "rank %d: forward %s", r,
            mok_status_name(s.run[r].fwd));
      CHECK(untouched(s.run[r].f.y, s.run[r].y_bytes), "rank %d: y written", r);
    }
    s.run[1].f.tokens = good_tokens;
    run_all(&s, step_main); /* the group still works */
    for (int r = 0; r < 4; r++)
      CHECK(s.run[r].fwd == MOK_OK && s.run[r].bwd == MOK_OK, "rank %d after a refusal: %s / %s",
            r, mok_status_name(s.run[r].fwd), mok_status_name(s.run[r].bwd));
    /* A backward refused on rank 2 (no dx): every rank's backward fails, dx untouched. */
    for (int r = 0; r < 4; r++) memset(s.run[r].b.dx, POISON, (size_t)s.run[r].y_bytes);
    void *dx2 = s.run[2].b.dx;
    s.run[2].b.dx = NULL;
    run_all(&s, backward_main);
    s.run[2].b.dx = dx2;
    for (int r = 0; r < 4; r++) {
      CHECK(s.run[r].bwd == MOK_ERR_INVALID_ARG, "rank %d: backward %s", r,
            mok_status_name(s.run[r].bwd));
      CHECK(untouched(s.run[r].b.dx, s.run[r].y_bytes), "rank %d: dx written", r);
    }
    /* Rank 2's backward of other tokens than its forward's (its saved's): refused on the host by
     * the CPU backend, and so on every rank, at once, dx untouched. */
    s.run[2].b.tokens = s.run[2].f.tokens - 1;
    const double t1 = now_s();
    run_all(&s, backward_main);
    CHECK(now_s() - t1 < 2.0, "the tokens refusal took %.3f s (a timeout?)", now_s() - t1);
    s.run[2].b.tokens = s.run[2].f.tokens;
    CHECK(strstr(s.run[2].bwd_msg, "filled by a call of 24 tokens"), "rank 2 says '%s'",
          s.run[2].bwd_msg);
    for (int r = 0; r < 4; r++) {
      CHECK(s.run[r].bwd == MOK_ERR_INVALID_ARG, "rank %d: backward of other tokens: %s (%s)", r,
            mok_status_name(s.run[r].bwd), s.run[r].bwd_msg);
      CHECK(untouched(s.run[r].b.dx, s.run[r].y_bytes), "rank %d: dx written", r);
    }
    run_all(&s, backward_main); /* the group still works */
    for (int r = 0; r < 4; r++)
      CHECK(s.run[r].bwd == MOK_OK, "rank %d: backward after the refusals: %s (%s)", r,
            mok_status_name(s.run[r].bwd), s.run[r].bwd_msg);
  }
  teardown(&s);
  mok_host_layer_destroy(&L);
}

/* mok_schedule on every rank: each rank's counts are the global batch's rows of its experts. */
static void schedule_counts_per_rank(void) {
  mok_host_layer L;
  if (mok_host_layer_create(&global_shape, global_shape.max_tokens, 17, &L) != MOK_OK) return;
  const int E = global_shape.experts, k = global_shape.top_k;
  int32_t want[8] = {0};
  for (int64_t s = 0; s < L.tokens * k; s++) want[L.topk_ids[s]]++;
  ep_setup s;
  if (setup(&s, &L, 4, 0, 0)) {
    for (int r = 0; r < 4; r++) /* not -1: a missing slot_row write shows */
      memset(s.run[r].f.saved, POISON, mok_saved_bytes(s.run[r].ws, s.run[r].f.tokens));
    run_all(&s, schedule_main);
    for (int r = 0; r < 4; r++) {
      CHECK(s.run[r].fwd == MOK_OK, "rank %d: mok_schedule %s", r, mok_status_name(s.run[r].fwd));
      int32_t got[2] = {-1, -1};
      CHECK_OK(mok_schedule_counts(s.run[r].ws, s.run[r].f.saved, s.run[r].f.tokens, got, NULL));
      for (int e = 0; e < E / 4; e++)
        CHECK(got[e] == want[r * (E / 4) + e], "rank %d expert %d: %d rows, expected %d", r, e,
              got[e], want[r * (E / 4) + e]);
      const rank_run *u = &s.run[r];
      const int64_t q =
          slot_row_first_wrong(u->ws, u->f.saved, u->f.tokens, u->f.topk_ids, r, E / 4);
      CHECK(q < 0, "rank %d: slot_row of slot %lld wrong (expert %d)", r, (long long)q,
            q < 0 ? 0 : u->f.topk_ids[q]);
    }
  }
  teardown(&s);
  mok_host_layer_destroy(&L);
}

/* One rank's call of a chosen kind, on its own thread. */
enum { OP_FORWARD, OP_RECOMPUTE, OP_SCHEDULE, OP_BACKWARD };
typedef struct op_run {
  rank_run *u;
  int op;
  mok_status st;
  char msg[512];
} op_run;

static void *op_main(void *p) {
  op_run *o = p;
  rank_run *u = o->u;
  o->st = o->op == OP_FORWARD     ? mok_forward(u->ws, &u->f, NULL)
          : o->op == OP_RECOMPUTE ? mok_recompute(u->ws, &u->f, NULL)
          : o->op == OP_SCHEDULE  ? mok_schedule(u->ws, &u->f, NULL)
                                  : mok_backward(u->ws, &u->b, NULL);
  snprintf(o->msg, sizeof o->msg, "%s", mok_last_error());
  return NULL;
}

/* Ranks making different calls at once (one forward, the other backward, recompute or the
 * schedule): every rank fails at once with MOK_ERR_INVALID_ARG naming both calls, writes no
 * output, and the group stays usable: the next step gives the bits of the first. */
static void different_calls_on_ranks(void) {
  mok_host_layer L;
  if (mok_host_layer_create(&global_shape, global_shape.max_tokens, 18, &L) != MOK_OK) return;
  ep_setup s;
  if (setup(&s, &L, 2, 0, 5000)) {
    run_all(&s, step_main);
    void *first_y[2], *first_dx[2];
    for (int r = 0; r < 2; r++) {
      CHECK(s.run[r].fwd == MOK_OK && s.run[r].bwd == MOK_OK, "rank %d: first step failed", r);
      first_y[r] = malloc((size_t)s.run[r].y_bytes);
      first_dx[r] = malloc((size_t)s.run[r].y_bytes);
      if (first_y[r]) memcpy(first_y[r], s.run[r].f.y, (size_t)s.run[r].y_bytes);
      if (first_dx[r]) memcpy(first_dx[r], s.run[r].b.dx, (size_t)s.run[r].y_bytes);
    }
    static const char *const names[] = {"mok_forward", "mok_recompute", "mok_schedule",
                                        "mok_backward"};
    const int pairs[][2] = {{OP_FORWARD, OP_BACKWARD},
                            {OP_FORWARD, OP_RECOMPUTE},
                            {OP_SCHEDULE, OP_FORWARD},
                            {OP_BACKWARD, OP_SCHEDULE},
                            {OP_RECOMPUTE, OP_BACKWARD}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
      run_all(&s, step_main); /* saved filled again for the backward of the pair */
      for (int r = 0; r < 2; r++) rank_poison(&s.run[r]);
      op_run o[2] = {{&s.run[0], pairs[i][0], MOK_OK, ""}, {&s.run[1], pairs[i][1], MOK_OK, ""}};
      pthread_t th[2];
      const double t0 = now_s();
      for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, op_main, &o[r]);
      for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
      CHECK(now_s() - t0 < 2.0, "%s with %s took %.3f s (a timeout?)", names[pairs[i][0]],
            names[pairs[i][1]], now_s() - t0);
      for (int r = 0; r < 2; r++) {
        CHECK(o[r].st == MOK_ERR_INVALID_ARG && strstr(o[r].msg, "different calls") &&
                  strstr(o[r].msg, names[pairs[i][0]]) && strstr(o[r].msg, names[pairs[i][1]]),
              "%s on rank 0 with %s on rank 1: rank %d gave %s (%s)", names[pairs[i][0]],
              names[pairs[i][1]], r, mok_status_name(o[r].st), o[r].msg);
        const rank_run *u = &s.run[r];
        CHECK(untouched(u->f.y, u->y_bytes) && untouched(u->b.dx, u->y_bytes) &&
                  untouched(u->b.d_topk_weights, u->dtw_bytes),
              "%s with %s: rank %d wrote an output", names[pairs[i][0]], names[pairs[i][1]], r);
        CHECK_OK(mok_check(u->ws, NULL));
      }
    }
    run_all(&s, step_main); /* the group still works, and gives the first step's bits */
    for (int r = 0; r < 2; r++) {
      CHECK(s.run[r].fwd == MOK_OK && s.run[r].bwd == MOK_OK, "rank %d after: %s / %s", r,
            mok_status_name(s.run[r].fwd), mok_status_name(s.run[r].bwd));
      CHECK(first_y[r] && first_dx[r] &&
                !memcmp(first_y[r], s.run[r].f.y, (size_t)s.run[r].y_bytes) &&
                !memcmp(first_dx[r], s.run[r].b.dx, (size_t)s.run[r].y_bytes),
            "rank %d: y or dx differs from the first step's", r);
      free(first_y[r]);
      free(first_dx[r]);
    }
  }
  teardown(&s);
  mok_host_layer_destroy(&L);
}

/* NCCL groups, on the host alone (tests/gpu/test_nccl.c runs one): what is checked before NCCL
 * is touched, and an id from whichever NCCL is installed (or a message saying there is none). */
static void nccl_group_arguments(void) {
  mok_ep_group *g = (mok_ep_group *)&g;
#ifdef MOK_NO_CUDA /* a build without CUDA has no NCCL groups, whatever the arguments */
  unsigned char none[MOK_NCCL_ID_BYTES] = {0};
  const mok_status got[3] = {mok_ep_group_create_nccl(NULL, 0, &g), mok_nccl_id(none),
                             mok_ep_group_create_nccl_id(none, 0, 1, 0, 0, &g)};
  for (int i = 0; i < 3; i++)
    CHECK(got[i] == MOK_ERR_UNSUPPORTED && !g, "call %d gave %s", i, mok_status_name(got[i]));
  CHECK(strstr(mok_last_error(), "built without the CUDA backend"), "%s", mok_last_error());
#else
  mok_status st = mok_ep_group_create_nccl(NULL, 0, &g);
  CHECK(st == MOK_ERR_INVALID_ARG && !g, "a NULL communicator gave %s", mok_status_name(st));
  unsigned char id[MOK_NCCL_ID_BYTES] = {0};
  const int bad[][3] = {{0, 0, 0}, {2, 2, 0}, {-1, 2, 0}, {0, MOK_EP_MAX + 1, 0}, {0, 2, -1}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    g = (mok_ep_group *)&g;
    st = mok_ep_group_create_nccl_id(id, bad[i][0], bad[i][1], 0, bad[i][2], &g);
    CHECK(st == MOK_ERR_INVALID_ARG && !g, "rank %d of %d, timeout %d gave %s", bad[i][0],
          bad[i][1], bad[i][2], mok_status_name(st));
  }
  st = mok_ep_group_create_nccl_id(NULL, 0, 1, 0, 0, &g);
  CHECK(st == MOK_ERR_INVALID_ARG, "a NULL id gave %s", mok_status_name(st));
  CHECK(mok_nccl_id(NULL) == MOK_ERR_INVALID_ARG, "mok_nccl_id(NULL) accepted");
  st = mok_nccl_id(id);
  CHECK(st == MOK_OK || (st == MOK_ERR_UNSUPPORTED && strstr(mok_last_error(), "libnccl")),
        "mok_nccl_id gave %s: %s", mok_status_name(st), mok_last_error());
#endif
}

const test_case tests_ep[] = {
    {"ep/nccl_group_arguments", nccl_group_arguments},
    {"ep/D4_bits_across_ep_1_2_4_8", d4_across_ep},
    {"ep/D4_uneven_tokens_repeated", d4_uneven_repeated},
    {"fp8/ep_D4_bits_across_ep_1_2_4_8", d4_across_ep_fp8},
    {"fp8/ep_D4_uneven_tokens_repeated", d4_uneven_repeated_fp8},
    {"ep/absent_rank_times_out", absent_rank_times_out},
    {"ep/turns_in_rank_order", turns_in_rank_order},
    {"ep/api_calls_take_turns", api_calls_take_turns},
    {"ep/bad_id_on_one_rank_stops_all", bad_id_on_one_rank},
    {"ep/capacity_overflow_stops_all", capacity_overflow},
    {"ep/refused_arguments_on_one_rank", refused_arguments_on_one_rank},
    {"ep/schedule_counts_per_rank", schedule_counts_per_rank},
    {"ep/different_calls_on_ranks_fail_all", different_calls_on_ranks},
    {NULL, NULL},
};
