/*
 * mok.c: the mok command: `mok info`, `mok run` and `mok bench` (see usage() below, or run
 * `mok --help`). Results go to stdout; progress and errors to stderr. Exit status: 0 success,
 * 1 a library call or a check failed, 2 a bad command line. This is the only code in the
 * project that ends the process; everything under it returns errors.
 */
#include <errno.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cudart.h"
#include "layer.h"
#include "mok.h"

/* ---- help ----------------------------------------------------------------------------------- */

static void usage(FILE *f) {
  fputs(
      "mok: one deterministic Mixture-of-Experts layer (routed SwiGLU experts and an optional\n"
      "shared expert), forward and backward, on NVIDIA Hopper (cuda) or on the CPU (cpu).\n"
      "\n"
      "usage: mok <command> [options]\n"
      "       mok <command> --help       (or: mok help <command>)\n"
      "       mok --version\n"
      "\n"
      "commands:\n"
      "  info    the library version, the backends built and the CUDA devices visible\n"
      "  run     one forward and backward of a benchmark layer: timings, a checksum of every\n"
      "          output, and sampled rows checked against a float64 recomputation\n"
      "  bench   forward and backward timed separately (median of repeats), TFLOP/s, and a\n"
      "          check that repeated runs give identical bits\n"
      "\n"
      "examples:\n"
      "  mok info\n"
      "  mok run --shape dsv3 --scale 1/16 --backend cpu\n"
      "  mok run --shape qwen3-30b-a3b --backend cuda --grad-mode f32\n"
      "  mok run --shape dsv3 --scale 1/16 --backend cpu --precision fp8\n"
      "  mok bench --shape dsv3 --backend cuda --repeat 50 --json dsv3.json\n"
      "\n"
      "exit status: 0 success, 1 a library call or a check failed, 2 a bad command line.\n",
      f);
}

static void layer_options_help(void) {
  printf("layer options (run and bench):\n"
         "  --shape NAME      a benchmark shape of DESIGN.md section 7 (default dsv3):\n"
         "      %-14s %6s %6s %6s %5s %3s %6s\n",
         "name", "T", "H", "I", "E", "k", "I_s");
  for (const cli_shape *s = cli_shapes; s->name; s++)
    printf("      %-14s %6lld %6lld %6lld %5d %3d %6lld  %s\n", s->name,
           (long long)s->T, (long long)s->H, (long long)s->I, s->E, s->k, (long long)s->I_s,
           s->about);
  printf(
      "  --scale 1/N       shrink T, H, I and I_s by N: H, I and I_s are rounded up to a multiple\n"
      "                    of 64 (at least 64), T is at least 1; E and k stay (default 1)\n"
      "  --tokens T        run T tokens instead of the shape's (scaled) T\n"
      "  --backend B       cuda or cpu (default cuda)\n"
      "  --device N        CUDA device (default 0)\n"
      "  --threads N       CPU worker threads, 0 = all cores (default 0)\n"
      "  --sms N           CUDA multiprocessors the kernels spread over, 0 = all (default 0);\n"
      "                    a tuning knob that never changes a bit of the results\n"
      "  --cluster C       CUDA: every GEMM in clusters of C CTAs, 2 (2 x 1 output tiles\n"
      "                    that share B; the default, also called auto) or 4 (2 x 2, which\n"
      "                    also share A); a tuning knob like --sms\n"
      "  --seed S          seed of the random inputs: the same seed gives the same inputs on\n"
      "                    every backend (default 1)\n"
      "  --grad-mode M     bf16: weight gradients written as bf16; f32: added to fp32 main-grad\n"
      "                    buffers, which mok zeroes before each backward (default bf16)\n"
      "  --precision P     bf16, or fp8: every product on e4m3 operands with fp32 scales per\n"
      "                    1 x 128 and 128 x 128 (DESIGN.md section 8); the bf16 weights are\n"
      "                    quantized once, before the runs, with mok_quantize_weights, and\n"
      "                    run's float64 check follows the same recipe (default bf16)\n"
      "  --ep R            R emulated expert-parallel ranks (a thread each; on cuda also a\n"
      "                    stream each, all on one GPU), T\n"
      "                    tokens and E/R experts each: run compares every output but the\n"
      "                    shared expert's gradients (per-rank partial sums) with one rank\n"
      "                    running all R*T tokens, bit for bit (instead of the float64 check);\n"
      "                    bench times the R ranks together (default 1)\n"
      "\n"
      "Inputs: x, dy ~ N(0,1); weights ~ N(0,1)/sqrt(fan-in); routing = top-k of a softmax of\n"
      "Gaussian logits. FLOPs (DESIGN.md section 7): forward 6*T*k*H*I + 6*T*H*I_s, backward\n"
      "twice that. Forward times include building the schedule.\n");
}

