/*
 * ep.c: the mok command on R emulated ranks of an EP group (CPU backend), each with the shape's T
 * tokens (a global batch of R*T) and a thread of its own.
 *   mok run --ep R:   then the same batch on one rank; prints both times and whether every output
 *                     has the same bits on both (DESIGN §3, D4): y, dx and d_topk_weights of every
 *                     token, and the routed weight gradients of every expert. The shared expert's
 *                     gradients are per-rank partial sums (DESIGN §2.3) and are not compared.
 *   mok bench --ep R: forward and backward timed apart (wall clock from the first rank's start
 *                     to the last rank's end), and whether the last run repeats the first's bits.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layer.h"
#include "mok_gen.h"

enum { EP_Y, EP_DX, EP_DTW, EP_GATE, EP_UP, EP_DOWN, EP_SG, EP_SU, EP_SD, EP_COUNT };
static const char *ep_names[EP_COUNT] = {"y", "dx", "d_topk_weights", "dw_gate", "dw_up",
                                         "dw_down", "dws_gate", "dws_up", "dws_down"};

/* One rank (or the single-rank run): its context, workspace, arguments and output buffers. */
typedef struct ep_rank {
  mok_context *ctx;
  mok_workspace *ws;
  mok_forward_args f;
  mok_backward_args b;
  void *out[EP_COUNT];
  size_t bytes[EP_COUNT];
  mok_status st;
} ep_rank;

static void *zalloc(size_t bytes) {
  void *p = aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (p) memset(p, 0, bytes);
  return p;
}

/* Rank r of R over tokens [r T, (r+1) T) and experts [r E/R, (r+1) E/R) of L (R = 1: all). */
static int rank_init(ep_rank *u, const mok_host_layer *L, const cli_options *o, int r, int R,
                     mok_ep_group *g, int64_t T) {
  memset(u, 0, sizeof *u);
  const mok_shape *gs = &L->shape;
  const int64_t H = gs->hidden, I = gs->inter, Is = gs->shared_inter, k = gs->top_k;
  const int64_t El = gs->experts / R, ge = o->grad_mode == MOK_GRAD_ACCUMULATE_F32 ? 4 : 2;
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  cfg.ep_rank = r, cfg.ep_size = R, cfg.group = R > 1 ? g : NULL;
  cfg.threads = o->threads > 0 ? (o->threads + R - 1) / R : 0;
  mok_status st = mok_context_create(&cfg, &u->ctx);
  if (st != MOK_OK) return tool_mok_error("mok_context_create", st);
  mok_shape shape = *gs;
  shape.max_tokens = T;
  st = mok_workspace_create(u->ctx, &shape, &u->ws);
  if (st != MOK_OK) return tool_mok_error("mok_workspace_create", st);
  const size_t b[EP_COUNT] = {(size_t)(T * H * 2), (size_t)(T * H * 2), (size_t)(T * k * 4),
                              (size_t)(El * I * H * ge), (size_t)(El * I * H * ge),
                              (size_t)(El * H * I * ge), (size_t)(Is * H * ge),
                              (size_t)(Is * H * ge), (size_t)(H * Is * ge)};
  for (int i = 0; i < EP_COUNT; i++) {
    u->bytes[i] = b[i];
    if (b[i] && !(u->out[i] = zalloc(b[i]))) {
      tool_error("no host memory for %zu bytes of %s", b[i], ep_names[i]);
      return 1;
    }
  }
  void *saved = zalloc(mok_saved_bytes(u->ws, T));
  if (!saved) {
    tool_error("no host memory for saved");
    return 1;
  }
  mok_weights w = mok_host_layer_weights(L);
  w.w_gate = L->w_gate + r * El * I * H;
  w.w_up = L->w_up + r * El * I * H;
  w.w_down = L->w_down + r * El * H * I;
  u->f = (mok_forward_args){T, L->x + r * T * H, L->topk_ids + r * T * k,
                            L->topk_weights + r * T * k, w, u->out[EP_Y], saved};
  mok_grads gr = {u->out[EP_GATE], u->out[EP_UP], u->out[EP_DOWN],
                  u->out[EP_SG],   u->out[EP_SU], u->out[EP_SD]};
  u->b = (mok_backward_args){T, u->f.x, u->f.topk_ids, u->f.topk_weights, w, saved,
                             L->dy + r * T * H, u->out[EP_DX], u->out[EP_DTW], gr, o->grad_mode};
  return 0;
}

