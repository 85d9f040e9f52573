/*
 * dispatch.c: step 2 (and its backward twin): every routed row pulls its token's row from the
 * source rank's published x (and dy), converted to fp32 once here. At ep = 1 the source is this
 * rank; padding rows are zeros.
 */
#include <string.h>

#include "bf16.h"
#include "cpu/cpu.h"

void cpu_dispatch(mok_workspace *ws, const cpu_saved *sv, int with_dy) {
  const cpu_state *st = cpu_state_of(ws);
  const int64_t H = ws->shape.hidden, k = ws->shape.top_k;
  #pragma omp parallel for schedule(static) num_threads(st->threads)
  for (int64_t r = 0; r < sv->rows_cap; r++) {
    const int32_t src = sv->row_src[r];
    if (src < 0) {
      memset(st->xr + r * H, 0, (size_t)H * sizeof(float));
      if (with_dy) memset(st->dyr + r * H, 0, (size_t)H * sizeof(float));
      continue;
    }
    const cpu_state *p = cpu_peer(ws, cpu_src_rank(ws, src));
    const int64_t t = cpu_src_slot(ws, src) / k;
    for (int64_t h = 0; h < H; h++) st->xr[r * H + h] = bf16_to_f32(p->sym_x[t * H + h]);
    if (with_dy)
      for (int64_t h = 0; h < H; h++) st->dyr[r * H + h] = bf16_to_f32(p->sym_dy[t * H + h]);
  }
}
