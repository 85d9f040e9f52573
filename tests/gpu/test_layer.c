/*
 * test_layer.c: the CUDA backend against the CPU reference and against itself (DESIGN §6):
 * schedule equality, every output and saved activation vs the CPU backend on small odd shapes,
 * the DESIGN §7 shapes at reduced T vs the float64 checker, poisoned outputs, D1 repeats, the D2
 * knob sweep, D3 batch subsets, bad expert ids, recompute, CUDA graph capture and replay.
 * Every run starts from outputs poisoned with NaN bytes, so an unwritten element fails.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "check.h"
#include "cpu/ref64.h"
#include "device.h"
#include "internal.h"

#define TOL GPU_TOL

/* Odd sizes: tiles that overhang H and I, one expert, T = 1, a shared expert of another I,
 * k > 32 (dispatch takes a token's slots 32 at a time), T = 2100 (between one and two tokens a
 * warp of the layer launch, which takes them two at a time: the warps whose second token is past
 * T, and their step back to their first group of routed rows), and for the schedule's scan: more
 * experts than its block has threads, with more chunks than it loads in one batch (9 chunks of
 * 1024 slots), and 33 chunks over 21 rows of 48 threads (slices of 2 after a prefix). */
const small_case small_cases[] = {
    {300, 192, 320, 0, 8, 2},   {1, 64, 64, 64, 4, 4},     {257, 384, 128, 192, 16, 8},
    {130, 128, 64, 0, 1, 1},    {77, 320, 192, 64, 5, 3},  {513, 256, 448, 128, 32, 4},
    {65, 64, 64, 0, 48, 40},    {2100, 64, 64, 0, 1500, 4}, {2100, 64, 64, 0, 48, 16},
};
const size_t small_case_count = sizeof small_cases / sizeof small_cases[0];

static mok_shape shape_at(mok_precision p, int64_t T, int64_t H, int64_t I, int64_t Is, int E,
                          int k) {
  mok_shape s = shape_of(T, H, I, Is, E, k);
  s.precision = p;
  return s;
}

static const char *precision_name(mok_precision p) { return p == MOK_FP8 ? "fp8" : "bf16"; }

/* Each case twice: bf16 weight gradients in clusters of 2 x 1 (the default), fp32 main-grad
 * accumulation in clusters of 2 x 2 (the knob), so the sanitizers, which run this test, see both
 * cluster shapes. */
void layer_vs_cpu_cases(mok_precision p, const small_case *cases, size_t n) {
  mok_context_config k4 = MOK_CONTEXT_CONFIG_INIT;
  k4.cluster = 4;
  for (size_t c = 0; c < n; c++) {
    const small_case *sc = &cases[c];
    for (int m = 0; m < 2; m++) {
      mok_grad_mode mode = m ? MOK_GRAD_ACCUMULATE_F32 : MOK_GRAD_WRITE_BF16;
      mok_shape s = shape_at(p, sc->T, sc->H, sc->I, sc->Is, sc->E, sc->k);
      harness ref, out;
      int ok = harness_init(&ref, &s, sc->T, 100 + c, 0) &&
               harness_init(&out, &s, sc->T, 100 + c, 0);
      if (ok) {
        char tag[96];
        snprintf(tag, sizeof tag, "%s T%lld H%lld I%lld Is%lld E%d k%d %s", precision_name(p),
                 (long long)sc->T, (long long)sc->H, (long long)sc->I, (long long)sc->Is, sc->E,
                 sc->k, m ? "f32acc 2x2" : "bf16 2x1");
        if (run_both(&ref, &out, mode, m ? &k4 : NULL)) {
          compare_schedule(tag, &out, &ref);
          compare_outputs(tag, &out, &ref, mode);
        }
      }
      harness_fini(&ref);
      harness_fini(&out);
    }
  }
}

static void layer_vs_cpu(void) { layer_vs_cpu_cases(MOK_BF16, small_cases, small_case_count); }

/* Routing edge cases: all tokens on one expert (others empty), segments of exactly 128 and 129
 * rows, duplicate ids within a token. */
void routing_edges_at(mok_precision p) {
  mok_shape s = shape_at(p, 257, 128, 128, 0, 4, 2);
  for (int variant = 0; variant < 3; variant++) {
    harness ref, out;
    if (harness_init(&ref, &s, 257, 7 + variant, 0) &&
        harness_init(&out, &s, 257, 7 + variant, 0)) {
      for (int64_t t = 0; t < 257; t++)
        for (int j = 0; j < 2; j++) {
          int32_t id;
          if (variant == 0) id = 0;                                  /* one expert, 514 rows */
          else if (variant == 1) id = t < 128 ? j : (t < 257 ? 2 + j : 0); /* 128 and 129 rows */
          else id = (int32_t)(t % 4);                                /* duplicates: j0 == j1 */
          ref.L.topk_ids[t * 2 + j] = out.L.topk_ids[t * 2 + j] = id;
        }
      char tag[40];
      snprintf(tag, sizeof tag, "%s routing variant %d", precision_name(p), variant);
      if (run_both(&ref, &out, MOK_GRAD_WRITE_BF16, NULL)) {
        compare_schedule(tag, &out, &ref);
        compare_outputs(tag, &out, &ref, MOK_GRAD_WRITE_BF16);
      }
    }
    harness_fini(&ref);
    harness_fini(&out);
  }
}

