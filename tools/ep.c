/*
 * ep.c: the mok command on R emulated ranks of an EP group, each with the shape's T tokens (a
 * global batch of R*T) and a thread of its own; on the cuda backend each rank also has its own
 * stream, and all share one GPU.
 *   mok run --ep R:   then the same batch on one rank; prints both times and whether every output
 *                     has the same bits on both (DESIGN §3, D4): y, dx and d_topk_weights of every
 *                     token, and the routed weight gradients of every expert. The shared expert's
 *                     gradients are per-rank partial sums (DESIGN §2.3) and are not compared.
 *   mok bench --ep R: the measurements of `mok bench` (mok.c reports them) for the R ranks.
 * Outputs start as NaN (all bits set), so one that no run wrote shows as nonfinite, not as equal.
 */
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cudart.h"
#include "layer.h"
#include "mok_gen.h"

/* One rank (or the single-rank run): its context, workspace, arguments and output buffers. */
typedef struct ep_rank {
  mok_context *ctx;
  mok_workspace *ws;
  mok_forward_args f;
  mok_backward_args b;
  void *out[OUT_COUNT];
  int64_t n[OUT_COUNT];
  int elem[OUT_COUNT];
  mok_status st;
  char err[512];  /* mok_last_error() of the rank's thread when st is not MOK_OK */
  /* cuda: the rank's stream, device copies of its inputs and outputs (out[] holds what
   * rank_download fetched); dev_in[] is what rank_fini frees. */
  int cuda;
  cudaStream_t stream;
  void *dev_out[OUT_COUNT];
  void *dev_in[24];          /* inputs (10), outputs (9), saved, the FP8 weights */
  int n_in;
  void *fp8_host;            /* cpu at fp8: the rank's FP8 weight buffer */
} ep_rank;

static size_t out_bytes(const ep_rank *u, int i) { return (size_t)u->n[i] * (size_t)u->elem[i]; }

/* A device copy of `bytes` at host (NULL: uninitialised), kept for rank_fini; NULL on failure. */
static void *rank_upload(ep_rank *u, const void *host, size_t bytes) {
  void *p = NULL;
  if (u->n_in == (int)(sizeof u->dev_in / sizeof u->dev_in[0])) {
    tool_error("too many device buffers for a rank");
    return NULL;
  }
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 16);
  if (e == cudaSuccess && host) e = cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice);
  if (e != cudaSuccess) {
    tool_error("device copy of %zu bytes: %s", bytes, cudaGetErrorString(e));
    cudaFree(p);
    return NULL;
  }
  u->dev_in[u->n_in++] = p;
  return p;
}

/* cuda: the arguments point at device copies of the rank's inputs and at device outputs. */
static int rank_to_device(ep_rank *u, const mok_host_layer *L, int64_t T, int64_t El) {
  const int64_t H = L->shape.hidden, I = L->shape.inter, Is = L->shape.shared_inter;
  const int64_t k = L->shape.top_k;
  if (cudaStreamCreateWithFlags(&u->stream, cudaStreamNonBlocking) != cudaSuccess) {
    tool_error("no CUDA stream");
    return -1;
  }
  mok_forward_args *f = &u->f;
  mok_backward_args *b = &u->b;
  const void *in[10] = {f->x, b->dy, f->topk_ids, f->topk_weights, f->w.w_gate, f->w.w_up,
                        f->w.w_down, f->w.ws_gate, f->w.ws_up, f->w.ws_down};
  const int64_t bytes[10] = {T * H * 2, T * H * 2, T * k * 4, T * k * 4, El * I * H * 2,
                             El * I * H * 2, El * H * I * 2, Is * H * 2, Is * H * 2, H * Is * 2};
  void *d[10] = {0};
  for (int i = 0; i < 10; i++)
    if (in[i] && !(d[i] = rank_upload(u, in[i], (size_t)bytes[i]))) return -1;
  for (int i = 0; i < OUT_COUNT; i++)
    if (u->n[i] && !(u->dev_out[i] = rank_upload(u, NULL, out_bytes(u, i)))) return -1;
  void *saved = rank_upload(u, NULL, mok_saved_bytes(u->ws, T));
  if (!saved) return -1;
  const mok_weights w = {d[4], d[5], d[6], d[7], d[8], d[9], NULL};
  const mok_grads g = {u->dev_out[OUT_DW_GATE],  u->dev_out[OUT_DW_UP],
                       u->dev_out[OUT_DW_DOWN],  u->dev_out[OUT_DWS_GATE],
                       u->dev_out[OUT_DWS_UP],   u->dev_out[OUT_DWS_DOWN]};
  free(f->saved);
  *f = (mok_forward_args){T, d[0], d[2], d[3], w, u->dev_out[OUT_Y], saved};
  *b = (mok_backward_args){T, d[0], d[2], d[3], w, saved, d[1], u->dev_out[OUT_DX],
                           u->dev_out[OUT_DTW], g, b->grad_mode};
  return 0;
}

