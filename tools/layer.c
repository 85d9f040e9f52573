/*
 * layer.c: one layer call of the mok command on the cpu or cuda backend (see layer.h): buffers,
 * poisoning, timed forward and backward, copies back to the host, digests, and progress and
 * error lines. Output tensors are described once, in `out`, and everything else walks that list.
 */
#include "layer.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cudart.h"

/* ---- progress and errors -------------------------------------------------------------------- */

static int line_open; /* a progress line waits for its time */

double tool_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

double tool_step(const char *fmt, ...) {
  fflush(stdout); /* results so far come first in a combined log */
  va_list ap;
  fputs("[mok] ", stderr);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputs("... ", stderr);
  fflush(stderr);
  line_open = 1;
  return tool_seconds();
}

void tool_done(double started) {
  if (line_open) fprintf(stderr, "%.1f s\n", tool_seconds() - started);
  line_open = 0;
}

void tool_error(const char *fmt, ...) {
  va_list ap;
  if (line_open) fputs("failed\n", stderr);
  line_open = 0;
  fputs("mok: error: ", stderr);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
}

int tool_mok_error(const char *call, mok_status st) {
  tool_error("%.*s: %s: %s", (int)strcspn(call, "("), call, mok_status_name(st), mok_last_error());
  return -1;
}

