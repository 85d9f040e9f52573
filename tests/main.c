/*
 * main.c: runs the C tests (all, or those whose name contains argv[1]) and ends with the line
 * "N passed, N failed". Exit status is 1 if any test failed.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "mok.h"

int check_failures;

void check_fail(const char *file, int line, const char *fmt, ...) {
  va_list ap;
  if (check_failures < 20) {
    fprintf(stderr, "  %s:%d: ", file, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
  }
  check_failures++;
}

/* tables.h (tests/ for the CPU binary, tests/gpu/ for the GPU one) defines TEST_TABLES(X): one
 * X(table) per test file; each table ends with {NULL, NULL}. */
#include <tables.h>

#define DECLARE_(t) extern const test_case t[];
TEST_TABLES(DECLARE_)
#undef DECLARE_

int main(int argc, char **argv) {
  const test_case *tables[] = {
#define LIST_(t) t,
      TEST_TABLES(LIST_)
#undef LIST_
  };
#ifdef TESTS_NEED_CUDA_DEVICE
  if (mok_cuda_device_count() == 0) {
    printf("no CUDA device is visible: these tests need a Hopper GPU\n0 passed, 1 failed\n");
    return 1;
  }
#endif
  const char *filter = argc > 1 ? argv[1] : NULL;
  int passed = 0, failed = 0;
  for (size_t i = 0; i < sizeof tables / sizeof tables[0]; i++) {
    for (const test_case *t = tables[i]; t->name; t++) {
      if (filter && !strstr(t->name, filter)) continue;
      struct timespec a, b;
      clock_gettime(CLOCK_MONOTONIC, &a);
      check_failures = 0;
      t->fn();
      clock_gettime(CLOCK_MONOTONIC, &b);
      double s = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
      printf("%-4s %-48s %7.2fs\n", check_failures ? "FAIL" : "ok", t->name, s);
      fflush(stdout);
      if (check_failures) failed++; else passed++;
    }
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed != 0;
}