static void rank_fini(ep_rank *u) {
  if (u->f.saved) free(u->f.saved);
  for (int i = 0; i < EP_COUNT; i++) free(u->out[i]);
  mok_workspace_destroy(u->ws);
  mok_context_destroy(u->ctx);
}

static void *rank_main(void *p) {
  ep_rank *u = p;
  u->st = mok_forward(u->ws, &u->f, NULL);
  if (u->st == MOK_OK) u->st = mok_backward(u->ws, &u->b, NULL);
  return NULL;
}

static void *rank_forward(void *p) {
  ep_rank *u = p;
  u->st = mok_forward(u->ws, &u->f, NULL);
  return NULL;
}

static void *rank_backward(void *p) {
  ep_rank *u = p;
  for (int i = EP_GATE; i < EP_COUNT; i++) /* f32 main grads start from zero every time */
    if (u->b.grad_mode == MOK_GRAD_ACCUMULATE_F32 && u->out[i]) memset(u->out[i], 0, u->bytes[i]);
  u->st = mok_backward(u->ws, &u->b, NULL);
  return NULL;
}

/* Every rank runs fn on its own thread; returns the wall seconds, or -1 if a rank failed. */
static double all_ranks(ep_rank *ranks, int R, void *(*fn)(void *)) {
  pthread_t th[MOK_EP_MAX];
  const double t0 = tool_seconds();
  for (int r = 0; r < R; r++) pthread_create(&th[r], NULL, fn, &ranks[r]);
  for (int r = 0; r < R; r++) pthread_join(th[r], NULL);
  const double t = tool_seconds() - t0;
  for (int r = 0; r < R; r++)
    if (ranks[r].st != MOK_OK) {
      tool_error("rank %d: %s: %s", r, mok_status_name(ranks[r].st), mok_last_error());
      return -1;
    }
  return t;
}

/* The global batch and its R ranks. */
typedef struct ep_world {
  int R;
  int64_t T;          /* tokens per rank */
  mok_host_layer L;   /* R*T tokens, every expert */
  mok_ep_group *g;
  ep_rank *ranks;     /* [R] */
} ep_world;

static void world_fini(ep_world *w) {
  for (int r = 0; w->ranks && r < w->R; r++) rank_fini(&w->ranks[r]);
  free(w->ranks);
  mok_ep_group_destroy(w->g);
  mok_host_layer_destroy(&w->L);
}

static int world_init(ep_world *w, const cli_options *o) {
  memset(w, 0, sizeof *w);
  w->R = o->ep, w->T = o->shape.max_tokens;
  mok_shape gs = o->shape;
  gs.max_tokens = w->T * w->R;
  double t0 = tool_step("inputs of the global batch (%d ranks x %lld tokens)", w->R,
                        (long long)w->T);
  mok_status st = mok_host_layer_create(&gs, w->T * w->R, o->seed, &w->L);
  if (st != MOK_OK) return tool_mok_error("mok_host_layer_create", st);
  tool_done(t0);
  st = mok_ep_group_create_emulated(w->R, 0, &w->g);
  if (st != MOK_OK) return tool_mok_error("mok_ep_group_create_emulated", st);
  if (!(w->ranks = calloc((size_t)w->R, sizeof *w->ranks))) {
    tool_error("no host memory for %d ranks", w->R);
    return 1;
  }
  for (int r = 0; r < w->R; r++)
    if (rank_init(&w->ranks[r], &w->L, o, r, w->R, w->g, w->T)) return 1;
  return 0;
}