static void command_help(cli_command c) {
  if (c == CLI_INFO) {
    printf("usage: mok info\n\n"
           "Prints the library version, the backends built into it, the CUDA runtime and driver\n"
           "versions, and each CUDA device visible (name, architecture, SMs, memory). Without a\n"
           "driver or a GPU it says so and still succeeds.\n");
    return;
  }
  if (c == CLI_RUN) {
    printf(
        "usage: mok run [options]\n\n"
        "Builds one layer, generates its inputs (host), copies them to the GPU for cuda, poisons\n"
        "the outputs (NaN), runs forward and backward once (after one untimed warm-up on cuda),\n"
        "calls mok_check and prints: the time of each with TFLOP/s; a digest of every output\n"
        "(y, dx, d_topk_weights, the weight gradients) to compare runs by eye; and a check of\n"
        "sampled tokens, gradient rows and columns against the float64 recomputation of\n"
        "src/cpu/ref64.h. Exit status 1 if a call or a check fails or an output holds a NaN or\n"
        "an Inf.\n\n"
        "run options:\n"
        "  --check-tokens N  tokens whose y, dx and d_topk_weights are checked (default 8)\n"
        "  --check-rows N    rows (gate, up) or columns (down) of each weight gradient checked,\n"
        "                    at most every one there is (default: up to %d while the float64\n"
        "                    work stays under %.0e multiply-adds, at least 1; one sums over\n"
        "                    every token routed to its expert)\n"
        "  --tol X           largest relative L2 error ||got - ref|| / ||ref|| that passes\n"
        "                    (default 1e-2)\n\n",
        CLI_CHECK_ROWS, CLI_CHECK_BUDGET);
    layer_options_help();
    printf("\nexamples:\n"
           "  mok run --shape dsv3 --scale 1/16 --backend cpu\n"
           "  mok run --shape mixtral-8x7b --tokens 1024 --backend cuda --grad-mode f32\n");
    return;
  }
  if (c == CLI_BENCH) {
    printf(
        "usage: mok bench [options]\n\n"
        "Times forward and backward separately: one untimed reference run whose outputs are\n"
        "hashed, --warmup more, then --repeat timed runs (CUDA events on cuda, the wall clock\n"
        "on cpu). Prints the median, min and max ms and the median's TFLOP/s, and checks that\n"
        "the last timed run's outputs have the same bits as the reference run's (exit status 1\n"
        "if not). Last, one 64-bit hash of the reference run's outputs (\"outputs fnv64\"), by\n"
        "which builds given the same options can be compared bit for bit (tools/ab.sh does).\n\n"
        "bench options:\n"
        "  --warmup N        untimed runs before timing (default %d on cuda, %d on cpu)\n"
        "  --repeat N        timed runs (default %d on cuda, %d on cpu)\n"
        "  --json FILE       also write the results to FILE as JSON\n\n",
        CLI_CUDA_WARMUP, CLI_CPU_WARMUP, CLI_CUDA_REPEAT, CLI_CPU_REPEAT);
    layer_options_help();
    printf("\nexamples:\n"
           "  mok bench --shape qwen3-235b --backend cuda --repeat 50 --json qwen3-235b.json\n"
           "  mok bench --shape fine-7b --scale 1/8 --backend cpu\n");
    return;
  }
  usage(stdout);
}

/* ---- info ----------------------------------------------------------------------------------- */

/* "0.1.0" from MOK_VERSION's encoding, into buf[16]. */
static const char *version_text(int v, char *buf) {
  snprintf(buf, 16, "%d.%d.%d", v / 10000 % 100, v / 100 % 100, v % 100);
  return buf;
}