/* DESIGN §7 shapes with their full H, I, E, k at reduced T, against the float64 checker on
 * sampled tokens and gradient rows. */
const design_shape design_shapes[] = {
    {"dsv3", 7168, 2048, 2048, 32, 8},          {"qwen3-30b-a3b", 2048, 768, 0, 128, 8},
    {"qwen3-235b", 4096, 1536, 0, 128, 8},      {"mixtral-8x7b", 4096, 14336, 0, 8, 2},
    {"gpt-oss-120b", 2880, 2880, 0, 128, 4},    {"fine-7b", 1536, 256, 0, 128, 8},
};
const size_t design_shape_count = sizeof design_shapes / sizeof design_shapes[0];

static void design_shapes_vs_ref64(void) {
  const int64_t T = 256;
  for (size_t c = 0; c < design_shape_count; c++) {
    const design_shape *ds = &design_shapes[c];
    mok_shape s = shape_of(T, ds->H, ds->I, ds->Is, ds->E, ds->k);
    harness out;
    if (!harness_init(&out, &s, T, 500 + c, 0)) {
      harness_fini(&out);
      continue;
    }
    gpu_layer d;
    if (gpu_init(&d, &out, T, NULL)) {
      gpu_poison(&d, 0xff);
      CHECK_OK(gpu_run(&d, MOK_GRAD_WRITE_BF16, 0));
      gpu_fetch(&d, &out);
      CHECK_OK(mok_check(d.ws, 0));
    }
    gpu_fini(&d);
    const int64_t H = ds->H, k = ds->k;
    CHECK(nan_count_bf16(out.y, (size_t)(T * H)) == 0, "%s: y unwritten", ds->name);
    CHECK(nan_count_bf16(out.dx, (size_t)(T * H)) == 0, "%s: dx unwritten", ds->name);
    /* Sampled tokens. */
    enum { NT = 6 };
    const int64_t toks[NT] = {0, 1, T / 3, T / 2, T - 2, T - 1};
    rel_err ey = {0, 0}, edx = {0, 0}, edw = {0, 0};
    double *buf = malloc(sizeof(double) * NT * (2 * H + k));
#pragma omp parallel for schedule(dynamic)
    for (int i = 0; i < NT; i++)
      mok_ref64_token(&out.L, toks[i], buf + i * (2 * H + k), buf + i * (2 * H + k) + H,
                      buf + i * (2 * H + k) + 2 * H);
    for (int i = 0; i < NT; i++) {
      const double *r = buf + i * (2 * H + k);
      for (int64_t h = 0; h < H; h++) {
        rel_err_add(&ey, bf16_to_f32(out.y[toks[i] * H + h]), r[h]);
        rel_err_add(&edx, bf16_to_f32(out.dx[toks[i] * H + h]), r[H + h]);
      }
      for (int64_t j = 0; j < k; j++) rel_err_add(&edw, out.dtw[toks[i] * k + j], r[2 * H + j]);
    }
    free(buf);
    CHECK(rel_err_value(&ey) < TOL, "%s: y rel err %.3g", ds->name, rel_err_value(&ey));
    CHECK(rel_err_value(&edx) < TOL, "%s: dx rel err %.3g", ds->name, rel_err_value(&edx));
    CHECK(rel_err_value(&edw) < TOL, "%s: d_topk_weights rel err %.3g", ds->name,
          rel_err_value(&edw));
    /* One row of each weight gradient, for the expert of token 0's first slot. */
    const int64_t e = out.L.topk_ids[0];
    const int64_t ncols[G_COUNT] = {H, H, ds->I, H, H, ds->Is};
    const int64_t rowsel[G_COUNT] = {ds->I / 2, 3, H - 1, ds->Is / 3, ds->Is - 1, 5};
    for (int g = 0; g < G_COUNT; g++) {
      if (!out.g_len[g]) continue;
      double *r = malloc(sizeof(double) * ncols[g]);
      mok_ref64_grad_row(&out.L, (mok_ref_grad)g, e, rowsel[g], r);
      const uint16_t *gp = (const uint16_t *)out.g[g] +
                           (g < GS_GATE ? e * (out.g_len[g] / ds->E) : 0) + rowsel[g] * ncols[g];
      rel_err re = {0, 0};
      for (int64_t j = 0; j < ncols[g]; j++) rel_err_add(&re, bf16_to_f32(gp[j]), r[j]);
      free(r);
      CHECK(rel_err_value(&re) < TOL, "%s: %s row rel err %.3g", ds->name, grad_name[g],
            rel_err_value(&re));
    }
    harness_fini(&out);
  }
}

