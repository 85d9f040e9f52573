/*
 * mlp.c: the SwiGLU MLP of one row of one expert, forward and backward, exactly as DESIGN.md §1.1
 * rounds it. Routed rows and the shared expert's tokens both run through here (the shared expert
 * with w = 1, where w * v == v exactly), so the two can never drift apart.
 *
 * Products of three or more factors are evaluated left to right as §1.1 writes them:
 * w * silu(g) * u is (w * silu(g)) * u, and so on.
 */
#include <math.h>

#include "bf16.h"
#include "cpu/cpu.h"
#include "cpu/kernels.h"

static inline float silu(float z) { return z / (1.0f + expf(-z)); }
static inline float sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

/* Router-gradient chunk: d_topk_weights sums 64-column chunks of I, each summed in order. */
#define ROUTER_CHUNK 64

void cpu_load_panels(const mok_workspace *ws, const uint16_t *w_gate, const uint16_t *w_up,
                     const uint16_t *w_down, int64_t H, int64_t I) {
  const cpu_state *st = cpu_state_of(ws);
  #pragma omp for schedule(static)
  for (int64_t r = 0; r < 2 * I + H; r++) {
    const uint16_t *src;
    float *dst;
    int64_t n;
    if (r < I) {
      src = w_gate + r * H, dst = st->panel_gu + r * H, n = H;
    } else if (r < 2 * I) {
      src = w_up + (r - I) * H, dst = st->panel_gu + r * H, n = H;
    } else {
      src = w_down + (r - 2 * I) * I, dst = st->panel_down + (r - 2 * I) * I, n = I;
    }
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
  }
}

void cpu_mlp_forward_row(const float *x, const float *panel_gu, const float *panel_down,
                         int64_t H, int64_t I, float w, uint16_t *gu, uint16_t *hw, float *hwf,
                         float *out) {
  for (int64_t c = 0; c < 2 * I; c++) gu[c] = f32_to_bf16(cpu_dot(x, panel_gu + c * H, H));
  for (int64_t i = 0; i < I; i++) {
    const float g = bf16_to_f32(gu[i]), u = bf16_to_f32(gu[I + i]);
    hw[i] = f32_to_bf16(w * silu(g) * u);
    hwf[i] = bf16_to_f32(hw[i]);
  }
  if (!out) return;
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
                           float *dgu, float *dx) {
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

  /* gate/up dgrad: dx[h] = sum_c dgu[c] W_gu[c, h], c over [gate | up] ascending */
  sum_rows(dx, dgu, panel_gu, 2 * I, H);
  return dtw;
}