static int cmd_info(void) {
  char lib[16], hdr[16];
  printf("mok %s (mok.h %s)\n", version_text(mok_version(), lib), version_text(MOK_VERSION, hdr));
  printf("CPU: %d threads (OpenMP)\n", omp_get_max_threads());
#ifdef MOK_NO_CUDA
  printf("backends built: cpu (cuda: not built, no nvcc where this mok was built)\n");
  printf("CUDA devices visible: 0 (the cpu backend works)\n");
  return 0;
#endif
  printf("backends built: cpu, cuda (kernels for sm_90a)\n");
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  printf("CUDA runtime %d.%d (linked statically); driver ", rt / 1000, rt % 1000 / 10);
  if (drv) printf("supports CUDA %d.%d\n", drv / 1000, drv % 1000 / 10);
  else printf("not found\n");
  const int n = mok_cuda_device_count();
  printf("CUDA devices visible: %d", n);
  if (n == 0) {
    int m = 0;
    cudaError_t e = cudaGetDeviceCount(&m);
    if (e != cudaSuccess)
      printf(" (%s: %s; the cpu backend still works)", cudaGetErrorName(e), cudaGetErrorString(e));
    cudaGetLastError();
  }
  printf("\n");
  for (int d = 0; d < n; d++) {
    struct cudaDeviceProp p;
    cudaError_t e = cudaGetDeviceProperties(&p, d);
    if (e != cudaSuccess) {
      printf("  %d: %s: %s\n", d, cudaGetErrorName(e), cudaGetErrorString(e));
      continue;
    }
    printf("  %d: %s, sm_%d%d, %d SMs, %.1f GiB%s\n", d, p.name, p.major, p.minor,
           p.multiProcessorCount, (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0),
           p.major == 9 && p.minor == 0 ? "" : " (mok's kernels need sm_90)");
  }
  return 0;
}

/* ---- run and bench -------------------------------------------------------------------------- */

/* The first line of run and bench: what is being run, on what. */
static void print_header(const char *cmd, const cli_options *o) {
  const mok_shape *s = &o->shape;
  char v[16];
  printf("mok %s %s: %s", version_text(mok_version(), v), cmd, o->shape_name);
  if (o->scale > 1) printf(" at 1/%lld", (long long)o->scale);
  printf(", T=%lld H=%lld I=%lld I_s=%lld E=%d k=%d, backend ", (long long)s->max_tokens,
         (long long)s->hidden, (long long)s->inter, (long long)s->shared_inter, s->experts,
         s->top_k);
  struct cudaDeviceProp p;
  if (o->backend == MOK_BACKEND_CPU)
    printf("cpu (%d threads)", o->threads ? o->threads : omp_get_max_threads());
  else if (cudaGetDeviceProperties(&p, o->device) == cudaSuccess)
    printf("cuda (device %d: %s, %d of %d SMs)", o->device, p.name,
           o->sms > 0 && o->sms < p.multiProcessorCount ? o->sms : p.multiProcessorCount,
           p.multiProcessorCount);
  else
    printf("cuda (device %d)", o->device);
  if (o->backend == MOK_BACKEND_CUDA && o->cluster) printf(", clusters of %d", o->cluster);
  printf(", precision %s, seed %llu, grad-mode %s\n", o->precision == MOK_FP8 ? "fp8" : "bf16",
         (unsigned long long)o->seed, o->grad_mode == MOK_GRAD_ACCUMULATE_F32 ? "f32" : "bf16");
  fflush(stdout);
}

static double tflops(double flops, double ms) { return flops / (ms * 1e-3) / 1e12; }

/* Prints every output's digest; returns the number holding a NaN or an Inf. */
static int print_digests(const tool_layer *L, const cli_digest *d) {
  int bad = 0;
  printf("\noutputs (fnv64: FNV-1a over the FNV-1a hashes of each MiB; sum|v| of finite values)\n");
  printf("  %-15s %12s  %-16s  %-14s %s\n", "tensor", "values", "fnv64", "sum|v|", "nonfinite");
  for (int i = 0; i < OUT_COUNT; i++) {
    if (L->out[i].n == 0) continue;
    printf("  %-15s %12lld  %016llx  %-14.8e %lld%s\n", L->out[i].name, (long long)L->out[i].n,
           (unsigned long long)d[i].hash, d[i].abs_sum, (long long)d[i].nonfinite,
           d[i].nonfinite ? "  FAIL" : "");
    bad += d[i].nonfinite != 0;
  }
  return bad;
}