/* D1: three runs give the same bits; D2: so does every grid size and cluster shape. About 130
 * rows per expert make segments of one and of two M tiles, so a cluster's M tiles may belong to
 * two experts (B not shared); the shared expert has 5 M tiles and gate/up forward 3 N tiles of
 * 128, so clusters have phantom CTAs along M and, at 2 x 2, along N. */
void repeat_and_knobs_at(mok_precision p) {
  mok_shape s = shape_at(p, 520, 512, 384, 256, 16, 4);
  harness h, a, b;
  if (harness_init(&h, &s, 520, 42, 0) && harness_init(&a, &s, 520, 42, 0) &&
      harness_init(&b, &s, 520, 42, 0)) {
    fill_grads(&h);
    gpu_once(&h, &a, NULL, MOK_GRAD_ACCUMULATE_F32);
    for (int r = 0; r < 2; r++) {
      gpu_once(&h, &b, NULL, MOK_GRAD_ACCUMULATE_F32);
      compare_bits("D1 repeat", &b, &a, MOK_GRAD_ACCUMULATE_F32);
      same_bits("D1 saved", b.saved, a.saved, a.saved_bytes);
    }
    const int knobs[][2] = {/* sms, cluster */
                            {97, 0}, {33, 0}, {8, 0}, {1, 0}, {0, 4}, {33, 4}, {8, 4}, {1, 4}};
    for (size_t i = 0; i < sizeof knobs / sizeof knobs[0]; i++) {
      mok_context_config k = MOK_CONTEXT_CONFIG_INIT;
      k.sms = knobs[i][0], k.cluster = knobs[i][1];
      char tag[48];
      snprintf(tag, sizeof tag, "D2 sms=%d cluster=%d", k.sms, k.cluster);
      gpu_once(&h, &b, &k, MOK_GRAD_ACCUMULATE_F32);
      compare_bits(tag, &b, &a, MOK_GRAD_ACCUMULATE_F32);
    }
  }
  harness_fini(&h);
  harness_fini(&a);
  harness_fini(&b);
}

/* D3: a token's y, dx and d_topk_weights do not depend on the rest of the batch. */
void batch_subsets_at(mok_precision p) {
  mok_shape s = shape_at(p, 600, 256, 192, 128, 8, 2);
  harness full, fo, sub, so;
  const int64_t Ts = 171; /* tokens 3, 6, 9, ... of the full batch */
  if (harness_init(&full, &s, 600, 77, 0) && harness_init(&fo, &s, 600, 77, 0) &&
      harness_init(&sub, &s, Ts, 77, 0) && harness_init(&so, &s, Ts, 77, 0)) {
    const int64_t H = s.hidden, k = s.top_k;
    for (int64_t i = 0; i < Ts; i++) {
      int64_t t = 3 * (i + 1);
      memcpy(sub.L.x + i * H, full.L.x + t * H, (size_t)H * 2);
      memcpy(sub.L.dy + i * H, full.L.dy + t * H, (size_t)H * 2);
      memcpy(sub.L.topk_ids + i * k, full.L.topk_ids + t * k, (size_t)k * 4);
      memcpy(sub.L.topk_weights + i * k, full.L.topk_weights + t * k, (size_t)k * 4);
    }
    gpu_once(&full, &fo, NULL, MOK_GRAD_WRITE_BF16);
    gpu_once(&sub, &so, NULL, MOK_GRAD_WRITE_BF16);
    for (int64_t i = 0; i < Ts; i++) {
      int64_t t = 3 * (i + 1);
      char tag[64];
      snprintf(tag, sizeof tag, "D3 token %lld y", (long long)t);
      if (!same_bits(tag, so.y + i * H, fo.y + t * H, (size_t)H * 2)) break;
      snprintf(tag, sizeof tag, "D3 token %lld dx", (long long)t);
      if (!same_bits(tag, so.dx + i * H, fo.dx + t * H, (size_t)H * 2)) break;
      snprintf(tag, sizeof tag, "D3 token %lld d_topk_weights", (long long)t);
      if (!same_bits(tag, so.dtw + i * k, fo.dtw + t * k, (size_t)k * 4)) break;
    }
  }
  harness_fini(&full);
  harness_fini(&fo);
  harness_fini(&sub);
  harness_fini(&so);
}

/* Forward then backward of d, which must fail on the device with `want` (reported by mok_check
 * after each), leaving every output as poisoned (compared with `poison`, read back into `out`). */
