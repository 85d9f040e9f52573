/*
 * test_errors.c: every bad input of DESIGN.md §5 that the API checks, on forward, recompute,
 * schedule and backward: each returns its status with a message, and leaves every output (and
 * `saved`) exactly as poisoned before the call. Then the device-side error: an expert id out of
 * range fails the call with MOK_ERR_EXPERT_ID naming the token, slot and id, leaves the outputs
 * untouched, is reported (once) by mok_check, and makes backward refuse the `saved` it left.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "harness.h"
#include "internal.h"

#define POISON 0xC3

enum { OP_FORWARD, OP_RECOMPUTE, OP_SCHEDULE, OP_BACKWARD };

typedef struct call {
  mok_workspace *ws;
  mok_forward_args f;
  mok_backward_args b;
} call;

typedef struct bad_case {
  const char *name;
  int op;
  int no_shared; /* run on the layer without a shared expert */
  void (*mutate)(call *c);
  mok_status want;
} bad_case;

#define MUT(name, stmt) \
  static void name(call *c) { stmt; }
/* Misaligned: a tensor moved by one element, still element-aligned but not 16-byte aligned. */
#define SHIFT(p, by) ((void *)((char *)(p) + (by)))

MUT(no_ws, c->ws = NULL)
MUT(f_tokens0, c->f.tokens = 0)
MUT(f_tokens_big, c->f.tokens = 1000)
MUT(f_x_null, c->f.x = NULL)
MUT(f_x_mis, c->f.x = SHIFT(c->f.x, 2))
MUT(f_ids_null, c->f.topk_ids = NULL)
MUT(f_ids_mis, c->f.topk_ids = SHIFT(c->f.topk_ids, 4))
MUT(f_tw_null, c->f.topk_weights = NULL)
MUT(f_tw_mis, c->f.topk_weights = SHIFT(c->f.topk_weights, 4))
MUT(f_wg_null, c->f.w.w_gate = NULL)
MUT(f_wu_mis, c->f.w.w_up = SHIFT(c->f.w.w_up, 2))
MUT(f_wd_null, c->f.w.w_down = NULL)
MUT(f_sg_null, c->f.w.ws_gate = NULL)
MUT(f_su_mis, c->f.w.ws_up = SHIFT(c->f.w.ws_up, 2))
MUT(f_sd_null, c->f.w.ws_down = NULL)
MUT(f_sg_given, c->f.w.ws_gate = c->f.w.w_gate)
MUT(f_sd_given, c->f.w.ws_down = c->f.w.w_down)
MUT(f_y_null, c->f.y = NULL)
MUT(f_y_mis, c->f.y = SHIFT(c->f.y, 2))
MUT(f_saved_null, c->f.saved = NULL)
MUT(f_saved_mis, c->f.saved = SHIFT(c->f.saved, 16))
MUT(b_tokens0, c->b.tokens = 0)
MUT(b_tokens_neg, c->b.tokens = -5)
MUT(b_x_null, c->b.x = NULL)
MUT(b_ids_mis, c->b.topk_ids = SHIFT(c->b.topk_ids, 4))
MUT(b_tw_null, c->b.topk_weights = NULL)
MUT(b_wd_mis, c->b.w.w_down = SHIFT(c->b.w.w_down, 2))
MUT(b_su_null, c->b.w.ws_up = NULL)
MUT(b_su_given, c->b.w.ws_up = c->b.w.w_up)
MUT(b_saved_null, c->b.saved = NULL)
MUT(b_saved_mis, c->b.saved = SHIFT(c->b.saved, 128))
MUT(b_dy_null, c->b.dy = NULL)
MUT(b_dy_mis, c->b.dy = SHIFT(c->b.dy, 2))
MUT(b_dx_null, c->b.dx = NULL)
MUT(b_dx_mis, c->b.dx = SHIFT(c->b.dx, 2))
MUT(b_dtw_null, c->b.d_topk_weights = NULL)
MUT(b_dtw_mis, c->b.d_topk_weights = SHIFT(c->b.d_topk_weights, 4))
MUT(b_gg_null, c->b.g.dw_gate = NULL)
MUT(b_gu_mis, c->b.g.dw_up = SHIFT(c->b.g.dw_up, 2))
MUT(b_gd_null, c->b.g.dw_down = NULL)
MUT(b_sgg_null, c->b.g.dws_gate = NULL)
MUT(b_sgu_mis, c->b.g.dws_up = SHIFT(c->b.g.dws_up, 2))
MUT(b_sgd_null, c->b.g.dws_down = NULL)
MUT(b_sgg_given, c->b.g.dws_gate = c->b.g.dw_gate)
MUT(b_mode_bad, c->b.grad_mode = (mok_grad_mode)2)
MUT(b_mode_neg, c->b.grad_mode = (mok_grad_mode)-1)