static int cmd_run(const cli_options *o) {
  if (o->ep > 1) {
    print_header("run", o);
    return tool_run_ep(o);
  }
  tool_layer L;
  double fwd = 0, bwd = 0, t0;
  cli_digest d[OUT_COUNT];
  int failed = 0, rc = 1;
  print_header("run", o);
  if (tool_layer_create(&L, o)) goto done;
  if (o->backend == MOK_BACKEND_CUDA) {
    t0 = tool_step("warm-up forward and backward");
    if (tool_run(&L, 1, NULL, NULL)) goto done;
    tool_done(t0);
  }
  t0 = tool_step("forward and backward");
  if (tool_poison(&L) || tool_run(&L, 1, &fwd, &bwd)) goto done; /* ends with mok_check */
  tool_done(t0);
  const double flops = cli_forward_flops(&o->shape, o->shape.max_tokens);
  printf("  forward  %12.3f ms  %9.3f TFLOP/s  (%.3g FLOP; schedule included)\n", fwd,
         tflops(flops, fwd), flops);
  printf("  backward %12.3f ms  %9.3f TFLOP/s  (%.3g FLOP)\n", bwd, tflops(2 * flops, bwd),
         2 * flops);
  printf("  mok_check: MOK_OK (no device-side error)\n");
  t0 = tool_step(o->backend == MOK_BACKEND_CUDA ? "copying outputs to the host, hashing"
                                                : "hashing outputs");
  if (tool_download(&L)) goto done;
  tool_digests(&L, d);
  tool_done(t0);
  failed += print_digests(&L, d);
  if (o->check_tokens > 0 || o->check_rows != 0) failed += tool_check_ref(&L);
  printf("\nrun: %s\n", failed ? "FAIL" : "PASS");
  rc = failed != 0;
done:
  tool_layer_destroy(&L);
  return rc;
}

static int compare_doubles(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

typedef struct stats { double median, min, max; } stats;

/* Median, min and max of v[n], sorting a copy in scratch[n]. */
static stats stats_of(const double *v, int n, double *scratch) {
  memcpy(scratch, v, (size_t)n * sizeof *v);
  qsort(scratch, (size_t)n, sizeof *v, compare_doubles);
  const double *s = scratch;
  stats r = {n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]), s[0], s[n - 1]};
  return r;
}

static void write_json_times(FILE *f, const char *key, const double *v, int n) {
  fprintf(f, "  \"%s\": [", key);
  for (int i = 0; i < n; i++) fprintf(f, "%s%.6f", i ? ", " : "", v[i]);
  fprintf(f, "],\n");
}

/* A JSON string: quotes, backslashes and control characters escaped. */
static void json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') fprintf(f, "\\%c", *s);
    else if ((unsigned char)*s < 0x20) fprintf(f, "\\u%04x", (unsigned)*s);
    else fputc(*s, f);
  }
  fputc('"', f);
}

/* flops: of one forward (of every rank's tokens with --ep). Writes into j, which the bench
 * opened before it ran. */