static void failing_call_untouched(gpu_layer *d, harness *out, const harness *poison,
                                   mok_status want, const char *what) {
  gpu_poison(d, 0xa5);
  mok_forward_args f = gpu_forward_args(d);
  CHECK_OK(mok_forward(d->ws, &f, 0));
  mok_status st = mok_check(d->ws, 0);
  CHECK(st == want, "%s: forward: mok_check gave %s", what, mok_status_name(st));
  mok_backward_args b = gpu_backward_args(d, MOK_GRAD_WRITE_BF16);
  CHECK_OK(mok_backward(d->ws, &b, 0));
  st = mok_check(d->ws, 0);
  CHECK(st == want, "%s: backward after it: mok_check gave %s", what, mok_status_name(st));
  gpu_fetch(d, out);
  compare_bits("outputs untouched", out, poison, MOK_GRAD_WRITE_BF16);
  const mok_saved_layout S = mok_saved_layout_of(d->ws, d->T);
  same_bits("saved past its header untouched", (char *)out->saved + S.tag,
            (char *)poison->saved + S.tag, out->saved_bytes - S.tag);
  int32_t counts[64];
  memset(counts, 0xa5, sizeof counts);
  st = mok_schedule_counts(d->ws, d->saved, d->T, counts, 0);
  CHECK(st == want, "%s: schedule_counts on its saved: %s (%s)", what, mok_status_name(st),
        mok_last_error());
}

/* After a failed call, a good one on the same workspace (ids from h) runs normally. */
static void good_call_after(gpu_layer *d, const harness *h, harness *out, int64_t T, int k) {
  CUDA_CHECK(cudaMemcpy(d->ids, h->L.topk_ids, (size_t)(T * k) * 4, cudaMemcpyHostToDevice));
  CHECK_OK(gpu_run(d, MOK_GRAD_WRITE_BF16, 0));
  CHECK_OK(mok_check(d->ws, 0));
  gpu_fetch(d, out);
  CHECK(nan_count_bf16(out->y, T * h->L.shape.hidden) == 0, "the good call left y unwritten");
}

/* A bad expert id: the calls queue fine, mok_check reports it, every output is untouched; the
 * backward on that saved buffer is reported again; the next good call works. */
static void bad_expert_id(void) {
  mok_shape s = shape_of(200, 128, 128, 64, 8, 2);
  harness h, out, poison;
  if (harness_init(&h, &s, 200, 9, 0) && harness_init(&out, &s, 200, 9, 0) &&
      harness_init(&poison, &s, 200, 9, 0)) {
    harness_poison(&poison, 0xa5);
    const int32_t bad[2] = {8, -1};
    for (int v = 0; v < 2; v++) {
      h.L.topk_ids[17] = bad[v];
      gpu_layer d;
      if (gpu_init(&d, &h, 200, NULL)) {
        failing_call_untouched(&d, &out, &poison, MOK_ERR_EXPERT_ID, "a bad id");
        h.L.topk_ids[17] = 1;
        good_call_after(&d, &h, &out, 200, 2);
      }
      gpu_fini(&d);
    }
  }
  harness_fini(&h);
  harness_fini(&out);
  harness_fini(&poison);
}

/* Over the capacity (shape.routed_rows): the schedule raises MOK_ERR_CAPACITY, nothing past it
 * runs, the outputs stay as they were; the same workspace then runs a call that fits. */
static void capacity_overflow_untouched(void) {
  mok_shape s = shape_of(200, 128, 128, 64, 8, 2);
  s.routed_rows = 640;
  harness h, out, poison;
  if (harness_init(&h, &s, 200, 10, 0) && harness_init(&out, &s, 200, 10, 0) &&
      harness_init(&poison, &s, 200, 10, 0)) {
    harness_poison(&poison, 0xa5);
    /* Random routing spreads 400 rows over the 8 experts, at least 6 of them non-empty: 768 or
     * more rows with padding, against 640. */
    gpu_layer d;
    if (gpu_init(&d, &h, 200, NULL)) {
      failing_call_untouched(&d, &out, &poison, MOK_ERR_CAPACITY, "over capacity");
      /* Every token to experts 0 and 1: 2 x 200 rows, 512 with padding, fit. */
      for (int t = 0; t < 200; t++) h.L.topk_ids[2 * t] = 0, h.L.topk_ids[2 * t + 1] = 1;
      good_call_after(&d, &h, &out, 200, 2);
    }
    gpu_fini(&d);
  }
  harness_fini(&h);
  harness_fini(&out);
  harness_fini(&poison);
}

/* A backward whose saved was not filled for its tokens (a forward of 200 tokens, backward of
 * 120; a schedule alone) is queued, then mok_check reports MOK_ERR_INVALID_ARG and every output of
 * the backward is as poisoned; a good call on the same workspace then runs normally. Without the
 * check the first would read saved at the offsets of 120 tokens. */
