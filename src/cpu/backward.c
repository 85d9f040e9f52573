/*
 * backward.c: step 5 for routed rows (dispatch has filled dyr): dgrad through down, the router
 * gradient, the SwiGLU backward from the saved gu, and dgrad through gate/up; the router gradient
 * and the dx row go to the row's slot t*k + j on its source rank. Keeps each row's dgu (and hw as
 * fp32) for the weight gradients.
 */
#include "bf16.h"
#include "cpu/cpu.h"

void cpu_expert_backward(mok_workspace *ws, const mok_weights *w, const cpu_saved *sv) {
  const cpu_state *st = cpu_state_of(ws);
  const int64_t H = ws->shape.hidden, I = ws->shape.inter;
  const int fp8 = ws->shape.precision == MOK_FP8;
  /* MOK_FP8: the down dgrad reads the token's Q_row(dy), dispatched into dyq */
  const float *dy = fp8 ? st->dyq : st->dyr;

  #pragma omp parallel num_threads(st->threads)
  {
    float *dh = cpu_thread_scratch(ws); /* [I], then [H], then (MOK_FP8) [2I] */
    float *dx = dh + I;
    float *dgu_q = fp8 ? dx + H : NULL;
    for (int64_t e = 0; e < ws->experts_local; e++) {
      const int64_t r0 = sv->offsets[e], n = sv->counts[e];
      if (n == 0) continue;
      cpu_load_panels(ws, w, e);
      #pragma omp for schedule(static)
      for (int64_t r = r0; r < r0 + n; r++) {
        const int32_t src = sv->row_src[r];
        cpu_state *home = cpu_peer(ws, cpu_src_rank(ws, src));
        const int64_t slot = cpu_src_slot(ws, src);
        for (int64_t i = 0; i < I; i++) st->hwf[r * I + i] = bf16_to_f32(sv->hw[r * I + i]);
        home->sym_dtw[slot] =
            cpu_mlp_backward_row(dy + r * H, st->panel_gu, st->panel_down, H, I,
                                 sv->row_weight[r], sv->gu + r * 2 * I, dh,
                                 st->dguf + r * 2 * I, dgu_q, dx);
        for (int64_t h = 0; h < H; h++) home->slot[slot * H + h] = f32_to_bf16(dx[h]);
      }
    }
  }
}