#define INV MOK_ERR_INVALID_ARG
#define ALN MOK_ERR_ALIGNMENT
static const bad_case cases[] = {
    {"forward: ws NULL", OP_FORWARD, 0, no_ws, INV},
    {"forward: tokens 0", OP_FORWARD, 0, f_tokens0, INV},
    {"forward: tokens > max_tokens", OP_FORWARD, 0, f_tokens_big, INV},
    {"forward: x NULL", OP_FORWARD, 0, f_x_null, INV},
    {"forward: x misaligned", OP_FORWARD, 0, f_x_mis, ALN},
    {"forward: topk_ids NULL", OP_FORWARD, 0, f_ids_null, INV},
    {"forward: topk_ids misaligned", OP_FORWARD, 0, f_ids_mis, ALN},
    {"forward: topk_weights NULL", OP_FORWARD, 0, f_tw_null, INV},
    {"forward: topk_weights misaligned", OP_FORWARD, 0, f_tw_mis, ALN},
    {"forward: w_gate NULL", OP_FORWARD, 0, f_wg_null, INV},
    {"forward: w_up misaligned", OP_FORWARD, 0, f_wu_mis, ALN},
    {"forward: w_down NULL", OP_FORWARD, 0, f_wd_null, INV},
    {"forward: ws_gate NULL with a shared expert", OP_FORWARD, 0, f_sg_null, INV},
    {"forward: ws_up misaligned", OP_FORWARD, 0, f_su_mis, ALN},
    {"forward: ws_down NULL with a shared expert", OP_FORWARD, 0, f_sd_null, INV},
    {"forward: ws_gate given without a shared expert", OP_FORWARD, 1, f_sg_given, INV},
    {"forward: ws_down given without a shared expert", OP_FORWARD, 1, f_sd_given, INV},
    {"forward: y NULL", OP_FORWARD, 0, f_y_null, INV},
    {"forward: y misaligned", OP_FORWARD, 0, f_y_mis, ALN},
    {"forward: saved NULL", OP_FORWARD, 0, f_saved_null, INV},
    {"forward: saved not 256-byte aligned", OP_FORWARD, 0, f_saved_mis, ALN},
    {"recompute: ws NULL", OP_RECOMPUTE, 0, no_ws, INV},
    {"recompute: tokens > max_tokens", OP_RECOMPUTE, 0, f_tokens_big, INV},
    {"recompute: x misaligned", OP_RECOMPUTE, 0, f_x_mis, ALN},
    {"recompute: w_gate NULL", OP_RECOMPUTE, 0, f_wg_null, INV},
    {"recompute: ws_gate given without a shared expert", OP_RECOMPUTE, 1, f_sg_given, INV},
    {"recompute: saved NULL", OP_RECOMPUTE, 0, f_saved_null, INV},
    {"schedule: ws NULL", OP_SCHEDULE, 0, no_ws, INV},
    {"schedule: tokens 0", OP_SCHEDULE, 0, f_tokens0, INV},
    {"schedule: topk_ids NULL", OP_SCHEDULE, 0, f_ids_null, INV},
    {"schedule: topk_weights misaligned", OP_SCHEDULE, 0, f_tw_mis, ALN},
    {"schedule: saved not 256-byte aligned", OP_SCHEDULE, 0, f_saved_mis, ALN},
    {"backward: ws NULL", OP_BACKWARD, 0, no_ws, INV},
    {"backward: tokens 0", OP_BACKWARD, 0, b_tokens0, INV},
    {"backward: tokens negative", OP_BACKWARD, 0, b_tokens_neg, INV},
    {"backward: x NULL", OP_BACKWARD, 0, b_x_null, INV},
    {"backward: topk_ids misaligned", OP_BACKWARD, 0, b_ids_mis, ALN},
    {"backward: topk_weights NULL", OP_BACKWARD, 0, b_tw_null, INV},
    {"backward: w_down misaligned", OP_BACKWARD, 0, b_wd_mis, ALN},
    {"backward: ws_up NULL with a shared expert", OP_BACKWARD, 0, b_su_null, INV},
    {"backward: ws_up given without a shared expert", OP_BACKWARD, 1, b_su_given, INV},
    {"backward: saved NULL", OP_BACKWARD, 0, b_saved_null, INV},
    {"backward: saved not 256-byte aligned", OP_BACKWARD, 0, b_saved_mis, ALN},
    {"backward: dy NULL", OP_BACKWARD, 0, b_dy_null, INV},
    {"backward: dy misaligned", OP_BACKWARD, 0, b_dy_mis, ALN},
    {"backward: dx NULL", OP_BACKWARD, 0, b_dx_null, INV},
    {"backward: dx misaligned", OP_BACKWARD, 0, b_dx_mis, ALN},
    {"backward: d_topk_weights NULL", OP_BACKWARD, 0, b_dtw_null, INV},
    {"backward: d_topk_weights misaligned", OP_BACKWARD, 0, b_dtw_mis, ALN},
    {"backward: dw_gate NULL", OP_BACKWARD, 0, b_gg_null, INV},
    {"backward: dw_up misaligned", OP_BACKWARD, 0, b_gu_mis, ALN},
    {"backward: dw_down NULL", OP_BACKWARD, 0, b_gd_null, INV},
    {"backward: dws_gate NULL with a shared expert", OP_BACKWARD, 0, b_sgg_null, INV},
    {"backward: dws_up misaligned", OP_BACKWARD, 0, b_sgu_mis, ALN},
    {"backward: dws_down NULL with a shared expert", OP_BACKWARD, 0, b_sgd_null, INV},
    {"backward: dws_gate given without a shared expert", OP_BACKWARD, 1, b_sgg_given, INV},
    {"backward: grad_mode 2", OP_BACKWARD, 0, b_mode_bad, INV},
    {"backward: grad_mode -1", OP_BACKWARD, 0, b_mode_neg, INV},
};

