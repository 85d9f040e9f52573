/*
 * fuzz_api.c: a libFuzzer target for the C API on the CPU backend (make fuzz), and the same code
 * behind tests/fuzz/replay.c, which make test runs over the corpus in tests/fuzz/corpus.
 *
 * The input's bytes choose a small layer shape (BF16 or FP8) and up to 12 calls: forward, recompute, schedule,
 * backward, check, schedule_counts, saved_bytes, with tokens in or out of range, expert ids and
 * router weights of any value, NULL, misaligned or saved-overlapping tensors, any grad_mode, and
 * saved buffers that are stale (another call's), of another size, or overwritten anywhere. What
 * it holds to is mok.h's contract, within the caller's part of it (every buffer as large as its
 * own call documents; a backward's saved may be any buffer a call filled, or garbage, of any
 * size from 256 bytes): no crash and no sanitizer report; every status a MOK_* value; a message
 * after each failure and none after a success; and every output of a failed call, and saved but
 * for its header, as they were. A broken promise aborts with what broke.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h" /* mok_saved_layout_of: where to overwrite saved */
#include "mok_gen.h"

#define POISON 0xa5
#define SLOTS 3 /* saved buffers */

typedef struct input {
  const uint8_t *p;
  size_t n;
} input;

static unsigned take(input *in) {
  if (!in->n) return 0;
  in->n--;
  return *in->p++;
}

static uint32_t take32(input *in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v = v << 8 | take(in);
  return v;
}

static void broke(const char *what, int op, mok_status st) {
  fprintf(stderr, "fuzz_api: %s (op %d, %s: %s)\n", what, op, mok_status_name(st),
          mok_last_error());
  abort();
}

static void *alloc(size_t bytes) {
  void *p = aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (!p) abort();
  return p;
}

typedef struct state {
  mok_shape s;
  mok_workspace *ws;
  mok_host_layer L;
  int64_t T; /* max_tokens: the host layer's tokens */
  void *y, *dx, *dtw, *g[6];
  int64_t g_bytes[6]; /* fp32 sizes: room for either grad mode */
  void *saved[SLOTS];
  size_t saved_bytes[SLOTS];
  int64_t saved_tokens[SLOTS]; /* the tokens each is sized for */
} state;

/* Every output to POISON (saved keeps what calls left in it). */
static void poison(state *z) {
  const int64_t TH = z->T * z->s.hidden;
  memset(z->y, POISON, (size_t)TH * 2);
  memset(z->dx, POISON, (size_t)TH * 2);
  memset(z->dtw, POISON, (size_t)(z->T * z->s.top_k) * 4);
  for (int i = 0; i < 6; i++)
    if (z->g[i]) memset(z->g[i], POISON, (size_t)z->g_bytes[i]);
}

static int untouched(const void *p, size_t n) {
  const unsigned char *c = p;
  for (size_t i = 0; i < n; i++)
    if (c[i] != POISON) return 0;
  return 1;
}

static int outputs_untouched(const state *z) {
  const int64_t TH = z->T * z->s.hidden;
  int ok = untouched(z->y, (size_t)TH * 2) && untouched(z->dx, (size_t)TH * 2) &&
           untouched(z->dtw, (size_t)(z->T * z->s.top_k) * 4);
  for (int i = 0; i < 6; i++) ok = ok && (!z->g[i] || untouched(z->g[i], (size_t)z->g_bytes[i]));
  return ok;
}

/* Tokens for a call: mostly 1..T, sometimes out of range. */
static int64_t tokens_of(input *in, int64_t T) {
  const unsigned c = take(in);
  if (c < 224) return 1 + c % T;
  const int64_t odd[] = {0, -1, T + 1, (int64_t)1 << 40, INT64_MIN};
  return odd[c % 5];
}

/* Slot `k`'s buffer made exactly what a call of t tokens needs (its old contents dropped). */
static void size_slot(state *z, int k, int64_t t) {
  const size_t n = mok_saved_bytes(z->ws, t);
  if (!n || n == z->saved_bytes[k]) return;
  free(z->saved[k]);
  z->saved[k] = alloc(n);
  memset(z->saved[k], POISON, n);
  z->saved_bytes[k] = n;
  z->saved_tokens[k] = t;
}

