/* The C test files of the CPU test binary (build/test_mok). */
#define TEST_TABLES(X) X(tests_api) X(tests_numerics) X(tests_gradcheck) X(tests_router) X(tests_schedule) X(tests_errors) X(tests_determinism) X(tests_ep) X(tests_cli) X(tests_fp8) X(tests_fp8_weights) X(tests_fp8_layer) X(tests_misuse) X(tests_mxfp8)
