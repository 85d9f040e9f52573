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

/* ---- expert parallelism (ep.cu) ------------------------------------------------------------ */
/* Where every rank's symmetric buffers are, in device memory, one copy per workspace (filled
 * once the group is complete; at ep = 1 only this rank's slots and partials). A routed row's
 * row_src v belongs to rank v / slots_cap, slot v % slots_cap. Kernels read this rank's own
 * inputs from the call's pointers, not from its entry here. */
#define EP_MAX 64 /* = MOK_EP_MAX */
typedef struct ep_table {
  const __nv_bfloat16 *x[EP_MAX], *dy[EP_MAX]; /* [max_tokens, H]: each rank's published x, dy */
  const int32_t *ids[EP_MAX];                  /* [max_tokens * k] published topk_ids */
  const float *w[EP_MAX];                      /* [max_tokens * k] published topk_weights */
  const int32_t *tokens[EP_MAX];               /* the published T of each rank */
  void *slots[EP_MAX];                         /* [max_tokens * k, H] bf16 slot rows */
  float *dtw[EP_MAX];                          /* [max_tokens * k, I / 64] router partials */
  unsigned long long *flags[EP_MAX];           /* [2][EP_MAX] barrier words (ep.cu) */
} ep_table;

/* Where each of a workspace's buffers in the table sits, in bytes from the workspace's start. */
typedef struct ep_offsets {
  size_t x, dy, ids, w, tokens, slots, dtw, flags;
} ep_offsets;

/* Rank r's entries: its workspace starts at `base`. */
static inline __host__ __device__ void ep_table_set(ep_table *t, int r, char *base,
                                                    const ep_offsets *o) {
  t->x[r] = (const __nv_bfloat16 *)(base + o->x);
  t->dy[r] = (const __nv_bfloat16 *)(base + o->dy);
  t->ids[r] = (const int32_t *)(base + o->ids);
  t->w[r] = (const float *)(base + o->w);
  t->tokens[r] = (const int32_t *)(base + o->tokens);
  t->slots[r] = base + o->slots;
  t->dtw[r] = (float *)(base + o->dtw);
  t->flags[r] = (unsigned long long *)(base + o->flags);
}

/* An NCCL group: fills `out` with every rank's buffers, their workspaces being the symmetric
 * window `win` (an ncclWindow_t), read once through NCCL's device API. Each rank r has written
 * EP_MARK + r at `mark_at` in its workspace before the window was made; *bad is set unless every
 * rank's mark reads back through the window (NCCL did not map the workspaces, or its device
 * structs differ from the headers mok was built with). */
#define EP_MARK 0x6d6f6b00
cudaError_t ep_table_from_window_launch(void *win, const ep_offsets *o, int ranks, size_t mark_at,
                                        ep_table *out, int32_t *bad, cudaStream_t stream);

/* The group barrier of one rank (one thread): publishes (epoch, this rank's error bits) into
 * every rank's flags, waits until every rank has published the same epoch, and ORs all their
 * bits into status[MOK_STATUS_BITS] and sticky; a rank missing after timeout_ns sets
 * MOK_DEVERR_TIMEOUT. `when`: EP_OPEN always runs and also records the result in
 * status[MOK_STATUS_OPEN]; EP_CHECK runs only if status[MOK_STATUS_OPEN] is clear (every rank
 * agrees on it after the open); EP_CLOSE only if status[MOK_STATUS_BITS] is clear (every rank
 * agrees after a check). `tokens`: published as this rank's T (EP_OPEN); `add`: bits ORed into
 * status[MOK_STATUS_BITS] first (MOK_DEVERR_PEER_ARG for a call refused on the host). `call`:
 * the call's kind (MOK_CALL_*), published beside the bits; ranks whose kinds differ all get
 * MOK_DEVERR_PEER_CALL, and the kinds go to sticky with it for mok_check's message. */