static int write_json(FILE *j, const cli_options *o, double flops, stats f, stats b,
                      const double *fv, const double *bv, const int kernels[2], int identical,
                      uint64_t bits) {
  const mok_shape *s = &o->shape;
  char v[16];
  fprintf(j, "{\n  \"mok_version\": \"%s\",\n  \"shape\": \"%s\",\n  \"scale\": %lld,\n",
          version_text(mok_version(), v), o->shape_name, (long long)o->scale);
  fprintf(j, "  \"T\": %lld, \"H\": %lld, \"I\": %lld, \"I_s\": %lld, \"E\": %d, \"k\": %d,\n",
          (long long)s->max_tokens, (long long)s->hidden, (long long)s->inter,
          (long long)s->shared_inter, s->experts, s->top_k);
  struct cudaDeviceProp p;
  const int cuda = o->backend == MOK_BACKEND_CUDA;
  fprintf(j, "  \"backend\": \"%s\", \"device\": ", cuda ? "cuda" : "cpu");
  json_string(j, !cuda ? "cpu"
                 : cudaGetDeviceProperties(&p, o->device) == cudaSuccess ? p.name : "unknown");
  fprintf(j, ", \"threads\": %d, \"sms\": %d, \"cluster\": ",
          cuda ? 0 : o->threads ? o->threads : omp_get_max_threads(), cuda ? o->sms : 0);
  if (cuda) fprintf(j, "%d", o->cluster ? o->cluster : 2); /* auto (0) is 2 */
  else fprintf(j, "null");
  fprintf(j, ", \"seed\": %llu,\n", (unsigned long long)o->seed);
  fprintf(j, "  \"grad_mode\": \"%s\", \"precision\": \"%s\", \"ep\": %d, \"warmup\": %d, "
          "\"repeat\": %d,\n", o->grad_mode == MOK_GRAD_ACCUMULATE_F32 ? "f32" : "bf16",
          o->precision == MOK_FP8 ? "fp8" : "bf16", o->ep, o->warmup, o->repeat);
  fprintf(j, "  \"forward_flops\": %.6e, \"backward_flops\": %.6e,\n", flops, 2 * flops);
  fprintf(j, "  \"forward_ms\": %.6f, \"forward_ms_min\": %.6f, \"forward_ms_max\": %.6f,\n",
          f.median, f.min, f.max);
  fprintf(j, "  \"backward_ms\": %.6f, \"backward_ms_min\": %.6f, \"backward_ms_max\": %.6f,\n",
          b.median, b.min, b.max);
  fprintf(j, "  \"forward_tflops\": %.6f, \"backward_tflops\": %.6f,\n",
          tflops(flops, f.median), tflops(2 * flops, b.median));
  write_json_times(j, "forward_ms_all", fv, o->repeat);
  write_json_times(j, "backward_ms_all", bv, o->repeat);
  if (kernels[0])
    fprintf(j, "  \"forward_kernels\": %d, \"backward_kernels\": %d,\n", kernels[0], kernels[1]);
  fprintf(j, "  \"identical_bits\": %s, \"outputs_fnv64\": \"%016llx\"\n}\n",
          identical ? "true" : "false", (unsigned long long)bits);
  if (fclose(j) != 0) {
    tool_error("cannot write %s", o->json);
    return -1;
  }
  return 0;
}

/* One layer: a reference run, warm-ups, then o->repeat timed runs; the same as tool_bench_ep. */
static int bench_layer(const cli_options *o, double *fv, double *bv, cli_digest ref[OUT_COUNT],
                       cli_digest last[OUT_COUNT], int64_t n[OUT_COUNT], int kernels[2]) {
  tool_layer L;
  int rc = -1;
  if (tool_layer_create(&L, o)) goto done;
  double t0 = tool_step("reference run and %d warm-up runs", o->warmup);
  if (tool_poison(&L) || tool_run(&L, 1, NULL, NULL) || tool_download(&L)) goto done;
  tool_digests(&L, ref);
  if (o->warmup && tool_run(&L, o->warmup, NULL, NULL)) goto done;
  tool_done(t0);
  t0 = tool_step("%d timed runs", o->repeat);
  if (tool_poison(&L) || tool_run(&L, o->repeat, fv, bv) || tool_download(&L)) goto done;
  tool_digests(&L, last);
  tool_done(t0);
  /* Last, and not a failure of the benchmark if it fails (it says why): nothing runs after it. */
  if (tool_count_kernels(&L, &kernels[0], &kernels[1])) kernels[0] = kernels[1] = 0;
  for (int i = 0; i < OUT_COUNT; i++) n[i] = L.out[i].n;
  rc = 0;
done:
  tool_layer_destroy(&L);
  return rc;
}