/* True when all n bytes of p are `pattern`. */
static int all_bytes(const void *p, size_t n, unsigned char pattern) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != pattern) return 0;
  return 1;
}

/* Names the first output that is not all `pattern`, or returns NULL. */
static const char *touched_output(const harness *h, unsigned char pattern, int with_saved) {
  const int64_t TH = h->T * h->L.shape.hidden, Tk = h->T * h->L.shape.top_k;
  if (!all_bytes(h->y, (size_t)TH * 2, pattern)) return "y";
  if (!all_bytes(h->dx, (size_t)TH * 2, pattern)) return "dx";
  if (!all_bytes(h->dtw, (size_t)Tk * 4, pattern)) return "d_topk_weights";
  static const char *names[G_COUNT] = {"dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up",
                                       "dws_down"};
  for (int g = 0; g < G_COUNT; g++)
    if (h->g[g] && !all_bytes(h->g[g], (size_t)h->g_len[g] * 4, pattern)) return names[g];
  if (with_saved && !all_bytes(h->saved, h->saved_bytes, pattern)) return "saved";
  return NULL;
}

static mok_status run_op(int op, call *c) {
  switch (op) {
    case OP_FORWARD: return mok_forward(c->ws, &c->f, NULL);
    case OP_RECOMPUTE: return mok_recompute(c->ws, &c->f, NULL);
    case OP_SCHEDULE: return mok_schedule(c->ws, &c->f, NULL);
    default: return mok_backward(c->ws, &c->b, NULL);
  }
}