enum { EP_OPEN, EP_CHECK, EP_CLOSE };
cudaError_t ep_barrier_launch(const ep_table *tb, int rank, int ranks, int when, int call,
                              int32_t *status, int32_t *sticky, unsigned *epoch,
                              int32_t *tokens_out, int tokens, int32_t add, long long timeout_ns,
                              cudaStream_t stream);

/* ---- GEMM engine (gemm.cuh, gemm_kernels.cu) ------------------------------------------------ */
#define GEMM_BM 128      /* output tile rows (= MOK_TILE_M) */
#define GEMM_BN 256      /* output tile columns */
#define GEMM_BK 64       /* k-block: 64 bf16 = one 128-byte swizzle row */
#define GEMM_STAGES 4
#define GEMM_THREADS 384 /* producer warpgroup + two consumer warpgroups */
#define GEMM_BN_GATEUP 128 /* gate/up forward: output columns of a tile (128 gate + 128 up) */
#define GEMM_CM 2        /* CTAs of a cluster along M (see gemm_args.cn) */
typedef enum gemm_kind {
  GEMM_FWD_GATEUP,    /* gu, hw <- A x [gate | up]^T, SwiGLU epilogue */
  GEMM_FWD_DOWN,      /* slot rows (or fp32 rows) <- A x W_down^T */
  GEMM_DGRAD_DOWN,    /* dgu, router partials <- A x W_down, SwiGLU backward epilogue */
  GEMM_DGRAD_GATEUP,  /* slot rows (or fp32 rows) <- A x [W_gate; W_up] */
  GEMM_WGRAD          /* per expert: A^T x B over its rows */
} gemm_kind;

/* out[t] = bf16(((base[t] + slot[t,0]) + slot[t,1]) + ...), base fp32 [T, H] or NULL (zero),
 * slot rows [T * k, H]. */
typedef struct combine_args {
  const int32_t *status;
  int T, k, H;
  const float *base;
  const __nv_bfloat16 *slots;
  __nv_bfloat16 *out;
} combine_args;

/* The layout of the operands and the tile space of one launch. Passed as a __grid_constant__
 * parameter so the tensor maps stay in constant/param space where TMA can read them. */
typedef struct gemm_args {
  CUtensorMap a;   /* A operand */
  CUtensorMap b0;  /* B operand (gate weights for the gate/up kernels) */
  CUtensorMap b1;  /* up weights for the gate/up kernels; unused otherwise */
  int cn;          /* clusters of GEMM_CM x cn CTAs take as many tiles: the 2 tiles of an N column
                    * share (multicast) B, the cn tiles of an M row share A (gemm.cuh). 1 or 2:
                    * 1 unless the context's cluster knob asks for 2 x 2 (products.cu), which
                    * picks the kernel compiled for it. A K-major A map has boxes of 128 / cn
                    * rows. */

  /* Tile space. Row-grouped kernels: M = routed rows grouped by expert (offsets, mblock_expert
   * from the schedule), or a plain T rows (offsets == NULL: one expert, m_tiles_max tiles).
   * Weight-gradient kernels: `experts` independent products, K = each expert's rows. */
  const int32_t *offsets;        /* [E_local + 1] padded segment starts, or NULL */
  const int32_t *mblock_expert;  /* [rows_cap / 128], or NULL */
  const int32_t *counts;         /* weight gradients: [E_local] routed rows of each expert */
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
  const int32_t *row_src;   /* [rows] source per routed row (-1 = padding), or NULL: rank
                             * row_src / slots_cap, slot t*k+j = row_src % slots_cap */
  void *const *peer_out;    /* routed rows: every rank's slot rows (ep_table.slots) */
  float *const *peer_aux;   /* dgrad down: every rank's router partials (ep_table.dtw) */
  int slots_cap;            /* max_tokens * k */
  const __nv_bfloat16 *gu_in; /* dgrad down: saved [rows, 2I] pre-activations */
  void *out0;       /* main output */
  void *out1;       /* second output (hw; W_up gradient) */
  float *aux;       /* dgrad down: router-gradient partials [slots, I/64] */
  int ld_out;       /* leading dimension of out0/out1 in elements */
  int rows_valid;   /* rows < rows_valid are stored (shared expert: T) */
  int accumulate;   /* weight gradients: 1 = fp32 out += acc, 0 = bf16 out = acc */

  /* The backward's last weight gradient at ep = 1 with top_k <= GEMM_COMBINE_K: its producer
   * warpgroup's idle warps also combine dx as combine_rows does, while its consumers compute;
   * the launch asks for GEMM_COMBINE_SMEM bytes more. comb.out NULL: combine is a kernel of its
   * own. */
  combine_args comb;
} gemm_args;

