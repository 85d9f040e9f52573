/*
 * layer.h: one layer call of the mok command on either backend: seeded inputs (host, copied to
 * the GPU for cuda), the outputs (poisoned before a run, copied back to the host after), timed
 * forward and backward, digests, and the comparison with the float64 recomputation (ref64.h).
 * Functions that can fail print what failed (with the status name and mok_last_error()) on
 * stderr and return -1; they never exit.
 */
#ifndef MOK_TOOLS_LAYER_H
#define MOK_TOOLS_LAYER_H

#include "cli.h"
#include "mok.h"
#include "mok_gen.h"

/* Progress on stderr: "[mok] what... " then, from tool_done, the seconds it took. */
double tool_step(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void tool_done(double started);
/* "mok: error: ..." on stderr (closing an open progress line first). */
void tool_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Prints the function of the failed `call` (the text up to its '('), mok_status_name(st) and
 * mok_last_error(); returns -1. */
int tool_mok_error(const char *call, mok_status st);
double tool_seconds(void); /* monotonic clock */

/* The outputs, in the order they are printed. */
typedef enum tool_output {
  OUT_Y, OUT_DX, OUT_DTW, OUT_DW_GATE, OUT_DW_UP, OUT_DW_DOWN, OUT_DWS_GATE, OUT_DWS_UP,
  OUT_DWS_DOWN, OUT_COUNT
} tool_output;

extern const char *const tool_output_names[OUT_COUNT];
/* Values and bytes per value of each output, for a call of `tokens` tokens holding `experts`
 * routed experts (0 values: absent, as the shared-expert gradients without a shared expert). */
void tool_output_sizes(const cli_options *o, int64_t tokens, int64_t experts, int64_t n[OUT_COUNT],
                       int elem[OUT_COUNT]);

typedef struct tool_tensor {
  const char *name;
  int64_t n;    /* values; 0 when absent (shared-expert gradients without a shared expert) */
  int elem;     /* bytes per value: 2 = bf16, 4 = fp32 */
  void *dev;    /* backend memory (host memory on cpu) */
  void *host;   /* host copy after tool_download (the same memory on cpu) */
} tool_tensor;

typedef struct tool_layer {
  const cli_options *o;
  mok_host_layer in;          /* every input, in host memory */
  mok_context *ctx;
  mok_workspace *ws;
  void *stream;               /* cudaStream_t; NULL on cpu */
  mok_forward_args fwd;       /* backend pointers */
  mok_backward_args bwd;
  tool_tensor out[OUT_COUNT];
  void *allocs[24];           /* backend memory to free */
  int nallocs;
} tool_layer;

/* Creates the context and workspace (first, so a bad shape or backend fails fast), generates the
 * inputs and moves them to the backend. tool_layer_destroy accepts a failed or zeroed layer. */
int tool_layer_create(tool_layer *L, const cli_options *o);
void tool_layer_destroy(tool_layer *L);

/* Outputs to NaN (all bits set), so a value a call forgot to write shows. With --grad-mode f32
 * the weight gradients are main-grad buffers that backward adds to: they are zeroed instead. */
int tool_poison(tool_layer *L);

/* `runs` forward+backward pairs. With fwd_ms/bwd_ms (arrays of `runs`), each call is timed: CUDA
 * events on cuda (everything is queued first, then read), the wall clock on cpu. With --grad-mode
 * f32 the main-grad buffers are zeroed before each backward, outside the timed part. Ends with
 * mok_check. */
int tool_run(tool_layer *L, int runs, double *fwd_ms, double *bwd_ms);

/* cuda: captures one forward and one backward into CUDA graphs, which are not launched, and
 * counts the kernel nodes of each (issue 5 asks for at most 2 per direction). */
int tool_count_kernels(tool_layer *L, int *fwd, int *bwd);

/* Copies the outputs to their host buffers (nothing to do on cpu). */
int tool_download(tool_layer *L);
void tool_digests(const tool_layer *L, cli_digest d[OUT_COUNT]);

/* Compares sampled tokens (y, dx, d_topk_weights) and weight-gradient rows of the downloaded
 * outputs with mok_ref64_*; prints a table; returns the number of tensors over o->tol. */
int tool_check_ref(const tool_layer *L);

/* ep.c, on the CPU backend with R = o->ep emulated ranks of o->shape.max_tokens tokens each.
 * tool_run_ep: `mok run --ep R`, the R ranks against one rank with all R*T tokens, bit for bit;
 *   prints its result, returns the exit status.
 * tool_bench_ep: `mok bench --ep R`, a reference run, o->warmup more, then o->repeat timed runs
 *   (wall clock from the first rank's start to the last rank's end) into fwd_ms/bwd_ms; the
 *   digests of the reference and of the last run, each output over every rank in rank order;
 *   n[i] values of output i over all ranks (0: absent). Returns 0, or -1 (printed). */
int tool_run_ep(const cli_options *o);
int tool_bench_ep(const cli_options *o, double *fwd_ms, double *bwd_ms, cli_digest ref[OUT_COUNT],
                  cli_digest last[OUT_COUNT], int64_t n[OUT_COUNT]);

#endif
