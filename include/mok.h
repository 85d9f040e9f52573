/*
 * mok.h: the public C API of mok, one deterministic Mixture-of-Experts layer (routed SwiGLU
 * experts, an optional shared expert) forward and backward, on NVIDIA Hopper or on the CPU.
 *
 * Shape letters (DESIGN.md §1): T tokens on this rank, H hidden size, I routed intermediate size,
 * I_s shared intermediate size (0 = no shared expert), E experts in total, k experts per token,
 * ep ranks in the expert-parallel group, E_local = E / ep experts on this rank.
 *
 * Usage:
 *   mok_context *ctx;   mok_context_create(&cfg, &ctx);          // backend, device, EP group
 *   mok_workspace *ws;  mok_workspace_create(ctx, &shape, &ws);  // once per layer shape
 *   size_t n = mok_saved_bytes(ws, T);                           // per call: what backward needs
 *   mok_forward(ws, &fwd, stream);   mok_backward(ws, &bwd, stream);
 *   mok_check(ws, stream);           // reports device-side errors (synchronises; not hot path)
 *
 * Pointers are device pointers for the CUDA backend and host pointers for the CPU backend.
 * `stream` is a cudaStream_t (NULL = legacy default stream); the CPU backend ignores it.
 * Nothing here synchronises with the host except mok_check and mok_schedule_counts, and nothing
 * allocates after mok_workspace_create, so forward and backward can be captured in a CUDA graph.
 *
 * Errors. Every function that can fail returns a mok_status (size queries return 0). A call that
 * fails leaves every output as it found it, and `saved` too but for the header that a forward,
 * recompute or schedule writes first (and which then says why it failed). mok_last_error() is
 * the message of the last call on the calling thread that failed, and "" once a later call on
 * that thread succeeds (a destroy, which returns nothing, sets it only when it refuses a handle).
 *
 * Threads. Different workspaces, contexts and groups may be used from different threads at once.
 * A workspace takes one call at a time: a call on a workspace that another thread's call is
 * using (mok_schedule, mok_forward, mok_recompute, mok_backward, mok_check,
 * mok_schedule_counts, mok_workspace_destroy) is refused with MOK_ERR_INVALID_ARG. A call has
 * finished with the workspace when it returns, but the work it queued (CUDA) uses the
 * workspace's memory until it runs: calls on one stream are ordered; calls on different streams
 * must be ordered by the caller (events), which mok cannot see.
 *
 * Lifetimes. Groups, contexts and workspaces may be destroyed in any order (a workspace holds its
 * context, a context its group, until they are destroyed). A second destroy of a handle that is
 * still held is refused and frees nothing, and a context (group) its caller destroyed makes no
 * new workspace (context). Using a handle after it is freed is the caller's error; mok refuses
 * it on a best-effort basis only (a magic word in the handle, cleared when it is freed): do not
 * rely on it.
 *
 * What mok checks (refused with a status, outputs untouched): NULL and misaligned pointers,
 * shapes, sizes and token counts, host pointers given to the CUDA backend, expert ids and the
 * routed-row capacity (on the GPU: the call queues and mok_check reports), a `saved` that its
 * forward did not fill (another workspace's, another call's, garbage, or its schedule
 * overwritten), tensors that overlap `saved`, concurrent calls on one workspace, the ranks of an
 * EP group making different calls at once, thread counts above MOK_MAX_THREADS, a CPU workspace
 * (with a saved of max_tokens) larger than the memory still available. What is the
 * caller's: buffers at least as large as documented (mok is given no sizes), tensors that overlap
 * each other (but x and dx may), x and the weights unchanged from a forward to its backward,
 * `saved`'s activations as the forward left them, the order of calls on different streams, and
 * handles used after they are freed.
 */
#ifndef MOK_H
#define MOK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOK_VERSION_MAJOR 0
#define MOK_VERSION_MINOR 1
#define MOK_VERSION_PATCH 0
#define MOK_VERSION (MOK_VERSION_MAJOR * 10000 + MOK_VERSION_MINOR * 100 + MOK_VERSION_PATCH)

/* Routed rows of each expert are padded to a multiple of this (the GEMM tile height). */
#define MOK_TILE_M 128

