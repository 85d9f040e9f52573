/*
 * cudart.h: the CUDA runtime as the mok command sees it: <cuda_runtime.h>, or, in a build without
 * the CUDA toolkit (MOK_NO_CUDA), stand-ins for the calls the command makes, each failing with
 * cudaErrorNoDevice. libmok refuses every CUDA context there first (src/cuda/absent.c), so the
 * command reaches none of them but `mok info`'s questions.
 */
#ifndef MOK_TOOLS_CUDART_H
#define MOK_TOOLS_CUDART_H

#ifndef MOK_NO_CUDA
#include <cuda_runtime.h>
#else
#include <stddef.h>

typedef enum cudaError { cudaSuccess = 0, cudaErrorNoDevice = 100 } cudaError_t;
typedef struct absent_stream *cudaStream_t;
typedef struct absent_event *cudaEvent_t;
typedef struct absent_graph *cudaGraph_t;
typedef struct absent_graph_node *cudaGraphNode_t;
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };
enum cudaGraphNodeType { cudaGraphNodeTypeKernel = 0 };
enum cudaStreamCaptureMode { cudaStreamCaptureModeThreadLocal = 1 };
#define cudaStreamNonBlocking 0x01
struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  int major, minor, multiProcessorCount;
};

#define ABSENT_ return cudaErrorNoDevice
static inline const char *cudaGetErrorName(cudaError_t e) {
  return e ? "cudaErrorNoDevice" : "cudaSuccess";
}
static inline const char *cudaGetErrorString(cudaError_t e) {
  return e ? "this mok was built without CUDA" : "no error";
}
static inline cudaError_t cudaGetLastError(void) { return cudaSuccess; }
static inline cudaError_t cudaRuntimeGetVersion(int *v) { *v = 0; ABSENT_; }
static inline cudaError_t cudaDriverGetVersion(int *v) { *v = 0; ABSENT_; }
static inline cudaError_t cudaGetDeviceCount(int *n) { *n = 0; ABSENT_; }
static inline cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d) {
  (void)p, (void)d;
  ABSENT_;
}
static inline cudaError_t cudaSetDevice(int d) { (void)d; ABSENT_; }
static inline cudaError_t cudaMalloc(void **p, size_t n) { *p = NULL, (void)n; ABSENT_; }
static inline cudaError_t cudaFree(void *p) { (void)p; ABSENT_; }
static inline cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind k) {
  (void)d, (void)s, (void)n, (void)k;
  ABSENT_;
}
static inline cudaError_t cudaMemset(void *p, int v, size_t n) { (void)p, (void)v, (void)n; ABSENT_; }
static inline cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) {
  (void)p, (void)v, (void)n, (void)s;
  ABSENT_;
}
static inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned f) {
  *s = NULL, (void)f;
  ABSENT_;
}
static inline cudaError_t cudaStreamDestroy(cudaStream_t s) { (void)s; ABSENT_; }
static inline cudaError_t cudaStreamSynchronize(cudaStream_t s) { (void)s; ABSENT_; }
static inline cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = NULL; ABSENT_; }
static inline cudaError_t cudaEventDestroy(cudaEvent_t e) { (void)e; ABSENT_; }
static inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { (void)e, (void)s; ABSENT_; }
static inline cudaError_t cudaEventSynchronize(cudaEvent_t e) { (void)e; ABSENT_; }
static inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
  *ms = 0, (void)a, (void)b;
  ABSENT_;
}
static inline cudaError_t cudaStreamBeginCapture(cudaStream_t s, enum cudaStreamCaptureMode m) {
  (void)s, (void)m;
  ABSENT_;
}
static inline cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
  (void)s, *g = NULL;
  ABSENT_;
}
static inline cudaError_t cudaGraphDestroy(cudaGraph_t g) { (void)g; ABSENT_; }
static inline cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t *n, size_t *count) {
  (void)g, (void)n, *count = 0;
  ABSENT_;
}
static inline cudaError_t cudaGraphNodeGetType(cudaGraphNode_t n, enum cudaGraphNodeType *t) {
  (void)n, *t = cudaGraphNodeTypeKernel;
  ABSENT_;
}
#undef ABSENT_
#endif /* MOK_NO_CUDA */

#endif /* MOK_TOOLS_CUDART_H */
