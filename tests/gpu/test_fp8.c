/*
 * test_fp8.c: the CUDA backend's FP8 layer (DESIGN §8) against the CPU reference's and against
 * itself: the weights' FP8 buffer byte for byte (quantized, and imported), test_layer.c's tests at
 * FP8 (every output and saved activation on odd shapes and routing edge cases at
 * accumulation-order tolerance, D1 repeats, the D2 knob sweep, D3 batch subsets, recompute, graph
 * replay), layers scaled group by group, and on the DESIGN §7 shapes at reduced T what FP8 costs
 * against the GPU's BF16 layer (relative error and cosine per tensor).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "check.h"
#include "device.h"
#include "fp8_scaling.h"
#include "internal.h"

static mok_shape fp8_shape(int64_t T, int64_t H, int64_t I, int64_t Is, int E, int k) {
  mok_shape s = shape_of(T, H, I, Is, E, k);
  s.precision = MOK_FP8;
  return s;
}

/* mok_quantize_weights on the GPU writes the CPU's bytes; so does mok_fp8_weights_import of the
 * CPU's codes and scales. */
static void weights_vs_cpu(void) {
  const int64_t shapes[][5] = {{64, 192, 320, 64, 4}, {64, 2880, 384, 0, 3}, {64, 64, 64, 192, 1}};
  for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
    const int64_t *v = shapes[c];
    mok_shape s = fp8_shape(v[0], v[1], v[2], v[3], (int)v[4], 1);
    harness h;
    if (harness_init(&h, &s, v[0], 31 + c, 0)) {
      gpu_layer d;
      if (gpu_init(&d, &h, v[0], NULL)) {
        const size_t n = mok_fp8_weights_bytes(d.ws);
        char *got = malloc(n);
        CUDA_CHECK(cudaMemcpy(got, d.fp8, n, cudaMemcpyDeviceToHost));
        char tag[96];
        snprintf(tag, sizeof tag, "H%lld I%lld Is%lld E%lld quantized", (long long)v[1],
                 (long long)v[2], (long long)v[3], (long long)v[4]);
        same_bits(tag, got, h.fp8, n);
        /* import: the CPU's codes and scales, matrix by matrix, as a caller would give them */
        const mok_fp8_layout L = mok_fp8_layout_of(d.ws);
        void *dev[MOK_W_COUNT][2] = {{0}};
        mok_fp8_matrix m[MOK_W_COUNT];
        memset(m, 0, sizeof m);
        for (int i = 0; i < MOK_W_COUNT; i++) {
          const mok_fp8_matrix_layout *ml = &L.m[i];
          if (!ml->experts) continue;
          const size_t codes = (size_t)(ml->experts * ml->n * ml->k);
          const size_t scales = (size_t)(ml->experts * ((ml->n + 127) / 128) *
                                         ((ml->k + 127) / 128)) * 4;
          CUDA_CHECK(cudaMalloc(&dev[i][0], codes));
          CUDA_CHECK(cudaMalloc(&dev[i][1], scales));
          CUDA_CHECK(cudaMemcpy(dev[i][0], (char *)h.fp8 + ml->q, codes, cudaMemcpyHostToDevice));
          CUDA_CHECK(cudaMemcpy(dev[i][1], (char *)h.fp8 + ml->s, scales, cudaMemcpyHostToDevice));
          m[i].q = dev[i][0];
          m[i].s = (const float *)dev[i][1];
        }
        const mok_fp8_given given = {m[0], m[1], m[2], m[3], m[4], m[5]};
        CUDA_CHECK(cudaMemset(d.fp8, 0x5a, n));
        CHECK_OK(mok_fp8_weights_import(d.ws, &given, d.fp8, 0));
        CUDA_CHECK(cudaMemcpy(got, d.fp8, n, cudaMemcpyDeviceToHost));
        snprintf(tag, sizeof tag, "H%lld I%lld imported", (long long)v[1], (long long)v[2]);
        /* the padding between the matrices is nobody's: compare the matrices */
        for (int i = 0; i < MOK_W_COUNT; i++) {
          const mok_fp8_matrix_layout *ml = &L.m[i];
          if (!ml->experts) continue;
          const size_t codes = (size_t)(ml->experts * ml->n * ml->k);
          same_bits(tag, got + ml->q, (char *)h.fp8 + ml->q, codes);
          same_bits(tag, got + ml->qt, (char *)h.fp8 + ml->qt, codes);
          cudaFree(dev[i][0]);
          cudaFree(dev[i][1]);
        }
        free(got);
      }
      gpu_fini(&d);
    }
    harness_fini(&h);
  }
}

/* A refused mok_quantize_weights or mok_fp8_weights_import (a host pointer among the tensors,
 * the last one checked) leaves the buffer as it was. */