/* cuda: the outputs into out[]. */
static int rank_download(ep_rank *u) {
  for (int i = 0; u->cuda && i < OUT_COUNT; i++) {
    if (!u->n[i]) continue;
    cudaError_t e = cudaMemcpy(u->out[i], u->dev_out[i], out_bytes(u, i), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
      tool_error("fetching %s: %s", tool_output_names[i], cudaGetErrorString(e));
      return -1;
    }
  }
  return 0;
}

/* Rank r of R (R = 1: all experts) with its share of the threads (all cores split between the
 * ranks by default): its context, workspace of T tokens and output buffers. Made before the
 * inputs, so that a bad shape fails at once rather than after generating the global batch. */
static int rank_open(ep_rank *u, const cli_options *o, int r, int R, mok_ep_group *g,
                     int64_t T) {
  memset(u, 0, sizeof *u);
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  cfg.ep_rank = r, cfg.ep_size = R, cfg.group = R > 1 ? g : NULL;
  cfg.threads = ((o->threads > 0 ? o->threads : omp_get_max_threads()) + R - 1) / R;
  cfg.backend = o->backend, cfg.device = o->device;
  cfg.sms = o->sms, cfg.cluster = o->cluster;
  u->cuda = o->backend == MOK_BACKEND_CUDA;
  mok_status st = mok_context_create(&cfg, &u->ctx);
  if (st != MOK_OK) return tool_mok_error("mok_context_create", st);
  mok_shape shape = o->shape;
  shape.max_tokens = T;
  st = mok_workspace_create(u->ctx, &shape, &u->ws);
  if (st != MOK_OK) return tool_mok_error("mok_workspace_create", st);
  tool_output_sizes(o, T, shape.experts / R, u->n, u->elem);
  for (int i = 0; i < OUT_COUNT; i++) {
    if (!u->n[i]) continue;
    if (!(u->out[i] = aligned_alloc(256, (out_bytes(u, i) + 255) / 256 * 256))) {
      tool_error("no host memory for %zu bytes of %s", out_bytes(u, i), tool_output_names[i]);
      return -1;
    }
  }
  return 0;
}

/* fp8: the rank quantizes its experts' bf16 weights into its FP8 buffer, which forward and
 * backward then read alone. */
static int rank_quantize(ep_rank *u) {
  const size_t bytes = mok_fp8_weights_bytes(u->ws);
  void *fp8 = u->cuda ? rank_upload(u, NULL, bytes)
                      : (u->fp8_host = aligned_alloc(256, (bytes + 255) / 256 * 256));
  if (!fp8) {
    if (!u->cuda) tool_error("no host memory for %zu bytes of FP8 weights", bytes);
    return -1;
  }
  mok_status st = mok_quantize_weights(u->ws, &u->f.w, fp8, u->stream);
  if (st == MOK_OK && u->cuda) st = mok_check(u->ws, u->stream);
  if (st != MOK_OK) return tool_mok_error("mok_quantize_weights", st);
  u->f.w = u->b.w = (mok_weights){.fp8 = fp8};
  return 0;
}

/* The opened rank r of R over tokens [r T, (r+1) T) and experts [r E/R, (r+1) E/R) of L: its
 * saved buffer and arguments (on cuda, device copies of its inputs). */
static int rank_bind(ep_rank *u, const mok_host_layer *L, const cli_options *o, int r, int R,
                     int64_t T) {
  const mok_shape *gs = &L->shape;
  const int64_t H = gs->hidden, I = gs->inter, k = gs->top_k, El = gs->experts / R;
  const size_t saved_bytes = mok_saved_bytes(u->ws, T);
  void *saved = aligned_alloc(256, (saved_bytes + 255) / 256 * 256);
  if (!saved) {
    tool_error("no host memory for saved");
    return -1;
  }
  mok_weights w = mok_host_layer_weights(L);
  w.w_gate = L->w_gate + r * El * I * H;
  w.w_up = L->w_up + r * El * I * H;
  w.w_down = L->w_down + r * El * H * I;
  u->f = (mok_forward_args){T, L->x + r * T * H, L->topk_ids + r * T * k,
                            L->topk_weights + r * T * k, w, u->out[OUT_Y], saved};
  mok_grads gr = {u->out[OUT_DW_GATE],  u->out[OUT_DW_UP],  u->out[OUT_DW_DOWN],
                  u->out[OUT_DWS_GATE], u->out[OUT_DWS_UP], u->out[OUT_DWS_DOWN]};
  u->b = (mok_backward_args){T, u->f.x, u->f.topk_ids, u->f.topk_weights, w, saved,
                             L->dy + r * T * H, u->out[OUT_DX], u->out[OUT_DTW], gr, o->grad_mode};
  if (u->cuda && rank_to_device(u, L, T, El)) return -1;
  return gs->precision == MOK_FP8 ? rank_quantize(u) : 0;
}