#define TRY_MOK(call)                                          \
  do {                                                         \
    mok_status st_ = (call);                                   \
    if (st_ != MOK_OK) return tool_mok_error(#call, st_);      \
  } while (0)

#define TRY_CUDA(call)                                                                        \
  do {                                                                                        \
    cudaError_t e_ = (call);                                                                  \
    if (e_ != cudaSuccess) {                                                                  \
      tool_error("%.*s: %s: %s", (int)strcspn(#call, "("), #call, cudaGetErrorName(e_),       \
                 cudaGetErrorString(e_));                                                     \
      return -1;                                                                              \
    }                                                                                         \
  } while (0)

/* ---- buffers -------------------------------------------------------------------------------- */

static int on_cuda(const tool_layer *L) { return L->o->backend == MOK_BACKEND_CUDA; }

/* Backend memory, freed by tool_layer_destroy; 256-byte aligned on both backends. */
static int backend_alloc(tool_layer *L, size_t bytes, void **out) {
  void *p = NULL;
  *out = NULL;
  if (L->nallocs == (int)(sizeof L->allocs / sizeof L->allocs[0])) {
    tool_error("internal: too many buffers");
    return -1;
  }
  if (on_cuda(L)) {
    TRY_CUDA(cudaMalloc(&p, bytes ? bytes : 1));
  } else if (!(p = aligned_alloc(256, (bytes + 255) / 256 * 256 + 256))) {
    tool_error("no host memory for %zu bytes", bytes);
    return -1;
  }
  L->allocs[L->nallocs++] = p;
  *out = p;
  return 0;
}

/* The input's backend copy: the host buffer itself on cpu. */
static int upload(tool_layer *L, const void *host, size_t bytes, const void **out) {
  void *p;
  *out = host;
  if (!host || !on_cuda(L)) return 0;
  if (backend_alloc(L, bytes, &p)) return -1;
  TRY_CUDA(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
  *out = p;
  return 0;
}

static size_t tensor_bytes(const tool_tensor *t) { return (size_t)t->n * (size_t)t->elem; }

const char *const tool_output_names[OUT_COUNT] = {
    "y", "dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down"};

void tool_output_sizes(const cli_options *o, int64_t tokens, int64_t experts, int64_t n[OUT_COUNT],
                       int elem[OUT_COUNT]) {
  const mok_shape *s = &o->shape;
  const int64_t H = s->hidden, I = s->inter, Is = s->shared_inter, k = s->top_k;
  const int g = o->grad_mode == MOK_GRAD_ACCUMULATE_F32 ? 4 : 2;
  const int64_t v[OUT_COUNT] = {tokens * H, tokens * H, tokens * k, experts * I * H,
                                experts * I * H, experts * H * I, Is * H, Is * H, H * Is};
  for (int i = 0; i < OUT_COUNT; i++) {
    n[i] = v[i];
    elem[i] = i == OUT_Y || i == OUT_DX ? 2 : i == OUT_DTW ? 4 : g;
  }
}

/* The outputs' names, sizes and types. */
static void describe_outputs(tool_layer *L) {
  int64_t n[OUT_COUNT];
  int elem[OUT_COUNT];
  tool_output_sizes(L->o, L->o->shape.max_tokens, L->o->shape.experts, n, elem);
  for (int i = 0; i < OUT_COUNT; i++)
    L->out[i] = (tool_tensor){tool_output_names[i], n[i], elem[i], NULL, NULL};
}

int tool_layer_create(tool_layer *L, const cli_options *o) {
  memset(L, 0, sizeof *L);
  L->o = o;
  const mok_shape *s = &o->shape;
  const int64_t T = s->max_tokens;
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  cfg.backend = o->backend;
  cfg.device = o->device;
  cfg.threads = o->threads;
  cfg.sms = o->sms;
  cfg.cluster = o->cluster;
  mok_status st = mok_context_create(&cfg, &L->ctx);
  if (st != MOK_OK) {
    tool_mok_error("mok_context_create", st);
    if (o->backend == MOK_BACKEND_CUDA && mok_cuda_device_count() == 0)
      fprintf(stderr, "mok: no CUDA device is visible here; --backend cpu runs the CPU backend\n");
    return -1;
  }
  TRY_MOK(mok_workspace_create(L->ctx, s, &L->ws));
  if (on_cuda(L)) {
    cudaStream_t stream;
    TRY_CUDA(cudaSetDevice(o->device));
    TRY_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    L->stream = stream;
  }

  /* Input sizes in bytes: x and dy; topk_ids and topk_weights; each routed and shared weight. */
  const size_t xb = (size_t)T * (size_t)s->hidden * 2, rb = (size_t)T * (size_t)s->top_k * 4;
  const size_t wb = (size_t)s->experts * (size_t)s->inter * (size_t)s->hidden * 2;
  const size_t sb = (size_t)s->shared_inter * (size_t)s->hidden * 2;
  const size_t in_bytes = 2 * xb + 2 * rb + 3 * wb + 3 * sb;
  double t0 = tool_step("generating inputs (%.2f GB)", 1e-9 * (double)in_bytes);
  TRY_MOK(mok_host_layer_create(s, T, o->seed, &L->in));
  tool_done(t0);

  describe_outputs(L);
  size_t out_bytes = mok_saved_bytes(L->ws, T);
  for (int i = 0; i < OUT_COUNT; i++) out_bytes += tensor_bytes(&L->out[i]);
  t0 = tool_step("%s inputs", on_cuda(L) ? "copying to the GPU" : "preparing");
  const mok_host_layer *in = &L->in;
  const mok_weights hw = mok_host_layer_weights(in);
  mok_weights w = {0};
  const void *x, *dy, *ids, *wts;
  if (upload(L, in->x, xb, &x) || upload(L, in->dy, xb, &dy) ||
      upload(L, in->topk_ids, rb, &ids) || upload(L, in->topk_weights, rb, &wts) ||
      upload(L, hw.w_gate, wb, &w.w_gate) || upload(L, hw.w_up, wb, &w.w_up) ||
      upload(L, hw.w_down, wb, &w.w_down) || upload(L, hw.ws_gate, sb, &w.ws_gate) ||
      upload(L, hw.ws_up, sb, &w.ws_up) || upload(L, hw.ws_down, sb, &w.ws_down))
    return -1;
  tool_done(t0);
  if (s->precision == MOK_FP8) { /* forward and backward read the FP8 buffer alone */
    t0 = tool_step("quantizing the weights (mok_quantize_weights)");
    void *fp8;
    if (backend_alloc(L, mok_fp8_weights_bytes(L->ws), &fp8)) return -1;
    TRY_MOK(mok_quantize_weights(L->ws, &w, fp8, L->stream));
    if (on_cuda(L)) TRY_CUDA(cudaStreamSynchronize((cudaStream_t)L->stream));
    w = (mok_weights){.fp8 = fp8};
    tool_done(t0);
  }
  t0 = tool_step("allocating outputs (%.2f GB)", 1e-9 * (double)out_bytes);
  void *saved;
  if (backend_alloc(L, mok_saved_bytes(L->ws, T), &saved)) return -1;
  for (int i = 0; i < OUT_COUNT; i++) {
    tool_tensor *t = &L->out[i];
    if (t->n == 0) continue;
    if (backend_alloc(L, tensor_bytes(t), &t->dev)) return -1;
    t->host = t->dev;
    if (on_cuda(L) && !(t->host = malloc(tensor_bytes(t)))) {
      tool_error("no host memory for a copy of %s (%zu bytes)", t->name, tensor_bytes(t));
      return -1;
    }
  }
  tool_done(t0);

  mok_forward_args f = {.tokens = T, .x = x, .topk_ids = ids, .topk_weights = wts, .w = w,
                        .y = L->out[OUT_Y].dev, .saved = saved};
  mok_grads g = {L->out[OUT_DW_GATE].dev, L->out[OUT_DW_UP].dev, L->out[OUT_DW_DOWN].dev,
                 L->out[OUT_DWS_GATE].dev, L->out[OUT_DWS_UP].dev, L->out[OUT_DWS_DOWN].dev};
  mok_backward_args b = {.tokens = T, .x = x, .topk_ids = ids, .topk_weights = wts, .w = w,
                         .saved = saved, .dy = dy, .dx = L->out[OUT_DX].dev,
                         .d_topk_weights = L->out[OUT_DTW].dev, .g = g,
                         .grad_mode = o->grad_mode};
  L->fwd = f;
  L->bwd = b;
  return 0;
}

void tool_layer_destroy(tool_layer *L) {
  if (!L->o) return;
  for (int i = 0; i < OUT_COUNT; i++)
    if (L->out[i].host != L->out[i].dev) free(L->out[i].host);
  for (int i = 0; i < L->nallocs; i++) {
    if (on_cuda(L)) cudaFree(L->allocs[i]);
    else free(L->allocs[i]);
  }
  if (L->stream) cudaStreamDestroy((cudaStream_t)L->stream);
  mok_workspace_destroy(L->ws);
  mok_context_destroy(L->ctx);
  mok_host_layer_destroy(&L->in);
  memset(L, 0, sizeof *L);
}

/* ---- running -------------------------------------------------------------------------------- */

static int fill(tool_layer *L, tool_output i, int byte) {
  tool_tensor *t = &L->out[i];
  if (t->n == 0) return 0;
  if (on_cuda(L)) TRY_CUDA(cudaMemsetAsync(t->dev, byte, tensor_bytes(t), (cudaStream_t)L->stream));
  else memset(t->dev, byte, tensor_bytes(t));
  return 0;
}

/* With --grad-mode f32 the weight gradients are main-grad buffers that backward adds to. */
static int main_grads(const tool_layer *L) { return L->o->grad_mode == MOK_GRAD_ACCUMULATE_F32; }

static int zero_main_grads(tool_layer *L) {
  for (int i = OUT_DW_GATE; main_grads(L) && i < OUT_COUNT; i++)
    if (fill(L, (tool_output)i, 0)) return -1;
  return 0;
}

int tool_poison(tool_layer *L) {
  for (int i = 0; i < OUT_COUNT; i++)
    if (fill(L, (tool_output)i, main_grads(L) && i >= OUT_DW_GATE ? 0 : 0xff)) return -1;
  return 0;
}

/* A forward+backward pair; ev (4 events) or wall (4 clock readings) bracket the two calls. */
static int run_pair(tool_layer *L, cudaEvent_t *ev, double *wall) {
  cudaStream_t s = (cudaStream_t)L->stream;
  if (ev) TRY_CUDA(cudaEventRecord(ev[0], s));
  if (wall) wall[0] = tool_seconds();
  TRY_MOK(mok_forward(L->ws, &L->fwd, L->stream));
  if (ev) TRY_CUDA(cudaEventRecord(ev[1], s));
  if (wall) wall[1] = tool_seconds();
  if (zero_main_grads(L)) return -1;
  if (ev) TRY_CUDA(cudaEventRecord(ev[2], s));
  if (wall) wall[2] = tool_seconds();
  TRY_MOK(mok_backward(L->ws, &L->bwd, L->stream));
  if (ev) TRY_CUDA(cudaEventRecord(ev[3], s));
  if (wall) wall[3] = tool_seconds();
  return 0;
}

static int run_timed_cuda(tool_layer *L, int runs, double *fwd_ms, double *bwd_ms) {
  cudaEvent_t *ev = calloc((size_t)runs * 4, sizeof *ev);
  int made = 0, rc = -1;
  if (!ev) {
    tool_error("no host memory for %d CUDA events", runs * 4);
    return -1;
  }
  for (; made < runs * 4; made++)
    if (cudaEventCreate(&ev[made]) != cudaSuccess) {
      tool_error("cudaEventCreate failed after %d events", made);
      goto done;
    }
  for (int r = 0; r < runs; r++)
    if (run_pair(L, ev + 4 * r, NULL)) goto done;
  for (int r = 0; r < runs; r++) {
    float f, b;
    cudaError_t e = cudaEventSynchronize(ev[4 * r + 3]);
    if (e == cudaSuccess) e = cudaEventElapsedTime(&f, ev[4 * r], ev[4 * r + 1]);
    if (e == cudaSuccess) e = cudaEventElapsedTime(&b, ev[4 * r + 2], ev[4 * r + 3]);
    if (e != cudaSuccess) {
      tool_error("timing run %d: %s: %s", r, cudaGetErrorName(e), cudaGetErrorString(e));
      goto done;
    }
    fwd_ms[r] = f;
    bwd_ms[r] = b;
  }
  rc = 0;
done:
  for (int i = 0; i < made; i++) cudaEventDestroy(ev[i]);
  free(ev);
  return rc;
}

int tool_run(tool_layer *L, int runs, double *fwd_ms, double *bwd_ms) {
  if (fwd_ms && on_cuda(L)) {
    if (run_timed_cuda(L, runs, fwd_ms, bwd_ms)) return -1;
  } else {
    for (int r = 0; r < runs; r++) {
      double wall[4] = {0};
      if (run_pair(L, NULL, wall)) return -1;
      if (fwd_ms) fwd_ms[r] = 1e3 * (wall[1] - wall[0]);
      if (bwd_ms) bwd_ms[r] = 1e3 * (wall[3] - wall[2]);
    }
  }
  TRY_MOK(mok_check(L->ws, L->stream));
  return 0;
}

/* Kernel nodes of `g`. */
static int kernel_nodes(cudaGraph_t g, int *kernels) {
  size_t count = 0;
  TRY_CUDA(cudaGraphGetNodes(g, NULL, &count));
  cudaGraphNode_t *nodes = calloc(count ? count : 1, sizeof *nodes);
  if (!nodes) {
    tool_error("no host memory for %zu graph nodes", count);
    return -1;
  }
  cudaError_t e = cudaGraphGetNodes(g, nodes, &count);
  *kernels = 0;
  for (size_t i = 0; e == cudaSuccess && i < count; i++) {
    enum cudaGraphNodeType t;
    e = cudaGraphNodeGetType(nodes[i], &t);
    *kernels += e == cudaSuccess && t == cudaGraphNodeTypeKernel;
  }
  free(nodes);
  TRY_CUDA(e);
  return 0;
}

/* One call captured on the layer's stream, its kernel nodes counted, the graph dropped. */
static int captured_kernels(tool_layer *L, int backward, int *kernels) {
  cudaStream_t s = (cudaStream_t)L->stream;
  cudaGraph_t g = NULL;
  TRY_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  mok_status st = backward ? mok_backward(L->ws, &L->bwd, L->stream)
                           : mok_forward(L->ws, &L->fwd, L->stream);
  cudaError_t e = cudaStreamEndCapture(s, &g);
  int rc = st != MOK_OK ? tool_mok_error(backward ? "mok_backward" : "mok_forward", st) : 0;
  if (!rc && e != cudaSuccess) {
    tool_error("cudaStreamEndCapture: %s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
    rc = -1;
  }
  if (!rc) rc = kernel_nodes(g, kernels);
  if (g) cudaGraphDestroy(g);
  return rc;
}

int tool_count_kernels(tool_layer *L, int *fwd, int *bwd) {
  if (!on_cuda(L)) return 0;
  if (captured_kernels(L, 0, fwd) || captured_kernels(L, 1, bwd)) return -1;
  return 0;
}

int tool_download(tool_layer *L) {
  if (!on_cuda(L)) return 0;
  TRY_CUDA(cudaStreamSynchronize((cudaStream_t)L->stream));
  for (int i = 0; i < OUT_COUNT; i++) {
    tool_tensor *t = &L->out[i];
    if (t->n) TRY_CUDA(cudaMemcpy(t->host, t->dev, tensor_bytes(t), cudaMemcpyDeviceToHost));
  }
  return 0;
}

void tool_digests(const tool_layer *L, cli_digest d[OUT_COUNT]) {
  for (int i = 0; i < OUT_COUNT; i++) {
    const tool_tensor *t = &L->out[i];
    d[i] = cli_digest_of(t->host, t->n, t->elem);
  }
}
