/*
 * api.c: the public entry points. Every host-checkable mistake is caught here, before a backend
 * queues any work, with a message saying what was wrong and what was expected.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "fp8.h"
#include "internal.h"

/* Every tensor must be 16-byte aligned (TMA needs it; the CPU backend keeps the same rule). */
#define CHECK_ALIGNED(p, name)                                                             \
  do {                                                                                     \
    if (((uintptr_t)(p)) % 16 != 0)                                                        \
      return mok_fail(MOK_ERR_ALIGNMENT, "%s (%p) is not 16-byte aligned", name, (p));     \
  } while (0)

#define CHECK_TENSOR(p, name)                                      \
  do {                                                             \
    CHECK_ARG((p) != NULL, "%s is NULL; expected a tensor", name); \
    CHECK_ALIGNED(p, name);                                        \
  } while (0)

static const mok_backend_ops *backend_ops(mok_backend b) {
  switch (b) {
    case MOK_BACKEND_CPU: return &mok_cpu_ops;
    case MOK_BACKEND_CUDA: return &mok_cuda_ops;
  }
  return NULL;
}

mok_status mok_context_create(const mok_context_config *cfg, mok_context **out) {
  CHECK_ARG(out != NULL, "out is NULL; expected a place for the context");
  *out = NULL;
  CHECK_ARG(cfg != NULL, "cfg is NULL; start from MOK_CONTEXT_CONFIG_INIT");
  const mok_backend_ops *ops = backend_ops(cfg->backend);
  CHECK_ARG(ops != NULL, "backend %d is not MOK_BACKEND_CPU (0) or MOK_BACKEND_CUDA (1)",
            (int)cfg->backend);
  CHECK_ARG(cfg->ep_size >= 1, "ep_size is %d; expected >= 1", cfg->ep_size);
  CHECK_ARG(cfg->ep_rank >= 0 && cfg->ep_rank < cfg->ep_size,
            "ep_rank is %d; expected 0 <= ep_rank < ep_size (%d)", cfg->ep_rank, cfg->ep_size);
  CHECK_ARG(cfg->threads >= 0 && cfg->threads <= MOK_MAX_THREADS,
            "threads is %d; expected 0..%d (0 = all cores)", cfg->threads, MOK_MAX_THREADS);
  CHECK_ARG(cfg->sms >= 0, "sms is %d; expected >= 0 (0 = all multiprocessors)", cfg->sms);
  CHECK_ARG(cfg->cluster == 0 || cfg->cluster == 2 || cfg->cluster == 4,
            "cluster is %d; expected 2, 4 or 0 (2)", cfg->cluster);
  if (cfg->ep_size > 1 || cfg->group) {
    CHECK_ARG(cfg->group != NULL,
              "ep_size is %d but group is NULL; expected an EP group of ep_size ranks "
              "(mok_ep_group_create_emulated or _nccl)", cfg->ep_size);
    CHECK_ARG(mok_group_live(cfg->group),
              "group (%p) is not a live EP group (destroyed, or not made by mok)",
              (void *)cfg->group);
    CHECK_ARG(cfg->group->size == cfg->ep_size, "ep_size is %d but the group has %d ranks",
              cfg->ep_size, cfg->group->size);
  }
  const mok_ep_group *g = cfg->group;
  CHECK_ARG(!(g && !g->nccl && cfg->cluster == 4),
            "cluster is 4 with emulated EP ranks; expected 2 or 0 (the GEMMs of several ranks "
            "share one GPU, where clusters of 4 of every rank may not fit at once)");
  if (g && g->nccl) {
    if (cfg->backend != MOK_BACKEND_CUDA)
      return mok_fail(MOK_ERR_UNSUPPORTED, "an NCCL group needs the CUDA backend");
    CHECK_ARG(cfg->ep_rank == g->nccl_rank,
              "ep_rank is %d but this process is rank %d of the NCCL communicator", cfg->ep_rank,
              g->nccl_rank);
    CHECK_ARG(cfg->device == g->nccl_device,
              "device is %d but the NCCL communicator is on device %d", cfg->device,
              g->nccl_device);
  }
  mok_context *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return mok_fail(MOK_ERR_OUT_OF_MEMORY, "no host memory for a context");
  ctx->magic = MOK_MAGIC_CONTEXT;
  ctx->refs = 1;
  ctx->cfg = *cfg;
  ctx->ops = ops;
  mok_status st = ops->context_init(ctx);
  if (st != MOK_OK) {
    free(ctx);
    return st;
  }
  mok_group_retain(cfg->group);
  mok_clear_error();
  *out = ctx;
  return MOK_OK;
}

