/*
 * combine.c: step 4 (and its backward twin): each token's output is its shared-expert fp32 row
 * (or 0) plus its k slot rows, added in ascending j, rounded once to bf16. One token per thread
 * at a time, so a token's bits never depend on the rest of the batch (D3).
 */
#include "bf16.h"
#include "cpu/cpu.h"

void cpu_combine(mok_workspace *ws, int64_t tokens, int with_side, uint16_t *out) {
  const cpu_state *st = cpu_state_of(ws);
  const int64_t H = ws->shape.hidden, k = ws->shape.top_k;
  #pragma omp parallel for schedule(static) num_threads(st->threads)
  for (int64_t t = 0; t < tokens; t++) {
    for (int64_t h = 0; h < H; h++) {
      float acc = with_side ? st->side[t * H + h] : 0.0f;
      for (int64_t j = 0; j < k; j++) acc += bf16_to_f32(st->slot[(t * k + j) * H + h]);
      out[t * H + h] = f32_to_bf16(acc);
    }
  }
}
