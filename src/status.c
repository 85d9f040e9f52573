/*
 * status.c: status names and messages (generated from MOK_STATUS_LIST) and the per-thread last
 * error. Each thread has its own message, so concurrent callers never overwrite each other's.
 */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

static _Thread_local char last_error[1024];

int mok_version(void) { return MOK_VERSION; }

const char *mok_status_name(mok_status s) {
  switch (s) {
#define MOK_STATUS_NAME_(name, value, msg) \
  case name:                               \
    return #name;
    MOK_STATUS_LIST(MOK_STATUS_NAME_)
#undef MOK_STATUS_NAME_
  }
  return "MOK_ERR_UNKNOWN";
}

const char *mok_status_string(mok_status s) {
  switch (s) {
#define MOK_STATUS_STRING_(name, value, msg) \
  case name:                                 \
    return msg;
    MOK_STATUS_LIST(MOK_STATUS_STRING_)
#undef MOK_STATUS_STRING_
  }
  return "unknown status code";
}

const char *mok_last_error(void) { return last_error; }

void mok_clear_error(void) { last_error[0] = '\0'; }

mok_status mok_fail(mok_status s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return s;
}

const char *mok_call_name(int call) {
  static const char *const names[MOK_CALL_KINDS] = {
      "no call",      "mok_schedule", "mok_forward",        "mok_recompute",
      "mok_backward", "mok_check",    "mok_schedule_counts"};
  return call >= 0 && call < MOK_CALL_KINDS ? names[call] : "an unknown call";
}

void mok_call_names(int32_t calls, char *out, size_t len) {
  size_t at = 0;
  out[0] = '\0';
  for (int c = 0; c < MOK_CALL_KINDS; c++)
    if (calls & (1 << (MOK_CALL_SHIFT + c)) && at < len)
      at += (size_t)snprintf(out + at, len - at, "%s%s", at ? " and " : "", mok_call_name(c));
}
