/*
 * test_ep.c: expert parallelism on the CUDA backend with emulated ranks (DESIGN §2.3): R ranks on
 * one GPU, each with its own context, workspace, stream and host thread, their device barriers
 * and peer tables joining them as NCCL symmetric memory would join R GPUs.
 *   D4 and the reference: the global batch at ep = 2, 4, 8 gives the bits of ep = 1 (y, dx,
 *     d_topk_weights, routed weight gradients), and ep = 1 agrees with the CPU backend; every
 *     rank's slot_row inverts its row_src for its own slots.
 *   Failures: a rank that never calls (timeout), a bad id on one rank, one rank over its
 *     capacity, a call refused on the host on one rank, and a backward of other tokens than its
 *     saved on one rank, and ranks making different calls each fail every rank with outputs
 *     untouched.
 *   Graphs: every rank's forward and backward captured at once and replayed in rank order, twice.
 * Every rank's arguments are slices of one gpu_layer: its tokens' rows of x, dy, y, dx,
 * d_topk_weights and its experts' weights and gradients; the shared expert's gradients are each
 * rank's own partial sums and get buffers of their own.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "device.h"

typedef struct grank {
  mok_context *ctx;
  mok_workspace *ws;
  cudaStream_t stream;
  mok_forward_args f;
  mok_backward_args b;
  void *shared_g[3];       /* this rank's shared-expert gradients */
  void *fp8;               /* MOK_FP8: this rank's FP8 weights, from its slice of the bf16 ones */
  int absent;              /* never calls */
  mok_status fwd, bwd, chk;
  double t[4];             /* host clock at the thread's start and as each call returned */
  cudaGraphExec_t graph;   /* forward + backward captured on this rank's stream */
} grank;

typedef struct gsetup {
  int ep;
  mok_ep_group *group;
  grank r[8];
} gsetup;

/* Rank r of ep takes tokens [r T/ep, (r+1) T/ep) and experts [r E/ep, (r+1) E/ep) of d. */
static int gsetup_init(gsetup *s, gpu_layer *d, int ep, int64_t routed_rows, int timeout_ms) {
  memset(s, 0, sizeof *s);
  s->ep = ep;
  CHECK_OK(mok_ep_group_create_emulated(ep, timeout_ms, &s->group));
  if (!s->group) return 0;
  const mok_shape *gs = &d->src->L.shape;
  const int64_t H = gs->hidden, I = gs->inter, Is = gs->shared_inter, k = gs->top_k;
  const int64_t El = gs->experts / ep, Tr = d->T / ep;
  const mok_forward_args F = gpu_forward_args(d);
  const mok_backward_args B = gpu_backward_args(d, MOK_GRAD_WRITE_BF16);
  for (int r = 0; r < ep; r++) {
    grank *u = &s->r[r];
    mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
    cfg.backend = MOK_BACKEND_CUDA;
    cfg.ep_rank = r, cfg.ep_size = ep, cfg.group = s->group;
    CHECK_OK(mok_context_create(&cfg, &u->ctx));
    mok_shape shape = *gs;
    shape.max_tokens = Tr;
    shape.routed_rows = routed_rows;
    if (u->ctx) CHECK_OK(mok_workspace_create(u->ctx, &shape, &u->ws));
    if (!u->ws) return 0;
    CUDA_CHECK(cudaStreamCreateWithFlags(&u->stream, cudaStreamNonBlocking));
    const int64_t t0 = r * Tr, e0 = r * El;
    mok_weights w = {d->w[G_GATE], d->w[G_UP], d->w[G_DOWN], d->w[GS_GATE], d->w[GS_UP],
                     d->w[GS_DOWN], NULL};
    w.w_gate = (const char *)w.w_gate + e0 * I * H * 2;
    w.w_up = (const char *)w.w_up + e0 * I * H * 2;
    w.w_down = (const char *)w.w_down + e0 * H * I * 2;
    if (gs->precision == MOK_FP8) { /* a rank's FP8 buffer holds its experts only */
      CUDA_CHECK(cudaMalloc(&u->fp8, mok_fp8_weights_bytes(u->ws)));
      CHECK_OK(mok_quantize_weights(u->ws, &w, u->fp8, 0));
      const mok_weights w8 = {NULL, NULL, NULL, NULL, NULL, NULL, u->fp8};
      w = w8;
    }
    u->f = F;
    u->f.tokens = Tr;
    u->f.x = (const char *)F.x + t0 * H * 2;
    u->f.topk_ids = F.topk_ids + t0 * k;
    u->f.topk_weights = F.topk_weights + t0 * k;
    u->f.w = w;
    u->f.y = (char *)F.y + t0 * H * 2;
    size_t saved = mok_saved_bytes(u->ws, Tr);
    CUDA_CHECK(cudaMalloc(&u->f.saved, saved));
    CUDA_CHECK(cudaMemset(u->f.saved, 0x5a, saved)); /* not -1: a missing slot_row write shows */
    u->b = B;
    u->b.tokens = Tr;
    u->b.x = u->f.x, u->b.topk_ids = u->f.topk_ids, u->b.topk_weights = u->f.topk_weights;
    u->b.w = w, u->b.saved = u->f.saved;
    u->b.dy = (const char *)B.dy + t0 * H * 2;
    u->b.dx = (char *)B.dx + t0 * H * 2;
    u->b.d_topk_weights = B.d_topk_weights + t0 * k;
    u->b.g.dw_gate = (char *)B.g.dw_gate + e0 * I * H * 2;
    u->b.g.dw_up = (char *)B.g.dw_up + e0 * I * H * 2;
    u->b.g.dw_down = (char *)B.g.dw_down + e0 * H * I * 2;
    if (Is) {
      for (int i = 0; i < 3; i++) CUDA_CHECK(cudaMalloc(&u->shared_g[i], (size_t)(Is * H) * 2));
      u->b.g.dws_gate = u->shared_g[0], u->b.g.dws_up = u->shared_g[1];
      u->b.g.dws_down = u->shared_g[2];
    }
  }
  /* The poison and saved's fill ran on the legacy stream, which the ranks' non-blocking streams
   * do not wait for. */
  CUDA_CHECK(cudaDeviceSynchronize());
  return 1;
}

