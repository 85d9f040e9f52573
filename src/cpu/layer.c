/*
 * layer.c: the CPU backend's entry points, each the steps of DESIGN.md §2 in order. With an EP
 * group every rank runs them at once from its own thread; the group's barriers open a direction
 * (inputs published), check it (ids, capacity; in schedule.c) and close it (every push into this
 * rank's slots done). Every output is written after the closing barrier and every error is found
 * before it, so a failing call (a bad id or capacity anywhere, a failed forward, a rank that never
 * comes) leaves its outputs untouched.
 */
#include <string.h>

#include "cpu/cpu.h"

/* Publishes this rank's x (and dy) for the peers' dispatch; at MOK_FP8 also the operand the
 * products read, Q_row of each token's x (forward) or dy (backward), made once per token. */
static void publish(mok_workspace *ws, int64_t tokens, const void *x, const void *dy) {
  cpu_state *st = cpu_state_of(ws);
  const size_t n = (size_t)(tokens * ws->shape.hidden) * sizeof(uint16_t);
  memcpy(st->sym_x, x, n);
  if (dy) memcpy(st->sym_dy, dy, n);
  if (ws->shape.precision == MOK_FP8)
    cpu_q_rows_bf16(ws, st->sym_q, dy ? dy : x, tokens, ws->shape.hidden);
}

/* The closing barrier: every rank's pushes into this rank's slots are done, and no rank reads
 * this rank's published inputs any more. */
static mok_status close_direction(mok_workspace *ws) {
  int32_t bits = 0;
  return cpu_barrier(ws, &bits);
}

mok_status cpu_layer_schedule(mok_workspace *ws, const mok_forward_args *a, void *stream) {
  (void)stream;
  cpu_saved sv = cpu_saved_view(ws, a->saved, a->tokens);
  mok_status s = cpu_schedule_build(ws, a->topk_ids, a->topk_weights, a->tokens, &sv);
  if (s != MOK_OK) return s;
  return close_direction(ws);
}

mok_status cpu_layer_forward(mok_workspace *ws, const mok_forward_args *a, int compute_y,
                             void *stream) {
  (void)stream;
  const int64_t T = a->tokens;
  cpu_saved sv = cpu_saved_view(ws, a->saved, T);
  publish(ws, T, a->x, NULL);
  mok_status s = cpu_schedule_build(ws, a->topk_ids, a->topk_weights, T, &sv);
  if (s != MOK_OK) return s;
  cpu_dispatch(ws, &sv, 0);
  cpu_expert_forward(ws, &a->w, &sv, compute_y);
  cpu_shared_forward(ws, &a->w, &sv, a->x, T, compute_y);
  sv.status[MOK_STATUS_FILLED] = MOK_FILLED_ACTIVATIONS;
  s = close_direction(ws);
  if (s != MOK_OK) return s;
  if (compute_y) cpu_combine(ws, T, ws->shape.shared_inter > 0, a->y);
  return MOK_OK;
}

/* Backward reads the schedule the forward left; one that failed left a non-zero status word. */
static mok_status refuse_failed_forward(mok_workspace *ws, int32_t own, int32_t bits) {
  cpu_state_of(ws)->sticky |= bits;
  mok_status s = (bits & MOK_DEVERR_EXPERT_ID) ? MOK_ERR_EXPERT_ID
                 : (bits & MOK_DEVERR_CAPACITY) ? MOK_ERR_CAPACITY
                 : (bits & MOK_DEVERR_TIMEOUT) ? MOK_ERR_TIMEOUT
                                               : MOK_ERR_INTERNAL;
  return mok_fail(s,
                  "saved holds a forward that failed (status word 0x%x%s: %s); backward left its "
                  "outputs untouched",
                  (unsigned)bits, own ? "" : " on another rank of the EP group",
                  mok_status_string(s));
}

/* Saved was filled for this backward (mok_saved_check, then the routing and schedule sums), or
 * the error saying how it was not. Reads nothing past the header unless the header is this
 * workspace's for these tokens. */
static mok_status check_saved_filled(mok_workspace *ws, const cpu_saved *sv,
                                     const mok_backward_args *a) {
  const int32_t *h = sv->status;
  switch (mok_saved_check(h, mok_saved_ident(ws), a->tokens)) {
  case MOK_SAVED_FOREIGN:
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "saved was not filled by a call on this workspace (its header is another "
                    "layer shape's or EP rank's, or none: never filled, or overwritten); expected "
                    "the saved of a forward or recompute on this workspace; outputs untouched");
  case MOK_SAVED_OTHER_TOKENS:
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "backward has tokens = %lld but saved was filled by a call of %d tokens (or "
                    "not by mok_forward or mok_recompute); expected the tokens and the saved of "
                    "one forward; outputs untouched",
                    (long long)a->tokens, (int)h[MOK_STATUS_TOKENS]);
  case MOK_SAVED_SCHEDULE_ONLY:
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "saved holds no activations: only a schedule (mok_schedule), or a call that "
                    "did not finish (it failed on another rank, or the ranks made different "
                    "calls); expected saved filled by mok_forward or mok_recompute; outputs "
                    "untouched");
  default:
    break;
  }
  if (h[MOK_STATUS_BITS]) return MOK_OK; /* a failed forward: its bits stand for it */
  const int64_t slots = a->tokens * ws->shape.top_k;
  if ((uint32_t)h[MOK_STATUS_ROUTING] != mok_routing_sum(a->topk_ids, a->topk_weights, slots))
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "saved was filled with other topk_ids or topk_weights than this backward's "
                    "(the saved of another layer of this shape?); expected the forward's inputs "
                    "and its saved; outputs untouched");
  if ((uint32_t)h[MOK_STATUS_SCHEDULE] != mok_schedule_sum(ws, sv->base, a->tokens))
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "saved's schedule was overwritten since its forward filled it (its checksum "
                    "differs); expected saved as the forward left it; outputs untouched");
  return MOK_OK;
}

mok_status cpu_layer_backward(mok_workspace *ws, const mok_backward_args *a, void *stream) {
  (void)stream;
  const cpu_state *st = cpu_state_of(ws);
  const int64_t T = a->tokens;
  cpu_saved sv = cpu_saved_view(ws, a->saved, T);
  /* A mismatched saved is refused like a bad argument: every rank of the group fails the call.
   * Its message stands: the barrier records one only when it fails. */
  const mok_status arg = check_saved_filled(ws, &sv, a);
  publish(ws, T, a->x, a->dy);
  int32_t bits = arg != MOK_OK ? MOK_DEVERR_PEER_ARG : sv.status[MOK_STATUS_BITS];
  mok_status s = cpu_barrier(ws, &bits);
  if (s != MOK_OK) return s;
  if (arg != MOK_OK) return arg;
  if (bits & MOK_DEVERR_PEER_ARG)
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "another rank of the EP group had this backward refused for a bad argument "
                    "(its error says which); outputs untouched on every rank");
  if (bits) return refuse_failed_forward(ws, sv.status[MOK_STATUS_BITS], bits);
  cpu_dispatch(ws, &sv, 1);
  cpu_expert_backward(ws, &a->w, &sv);
  cpu_shared_backward(ws, &a->w, &sv, a->x, a->dy, T);
  s = close_direction(ws);
  if (s != MOK_OK) return s;
  cpu_weight_grads(ws, &sv, T, &a->g, a->grad_mode);
  cpu_combine(ws, T, ws->shape.shared_inter > 0, a->dx);
  memcpy(a->d_topk_weights, st->sym_dtw, (size_t)(T * ws->shape.top_k) * sizeof(float));
  return MOK_OK;
}
