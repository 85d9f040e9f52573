/* test_api.c: status names, version, context and workspace argument checks. */
#include "check.h"
#include "mok.h"

static void status_names(void) {
  CHECK(mok_version() == MOK_VERSION, "version %d != %d", mok_version(), MOK_VERSION);
  CHECK(mok_status_name(MOK_ERR_EXPERT_ID)[0] == 'M', "name");
}

const test_case tests_api[] = {{"api/status_names", status_names}, {NULL, NULL}};
