/*
 * cli.c: the benchmark shapes, their scaling, the command-line parser and the output digests of
 * the mok command. Pure functions: errors come back as a message, never printed or exited on.
 */
#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mok_gen.h"

const cli_shape cli_shapes[] = {
    {"dsv3", 4096, 7168, 2048, 2048, 32, 8, "DeepSeek-V3, one GPU's slice at EP 8"},
    {"qwen3-30b-a3b", 16384, 2048, 768, 0, 128, 8, "Qwen3-30B-A3B"},
    {"qwen3-235b", 32768, 4096, 1536, 0, 128, 8, "Qwen3-235B-A22B"},
    {"mixtral-8x7b", 8192, 4096, 14336, 0, 8, 2, "Mixtral 8x7B"},
    {"gpt-oss-120b", 16384, 2880, 2880, 0, 128, 4, "gpt-oss-120b"},
    {"fine-7b", 24576, 1536, 256, 0, 128, 8, "fine-grained 7B-class experts"},
    {NULL, 0, 0, 0, 0, 0, 0, NULL},
};

const cli_shape *cli_shape_find(const char *name) {
  for (const cli_shape *s = cli_shapes; s->name; s++)
    if (strcmp(s->name, name) == 0) return s;
  return NULL;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static int64_t scale_dim(int64_t v, int64_t n) {
  if (v == 0) return 0;
  int64_t d = ceil_div(ceil_div(v, n), 64) * 64;
  return d < 64 ? 64 : d;
}

mok_shape cli_scale(const cli_shape *s, int64_t scale, int64_t tokens) {
  mok_shape m = MOK_SHAPE_INIT;
  m.max_tokens = tokens > 0 ? tokens : ceil_div(s->T, scale);
  m.hidden = scale_dim(s->H, scale);
  m.inter = scale_dim(s->I, scale);
  m.shared_inter = scale_dim(s->I_s, scale);
  m.experts = s->E;
  m.top_k = s->k;
  return m;
}

double cli_forward_flops(const mok_shape *s, int64_t tokens) {
  double T = (double)tokens, H = (double)s->hidden;
  return 6.0 * T * s->top_k * H * (double)s->inter + 6.0 * T * H * (double)s->shared_inter;
}

/* ---- parsing -------------------------------------------------------------------------------- */

enum { FOR_RUN = 1, FOR_BENCH = 2, FOR_BOTH = 3 };

typedef enum opt_id {
  OPT_SHAPE, OPT_SCALE, OPT_TOKENS, OPT_BACKEND, OPT_DEVICE, OPT_SEED, OPT_THREADS, OPT_SMS,
  OPT_CLUSTER, OPT_GRAD_MODE, OPT_PRECISION,
  OPT_CHECK_TOKENS, OPT_CHECK_ROWS, OPT_TOL, OPT_WARMUP, OPT_REPEAT, OPT_JSON, OPT_EP
} opt_id;

static const struct {
  const char *name;
  opt_id id;
  int commands;
} options[] = {
    {"shape", OPT_SHAPE, FOR_BOTH},         {"scale", OPT_SCALE, FOR_BOTH},
    {"tokens", OPT_TOKENS, FOR_BOTH},       {"backend", OPT_BACKEND, FOR_BOTH},
    {"device", OPT_DEVICE, FOR_BOTH},       {"seed", OPT_SEED, FOR_BOTH},
    {"threads", OPT_THREADS, FOR_BOTH},     {"sms", OPT_SMS, FOR_BOTH},
    {"cluster", OPT_CLUSTER, FOR_BOTH},
    {"grad-mode", OPT_GRAD_MODE, FOR_BOTH}, {"precision", OPT_PRECISION, FOR_BOTH},
    {"check-tokens", OPT_CHECK_TOKENS, FOR_RUN}, {"check-rows", OPT_CHECK_ROWS, FOR_RUN},
    {"tol", OPT_TOL, FOR_RUN},              {"warmup", OPT_WARMUP, FOR_BENCH},
    {"repeat", OPT_REPEAT, FOR_BENCH},      {"json", OPT_JSON, FOR_BENCH},
    {"ep", OPT_EP, FOR_BOTH},
};

static const char *command_names[] = {"help", "info", "run", "bench"};

static int fail(char *err, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, len, fmt, ap);
  va_end(ap);
  return -1;
}

