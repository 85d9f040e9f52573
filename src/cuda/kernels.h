/*
 * kernels.h: the CUDA backend's kernels as the host sees them: argument structs and launchers.
 * Every launcher queues work on `stream` and returns the launch error; none synchronises.
 */
#ifndef MOK_CUDA_KERNELS_H
#define MOK_CUDA_KERNELS_H

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

/* ---- GEMM engine (gemm.cuh, gemm_kernels.cu) ------------------------------------------------ */
#define GEMM_BM 128      /* output tile rows (= MOK_TILE_M) */
#define GEMM_BN 256      /* output tile columns */
#define GEMM_BK 64       /* k-block: 64 bf16 = one 128-byte swizzle row */
#define GEMM_STAGES 4
#define GEMM_THREADS 384 /* producer warpgroup + two consumer warpgroups */
#define GEMM_BN_GATEUP 128 /* gate/up forward: output columns of a tile (128 gate + 128 up) */
/* CTAs per cluster sharing (multicasting) B tiles, 1 or 2 (gemm.cuh; measured in DESIGN §2.2). */
#ifndef GEMM_CLUSTER
#define GEMM_CLUSTER 2
#endif
typedef enum gemm_kind {
  GEMM_FWD_GATEUP,    /* gu, hw <- A x [gate | up]^T, SwiGLU epilogue */
  GEMM_FWD_DOWN,      /* slot rows (or fp32 rows) <- A x W_down^T */
  GEMM_DGRAD_DOWN,    /* dgu, router partials <- A x W_down, SwiGLU backward epilogue */
  GEMM_DGRAD_GATEUP,  /* slot rows (or fp32 rows) <- A x [W_gate; W_up] */
  GEMM_WGRAD          /* per expert: A^T x B over its rows */
} gemm_kind;

/* The layout of the operands and the tile space of one launch. Passed as a __grid_constant__
 * parameter so the tensor maps stay in constant/param space where TMA can read them. */
typedef struct gemm_args {
  CUtensorMap a;   /* A operand */
  CUtensorMap b0;  /* B operand (gate weights for the gate/up kernels) */
  CUtensorMap b1;  /* up weights for the gate/up kernels; unused otherwise */

  /* Tile space. Row-grouped kernels: M = routed rows grouped by expert (offsets, mblock_expert
   * from the schedule), or a plain T rows (offsets == NULL: one expert, m_tiles_max tiles).
   * Weight-gradient kernels: `experts` independent products, K = each expert's rows. */
  const int32_t *offsets;        /* [E_local + 1] padded segment starts, or NULL */
  const int32_t *mblock_expert;  /* [rows_cap / 128], or NULL */
  const int32_t *status;         /* the call's error word: non-zero means do nothing */
  int experts;      /* E_local (or 1 for the shared expert): offsets[experts] ends the rows */
  int m_tiles_max;  /* upper bound of M tiles (grid sizing, wgrad: exact) */
  int m;            /* weight gradients: M extent (output rows) */
  int n;            /* N extent */
  int k;            /* K extent where fixed (row-grouped kernels) */
  int k_split;      /* = I: dgrad gate/up, the K index where W_up takes over from W_gate;
                     * weight gradients, the output row where out1 takes over from out0 */

  /* Epilogue. */
  const float *row_weight;  /* [rows] router weight per routed row, or NULL (= 1) */
  const int32_t *row_src;   /* [rows] slot t*k+j per routed row (-1 = padding), or NULL */
  const __nv_bfloat16 *gu_in; /* dgrad down: saved [rows, 2I] pre-activations */
  void *out0;       /* main output */
  void *out1;       /* second output (hw; W_up gradient) */
  float *aux;       /* dgrad down: router-gradient partials [slots, I/64] */
  int ld_out;       /* leading dimension of out0/out1 in elements */
  int rows_valid;   /* rows < rows_valid are stored (shared expert: T) */
  int accumulate;   /* weight gradients: 1 = fp32 out += acc, 0 = bf16 out = acc */
} gemm_args;

/* Once per device, before any launch and outside graph capture: sets the kernels' attributes and
 * gives the most CTAs (clusters of GEMM_CLUSTER, one CTA per SM) that can be resident at once. */
cudaError_t gemm_init(int *max_ctas);
/* Launches on at most `ctas` CTAs (a multiple of GEMM_CLUSTER); the grid never changes a bit. */
cudaError_t gemm_launch(gemm_kind kind, const gemm_args *g, int ctas, cudaStream_t stream);

/* ---- tensor maps (tma.cu) ------------------------------------------------------------------- */
/* Looks up the driver's encoder; 0 on success. Called at context creation, outside any capture. */
int tma_init(void);
/* 2D map of a row-major bf16 matrix [rows, cols], box [box_rows][64 cols], 128B swizzle. */
int tma_map_2d(CUtensorMap *map, const void *base, int64_t rows, int64_t cols, int box_rows);
/* 3D map of row-major bf16 [batch, rows, cols], box [1][box_rows][64 cols], 128B swizzle. */
int tma_map_3d(CUtensorMap *map, const void *base, int64_t batch, int64_t rows, int64_t cols,
               int box_rows);

/* ---- schedule (schedule.cu) ----------------------------------------------------------------- */
typedef struct sched_args {
  const int32_t *topk_ids;     /* [slots] */
  const float *topk_weights;   /* [slots] */
  int slots;                   /* T * k */
  int experts;                 /* E, all ranks */
  int experts_local;           /* E_local */
  int expert_base;             /* first global id of this rank */
  int rows_cap;                /* rows of the routed buffers */
  int32_t *status;             /* saved: this call's error word (zeroed by the launcher) */
  int32_t *sticky;             /* workspace: error bits until mok_check */
  int32_t *counts, *offsets, *row_src, *mblock_expert; /* saved */
  float *row_weight;           /* saved */
  int32_t *chunk_counts;       /* scratch [chunks, E_local] */
} sched_args;
#define SCHED_CHUNK 1024       /* slots per block of the counting passes */
cudaError_t schedule_launch(const sched_args *a, cudaStream_t stream);

/* ---- row movement (rows.cu) ----------------------------------------------------------------- */
/* Routed row r gets row row_src[r] / k of src (zeros on padding), for one or two tensors. */
cudaError_t dispatch_launch(const int32_t *status, const int32_t *offsets, int experts_local,
                            const int32_t *row_src, int k, int H, int rows_cap,
                            const __nv_bfloat16 *src0, __nv_bfloat16 *dst0,
                            const __nv_bfloat16 *src1, __nv_bfloat16 *dst1, cudaStream_t stream);
/* y[t] = bf16(((base[t] + slot[t,0]) + slot[t,1]) + ...), base fp32 or NULL (zero). */
cudaError_t combine_launch(const int32_t *status, int T, int k, int H, const float *base,
                           const __nv_bfloat16 *slots, __nv_bfloat16 *out, cudaStream_t stream);
/* d_topk_weights[s] = sum over chunks c ascending of part[s, c]. Also copies the call's error
 * bits into `sticky`, so a backward on a failed forward's saved buffer is reported again. */
cudaError_t router_grad_launch(const int32_t *status, int32_t *sticky, int slots, int chunks,
                               const float *part, float *out, cudaStream_t stream);

#endif /* MOK_CUDA_KERNELS_H */