static int compare_doubles(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void print_times(const char *name, double *ms, int n, double flops) {
  qsort(ms, (size_t)n, sizeof *ms, compare_doubles);
  const double med = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  printf("  %-9s %12.3f %12.3f %12.3f %10.3f\n", name, med, ms[0], ms[n - 1],
         flops / (med * 1e-3) / 1e12);
}

int tool_bench_ep(const cli_options *o) {
  const int R = o->ep, n = o->repeat;
  ep_world w;
  void **ref = calloc((size_t)R * EP_COUNT, sizeof *ref);
  double *fwd = calloc(2 * (size_t)n, sizeof *fwd), *bwd = fwd ? fwd + n : NULL;
  int rc = 1;
  double t0;
  if (world_init(&w, o)) goto done;
  ep_rank *ranks = w.ranks;
  if (!ref || !fwd) {
    tool_error("no host memory for the timings");
    goto done;
  }
  t0 = tool_step("reference run and %d warm-up runs", o->warmup);
  if (all_ranks(ranks, R, rank_forward) < 0 || all_ranks(ranks, R, rank_backward) < 0) goto done;
  for (int r = 0; r < R; r++)
    for (int i = 0; i < EP_COUNT; i++)
      if (ranks[r].bytes[i]) {
        if (!(ref[r * EP_COUNT + i] = malloc(ranks[r].bytes[i]))) goto done;
        memcpy(ref[r * EP_COUNT + i], ranks[r].out[i], ranks[r].bytes[i]);
      }
  for (int w = 0; w < o->warmup; w++)
    if (all_ranks(ranks, R, rank_forward) < 0 || all_ranks(ranks, R, rank_backward) < 0)
      goto done;
  tool_done(t0);
  t0 = tool_step("%d timed runs", n);
  for (int i = 0; i < n; i++) {
    if ((fwd[i] = 1e3 * all_ranks(ranks, R, rank_forward)) < 0) goto done;
    if ((bwd[i] = 1e3 * all_ranks(ranks, R, rank_backward)) < 0) goto done;
  }
  tool_done(t0);
  const double flops = cli_forward_flops(&w.L.shape, w.L.tokens);
  printf("  %d timed runs on %d ranks (wall clock, first start to last end), global batch of "
         "%lld tokens\n", n, R, (long long)w.L.tokens);
  printf("  %-9s %12s %12s %12s %10s\n", "", "median ms", "min ms", "max ms", "TFLOP/s");
  print_times("forward", fwd, n, flops);
  print_times("backward", bwd, n, 2 * flops);
  int identical = 1;
  for (int r = 0; r < R; r++)
    for (int i = 0; i < EP_COUNT; i++)
      if (ranks[r].bytes[i] && memcmp(ref[r * EP_COUNT + i], ranks[r].out[i], ranks[r].bytes[i])) {
        printf("  repeated bits: %s of rank %d differs\n", ep_names[i], r);
        identical = 0;
      }
  if (identical) printf("  repeated bits: identical (every output of every rank, last timed run = "
                        "the reference run)\n");
  printf("bench --ep %d: %s\n", R, identical ? "PASS" : "FAIL");
  rc = !identical;
done:
  for (int i = 0; ref && i < R * EP_COUNT; i++) free(ref[i]);
  free(ref);
  free(fwd);
  world_fini(&w);
  return rc;
}

int tool_run_ep(const cli_options *o) {
  const int R = o->ep;
  ep_world w;
  ep_rank one;
  int rc = 1, failed = 0;
  memset(&one, 0, sizeof one);
  if (world_init(&w, o)) goto done;
  if (rank_init(&one, &w.L, o, 0, 1, NULL, w.T * R)) goto done;
  double t0 = tool_step("forward and backward on %d ranks, a thread each", R);
  const double t_ep = all_ranks(w.ranks, R, rank_main);
  if (t_ep < 0) goto done;
  tool_done(t0);
  t0 = tool_step("the same batch on one rank");
  rank_main(&one);
  const double t_one = tool_seconds() - t0;
  tool_done(t0);
  if (one.st != MOK_OK) {
    tool_mok_error("one rank", one.st);
    goto done;
  }

  printf("  %d ranks: forward+backward %.3f s; one rank: %.3f s\n", R, t_ep, t_one);
  printf("  %-16s %s\n", "output", "bits at ep = 1 and ep = R");
  for (int i = 0; i < EP_COUNT; i++) {
    if (!one.bytes[i]) continue;
    if (i >= EP_SG) {
      printf("  %-16s not compared (per-rank partial sums)\n", ep_names[i]);
      continue;
    }
    int same = 1;
    for (int r = 0; r < R; r++) { /* rank r's slice: tokens r T.. or experts r E/R.. */
      const ep_rank *u = &w.ranks[r];
      same = same &&
             memcmp(u->out[i], (char *)one.out[i] + (size_t)r * u->bytes[i], u->bytes[i]) == 0;
    }
    printf("  %-16s %s\n", ep_names[i], same ? "identical" : "DIFFER");
    failed += !same;
  }
  printf("\nrun --ep %d: %s\n", R, failed ? "FAIL" : "PASS");
  rc = failed != 0;
done:
  rank_fini(&one);
  world_fini(&w);
  return rc;
}
