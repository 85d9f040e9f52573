/*
 * router.c: the router's public entry points (DESIGN.md §1.2). Every host-checkable mistake is
 * caught here, before a backend queues any work, with a message saying what was wrong and what
 * was expected; the backends (src/cpu/router.c, src/cuda/router.cu) compute.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "internal.h"

/* The layer's rule: every tensor 16-byte aligned (api.c), saved on MOK_ALIGN. */
static mok_status check_tensor(const void *p, const char *name, size_t align) {
  CHECK_ARG(p != NULL, "%s is NULL; expected a tensor", name);
  if ((uintptr_t)p % align != 0)
    return mok_fail(MOK_ERR_ALIGNMENT, "%s (%p) is not %zu-byte aligned", name, p, align);
  return MOK_OK;
}

static const mok_router_ops *router_ops(mok_backend b) {
  return b == MOK_BACKEND_CUDA ? &mok_cuda_router_ops : &mok_cpu_router_ops;
}

static mok_status check_config(const mok_router_config *c) {
  const int64_t big = (int64_t)1 << 20;
  CHECK_ARG(c->max_tokens >= 1 && c->max_tokens <= MOK_MAX_TOKENS,
            "max_tokens is %lld; expected 1..%d (MOK_MAX_TOKENS)", (long long)c->max_tokens,
            MOK_MAX_TOKENS);
  CHECK_ARG(c->hidden >= 1 && c->hidden <= big, "hidden (H) is %lld; expected 1..%lld",
            (long long)c->hidden, (long long)big);
  CHECK_ARG(c->experts >= 1 && c->experts <= MOK_ROUTER_MAX_EXPERTS,
            "experts (E) is %d; expected 1..%d", c->experts, MOK_ROUTER_MAX_EXPERTS);
  CHECK_ARG(c->top_k >= 1 && c->top_k <= c->experts && c->top_k <= MOK_ROUTER_MAX_K,
            "top_k is %d; expected 1..min(E, %d) (E = %d)", c->top_k, MOK_ROUTER_MAX_K,
            c->experts);
  CHECK_ARG(c->max_tokens * c->experts <= ((int64_t)1 << 31),
            "max_tokens * experts is %lld; expected at most 2^31",
            (long long)(c->max_tokens * c->experts));
  CHECK_ARG(c->scoring == MOK_ROUTER_SOFTMAX || c->scoring == MOK_ROUTER_SIGMOID,
            "scoring is %d; expected MOK_ROUTER_SOFTMAX (0) or MOK_ROUTER_SIGMOID (1)",
            (int)c->scoring);
  CHECK_ARG(c->n_group >= 0 && c->n_group <= 64, "n_group is %d; expected 0..64 (0, 1: no groups)",
            c->n_group);
  if (c->n_group > 1) {
    CHECK_ARG(c->experts % c->n_group == 0, "experts (%d) is not a multiple of n_group (%d)",
              c->experts, c->n_group);
    CHECK_ARG(c->topk_group >= 1 && c->topk_group <= c->n_group,
              "topk_group is %d; expected 1..n_group (%d)", c->topk_group, c->n_group);
    CHECK_ARG(c->top_k <= (int64_t)c->topk_group * (c->experts / c->n_group),
              "top_k (%d) is more than the experts of topk_group (%d) groups of %d",
              c->top_k, c->topk_group, c->experts / c->n_group);
  } else {
    CHECK_ARG(c->topk_group == 0 || c->topk_group == 1,
              "topk_group is %d without groups (n_group %d); expected 0", c->topk_group,
              c->n_group);
  }
  CHECK_ARG(c->renormalize == 0 || c->renormalize == 1, "renormalize is %d; expected 0 or 1",
            c->renormalize);
  CHECK_ARG(isfinite(c->scale) && c->scale > 0.0f,
            "scale is %g; expected a finite value > 0 (MOK_ROUTER_CONFIG_INIT: 1)",
            (double)c->scale);
  return MOK_OK;
}

