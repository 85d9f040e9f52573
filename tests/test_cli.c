/* test_cli.c: the mok command's parsing and digests (tools/cli.c): the DESIGN.md §7 shapes, --scale, option
 * parsing and its error messages, FLOP counts, output digests. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "../tools/cli.h"
#include "check.h"
#include "mok_gen.h"

/* Parses a command line given as one string (words split on spaces). */
static int parse(const char *line, cli_options *o, char *err, size_t len) {
  static char buf[512];
  char *argv[64];
  int argc = 0;
  snprintf(buf, sizeof buf, "%s", line);
  for (char *w = strtok(buf, " "); w && argc < 64; w = strtok(NULL, " ")) argv[argc++] = w;
  err[0] = 0;
  return cli_parse(argc, argv, o, err, len);
}

static void shapes(void) {
  int n = 0;
  for (const cli_shape *s = cli_shapes; s->name; s++) n++;
  CHECK(n == 6, "%d shapes; DESIGN.md §7 has 6", n);
  const cli_shape *d = cli_shape_find("dsv3");
  CHECK(d && d->T == 4096 && d->H == 7168 && d->I == 2048 && d->E == 32 && d->k == 8 &&
            d->I_s == 2048, "dsv3 row");
  const cli_shape *m = cli_shape_find("mixtral-8x7b");
  CHECK(m && m->T == 8192 && m->H == 4096 && m->I == 14336 && m->E == 8 && m->k == 2 &&
            m->I_s == 0, "mixtral row");
  CHECK(cli_shape_find("dsv4") == NULL, "unknown shape found");
}

static void scaling(void) {
  mok_shape s = cli_scale(cli_shape_find("dsv3"), 16, 0);
  CHECK(s.max_tokens == 256 && s.hidden == 448 && s.inter == 128 && s.shared_inter == 128 &&
            s.experts == 32 && s.top_k == 8, "dsv3 1/16: T=%lld H=%lld I=%lld I_s=%lld",
        (long long)s.max_tokens, (long long)s.hidden, (long long)s.inter,
        (long long)s.shared_inter);
  s = cli_scale(cli_shape_find("dsv3"), 1, 0);
  CHECK(s.max_tokens == 4096 && s.hidden == 7168 && s.inter == 2048, "1/1 keeps the shape");
  /* fine-7b 1/16: H 96 -> 128, I 16 -> 64, I_s 0 stays 0. */
  s = cli_scale(cli_shape_find("fine-7b"), 16, 0);
  CHECK(s.max_tokens == 1536 && s.hidden == 128 && s.inter == 64 && s.shared_inter == 0,
        "fine-7b 1/16: T=%lld H=%lld I=%lld I_s=%lld", (long long)s.max_tokens,
        (long long)s.hidden, (long long)s.inter, (long long)s.shared_inter);
  /* gpt-oss 1/3: T ceil(16384/3) = 5462, H = I = 960 exactly. */
  s = cli_scale(cli_shape_find("gpt-oss-120b"), 3, 0);
  CHECK(s.max_tokens == 5462 && s.hidden == 960 && s.inter == 960, "gpt-oss 1/3");
  /* Huge N: T at least 1, sizes at least 64. */
  s = cli_scale(cli_shape_find("qwen3-235b"), 1000000, 0);
  CHECK(s.max_tokens == 1 && s.hidden == 64 && s.inter == 64 && s.experts == 128 &&
            s.top_k == 8, "1/1000000: T=%lld H=%lld", (long long)s.max_tokens,
        (long long)s.hidden);
  s = cli_scale(cli_shape_find("dsv3"), 16, 5);
  CHECK(s.max_tokens == 5 && s.hidden == 448, "--tokens replaces the scaled T");
}

static void parse_defaults(void) {
  cli_options o;
  char err[256];
  CHECK(parse("mok run", &o, err, sizeof err) == 0, "%s", err);
  CHECK(o.cmd == CLI_RUN && !o.help && strcmp(o.shape_name, "dsv3") == 0 && o.scale == 1 &&
            o.backend == MOK_BACKEND_CUDA && o.seed == 1 && o.threads == 0 &&
            o.grad_mode == MOK_GRAD_WRITE_BF16 && o.check_tokens == 8 &&
            o.check_rows == CLI_DEFAULT && o.tol == 1e-2 && o.json == NULL &&
            o.shape.max_tokens == 4096 && o.precision == MOK_BF16 &&
            o.shape.precision == MOK_BF16,
        "run defaults");
  CHECK(parse("mok bench", &o, err, sizeof err) == 0, "%s", err);
  CHECK(o.warmup == CLI_CUDA_WARMUP && o.repeat == CLI_CUDA_REPEAT, "cuda bench defaults");
  CHECK(parse("mok bench --backend cpu", &o, err, sizeof err) == 0, "%s", err);
  CHECK(o.warmup == CLI_CPU_WARMUP && o.repeat == CLI_CPU_REPEAT, "cpu bench defaults");
  CHECK(parse("mok info", &o, err, sizeof err) == 0 && o.cmd == CLI_INFO, "info");
}