static int cmd_bench(const cli_options *o) {
  /* The JSON file is opened first: a path that cannot be written fails before the benchmark. */
  FILE *json = o->json ? fopen(o->json, "w") : NULL;
  if (o->json && !json) {
    tool_error("--json %s: %s; nothing was run", o->json, strerror(errno));
    return 2;
  }
  cli_digest ref[OUT_COUNT], last[OUT_COUNT];
  int64_t n[OUT_COUNT];
  double *fv = calloc(3 * (size_t)o->repeat, sizeof *fv); /* forward, backward ms, scratch */
  double *bv = fv + o->repeat;
  int rc = 1;
  print_header("bench", o);
  if (!fv) {
    tool_error("no host memory for %d timings", o->repeat);
    goto done;
  }
  const int ep = o->ep > 1;
  int kernels[2] = {0, 0}; /* per forward, per backward (cuda at ep = 1) */
  if (ep ? tool_bench_ep(o, fv, bv, ref, last, n) : bench_layer(o, fv, bv, ref, last, n, kernels))
    goto done;
  const double flops = cli_forward_flops(&o->shape, o->shape.max_tokens * o->ep);
  const stats f = stats_of(fv, o->repeat, bv + o->repeat);
  const stats b = stats_of(bv, o->repeat, bv + o->repeat);
  if (ep)
    printf("  %d timed runs on %d ranks after the reference run and %d warm-up runs (wall clock, "
           "first start to last end; global batch of %lld tokens)\n", o->repeat, o->ep,
           o->warmup, (long long)(o->shape.max_tokens * o->ep));
  else
    printf("  %d timed runs after the reference run and %d warm-up runs (%s)\n", o->repeat,
           o->warmup, o->backend == MOK_BACKEND_CUDA ? "CUDA events" : "wall clock");
  printf("  %-9s %12s %12s %12s %10s\n", "", "median ms", "min ms", "max ms", "TFLOP/s");
  printf("  %-9s %12.3f %12.3f %12.3f %10.3f\n", "forward", f.median, f.min, f.max,
         tflops(flops, f.median));
  printf("  %-9s %12.3f %12.3f %12.3f %10.3f\n", "backward", b.median, b.min, b.max,
         tflops(2 * flops, b.median));
  if (kernels[0])
    printf("  kernels per call (CUDA graph kernel nodes): forward %d, backward %d\n", kernels[0],
           kernels[1]);
  int identical = 1, nonfinite = 0;
  printf("  repeated bits:");
  for (int i = 0; i < OUT_COUNT; i++) {
    if (n[i] == 0) continue;
    if (ref[i].hash != last[i].hash) {
      printf(" %s differs", tool_output_names[i]);
      identical = 0;
    }
    nonfinite += last[i].nonfinite != 0;
  }
  printf("%s\n", identical ? " identical (every output of the last timed run = the reference run)"
                           : "");
  const uint64_t bits = cli_digest_join(ref, n, OUT_COUNT);
  printf("  outputs fnv64: %016llx (the reference run's outputs, all in one hash)\n",
         (unsigned long long)bits);
  if (nonfinite) printf("  %d outputs hold NaN or Inf\n", nonfinite);
  rc = !identical || nonfinite;
  if (json && write_json(json, o, flops, f, b, fv, bv, kernels, identical, bits)) rc = 1;
  json = NULL; /* written and closed */
  printf("bench: %s\n", rc ? "FAIL" : "PASS");
done:
  if (json) { /* the benchmark did not run to the end: no file is left that says it did */
    fclose(json);
    remove(o->json);
  }
  free(fv);
  return rc;
}

int main(int argc, char **argv) {
  cli_options o;
  char err[512];
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (cli_parse(argc, argv, &o, err, sizeof err)) {
    fprintf(stderr, "mok: %s\nsee 'mok %s%s--help'\n", err, o.cmd ? argv[1] : "",
            o.cmd ? " " : "");
    return 2;
  }
  if (o.help) {
    command_help(o.cmd);
    return 0;
  }
  if (o.version) {
    char v[16];
    printf("mok %s\n", version_text(mok_version(), v));
    return 0;
  }
  if (o.threads > 0) omp_set_num_threads(o.threads);
  switch (o.cmd) {
    case CLI_INFO: return cmd_info();
    case CLI_RUN: return cmd_run(&o);
    case CLI_BENCH: return cmd_bench(&o);
    case CLI_HELP: break;
  }
  usage(stdout);
  return 0;
}