mok_status mok_router_create(mok_context *ctx, const mok_router_config *cfg, mok_router **out) {
  CHECK_ARG(out != NULL, "out is NULL; expected a place for the router");
  *out = NULL;
  CHECK_ARG(ctx != NULL, "ctx is NULL; create one with mok_context_create");
  CHECK_ARG(mok_context_live(ctx),
            "ctx (%p) is not a live context (destroyed, or not made by mok_context_create)",
            (void *)ctx);
  CHECK_ARG(cfg != NULL, "cfg is NULL; start from MOK_ROUTER_CONFIG_INIT");
  TRY(check_config(cfg));
  mok_router *r = calloc(1, sizeof *r);
  if (!r) return mok_fail(MOK_ERR_OUT_OF_MEMORY, "no host memory for a router");
  r->ctx = ctx;
  r->cfg = *cfg;
  mok_status st = router_ops(ctx->cfg.backend)->init(r);
  if (st != MOK_OK) {
    free(r);
    return st;
  }
  __atomic_add_fetch(&ctx->refs, 1, __ATOMIC_RELAXED); /* the router holds its context */
  mok_clear_error();
  *out = r;
  return MOK_OK;
}

void mok_router_destroy(mok_router *r) {
  if (!r) return;
  router_ops(r->ctx->cfg.backend)->fini(r);
  mok_context *ctx = r->ctx;
  free(r);
  mok_context_release(ctx); /* drops the router's hold */
}

static mok_status check_tokens(const mok_router *r, int64_t tokens) {
  CHECK_ARG(tokens >= 1 && tokens <= r->cfg.max_tokens,
            "tokens is %lld; expected 1..max_tokens (%lld)", (long long)tokens,
            (long long)r->cfg.max_tokens);
  return MOK_OK;
}

size_t mok_router_saved_bytes(const mok_router *r, int64_t tokens) {
  if (!r) {
    mok_fail(MOK_ERR_INVALID_ARG, "r is NULL; create one with mok_router_create");
    return 0;
  }
  if (check_tokens(r, tokens) != MOK_OK) return 0;
  return mok_router_layout_of(r, tokens).bytes;
}

static mok_status check_forward(const mok_router *r, const mok_router_forward_args *a) {
  CHECK_ARG(r != NULL, "r is NULL; create one with mok_router_create");
  CHECK_ARG(a != NULL, "args is NULL; expected a mok_router_forward_args");
  TRY(check_tokens(r, a->tokens));
  TRY(check_tensor(a->x, "x", 16));
  TRY(check_tensor(a->w_router, "w_router", 16));
  if (a->bias) TRY(check_tensor(a->bias, "bias", 16));
  TRY(check_tensor(a->topk_ids, "topk_ids", 16));
  TRY(check_tensor(a->topk_weights, "topk_weights", 16));
  TRY(check_tensor(a->counts, "counts", 16));
  if (a->aux_loss) TRY(check_tensor(a->aux_loss, "aux_loss", 4));
  if (a->z_loss) TRY(check_tensor(a->z_loss, "z_loss", 4));
  return check_tensor(a->saved, "saved", MOK_ALIGN);
}

mok_status mok_router_forward(mok_router *r, const mok_router_forward_args *a, void *stream) {
  TRY(check_forward(r, a));
  return router_ops(r->ctx->cfg.backend)->forward(r, a, stream);
}

static mok_status check_backward(const mok_router *r, const mok_router_backward_args *a) {
  CHECK_ARG(r != NULL, "r is NULL; create one with mok_router_create");
  CHECK_ARG(a != NULL, "args is NULL; expected a mok_router_backward_args");
  TRY(check_tokens(r, a->tokens));
  TRY(check_tensor(a->x, "x", 16));
  TRY(check_tensor(a->w_router, "w_router", 16));
  TRY(check_tensor(a->saved, "saved", MOK_ALIGN));
  TRY(check_tensor(a->d_topk_weights, "d_topk_weights", 16));
  if (a->d_aux_loss) TRY(check_tensor(a->d_aux_loss, "d_aux_loss", 4));
  if (a->d_z_loss) TRY(check_tensor(a->d_z_loss, "d_z_loss", 4));
  TRY(check_tensor(a->dx, "dx", 16));
  TRY(check_tensor(a->dw_router, "dw_router", 16));
  CHECK_ARG(a->accumulate_dx == 0 || a->accumulate_dx == 1, "accumulate_dx is %d; expected 0 or 1",
            a->accumulate_dx);
  CHECK_ARG(a->grad_mode == MOK_GRAD_WRITE_BF16 || a->grad_mode == MOK_GRAD_ACCUMULATE_F32,
            "grad_mode is %d; expected MOK_GRAD_WRITE_BF16 or MOK_GRAD_ACCUMULATE_F32",
            (int)a->grad_mode);
  return MOK_OK;
}

mok_status mok_router_backward(mok_router *r, const mok_router_backward_args *a, void *stream) {
  TRY(check_backward(r, a));
  return router_ops(r->ctx->cfg.backend)->backward(r, a, stream);
}