static void parse_values(void) {
  cli_options o;
  char err[256];
  CHECK(parse("mok run --shape fine-7b --scale=1/8 --tokens 100 --backend cpu --seed 7 --sms 66 "
              "--threads 2 --grad-mode f32 --check-tokens 3 --check-rows=0 --tol 0.5 --device 1",
              &o, err, sizeof err) == 0, "%s", err);
  CHECK(strcmp(o.shape_name, "fine-7b") == 0 && o.scale == 8 && o.tokens == 100 &&
            o.backend == MOK_BACKEND_CPU && o.seed == 7 && o.threads == 2 &&
            o.grad_mode == MOK_GRAD_ACCUMULATE_F32 && o.check_tokens == 3 &&
            o.check_rows == 0 && o.tol == 0.5 && o.device == 1 && o.sms == 66,
        "run values");
  CHECK(o.shape.max_tokens == 100 && o.shape.hidden == 192 && o.shape.inter == 64,
        "fine-7b 1/8 with 100 tokens: H=%lld I=%lld", (long long)o.shape.hidden,
        (long long)o.shape.inter);
  CHECK(parse("mok bench --warmup 0 --repeat 9 --json out.json --scale 1", &o, err,
              sizeof err) == 0, "%s", err);
  CHECK(o.warmup == 0 && o.repeat == 9 && strcmp(o.json, "out.json") == 0 && o.scale == 1,
        "bench values");
  CHECK(o.cluster == 0, "--cluster defaults to auto");
  CHECK(parse("mok bench --cluster 4", &o, err, sizeof err) == 0 && o.cluster == 4,
        "--cluster 4");
  CHECK(parse("mok run --cluster 2 --cluster auto", &o, err, sizeof err) == 0 && o.cluster == 0,
        "--cluster auto after 2");
  CHECK(parse("mok bench --precision fp8", &o, err, sizeof err) == 0 &&
            o.precision == MOK_FP8 && o.shape.precision == MOK_FP8,
        "--precision fp8 reaches the shape");
  CHECK(parse("mok run --precision fp8 --precision bf16", &o, err, sizeof err) == 0 &&
            o.shape.precision == MOK_BF16, "--precision bf16 after fp8");
}

static void parse_help(void) {
  cli_options o;
  char err[256];
  CHECK(parse("mok --help", &o, err, sizeof err) == 0 && o.help && o.cmd == CLI_HELP, "--help");
  CHECK(parse("mok help bench", &o, err, sizeof err) == 0 && o.help && o.cmd == CLI_BENCH,
        "help bench");
  CHECK(parse("mok run --shape nope --help", &o, err, sizeof err) == 0 && o.help &&
            o.cmd == CLI_RUN, "run --help wins over a bad shape");
  CHECK(parse("mok --version", &o, err, sizeof err) == 0 && o.version && !o.help, "--version");
  CHECK(parse("mok -V", &o, err, sizeof err) == 0 && o.version, "-V");
}