/* A whole decimal integer in [lo, hi]. */
static int parse_int(const char *s, int64_t lo, int64_t hi, int64_t *out) {
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

static void set_defaults(cli_options *o) {
  memset(o, 0, sizeof *o);
  o->shape_name = "dsv3";
  o->scale = 1;
  o->backend = MOK_BACKEND_CUDA;
  o->seed = 1;
  o->grad_mode = MOK_GRAD_WRITE_BF16;
  o->precision = MOK_BF16;
  o->check_tokens = 8;
  o->check_rows = CLI_DEFAULT;
  o->tol = 1e-2;
  o->warmup = o->repeat = CLI_DEFAULT;
  o->ep = 1;
}

/* An int option: a whole number in [lo, INT32_MAX]. */
static int set_int(int *dst, const char *name, const char *v, int lo, char *err, size_t len) {
  int64_t n;
  if (parse_int(v, lo, INT32_MAX, &n))
    return fail(err, len, "--%s '%s': expected an integer >= %d", name, v, lo);
  *dst = (int)n;
  return 0;
}

/* Applies one option's value. */
static int apply(cli_options *o, opt_id id, const char *name, const char *v, char *err,
                 size_t len) {
  int64_t n = 0;
  char *end;
  switch (id) {
    case OPT_SHAPE: o->shape_name = v; return 0;
    case OPT_SCALE:
      if (strcmp(v, "1") == 0) n = 1;
      else if (strncmp(v, "1/", 2) != 0 || parse_int(v + 2, 1, INT32_MAX, &n))
        return fail(err, len, "--scale '%s': expected 1/N with N a positive integer, e.g. 1/16", v);
      o->scale = n;
      return 0;
    case OPT_TOKENS:
      if (parse_int(v, 1, MOK_MAX_TOKENS, &n))
        return fail(err, len, "--tokens '%s': expected an integer 1..%d (the library's limit, "
                    "MOK_MAX_TOKENS)", v, MOK_MAX_TOKENS);
      o->tokens = n;
      return 0;
    case OPT_BACKEND:
      if (strcmp(v, "cpu") == 0) o->backend = MOK_BACKEND_CPU;
      else if (strcmp(v, "cuda") == 0) o->backend = MOK_BACKEND_CUDA;
      else return fail(err, len, "--backend '%s': expected cpu or cuda", v);
      return 0;
    case OPT_GRAD_MODE:
      if (strcmp(v, "bf16") == 0) o->grad_mode = MOK_GRAD_WRITE_BF16;
      else if (strcmp(v, "f32") == 0) o->grad_mode = MOK_GRAD_ACCUMULATE_F32;
      else return fail(err, len, "--grad-mode '%s': expected bf16 or f32", v);
      return 0;
    case OPT_PRECISION:
      if (strcmp(v, "bf16") == 0) o->precision = MOK_BF16;
      else if (strcmp(v, "fp8") == 0) o->precision = MOK_FP8;
      else return fail(err, len, "--precision '%s': expected bf16 or fp8", v);
      return 0;
    case OPT_SEED:
      errno = 0;
      o->seed = strtoull(v, &end, 10);
      if (errno || end == v || *end || !isdigit((unsigned char)v[0])) /* strtoull takes " -1" */
        return fail(err, len, "--seed '%s': expected an integer >= 0", v);
      return 0;
    case OPT_TOL:
      o->tol = strtod(v, &end);
      if (end == v || *end || !(o->tol > 0) || !isfinite(o->tol))
        return fail(err, len, "--tol '%s': expected a number > 0, e.g. 1e-2", v);
      return 0;
    case OPT_CLUSTER:
      if (strcmp(v, "auto") == 0) o->cluster = 0;
      else if (strcmp(v, "2") == 0 || strcmp(v, "4") == 0) o->cluster = v[0] - '0';
      else return fail(err, len, "--cluster '%s': expected 2, 4 or auto", v);
      return 0;
    case OPT_JSON: o->json = v; return 0;
    case OPT_DEVICE: return set_int(&o->device, name, v, 0, err, len);
    case OPT_THREADS:
      if (set_int(&o->threads, name, v, 0, err, len)) return -1;
      if (o->threads > MOK_MAX_THREADS)
        return fail(err, len, "--threads %d: expected 0..%d (0 = all cores)", o->threads,
                    MOK_MAX_THREADS);
      return 0;
    case OPT_SMS: return set_int(&o->sms, name, v, 0, err, len);
    case OPT_CHECK_TOKENS: return set_int(&o->check_tokens, name, v, 0, err, len);
    case OPT_CHECK_ROWS: return set_int(&o->check_rows, name, v, 0, err, len);
    case OPT_WARMUP: return set_int(&o->warmup, name, v, 0, err, len);
    case OPT_REPEAT: return set_int(&o->repeat, name, v, 1, err, len);
    case OPT_EP:
      if (set_int(&o->ep, name, v, 1, err, len)) return -1;
      if (o->ep > MOK_EP_MAX) return fail(err, len, "--ep %d: expected 1..%d", o->ep, MOK_EP_MAX);
      return 0;
  }
  return fail(err, len, "--%s: not handled", name);
}

/* The shape and the backend-dependent defaults, once every option is known. */
static int resolve(cli_options *o, char *err, size_t len) {
  const cli_shape *s = cli_shape_find(o->shape_name);
  if (!s) {
    char names[256] = "";
    for (const cli_shape *r = cli_shapes; r->name; r++)
      snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s",
               r == cli_shapes ? "" : ", ", r->name);
    return fail(err, len, "--shape '%s': expected one of %s", o->shape_name, names);
  }
  o->shape = cli_scale(s, o->scale, o->tokens);
  o->shape.precision = o->precision;
  int cuda = o->backend == MOK_BACKEND_CUDA;
  if (o->shape.experts % o->ep != 0)
    return fail(err, len, "--ep %d: the shape's %d experts do not split over %d ranks", o->ep,
                o->shape.experts, o->ep);
  if (o->warmup == CLI_DEFAULT) o->warmup = cuda ? CLI_CUDA_WARMUP : CLI_CPU_WARMUP;
  if (o->repeat == CLI_DEFAULT) o->repeat = cuda ? CLI_CUDA_REPEAT : CLI_CPU_REPEAT;
  return 0;
}

