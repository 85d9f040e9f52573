/*
 * shared.c: the shared expert, forward and backward dgrad, one token per row with w = 1 (same row
 * code as the routed experts, mlp.c). Its outputs stay fp32 (ys forward, dxs backward, in
 * cpu_state.side) until the combine adds the routed slots to them.
 */
#include "bf16.h"
#include "cpu/cpu.h"

void cpu_shared_forward(mok_workspace *ws, const mok_weights *w, const cpu_saved *sv,
                        const uint16_t *x, int64_t tokens, int compute_y) {
  const cpu_state *st = cpu_state_of(ws);
  const int64_t H = ws->shape.hidden, Is = ws->shape.shared_inter;
  if (Is == 0) return;
  cpu_bf16_to_f32(ws, st->xf, x, tokens * H);
  #pragma omp parallel num_threads(st->threads)
  {
    cpu_load_panels(ws, w->ws_gate, w->ws_up, w->ws_down, H, Is);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; t++)
      cpu_mlp_forward_row(st->xf + t * H, st->panel_gu, st->panel_down, H, Is, 1.0f,
                          sv->gus + t * 2 * Is, sv->hs + t * Is, st->hsf + t * Is,
                          compute_y ? st->side + t * H : NULL);
  }
}

void cpu_shared_backward(mok_workspace *ws, const mok_weights *w, const cpu_saved *sv,
                         const uint16_t *x, const uint16_t *dy, int64_t tokens) {
  const cpu_state *st = cpu_state_of(ws);
  const int64_t H = ws->shape.hidden, Is = ws->shape.shared_inter;
  if (Is == 0) return;
  cpu_bf16_to_f32(ws, st->xf, x, tokens * H); /* kept for its weight gradients (wgrad.c) */
  cpu_bf16_to_f32(ws, st->dyf, dy, tokens * H);
  #pragma omp parallel num_threads(st->threads)
  {
    float *dh = cpu_thread_scratch(ws); /* [I_s] */
    cpu_load_panels(ws, w->ws_gate, w->ws_up, w->ws_down, H, Is);
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
      for (int64_t i = 0; i < Is; i++) st->hsf[t * Is + i] = bf16_to_f32(sv->hs[t * Is + i]);
      /* the router gradient it returns has no use here: the shared expert has no weight */
      (void)cpu_mlp_backward_row(st->dyf + t * H, st->panel_gu, st->panel_down, H, Is, 1.0f,
                                 sv->gus + t * 2 * Is, dh, st->dgusf + t * 2 * Is,
                                 st->side + t * H);
    }
  }
}