static void weights_refused_untouched(void) {
  mok_shape s = fp8_shape(64, 128, 128, 64, 4, 1);
  harness h;
  if (harness_init(&h, &s, 64, 5, 0)) {
    gpu_layer d;
    if (gpu_init(&d, &h, 64, NULL)) {
      const size_t n = mok_fp8_weights_bytes(d.ws);
      char *got = malloc(n), *want = malloc(n);
      memset(want, 0x5a, n);
      mok_weights w = {d.w[G_GATE], d.w[G_UP], d.w[G_DOWN], d.w[GS_GATE], d.w[GS_UP],
                       h.L.ws_down, NULL}; /* ws_down in host memory */
      CUDA_CHECK(cudaMemset(d.fp8, 0x5a, n));
      mok_status st = mok_quantize_weights(d.ws, &w, d.fp8, 0);
      CHECK(st == MOK_ERR_INVALID_ARG && strstr(mok_last_error(), "ws_down"),
            "quantize with a host ws_down: %s (%s)", mok_status_name(st), mok_last_error());
      CUDA_CHECK(cudaMemcpy(got, d.fp8, n, cudaMemcpyDeviceToHost));
      same_bits("refused quantize left the buffer", got, want, n);
      mok_fp8_given g;
      memset(&g, 0, sizeof g);
      mok_fp8_matrix *m[MOK_W_COUNT] = {&g.w_gate,  &g.w_up,  &g.w_down,
                                        &g.ws_gate, &g.ws_up, &g.ws_down};
      const mok_fp8_layout L = mok_fp8_layout_of(d.ws);
      void *copy = NULL;
      CUDA_CHECK(cudaMalloc(&copy, n));
      CUDA_CHECK(cudaMemcpy(copy, h.fp8, n, cudaMemcpyHostToDevice));
      for (int i = 0; i < MOK_W_COUNT; i++) {
        m[i]->q = (char *)copy + L.m[i].q;
        m[i]->s = (const float *)((char *)copy + L.m[i].s);
      }
      g.ws_down.q = (char *)h.fp8 + L.m[MOK_WS_DOWN].q; /* host */
      st = mok_fp8_weights_import(d.ws, &g, d.fp8, 0);
      CHECK(st == MOK_ERR_INVALID_ARG && strstr(mok_last_error(), "ws_down"),
            "import with a host ws_down: %s (%s)", mok_status_name(st), mok_last_error());
      CUDA_CHECK(cudaMemcpy(got, d.fp8, n, cudaMemcpyDeviceToHost));
      same_bits("refused import left the buffer", got, want, n);
      cudaFree(copy);
      free(got), free(want);
    }
    gpu_fini(&d);
  }
  harness_fini(&h);
}

/* The layer tests of test_layer.c at FP8, against the CPU reference's FP8 layer; the small
 * cases and one more, I = H = 2880: FP8's last k-block and the gate/up dgrad's split half full. */
static void layer_vs_cpu(void) {
  static const small_case wide = {64, 2880, 2880, 192, 4, 2};
  layer_vs_cpu_cases(MOK_FP8, small_cases, small_case_count);
  layer_vs_cpu_cases(MOK_FP8, &wide, 1);
}

static void routing_edges(void) { routing_edges_at(MOK_FP8); }

static void determinism(void) {
  repeat_and_knobs_at(MOK_FP8);
  batch_subsets_at(MOK_FP8);
  recompute_matches_forward_at(MOK_FP8);
  graph_replay_at(MOK_FP8);
}

/* The GPU layer plain and scaled group by group (tests/fp8_scaling.h) against each other, bit for
 * bit: a quantization of the CUDA kernels that takes other groups than DESIGN §8.1's mixes scales
 * 2^16 apart and fails this, where comparing with the CPU at accumulation-order tolerance cannot
 * tell (scales are powers of two: a group's extent barely moves the values when they are all of
 * a size). The CPU test of the same name checks the CPU's groups. */
static void scaled_case(const mok_shape *shape, int64_t T, uint64_t seed, scaling *sc,
                        int *s_of_token, const char *what) {
  harness p, q, po, qo;
  if (harness_init(&p, shape, T, seed, 0) && harness_init(&q, shape, T, seed, 0) &&
      harness_init(&po, shape, T, seed, 0) && harness_init(&qo, shape, T, seed, 0)) {
    if (s_of_token) { /* k = 1: each token's row's block of 128 in its expert's segment */
      int64_t count[64] = {0};
      static const int sB[8] = {0, 17, -16, 16, -17, 18, -18, 1};
      for (int64_t t = 0; t < T; t++) s_of_token[t] = sB[count[p.L.topk_ids[t]]++ / FSG % 8];
      sc->s = s_of_token;
    }
    scale_layer(&q.L, sc); /* the GPU quantizes q's weights as gpu_init uploads them */
    gpu_once(&p, &po, NULL, MOK_GRAD_WRITE_BF16);
    gpu_once(&q, &qo, NULL, MOK_GRAD_WRITE_BF16);
    check_scaled_bits(&po, &qo, sc, what);
  }
  harness_fini(&p);
  harness_fini(&q);
  harness_fini(&po);
  harness_fini(&qo);
}