static void bad_arguments(void) {
  const mok_shape with = {16, 32, 16, 8, 4, 2, MOK_BF16, 0};
  const mok_shape without = {16, 32, 16, 0, 4, 2, MOK_BF16, 0};
  harness hs[2];
  int ok0 = harness_init(&hs[0], &with, 16, 31, 0), ok1 = harness_init(&hs[1], &without, 16, 32, 0);
  if (ok0 && ok1) {
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
      const bad_case *bc = &cases[i];
      harness *h = &hs[bc->no_shared];
      call c = {h->ws, harness_forward_args(h), harness_backward_args(h, MOK_GRAD_WRITE_BF16)};
      bc->mutate(&c);
      harness_poison(h, POISON);
      mok_clear_error();
      mok_status st = run_op(bc->op, &c);
      CHECK(st == bc->want, "%s: got %s (%s), expected %s", bc->name, mok_status_name(st),
            mok_last_error(), mok_status_name(bc->want));
      CHECK(mok_last_error()[0] != '\0', "%s: no message", bc->name);
      const char *t = touched_output(h, POISON, 1);
      CHECK(t == NULL, "%s: %s was written", bc->name, t);
    }
    /* No argument struct at all. */
    for (int op = OP_FORWARD; op <= OP_BACKWARD; op++) {
      harness *h = &hs[0];
      harness_poison(h, POISON);
      mok_clear_error();
      mok_status st = op == OP_FORWARD     ? mok_forward(h->ws, NULL, NULL)
                      : op == OP_RECOMPUTE ? mok_recompute(h->ws, NULL, NULL)
                      : op == OP_SCHEDULE  ? mok_schedule(h->ws, NULL, NULL)
                                           : mok_backward(h->ws, NULL, NULL);
      const char *want = op == OP_BACKWARD ? "args is NULL; expected a mok_backward_args"
                                           : "args is NULL; expected a mok_forward_args";
      CHECK(st == INV && strstr(mok_last_error(), want), "op %d with args NULL: %s (%s)", op,
            mok_status_name(st), mok_last_error());
      const char *t = touched_output(h, POISON, 1);
      CHECK(t == NULL, "op %d with args NULL: %s was written", op, t);
    }
    /* recompute takes y = NULL: it computes no y */
    harness *h = &hs[0];
    mok_forward_args f = harness_forward_args(h);
    f.y = NULL;
    CHECK_OK(mok_recompute(h->ws, &f, NULL));
    CHECK_OK(mok_check(h->ws, NULL));
  }
  harness_fini(&hs[0]);
  harness_fini(&hs[1]);
}

/* The call's status word in saved. */
static int32_t status_word(const harness *h) {
  mok_saved_layout L = mok_saved_layout_of(h->ws, h->T);
  return *(const int32_t *)((const char *)h->saved + L.status);
}

/* An id of E, then -1, at token 3, slot 1: every op that reads topk_ids fails and writes only
 * the status word; mok_check reports it once. */
