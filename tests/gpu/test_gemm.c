#include "check.h"
const test_case tests_gpu_gemm[] = {{NULL, NULL}};