static void group_scaling(void) {
  /* 3 groups along H and I (the last 64 wide), 2 along I_s */
  static const int aH[3] = {0, 17, -16}, cH[3] = {-16, 0, 17}, bI[3] = {16, -17, 0},
                   bS[2] = {-16, 17};
  scaling sc = {aH, cH, bI, bS, NULL};
  const mok_shape s = fp8_shape(64, 320, 320, 192, 4, 2);
  scaled_case(&s, 64, 901, &sc, NULL, "gpu groups along H and I");
}

static void row_block_scaling(void) {
  /* k = 1, 600 tokens on 2 experts: segments of about 300 rows, 3 blocks each */
  const mok_shape s = fp8_shape(600, 192, 192, 0, 2, 1);
  int st[600];
  scaling sc = {NULL, NULL, NULL, NULL, NULL};
  scaled_case(&s, 600, 902, &sc, st, "gpu blocks of each expert's rows");
}

/* agree (fp8_scaling.h) over n values of two tensors, bf16 or fp32. */
static void agree_tensor(agree *g, const void *a, const void *b, size_t n, int f32) {
  for (size_t i = 0; i < n; i++)
    agree_add(g, f32 ? ((const float *)a)[i] : bf16_to_f32(((const uint16_t *)a)[i]),
              f32 ? ((const float *)b)[i] : bf16_to_f32(((const uint16_t *)b)[i]));
}

/* The DESIGN §7 shapes at T = 256: the GPU's FP8 layer against its BF16 layer on the same
 * inputs, per output tensor (relative error and cosine, printed). The bound is test_fp8_layer.c's
 * (the CPU's): what e4m3's 3 mantissa bits cost, with margin. */
#define TOL_FP8 0.10
static void design_shapes_vs_bf16(void) {
  const design_shape *shapes = design_shapes;
  const int64_t T = 256;
  for (size_t c = 0; c < design_shape_count; c++) {
    mok_shape s8 = fp8_shape(T, shapes[c].H, shapes[c].I, shapes[c].Is, shapes[c].E, shapes[c].k);
    mok_shape s16 = s8;
    s16.precision = MOK_BF16;
    harness h8, o8, o16;
    if (harness_init(&h8, &s8, T, 500 + c, 0) && harness_init(&o8, &s8, T, 500 + c, 0) &&
        harness_init(&o16, &s16, T, 500 + c, 0)) {
      gpu_once(&h8, &o8, NULL, MOK_GRAD_WRITE_BF16);
      gpu_once(&o16, &o16, NULL, MOK_GRAD_WRITE_BF16);
      const int64_t H = shapes[c].H, k = shapes[c].k;
      CHECK(nan_count_bf16(o8.y, (size_t)(T * H)) == 0, "%s: y has NaN", shapes[c].name);
      printf("     %s fp8 vs bf16 (rel.err/cosine):", shapes[c].name);
      for (int i = 0; i < 3 + G_COUNT; i++) {
        agree g = {0, 0, 0, 0};
        if (i == 0) agree_tensor(&g, o8.y, o16.y, (size_t)(T * H), 0);
        else if (i == 1) agree_tensor(&g, o8.dx, o16.dx, (size_t)(T * H), 0);
        else if (i == 2) agree_tensor(&g, o8.dtw, o16.dtw, (size_t)(T * k), 1);
        else if (o8.g_len[i - 3])
          agree_tensor(&g, o8.g[i - 3], o16.g[i - 3], (size_t)o8.g_len[i - 3], 0);
        else continue;
        const double rel = agree_rel(&g), cosv = agree_cos(&g);
        printf(" %s %.4f/%.6f", fs_names[i], rel, cosv);
        CHECK(rel < TOL_FP8 && cosv > 1 - TOL_FP8 * TOL_FP8 / 2, "%s: %s rel err %.3g cosine %.6f",
              shapes[c].name, fs_names[i], rel, cosv);
      }
      printf("\n");
    }
    harness_fini(&h8);
    harness_fini(&o8);
    harness_fini(&o16);
  }
}

const test_case tests_gpu_fp8[] = {
    {"gpu/fp8_weights_vs_cpu", weights_vs_cpu},
    {"gpu/fp8_weights_refused_untouched", weights_refused_untouched},
    {"gpu/fp8_layer_vs_cpu_small_shapes", layer_vs_cpu},
    {"gpu/fp8_routing_edges", routing_edges},
    {"gpu/fp8_layer_commutes_with_group_scaling", group_scaling},
    {"gpu/fp8_layer_commutes_with_row_block_scaling", row_block_scaling},
    {"gpu/fp8_determinism_recompute_graph", determinism},
    {"gpu/fp8_design_shapes_vs_bf16", design_shapes_vs_bf16},
    {NULL, NULL},
};