static void saved_of_another_call(void) {
  mok_shape s = shape_of(200, 128, 128, 64, 8, 2);
  harness h, out, poison;
  if (harness_init(&h, &s, 200, 11, 0) && harness_init(&out, &s, 200, 11, 0) &&
      harness_init(&poison, &s, 200, 11, 0)) {
    harness_poison(&poison, 0xa5);
    gpu_layer d;
    if (gpu_init(&d, &h, 200, NULL)) {
      for (int op = 0; op < 2; op++) {
        const char *what = op == 0 ? "forward of 200, backward of 120" : "schedule alone";
        gpu_poison(&d, 0xa5);
        mok_forward_args f = gpu_forward_args(&d);
        CHECK_OK(op == 0 ? mok_forward(d.ws, &f, 0) : mok_schedule(d.ws, &f, 0));
        CHECK_OK(mok_check(d.ws, 0));
        mok_backward_args b = gpu_backward_args(&d, MOK_GRAD_WRITE_BF16);
        if (op == 0) b.tokens = 120;
        CHECK_OK(mok_backward(d.ws, &b, 0));
        mok_status st = mok_check(d.ws, 0);
        CHECK(st == MOK_ERR_INVALID_ARG && strstr(mok_last_error(), "saved"),
              "%s: mok_check gave %s (%s)", what, mok_status_name(st), mok_last_error());
        gpu_fetch(&d, &out);
        memcpy(poison.y, out.y, (size_t)200 * s.hidden * 2); /* y is the forward's */
        compare_bits(what, &out, &poison, MOK_GRAD_WRITE_BF16);
      }
      good_call_after(&d, &h, &out, 200, 2);
    }
    gpu_fini(&d);
  }
  harness_fini(&h);
  harness_fini(&out);
  harness_fini(&poison);
}

/* Backward given a foreign or corrupted saved: another layer's of the same shape (other
 * routing), a wider layer's, garbage, zeros, or its own with one schedule value changed. The
 * backward queues fine; its first kernel (saved_open) checks saved's header, then the routing and
 * schedule sums, and raises MOK_DEVERR_SAVED: mok_check reports MOK_ERR_INVALID_ARG and every
 * output of the backward is as poisoned. mok_schedule_counts refuses the foreign ones on the host.
 * The pristine saved then serves its backward, which matches a plain run's bits. */
static void foreign_or_corrupted_saved(void) {
  mok_shape s = shape_of(200, 128, 128, 64, 8, 2), wide = shape_of(200, 256, 128, 64, 8, 2);
  harness h, h2, hw, out, ref, poison;
  if (harness_init(&h, &s, 200, 12, 0) && harness_init(&h2, &s, 200, 13, 0) &&
      harness_init(&hw, &wide, 200, 14, 0) && harness_init(&out, &s, 200, 12, 0) &&
      harness_init(&ref, &s, 200, 12, 0) && harness_init(&poison, &s, 200, 12, 0)) {
    harness_poison(&poison, 0xa5);
    gpu_layer d, d2, dw;
    memset(&d2, 0, sizeof d2);
    memset(&dw, 0, sizeof dw);
    if (gpu_init(&d, &h, 200, NULL) && gpu_init(&d2, &h2, 200, NULL) &&
        gpu_init(&dw, &hw, 200, NULL)) {
      CHECK_OK(gpu_run(&d, MOK_GRAD_WRITE_BF16, 0));
      CHECK_OK(mok_check(d.ws, 0));
      gpu_fetch(&d, &ref);
      mok_forward_args f2 = gpu_forward_args(&d2), fw = gpu_forward_args(&dw);
      CHECK_OK(mok_forward(d2.ws, &f2, 0));
      CHECK_OK(mok_forward(dw.ws, &fw, 0));
      CHECK_OK(mok_check(d2.ws, 0));
      CHECK_OK(mok_check(dw.ws, 0));
      char *pristine = (char *)malloc(d.saved_bytes);
      if (pristine) {
        CUDA_CHECK(cudaMemcpy(pristine, d.saved, d.saved_bytes, cudaMemcpyDeviceToHost));
        const mok_saved_layout S = mok_saved_layout_of(d.ws, 200);
        const struct {
          const char *what;
          const void *saved; /* another buffer, or NULL: d's own, changed at `at` */
          size_t at;         /* SIZE_MAX: every byte set to fill */
          int32_t add;
          int fill;
        } cases[] = {
            {"another layer's saved (same shape)", d2.saved, 0, 0, 0},
            {"a wider layer's saved", dw.saved, 0, 0, 0},
            {"garbage", NULL, SIZE_MAX, 0, 0x5a},
            {"zeros", NULL, SIZE_MAX, 0, 0},
            {"counts[0] + 1", NULL, S.counts, 1, 0},
            {"offsets[1] + 128", NULL, S.offsets + 4, 128, 0},
            {"row_src[0] + 1", NULL, S.row_src, 1, 0},
            {"row_weight[5] + 1 ulp", NULL, S.row_weight + 20, 1, 0},
            {"slot_row[7] - 1", NULL, S.slot_row + 28, -1, 0},
            {"mblock_expert[0] + 1", NULL, S.mblock_expert, 1, 0},
            {"status ROUTING + 1", NULL, S.status + 4 * MOK_STATUS_ROUTING, 1, 0},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
          CUDA_CHECK(cudaMemcpy(d.saved, pristine, d.saved_bytes, cudaMemcpyHostToDevice));
          if (!cases[i].saved && cases[i].at == SIZE_MAX) {
            CUDA_CHECK(cudaMemset(d.saved, cases[i].fill, d.saved_bytes));
          } else if (!cases[i].saved) {
            int32_t v;
            memcpy(&v, pristine + cases[i].at, 4);
            v += cases[i].add;
            CUDA_CHECK(cudaMemcpy((char *)d.saved + cases[i].at, &v, 4, cudaMemcpyHostToDevice));
          }
          gpu_poison_backward(&d, 0xa5);
          mok_backward_args b = gpu_backward_args(&d, MOK_GRAD_WRITE_BF16);
          if (cases[i].saved) b.saved = cases[i].saved;
          CHECK_OK(mok_backward(d.ws, &b, 0));
          mok_status st = mok_check(d.ws, 0);
          CHECK(st == MOK_ERR_INVALID_ARG && strstr(mok_last_error(), "saved"),
                "%s: mok_check gave %s (%s)", cases[i].what, mok_status_name(st),
                mok_last_error());
          gpu_fetch(&d, &out);
          memcpy(poison.y, out.y, (size_t)200 * s.hidden * 2); /* y is the forward's */
          compare_bits(cases[i].what, &out, &poison, MOK_GRAD_WRITE_BF16);
          if (i < 4) {
            int32_t counts[8];
            st = mok_schedule_counts(d.ws, b.saved, 200, counts, 0);
            CHECK((i == 0) == (st == MOK_OK), "%s: schedule_counts gave %s", cases[i].what,
                  mok_status_name(st));
          }
        }
        CUDA_CHECK(cudaMemcpy(d.saved, pristine, d.saved_bytes, cudaMemcpyHostToDevice));
        gpu_poison_backward(&d, 0xa5);
        mok_backward_args b = gpu_backward_args(&d, MOK_GRAD_WRITE_BF16);
        CHECK_OK(mok_backward(d.ws, &b, 0));
        CHECK_OK(mok_check(d.ws, 0));
        gpu_fetch(&d, &out);
        compare_bits("the pristine saved's backward", &out, &ref, MOK_GRAD_WRITE_BF16);
        free(pristine);
      }
    }
    gpu_fini(&d);
    gpu_fini(&d2);
    gpu_fini(&dw);
  }
  harness_fini(&h);
  harness_fini(&h2);
  harness_fini(&hw);
  harness_fini(&out);
  harness_fini(&ref);
  harness_fini(&poison);
}