void mok_context_release(mok_context *ctx) {
  if (!ctx || __atomic_sub_fetch(&ctx->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
  ctx->magic = 0;
  mok_group_release(ctx->cfg.group);
  free(ctx);
}

int mok_context_live(const mok_context *ctx) {
  return ctx && ctx->magic == MOK_MAGIC_CONTEXT &&
         !__atomic_load_n(&ctx->released, __ATOMIC_ACQUIRE);
}

/* A handle the caller destroyed already is left alone (its workspaces may still hold it). */
void mok_context_destroy(mok_context *ctx) {
  if (!ctx) return;
  if (ctx->magic != MOK_MAGIC_CONTEXT ||
      __atomic_exchange_n(&ctx->released, 1, __ATOMIC_ACQ_REL)) {
    mok_fail(MOK_ERR_INVALID_ARG, "mok_context_destroy: %p is not a live context (destroyed "
                                  "already, or not made by mok_context_create); left alone",
             (void *)ctx);
    return;
  }
  mok_context_release(ctx);
}

static mok_status check_shape(const mok_context *ctx, const mok_shape *s) {
  const int64_t big = (int64_t)1 << 20;
  CHECK_ARG(s->max_tokens >= 1 && s->max_tokens <= MOK_MAX_TOKENS,
            "max_tokens is %lld; expected 1..%d (MOK_MAX_TOKENS)", (long long)s->max_tokens,
            MOK_MAX_TOKENS);
  CHECK_ARG(s->hidden >= 1 && s->hidden <= big, "hidden (H) is %lld; expected 1..%lld",
            (long long)s->hidden, (long long)big);
  CHECK_ARG(s->inter >= 1 && s->inter <= big, "inter (I) is %lld; expected 1..%lld",
            (long long)s->inter, (long long)big);
  CHECK_ARG(s->shared_inter >= 0 && s->shared_inter <= big,
            "shared_inter (I_s) is %lld; expected 0..%lld", (long long)s->shared_inter,
            (long long)big);
  CHECK_ARG(s->experts >= 1 && s->experts <= 4096, "experts (E) is %d; expected 1..4096",
            s->experts);
  CHECK_ARG(s->top_k >= 1 && s->top_k <= s->experts, "top_k is %d; expected 1..E (%d)", s->top_k,
            s->experts);
  CHECK_ARG(s->experts % ctx->cfg.ep_size == 0,
            "experts (%d) is not a multiple of ep_size (%d); expected E %% ep == 0 (each rank "
            "holds E / ep experts)", s->experts, ctx->cfg.ep_size);
  CHECK_ARG(s->max_tokens * s->top_k * ctx->cfg.ep_size <= ((int64_t)1 << 26),
            "max_tokens * top_k * ep_size is %lld; expected at most 2^26",
            (long long)(s->max_tokens * s->top_k * ctx->cfg.ep_size));
  CHECK_ARG(s->routed_rows >= 0 && s->routed_rows <= ((int64_t)1 << 31),
            "routed_rows is %lld; expected 0 (the worst case) .. 2^31",
            (long long)s->routed_rows);
  CHECK_ARG(s->precision == MOK_BF16 || s->precision == MOK_FP8,
            "precision is %d; expected MOK_BF16 (0) or MOK_FP8 (1)", (int)s->precision);
  return MOK_OK;
}

mok_status mok_workspace_create(mok_context *ctx, const mok_shape *shape, mok_workspace **out) {
  CHECK_ARG(out != NULL, "out is NULL; expected a place for the workspace");
  *out = NULL;
  CHECK_ARG(ctx != NULL, "ctx is NULL; create one with mok_context_create");
  CHECK_ARG(mok_context_live(ctx),
            "ctx (%p) is not a live context (destroyed, or not made by mok_context_create)",
            (void *)ctx);
  CHECK_ARG(shape != NULL, "shape is NULL; start from MOK_SHAPE_INIT");
  mok_status st = check_shape(ctx, shape);
  if (st != MOK_OK) return st;
  mok_workspace *ws = calloc(1, sizeof *ws);
  if (!ws) return mok_fail(MOK_ERR_OUT_OF_MEMORY, "no host memory for a workspace");
  ws->ctx = ctx;
  ws->shape = *shape;
  ws->experts_local = shape->experts / ctx->cfg.ep_size;
  ws->expert_base = ws->experts_local * ctx->cfg.ep_rank;
  st = ctx->ops->workspace_init(ws);
  if (st != MOK_OK) {
    free(ws);
    return st;
  }
  st = mok_group_join(ctx->cfg.group, ctx->cfg.ep_rank, ws);
  if (st == MOK_OK && ctx->cfg.group && ctx->ops->group_ready) {
    st = ctx->ops->group_ready(ws);
    if (st != MOK_OK) mok_group_leave(ctx->cfg.group, ctx->cfg.ep_rank, ws);
  }
  if (st != MOK_OK) {
    ctx->ops->workspace_fini(ws);
    free(ws);
    return st;
  }
  __atomic_add_fetch(&ctx->refs, 1, __ATOMIC_RELAXED); /* the workspace holds its context */
  ws->magic = MOK_MAGIC_WORKSPACE;
  mok_clear_error();
  *out = ws;
  return MOK_OK;
}

/* ws is a workspace that mok made and nobody destroyed (best effort: internal.h). */
static mok_status check_ws(const mok_workspace *ws) {
  CHECK_ARG(ws != NULL, "ws is NULL; create one with mok_workspace_create");
  CHECK_ARG(ws->magic == MOK_MAGIC_WORKSPACE,
            "ws (%p) is not a live workspace (destroyed, or not made by mok_workspace_create)",
            (const void *)ws);
  return MOK_OK;
}

/* A call takes the workspace for itself (its scratch, and its rank's buffers in the EP group),
 * or is refused while another thread's call has it. Every call that takes it gives it back with
 * ws_leave. */
static mok_status ws_enter(mok_workspace *ws, int call) {
  TRY(check_ws(ws));
  int idle = 0;
  if (!__atomic_compare_exchange_n(&ws->busy, &idle, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "%s: ws is in use by a call of another thread; a workspace takes one call "
                    "at a time (mok.h): give each thread its own, or order the calls",
                    mok_call_name(call));
  ws->call = call;
  return MOK_OK;
}

static mok_status ws_leave(mok_workspace *ws, mok_status st) {
  ws->call = MOK_CALL_NONE;
  __atomic_store_n(&ws->busy, 0, __ATOMIC_RELEASE);
  return mok_done(st);
}

void mok_workspace_destroy(mok_workspace *ws) {
  if (!ws) return;
  if (check_ws(ws) != MOK_OK) return; /* its message says why; nothing is freed twice */
  int idle = 0;
  if (!__atomic_compare_exchange_n(&ws->busy, &idle, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
    mok_fail(MOK_ERR_INVALID_ARG, "mok_workspace_destroy: ws is in use by a call of another "
                                  "thread; left alone");
    return;
  }
  ws->magic = 0;
  mok_context *ctx = ws->ctx;
  mok_group_leave(ctx->cfg.group, ctx->cfg.ep_rank, ws);
  ctx->ops->workspace_fini(ws);
  free(ws);
  mok_context_release(ctx);
}

size_t mok_workspace_bytes(const mok_workspace *ws) {
  if (check_ws(ws) != MOK_OK) return 0;
  mok_clear_error();
  return ws->bytes;
}

size_t mok_saved_bytes(const mok_workspace *ws, int64_t tokens) {
  if (check_ws(ws) != MOK_OK) return 0;
  if (tokens < 1 || tokens > ws->shape.max_tokens) {
    mok_fail(MOK_ERR_INVALID_ARG, "tokens is %lld; expected 1..max_tokens (%lld)",
             (long long)tokens, (long long)ws->shape.max_tokens);
    return 0;
  }
  mok_clear_error();
  return mok_saved_layout_of(ws, tokens).bytes;
}

static mok_status check_tokens(const mok_workspace *ws, int64_t tokens) {
  CHECK_ARG(tokens >= 1 && tokens <= ws->shape.max_tokens,
            "tokens is %lld; expected 1..max_tokens (%lld)", (long long)tokens,
            (long long)ws->shape.max_tokens);
  return MOK_OK;
}

static mok_status check_saved(const void *saved) {
  CHECK_ARG(saved != NULL, "saved is NULL; expected mok_saved_bytes(ws, tokens) bytes");
  if (((uintptr_t)saved) % MOK_ALIGN != 0)
    return mok_fail(MOK_ERR_ALIGNMENT, "saved (%p) is not %d-byte aligned", saved, MOK_ALIGN);
  return MOK_OK;
}

/* The shared-expert tensors must be given exactly when the workspace has a shared expert. */
static mok_status check_shared(const mok_workspace *ws, const void *p, const char *name) {
  if (ws->shape.shared_inter > 0) {
    CHECK_TENSOR(p, name);
  } else {
    CHECK_ARG(p == NULL, "%s is given but the workspace has no shared expert (I_s = 0)", name);
  }
  return MOK_OK;
}

static mok_status check_fp8_buffer(const void *fp8, const char *name) {
  CHECK_ARG(fp8 != NULL, "%s is NULL; expected mok_fp8_weights_bytes(ws) bytes filled by "
                         "mok_quantize_weights", name);
  if (((uintptr_t)fp8) % MOK_ALIGN != 0)
    return mok_fail(MOK_ERR_ALIGNMENT, "%s (%p) is not %d-byte aligned", name, fp8, MOK_ALIGN);
  return MOK_OK;
}

/* The bf16 weights: forward and backward of a MOK_BF16 layer, mok_quantize_weights. */
static mok_status check_bf16_weights(const mok_workspace *ws, const mok_weights *w) {
  CHECK_TENSOR(w->w_gate, "w.w_gate");
  CHECK_TENSOR(w->w_up, "w.w_up");
  CHECK_TENSOR(w->w_down, "w.w_down");
  TRY(check_shared(ws, w->ws_gate, "w.ws_gate"));
  TRY(check_shared(ws, w->ws_up, "w.ws_up"));
  TRY(check_shared(ws, w->ws_down, "w.ws_down"));
  return MOK_OK;
}

/* What forward and backward read: the bf16 weights, or at MOK_FP8 their FP8 buffer alone. */
static mok_status check_weights(const mok_workspace *ws, const mok_weights *w) {
  if (ws->shape.precision == MOK_FP8) return check_fp8_buffer(w->fp8, "w.fp8");
  CHECK_ARG(w->fp8 == NULL, "w.fp8 is given but the workspace is MOK_BF16; expected NULL");
  return check_bf16_weights(ws, w);
}

/* One tensor of a call: where, how many bytes, its name. */
typedef struct span {
  const void *p;
  int64_t bytes;
  const char *name;
} span;

/* No tensor may share a byte with saved: forward would write saved over its inputs, and outputs
 * written over saved would change what backward reads. (NULL tensors, absent ones, pass.) */
static mok_status check_apart(const mok_workspace *ws, int64_t tokens, const void *saved,
                              const span *t, int n) {
  const uintptr_t s0 = (uintptr_t)saved, s1 = s0 + mok_saved_layout_of(ws, tokens).bytes;
  for (int i = 0; i < n; i++) {
    const uintptr_t p0 = (uintptr_t)t[i].p, p1 = p0 + (uintptr_t)t[i].bytes;
    CHECK_ARG(!t[i].p || t[i].bytes <= 0 || p1 <= s0 || s1 <= p0,
              "%s [%p, +%lld bytes) overlaps saved [%p, +%zu bytes); expected them apart",
              t[i].name, t[i].p, (long long)t[i].bytes, saved, (size_t)(s1 - s0));
  }
  return MOK_OK;
}

/* The spans of the weights (or, with bytes = 4, of fp32 gradients): 6 entries at t. */
static void weight_spans(const mok_workspace *ws, const void *const p[6], int bytes,
                         const char *const names[6], span *t) {
  const mok_shape *s = &ws->shape;
  const int64_t routed = ws->experts_local * s->inter * s->hidden * bytes;
  const int64_t shared = s->shared_inter * s->hidden * bytes;
  for (int i = 0; i < 6; i++) t[i] = (span){p[i], i < 3 ? routed : shared, names[i]};
}

/* (The workspace was checked by ws_enter.) */
static mok_status check_args(const void *args, const char *type) {
  CHECK_ARG(args != NULL, "args is NULL; expected a %s", type);
  return MOK_OK;
}

/* The inputs forward and backward share: tokens, x, routing, weights. */
static mok_status check_inputs(const mok_workspace *ws, int64_t tokens, const void *x,
                               const int32_t *ids, const float *tw, const mok_weights *w) {
  TRY(check_tokens(ws, tokens));
  CHECK_TENSOR(x, "x");
  CHECK_TENSOR(ids, "topk_ids");
  CHECK_TENSOR(tw, "topk_weights");
  return check_weights(ws, w);
}

static mok_status check_forward(const mok_workspace *ws, const mok_forward_args *a, int need_y) {
  TRY(check_args(a, "mok_forward_args"));
  TRY(check_inputs(ws, a->tokens, a->x, a->topk_ids, a->topk_weights, &a->w));
  if (need_y) CHECK_TENSOR(a->y, "y");
  TRY(check_saved(a->saved));
  const int64_t T = a->tokens, H = ws->shape.hidden, k = ws->shape.top_k;
  static const char *const names[6] = {"w.w_gate", "w.w_up", "w.w_down", "w.ws_gate", "w.ws_up",
                                       "w.ws_down"};
  const void *const wp[6] = {a->w.w_gate, a->w.w_up, a->w.w_down,
                             a->w.ws_gate, a->w.ws_up, a->w.ws_down};
  span t[11] = {{a->x, T * H * 2, "x"}, {a->topk_ids, T * k * 4, "topk_ids"},
                {a->topk_weights, T * k * 4, "topk_weights"}, {a->y, T * H * 2, "y"},
                {a->w.fp8, (int64_t)mok_fp8_layout_of(ws).bytes, "w.fp8"}};
  weight_spans(ws, wp, 2, names, t + 5);
  return check_apart(ws, T, a->saved, t, 11);
}

/* A call refused here on one rank of an EP group would leave the others waiting at the call's
 * first barrier until the timeout: this rank goes to that barrier with MOK_DEVERR_PEER_ARG, so
 * every rank fails the call at once (and the group stays usable), then keeps its own message.
 * A call on a group that has timed out is refused before it publishes anything (a late peer may
 * still be reading this rank's buffers). */
static mok_status refuse_with_peers(mok_workspace *ws, mok_status st, void *stream) {
  mok_ep_group *g = ws ? ws->ctx->cfg.group : NULL;
  if (st == MOK_OK && g && mok_group_broken(g))
    return mok_fail(MOK_ERR_TIMEOUT, "an earlier call of this EP group timed out, which leaves "
                                     "the group failed; create a new one");
  mok_workspace *members[MOK_EP_MAX];
  /* (An NCCL group's workspaces are made together: each rank has one once this rank has.) */
  if (g && !g->nccl && ws->ctx->ops->device_barriers && !mok_group_members(g, members)) {
    /* Refused here: the others will time out. */
    int missing = 0;
    while (members[missing]) missing++;
    return mok_fail(MOK_ERR_INVALID_ARG, "rank %d of the EP group has no workspace; every rank "
                                         "needs one before any rank calls", missing);
  }
  if (st == MOK_OK || !g) return st;
  char msg[512];
  snprintf(msg, sizeof msg, "%s", mok_last_error());
  (void)ws->ctx->ops->refuse(ws, stream);
  return mok_fail(st, "%s", msg);
}

/* Emulated ranks of a backend with device barriers enqueue each call in rank order
 * (mok_group_turn_take says why): the turn is taken before the call's checks, since a refused
 * call still meets its peers at a device barrier, and given once the call is enqueued. */
static mok_ep_group *turns_of(const mok_workspace *ws) {
  mok_ep_group *g = ws ? ws->ctx->cfg.group : NULL;
  return g && !g->nccl && ws->ctx->ops->device_barriers ? g : NULL;
}

static void turn_take(const mok_workspace *ws) {
  mok_ep_group *g = turns_of(ws);
  if (g) mok_group_turn_take(g, ws->ctx->cfg.ep_rank);
}

static mok_status turn_give(const mok_workspace *ws, mok_status st) {
  mok_ep_group *g = turns_of(ws);
  if (g) mok_group_turn_give(g, ws->ctx->cfg.ep_rank);
  return st;
}

static mok_status check_schedule(const mok_workspace *ws, const mok_forward_args *a) {
  TRY(check_args(a, "mok_forward_args"));
  TRY(check_tokens(ws, a->tokens));
  CHECK_TENSOR(a->topk_ids, "topk_ids");
  CHECK_TENSOR(a->topk_weights, "topk_weights");
  TRY(check_saved(a->saved));
  const int64_t slots = a->tokens * ws->shape.top_k;
  const span t[2] = {{a->topk_ids, slots * 4, "topk_ids"},
                     {a->topk_weights, slots * 4, "topk_weights"}};
  return check_apart(ws, a->tokens, a->saved, t, 2);
}

mok_status mok_schedule(mok_workspace *ws, const mok_forward_args *a, void *stream) {
  TRY(ws_enter(ws, MOK_CALL_SCHEDULE));
  turn_take(ws);
  mok_status st = refuse_with_peers(ws, check_schedule(ws, a), stream);
  st = turn_give(ws, st == MOK_OK ? ws->ctx->ops->schedule(ws, a, stream) : st);
  return ws_leave(ws, st);
}

mok_status mok_forward(mok_workspace *ws, const mok_forward_args *a, void *stream) {
  TRY(ws_enter(ws, MOK_CALL_FORWARD));
  turn_take(ws);
  mok_status st = refuse_with_peers(ws, check_forward(ws, a, 1), stream);
  st = turn_give(ws, st == MOK_OK ? ws->ctx->ops->forward(ws, a, 1, stream) : st);
  return ws_leave(ws, st);
}

mok_status mok_recompute(mok_workspace *ws, const mok_forward_args *a, void *stream) {
  TRY(ws_enter(ws, MOK_CALL_RECOMPUTE));
  turn_take(ws);
  mok_status st = refuse_with_peers(ws, check_forward(ws, a, 0), stream);
  st = turn_give(ws, st == MOK_OK ? ws->ctx->ops->forward(ws, a, 0, stream) : st);
  return ws_leave(ws, st);
}

static mok_status check_backward(const mok_workspace *ws, const mok_backward_args *a) {
  TRY(check_args(a, "mok_backward_args"));
  TRY(check_inputs(ws, a->tokens, a->x, a->topk_ids, a->topk_weights, &a->w));
  TRY(check_saved(a->saved));
  CHECK_TENSOR(a->dy, "dy");
  CHECK_TENSOR(a->dx, "dx");
  CHECK_TENSOR(a->d_topk_weights, "d_topk_weights");
  CHECK_TENSOR(a->g.dw_gate, "g.dw_gate");
  CHECK_TENSOR(a->g.dw_up, "g.dw_up");
  CHECK_TENSOR(a->g.dw_down, "g.dw_down");
  TRY(check_shared(ws, a->g.dws_gate, "g.dws_gate"));
  TRY(check_shared(ws, a->g.dws_up, "g.dws_up"));
  TRY(check_shared(ws, a->g.dws_down, "g.dws_down"));
  CHECK_ARG(a->grad_mode == MOK_GRAD_WRITE_BF16 || a->grad_mode == MOK_GRAD_ACCUMULATE_F32,
            "grad_mode is %d; expected MOK_GRAD_WRITE_BF16 or MOK_GRAD_ACCUMULATE_F32",
            (int)a->grad_mode);
  const int64_t T = a->tokens, H = ws->shape.hidden, k = ws->shape.top_k;
  static const char *const wnames[6] = {"w.w_gate", "w.w_up", "w.w_down", "w.ws_gate", "w.ws_up",
                                        "w.ws_down"};
  static const char *const gnames[6] = {"g.dw_gate", "g.dw_up", "g.dw_down", "g.dws_gate",
                                        "g.dws_up", "g.dws_down"};
  const void *const wp[6] = {a->w.w_gate, a->w.w_up, a->w.w_down,
                             a->w.ws_gate, a->w.ws_up, a->w.ws_down};
  const void *const gp[6] = {a->g.dw_gate, a->g.dw_up, a->g.dw_down,
                             a->g.dws_gate, a->g.dws_up, a->g.dws_down};
  span t[19] = {{a->x, T * H * 2, "x"},   {a->topk_ids, T * k * 4, "topk_ids"},
                {a->topk_weights, T * k * 4, "topk_weights"}, {a->dy, T * H * 2, "dy"},
                {a->dx, T * H * 2, "dx"}, {a->d_topk_weights, T * k * 4, "d_topk_weights"},
                {a->w.fp8, (int64_t)mok_fp8_layout_of(ws).bytes, "w.fp8"}};
  weight_spans(ws, wp, 2, wnames, t + 7);
  weight_spans(ws, gp, a->grad_mode == MOK_GRAD_ACCUMULATE_F32 ? 4 : 2, gnames, t + 13);
  return check_apart(ws, T, a->saved, t, 19);
}

mok_status mok_backward(mok_workspace *ws, const mok_backward_args *a, void *stream) {
  TRY(ws_enter(ws, MOK_CALL_BACKWARD));
  turn_take(ws);
  mok_status st = refuse_with_peers(ws, check_backward(ws, a), stream);
  st = turn_give(ws, st == MOK_OK ? ws->ctx->ops->backward(ws, a, stream) : st);
  return ws_leave(ws, st);
}

/* The error of a call whose device-side error bits are `bits` (MOK_OK if none). */
static mok_status fail_for_bits(const mok_workspace *ws, int32_t bits) {
  if (bits & MOK_DEVERR_EXPERT_ID)
    return mok_fail(MOK_ERR_EXPERT_ID,
                    "a call saw an expert id outside 0..E-1 (E = %d) in topk_ids (padding "
                    "slots, id -1, are not supported: give them any expert id and weight 0); its "
                    "outputs were left untouched",
                    ws->shape.experts);
  if (bits & MOK_DEVERR_CAPACITY)
    return mok_fail(MOK_ERR_CAPACITY,
                    "a call routed more rows than the workspace holds; its outputs were left "
                    "untouched");
  if (bits & MOK_DEVERR_TIMEOUT)
    return mok_fail(MOK_ERR_TIMEOUT, "a rank of the EP group did not arrive within the group's "
                                     "timeout; the group is failed now, create a new one");
  if (bits & MOK_DEVERR_SAVED)
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "a backward was given a saved that no forward or recompute on this "
                    "workspace filled for its tokens, topk_ids and topk_weights, or one "
                    "overwritten since (on this rank or another of the EP group); expected the "
                    "inputs and the saved of one forward; its outputs were left untouched");
  if (bits & MOK_DEVERR_MXFP8)
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "a mok_mxfp8_to_bf16 call met a block with scale byte 0xff (NaN) or a value "
                    "of 2^128 or more (beyond bf16); its output was left untouched");
  if (bits & MOK_DEVERR_PEER_ARG)
    return mok_fail(MOK_ERR_INVALID_ARG, "a call was refused on another rank of the EP group for "
                                         "a bad argument; it was left undone on every rank");
  if (bits & MOK_DEVERR_PEER_CALL) {
    char names[128];
    mok_call_names(bits & MOK_CALL_MASK, names, sizeof names);
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "the ranks of the EP group made different calls at once (%s); every rank "
                    "must make the same calls in the same order; the call was left undone on "
                    "every rank", names[0] ? names : "kinds not recorded");
  }
  if (bits) return mok_fail(MOK_ERR_INTERNAL, "unknown device error bits 0x%x", (unsigned)bits);
  return MOK_OK;
}

mok_status mok_check(mok_workspace *ws, void *stream) {
  TRY(ws_enter(ws, MOK_CALL_CHECK));
  int32_t bits = 0;
  mok_status st = ws->ctx->ops->check(ws, stream, &bits);
  if (bits & MOK_DEVERR_TIMEOUT) mok_group_break(ws->ctx->cfg.group); /* barrier counts differ */
  return ws_leave(ws, st == MOK_OK ? fail_for_bits(ws, bits) : st);
}

/* Reads saved's header first: the counts are read only from a saved of this workspace and these
 * tokens, whose schedule did not fail. */
static mok_status schedule_counts(mok_workspace *ws, const void *saved, int64_t tokens,
                                  int32_t *counts, void *stream) {
  TRY(check_tokens(ws, tokens));
  TRY(check_saved(saved));
  CHECK_ARG(counts != NULL, "counts is NULL; expected int32[E_local]");
  mok_saved_layout L = mok_saved_layout_of(ws, tokens);
  int32_t h[MOK_STATUS_WORDS];
  TRY(ws->ctx->ops->copy_to_host(ws, h, (const char *)saved + L.status, sizeof h, stream));
  const int why = mok_saved_check(h, mok_saved_ident(ws), tokens);
  CHECK_ARG(why != MOK_SAVED_FOREIGN,
            "saved was not filled by a call on this workspace (its header is another layer "
            "shape's or EP rank's, or none); expected the saved of a call on this workspace; "
            "counts untouched");
  CHECK_ARG(why != MOK_SAVED_OTHER_TOKENS,
            "tokens is %lld but saved was filled by a call of %d tokens; counts untouched",
            (long long)tokens, (int)h[MOK_STATUS_TOKENS]);
  if (h[MOK_STATUS_BITS]) {
    const mok_status st = fail_for_bits(ws, h[MOK_STATUS_BITS]);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", mok_last_error());
    return mok_fail(st, "saved holds a call that failed, which left no schedule (%s); counts "
                        "untouched", msg);
  }
  CHECK_ARG(h[MOK_STATUS_FILLED] >= MOK_FILLED_SCHEDULE,
            "saved holds no schedule: the call that filled it did not finish (a barrier of the EP "
            "group failed); counts untouched");
  return ws->ctx->ops->copy_to_host(ws, counts, (const char *)saved + L.counts,
                                    (size_t)ws->experts_local * sizeof(int32_t), stream);
}

mok_status mok_schedule_counts(mok_workspace *ws, const void *saved, int64_t tokens,
                               int32_t *counts, void *stream) {
  TRY(ws_enter(ws, MOK_CALL_COUNTS));
  return ws_leave(ws, schedule_counts(ws, saved, tokens, counts, stream));
}

size_t mok_fp8_weights_bytes(const mok_workspace *ws) {
  if (check_ws(ws) != MOK_OK) return 0;
  mok_clear_error();
  return mok_fp8_layout_of(ws).bytes;
}

static mok_status check_fp8_call(const mok_workspace *ws, const void *w, const void *fp8) {
  TRY(check_ws(ws));
  CHECK_ARG(ws->shape.precision == MOK_FP8,
            "the workspace is MOK_BF16; FP8 weights belong to a MOK_FP8 workspace");
  CHECK_ARG(w != NULL, "the weights are NULL");
  return check_fp8_buffer(fp8, "fp8");
}

mok_status mok_quantize_weights(mok_workspace *ws, const mok_weights *w, void *fp8,
                                void *stream) {
  TRY(check_fp8_call(ws, w, fp8));
  TRY(check_bf16_weights(ws, w));
  return mok_done(ws->ctx->ops->fp8_weights(ws, w, NULL, fp8, stream));
}

static mok_status check_fp8_matrix(const mok_workspace *ws, const mok_fp8_matrix *m, int shared,
                                   const char *name) {
  if (shared && ws->shape.shared_inter == 0) {
    CHECK_ARG(m->q == NULL && m->s == NULL,
              "%s is given but the workspace has no shared expert (I_s = 0)", name);
    return MOK_OK;
  }
  CHECK_ARG(m->q != NULL, "%s.q is NULL; expected e4m3 codes [E, N, K]", name);
  CHECK_ARG(m->s != NULL, "%s.s is NULL; expected fp32 block scales", name);
  CHECK_ALIGNED(m->q, name);
  if (((uintptr_t)m->s) % 4 != 0)
    return mok_fail(MOK_ERR_ALIGNMENT, "%s.s (%p) is not 4-byte aligned", name, (void *)m->s);
  return MOK_OK;
}

mok_status mok_fp8_weights_import(mok_workspace *ws, const mok_fp8_given *w, void *fp8,
                                  void *stream) {
  TRY(check_fp8_call(ws, w, fp8));
  TRY(check_fp8_matrix(ws, &w->w_gate, 0, "w_gate"));
  TRY(check_fp8_matrix(ws, &w->w_up, 0, "w_up"));
  TRY(check_fp8_matrix(ws, &w->w_down, 0, "w_down"));
  TRY(check_fp8_matrix(ws, &w->ws_gate, 1, "ws_gate"));
  TRY(check_fp8_matrix(ws, &w->ws_up, 1, "ws_up"));
  TRY(check_fp8_matrix(ws, &w->ws_down, 1, "ws_down"));
  return mok_done(ws->ctx->ops->fp8_weights(ws, NULL, w, fp8, stream));
}

mok_status mok_mxfp8_to_bf16(mok_workspace *ws, int64_t rows, int64_t k, const void *q,
                             const void *scales, void *out, void *stream) {
  TRY(check_ws(ws));
  CHECK_ARG(k >= MOK_MX_BLOCK && k % MOK_MX_BLOCK == 0,
            "k is %lld; expected a positive multiple of %d (one E8M0 scale per %d values)",
            (long long)k, MOK_MX_BLOCK, MOK_MX_BLOCK);
  CHECK_ARG(rows >= 1 && rows <= ((int64_t)1 << 60) / k,
            "rows is %lld; expected 1..2^60 / k (k = %lld)", (long long)rows, (long long)k);
  CHECK_TENSOR(q, "q");
  CHECK_ARG(scales != NULL, "scales is NULL; expected E8M0 bytes [rows, k / 32]");
  CHECK_TENSOR(out, "out");
  const span in[2] = {{q, rows * k, "q"}, {scales, rows * (k / MOK_MX_BLOCK), "scales"}};
  const uintptr_t o0 = (uintptr_t)out, o1 = o0 + (uintptr_t)(rows * k * 2);
  for (int i = 0; i < 2; i++) {
    const uintptr_t p0 = (uintptr_t)in[i].p, p1 = p0 + (uintptr_t)in[i].bytes;
    CHECK_ARG(p1 <= o0 || o1 <= p0,
              "%s [%p, +%lld bytes) overlaps out [%p, +%lld bytes); expected them apart",
              in[i].name, in[i].p, (long long)in[i].bytes, out, (long long)(rows * k * 2));
  }
  return mok_done(ws->ctx->ops->mxfp8_to_bf16(ws, rows, k, q, scales, out, stream));
}