int cli_parse(int argc, char **argv, cli_options *o, char *err, size_t len) {
  set_defaults(o);
  if (argc < 2) return fail(err, len, "no command given; expected info, run or bench");
  const char *c = argv[1];
  int i = 2;
  if (strcmp(c, "--version") == 0 || strcmp(c, "-V") == 0) {
    o->version = 1;
    return argc > 2 ? fail(err, len, "%s takes no arguments", c) : 0;
  }
  if (strcmp(c, "--help") == 0 || strcmp(c, "-h") == 0 || strcmp(c, "help") == 0) {
    o->help = 1;
    if (strcmp(c, "help") != 0 || argc < 3) return 0;
    c = argv[2]; /* mok help CMD */
    i = argc;
  }
  int found = 0;
  for (int k = 1; k < 4; k++)
    if (strcmp(c, command_names[k]) == 0) { o->cmd = (cli_command)k; found = 1; }
  if (!found) return fail(err, len, "unknown command '%s'; expected info, run or bench", c);
  const int mask = o->cmd == CLI_RUN ? FOR_RUN : o->cmd == CLI_BENCH ? FOR_BENCH : 0;
  for (; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) { o->help = 1; return 0; }
    if (strncmp(a, "--", 2) != 0)
      return fail(err, len, "mok %s: unexpected argument '%s'", c, a);
    const char *eq = strchr(a, '=');
    size_t nlen = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
    int k = -1;
    for (size_t j = 0; j < sizeof options / sizeof options[0]; j++)
      if (strlen(options[j].name) == nlen && strncmp(options[j].name, a + 2, nlen) == 0) k = (int)j;
    if (k < 0 || !(options[k].commands & mask))
      return fail(err, len, "mok %s: unknown option '%.*s'", c, (int)nlen + 2, a);
    const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
    if (!v) return fail(err, len, "mok %s: option '%s' needs a value", c, a);
    if (apply(o, options[k].id, options[k].name, v, err, len)) return -1;
  }
  return o->cmd == CLI_INFO ? 0 : resolve(o, err, len);
}