static void bad_expert_id(void) {
  const mok_shape s = {16, 32, 16, 8, 4, 2, MOK_BF16, 0};
  const int32_t bad_ids[2] = {4, -1};
  harness h;
  if (harness_init(&h, &s, 16, 41, 0)) {
    for (int b = 0; b < 2; b++) {
      h.L.topk_ids[3 * 2 + 1] = bad_ids[b];
      for (int op = OP_FORWARD; op <= OP_SCHEDULE; op++) {
        call c = {h.ws, harness_forward_args(&h), harness_backward_args(&h, MOK_GRAD_WRITE_BF16)};
        harness_poison(&h, POISON);
        mok_status st = run_op(op, &c);
        CHECK(st == MOK_ERR_EXPERT_ID, "op %d id %d: got %s", op, bad_ids[b], mok_status_name(st));
        char want[64];
        snprintf(want, sizeof want, "token 3, slot 1) is %d", bad_ids[b]);
        CHECK(strstr(mok_last_error(), want) != NULL, "message '%s' does not name '%s'",
              mok_last_error(), want);
        CHECK((bad_ids[b] < 0) == (strstr(mok_last_error(), "padding slots") != NULL),
              "message '%s' (id %d) and padding slots", mok_last_error(), bad_ids[b]);
        const char *t = touched_output(&h, POISON, 0);
        CHECK(t == NULL, "op %d: %s was written", op, t);
        CHECK(status_word(&h) == MOK_DEVERR_EXPERT_ID,
              "op %d: status word %d, expected MOK_DEVERR_EXPERT_ID", op, status_word(&h));
        st = mok_check(h.ws, NULL);
        CHECK(st == MOK_ERR_EXPERT_ID, "op %d: mok_check gave %s", op, mok_status_name(st));
        CHECK_OK(mok_check(h.ws, NULL)); /* reported once, then cleared */
      }
      /* Backward on the failed forward's saved refuses, in both grad modes. */
      for (int mode = 0; mode < 2; mode++) {
        call c = {h.ws, harness_forward_args(&h), harness_backward_args(&h, (mok_grad_mode)mode)};
        harness_poison(&h, POISON);
        CHECK(mok_forward(h.ws, &c.f, NULL) == MOK_ERR_EXPERT_ID, "forward did not fail");
        CHECK(mok_check(h.ws, NULL) == MOK_ERR_EXPERT_ID, "check after forward");
        mok_status st = mok_backward(h.ws, &c.b, NULL);
        CHECK(st == MOK_ERR_EXPERT_ID, "backward on a failed saved: got %s",
              mok_status_name(st));
        const char *t = touched_output(&h, POISON, 0);
        CHECK(t == NULL, "backward (mode %d) wrote %s", mode, t);
        CHECK(mok_check(h.ws, NULL) == MOK_ERR_EXPERT_ID, "check after backward");
      }
    }
    /* A capacity error left in saved is refused by backward the same way. */
    h.L.topk_ids[3 * 2 + 1] = 0;
    CHECK_OK(harness_run(&h, MOK_GRAD_WRITE_BF16));
    mok_saved_layout L = mok_saved_layout_of(h.ws, h.T);
    *(int32_t *)((char *)h.saved + L.status) = 2; /* MOK_DEVERR_CAPACITY */
    call c = {h.ws, harness_forward_args(&h), harness_backward_args(&h, MOK_GRAD_WRITE_BF16)};
    memset(h.dx, POISON, (size_t)(h.T * s.hidden) * 2);
    CHECK(mok_backward(h.ws, &c.b, NULL) == MOK_ERR_CAPACITY, "capacity status not refused");
    CHECK(all_bytes(h.dx, (size_t)(h.T * s.hidden) * 2, POISON), "dx written");
    CHECK(mok_check(h.ws, NULL) == MOK_ERR_CAPACITY, "check after capacity refusal");
    /* Good ids again: all is well, and nothing sticky is left. */
    CHECK_OK(harness_run(&h, MOK_GRAD_WRITE_BF16));
    CHECK_OK(mok_check(h.ws, NULL));
  }
  harness_fini(&h);
}

/* Every output but saved to POISON; saved keeps what the last call left in it. */
static void poison_outputs(harness *h) {
  void *keep = malloc(h->saved_bytes);
  CHECK(keep != NULL, "malloc");
  if (!keep) return;
  memcpy(keep, h->saved, h->saved_bytes);
  harness_poison(h, POISON);
  memcpy(h->saved, keep, h->saved_bytes);
  free(keep);
}

/* Backward reads saved at offsets that depend on its tokens: a saved filled by a call of other
 * tokens (or by mok_schedule alone, without the activations) is refused with MOK_ERR_INVALID_ARG,
 * every output untouched, instead of reading the wrong rows, or past the end of a smaller saved. */
