/*
 * tma.cu: tensor maps (TMA descriptors) for row-major matrices: bf16 and e4m3 operands in
 * 128-byte swizzled boxes (64 or 128 columns), and FP8 scale vectors. cuTensorMapEncodeTiled is
 * a driver function; it is looked up once through the runtime so that libmok never links libcuda
 * (and loads on machines without a GPU driver).
 * Out-of-range box elements read as zeros: a 3D map per expert keeps a tile that overhangs an
 * expert's rows from reading its neighbour's.
 */
#include <cudaTypedefs.h>

#include "cuda/kernels.h"

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn(void) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = NULL;
  if (!fn) {
    void *p = NULL;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
  }
  return fn;
}

int tma_init(void) { return encode_fn() ? 0 : -1; }

static int encode_as(CUtensorMap *map, CUtensorMapDataType type, CUtensorMapSwizzle swizzle,
                     const void *base, int rank, const cuuint64_t *dims,
                     const cuuint64_t *strides, const cuuint32_t *box) {
  PFN_cuTensorMapEncodeTiled_v12000 fn = encode_fn();
  if (!fn) return -1;
  cuuint32_t ones[3] = {1, 1, 1};
  CUresult r = fn(map, type, (cuuint32_t)rank, (void *)base, dims, strides, box, ones,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : (int)r;
}

static int encode(CUtensorMap *map, const void *base, int rank, const cuuint64_t *dims,
                  const cuuint64_t *strides, const cuuint32_t *box) {
  return encode_as(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, CU_TENSOR_MAP_SWIZZLE_128B, base, rank,
                   dims, strides, box);
}

int tma_map_2d(CUtensorMap *map, const void *base, int64_t rows, int64_t cols, int box_rows) {
  cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
  cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
  return encode(map, base, 2, dims, strides, box);
}

int tma_map_3d(CUtensorMap *map, const void *base, int64_t batch, int64_t rows, int64_t cols,
               int box_rows) {
  cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)rows, (cuuint64_t)batch};
  cuuint64_t strides[2] = {(cuuint64_t)cols * 2, (cuuint64_t)(rows * cols * 2)};
  cuuint32_t box[3] = {64, (cuuint32_t)box_rows, 1};
  return encode(map, base, 3, dims, strides, box);
}

int tma_map_2d_u8(CUtensorMap *map, const void *base, int64_t rows, int64_t cols, int64_t ld,
                  int box_rows) {
  cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  cuuint64_t strides[1] = {(cuuint64_t)ld};
  cuuint32_t box[2] = {128, (cuuint32_t)box_rows};
  return encode_as(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, CU_TENSOR_MAP_SWIZZLE_128B, base, 2, dims,
                   strides, box);
}

int tma_map_3d_u8(CUtensorMap *map, const void *base, int64_t batch, int64_t rows, int64_t cols,
                  int box_rows) {
  cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)rows, (cuuint64_t)batch};
  cuuint64_t strides[2] = {(cuuint64_t)cols, (cuuint64_t)(rows * cols)};
  cuuint32_t box[3] = {128, (cuuint32_t)box_rows, 1};
  return encode_as(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, CU_TENSOR_MAP_SWIZZLE_128B, base, 3, dims,
                   strides, box);
}

int tma_map_scales(CUtensorMap *map, const float *base, int64_t groups, int64_t ld, int box) {
  cuuint64_t dims[2] = {(cuuint64_t)ld, (cuuint64_t)groups};
  cuuint64_t strides[1] = {(cuuint64_t)ld * 4};
  cuuint32_t boxd[2] = {(cuuint32_t)box, 1};
  return encode_as(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, CU_TENSOR_MAP_SWIZZLE_NONE, base, 2, dims,
                   strides, boxd);
}