#define GEMM_COMBINE_K 8 /* slot rows a lane copies at once: up to top_k 8 */
#define GEMM_COMBINE_SMEM (3 * 2 * (GEMM_COMBINE_K + 2) * 32 * 16) /* 3 warps, 2 buffers */

/* Blocks of GEMM_CM x cn tiles over m_tiles x ceil(n / bn) tiles, per expert: what a kernel
 * walks (with the real M tiles) and what its grid is sized from (with m_tiles_max). */
static inline __host__ __device__ int gemm_blocks(int m_tiles, int n, int bn, int cn) {
  return (m_tiles + GEMM_CM - 1) / GEMM_CM * (((n + bn - 1) / bn + cn - 1) / cn);
}

/* Once per device, before any launch and outside graph capture: sets the kernels' attributes and
 * gives, for clusters of 2 x cn CTAs (cn = 1, 2; one CTA per SM), the most CTAs resident at once. */
cudaError_t gemm_init(int max_ctas[2]);
/* Launches on at most `ctas` CTAs (a multiple of 2 x cn); the grid never changes a bit. */
cudaError_t gemm_launch(gemm_kind kind, const gemm_args *g, int ctas, cudaStream_t stream);

/* ---- FP8 products (gemm_fp8.cu, DESIGN §8.2) ----------------------------------------------- */
/* The five products on e4m3 operands, each a kernel of its own in clusters of 2 x 1 CTAs (the
 * cluster knob does not apply: it never changes a bit anyway). Tiles as the bf16 kernels' with
 * k-blocks of 128; every operand K-major (the dgrads read the weights' transposed codes, the
 * weight gradients the column-quantized activations). */
typedef enum gemm8_kind {
  GEMM8_FWD_GATEUP,   /* gu, hw, hw's codes and scales <- x codes x [gate | up]^T */
  GEMM8_FWD_DOWN,     /* slot rows (or fp32 rows) <- hw codes x W_down^T */
  GEMM8_DGRAD_DOWN,   /* dgu, router partials <- dy codes x W_down (its transpose's codes) */
  GEMM8_DGRAD_GATEUP, /* slot rows (or fp32 rows) <- dgu codes x [W_gate; W_up] */
  GEMM8_WGRAD,        /* per expert: A^T B over its rows, both column-quantized */
  GEMM8_KINDS
} gemm8_kind;

typedef struct gemm8_args {
  gemm_args g;      /* maps a, b0, b1 of e4m3 codes (boxes 128 bytes wide), tile space (k: a
                     * multiple of 128), epilogue; g.cn = 1 */
  CUtensorMap sa;   /* A's scales, f32 [groups of K][lda rows], box 128 x 1 */
  CUtensorMap sb;   /* GEMM8_WGRAD: B's scales, f32 [groups of K][ldb rows], box 256 x 1 */
  /* The weights' block scales (the other kinds): f32, the scale of B rows' 128-block nb at
   * k-block kb of expert e is w0[e * se + nb * sn + kb * sk] (b0's; b1's in w1). Gate/up forward:
   * half 0 of a tile is b0 (gate), half 1 b1 (up), at the same nb; the others: both halves from
   * one tensor, nb = n0 / 128 + half, and k-blocks from `ksplit` on come from b1 (gate/up dgrad:
   * W_up after W_gate) at kb - ksplit. nb is clamped to ng - 1 (a tile's overhang is zeros). */
  const float *w0, *w1;
  int se, sn, sk, ng, ksplit;
  /* GEMM8_FWD_GATEUP: hw's codes [rows, I] and scales [I / 128][ld_s] (Q_row along I) */
  uint8_t *q_out;
  float *s_out;
  int ld_s;
} gemm8_args;