/* ---- digests -------------------------------------------------------------------------------- */

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull
#define DIGEST_CHUNK ((int64_t)1 << 20) /* bytes */

static uint64_t fnv1a(uint64_t h, const unsigned char *p, size_t n) {
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * FNV_PRIME;
  return h;
}

/* h extended by the 8 bytes of x, little-endian whatever the host. */
static uint64_t fnv1a_u64(uint64_t h, uint64_t x) {
  unsigned char le[8];
  for (int j = 0; j < 8; j++) le[j] = (unsigned char)(x >> (8 * j));
  return fnv1a(h, le, 8);
}

cli_digest cli_digest_of(const void *p, int64_t n, int elem_bytes) {
  const unsigned char *b = p;
  const int64_t bytes = n * elem_bytes;
  const int64_t chunks = (bytes + DIGEST_CHUNK - 1) / DIGEST_CHUNK;
  uint64_t *hash = malloc((size_t)(chunks ? chunks : 1) * sizeof *hash);
  double *sum = malloc((size_t)(chunks ? chunks : 1) * sizeof *sum);
  int64_t *bad = malloc((size_t)(chunks ? chunks : 1) * sizeof *bad);
  cli_digest d = {FNV_OFFSET, 0.0, 0};
  if (!hash || !sum || !bad) {
    free(hash); free(sum); free(bad);
    d.nonfinite = -1; /* never happens at the sizes mok runs; reads as "not computed" */
    return d;
  }
  #pragma omp parallel for schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t lo = c * DIGEST_CHUNK, hi = lo + DIGEST_CHUNK < bytes ? lo + DIGEST_CHUNK : bytes;
    hash[c] = fnv1a(FNV_OFFSET, b + lo, (size_t)(hi - lo));
    double s = 0.0;
    int64_t nf = 0;
    for (int64_t i = lo; i < hi; i += elem_bytes) {
      float v;
      if (elem_bytes == 2) {
        uint16_t u;
        memcpy(&u, b + i, 2);
        v = mok_bf16_to_f32(u);
      } else {
        memcpy(&v, b + i, 4);
      }
      if (isfinite(v)) s += fabs((double)v); else nf++;
    }
    sum[c] = s;
    bad[c] = nf;
  }
  for (int64_t c = 0; c < chunks; c++) {
    d.hash = fnv1a_u64(d.hash, hash[c]);
    d.abs_sum += sum[c];
    d.nonfinite += bad[c];
  }
  free(hash); free(sum); free(bad);
  return d;
}

uint64_t cli_digest_join(const cli_digest *d, const int64_t *n, int count) {
  uint64_t h = FNV_OFFSET;
  for (int i = 0; i < count; i++)
    if (n[i] > 0) h = fnv1a_u64(h, d[i].hash);
  return h;
}