static void saved_of_another_call(void) {
  const mok_shape s = {16, 32, 16, 8, 4, 2, MOK_BF16, 0};
  harness h;
  if (harness_init(&h, &s, 16, 43, 0)) {
    const struct {
      int op;
      int64_t fill_tokens, backward_tokens;
      mok_status want;
      const char *word;
    } cases[] = {
        {OP_FORWARD, 8, 16, MOK_ERR_INVALID_ARG, "filled by a call of 8 tokens"},
        {OP_FORWARD, 16, 8, MOK_ERR_INVALID_ARG, "filled by a call of 16 tokens"},
        {OP_RECOMPUTE, 16, 1, MOK_ERR_INVALID_ARG, "filled by a call of 16 tokens"},
        {OP_SCHEDULE, 16, 16, MOK_ERR_INVALID_ARG, "only a schedule"},
        {OP_SCHEDULE, 8, 16, MOK_ERR_INVALID_ARG, "filled by a call of 8 tokens"},
        {OP_FORWARD, 8, 8, MOK_OK, ""},
        {OP_RECOMPUTE, 16, 16, MOK_OK, ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
      call c = {h.ws, harness_forward_args(&h), harness_backward_args(&h, MOK_GRAD_WRITE_BF16)};
      c.f.tokens = cases[i].fill_tokens;
      c.b.tokens = cases[i].backward_tokens;
      harness_poison(&h, POISON);
      CHECK_OK(run_op(cases[i].op, &c));
      poison_outputs(&h);
      mok_status st = mok_backward(h.ws, &c.b, NULL);
      CHECK(st == cases[i].want, "case %zu: op %d of %lld tokens, backward of %lld: %s (%s)", i,
            cases[i].op, (long long)cases[i].fill_tokens, (long long)cases[i].backward_tokens,
            mok_status_name(st), mok_last_error());
      if (cases[i].want == MOK_OK) continue;
      CHECK(strstr(mok_last_error(), cases[i].word) != NULL, "case %zu: '%s' does not say '%s'",
            i, mok_last_error(), cases[i].word);
      const char *t = touched_output(&h, POISON, 0);
      CHECK(t == NULL, "case %zu: %s was written", i, t);
      CHECK_OK(mok_check(h.ws, NULL)); /* a refused argument, not a device-side error */
    }
  }
  harness_fini(&h);
}

/* ---- foreign and corrupted saved ----------------------------------------------------------- */
/* A saved buffer of another workspace or layer, garbage, or a saved overwritten since its
 * forward: backward and mok_schedule_counts refuse it with MOK_ERR_INVALID_ARG, reading nothing
 * past its header that the header does not vouch for, and leave every output and saved itself
 * as they were. */

typedef struct mutation {
  const char *name;
  size_t at;        /* byte offset in saved (from mok_saved_layout_of); SIZE_MAX: every byte */
  int32_t value;    /* the int32 written there; at SIZE_MAX, 0: zeros, else xorshift garbage */
  int add;          /* add value to the int32 there instead */
  const char *word; /* what the message must say */
} mutation;

static void corrupt(void *saved, size_t bytes, const mutation *m) {
  unsigned char *b = saved;
  uint64_t z = 0x9e3779b97f4a7c15ull;
  int32_t v;
  if (m->at != SIZE_MAX) {
    memcpy(&v, b + m->at, sizeof v);
    v = m->add ? v + m->value : m->value;
    memcpy(b + m->at, &v, sizeof v);
    return;
  }
  for (size_t i = 0; i < bytes; i++) {
    z ^= z << 13, z ^= z >> 7, z ^= z << 17;
    b[i] = m->value ? (unsigned char)z : 0;
  }
}

static void foreign_or_corrupted_saved(void) {
  const mok_shape s = {16, 32, 16, 8, 4, 2, MOK_BF16, 0};
  const mok_shape wider = {16, 64, 16, 8, 4, 2, MOK_BF16, 0};
  harness a, b, c;
  const int ok = harness_init(&a, &s, 16, 51, 0) && harness_init(&b, &s, 16, 52, 0) &&
                 harness_init(&c, &wider, 16, 53, 0);
  void *pristine = ok ? malloc(a.saved_bytes) : NULL, *mutated = ok ? malloc(a.saved_bytes) : NULL;
  if (ok && pristine && mutated) {
    mok_forward_args fa = harness_forward_args(&a), fb = harness_forward_args(&b),
                     fc = harness_forward_args(&c);
    CHECK_OK(mok_forward(a.ws, &fa, NULL));
    CHECK_OK(mok_forward(b.ws, &fb, NULL));
    CHECK_OK(mok_forward(c.ws, &fc, NULL));
    memcpy(pristine, a.saved, a.saved_bytes);
    const mok_saved_layout L = mok_saved_layout_of(a.ws, a.T);
    const mutation ms[] = {
        {"garbage", SIZE_MAX, 1, 0, "not filled by a call on this workspace"},
        {"zeros", SIZE_MAX, 0, 0, "not filled by a call on this workspace"},
        {"counts[0] + 1", L.counts, 1, 1, "overwritten"},
        {"offsets[1] huge", L.offsets + 4, 1 << 30, 0, "overwritten"},
        {"row_src[0] huge", L.row_src, 1 << 30, 0, "overwritten"},
        {"row_weight[0] + 1 ulp", L.row_weight, 1, 1, "overwritten"},
        {"slot_row[3] negative", L.slot_row + 12, -7, 0, "overwritten"},
        {"mblock_expert[0]", L.mblock_expert, 99, 0, "overwritten"},
    };
    for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
      memcpy(a.saved, pristine, a.saved_bytes);
      corrupt(a.saved, a.saved_bytes, &ms[i]);
      memcpy(mutated, a.saved, a.saved_bytes);
      poison_outputs(&a);
      mok_backward_args bw = harness_backward_args(&a, MOK_GRAD_WRITE_BF16);
      mok_status st = mok_backward(a.ws, &bw, NULL);
      CHECK(st == MOK_ERR_INVALID_ARG && strstr(mok_last_error(), ms[i].word),
            "backward on a saved with %s: %s (%s), expected MOK_ERR_INVALID_ARG saying '%s'",
            ms[i].name, mok_status_name(st), mok_last_error(), ms[i].word);
      const char *t = touched_output(&a, POISON, 0);
      CHECK(t == NULL, "backward on a saved with %s wrote %s", ms[i].name, t);
      CHECK(memcmp(a.saved, mutated, a.saved_bytes) == 0, "backward on %s wrote saved",
            ms[i].name);
    }
    /* Saved of another layer of the same shape (other inputs), and of a wider layer. */
    const struct {
      const harness *from;
      const char *word;
    } others[] = {{&b, "other topk_ids"}, {&c, "not filled by a call on this workspace"}};
    for (int i = 0; i < 2; i++) {
      memcpy(a.saved, pristine, a.saved_bytes);
      poison_outputs(&a);
      mok_backward_args bw = harness_backward_args(&a, MOK_GRAD_WRITE_BF16);
      bw.saved = others[i].from->saved;
      mok_status st = mok_backward(a.ws, &bw, NULL);
      CHECK(st == MOK_ERR_INVALID_ARG && strstr(mok_last_error(), others[i].word),
            "backward on another layer's saved (%d): %s (%s)", i, mok_status_name(st),
            mok_last_error());
      const char *t = touched_output(&a, POISON, 0);
      CHECK(t == NULL, "backward on another layer's saved (%d) wrote %s", i, t);
      int32_t counts[4];
      memset(counts, POISON, sizeof counts);
      st = mok_schedule_counts(a.ws, others[i].from->saved, a.T, counts, NULL);
      CHECK(i == 0 ? st == MOK_OK : st == MOK_ERR_INVALID_ARG,
            "schedule_counts on another layer's saved (%d): %s", i, mok_status_name(st));
      if (i == 1) CHECK(all_bytes(counts, sizeof counts, POISON), "counts written");
    }
    /* Garbage to mok_schedule_counts. */
    memset(a.saved, POISON, a.saved_bytes);
    int32_t counts[4];
    memset(counts, POISON, sizeof counts);
    mok_status st = mok_schedule_counts(a.ws, a.saved, a.T, counts, NULL);
    CHECK(st == MOK_ERR_INVALID_ARG, "schedule_counts on garbage: %s", mok_status_name(st));
    CHECK(all_bytes(counts, sizeof counts, POISON), "schedule_counts on garbage wrote counts");
    /* The pristine saved still serves its backward. */
    memcpy(a.saved, pristine, a.saved_bytes);
    mok_backward_args bw = harness_backward_args(&a, MOK_GRAD_WRITE_BF16);
    CHECK_OK(mok_backward(a.ws, &bw, NULL));
  }
  free(pristine);
  free(mutated);
  harness_fini(&a);
  harness_fini(&b);
  harness_fini(&c);
}