/* Once per device, with gemm_init: the FP8 kernels' attributes and the most CTAs resident. */
cudaError_t gemm8_init(int *max_ctas);
cudaError_t gemm8_launch(gemm8_kind kind, const gemm8_args *a, int ctas, cudaStream_t stream);

/* ---- FP8 quantization (quant.cu, DESIGN §8.1) ---------------------------------------------- */
/* Tiles of 128 x 128 of a bf16 matrix [rows, cols] (ld_src elements a row). Rows from `rows` on
 * read as zeros; with `live` set, only the first *live rows matter (the schedule's
 * offsets[E_local]: the tiles below it run, the rest return at once). The rows are src's, or
 * (src NULL) the routed rows gathered from their tokens as dispatch would move them: row r holds
 * token (row_src[r] % slots_cap) / k of rank row_src[r] / slots_cap, from `own` [T, ld_src] for
 * this rank's tokens, else from that rank's published x (dy when `dy`) in `peers`; padding
 * (-1) reads as zeros. Either output or both:
 *   row: Q_row, codes q [rows, ld_q] (columns cols .. ld_q - 1 of each row, up to the tile's
 *        end, are zero codes) and scales s [ceil(cols / 128)][ld_s];
 *   col: Q_col over blocks of 128 rows, codes qt [cols, ld_qt] (row c holds column c, every row
 *        of the tile written, zeros past `rows`) and scales st [rows / 128 blocks][ld_st].
 * `filled` (or NULL): the first tile sets it to MOK_FILLED_ACTIVATIONS, once the call is known
 * to have had no error (the FP8 forward's mark, which the bf16 forward's dispatch makes). */
typedef struct quant_args {
  const int32_t *status;
  const __nv_bfloat16 *src;
  int rows, cols, ld_src;
  const int32_t *live;
  const int32_t *row_src;
  const __nv_bfloat16 *own;
  const ep_table *peers;
  int dy, slots_cap, k, rank;
  int32_t *filled;
  uint8_t *q;
  float *s;
  int ld_q, ld_s;
  uint8_t *qt;
  float *st;
  int ld_qt, ld_st;
} quant_args;
cudaError_t quant_launch(const quant_args *a, cudaStream_t stream);
/* Q_blk of bf16 weights w [E, N, K] into codes q [E, N, K], codes qt [E, K, N] and scales
 * s [E][ceil(N / 128)][ceil(K / 128)]. */
cudaError_t quant_weights_launch(const __nv_bfloat16 *w, int64_t E, int64_t N, int64_t K,
                                 uint8_t *q, uint8_t *qt, float *s, cudaStream_t stream);
/* qt [E, K, N] <- q [E, N, K] transposed (bytes). */
cudaError_t transpose_u8_launch(const uint8_t *q, int64_t E, int64_t N, int64_t K, uint8_t *qt,
                                cudaStream_t stream);

/* ---- tensor maps (tma.cu) ------------------------------------------------------------------- */
/* Looks up the driver's encoder; 0 on success. Called at context creation, outside any capture. */
int tma_init(void);
/* 2D map of a row-major bf16 matrix [rows, cols], box [box_rows][64 cols], 128B swizzle. */
int tma_map_2d(CUtensorMap *map, const void *base, int64_t rows, int64_t cols, int box_rows);
/* 3D map of row-major bf16 [batch, rows, cols], box [1][box_rows][64 cols], 128B swizzle. */
int tma_map_3d(CUtensorMap *map, const void *base, int64_t batch, int64_t rows, int64_t cols,
               int box_rows);