/* X(name, value, message). One list generates the enum, mok_status_name and mok_status_string. */
#define MOK_STATUS_LIST(X)                                                                       \
  X(MOK_OK, 0, "success")                                                                      \
  X(MOK_ERR_INVALID_ARG, 1, "invalid argument (null pointer, bad size or shape)")              \
  X(MOK_ERR_UNSUPPORTED, 2, "not supported (backend, device, precision or shape)")             \
  X(MOK_ERR_ALIGNMENT, 3, "pointer not aligned as required")                                   \
  X(MOK_ERR_OUT_OF_MEMORY, 4, "out of memory")                                                 \
  X(MOK_ERR_EXPERT_ID, 5, "an expert id in topk_ids is out of range")                          \
  X(MOK_ERR_CAPACITY, 6, "routed rows exceed the capacity of the workspace")                   \
  X(MOK_ERR_TIMEOUT, 7, "a peer rank did not arrive in time")                                  \
  X(MOK_ERR_CUDA, 8, "CUDA runtime error")                                                     \
  X(MOK_ERR_NCCL, 9, "NCCL error")                                                             \
  X(MOK_ERR_INTERNAL, 10, "internal error")

typedef enum mok_status {
#define MOK_STATUS_ENUM_(name, value, msg) name = value,
  MOK_STATUS_LIST(MOK_STATUS_ENUM_)
#undef MOK_STATUS_ENUM_
} mok_status;

typedef enum mok_backend { MOK_BACKEND_CPU = 0, MOK_BACKEND_CUDA = 1 } mok_backend;
/* MOK_FP8: every matrix product on e4m3 operands with fp32 scales per 1 x 128 (activations,
 * gradients) and 128 x 128 (weights), DESIGN.md §8; inputs, outputs and saved stay as in BF16. */
typedef enum mok_precision { MOK_BF16 = 0, MOK_FP8 = 1 } mok_precision;

/* How backward writes the six weight gradients. */
typedef enum mok_grad_mode {
  MOK_GRAD_WRITE_BF16 = 0,     /* dw_* are bf16 tensors, overwritten */
  MOK_GRAD_ACCUMULATE_F32 = 1  /* dw_* are fp32 main-grad buffers; backward adds to them */
} mok_grad_mode;

typedef struct mok_context mok_context;
typedef struct mok_workspace mok_workspace;
typedef struct mok_ep_group mok_ep_group;

/* ---- version, status ------------------------------------------------------------------------ */
int mok_version(void);                      /* MOK_VERSION of the library that is loaded */
const char *mok_status_name(mok_status s);   /* "MOK_ERR_INVALID_ARG" */
const char *mok_status_string(mok_status s); /* one line saying what the code means */
/* The last failure on the calling thread: what was wrong and what was expected. "" if none, or
 * once a later call on the thread succeeded. */
const char *mok_last_error(void);

/* ---- bf16 ----------------------------------------------------------------------------------- */
/* The bit pattern of a bf16 value in a uint16_t. Round-to-nearest-even; NaN stays NaN (quiet), Inf
 * stays Inf, overflow rounds to Inf. */
uint16_t mok_f32_to_bf16(float f);
float mok_bf16_to_f32(uint16_t b);

/* ---- expert-parallel group ------------------------------------------------------------------ */
/* `ranks` ranks emulated in this process: each rank has its own context and workspace, and calls
 * mok_forward / mok_backward from its own thread, as separate processes would; their buffers
 * serve as each other's peer memory. A rank that has not reached a call's barrier after
 * `timeout_ms` (0 = 10 000) makes every rank waiting there fail with MOK_ERR_TIMEOUT, and the
 * group stays failed. CPU and CUDA backends (CUDA: the ranks share one GPU, each on its own
 * stream, and their calls are enqueued in rank order: mok_forward, mok_recompute, mok_backward
 * and mok_schedule, refused ones included, count as rank r's n-th call, which waits until rank
 * r - 1 has enqueued its n-th (rank 0: rank R - 1 its (n-1)-th). So a thread calling for several
 * ranks must go rank by rank, call by call; and CUDA graphs captured from these calls should be
 * launched in rank order too, which mok cannot do for the caller); 1 <= ranks <= MOK_EP_MAX. */
#define MOK_EP_MAX 64
mok_status mok_ep_group_create_emulated(int ranks, int timeout_ms, mok_ep_group **out);

