/* The test files of the GPU test binary (build/test_gpu), run on the device by make gpu-check. */
#define TEST_TABLES(X) X(tests_gpu_layer) X(tests_gpu_fp8) X(tests_gpu_mxfp8) X(tests_gpu_router) X(tests_gpu_ep) X(tests_gpu_nccl)
/* Without a CUDA device every test would fail (after minutes of CPU references): say so at once. */
#define TESTS_NEED_CUDA_DEVICE 1