/* The same for e4m3 codes (bytes): boxes [box_rows][128 cols]; ld: bytes a row (>= cols, a
 * multiple of 16). */
int tma_map_2d_u8(CUtensorMap *map, const void *base, int64_t rows, int64_t cols, int64_t ld,
                  int box_rows);
int tma_map_3d_u8(CUtensorMap *map, const void *base, int64_t batch, int64_t rows, int64_t cols,
                  int box_rows);
/* Scales f32 [groups][ld] (ld a multiple of 4): boxes of `box` consecutive floats of one group,
 * no swizzle. */
int tma_map_scales(CUtensorMap *map, const float *base, int64_t groups, int64_t ld, int box);

/* ---- schedule (schedule.cu) ----------------------------------------------------------------- */
typedef struct sched_args {
  const int32_t *topk_ids;     /* [slots] this rank's */
  const float *topk_weights;   /* [slots] */
  int slots;                   /* T * k */
  const ep_table *peers;       /* the other ranks' published ids, weights and T (ep > 1) */
  int rank, ranks;             /* chunks of rank r come r-th: canonical order (rank, t, j) */
  int slots_cap;               /* max_tokens * k: row_src = rank * slots_cap + slot */
  int top_k;
  int chunks_per_rank;         /* ep = 1: of this call's slots; else of slots_cap */
  int experts;                 /* E, all ranks */
  int experts_local;           /* E_local */
  int expert_base;             /* first global id of this rank */
  int rows_cap;                /* rows of the routed buffers */
  int32_t *status;             /* saved: this call's header (zeroed by the caller) */
  uint32_t ident;              /* mok_saved_ident of the workspace, for the header */
  int32_t *sticky;             /* workspace: error bits until mok_check */
  int32_t *counts, *offsets, *row_src, *mblock_expert; /* saved */
  float *row_weight;           /* saved */
  int32_t *slot_row;           /* saved [slots]: row of each own slot here, -1: another rank's */
  int32_t *chunk_counts;       /* scratch [chunks, E_local] */
  unsigned *sync;              /* the grid barrier's state (grid_sync), u32 [2] in the workspace */
} sched_args;
#define SCHED_CHUNK 1024       /* slots per block of the counting passes */
/* count, scan and place as phases of one cooperative launch of at most max_ctas blocks. */
cudaError_t schedule_launch(const sched_args *a, int max_ctas, cudaStream_t stream);

/* ---- row movement (rows.cu) ----------------------------------------------------------------- */
/* Routed row r gets row row_src[r] % slots_cap / k of rank row_src[r] / slots_cap's src (zeros
 * on padding), for one or two tensors. This rank's T tokens are read once each and written to
 * their slots' rows (slot_row); rows of other ranks (of `ranks`) come from their published x
 * (dy) in `peers`. `filled` (the forward's and recompute's): saved's MOK_STATUS_FILLED word, set
 * to MOK_FILLED_ACTIVATIONS when the call had no error before dispatch (a later launch failure
 * is returned to the caller). */