/* One process per GPU: a group over an NCCL communicator (CUDA backend only). NCCL is loaded as
 * libnccl.so.2 when the first such group is made (in a process with torch: torch's); any release
 * from that of the headers mok was built with (2.28 or later) on is taken. The group's size and this
 * process's rank are the communicator's; the context takes ep_rank = that rank, ep_size = that
 * size and device = the communicator's GPU. Making the workspace is collective (every rank, one
 * shape, at the same point): it registers the workspace as an NCCL symmetric window, and every
 * rank fails if the shapes differ. Destroying it is collective too (the window is deregistered).
 * Calls then meet only at device barriers, as emulated ranks do. `comm` stays the caller's and
 * must outlive the group. */
struct ncclComm; /* ncclComm_t is struct ncclComm * */
mok_status mok_ep_group_create_nccl(struct ncclComm *comm, int timeout_ms, mok_ep_group **out);
/* Without a communicator at hand: one rank makes an id, every rank gets its bytes (a file, a
 * socket, torch.distributed's broadcast), and each creates the group with its rank; mok then
 * makes the communicator on `device` and owns it. The call returns once every rank has joined. */
#define MOK_NCCL_ID_BYTES 128
mok_status mok_nccl_id(unsigned char id[MOK_NCCL_ID_BYTES]);
mok_status mok_ep_group_create_nccl_id(const unsigned char id[MOK_NCCL_ID_BYTES], int rank,
                                       int ranks, int device, int timeout_ms,
                                       mok_ep_group **out);
/* Destroy calls of groups, contexts and workspaces may come in any order: a context holds its
 * group and a workspace its context, and each is freed when the last holder is gone. */
void mok_ep_group_destroy(mok_ep_group *g); /* accepts NULL */

/* ---- context: backend, device, EP group ----------------------------------------------------- */
#define MOK_MAX_THREADS 1024 /* more is refused: an OpenMP team that large ends the process */
typedef struct mok_context_config {
  mok_backend backend;
  int device;   /* CUDA device ordinal; ignored by the CPU backend */
  int ep_rank;  /* rank in the expert-parallel group */
  int ep_size;  /* ranks in the group (1: no group) */
  int threads;  /* CPU backend worker threads; 0 = all cores; at most MOK_MAX_THREADS */
  int sms;      /* CUDA: multiprocessors the persistent kernels spread over; 0 = all.
                 * A tuning knob: it never changes a bit of any result (DESIGN §3, D2). */
  int cluster;  /* CUDA: CTAs per cluster of every GEMM: 2 (2 x 1 output tiles, which share their
                 * B tile) or 4 (2 x 2 tiles, which also share A); 0 = the default, 2
                 * (DESIGN §2.2). A tuning knob: it never changes a bit of any result. */
  mok_ep_group *group; /* the EP group (its size is ep_size); NULL when ep_size = 1, or an
                        * NCCL group of one rank */
} mok_context_config;
#define MOK_CONTEXT_CONFIG_INIT {MOK_BACKEND_CPU, 0, 0, 1, 0, 0, 0, NULL}

mok_status mok_context_create(const mok_context_config *cfg, mok_context **out);
void mok_context_destroy(mok_context *ctx); /* accepts NULL */
/* Number of CUDA devices visible (0 when there is no driver or no GPU). Never fails. */
int mok_cuda_device_count(void);

/* ---- workspace: scratch for one layer shape, created once ----------------------------------- */
#define MOK_MAX_TOKENS (1 << 20) /* the most max_tokens of a workspace or a router */
typedef struct mok_shape {
  int64_t max_tokens;   /* T: the most tokens per rank any call will pass, 1..MOK_MAX_TOKENS */
  int64_t hidden;       /* H */
  int64_t inter;        /* I */
  int64_t shared_inter; /* I_s; 0 = no shared expert */
  int32_t experts;      /* E, all ranks together; E % ep == 0 */
  int32_t top_k;        /* k, 1 <= k <= E */
  mok_precision precision;
  int64_t routed_rows;  /* capacity: the most routed rows one call may bring to a rank's experts,
                         * each expert's count rounded up to MOK_TILE_M; 0 = the worst case (every
                         * slot of every rank). A call that needs more fails with
                         * MOK_ERR_CAPACITY on every rank, outputs untouched. */
} mok_shape;
#define MOK_SHAPE_INIT {0, 0, 0, 0, 0, 0, MOK_BF16, 0}

