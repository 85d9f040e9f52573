/*
 * shared.c: the shared expert, forward and backward dgrad, one token per row with w = 1 (same row
 * code as the routed experts, mlp.c). Its outputs stay fp32 (ys forward, dxs backward, in
 * cpu_state.side) until the combine adds the routed slots to them.
 *
 * At MOK_FP8 its products read the tokens' Q_row (sym_q: x forward, dy backward, the very rows
 * the routed experts get), and the backward keeps x and dy as bf16 values in xf and dyf for the
 * weight gradients' Q_col.
 */
#include "bf16.h"
#include "cpu/cpu.h"

void cpu_shared_forward(mok_workspace *ws, const mok_weights *w, const cpu_saved *sv,
                        const uint16_t *x, int64_t tokens, int compute_y) {
  const cpu_state *st = cpu_state_of(ws);
  const int64_t H = ws->shape.hidden, Is = ws->shape.shared_inter;
  if (Is == 0) return;
  const int fp8 = ws->shape.precision == MOK_FP8;
  if (!fp8) cpu_bf16_to_f32(ws, st->xf, x, tokens * H);
  const float *in = fp8 ? st->sym_q : st->xf;
  #pragma omp parallel num_threads(st->threads)
  {
    cpu_load_panels(ws, w, -1);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; t++)
      cpu_mlp_forward_row(in + t * H, st->panel_gu, st->panel_down, H, Is, 1.0f, fp8,
                          sv->gus + t * 2 * Is, sv->hs + t * Is, st->hsf + t * Is,
                          compute_y ? st->side + t * H : NULL);
  }
}

void cpu_shared_backward(mok_workspace *ws, const mok_weights *w, const cpu_saved *sv,
                         const uint16_t *x, const uint16_t *dy, int64_t tokens) {
  const cpu_state *st = cpu_state_of(ws);
  const int64_t H = ws->shape.hidden, Is = ws->shape.shared_inter;
  if (Is == 0) return;
  const int fp8 = ws->shape.precision == MOK_FP8;
  cpu_bf16_to_f32(ws, st->xf, x, tokens * H); /* kept for its weight gradients (wgrad.c) */
  cpu_bf16_to_f32(ws, st->dyf, dy, tokens * H);
  const float *dyp = fp8 ? st->sym_q : st->dyf; /* the down dgrad's operand */
  #pragma omp parallel num_threads(st->threads)
  {
    float *dh = cpu_thread_scratch(ws); /* [I_s], then (MOK_FP8) [2 I_s] */
    float *dgu_q = fp8 ? dh + Is : NULL;
    cpu_load_panels(ws, w, -1);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
      for (int64_t i = 0; i < Is; i++) st->hsf[t * Is + i] = bf16_to_f32(sv->hs[t * Is + i]);
      /* the router gradient it returns has no use here: the shared expert has no weight */
      (void)cpu_mlp_backward_row(dyp + t * H, st->panel_gu, st->panel_down, H, Is, 1.0f,
                                 sv->gus + t * 2 * Is, dh, st->dgusf + t * 2 * Is, dgu_q,
                                 st->side + t * H);
    }
  }
}
