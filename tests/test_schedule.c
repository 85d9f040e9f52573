/*
 * test_schedule.c: the schedule in `saved` (counts, offsets, row_src, row_weight, slot_row,
 * mblock_expert, status) against a construction written the simple way (for each expert, scan
 * every slot), on edge cases: empty experts, all tokens on one expert, k = 1, T = 1, segments of
 * exactly 128 and 129 rows, duplicate ids within a token, T < max_tokens. Each case then runs
 * forward and backward and compares y, dx and d_topk_weights with ref64, as routing edge cases
 * are where the dataflow (not the arithmetic) breaks. The same cases run at MOK_FP8 too.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cpu/ref64.h"
#include "harness.h"
#include "internal.h"

/* The schedule as the contract describes it, built with no cleverness. */
static void check_schedule(const harness *h, const char *what) {
  const mok_shape *s = &h->L.shape;
  const int64_t T = h->T, k = s->top_k, E = s->experts;
  const mok_saved_layout L = mok_saved_layout_of(h->ws, T);
  const char *b = h->saved;
  const int32_t *status = (const int32_t *)(b + L.status);
  const int32_t *counts = (const int32_t *)(b + L.counts);
  const int32_t *offsets = (const int32_t *)(b + L.offsets);
  const int32_t *row_src = (const int32_t *)(b + L.row_src);
  const float *row_weight = (const float *)(b + L.row_weight);
  const int32_t *mblock = (const int32_t *)(b + L.mblock_expert);

  CHECK(status[0] == 0, "%s: status word %d", what, status[0]);
  int32_t *want_src = malloc((size_t)L.rows_cap * sizeof *want_src);
  int32_t *want_off = malloc((size_t)(E + 1) * sizeof *want_off);
  for (int64_t r = 0; r < L.rows_cap; r++) want_src[r] = -1;
  int64_t row = 0;
  for (int64_t e = 0; e < E; e++) {
    want_off[e] = (int32_t)row;
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < k; j++)
        if (h->L.topk_ids[t * k + j] == e) want_src[row + n++] = (int32_t)(t * k + j);
    CHECK(counts[e] == n, "%s: counts[%lld] = %d, expected %lld", what, (long long)e, counts[e],
          (long long)n);
    row += (n + MOK_TILE_M - 1) / MOK_TILE_M * MOK_TILE_M;
  }
  want_off[E] = (int32_t)row;
  for (int64_t e = 0; e <= E; e++)
    CHECK(offsets[e] == want_off[e], "%s: offsets[%lld] = %d, expected %d", what, (long long)e,
          offsets[e], want_off[e]);

  int bad = 0;
  for (int64_t r = 0; r < L.rows_cap && bad < 5; r++) {
    float w = want_src[r] >= 0 ? h->L.topk_weights[want_src[r]] : 0.0f;
    if (row_src[r] != want_src[r] || memcmp(&row_weight[r], &w, sizeof w) != 0) {
      bad++;
      CHECK(0, "%s: row %lld: row_src %d weight %g, expected %d and %g", what, (long long)r,
            row_src[r], row_weight[r], want_src[r], w);
    }
  }
  /* slot_row inverts row_src: every slot of this (only) rank has its row. */
  const int32_t *slot_row = (const int32_t *)(b + L.slot_row);
  int32_t *want_row = malloc((size_t)(T * k) * sizeof *want_row);
  for (int64_t q = 0; q < T * k; q++) want_row[q] = -1;
  for (int64_t r = 0; r < L.rows_cap; r++)
    if (want_src[r] >= 0) want_row[want_src[r]] = (int32_t)r;
  bad = 0;
  for (int64_t q = 0; q < T * k && bad < 5; q++)
    if (slot_row[q] != want_row[q]) {
      bad++;
      CHECK(0, "%s: slot_row[%lld] = %d, expected %d", what, (long long)q, slot_row[q],
            want_row[q]);
    }
  free(want_row);
  for (int64_t blk = 0; blk < L.rows_cap / MOK_TILE_M; blk++) {
    int32_t want = -1;
    for (int64_t e = 0; e < E; e++)
      if (blk * MOK_TILE_M >= want_off[e] && blk * MOK_TILE_M < want_off[e + 1]) want = (int32_t)e;
    CHECK(mblock[blk] == want, "%s: mblock_expert[%lld] = %d, expected %d", what,
          (long long)blk, mblock[blk], want);
  }

  int32_t *api_counts = malloc((size_t)E * sizeof *api_counts);
  CHECK_OK(mok_schedule_counts(h->ws, h->saved, T, api_counts, NULL));
  CHECK(memcmp(api_counts, counts, (size_t)E * sizeof *counts) == 0,
        "%s: mok_schedule_counts differs from saved", what);
  free(api_counts);
  free(want_src);
  free(want_off);
}