/* Host pointers are refused before any work is queued. */
static void host_pointer_refused(void) {
  mok_shape s = shape_of(64, 64, 64, 0, 2, 1);
  harness h;
  if (harness_init(&h, &s, 64, 3, 0)) {
    gpu_layer d;
    if (gpu_init(&d, &h, 64, NULL)) {
      mok_forward_args f = gpu_forward_args(&d);
      f.x = h.L.x;
      mok_status st = mok_forward(d.ws, &f, 0);
      CHECK(st == MOK_ERR_INVALID_ARG && strstr(mok_last_error(), "x"),
            "host x: %s (%s)", mok_status_name(st), mok_last_error());
    }
    gpu_fini(&d);
  }
  harness_fini(&h);
}

/* Recompute fills saved's activations (gu, hw, gus, hs) exactly as forward does; backward from
 * it gives the same dx and dw_gate. */
void recompute_matches_forward_at(mok_precision p) {
  mok_shape s = shape_at(p, 333, 256, 192, 64, 8, 3);
  harness h, a, b;
  if (harness_init(&h, &s, 333, 11, 0) && harness_init(&a, &s, 333, 11, 0) &&
      harness_init(&b, &s, 333, 11, 0)) {
    gpu_layer d;
    if (gpu_init(&d, &h, 333, NULL)) {
      gpu_poison(&d, 0xff);
      CHECK_OK(gpu_run(&d, MOK_GRAD_WRITE_BF16, 0));
      gpu_fetch(&d, &a);
      gpu_poison(&d, 0xff);
      mok_forward_args f = gpu_forward_args(&d);
      CHECK_OK(mok_recompute(d.ws, &f, 0));
      mok_backward_args bw = gpu_backward_args(&d, MOK_GRAD_WRITE_BF16);
      CHECK_OK(mok_backward(d.ws, &bw, 0));
      gpu_fetch(&d, &b);
      mok_saved_layout S = mok_saved_layout_of(d.ws, 333);
      same_bits("recompute gu", (char *)b.saved + S.gu, (char *)a.saved + S.gu, S.hw - S.gu);
      same_bits("recompute hw..hs", (char *)b.saved + S.hw, (char *)a.saved + S.hw,
                S.bytes - S.hw);
      same_bits("recompute dx", b.dx, a.dx, 333 * 256 * 2);
      same_bits("recompute dw_gate", b.g[G_GATE], a.g[G_GATE],
                (size_t)grad_bytes(&a, G_GATE, MOK_GRAD_WRITE_BF16));
    }
    gpu_fini(&d);
  }
  harness_fini(&h);
  harness_fini(&a);
  harness_fini(&b);
}