/* Each bad line fails with a message containing `want`. */
static void parse_errors(void) {
  static const char *bad[][2] = {
      {"mok", "no command"},
      {"mok frobnicate", "unknown command 'frobnicate'"},
      {"mok help frobnicate", "unknown command 'frobnicate'"},
      {"mok run --frob 1", "unknown option '--frob'"},
      {"mok run --shape", "needs a value"},
      {"mok run extra", "unexpected argument 'extra'"},
      {"mok run --shape dsv4", "one of dsv3, qwen3-30b-a3b, qwen3-235b, mixtral-8x7b"},
      {"mok run --scale 16", "expected 1/N"},
      {"mok run --scale 1/0", "expected 1/N"},
      {"mok run --scale 1/x", "expected 1/N"},
      {"mok run --tokens 0", "--tokens '0'"},
      {"mok run --tokens 1048577", "--tokens '1048577': expected an integer 1..1048576 (the "
                                   "library's limit, MOK_MAX_TOKENS)"},
      {"mok run --tokens 5000000000", "1..1048576 (the library's limit"},
      {"mok --version run", "--version takes no arguments"},
      {"mok run --tokens 12abc", "--tokens '12abc'"},
      {"mok run --backend gpu", "expected cpu or cuda"},
      {"mok run --grad-mode fp32", "expected bf16 or f32"},
      {"mok run --precision fp16", "--precision 'fp16': expected bf16 or fp8"},
      {"mok run --seed -1", "--seed '-1'"},
      {"mok run --threads -2", "--threads '-2'"},
      {"mok run --threads 1025", "--threads 1025: expected 0..1024"},
      {"mok run --threads 100000", "--threads 100000: expected 0..1024"},
      {"mok bench --sms x", "--sms 'x'"},
      {"mok bench --cluster 1", "--cluster '1'"},
      {"mok bench --cluster 2x2", "--cluster '2x2'"},
      {"mok run --tol 0", "--tol '0'"},
      {"mok run --tol nan", "--tol 'nan'"},
      {"mok run --repeat 3", "unknown option '--repeat'"},
      {"mok bench --tol 1", "unknown option '--tol'"},
      {"mok bench --repeat 0", "--repeat '0'"},
      {"mok info --shape dsv3", "unknown option '--shape'"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cli_options o;
    char err[256];
    int rc = parse(bad[i][0], &o, err, sizeof err);
    CHECK(rc == -1 && strstr(err, bad[i][1]), "'%s' -> %d '%s'; expected an error with '%s'",
          bad[i][0], rc, err, bad[i][1]);
  }
  /* Values with spaces, as a shell passes them quoted: strtoull reads " -1" as 2^64 - 1. */
  static const char *const spaced[] = {" -1", " 7", "+7", "7 "};
  for (size_t i = 0; i < sizeof spaced / sizeof spaced[0]; i++) {
    char *argv[] = {"mok", "run", "--seed", (char *)spaced[i]};
    cli_options o;
    char err[256] = "";
    int rc = cli_parse(4, argv, &o, err, sizeof err);
    CHECK(rc == -1 && strstr(err, "--seed"), "--seed '%s' -> %d (seed %llu) '%s'", spaced[i], rc,
          (unsigned long long)o.seed, err);
  }
}

static void flops(void) {
  mok_shape s = cli_scale(cli_shape_find("dsv3"), 1, 0);
  double want = 6.0 * 4096 * 8 * 7168 * 2048 + 6.0 * 4096 * 7168 * 2048;
  CHECK(cli_forward_flops(&s, 4096) == want, "dsv3 forward FLOPs %.6e != %.6e",
        cli_forward_flops(&s, 4096), want);
}

static void digests(void) {
  unsigned char b[10];
  for (int i = 0; i < 10; i++) b[i] = (unsigned char)i;
  cli_digest d = cli_digest_of(b, 5, 2);
  CHECK(d.hash == 0xca89e29c5320967aull, "hash of bytes 0..9: %016llx",
        (unsigned long long)d.hash);
  d = cli_digest_of(b, 0, 2);
  CHECK(d.hash == 0xcbf29ce484222325ull && d.abs_sum == 0 && d.nonfinite == 0, "empty");

  uint16_t v[4] = {mok_f32_to_bf16(-1.5f), mok_f32_to_bf16(2.0f), 0x7fc0 /* NaN */,
                   0xff80 /* -Inf */};
  d = cli_digest_of(v, 4, 2);
  CHECK(d.abs_sum == 3.5 && d.nonfinite == 2, "bf16: sum %g, nonfinite %lld", d.abs_sum,
        (long long)d.nonfinite);
  float f[3] = {-0.25f, 4.0f, NAN};
  d = cli_digest_of(f, 3, 4);
  CHECK(d.abs_sum == 4.25 && d.nonfinite == 1, "fp32: sum %g", d.abs_sum);

  /* Several MiB chunks: the same digest on 1 thread and on all. */
  const int64_t n = 3 * 262144 + 1000;
  float *big = malloc((size_t)n * sizeof *big);
  CHECK(big != NULL, "malloc");
  if (!big) return;
  for (int64_t i = 0; i < n; i++) big[i] = (float)(i % 1000) * 0.001f - 0.3f;
  int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  cli_digest one = cli_digest_of(big, n, 4);
  omp_set_num_threads(threads > 1 ? threads : 2);
  cli_digest all = cli_digest_of(big, n, 4);
  omp_set_num_threads(threads);
  CHECK(one.hash == all.hash && one.abs_sum == all.abs_sum, "digest depends on threads");
  big[n - 1] += 1.0f;
  CHECK(cli_digest_of(big, n, 4).hash != all.hash, "a changed last value keeps the hash");
  free(big);
}

const test_case tests_cli[] = {
    {"cli/shapes", shapes},           {"cli/scaling", scaling},
    {"cli/parse_defaults", parse_defaults}, {"cli/parse_values", parse_values},
    {"cli/parse_help", parse_help},   {"cli/parse_errors", parse_errors},
    {"cli/flops", flops},             {"cli/digests", digests},
    {NULL, NULL},
};
