/*
 * cli.h: the parts of the mok command that tests can call: the benchmark shapes of DESIGN.md §7,
 * scaling them down, parsing the command line, FLOP counts and output digests. Nothing here
 * prints or exits; mok.c does both.
 */
#ifndef MOK_TOOLS_CLI_H
#define MOK_TOOLS_CLI_H

#include <stddef.h>
#include <stdint.h>

#include "mok.h"

/* One row of the DESIGN.md §7 table. */
typedef struct cli_shape {
  const char *name;
  int64_t T, H, I, I_s; /* tokens per GPU, hidden, routed and shared intermediate sizes */
  int32_t E, k;         /* experts, experts per token */
  const char *about;
} cli_shape;

/* The table, ending with a row whose name is NULL. */
extern const cli_shape cli_shapes[];
/* The row called `name`, or NULL. */
const cli_shape *cli_shape_find(const char *name);

/* The shape shrunk by `scale` (N of "1/N"): T becomes ceil(T/N), at least 1; H, I and I_s become
 * ceil(v/N) rounded up to a multiple of 64, at least 64 (I_s = 0 stays 0); E and k are kept.
 * tokens > 0 then replaces T. */
mok_shape cli_scale(const cli_shape *s, int64_t scale, int64_t tokens);

typedef enum cli_command { CLI_HELP = 0, CLI_INFO, CLI_RUN, CLI_BENCH } cli_command;

/* Options whose default is decided later (by the backend, or by the size of the check). */
#define CLI_DEFAULT (-1)

typedef struct cli_options {
  cli_command cmd;
  int help;                 /* --help was given: print the command's help */
  int version;              /* --version was given: print the version */
  const char *shape_name;   /* --shape, default "dsv3" */
  int64_t scale;            /* --scale 1/N: N, default 1 */
  int64_t tokens;           /* --tokens, 0 = the shape's (scaled) */
  mok_backend backend;      /* --backend, default cuda */
  int device;               /* --device, default 0 */
  uint64_t seed;            /* --seed, default 1 */
  int threads;              /* --threads, default 0 (all cores) */
  int sms;                  /* --sms, default 0 (all): mok_context_config.sms */
  int cluster;              /* --cluster, default auto (0, which is 2): mok_context_config.cluster */
  int ep;                   /* --ep, default 1: emulated expert-parallel ranks (CPU) */
  mok_grad_mode grad_mode;  /* --grad-mode, default bf16 */
  mok_precision precision;  /* --precision, default bf16 (DESIGN.md §8: fp8) */
  int check_tokens;         /* run --check-tokens, default 8 */
  int check_rows;           /* run --check-rows, default CLI_DEFAULT: see CLI_CHECK_ROWS */
  double tol;               /* run --tol, default 1e-2 */
  int warmup, repeat;       /* bench --warmup, --repeat; CLI_DEFAULT until cli_parse ends */
  const char *json;         /* bench --json FILE, NULL = none */
  mok_shape shape;          /* filled by cli_parse: the layer after --scale and --tokens, at
                             * --precision */
} cli_options;

/* run checks, by default, up to CLI_CHECK_ROWS rows (columns of the down gradients) of each
 * weight gradient while the float64 recomputation's estimated multiply-adds stay within
 * CLI_CHECK_BUDGET (at least one each: one sums over every token routed to its expert, about
 * 4 H multiply-adds a token). CLI_CHECK_RATE: the float64 multiply-adds a thread does per second
 * (measured on a 2026 x86 core, a little under), for the estimate printed before the check. */
#define CLI_CHECK_ROWS 4
#define CLI_CHECK_BUDGET 1e11
#define CLI_CHECK_RATE 4e8

/* bench defaults: warm-ups and timed repeats per backend. */
#define CLI_CUDA_WARMUP 5
#define CLI_CUDA_REPEAT 20
#define CLI_CPU_WARMUP 1
#define CLI_CPU_REPEAT 3

/* Parses argv (argv[0] is the program). Returns 0, or -1 with a one-line message in err. */
int cli_parse(int argc, char **argv, cli_options *o, char *err, size_t errlen);

/* DESIGN.md §7: forward 6*T*k*H*I + 6*T*H*I_s; backward twice that. */
double cli_forward_flops(const mok_shape *s, int64_t tokens);

/* What `mok run` prints for an output tensor so that two runs can be compared by eye. */
typedef struct cli_digest {
  uint64_t hash;      /* 64-bit FNV-1a of the per-MiB FNV-1a hashes of the bytes (chunks hash in
                         parallel; the value depends on the bytes only) */
  double abs_sum;     /* sum of |value| over the finite values: per MiB chunk, chunks in order */
  int64_t nonfinite;  /* NaN and Inf values */
} cli_digest;

/* n values of `elem_bytes` bytes each: 2 = bf16, 4 = fp32. */
cli_digest cli_digest_of(const void *p, int64_t n, int elem_bytes);

/* One hash of several outputs: FNV-1a over the hashes of those with n[i] > 0, in order (each as
 * 8 little-endian bytes). What `mok bench` prints, so that builds can be compared by their bits
 * without a second run. */
uint64_t cli_digest_join(const cli_digest *d, const int64_t *n, int count);

#endif