/* Every token's y, dx and d_topk_weights vs ref64 (T is small in these cases, or sampled). */
static void check_outputs(const harness *h, const char *what) {
  const int64_t H = h->L.shape.hidden, k = h->L.shape.top_k;
  double *y = malloc((size_t)H * sizeof *y), *dx = malloc((size_t)H * sizeof *dx);
  double *dtw = malloc((size_t)k * sizeof *dtw);
  rel_err ey = {0, 0}, edx = {0, 0}, edtw = {0, 0};
  for (int64_t t = 0; t < h->T; t += h->T > 40 ? 7 : 1) {
    mok_ref64_token(&h->L, t, y, dx, dtw);
    for (int64_t i = 0; i < H; i++) {
      rel_err_add(&ey, mok_bf16_to_f32(h->y[t * H + i]), y[i]);
      rel_err_add(&edx, mok_bf16_to_f32(h->dx[t * H + i]), dx[i]);
    }
    for (int64_t j = 0; j < k; j++) rel_err_add(&edtw, h->dtw[t * k + j], dtw[j]);
  }
  CHECK(rel_err_value(&ey) < 5e-4, "%s: y rel err %.3g", what, rel_err_value(&ey));
  CHECK(rel_err_value(&edx) < 5e-4, "%s: dx rel err %.3g", what, rel_err_value(&edx));
  CHECK(rel_err_value(&edtw) < 2e-5, "%s: d_topk_weights rel err %.3g", what,
        rel_err_value(&edtw));
  free(y), free(dx), free(dtw);
}

/* Rows 0 and 5 of dW_gate, dW_up and dW_down of every expert (empty ones must be written as 0)
 * vs ref64, bf16-rounded as the backend writes them. */
static void check_grads(const harness *h, const char *what) {
  const int64_t H = h->L.shape.hidden, I = h->L.shape.inter;
  double ref[64];
  rel_err err[3] = {{0, 0}, {0, 0}, {0, 0}};
  for (int64_t e = 0; e < h->L.shape.experts; e++)
    for (int64_t row = 0; row < 6; row += 5)
      for (int g = G_GATE; g <= G_DOWN; g++) {
        const int64_t rows = g == G_DOWN ? H : I, len = g == G_DOWN ? I : H;
        mok_ref64_grad_row(&h->L, (mok_ref_grad)g, e, row, ref);
        const uint16_t *out = (const uint16_t *)h->g[g] + (e * rows + row) * len;
        for (int64_t i = 0; i < len; i++)
          rel_err_add(&err[g], mok_bf16_to_f32(out[i]),
                      mok_bf16_to_f32(mok_f32_to_bf16((float)ref[i])));
      }
  for (int g = G_GATE; g <= G_DOWN; g++)
    CHECK(rel_err_value(&err[g]) < 5e-4, "%s: weight grad %d rel err %.3g", what, g,
          rel_err_value(&err[g]));
}

typedef int32_t (*route_fn)(int64_t t, int64_t j);

