/*
 * layer.c: the CPU backend's entry points, each the steps of DESIGN.md §2 in order. Every error
 * is found before the first output is written (bad ids by the schedule, a failed forward by the
 * status word of `saved`), so a failing call leaves its outputs untouched.
 */
#include "cpu/cpu.h"

mok_status cpu_layer_schedule(mok_workspace *ws, const mok_forward_args *a, void *stream) {
  (void)stream;
  cpu_saved sv = cpu_saved_view(ws, a->saved, a->tokens);
  return cpu_schedule_build(ws, a->topk_ids, a->topk_weights, a->tokens, &sv);
}

mok_status cpu_layer_forward(mok_workspace *ws, const mok_forward_args *a, int compute_y,
                             void *stream) {
  (void)stream;
  cpu_state *st = cpu_state_of(ws);
  const int64_t T = a->tokens, H = ws->shape.hidden;
  cpu_saved sv = cpu_saved_view(ws, a->saved, T);
  mok_status s = cpu_schedule_build(ws, a->topk_ids, a->topk_weights, T, &sv);
  if (s != MOK_OK) return s;
  cpu_bf16_to_f32(ws, st->xf, a->x, T * H);
  cpu_expert_forward(ws, &a->w, &sv, compute_y);
  cpu_shared_forward(ws, &a->w, &sv, T, compute_y);
  if (compute_y) cpu_combine(ws, T, ws->shape.shared_inter > 0, a->y);
  return MOK_OK;
}

/* Backward reads the schedule the forward left; one that failed left a non-zero status word. */
static mok_status refuse_failed_forward(mok_workspace *ws, int32_t bits) {
  cpu_state_of(ws)->sticky |= bits;
  mok_status s = (bits & MOK_DEVERR_EXPERT_ID) ? MOK_ERR_EXPERT_ID
                 : (bits & MOK_DEVERR_CAPACITY) ? MOK_ERR_CAPACITY
                 : (bits & MOK_DEVERR_TIMEOUT) ? MOK_ERR_TIMEOUT
                                               : MOK_ERR_INTERNAL;
  return mok_fail(s,
                  "saved holds a forward that failed (status word 0x%x: %s); backward left its "
                  "outputs untouched",
                  (unsigned)bits, mok_status_string(s));
}

mok_status cpu_layer_backward(mok_workspace *ws, const mok_backward_args *a, void *stream) {
  (void)stream;
  cpu_state *st = cpu_state_of(ws);
  const int64_t T = a->tokens, H = ws->shape.hidden;
  cpu_saved sv = cpu_saved_view(ws, a->saved, T);
  if (sv.status[0] != 0) return refuse_failed_forward(ws, sv.status[0]);
  cpu_bf16_to_f32(ws, st->xf, a->x, T * H);
  cpu_bf16_to_f32(ws, st->dyf, a->dy, T * H);
  cpu_expert_backward(ws, &a->w, &sv, a->d_topk_weights);
  cpu_shared_backward(ws, &a->w, &sv, T);
  cpu_combine(ws, T, ws->shape.shared_inter > 0, a->dx);
  cpu_weight_grads(ws, &sv, T, &a->g, a->grad_mode);
  return MOK_OK;
}
