/*
 * check.h: the smallest test framework that does the job. A test is a function; CHECK records a
 * failure with file, line and message and lets the test go on; each file exports a table of its
 * tests, listed once in tests/main.c.
 */
#ifndef MOK_TESTS_CHECK_H
#define MOK_TESTS_CHECK_H

#include <stdio.h>

typedef struct test_case {
  const char *name;
  void (*fn)(void);
} test_case;

/* Failures recorded in the running test. */
extern int check_failures;
void check_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define CHECK(cond, ...)                                      \
  do {                                                        \
    if (!(cond)) check_fail(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

/* Status checks print the library's message for the failure. */
#define CHECK_OK(expr)                                                                   \
  do {                                                                                   \
    mok_status st_ = (expr);                                                             \
    CHECK(st_ == MOK_OK, "%s -> %s: %s", #expr, mok_status_name(st_), mok_last_error()); \
  } while (0)

#endif