static void forward_on(mok_workspace *ws, const gpu_layer *d) {
  mok_forward_args f = gpu_forward_args(d);
  CHECK_OK(mok_forward(ws, &f, 0));
  CHECK_OK(mok_check(ws, 0));
}

static void backward_on(mok_workspace *ws, gpu_layer *d) {
  gpu_poison_backward(d, 0xff);
  mok_backward_args b = gpu_backward_args(d, MOK_GRAD_WRITE_BF16);
  CHECK_OK(mok_backward(ws, &b, 0));
  CHECK_OK(mok_check(ws, 0));
}

/* At ep = 1 without a shared expert the routed x rows outlive the forward, and its backward
 * copies only dy (rows.cu). Calls A and B (other inputs, weights and saved) on one workspace:
 * a backward right after its forward, against one after the other call's forward (x copied
 * again), then B's backward after that (its rows were replaced), twice (kept again); A's after
 * a forward of A's x with B's routing into B's saved (same x, another forward: copied); A's
 * with a saved that A's forward filled on another workspace. The same bits each time. */
static void x_rows_kept(void) {
  mok_shape s = shape_of(300, 128, 192, 0, 8, 2);
  harness ha, hb, ra, rb, got;
  if (harness_init(&ha, &s, 300, 21, 0) && harness_init(&hb, &s, 300, 22, 0) &&
      harness_init(&ra, &s, 300, 21, 0) && harness_init(&rb, &s, 300, 22, 0) &&
      harness_init(&got, &s, 300, 21, 0)) {
    gpu_layer a, b; /* b's buffers only: every call runs on a's workspace */
    memset(&b, 0, sizeof b);
    if (gpu_init(&a, &ha, 300, NULL) && gpu_init(&b, &hb, 300, NULL)) {
      forward_on(a.ws, &a), backward_on(a.ws, &a);
      gpu_fetch(&a, &ra);
      forward_on(a.ws, &b), backward_on(a.ws, &b);
      gpu_fetch(&b, &rb);
      forward_on(a.ws, &a), forward_on(a.ws, &b), backward_on(a.ws, &a);
      gpu_fetch(&a, &got);
      same_layer_bits("A's backward after B's forward", &got, &ra, G_COUNT);
      for (int i = 0; i < 2; i++) {
        backward_on(a.ws, &b);
        gpu_fetch(&b, &got);
        same_layer_bits(i ? "B's backward again" : "B's backward after A's", &got, &rb,
                        G_COUNT);
      }
      forward_on(a.ws, &a);
      mok_forward_args f = gpu_forward_args(&b);
      f.x = a.x; /* A's x, B's routing, weights and saved */
      CHECK_OK(mok_forward(a.ws, &f, 0));
      CHECK_OK(mok_check(a.ws, 0));
      backward_on(a.ws, &a);
      gpu_fetch(&a, &got);
      same_layer_bits("A's backward after a forward of A's x", &got, &ra, G_COUNT);
      forward_on(b.ws, &a); /* A's saved filled on b's workspace */
      backward_on(a.ws, &a);
      gpu_fetch(&a, &got);
      same_layer_bits("A's backward, its saved from another workspace", &got, &ra, G_COUNT);
    }
    gpu_fini(&a);
    gpu_fini(&b);
  }
  harness_fini(&ha);
  harness_fini(&hb);
  harness_fini(&ra);
  harness_fini(&rb);
  harness_fini(&got);
}

/* Forward + backward captured in a CUDA graph (global capture mode, as PyTorch does) and
 * replayed twice give the eager bits. */
void graph_replay_at(mok_precision p) {
  mok_shape s = shape_at(p, 400, 256, 256, 128, 16, 4);
  harness h, eager, replay;
  if (harness_init(&h, &s, 400, 21, 0) && harness_init(&eager, &s, 400, 21, 0) &&
      harness_init(&replay, &s, 400, 21, 0)) {
    gpu_layer d;
    if (gpu_init(&d, &h, 400, NULL)) {
      cudaStream_t st;
      CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      CHECK_OK(gpu_run(&d, MOK_GRAD_WRITE_BF16, st));
      CUDA_CHECK(cudaStreamSynchronize(st));
      gpu_fetch(&d, &eager);
      cudaGraph_t graph = NULL;
      cudaGraphExec_t exec = NULL;
      CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      CHECK_OK(gpu_run(&d, MOK_GRAD_WRITE_BF16, st));
      CUDA_CHECK(cudaStreamEndCapture(st, &graph));
      CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int r = 0; r < 2; r++) {
        gpu_poison(&d, 0xff);
        CUDA_CHECK(cudaGraphLaunch(exec, st));
        CUDA_CHECK(cudaStreamSynchronize(st));
        gpu_fetch(&d, &replay);
        compare_bits("graph replay", &replay, &eager, MOK_GRAD_WRITE_BF16);
      }
      if (exec) cudaGraphExecDestroy(exec);
      if (graph) cudaGraphDestroy(graph);
      cudaStreamDestroy(st);
    }
    gpu_fini(&d);
  }
  harness_fini(&h);
  harness_fini(&eager);
  harness_fini(&replay);
}

