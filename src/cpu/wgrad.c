/*
 * wgrad.c: the six weight gradients. Each output row is one thread's: it sums a[q] * b_q[0..len)
 * over the expert's rows q in canonical order (ascending row of the segment; tokens in ascending
 * order for the shared expert), then writes bf16(sum) or adds the sum once to the fp32 main grad.
 *
 *   dW_down[e][h, :] = sum_r dy_r[h]   hw_r[:]      dWs_down[h, :] = sum_t dy_t[h]    hs_t[:]
 *   dW_gate[e][i, :] = sum_r dgate_r[i] x_r[:]      dWs_gate[i, :] = sum_t dgates_t[i] x_t[:]
 *   dW_up[e][i, :]   = sum_r dup_r[i]   x_r[:]      dWs_up[i, :]   = sum_t dups_t[i]   x_t[:]
 *
 * At MOK_FP8 the same sums run on every operand's Q_col (DESIGN §8.1), made in place first.
 */
#include "bf16.h"
#include "cpu/cpu.h"
#include "cpu/kernels.h"

/* The rows one gradient row sums over, in order: row q's scalar is a[q * a_stride], its vector
 * b + q * b_stride (routed rows: the expert's segment of the dispatched buffers; shared expert:
 * this rank's tokens). */
typedef struct row_set {
  int64_t n;
  const float *a;
  int64_t a_stride;
  const float *b;
  int64_t b_stride;
} row_set;

static void sum_rows(float *acc, const row_set *rs, int64_t len) {
  cpu_zero(acc, len);
  int64_t q = 0;
  for (; q < rs->n; q += 4) {
    const int64_t m = rs->n - q < 4 ? rs->n - q : 4;
    float a[4];
    const float *b[4];
    for (int64_t p = 0; p < m; p++) {
      a[p] = rs->a[(q + p) * rs->a_stride];
      b[p] = rs->b + (q + p) * rs->b_stride;
    }
    if (m == 4) {
      cpu_axpy4(acc, a, b[0], b[1], b[2], b[3], len);
    } else {
      for (int64_t p = 0; p < m; p++) cpu_axpy(acc, a[p], b[p], len);
    }
  }
}

static void store(void *dw, int64_t at, const float *acc, int64_t len, mok_grad_mode mode) {
  if (mode == MOK_GRAD_ACCUMULATE_F32) {
    float *p = (float *)dw + at;
    for (int64_t i = 0; i < len; i++) p[i] = p[i] + acc[i];
  } else {
    uint16_t *p = (uint16_t *)dw + at;
    for (int64_t i = 0; i < len; i++) p[i] = f32_to_bf16(acc[i]);
  }
}

/* The three gradients of one expert (routed, or the shared one) have H + 2 I output rows; row q
 * < H is of dW_down, then I rows of dW_gate, then I of dW_up. The expert's n rows: dy, x [n, H],
 * hw [n, I], dgu [n, 2I]. */
static void grad_row(int64_t q, int64_t n, int64_t H, int64_t I, const float *dy,
                     const float *x, const float *hw, const float *dgu, void *dw_gate,
                     void *dw_up, void *dw_down, int64_t e, mok_grad_mode mode, float *acc) {
  if (q < H) {
    row_set rows = {n, dy + q, H, hw, I};
    sum_rows(acc, &rows, I);
    store(dw_down, (e * H + q) * I, acc, I, mode);
    return;
  }
  const int64_t i = (q - H) % I;
  const int up = q - H >= I;
  row_set rows = {n, dgu + (up ? I : 0) + i, 2 * I, x, H};
  sum_rows(acc, &rows, H);
  store(up ? dw_up : dw_gate, (e * I + i) * H, acc, H, mode);
}

/* MOK_FP8: the operands, Q_col in place: each column of an expert's rows in blocks of 128 from
 * its segment's start (the padding rows past its count are zeros, which change no block's
 * amax, so they are left out), and of the shared expert's tokens in blocks of 128 from token 0.
 * Column by column over the team (inside the parallel region). */
static void quantize_operands(const mok_workspace *ws, const cpu_saved *sv, int64_t tokens) {
  const cpu_state *st = cpu_state_of(ws);
  const int64_t H = ws->shape.hidden, I = ws->shape.inter, Is = ws->shape.shared_inter;
  const int64_t El = ws->experts_local;
  /* an expert's columns: dy, x [n, H], then hw [n, I], then dgu [n, 2I] */
  const int64_t per_expert = 2 * H + 3 * I, shared = Is ? 2 * H + 3 * Is : 0;
  #pragma omp for schedule(static)
  for (int64_t item = 0; item < El * per_expert + shared; item++) {
    const int own = item < El * per_expert;
    const int64_t e = own ? item / per_expert : 0, c = own ? item % per_expert : item - El * per_expert;
    const int64_t n = own ? sv->counts[e] : tokens, r0 = own ? sv->offsets[e] : 0;
    const int64_t In = own ? I : Is;
    float *dy = own ? st->dyr + r0 * H : st->dyf, *x = own ? st->xr + r0 * H : st->xf;
    float *hw = own ? st->hwf + r0 * I : st->hsf, *dgu = own ? st->dguf + r0 * 2 * I : st->dgusf;
    if (c < H) cpu_q_col(dy + c, n, H);
    else if (c < 2 * H) cpu_q_col(x + c - H, n, H);
    else if (c < 2 * H + In) cpu_q_col(hw + c - 2 * H, n, In);
    else cpu_q_col(dgu + c - 2 * H - In, n, 2 * In);
  }
}

void cpu_weight_grads(mok_workspace *ws, const cpu_saved *sv, int64_t tokens,
                      const mok_grads *g, mok_grad_mode mode) {
  const cpu_state *st = cpu_state_of(ws);
  const int64_t H = ws->shape.hidden, I = ws->shape.inter, Is = ws->shape.shared_inter;
  const int64_t El = ws->experts_local;
  const int64_t per_expert = H + 2 * I, shared_rows = Is ? H + 2 * Is : 0;

  #pragma omp parallel num_threads(st->threads)
  {
    float *acc = cpu_thread_scratch(ws); /* [max(H, I, I_s)] */
    if (ws->shape.precision == MOK_FP8) quantize_operands(ws, sv, tokens);
    /* Rows differ in cost (H vs I long, segments of any size): hand them out dynamically;
     * each is still computed whole by one thread, so the bits do not depend on who takes it. */
    #pragma omp for schedule(dynamic, 4)
    for (int64_t item = 0; item < El * per_expert + shared_rows; item++) {
      if (item < El * per_expert) {
        const int64_t e = item / per_expert, r0 = sv->offsets[e];
        grad_row(item % per_expert, sv->counts[e], H, I, st->dyr + r0 * H, st->xr + r0 * H,
                 st->hwf + r0 * I, st->dguf + r0 * 2 * I, g->dw_gate, g->dw_up, g->dw_down, e,
                 mode, acc);
      } else {
        grad_row(item - El * per_expert, tokens, H, Is, st->dyf, st->xf, st->hsf, st->dgusf,
                 g->dws_gate, g->dws_up, g->dws_down, 0, mode, acc);
      }
    }
  }
}