static void run_input(input *in) {
  state z;
  memset(&z, 0, sizeof z);
  const unsigned a = take(in), b = take(in), c = take(in), d = take(in);
  z.T = 1 + take(in) % 40;
  z.s = (mok_shape)MOK_SHAPE_INIT;
  z.s.max_tokens = z.T;
  z.s.hidden = 16 * (1 + a % 6);
  z.s.inter = 16 * (1 + b % 4);
  z.s.shared_inter = c % 3 ? 0 : 16 * (1 + c % 4);
  z.s.experts = 1 + d % 12;
  z.s.top_k = 1 + (d >> 4) % (z.s.experts < 4 ? z.s.experts : 4);
  z.s.routed_rows = (a >> 4) % 4 == 0 ? 128 * (b >> 6) : 0;
  z.s.precision = (b >> 4) & 1 ? MOK_FP8 : MOK_BF16;
  mok_context_config cfg = MOK_CONTEXT_CONFIG_INIT;
  cfg.threads = 1 + (c >> 6) % 2;
  mok_context *ctx = NULL;
  if (mok_context_create(&cfg, &ctx) != MOK_OK) broke("context", -1, MOK_ERR_INTERNAL);
  mok_status st = mok_workspace_create(ctx, &z.s, &z.ws);
  if (st != MOK_OK) broke("a valid shape refused", -1, st);
  if (mok_host_layer_create(&z.s, z.T, take32(in), &z.L) != MOK_OK) abort();
  const int64_t H = z.s.hidden, I = z.s.inter, Is = z.s.shared_inter, E = z.s.experts;
  const int64_t k = z.s.top_k;
  mok_weights w = mok_host_layer_weights(&z.L);
  void *fp8 = NULL; /* MOK_FP8: the weights' FP8 buffer, which the calls then read instead */
  if (z.s.precision == MOK_FP8) {
    fp8 = alloc(mok_fp8_weights_bytes(z.ws));
    st = mok_quantize_weights(z.ws, &w, fp8, NULL);
    if (st != MOK_OK) broke("mok_quantize_weights", -1, st);
    w.fp8 = fp8;
  }
  z.y = alloc((size_t)(z.T * H) * 2);
  z.dx = alloc((size_t)(z.T * H) * 2);
  z.dtw = alloc((size_t)(z.T * k) * 4);
  const int64_t g_len[6] = {E * I * H, E * I * H, E * H * I, Is * H, Is * H, H * Is};
  for (int i = 0; i < 6; i++)
    if (g_len[i]) z.g_bytes[i] = g_len[i] * 4, z.g[i] = alloc((size_t)z.g_bytes[i]);
  for (int i = 0; i < SLOTS; i++) size_slot(&z, i, 1 + (int64_t)i * (z.T - 1) / 2);

  for (int op = 0; op < 12 && in->n; op++) {
    const unsigned kind = take(in) % 9, slot = take(in) % SLOTS, flags = take(in);
    const int64_t t = tokens_of(in, z.T);
    /* Routing: a few ids and weights of any value. */
    for (unsigned n = take(in) % 4; n; n--) {
      const int64_t q = take(in) % (z.T * k);
      if (take(in) & 1) z.L.topk_ids[q] = (int32_t)take32(in);
      else {
        const uint32_t u = take32(in);
        memcpy(&z.L.topk_weights[q], &u, 4);
      }
    }
    if (kind <= 2) size_slot(&z, (int)slot, t); /* a forward's saved: what its tokens need */
    char *sv = z.saved[slot];
    mok_forward_args f = {t, z.L.x, z.L.topk_ids, z.L.topk_weights, w, z.y, sv};
    mok_backward_args bw;
    memset(&bw, 0, sizeof bw);
    bw.tokens = t, bw.x = z.L.x, bw.topk_ids = z.L.topk_ids, bw.topk_weights = z.L.topk_weights;
    bw.w = f.w, bw.saved = sv, bw.dy = z.L.dy, bw.dx = z.dx, bw.d_topk_weights = z.dtw;
    bw.g = (mok_grads){z.g[0], z.g[1], z.g[2], z.g[3], z.g[4], z.g[5]};
    bw.grad_mode = flags & 0x10 ? (mok_grad_mode)(flags % 4) : (mok_grad_mode)(flags & 1);
    switch (flags >> 5) { /* argument damage: NULL, misaligned, inside saved */
      case 1: f.x = bw.x = NULL; break;
      case 2: f.topk_ids = bw.topk_ids = (const int32_t *)((const char *)z.L.topk_ids + 4); break;
      case 3: f.y = sv + 256, bw.dx = sv + 256; break;
      case 4: f.saved = sv + 128, bw.saved = sv + 128; break;
      case 5: /* a shared expert's weight where there is none, or none where there is */
        if (fp8) f.w.fp8 = bw.w.fp8 = (const char *)fp8 + 16;
        else f.w.ws_gate = bw.w.ws_gate = Is ? NULL : (const void *)z.L.w_gate;
        break;
      default: break;
    }
    if (kind == 6) { /* overwrite a byte of one of saved's parts (its header included) */
      const mok_saved_layout S = mok_saved_layout_of(z.ws, z.saved_tokens[slot]);
      const size_t part[][2] = {{S.status, MOK_STATUS_WORDS * 4},
                                {S.counts, (size_t)E * 4},
                                {S.offsets, (size_t)(E + 1) * 4},
                                {S.row_src, (size_t)S.rows_cap * 4},
                                {S.row_weight, (size_t)S.rows_cap * 4},
                                {S.slot_row, (size_t)(z.saved_tokens[slot] * k) * 4},
                                {S.mblock_expert, (size_t)S.rows_cap / MOK_TILE_M * 4},
                                {0, z.saved_bytes[slot]}};
      const unsigned p = take(in) % 8;
      const size_t at = part[p][0] + take32(in) % part[p][1];
      ((unsigned char *)z.saved[slot])[at] ^= (unsigned char)(1 + take(in) % 255);
      continue;
    }
    void *keep = malloc(z.saved_bytes[slot]);
    if (!keep) abort();
    memcpy(keep, z.saved[slot], z.saved_bytes[slot]);
    poison(&z);
    int32_t counts[16];
    memset(counts, POISON, sizeof counts);
    switch (kind) {
      case 0: st = mok_forward(z.ws, &f, NULL); break;
      case 1: st = mok_recompute(z.ws, &f, NULL); break;
      case 2: st = mok_schedule(z.ws, &f, NULL); break;
      case 3: st = mok_backward(z.ws, &bw, NULL); break;
      case 4: st = mok_check(z.ws, NULL); break;
      case 5: st = mok_schedule_counts(z.ws, z.saved[slot], t, counts, NULL); break;
      case 7: st = mok_saved_bytes(z.ws, t) ? MOK_OK : MOK_ERR_INVALID_ARG; break;
      default: st = mok_backward(z.ws, &bw, NULL); break;
    }
    if ((int)st < MOK_OK || st > MOK_ERR_INTERNAL) broke("a status that is no MOK_* value", op, st);
    if ((st == MOK_OK) != (mok_last_error()[0] == '\0'))
      broke(st == MOK_OK ? "a message after a success" : "no message after a failure", op, st);
    if (st != MOK_OK && kind != 4) { /* (a failed check reports an earlier call's error) */
      if (!outputs_untouched(&z)) broke("a failed call wrote an output", op, st);
      if (kind == 5 && !untouched(counts, sizeof counts)) broke("counts written", op, st);
      const size_t header = kind <= 2 ? 256 : 0; /* a forward's header says why it failed */
      if (memcmp((char *)keep + header, (char *)z.saved[slot] + header,
                 z.saved_bytes[slot] - header))
        broke("a failed call wrote saved past its header", op, st);
    }
    if (st == MOK_OK && (kind == 3 || kind == 8) && memcmp(keep, z.saved[slot], z.saved_bytes[slot]))
      broke("backward wrote saved", op, st);
    free(keep);
  }

  free(z.y), free(z.dx), free(z.dtw), free(fp8);
  for (int i = 0; i < 6; i++) free(z.g[i]);
  for (int i = 0; i < SLOTS; i++) free(z.saved[i]);
  mok_host_layer_destroy(&z.L);
  mok_workspace_destroy(z.ws);
  mok_context_destroy(ctx);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  input in = {data, size};
  if (size >= 6) run_input(&in);
  return 0;
}