/* The CUDA backend also needs H, I and I_s to be multiples of 64. The CPU backend refuses, with
 * MOK_ERR_OUT_OF_MEMORY, a workspace that with one saved of max_tokens would need more than the
 * memory available now (MemAvailable, or a cgroup's limit): its pages are only committed when
 * touched, so it would otherwise be made and the process killed in the middle of a call. */
mok_status mok_workspace_create(mok_context *ctx, const mok_shape *shape, mok_workspace **out);
void mok_workspace_destroy(mok_workspace *ws); /* accepts NULL */
/* Bytes of workspace memory held (device memory for CUDA, host memory for the CPU). */
size_t mok_workspace_bytes(const mok_workspace *ws);

/* Bytes of the `saved` buffer a call with `tokens` tokens needs: the schedule and the activations
 * backward reads (gate/up pre-activations and the weighted SwiGLU output). One per call in flight:
 * forward (or recompute) fills it, backward of the same inputs reads it. 256-byte aligned.
 * 0 when ws is NULL or tokens is outside 1..max_tokens; mok_last_error() then says which. */
size_t mok_saved_bytes(const mok_workspace *ws, int64_t tokens);

/* ---- the layer ------------------------------------------------------------------------------ */
typedef struct mok_weights {   /* bf16, row-major; E_local experts of this rank */
  const void *w_gate;          /* [E_local, I, H] */
  const void *w_up;            /* [E_local, I, H] */
  const void *w_down;          /* [E_local, H, I] */
  const void *ws_gate;         /* [I_s, H]; NULL when I_s = 0 */
  const void *ws_up;           /* [I_s, H] */
  const void *ws_down;         /* [H, I_s] */
  const void *fp8;             /* MOK_FP8: mok_fp8_weights_bytes(ws) bytes filled by
                                * mok_quantize_weights or mok_fp8_weights_import; the bf16
                                * pointers above are then not read (may be NULL). MOK_BF16: NULL */
} mok_weights;

typedef struct mok_forward_args {
  int64_t tokens;              /* T, 1 <= T <= max_tokens */
  const void *x;               /* [T, H] bf16 */
  const int32_t *topk_ids;     /* [T, k] global expert ids */
  const float *topk_weights;   /* [T, k] router weights */
  mok_weights w;
  void *y;                     /* [T, H] bf16, out (may be NULL for mok_recompute) */
  void *saved;                 /* mok_saved_bytes(ws, T) bytes, out; no tensor of a call may
                                * overlap it (MOK_ERR_INVALID_ARG) */
} mok_forward_args;

typedef struct mok_grads {     /* same shapes as mok_weights; bf16 or fp32 per mok_grad_mode */
  void *dw_gate, *dw_up, *dw_down;
  void *dws_gate, *dws_up, *dws_down; /* NULL when I_s = 0 */
} mok_grads;

typedef struct mok_backward_args {
  int64_t tokens;              /* T, as in the forward that filled `saved` */
  const void *x;               /* [T, H] bf16, the forward's input, unchanged since (the CUDA
                                * backend may reuse the rows it copied from it then) */
  const int32_t *topk_ids;     /* [T, k], the forward's */
  const float *topk_weights;   /* [T, k], the forward's */
  mok_weights w;
  const void *saved;           /* filled by mok_forward or mok_recompute with these inputs
                                * (mok_schedule alone does not fill it). A saved of another
                                * workspace shape, rank or token count, of other topk_ids or
                                * topk_weights, of mok_schedule alone, never filled, or whose
                                * schedule was overwritten since is refused with
                                * MOK_ERR_INVALID_ARG, outputs untouched (CPU: returned; CUDA: from
                                * mok_check, after the error of a forward that failed, if it
                                * did). Its activations are not checked: keep saved as the
                                * forward left it. */
  const void *dy;              /* [T, H] bf16 */
  void *dx;                    /* [T, H] bf16, out */
  float *d_topk_weights;       /* [T, k] fp32, out */
  mok_grads g;                 /* out */
  mok_grad_mode grad_mode;
} mok_backward_args;

