/*
 * schedule.c: step 1 of the dataflow. From the topk_ids of every rank of the EP group (each rank
 * publishes its own; one rank while ep = 1), the list of routed rows of each local expert in
 * canonical order (source rank, token, slot), each expert's segment padded to MOK_TILE_M rows,
 * written into the caller's `saved` buffer.
 *
 * Two barriers of the group: after publishing (every id checked, by its own rank) and after the
 * counts (every rank within its capacity). An error anywhere stops every rank there, before
 * anything but saved's status word is written, so every output of the call stays as it was.
 */
#include <string.h>

#include "cpu/cpu.h"

/* First slot whose id is outside [0, E), or -1. */
static int64_t first_bad_id(const int32_t *ids, int64_t slots, int32_t experts) {
  for (int64_t s = 0; s < slots; s++)
    if (ids[s] < 0 || ids[s] >= experts) return s;
  return -1;
}

/* A device-side error of the call: its status word and the workspace's sticky bits. */
static void set_error(mok_workspace *ws, const cpu_saved *sv, int32_t bits) {
  sv->status[MOK_STATUS_BITS] |= bits;
  cpu_state_of(ws)->sticky |= bits;
}

/* Publishes ids and weights, checks them, meets the group. */
static mok_status publish_and_check(mok_workspace *ws, const int32_t *ids, const float *weights,
                                    int64_t tokens, const cpu_saved *sv) {
  cpu_state *st = cpu_state_of(ws);
  const int64_t k = ws->shape.top_k, slots = tokens * k;
  st->sym_tokens = tokens;
  memcpy(st->sym_ids, ids, (size_t)slots * sizeof *ids);
  memcpy(st->sym_w, weights, (size_t)slots * sizeof *weights);
  const int64_t bad = first_bad_id(ids, slots, ws->shape.experts);
  int32_t bits = bad >= 0 ? MOK_DEVERR_EXPERT_ID : 0;
  mok_status s = cpu_barrier(ws, &bits);
  if (s != MOK_OK) return s;
  if (!bits) return MOK_OK;
  set_error(ws, sv, bits);
  if (bad < 0 && (bits & MOK_DEVERR_PEER_ARG))
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "another rank of the EP group had this call refused for a bad argument (its "
                    "error says which); the call left its outputs untouched on every rank");
  if (bad >= 0)
    return mok_fail(MOK_ERR_EXPERT_ID,
                    "topk_ids[%lld] (token %lld, slot %lld) is %d; expected 0..%d (E = %d)%s; "
                    "the call left its outputs untouched",
                    (long long)bad, (long long)(bad / k), (long long)(bad % k), ids[bad],
                    ws->shape.experts - 1, ws->shape.experts,
                    ids[bad] < 0 ? " (padding slots, id -1, are not supported: give them any "
                                   "expert id and weight 0)" : "");
  return mok_fail(MOK_ERR_EXPERT_ID,
                  "another rank of the EP group passed an expert id outside 0..%d; the call left "
                  "its outputs untouched on every rank", ws->shape.experts - 1);
}

mok_status cpu_schedule_build(mok_workspace *ws, const int32_t *ids, const float *weights,
                              int64_t tokens, const cpu_saved *sv) {
  const int64_t k = ws->shape.top_k, El = ws->experts_local, base = ws->expert_base;
  const int64_t ranks = ws->ctx->cfg.ep_size, slots_cap = ws->shape.max_tokens * k;
  for (int i = 0; i < MOK_STATUS_WORDS; i++) sv->status[i] = 0;
  sv->status[MOK_STATUS_TOKENS] = (int32_t)tokens; /* tokens <= max_tokens <= 2^20 (api.c) */
  sv->status[MOK_STATUS_MAGIC] = MOK_SAVED_MAGIC;
  sv->status[MOK_STATUS_IDENT] = (int32_t)mok_saved_ident(ws);
  mok_status s = publish_and_check(ws, ids, weights, tokens, sv);
  if (s != MOK_OK) return s;

  /* Counts (in the cursors until the capacity is known: a call over it writes nothing but the
   * header), then padded offsets. Ids of other ranks' experts are not routed here. */
  int32_t *cursor = cpu_state_of(ws)->cursor;
  for (int64_t e = 0; e < El; e++) cursor[e] = 0;
  for (int64_t src = 0; src < ranks; src++) {
    const cpu_state *p = cpu_peer(ws, src);
    for (int64_t q = 0; q < p->sym_tokens * k; q++) {
      int64_t e = p->sym_ids[q] - base;
      if (e >= 0 && e < El) cursor[e]++;
    }
  }
  int64_t rows = 0, total = 0;
  for (int64_t e = 0; e < El; e++) {
    rows += cursor[e];
    total += mok_round_up(cursor[e], MOK_TILE_M);
  }
  int32_t bits = total > sv->rows_cap ? MOK_DEVERR_CAPACITY : 0;
  s = cpu_barrier(ws, &bits);
  if (s != MOK_OK) return s;
  if (bits) {
    set_error(ws, sv, bits);
    if (total > sv->rows_cap)
      return mok_fail(MOK_ERR_CAPACITY,
                      "%lld routed rows (%lld with padding) came to this rank's experts; the "
                      "workspace holds %lld (shape.routed_rows); outputs untouched",
                      (long long)rows, (long long)total, (long long)sv->rows_cap);
    return mok_fail(MOK_ERR_CAPACITY, "another rank of the EP group received more routed rows "
                                      "than its workspace holds; outputs untouched");
  }
  int32_t *counts = sv->counts, *offsets = sv->offsets;
  offsets[0] = 0;
  for (int64_t e = 0; e < El; e++) {
    counts[e] = cursor[e];
    offsets[e + 1] = offsets[e] + (int32_t)mok_round_up(counts[e], MOK_TILE_M);
  }

  /* Rows in canonical order: source ranks ascending, each one's slots in ascending t*k + j. */
  const int64_t me = ws->ctx->cfg.ep_rank;
  for (int64_t e = 0; e < El; e++) cursor[e] = offsets[e];
  for (int64_t q = 0; q < tokens * k; q++) sv->slot_row[q] = -1;
  for (int64_t src = 0; src < ranks; src++) {
    const cpu_state *p = cpu_peer(ws, src);
    for (int64_t q = 0; q < p->sym_tokens * k; q++) {
      int64_t e = p->sym_ids[q] - base;
      if (e < 0 || e >= El) continue;
      int32_t r = cursor[e]++;
      sv->row_src[r] = (int32_t)(src * slots_cap + q);
      sv->row_weight[r] = p->sym_w[q];
      if (src == me) sv->slot_row[q] = r;
    }
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
  sv->status[MOK_STATUS_ROUTING] = (int32_t)mok_routing_sum(ids, weights, tokens * k);
  sv->status[MOK_STATUS_SCHEDULE] = (int32_t)mok_schedule_sum(ws, sv->base, tokens);
  sv->status[MOK_STATUS_FILLED] = MOK_FILLED_SCHEDULE;
  return MOK_OK;
}
