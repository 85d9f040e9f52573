/*
 * common.c: small pieces every step of the CPU backend uses: the typed view of `saved` (carved
 * from mok_saved_layout_of, the one place its offsets are computed), each thread's row scratch,
 * and bf16 -> fp32 conversion of whole tensors (exact, so it can be done once per call).
 */
#include <omp.h>

#include "bf16.h"
#include "cpu/cpu.h"

cpu_saved cpu_saved_view(const mok_workspace *ws, const void *saved, int64_t tokens) {
  mok_saved_layout L = mok_saved_layout_of(ws, tokens);
  char *b = (char *)saved;
  cpu_saved v;
  v.base = b;
  v.rows_cap = L.rows_cap;
  v.status = (int32_t *)(b + L.status);
  v.counts = (int32_t *)(b + L.counts);
  v.offsets = (int32_t *)(b + L.offsets);
  v.row_src = (int32_t *)(b + L.row_src);
  v.row_weight = (float *)(b + L.row_weight);
  v.slot_row = (int32_t *)(b + L.slot_row);
  v.mblock_expert = (int32_t *)(b + L.mblock_expert);
  v.gu = (uint16_t *)(b + L.gu);
  v.hw = (uint16_t *)(b + L.hw);
  v.gus = (uint16_t *)(b + L.gus);
  v.hs = (uint16_t *)(b + L.hs);
  return v;
}

float *cpu_thread_scratch(const mok_workspace *ws) {
  const cpu_state *st = cpu_state_of(ws);
  return st->per_thread + (int64_t)omp_get_thread_num() * st->per_thread_len;
}

void cpu_bf16_to_f32(const mok_workspace *ws, float *dst, const uint16_t *src, int64_t n) {
  #pragma omp parallel for schedule(static) num_threads(cpu_state_of(ws)->threads)
  for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}