/* Every output to NaN (all bits set), so a value a run forgot to write shows. */
static void rank_poison(ep_rank *u) {
  for (int i = 0; i < OUT_COUNT; i++) {
    if (u->out[i]) memset(u->out[i], 0xff, out_bytes(u, i));
    if (u->dev_out[i]) cudaMemset(u->dev_out[i], 0xff, out_bytes(u, i));
  }
}

static void rank_fini(ep_rank *u) {
  if (!u->cuda) free(u->f.saved);
  free(u->fp8_host);
  for (int i = 0; i < u->n_in; i++) cudaFree(u->dev_in[i]);
  if (u->stream) cudaStreamDestroy(u->stream);
  for (int i = 0; i < OUT_COUNT; i++) free(u->out[i]);
  mok_workspace_destroy(u->ws);
  mok_context_destroy(u->ctx);
}

static void rank_status(ep_rank *u, mok_status st) {
  u->st = st;
  if (st != MOK_OK) snprintf(u->err, sizeof u->err, "%s", mok_last_error());
}

/* cuda: waits for the rank's stream and reports its device errors (mok_check). */
static mok_status rank_wait(ep_rank *u, mok_status st) {
  return st == MOK_OK && u->cuda ? mok_check(u->ws, u->stream) : st;
}

static void *rank_forward(void *p) {
  ep_rank *u = p;
  rank_status(u, rank_wait(u, mok_forward(u->ws, &u->f, u->stream)));
  return NULL;
}

static void *rank_backward(void *p) {
  ep_rank *u = p;
  for (int i = OUT_DW_GATE; i < OUT_COUNT; i++) { /* f32 main grads start from zero every time */
    if (u->b.grad_mode != MOK_GRAD_ACCUMULATE_F32 || !u->out[i]) continue;
    if (u->cuda) cudaMemsetAsync(u->dev_out[i], 0, out_bytes(u, i), u->stream);
    else memset(u->out[i], 0, out_bytes(u, i));
  }
  rank_status(u, rank_wait(u, mok_backward(u->ws, &u->b, u->stream)));
  return NULL;
}

/* Every rank runs fn on its own thread; returns the wall milliseconds, or -1 if a rank failed. */
static double all_ranks(ep_rank *ranks, int R, void *(*fn)(void *)) {
  pthread_t th[MOK_EP_MAX];
  const double t0 = tool_seconds();
  for (int r = 0; r < R; r++) pthread_create(&th[r], NULL, fn, &ranks[r]);
  for (int r = 0; r < R; r++) pthread_join(th[r], NULL);
  const double ms = 1e3 * (tool_seconds() - t0);
  for (int r = 0; r < R; r++)
    if (ranks[r].st != MOK_OK) {
      tool_error("rank %d: %s: %s", r, mok_status_name(ranks[r].st), ranks[r].err);
      return -1;
    }
  return ms;
}

/* One forward and one backward of every rank; the milliseconds of each, or -1. */
static int step(ep_rank *ranks, int R, double *fwd_ms, double *bwd_ms) {
  const double f = all_ranks(ranks, R, rank_forward);
  const double b = f < 0 ? -1 : all_ranks(ranks, R, rank_backward);
  if (fwd_ms) *fwd_ms = f;
  if (bwd_ms) *bwd_ms = b;
  for (int r = 0; r < R && b >= 0; r++)
    if (rank_download(&ranks[r])) return -1;
  return f < 0 || b < 0 ? -1 : 0;
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
  mok_status st = mok_ep_group_create_emulated(w->R, 0, &w->g);
  if (st != MOK_OK) return tool_mok_error("mok_ep_group_create_emulated", st);
  if (!(w->ranks = calloc((size_t)w->R, sizeof *w->ranks))) {
    tool_error("no host memory for %d ranks", w->R);
    return -1;
  }
  for (int r = 0; r < w->R; r++)
    if (rank_open(&w->ranks[r], o, r, w->R, w->g, w->T)) return -1;
  mok_shape gs = o->shape;
  gs.max_tokens = w->T * w->R;
  double t0 = tool_step("inputs of the global batch (%d ranks x %lld tokens)", w->R,
                        (long long)w->T);
  st = mok_host_layer_create(&gs, w->T * w->R, o->seed, &w->L);
  if (st != MOK_OK) return tool_mok_error("mok_host_layer_create", st);
  tool_done(t0);
  for (int r = 0; r < w->R; r++) {
    if (rank_bind(&w->ranks[r], &w->L, o, r, w->R, w->T)) return -1;
    rank_poison(&w->ranks[r]);
  }
  return 0;
}