/* Kernel nodes of one call captured in a graph (memsets and copies are other node types). */
static int captured_kernels(gpu_layer *d, int backward) {
  cudaStream_t st;
  CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t graph = NULL;
  CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  mok_forward_args f = gpu_forward_args(d);
  mok_backward_args b = gpu_backward_args(d, MOK_GRAD_WRITE_BF16);
  CHECK_OK(backward ? mok_backward(d->ws, &b, st) : mok_forward(d->ws, &f, st));
  CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  size_t n = 0;
  int kernels = 0;
  if (graph && cudaGraphGetNodes(graph, NULL, &n) == cudaSuccess && n) {
    cudaGraphNode_t *nodes = calloc(n, sizeof *nodes);
    if (nodes && cudaGraphGetNodes(graph, nodes, &n) == cudaSuccess) {
      for (size_t i = 0; i < n; i++) {
        enum cudaGraphNodeType t;
        kernels +=
            cudaGraphNodeGetType(nodes[i], &t) == cudaSuccess && t == cudaGraphNodeTypeKernel;
      }
    }
    free(nodes);
  }
  if (graph) cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  return kernels;
}

/* The kernels per call that docs/kernels.md lists (ep = 1): forward, the schedule and the layer
 * launch (dispatch, the GEMMs and combine), shared expert or not; backward, saved_open, dispatch,
 * 4 GEMMs and as many again for a shared expert (the last of them also combining dx), and the
 * router gradient. Issue 5 aims at 2 per direction: this test says where main stands, and
 * changes with it. */
static void kernels_per_call(void) {
  for (int shared = 0; shared < 2; shared++) {
    mok_shape s = shape_of(200, 128, 128, shared ? 64 : 0, 8, 2);
    harness h;
    if (harness_init(&h, &s, 200, 31, 0)) {
      gpu_layer d;
      if (gpu_init(&d, &h, 200, NULL)) {
        CHECK_OK(gpu_run(&d, MOK_GRAD_WRITE_BF16, 0)); /* a saved for the backward's capture */
        CUDA_CHECK(cudaDeviceSynchronize());
        const int fwd = captured_kernels(&d, 0), bwd = captured_kernels(&d, 1);
        const int want_fwd = 2, want_bwd = shared ? 11 : 7; /* combine in the last wgrad */
        CHECK(fwd == want_fwd && bwd == want_bwd,
              "%s shared expert: %d kernels forward, %d backward; docs/kernels.md says %d, %d",
              shared ? "with a" : "no", fwd, bwd, want_fwd, want_bwd);
      }
      gpu_fini(&d);
    }
    harness_fini(&h);
  }
}

static void routing_edges(void) { routing_edges_at(MOK_BF16); }
static void repeat_and_knobs(void) { repeat_and_knobs_at(MOK_BF16); }
static void batch_subsets(void) { batch_subsets_at(MOK_BF16); }
static void recompute_matches_forward(void) { recompute_matches_forward_at(MOK_BF16); }
static void graph_replay(void) { graph_replay_at(MOK_BF16); }

const test_case tests_gpu_layer[] = {
    {"gpu/layer_vs_cpu_small_shapes", layer_vs_cpu},
    {"gpu/routing_edge_cases_vs_cpu", routing_edges},
    {"gpu/design_shapes_vs_ref64", design_shapes_vs_ref64},
    {"gpu/repeat_D1_and_knobs_D2", repeat_and_knobs},
    {"gpu/batch_subsets_D3", batch_subsets},
    {"gpu/bad_expert_id_untouched", bad_expert_id},
    {"gpu/capacity_overflow_untouched", capacity_overflow_untouched},
    {"gpu/saved_of_another_call_untouched", saved_of_another_call},
    {"gpu/foreign_or_corrupted_saved_untouched", foreign_or_corrupted_saved},
    {"gpu/host_pointer_refused", host_pointer_refused},
    {"gpu/recompute_matches_forward", recompute_matches_forward},
    {"gpu/x_rows_kept_for_their_backward", x_rows_kept},
    {"gpu/graph_capture_replay", graph_replay},
    {"gpu/kernels_per_call", kernels_per_call},
    {NULL, NULL},
};