/* A tensor placed inside saved would be written over saved (y, dx, ...) or by it (x): refused
 * before anything is written. */
static void tensors_inside_saved(void) {
  const mok_shape s = {16, 32, 16, 8, 4, 2, MOK_BF16, 0};
  harness h;
  if (harness_init(&h, &s, 16, 54, 0)) {
    const mok_saved_layout L = mok_saved_layout_of(h.ws, h.T);
    char *in = (char *)h.saved + L.gu;
    for (int op = OP_FORWARD; op <= OP_BACKWARD; op++) {
      call c = {h.ws, harness_forward_args(&h), harness_backward_args(&h, MOK_GRAD_WRITE_BF16)};
      if (op == OP_FORWARD) c.f.y = in;
      if (op == OP_RECOMPUTE) c.f.x = in;
      if (op == OP_SCHEDULE) c.f.topk_weights = (const float *)((char *)h.saved + L.tag);
      if (op == OP_BACKWARD) {
        mok_forward_args f = harness_forward_args(&h);
        CHECK_OK(mok_forward(h.ws, &f, NULL));
        c.b.dx = in;
      }
      if (op == OP_BACKWARD) poison_outputs(&h);
      else harness_poison(&h, POISON);
      void *keep = malloc(h.saved_bytes);
      if (!keep) break;
      memcpy(keep, h.saved, h.saved_bytes);
      mok_status st = run_op(op, &c);
      CHECK(st == MOK_ERR_INVALID_ARG && strstr(mok_last_error(), "overlaps saved"),
            "op %d with a tensor inside saved: %s (%s)", op, mok_status_name(st),
            mok_last_error());
      CHECK(memcmp(keep, h.saved, h.saved_bytes) == 0, "op %d wrote saved", op);
      const char *t = touched_output(&h, POISON, 0);
      CHECK(t == NULL, "op %d with a tensor inside saved wrote %s", op, t);
      free(keep);
    }
  }
  harness_fini(&h);
}

