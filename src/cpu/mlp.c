/*
 * mlp.c: the SwiGLU MLP of one row of one expert, forward and backward, exactly as DESIGN.md §1.1
 * rounds it. Routed rows and the shared expert's tokens both run through here (the shared expert
 * with w = 1, where w * v == v exactly), so the two can never drift apart.
 *
 * Products of three or more factors are evaluated left to right as §1.1 writes them:
 * w * silu(g) * u is (w * silu(g)) * u, and so on.
 *
 * At MOK_FP8 every product reads its operands dequantized (DESIGN §8.2) and is otherwise the
 * same code: the panels hold the FP8 weights decoded, x and dy come as their tokens' Q_row, and
 * hw (into down) and dgu (into the gate/up dgrad) are quantized here, after they are rounded to
 * bf16 as §1.1 stores them.
 */
#include <math.h>

#include "bf16.h"
#include "cpu/cpu.h"
#include "cpu/kernels.h"
#include "fp8.h"

static inline float silu(float z) { return z / (1.0f + expf(-z)); }
static inline float sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

/* Router-gradient chunk: d_topk_weights sums 64-column chunks of I, each summed in order. */
#define ROUTER_CHUNK 64

/* Row r of the panels, from bf16 weights or (MOK_FP8) from the codes and block scales of the
 * FP8 buffer: rows 0..2I of panel_gu are W_gate then W_up [.., H]; then H rows of W_down [.., I]. */
void cpu_load_panels(const mok_workspace *ws, const mok_weights *w, int64_t e) {
  const cpu_state *st = cpu_state_of(ws);
  const int shared = e < 0;
  const int64_t H = ws->shape.hidden, I = shared ? ws->shape.shared_inter : ws->shape.inter;
  const int fp8 = ws->shape.precision == MOK_FP8;
  const mok_fp8_layout L = mok_fp8_layout_of(ws);
  const uint16_t *bf16[3] = {shared ? w->ws_gate : w->w_gate, shared ? w->ws_up : w->w_up,
                             shared ? w->ws_down : w->w_down};
  const int first = shared ? MOK_WS_GATE : MOK_W_GATE; /* MOK_W_*: gate, up, down in order */
  if (e < 0) e = 0;
  #pragma omp for schedule(static)
  for (int64_t r = 0; r < 2 * I + H; r++) {
    const int m = r < I ? 0 : r < 2 * I ? 1 : 2;        /* gate, up, down */
    const int64_t row = m < 2 ? r - m * I : r - 2 * I;  /* row of that tensor */
    const int64_t n = m < 2 ? H : I;                    /* its length */
    float *dst = m < 2 ? st->panel_gu + r * H : st->panel_down + row * I;
    if (fp8) {
      const mok_fp8_matrix_layout *ml = &L.m[first + m];
      const char *buf = w->fp8;
      const int64_t rows = ml->n, bk = (ml->k + MOK_FP8_GROUP - 1) / MOK_FP8_GROUP;
      const uint8_t *q = (const uint8_t *)(buf + ml->q) + (e * rows + row) * n;
      const float *sc = (const float *)(buf + ml->s) +
                        (e * ((rows + MOK_FP8_GROUP - 1) / MOK_FP8_GROUP) + row / MOK_FP8_GROUP) * bk;
      cpu_fp8_decode_row(dst, q, sc, n);
    } else {
      const uint16_t *src = bf16[m] + (e * (m < 2 ? I : H) + row) * n;
      for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    }
  }
}

void cpu_mlp_forward_row(const float *x, const float *panel_gu, const float *panel_down,
                         int64_t H, int64_t I, float w, int fp8, uint16_t *gu, uint16_t *hw,
                         float *hwf, float *out) {
  for (int64_t c = 0; c < 2 * I; c++) gu[c] = f32_to_bf16(cpu_dot(x, panel_gu + c * H, H));
  for (int64_t i = 0; i < I; i++) {
    const float g = bf16_to_f32(gu[i]), u = bf16_to_f32(gu[I + i]);
    hw[i] = f32_to_bf16(w * silu(g) * u);
    hwf[i] = bf16_to_f32(hw[i]);
  }
  if (!out) return;
  if (fp8) cpu_q_row(hwf, I); /* the down product's operand */
  for (int64_t h = 0; h < H; h++) out[h] = cpu_dot(hwf, panel_down + h * I, I);
}

/* acc[0..n) = sum over q < K, ascending, of a[q] * rows[q * n .. q * n + n). */
static void sum_rows(float *acc, const float *a, const float *rows, int64_t K, int64_t n) {
  cpu_zero(acc, n);
  int64_t q = 0;
  for (; q + 4 <= K; q += 4)
    cpu_axpy4(acc, a + q, rows + q * n, rows + (q + 1) * n, rows + (q + 2) * n,
              rows + (q + 3) * n, n);
  for (; q < K; q++) cpu_axpy(acc, a[q], rows + q * n, n);
}

float cpu_mlp_backward_row(const float *dy, const float *panel_gu, const float *panel_down,
                           int64_t H, int64_t I, float w, const uint16_t *gu, float *dh,
                           float *dgu, float *dgu_q, float *dx) {
  /* down dgrad: dh[i] = sum_h dy[h] W_down[h, i] */
  sum_rows(dh, dy, panel_down, H, I);

  /* router gradient <dh, silu(g) u>, in 64-column chunks */
  float dtw = 0.0f;
  for (int64_t c0 = 0; c0 < I; c0 += ROUTER_CHUNK) {
    const int64_t c1 = c0 + ROUTER_CHUNK < I ? c0 + ROUTER_CHUNK : I;
    float part = 0.0f;
    for (int64_t i = c0; i < c1; i++) {
      const float g = bf16_to_f32(gu[i]), u = bf16_to_f32(gu[I + i]);
      part += dh[i] * silu(g) * u;
    }
    dtw += part;
  }

  /* SwiGLU backward, rounded to bf16 where dgu is stored */
  for (int64_t i = 0; i < I; i++) {
    const float g = bf16_to_f32(gu[i]), u = bf16_to_f32(gu[I + i]);
    const float s = sigmoid(g), d = w * dh[i];
    dgu[i] = round_bf16(d * u * s * (1.0f + g * (1.0f - s)));
    dgu[I + i] = round_bf16(d * g * s);
  }

  /* gate/up dgrad: dx[h] = sum_c dgu[c] W_gu[c, h], c over [gate | up] ascending; at MOK_FP8
   * on Q_row(dgate) and Q_row(dup), each quantized along I in groups of its own */
  if (dgu_q) {
    for (int64_t c = 0; c < 2 * I; c++) dgu_q[c] = dgu[c];
    cpu_q_row(dgu_q, I);
    cpu_q_row(dgu_q + I, I);
  }
  sum_rows(dx, dgu_q ? dgu_q : dgu, panel_gu, 2 * I, H);
  return dtw;
}