/* One case: a layer whose ids come from `route`; schedule alone, then forward + backward. */
static void run_case_at(mok_precision p, int64_t max_tokens, int64_t T, int32_t E, int32_t k,
                        route_fn route, uint64_t seed, const char *what) {
  const mok_shape s = {max_tokens, 32, 16, 8, E, k, p, 0};
  harness h;
  if (harness_init(&h, &s, T, seed, 0)) {
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = 0; j < k; j++) h.L.topk_ids[t * k + j] = route(t, j);
    harness_poison(&h, 0xEE);
    mok_forward_args f = harness_forward_args(&h);
    CHECK_OK(mok_schedule(h.ws, &f, NULL));
    check_schedule(&h, what);
    harness_poison(&h, 0x5A); /* bf16 0x5a5a = 1.5e16: an unwritten value shows */
    CHECK_OK(harness_run(&h, MOK_GRAD_WRITE_BF16));
    check_schedule(&h, what);
    check_outputs(&h, what);
    check_grads(&h, what);
  }
  harness_fini(&h);
}

static void run_case(int64_t max_tokens, int64_t T, int32_t E, int32_t k, route_fn route,
                     uint64_t seed, const char *what) {
  run_case_at(MOK_BF16, max_tokens, T, E, k, route, seed, what);
}

static int32_t two_experts(int64_t t, int64_t j) { return (int32_t)((t + j) % 2 ? 5 : 1); }
static int32_t all_on_two(int64_t t, int64_t j) { return (void)t, (void)j, 2; }
static int32_t split_128_129(int64_t t, int64_t j) { return (void)j, t % 2 ? 0 : 2; }
static int32_t duplicates(int64_t t, int64_t j) { return (int32_t)(j < 2 ? t % 4 : (t + 1) % 4); }
static int32_t mixed(int64_t t, int64_t j) { return (int32_t)((t * 5 + j * 3) % 7); }

static void empty_experts(void) { run_case(40, 40, 8, 2, two_experts, 11, "empty experts"); }
static void one_expert(void) { run_case(200, 200, 4, 1, all_on_two, 12, "all on one expert"); }
static void single_token(void) { run_case(1, 1, 3, 1, all_on_two, 13, "T = 1, k = 1"); }
static void tile_edges(void) { run_case(257, 257, 3, 1, split_128_129, 14, "128 and 129 rows"); }
static void duplicate_ids(void) { run_case(5, 5, 4, 3, duplicates, 15, "duplicate ids"); }
static void partial_batch(void) { run_case(300, 77, 7, 3, mixed, 16, "T < max_tokens"); }

/* The same cases at MOK_FP8, against ref64's FP8 recipe (a segment of 129 rows is two blocks
 * of the weight gradients' Q_col; an empty expert's gradients are zeros). */
static void fp8_cases(void) {
  run_case_at(MOK_FP8, 40, 40, 8, 2, two_experts, 21, "fp8, empty experts");
  run_case_at(MOK_FP8, 200, 200, 4, 1, all_on_two, 22, "fp8, all on one expert");
  run_case_at(MOK_FP8, 1, 1, 3, 1, all_on_two, 23, "fp8, T = 1, k = 1");
  run_case_at(MOK_FP8, 257, 257, 3, 1, split_128_129, 24, "fp8, 128 and 129 rows");
  run_case_at(MOK_FP8, 5, 5, 4, 3, duplicates, 25, "fp8, duplicate ids");
  run_case_at(MOK_FP8, 300, 77, 7, 3, mixed, 26, "fp8, T < max_tokens");
}

const test_case tests_schedule[] = {
    {"cpu/schedule_empty_experts", empty_experts},
    {"cpu/schedule_all_on_one_expert", one_expert},
    {"cpu/schedule_single_token", single_token},
    {"cpu/schedule_tile_edges_128_129", tile_edges},
    {"cpu/schedule_duplicate_ids", duplicate_ids},
    {"cpu/schedule_partial_batch", partial_batch},
    {"fp8/cpu_routing_edge_cases_vs_ref64", fp8_cases},
    {NULL, NULL}};