/* Builds the schedule (canonical per-expert row lists, padded offsets) into a->saved only. */
mok_status mok_schedule(mok_workspace *ws, const mok_forward_args *a, void *stream);
/* y = shared(x) + sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x); fills a->saved. */
mok_status mok_forward(mok_workspace *ws, const mok_forward_args *a, void *stream);
/* Fills a->saved as mok_forward would, without computing y (activation checkpointing). */
mok_status mok_recompute(mok_workspace *ws, const mok_forward_args *a, void *stream);
/* dx, d_topk_weights and the six weight gradients. */
mok_status mok_backward(mok_workspace *ws, const mok_backward_args *a, void *stream);

/* ---- FP8 weights (precision = MOK_FP8, DESIGN.md §8.3) -------------------------------------- */
/* Bytes of a workspace's FP8 weight buffer (256-byte aligned, device memory for CUDA): every
 * weight tensor's e4m3 codes in both orientations and its 128 x 128 block scales. 0 when ws is
 * NULL or not MOK_FP8. */
size_t mok_fp8_weights_bytes(const mok_workspace *ws);
/* fp8 <- the FP8 form of the bf16 weights w (w->fp8 is not read). Once per optimizer step: the
 * forward and backward of every call read it through mok_weights.fp8. Queued on `stream`. */
mok_status mok_quantize_weights(mok_workspace *ws, const mok_weights *w, void *fp8, void *stream);

/* One weight tensor already in FP8: codes [E, N, K] e4m3 (the layout of the bf16 tensor it
 * replaces) and fp32 scales [E, ceil(N / 128), ceil(K / 128)], one per 128 x 128 block, finite and
 * positive (value = code * scale). */
typedef struct mok_fp8_matrix {
  const void *q;
  const float *s;
} mok_fp8_matrix;
typedef struct mok_fp8_given {  /* the shared expert's: all NULL when I_s = 0 */
  mok_fp8_matrix w_gate, w_up, w_down, ws_gate, ws_up, ws_down;
} mok_fp8_given;
/* fp8 <- the given codes and scales, with the transposed codes the dgrads read. */
mok_status mok_fp8_weights_import(mok_workspace *ws, const mok_fp8_given *w, void *fp8,
                                  void *stream);

/* ---- MXFP8 inputs (DESIGN.md §8.5) ---------------------------------------------------------- */
/* MXFP8 rows (OCP Microscaling v1.0, e4m3 elements) to the bf16 the layer takes: x, dy, or a
 * weight tensor [E, N, K] as E * N rows of K. q [rows, k] e4m3 codes; scales [rows, k / 32] E8M0
 * bytes, one per 32 consecutive values of a row (byte b: 2^(b - 127)); out [rows, k] bf16 <-
 * decode(q) * 2^(b - 127), exact unless it is finer than bf16's least step 2^-133 (only with
 * scale bytes 0..2: it then rounds to nearest even). k a multiple of 32; q and out 16-byte
 * aligned (scales may start at any byte), out apart from q and scales. A block with scale byte
 * 0xff (NaN) or a value of 2^128 or more (beyond bf16) is refused with MOK_ERR_INVALID_ARG and
 * out left untouched: at once on the CPU backend; on the CUDA backend, which checks on the
 * device, from mok_check. Any workspace (BF16 or FP8); queued on `stream`. */
mok_status mok_mxfp8_to_bf16(mok_workspace *ws, int64_t rows, int64_t k, const void *q,
                             const void *scales, void *out, void *stream);

/* ---- the router (DESIGN.md §1.2) ------------------------------------------------------------ */
/* logits = x W_r^T, scores by softmax or sigmoid, an optional bias that steers the choice only,
 * optional group-limited choice, top-k (ties: the lower expert id), optional renormalisation and
 * a scaling factor; per-expert counts and optional auxiliary losses. Backward from
 * d_topk_weights (and the losses' gradients) gives dx and dW_r. A router is made once per
 * configuration on a context, like a workspace; it holds the scratch its backward needs. */
typedef enum mok_router_scoring {
  MOK_ROUTER_SOFTMAX = 0, /* s = softmax(logits) over the E experts */
  MOK_ROUTER_SIGMOID = 1  /* s = sigmoid(logits), each expert on its own (DeepSeek-V3) */
} mok_router_scoring;