static void gsetup_fini(gsetup *s) {
  for (int r = 0; r < s->ep; r++) {
    grank *u = &s->r[r];
    cudaFree(u->f.saved);
    cudaFree(u->fp8);
    for (int i = 0; i < 3; i++) cudaFree(u->shared_g[i]);
    if (u->stream) cudaStreamDestroy(u->stream);
    if (u->graph) cudaGraphExecDestroy(u->graph);
    mok_workspace_destroy(u->ws);
    mok_context_destroy(u->ctx);
  }
  mok_ep_group_destroy(s->group);
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* A rank's thread: forward and backward on its stream, then mok_check (which waits). The host
 * times say, when a group times out, whether a rank's thread was late to its calls or blocked
 * in one (forward and backward wait for their turn, then enqueue). */
static void *step_main(void *p) {
  grank *u = p;
  u->t[0] = now_s();
  u->fwd = mok_forward(u->ws, &u->f, u->stream);
  u->t[1] = now_s();
  u->bwd = mok_backward(u->ws, &u->b, u->stream);
  u->t[2] = now_s();
  u->chk = mok_check(u->ws, u->stream);
  u->t[3] = now_s();
  return NULL;
}

/* A rank's thread: captures forward and backward into u->graph (its thread's capture only, as
 * separate processes would). */
static void *capture_main(void *p) {
  grank *u = p;
  cudaGraph_t g = NULL;
  u->fwd = u->bwd = MOK_ERR_INTERNAL;
  if (cudaStreamBeginCapture(u->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
    return NULL;
  u->fwd = mok_forward(u->ws, &u->f, u->stream);
  u->bwd = mok_backward(u->ws, &u->b, u->stream);
  if (cudaStreamEndCapture(u->stream, &g) != cudaSuccess ||
      cudaGraphInstantiate(&u->graph, g, 0) != cudaSuccess)
    u->fwd = MOK_ERR_CUDA;
  if (g) cudaGraphDestroy(g);
  return NULL;
}

/* Every rank's graph launched in rank order, as mok enqueues the calls of emulated ranks (a
 * graph launch does not go through mok: DESIGN §2.3), then every rank checked. */
static void replay_in_order(gsetup *s) {
  for (int r = 0; r < s->ep; r++)
    s->r[r].chk = cudaGraphLaunch(s->r[r].graph, s->r[r].stream) == cudaSuccess ? MOK_OK
                                                                               : MOK_ERR_CUDA;
  for (int r = 0; r < s->ep; r++)
    if (s->r[r].chk == MOK_OK) s->r[r].chk = mok_check(s->r[r].ws, s->r[r].stream);
}

static void run_ranks_with(gsetup *s, void *(*fn)(void *)) {
  pthread_t th[8];
  for (int r = 0; r < s->ep; r++)
    if (!s->r[r].absent) pthread_create(&th[r], NULL, fn, &s->r[r]);
  for (int r = 0; r < s->ep; r++)
    if (!s->r[r].absent) pthread_join(th[r], NULL);
}

static void run_ranks(gsetup *s) { run_ranks_with(s, step_main); }

/* Each rank's saved slot_row, copied to the host, against the rule (slot_row_first_wrong). */
static void check_slot_row(const gsetup *s, const mok_shape *shape) {
  for (int r = 0; r < s->ep; r++) {
    const grank *u = &s->r[r];
    const size_t bytes = mok_saved_bytes(u->ws, u->f.tokens);
    const int64_t slots = u->f.tokens * shape->top_k;
    void *saved = malloc(bytes);
    int32_t *ids = malloc((size_t)slots * 4);
    CUDA_CHECK(cudaMemcpy(saved, u->f.saved, bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(ids, u->f.topk_ids, (size_t)slots * 4, cudaMemcpyDeviceToHost));
    const int64_t q =
        slot_row_first_wrong(u->ws, saved, u->f.tokens, ids, r, shape->experts / s->ep);
    CHECK(q < 0, "ep %d rank %d: slot_row of slot %lld wrong (expert %d)", s->ep, r,
          (long long)q, q < 0 ? 0 : ids[q]);
    free(saved), free(ids);
  }
}

/* 256 tokens, H 128, I 128, I_s 64, 16 experts, top-4. */
static const mok_shape ep_shape = {256, 128, 128, 64, 16, 4, MOK_BF16, 0};

/* D4 at ep = 2, 4, 8 against ep = 1, and ep = 1 against the CPU backend, for `shape`; with
 * `idle`, every token routed to the first half of the experts, so that at every ep the last
 * ranks have no rows at all. */
static void d4_of(const mok_shape *shape, int idle) {
  harness ref, one, got;
  if (!harness_init(&ref, shape, 256, 21, 0) || !harness_init(&one, shape, 256, 21, 0) ||
      !harness_init(&got, shape, 256, 21, 0))
    return;
  if (idle) /* ids j < k of a token stay distinct: 16 experts, top-4, ids 0..7 */
    for (int64_t i = 0; i < 256 * shape->top_k; i++)
      ref.L.topk_ids[i] = (int32_t)(i % shape->top_k + 2 * (i / shape->top_k % 2));
  CHECK_OK(harness_run(&ref, MOK_GRAD_WRITE_BF16));
  gpu_layer d;
  if (gpu_init(&d, &ref, 256, NULL)) {
    gpu_poison(&d, 0xff);
    CHECK_OK(gpu_run(&d, MOK_GRAD_WRITE_BF16, 0));
    CHECK_OK(mok_check(d.ws, 0));
    gpu_fetch(&d, &one);
    const int64_t n = 256 * shape->hidden;
    double ey = rel_err_bf16(one.y, ref.y, (size_t)n);
    double edx = rel_err_bf16(one.dx, ref.dx, (size_t)n);
    CHECK(ey < 2e-2 && edx < 2e-2, "ep 1 against the CPU backend: y %.2e, dx %.2e", ey, edx);
    const int eps[3] = {2, 4, 8};
    for (int i = 0; i < 3; i++) {
      gsetup s;
      gpu_poison(&d, 0xff);
      if (gsetup_init(&s, &d, eps[i], 0, 0)) {
        const double t0 = now_s();
        run_ranks(&s);
        for (int r = 0; r < eps[i]; r++) {
          const grank *u = &s.r[r];
          CHECK(u->fwd == MOK_OK && u->bwd == MOK_OK && u->chk == MOK_OK,
                "ep %d rank %d: forward %s, backward %s, check %s (host, s after the threads' "
                "start: began %.4f, forward returned %.4f, backward %.4f, check %.4f)",
                eps[i], r, mok_status_name(u->fwd), mok_status_name(u->bwd),
                mok_status_name(u->chk), u->t[0] - t0, u->t[1] - t0, u->t[2] - t0,
                u->t[3] - t0);
        }
        check_slot_row(&s, shape);
        gpu_fetch(&d, &got);
        char tag[32];
        snprintf(tag, sizeof tag, "%s ep %d against ep 1",
                 shape->precision == MOK_FP8 ? "fp8" : "bf16", eps[i]);
        same_layer_bits(tag, &got, &one, 3);
      }
      gsetup_fini(&s);
    }
  }
  gpu_fini(&d);
  harness_fini(&ref);
  harness_fini(&one);
  harness_fini(&got);
}

static void d4_and_reference(void) { d4_of(&ep_shape, 0); }

/* The FP8 layer: its ranks move bf16 rows and write peers' slots and router partials as BF16's
 * do, and each rank quantizes its own experts' weights. */
static void d4_fp8(void) {
  mok_shape s = ep_shape;
  s.precision = MOK_FP8;
  d4_of(&s, 0);
  d4_of(&s, 1); /* ranks without rows: their forward still marks saved filled */
}

/* Every rank fails the step with `want` (at mok_check; `refused` >= 0: that rank's forward and
 * backward were refused on the host with MOK_ERR_INVALID_ARG) and every output stays poisoned. */
static void all_fail_untouched(gsetup *s, gpu_layer *d, harness *got, const harness *poison,
                               mok_status want, int refused, const char *what) {
  run_ranks(s);
  for (int r = 0; r < s->ep; r++) {
    const grank *u = &s->r[r];
    if (u->absent) continue;
    if (r == refused)
      CHECK(u->fwd == MOK_ERR_INVALID_ARG && u->bwd == MOK_ERR_INVALID_ARG,
            "%s: rank %d's refused calls gave %s, %s", what, r, mok_status_name(u->fwd),
            mok_status_name(u->bwd));
    else
      CHECK(u->fwd == MOK_OK && u->bwd == MOK_OK && u->chk == want,
            "%s: rank %d: forward %s, backward %s, check %s (want %s)", what, r,
            mok_status_name(u->fwd), mok_status_name(u->bwd), mok_status_name(u->chk),
            mok_status_name(want));
  }
  gpu_fetch(d, got);
  char tag[96];
  snprintf(tag, sizeof tag, "%s: outputs untouched", what);
  same_layer_bits(tag, got, poison, 3);
}

static void failures_untouched(void) {
  harness h, got, poison;
  if (!harness_init(&h, &ep_shape, 256, 22, 0) || !harness_init(&got, &ep_shape, 256, 22, 0) ||
      !harness_init(&poison, &ep_shape, 256, 22, 0))
    return;
  harness_poison(&poison, 0xa5);
  gpu_layer d;
  if (gpu_init(&d, &h, 256, NULL)) {
    gsetup s;
    /* A rank that never calls: the other times out, and the group stays failed. */
    gpu_poison(&d, 0xa5);
    if (gsetup_init(&s, &d, 2, 0, 300)) {
      s.r[1].absent = 1;
      all_fail_untouched(&s, &d, &got, &poison, MOK_ERR_TIMEOUT, -1, "absent rank");
      mok_status st = mok_forward(s.r[0].ws, &s.r[0].f, s.r[0].stream);
      CHECK(st == MOK_ERR_TIMEOUT, "a call after the timeout gave %s", mok_status_name(st));
    }
    gsetup_fini(&s);
    /* A bad id on rank 1. */
    const int32_t bad = ep_shape.experts;
    CUDA_CHECK(cudaMemcpy((int32_t *)d.ids + 200 * 4 + 1, &bad, 4, cudaMemcpyHostToDevice));
    if (gsetup_init(&s, &d, 2, 0, 0))
      all_fail_untouched(&s, &d, &got, &poison, MOK_ERR_EXPERT_ID, -1, "bad id on rank 1");
    gsetup_fini(&s);
    /* Every slot of every token to expert 15 (rank 1's): 256 * 4 rows against room for 640. */
    int32_t *ids = malloc(256 * 4 * 4);
    for (int i = 0; i < 256 * 4; i++) ids[i] = 15 - i % 4;
    CUDA_CHECK(cudaMemcpy(d.ids, ids, 256 * 4 * 4, cudaMemcpyHostToDevice));
    free(ids);
    if (gsetup_init(&s, &d, 2, 640, 0))
      all_fail_untouched(&s, &d, &got, &poison, MOK_ERR_CAPACITY, -1, "rank 1 over capacity");
    gsetup_fini(&s);
    /* Rank 0 passes no y (and no dx): refused on the host, and rank 1 fails the call with it. */
    CUDA_CHECK(cudaMemcpy(d.ids, h.L.topk_ids, 256 * 4 * 4, cudaMemcpyHostToDevice));
    if (gsetup_init(&s, &d, 2, 0, 0)) {
      s.r[0].f.y = NULL;
      s.r[0].b.dx = NULL;
      all_fail_untouched(&s, &d, &got, &poison, MOK_ERR_INVALID_ARG, 0, "refused on rank 0");
      /* The group stays usable: the next step runs on both ranks. */
      s.r[0].f.y = (char *)d.y, s.r[0].b.dx = d.dx;
      run_ranks(&s);
      for (int r = 0; r < 2; r++)
        CHECK(s.r[r].chk == MOK_OK, "the step after a refused call: rank %d %s", r,
              mok_status_name(s.r[r].chk));
    }
    gsetup_fini(&s);
  }
  gpu_fini(&d);
  harness_fini(&h);
  harness_fini(&got);
  harness_fini(&poison);
}

static void *forward_main(void *p) {
  grank *u = p;
  u->fwd = mok_forward(u->ws, &u->f, u->stream);
  u->chk = mok_check(u->ws, u->stream);
  return NULL;
}

/* Backward, then mok_check; a check that fails must name saved in its message (which is
 * thread-local: looked at here), else it counts as MOK_ERR_INTERNAL. */
static void *backward_main(void *p) {
  grank *u = p;
  u->bwd = mok_backward(u->ws, &u->b, u->stream);
  u->chk = mok_check(u->ws, u->stream);
  if (u->chk != MOK_OK && !strstr(mok_last_error(), "saved")) u->chk = MOK_ERR_INTERNAL;
  return NULL;
}

/* Rank 1's backward has fewer tokens than the forward that filled its saved: its check raises
 * MOK_DEVERR_SAVED before the opening barrier, so every rank skips the backward
 * (MOK_ERR_INVALID_ARG at mok_check) and no output of it is written on any rank. */
static void saved_of_another_call(void) {
  harness h, got, poison;
  if (!harness_init(&h, &ep_shape, 256, 24, 0) || !harness_init(&got, &ep_shape, 256, 24, 0) ||
      !harness_init(&poison, &ep_shape, 256, 24, 0))
    return;
  harness_poison(&poison, 0xa5);
  gpu_layer d;
  if (gpu_init(&d, &h, 256, NULL)) {
    gsetup s;
    if (gsetup_init(&s, &d, 2, 0, 0)) {
      run_ranks_with(&s, forward_main);
      for (int r = 0; r < 2; r++)
        CHECK(s.r[r].fwd == MOK_OK && s.r[r].chk == MOK_OK, "forward on rank %d: %s, check %s", r,
              mok_status_name(s.r[r].fwd), mok_status_name(s.r[r].chk));
      gpu_poison(&d, 0xa5); /* y too: the backward must write nothing at all */
      s.r[1].b.tokens -= 16;
      run_ranks_with(&s, backward_main);
      for (int r = 0; r < 2; r++)
        CHECK(s.r[r].bwd == MOK_OK && s.r[r].chk == MOK_ERR_INVALID_ARG,
              "rank %d: backward %s, check %s (want MOK_ERR_INVALID_ARG)", r,
              mok_status_name(s.r[r].bwd), mok_status_name(s.r[r].chk));
      gpu_fetch(&d, &got);
      same_layer_bits("saved of another call on rank 1: outputs untouched", &got, &poison, 3);
    }
    gsetup_fini(&s);
  }
  gpu_fini(&d);
  harness_fini(&h);
  harness_fini(&got);
  harness_fini(&poison);
}

/* One rank's call of a chosen kind, then mok_check; msg keeps the check's message. */
typedef struct mixed_call {
  grank *u;
  int backward;
  mok_status st, chk;
  char msg[512];
} mixed_call;

static void *mixed_main(void *p) {
  mixed_call *m = p;
  grank *u = m->u;
  m->st = m->backward ? mok_backward(u->ws, &u->b, u->stream) : mok_forward(u->ws, &u->f, u->stream);
  m->chk = mok_check(u->ws, u->stream);
  snprintf(m->msg, sizeof m->msg, "%s", mok_last_error());
  return NULL;
}

/* Rank 0 calls forward while rank 1 calls backward: the opening device barrier sees two kinds of
 * call (each rank's word carries its kind), every kernel of both calls skips, mok_check reports
 * MOK_ERR_INVALID_ARG naming both on each rank, no output is written, and the group stays usable:
 * the next step runs on both ranks. */
static void different_calls_on_ranks(void) {
  harness h, got, poison;
  if (!harness_init(&h, &ep_shape, 256, 25, 0) || !harness_init(&got, &ep_shape, 256, 25, 0) ||
      !harness_init(&poison, &ep_shape, 256, 25, 0))
    return;
  harness_poison(&poison, 0xa5);
  gpu_layer d;
  if (gpu_init(&d, &h, 256, NULL)) {
    gsetup s;
    if (gsetup_init(&s, &d, 2, 0, 5000)) {
      run_ranks_with(&s, forward_main); /* rank 1's saved, for its backward */
      gpu_poison(&d, 0xa5);
      mixed_call m[2] = {{&s.r[0], 0, MOK_OK, MOK_OK, ""}, {&s.r[1], 1, MOK_OK, MOK_OK, ""}};
      pthread_t th[2];
      for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, mixed_main, &m[r]);
      for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
      for (int r = 0; r < 2; r++)
        CHECK(m[r].st == MOK_OK && m[r].chk == MOK_ERR_INVALID_ARG &&
                  strstr(m[r].msg, "different calls") && strstr(m[r].msg, "mok_forward") &&
                  strstr(m[r].msg, "mok_backward"),
              "rank %d: call %s, check %s (%s)", r, mok_status_name(m[r].st),
              mok_status_name(m[r].chk), m[r].msg);
      gpu_fetch(&d, &got);
      same_layer_bits("forward on rank 0, backward on rank 1: outputs untouched", &got, &poison,
                      3);
      run_ranks(&s);
      for (int r = 0; r < 2; r++)
        CHECK(s.r[r].fwd == MOK_OK && s.r[r].bwd == MOK_OK && s.r[r].chk == MOK_OK,
              "the step after different calls: rank %d %s / %s / %s", r,
              mok_status_name(s.r[r].fwd), mok_status_name(s.r[r].bwd),
              mok_status_name(s.r[r].chk));
    }
    gsetup_fini(&s);
  }
  gpu_fini(&d);
  harness_fini(&h);
  harness_fini(&got);
  harness_fini(&poison);
}

/* Each rank captures forward and backward in a CUDA graph (the device barriers and the epoch
 * counter inside), the ranks' threads at once; the graphs, replayed twice, give the bits of ep 1
 * each time. */
static void graph_replay(void) {
  harness h, one, got;
  if (!harness_init(&h, &ep_shape, 256, 23, 0) || !harness_init(&one, &ep_shape, 256, 23, 0) ||
      !harness_init(&got, &ep_shape, 256, 23, 0))
    return;
  gpu_layer d;
  if (gpu_init(&d, &h, 256, NULL)) {
    CHECK_OK(gpu_run(&d, MOK_GRAD_WRITE_BF16, 0));
    CHECK_OK(mok_check(d.ws, 0));
    gpu_fetch(&d, &one);
    gsetup s;
    if (gsetup_init(&s, &d, 4, 0, 0)) {
      run_ranks_with(&s, capture_main);
      for (int r = 0; r < 4; r++)
        CHECK(s.r[r].fwd == MOK_OK && s.r[r].bwd == MOK_OK && s.r[r].graph,
              "rank %d's capture: forward %s, backward %s", r, mok_status_name(s.r[r].fwd),
              mok_status_name(s.r[r].bwd));
      for (int i = 0; i < 2 && s.r[3].graph; i++) {
        gpu_poison(&d, 0xff);
        replay_in_order(&s);
        for (int r = 0; r < 4; r++)
          CHECK(s.r[r].chk == MOK_OK, "replay %d, rank %d: %s", i, r,
                mok_status_name(s.r[r].chk));
        gpu_fetch(&d, &got);
        same_layer_bits(i ? "ep 4, second replay" : "ep 4, first replay", &got, &one, 3);
      }
    }
    gsetup_fini(&s);
  }
  gpu_fini(&d);
  harness_fini(&h);
  harness_fini(&one);
  harness_fini(&got);
}

const test_case tests_gpu_ep[] = {
    {"gpu/ep_graph_capture_replay", graph_replay},
    {"gpu/ep_D4_and_vs_cpu", d4_and_reference},
    {"gpu/ep_fp8_D4_and_vs_cpu", d4_fp8},
    {"gpu/ep_failures_untouched", failures_untouched},
    {"gpu/ep_saved_of_another_call_untouched", saved_of_another_call},
    {"gpu/ep_different_calls_untouched", different_calls_on_ranks},
    {NULL, NULL},
};