typedef struct dispatch_args {
  const int32_t *status, *offsets, *row_src, *slot_row; /* offsets[experts_local]: rows */
  int experts_local, T, k, H, rows_cap, rank, slots_cap;
  int group; /* routed rows a warp looks at: 32 at ep = 1, 1 in a group (rows.cuh) */
  const ep_table *peers;
  const __nv_bfloat16 *src0, *src1; /* src1, dst1: NULL for one tensor */
  __nv_bfloat16 *dst0, *dst1;
  int32_t *filled;                  /* or NULL */
  /* ep = 1 without a shared expert (else NULL): the routed x rows stay in the workspace from the
   * forward to the backward. The forward numbers itself and marks them and saved with its
   * number; the backward skips copying x when saved_open found them to be its own, and marks
   * them as saved's forward's when it copies them. */
  uint64_t *xr_tag;      /* the workspace's [3] (see saved_open_launch) */
  uint64_t *saved_tag;   /* saved's: the number of the forward that filled it */
  const int32_t *x_rows; /* backward: the status word MOK_BSTATUS_X_ROWS; forward: NULL */
} dispatch_args;
cudaError_t dispatch_launch(const dispatch_args *a, cudaStream_t stream);
/* The backward's first kernel: its error bits (status[MOK_STATUS_BITS], the backward's own
 * status words) <- saved's, or MOK_DEVERR_SAVED where saved is not this workspace's (its header's
 * MAGIC and IDENT, `ident`), not of S->tokens tokens, holds no activations, or was filled with
 * other topk_ids or topk_weights (its ROUTING sum against this call's) or overwritten since (its
 * SCHEDULE sum against the schedule arrays, read only once the header passes); the barrier's word
 * cleared. Blocks add their sums into status words MOK_BSTATUS_ROUTING and _SCHEDULE, and the
 * last block to finish (MOK_BSTATUS_DONE counts them) compares and zeroes them. At most
 * max_blocks blocks. With xr_tag (ep = 1, no shared expert; else NULL): xr_tag[0] is the number
 * of the forward whose x rows the workspace holds (0: unknown), [1] the x they came from, [2] the
 * last number given (counting from a base of its own per workspace, so no two forwards of a
 * process share one). status[MOK_BSTATUS_X_ROWS] <- 1 if they are saved's forward's and x is
 * theirs. */
struct mok_saved_layout;
cudaError_t saved_open_launch(const struct mok_saved_layout *S, const void *saved, int experts_local,
                              int top_k, uint32_t ident, const int32_t *topk_ids,
                              const float *topk_weights, int32_t *status, uint64_t *xr_tag,
                              const void *x, int max_blocks, cudaStream_t stream);
cudaError_t combine_launch(const combine_args *c, cudaStream_t stream);
/* d_topk_weights[s] = sum over chunks c ascending of part[s, c]. Also copies the call's error
 * bits into `sticky`, so a backward on a failed forward's saved buffer is reported again. */
cudaError_t router_grad_launch(const int32_t *status, int32_t *sticky, int slots, int chunks,
                               const float *part, float *out, cudaStream_t stream);

/* Lazy module loading (the CUDA 12+ default) loads a kernel at its first launch, and a load may
 * wait for the kernels running on the device: a rank spinning at a barrier for a peer whose next
 * launch waits on such a load never returns. So every kernel is loaded at context creation (the
 * GEMMs by gemm_init). Without this, `mok run --ep R --backend cuda` timed out at the first
 * barrier on an H200; with it, it passes (docs/perf-log.md, 2026-12-02 at 8a00c06). */
cudaError_t ep_preload(void);
cudaError_t quant_preload(void);
cudaError_t rows_preload(void);
cudaError_t schedule_preload(void);
cudaError_t router_preload(void); /* router.cu */
cudaError_t mxfp8_preload(void); /* mxfp8.cu */

/* ---- the forward's layer launch (gemm_kernels.cu) ------------------------------------------ */
/* Everything of the forward after the schedule, as phases of one launch with every CTA at a grid
 * barrier between them: dispatch (d); the gate/up products (routed p[0], then the shared
 * expert's p[1] when `shared`); when `down` (not a recompute), the down products (p[2], p[3]);
 * when `combine` (down, and no group barrier must come first), combine (c). The products share
 * one cluster shape (p[0].cn); the grid barrier's state is `sync` (u32 [2] in the workspace,
 * zeroed when it is made). */
typedef struct layer_fwd {
  gemm_args p[4]; /* GEMM_FWD_GATEUP routed, shared; GEMM_FWD_DOWN routed, shared */
  dispatch_args d;
  combine_args c;
  unsigned *sync;
  int shared, down, combine;
} layer_fwd;
cudaError_t layer_forward_launch(const layer_fwd *f, int ctas, cudaStream_t stream);

#endif /* MOK_CUDA_KERNELS_H */
