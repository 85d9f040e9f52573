/*
 * schedule.c: step 1 of the dataflow. From topk_ids, the list of routed rows of each local
 * expert in canonical order (source rank, token, slot; one source rank while ep = 1), each
 * expert's segment padded to MOK_TILE_M rows, written into the caller's `saved` buffer.
 *
 * Every id is checked before anything but the status word is written, so a bad id leaves the
 * rest of `saved` (and every output of the call) as it was.
 */
#include "cpu/cpu.h"

/* First slot whose id is outside [0, E), or -1. */
static int64_t first_bad_id(const int32_t *ids, int64_t slots, int32_t experts) {
  for (int64_t s = 0; s < slots; s++)
    if (ids[s] < 0 || ids[s] >= experts) return s;
  return -1;
}

/* A device-side error: the call's status word and the workspace's sticky bits (mok_check). */
static void set_error(mok_workspace *ws, const cpu_saved *sv, int32_t bit) {
  sv->status[0] |= bit;
  cpu_state_of(ws)->sticky |= bit;
}

mok_status cpu_schedule_build(mok_workspace *ws, const int32_t *ids, const float *weights,
                              int64_t tokens, const cpu_saved *sv) {
  const int64_t k = ws->shape.top_k, slots = tokens * k;
  const int64_t El = ws->experts_local, base = ws->expert_base;
  for (int i = 0; i < 4; i++) sv->status[i] = 0;

  int64_t bad = first_bad_id(ids, slots, ws->shape.experts);
  if (bad >= 0) {
    set_error(ws, sv, MOK_DEVERR_EXPERT_ID);
    return mok_fail(MOK_ERR_EXPERT_ID,
                    "topk_ids[%lld] (token %lld, slot %lld) is %d; expected 0..%d (E = %d); "
                    "the call left its outputs untouched",
                    (long long)bad, (long long)(bad / k), (long long)(bad % k), ids[bad],
                    ws->shape.experts - 1, ws->shape.experts);
  }

  /* Counts, then padded offsets. Ids of other ranks' experts (ep > 1) are not routed here. */
  int32_t *counts = sv->counts, *offsets = sv->offsets;
  for (int64_t e = 0; e < El; e++) counts[e] = 0;
  for (int64_t s = 0; s < slots; s++) {
    int64_t e = ids[s] - base;
    if (e >= 0 && e < El) counts[e]++;
  }
  offsets[0] = 0;
  for (int64_t e = 0; e < El; e++)
    offsets[e + 1] = offsets[e] + (int32_t)mok_round_up(counts[e], MOK_TILE_M);
  const int64_t total = offsets[El];
  if (total > sv->rows_cap) { /* cannot happen at ep = 1: rows_cap is the worst case */
    set_error(ws, sv, MOK_DEVERR_CAPACITY);
    return mok_fail(MOK_ERR_CAPACITY, "schedule needs %lld rows; saved holds %lld",
                    (long long)total, (long long)sv->rows_cap);
  }

  /* Rows in canonical order: one pass over slots in ascending t*k + j. */
  int32_t *cursor = cpu_state_of(ws)->cursor;
  for (int64_t e = 0; e < El; e++) cursor[e] = offsets[e];
  for (int64_t s = 0; s < slots; s++) {
    int64_t e = ids[s] - base;
    if (e < 0 || e >= El) continue;
    int32_t r = cursor[e]++;
    sv->row_src[r] = (int32_t)s;
    sv->row_weight[r] = weights[s];
  }
  for (int64_t e = 0; e < El; e++)
    for (int64_t r = offsets[e] + counts[e]; r < offsets[e + 1]; r++) {
      sv->row_src[r] = -1;
      sv->row_weight[r] = 0.0f;
    }
  for (int64_t r = total; r < sv->rows_cap; r++) {
    sv->row_src[r] = -1;
    sv->row_weight[r] = 0.0f;
  }

  /* The expert of each 128-row block (the GEMM tile scheduler's map); -1 past the total. */
  for (int64_t e = 0; e < El; e++)
    for (int64_t b = offsets[e] / MOK_TILE_M; b < offsets[e + 1] / MOK_TILE_M; b++)
      sv->mblock_expert[b] = (int32_t)e;
  for (int64_t b = total / MOK_TILE_M; b < sv->rows_cap / MOK_TILE_M; b++)
    sv->mblock_expert[b] = -1;
  return MOK_OK;
}
