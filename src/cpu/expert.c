/*
 * expert.c: step 3 of the forward for routed rows (dispatch has filled xr): the gate/up GEMM with
 * the SwiGLU epilogue into `saved`, and the down GEMM into the row's slot t*k + j on its source
 * rank (combine's push).
 *
 * Experts run one after another; the team converts the expert's weights to fp32 panels once, then
 * splits its rows. Padding rows of gu and hw are zeroed so that `saved` is the same whatever it
 * held before (recompute gives forward's bits).
 */
#include <string.h>

#include "bf16.h"
#include "cpu/cpu.h"

void cpu_expert_forward(mok_workspace *ws, const mok_weights *w, const cpu_saved *sv,
                        int compute_y) {
  const cpu_state *st = cpu_state_of(ws);
  const int64_t H = ws->shape.hidden, I = ws->shape.inter;
  const int fp8 = ws->shape.precision == MOK_FP8;

  #pragma omp parallel num_threads(st->threads)
  {
    float *out = cpu_thread_scratch(ws); /* [H] */
    for (int64_t e = 0; e < ws->experts_local; e++) {
      const int64_t r0 = sv->offsets[e], n = sv->counts[e];
      if (n == 0) continue; /* every thread sees the same counts: the barriers stay matched */
      cpu_load_panels(ws, w, e);
      #pragma omp for schedule(static)
      for (int64_t r = r0; r < r0 + n; r++) {
        cpu_mlp_forward_row(st->xr + r * H, st->panel_gu, st->panel_down, H, I,
                            sv->row_weight[r], fp8, sv->gu + r * 2 * I, sv->hw + r * I,
                            st->hwf + r * I, compute_y ? out : NULL);
        if (compute_y) {
          const int32_t src = sv->row_src[r];
          uint16_t *dst = cpu_peer(ws, cpu_src_rank(ws, src))->slot + cpu_src_slot(ws, src) * H;
          for (int64_t h = 0; h < H; h++) dst[h] = f32_to_bf16(out[h]);
        }
      }
    }
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < sv->rows_cap; r++) {
      if (sv->row_src[r] >= 0) continue;
      memset(sv->gu + r * 2 * I, 0, (size_t)(2 * I) * sizeof(uint16_t));
      memset(sv->hw + r * I, 0, (size_t)I * sizeof(uint16_t));
    }
  }
}