/* Digest of output i over every rank, in rank order. */
static cli_digest digest_all(const ep_world *w, int i) {
  cli_digest d = {0, 0.0, 0};
  for (int r = 0; r < w->R; r++) {
    const ep_rank *u = &w->ranks[r];
    if (!u->n[i]) continue;
    const cli_digest x = cli_digest_of(u->out[i], u->n[i], u->elem[i]);
    d.hash = (d.hash ^ x.hash) * 0x100000001b3ull; /* FNV-1a step over the ranks' hashes */
    d.abs_sum += x.abs_sum;
    d.nonfinite += x.nonfinite;
  }
  return d;
}

int tool_bench_ep(const cli_options *o, double *fwd_ms, double *bwd_ms, cli_digest ref[OUT_COUNT],
                  cli_digest last[OUT_COUNT], int64_t n[OUT_COUNT]) {
  ep_world w;
  int rc = -1;
  if (world_init(&w, o)) goto done;
  double t0 = tool_step("reference run and %d warm-up runs", o->warmup);
  if (step(w.ranks, w.R, NULL, NULL)) goto done;
  for (int i = 0; i < OUT_COUNT; i++) ref[i] = digest_all(&w, i);
  for (int i = 0; i < o->warmup; i++)
    if (step(w.ranks, w.R, NULL, NULL)) goto done;
  tool_done(t0);
  t0 = tool_step("%d timed runs", o->repeat);
  for (int r = 0; r < w.R; r++) rank_poison(&w.ranks[r]);
  for (int i = 0; i < o->repeat; i++)
    if (step(w.ranks, w.R, &fwd_ms[i], &bwd_ms[i])) goto done;
  tool_done(t0);
  for (int i = 0; i < OUT_COUNT; i++) {
    last[i] = digest_all(&w, i);
    n[i] = w.ranks[0].n[i] * w.R;
  }
  rc = 0;
done:
  world_fini(&w);
  return rc;
}

int tool_run_ep(const cli_options *o) {
  const int R = o->ep;
  ep_world w;
  ep_rank one;
  int rc = 1, failed = 0;
  double f_ep, b_ep, f_one, b_one;
  memset(&w, 0, sizeof w);
  /* The one rank of all R*T tokens, opened first as well. */
  if (rank_open(&one, o, 0, 1, NULL, o->shape.max_tokens * R)) {
    tool_error("run --ep %d compares with one rank running all %d x %lld tokens; fewer --tokens "
               "may fit", R, R, (long long)o->shape.max_tokens);
    goto done;
  }
  if (world_init(&w, o)) goto done;
  if (rank_bind(&one, &w.L, o, 0, 1, w.T * R)) goto done;
  rank_poison(&one);
  double t0 = tool_step("forward and backward on %d ranks, a thread each", R);
  if (step(w.ranks, R, &f_ep, &b_ep)) goto done;
  tool_done(t0);
  t0 = tool_step("the same batch on one rank");
  if (step(&one, 1, &f_one, &b_one)) goto done;
  tool_done(t0);

  printf("  forward+backward: %d ranks %.3f ms, one rank %.3f ms\n", R, f_ep + b_ep,
         f_one + b_one);
  printf("  %-16s %s\n", "output", "bits at ep = 1 and ep = R");
  for (int i = 0; i < OUT_COUNT; i++) {
    if (!one.n[i]) continue;
    if (i >= OUT_DWS_GATE) {
      printf("  %-16s not compared (per-rank partial sums)\n", tool_output_names[i]);
      continue;
    }
    int same = cli_digest_of(one.out[i], one.n[i], one.elem[i]).nonfinite == 0;
    for (int r = 0; r < R; r++) { /* rank r's slice: tokens r T.. or experts r E/R.. */
      const ep_rank *u = &w.ranks[r];
      same = same && memcmp(u->out[i], (char *)one.out[i] + (size_t)r * out_bytes(u, i),
                            out_bytes(u, i)) == 0;
    }
    printf("  %-16s %s\n", tool_output_names[i], same ? "identical" : "DIFFER (or NaN)");
    failed += !same;
  }
  printf("\nrun --ep %d: %s\n", R, failed ? "FAIL" : "PASS");
  rc = failed != 0;
done:
  rank_fini(&one);
  world_fini(&w);
  return rc;
}