typedef struct mok_router_config {
  int64_t max_tokens;         /* the most tokens a call will pass, 1..MOK_MAX_TOKENS */
  int64_t hidden;             /* H */
  int32_t experts;            /* E, 1..MOK_ROUTER_MAX_EXPERTS */
  int32_t top_k;              /* k, 1..min(E, MOK_ROUTER_MAX_K) */
  mok_router_scoring scoring;
  int32_t n_group;            /* 0 or 1: no group limit; else groups of E / n_group experts and
                               * only experts of the topk_group best groups are chosen */
  int32_t topk_group;         /* 1..n_group when n_group > 1 (k <= topk_group * E / n_group) */
  int32_t renormalize;        /* 1: the k weights are divided by their sum */
  float scale;                /* every weight is multiplied by it (routed scaling factor) */
} mok_router_config;
#define MOK_ROUTER_CONFIG_INIT {0, 0, 0, 0, MOK_ROUTER_SOFTMAX, 0, 0, 0, 1.0f}
#define MOK_ROUTER_MAX_EXPERTS 1024
#define MOK_ROUTER_MAX_K 32

typedef struct mok_router mok_router;
mok_status mok_router_create(mok_context *ctx, const mok_router_config *cfg, mok_router **out);
void mok_router_destroy(mok_router *r); /* accepts NULL */
/* Bytes of the router's `saved` buffer for a call of `tokens` tokens (what backward reads: the
 * logits, the chosen ids and the counts). 0 when r is NULL or tokens is outside 1..max_tokens. */
size_t mok_router_saved_bytes(const mok_router *r, int64_t tokens);

typedef struct mok_router_forward_args {
  int64_t tokens;             /* T, 1..max_tokens */
  const void *x;              /* [T, H] bf16 */
  const void *w_router;       /* [E, H] bf16 */
  const float *bias;          /* [E] fp32 added to the scores for the choice only, or NULL */
  int32_t *topk_ids;          /* [T, k] out: chosen experts, best first */
  float *topk_weights;        /* [T, k] out */
  int32_t *counts;            /* [E] out: slots routed to each expert by this call */
  float *aux_loss;            /* [1] out, or NULL: the load-balancing loss (DESIGN §1.2) */
  float *z_loss;              /* [1] out, or NULL: the router z-loss */
  void *saved;                /* mok_router_saved_bytes(r, T) bytes, 256-byte aligned, out */
} mok_router_forward_args;

typedef struct mok_router_backward_args {
  int64_t tokens;             /* T, the forward's */
  const void *x;              /* [T, H] bf16, the forward's */
  const void *w_router;       /* [E, H] bf16, the forward's */
  const void *saved;          /* filled by mok_router_forward with these inputs */
  const float *d_topk_weights;/* [T, k] fp32 (mok_backward's output) */
  const float *d_aux_loss;    /* [1] gradient of the loss in aux_loss, or NULL (0) */
  const float *d_z_loss;      /* [1] gradient of the loss in z_loss, or NULL (0) */
  void *dx;                   /* [T, H] bf16, out (or in and out with accumulate_dx) */
  int32_t accumulate_dx;      /* 1: dx = bf16(dx + router's dx) (the layer's dx, in place);
                               * 0: dx = bf16(router's dx) */
  void *dw_router;            /* [E, H], out: bf16, or fp32 added to per grad_mode */
  mok_grad_mode grad_mode;
} mok_router_backward_args;

mok_status mok_router_forward(mok_router *r, const mok_router_forward_args *a, void *stream);
mok_status mok_router_backward(mok_router *r, const mok_router_backward_args *a, void *stream);

/* Waits for `stream`, then reports (and clears) any device-side error raised since the last check:
 * MOK_ERR_EXPERT_ID, MOK_ERR_CAPACITY, MOK_ERR_TIMEOUT, or MOK_ERR_INVALID_ARG (a CUDA backward
 * given a saved its forward did not fill, or a call refused on another rank). A call that
 * raised one left its outputs untouched. Synchronises: for tests and debugging, not the training
 * loop. */
mok_status mok_check(mok_workspace *ws, void *stream);

/* Copies the per-expert routed row counts of the schedule in `saved` to counts[E_local] on the
 * host. Synchronises. A saved of another workspace or token count is refused with
 * MOK_ERR_INVALID_ARG, and that of a call that failed with that call's error; counts untouched. */
mok_status mok_schedule_counts(mok_workspace *ws, const void *saved, int64_t tokens,
                               int32_t *counts, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* MOK_H */