/* A call that fails (a bad id, over the capacity) writes its header and nothing else of saved;
 * mok_schedule_counts then refuses that saved with the call's error. */
static void failed_call_writes_only_the_header(void) {
  const mok_shape s = {16, 32, 16, 8, 4, 2, MOK_BF16, 128}; /* one expert's tile of rows */
  harness h;
  if (harness_init(&h, &s, 16, 55, 0)) {
    const mok_saved_layout L = mok_saved_layout_of(h.ws, h.T);
    for (int bad_id = 0; bad_id < 2; bad_id++) {
      for (int q = 0; q < 32; q++) h.L.topk_ids[q] = q % 4; /* four experts: 512 rows > 128 */
      if (bad_id) h.L.topk_ids[5] = 9;
      const mok_status want = bad_id ? MOK_ERR_EXPERT_ID : MOK_ERR_CAPACITY;
      for (int op = OP_FORWARD; op <= OP_SCHEDULE; op++) {
        call c = {h.ws, harness_forward_args(&h), harness_backward_args(&h, MOK_GRAD_WRITE_BF16)};
        harness_poison(&h, POISON);
        mok_status st = run_op(op, &c);
        CHECK(st == want, "op %d: %s, expected %s", op, mok_status_name(st),
              mok_status_name(want));
        CHECK(all_bytes((char *)h.saved + L.tag, h.saved_bytes - L.tag, POISON),
              "op %d failing with %s wrote saved past its header", op, mok_status_name(want));
        int32_t counts[4];
        memset(counts, POISON, sizeof counts);
        st = mok_schedule_counts(h.ws, h.saved, h.T, counts, NULL);
        CHECK(st == want, "schedule_counts on the saved of a call that failed with %s: %s (%s)",
              mok_status_name(want), mok_status_name(st), mok_last_error());
        CHECK(all_bytes(counts, sizeof counts, POISON), "schedule_counts wrote counts");
        (void)mok_check(h.ws, NULL);
      }
    }
  }
  harness_fini(&h);
}

const test_case tests_errors[] = {
    {"cpu/errors_bad_arguments", bad_arguments},
    {"cpu/errors_bad_expert_id", bad_expert_id},
    {"cpu/errors_saved_of_another_call", saved_of_another_call},
    {"cpu/errors_foreign_or_corrupted_saved", foreign_or_corrupted_saved},
    {"cpu/errors_tensors_inside_saved", tensors_inside_saved},
    {"cpu/errors_failed_call_writes_only_the_header", failed_call_writes_only_the_header},
    {NULL, NULL}};
