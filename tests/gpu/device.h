/*
 * device.h: the GPU tests' twin of tests/harness.h. A gpu_layer holds device copies of a
 * harness's inputs and every output; gpu_fetch copies the outputs back into a host harness so
 * that GPU and CPU results (or two GPU runs) are compared with the same code.
 */
#ifndef MOK_TESTS_GPU_DEVICE_H
#define MOK_TESTS_GPU_DEVICE_H

#include <cuda_runtime.h>

#include "harness.h"

typedef struct gpu_layer {
  mok_context *ctx;
  mok_workspace *ws;
  int64_t T;
  const harness *src;           /* the inputs' host copy */
  void *x, *dy, *ids, *tw;      /* inputs */
  void *w[G_COUNT];             /* weights, in the order of the gradients */
  void *y, *dx, *dtw, *saved;   /* outputs */
  void *g[G_COUNT];             /* gradients, room for fp32 */
  void *fp8;                    /* MOK_FP8: the weights' FP8 buffer, quantized by the GPU */
  size_t saved_bytes;
} gpu_layer;

/* Device copies of h's inputs (first T tokens), a CUDA context with the tuning knobs of `knobs`
 * (sms, cluster; NULL = the defaults) and a workspace of h's shape. Returns 0 after
 * recording a failure. */
int gpu_init(gpu_layer *d, const harness *h, int64_t T, const mok_context_config *knobs);
void gpu_fini(gpu_layer *d);

mok_forward_args gpu_forward_args(const gpu_layer *d);
mok_backward_args gpu_backward_args(const gpu_layer *d, mok_grad_mode mode);
/* Every output filled with the byte `pattern` (0xff makes bf16 and fp32 NaNs). */
void gpu_poison(gpu_layer *d, unsigned char pattern);
/* The backward's outputs only (dx, d_topk_weights, gradients): saved and y stay. */
void gpu_poison_backward(gpu_layer *d, unsigned char pattern);
/* fp32 gradients set to the values in h (for MOK_GRAD_ACCUMULATE_F32 runs). */
void gpu_set_grads(gpu_layer *d, const harness *h);
/* Forward then backward on `stream`; first failing status. */
mok_status gpu_run(gpu_layer *d, mok_grad_mode mode, cudaStream_t stream);
/* Waits for the device and copies every output into h's output buffers (h->T must be d->T). */
void gpu_fetch(const gpu_layer *d, harness *h);

/* Bitwise comparison of two host buffers; records a failure naming the first differing byte. */
int same_bits(const char *what, const void *a, const void *b, size_t bytes);
/* y, dx, d_topk_weights and the first `grads` bf16 weight gradients (G_COUNT: all) of two
 * harnesses, bit for bit; each difference recorded under `tag`. */
void same_layer_bits(const char *tag, const harness *a, const harness *b, int grads);
/* Relative error of a bf16 / fp32 tensor against a reference of the same type. */
double rel_err_bf16(const uint16_t *out, const uint16_t *ref, size_t n);
double rel_err_f32(const float *out, const float *ref, size_t n);
/* Counts NaNs (unwritten poisoned elements show as NaN). */
size_t nan_count_bf16(const uint16_t *p, size_t n);

/* ---- the layer's comparisons (device.c) ------------------------------------------------------ */
#define GPU_TOL 1e-2 /* bf16-level: accumulation order may flip a rounding, a bug moves O(1) */
mok_shape shape_of(int64_t T, int64_t H, int64_t I, int64_t Is, int E, int k);
/* Deterministic fp32 starting values for accumulate-mode gradients. */
void fill_grads(harness *h);
int64_t grad_bytes(const harness *h, int i, mok_grad_mode mode);
extern const char *grad_name[G_COUNT];
/* Every output and saved activation of `out` (GPU) against `ref` (CPU): relative error below
 * GPU_TOL, no NaN in y. */
void compare_outputs(const char *tag, const harness *out, const harness *ref, mok_grad_mode mode);
/* The schedule fields of two saved buffers are identical. */
void compare_schedule(const char *tag, const harness *out, const harness *ref);
/* y, dx, d_topk_weights and the gradients of two runs are the same to the bit. */
void compare_bits(const char *tag, const harness *a, const harness *b, mok_grad_mode mode);
/* The layer on the CPU (into ref) and the GPU (into out), both from poisoned outputs; 0 after
 * recording the failure when the GPU layer could not be set up. */
int run_both(harness *ref, harness *out, mok_grad_mode mode, const mok_context_config *knobs);
/* The GPU layer on h's inputs with the knobs of `knobs` (NULL: defaults) into `out`. */
void gpu_once(harness *h, harness *out, const mok_context_config *knobs, mok_grad_mode mode);

/* ---- the layer tests of test_layer.c, at either precision (test_fp8.c runs them at FP8) ------ */
typedef struct small_case {
  int64_t T, H, I, Is;
  int E, k;
} small_case;
extern const small_case small_cases[]; /* odd sizes (test_layer.c says which) */
extern const size_t small_case_count;
/* The DESIGN §7 shapes (H, I, I_s, E, k; the tests take their own T). */
typedef struct design_shape {
  const char *name;
  int64_t H, I, Is;
  int E, k;
} design_shape;
extern const design_shape design_shapes[];
extern const size_t design_shape_count;
/* Every output and saved activation against the CPU, each case in both grad modes (the second in
 * clusters of 2 x 2). */
void layer_vs_cpu_cases(mok_precision p, const small_case *cases, size_t n);
void routing_edges_at(mok_precision p);           /* routing edge cases against the CPU */
void repeat_and_knobs_at(mok_precision p);        /* D1 and D2, bit for bit */
void batch_subsets_at(mok_precision p);           /* D3, bit for bit */
void recompute_matches_forward_at(mok_precision p);
void graph_replay_at(mok_precision p);            /* graph replays give the eager bits */

#define CUDA_CHECK(expr)                                                                   \
  do {                                                                                     \
    cudaError_t e_ = (expr);                                                               \
    CHECK(e_ == cudaSuccess, "%s: %s", #expr, cudaGetErrorString(e_));                     \
  } while (0)

#endif
