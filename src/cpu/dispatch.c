/*
 * dispatch.c: step 2 (and its backward twin): every routed row pulls its token's row from the
 * source rank's published x (and dy), converted to fp32 once here. At ep = 1 the source is this
 * rank; padding rows are zeros.
 *
 * At MOK_FP8 a product reads its token's published Q_row (sym_q, quantized once per token), so a
 * routed row is its token's quantized row: the forward's xr takes it in place of x; the backward
 * keeps x and dy as bf16 values in xr and dyr (the weight gradients quantize them along the
 * expert's rows, Q_col) and takes the down dgrad's operand into dyq.
 */
#include <string.h>

#include "bf16.h"
#include "cpu/cpu.h"

static void copy_bf16(float *dst, const uint16_t *src, int64_t n) {
  for (int64_t h = 0; h < n; h++) dst[h] = bf16_to_f32(src[h]);
}

void cpu_dispatch(mok_workspace *ws, const cpu_saved *sv, int with_dy) {
  const cpu_state *st = cpu_state_of(ws);
  const int64_t H = ws->shape.hidden, k = ws->shape.top_k;
  const int fp8 = ws->shape.precision == MOK_FP8;
  const size_t row_bytes = (size_t)H * sizeof(float);
  #pragma omp parallel for schedule(static) num_threads(st->threads)
  for (int64_t r = 0; r < sv->rows_cap; r++) {
    const int32_t src = sv->row_src[r];
    if (src < 0) {
      memset(st->xr + r * H, 0, row_bytes);
      if (with_dy) memset(st->dyr + r * H, 0, row_bytes);
      if (with_dy && fp8) memset(st->dyq + r * H, 0, row_bytes);
      continue;
    }
    const cpu_state *p = cpu_peer(ws, cpu_src_rank(ws, src));
    const int64_t t = cpu_src_slot(ws, src) / k;
    if (fp8 && !with_dy) {
      memcpy(st->xr + r * H, p->sym_q + t * H, row_bytes);
      continue;
    }
    copy_bf16(st->xr + r * H, p->sym_x + t * H, H);
    if (with_dy) copy_bf16(st->dyr + r * H, p->sym_dy + t * H, H);
    if (with_dy && fp8) memcpy(st->dyq + r * H, p->sym_q + t * H, row_bytes);
  }
}
