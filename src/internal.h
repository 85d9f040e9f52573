/*
 * internal.h: what the API layer and the backends share: the context and workspace structs, the
 * layout of the per-call `saved` buffer (computed here once, carved everywhere from it), the
 * backend function table, and the per-thread last-error functions.
 */
#ifndef MOK_INTERNAL_H
#define MOK_INTERNAL_H

#include "mok.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors (status.c) ---------------------------------------------------------------------- */
/* Records a message for mok_last_error() on this thread and returns `s`. */
mok_status mok_fail(mok_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void mok_clear_error(void);
/* What a public function returns: `s`, after clearing mok_last_error() if it is MOK_OK (mok.h:
 * the message is that of the last call on this thread, "" once a later one succeeds). */
static inline mok_status mok_done(mok_status s) {
  if (s == MOK_OK) mok_clear_error();
  return s;
}

/* Returns MOK_ERR_INVALID_ARG, with the message, from the calling function unless cond holds. */
#define CHECK_ARG(cond, ...)                                        \
  do {                                                              \
    if (!(cond)) return mok_fail(MOK_ERR_INVALID_ARG, __VA_ARGS__); \
  } while (0)

/* Returns the status of `expr` from the calling function unless it is MOK_OK. */
#define TRY(expr)                  \
  do {                             \
    mok_status st_ = (expr);       \
    if (st_ != MOK_OK) return st_; \
  } while (0)

/* ---- sizes ---------------------------------------------------------------------------------- */
static inline int64_t mok_round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
static inline int64_t mok_min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t mok_max64(int64_t a, int64_t b) { return a > b ? a : b; }
#define MOK_ALIGN 256 /* every buffer carved from saved/workspace starts on this boundary */

/* Takes `bytes` at *cursor for one buffer of a layout and moves the cursor past it, aligned. */
static inline size_t mok_take(size_t *cursor, int64_t bytes) {
  size_t at = *cursor;
  *cursor += (size_t)mok_round_up(bytes, MOK_ALIGN);
  return at;
}

/* Device-side error codes stored in error words (int32). Zero means fine. */
enum { MOK_DEVERR_NONE = 0, MOK_DEVERR_EXPERT_ID = 1, MOK_DEVERR_CAPACITY = 2,
       MOK_DEVERR_TIMEOUT = 4,
       MOK_DEVERR_PEER_ARG = 8, /* a rank of the EP group had this call refused by api.c */
       MOK_DEVERR_SAVED = 16, /* a backward's saved was not filled by its forward (or recompute)
                               * (the CUDA backend's check; the CPU one refuses it on the host) */
       MOK_DEVERR_PEER_CALL = 32, /* the ranks of the EP group made different calls at once */
       MOK_DEVERR_MXFP8 = 64 /* mok_mxfp8_to_bf16 met a NaN scale byte or a value of 2^128 or
                              * more (the CUDA backend's check; the CPU one refuses at once) */ };

/* The kinds of call a workspace takes (api.c sets mok_workspace.call). The group's barriers carry
 * the caller's kind, as bit MOK_CALL_SHIFT + kind of a word the ranks OR together, so ranks that
 * make different calls at once all fail there (and leave the group usable: every kind of call
 * passes its first barrier, where they fail, the same way). mok_call_name: "mok_forward". */
enum { MOK_CALL_NONE, MOK_CALL_SCHEDULE, MOK_CALL_FORWARD, MOK_CALL_RECOMPUTE, MOK_CALL_BACKWARD,
       MOK_CALL_CHECK, MOK_CALL_COUNTS, /* (these two meet no barrier) */ MOK_CALL_KINDS };
#define MOK_CALL_SHIFT 24
#define MOK_CALL_MASK (((1 << MOK_CALL_KINDS) - 1) << MOK_CALL_SHIFT)
const char *mok_call_name(int call);
/* "mok_forward and mok_backward": the calls whose bits are set in `calls` (MOK_CALL_MASK). */
void mok_call_names(int32_t calls, char *out, size_t len);

/* The header of `saved`: its first MOK_STATUS_WORDS int32 words, written by the schedule of the
 * forward, recompute or schedule that fills it (before it can fail, so a failed call's saved
 * still says what failed). Backward and mok_schedule_counts check MAGIC, IDENT and TOKENS
 * against their own call before they read anything else of saved: saved's layout depends on the
 * workspace and the tokens, so a saved of another workspace or call would be read at the wrong
 * places (or past the end of a smaller buffer). Backward then checks ROUTING against its own
 * topk_ids and topk_weights (the saved of another layer of the same shape) and SCHEDULE against
 * the schedule arrays (saved overwritten since), so that every index it takes from saved is one
 * the schedule wrote. */
enum {
  MOK_STATUS_BITS = 0,     /* device-error bits of the call (MOK_DEVERR_*) */
  MOK_STATUS_OPEN = 1,     /* CUDA with an EP group: the bits every rank agreed on at the opening
                            * barrier */
  MOK_STATUS_TOKENS = 2,   /* tokens of the call that filled saved */
  MOK_STATUS_FILLED = 3,   /* MOK_FILLED_*: how far the call that filled saved got */
  MOK_STATUS_MAGIC = 4,    /* MOK_SAVED_MAGIC */
  MOK_STATUS_IDENT = 5,    /* mok_saved_ident of the workspace that filled saved */
  MOK_STATUS_ROUTING = 6,  /* mok_routing_sum of the call's topk_ids and topk_weights */
  MOK_STATUS_SCHEDULE = 7, /* mok_schedule_sum of the schedule arrays as written */
  MOK_STATUS_WORDS = 8
};
#define MOK_SAVED_MAGIC 0x534b4f4d /* "MOKS" */
/* A call that failed (BITS set) or did not finish (a barrier timed out) stops before the next. */
enum { MOK_FILLED_NONE = 0, MOK_FILLED_SCHEDULE = 1, MOK_FILLED_ACTIVATIONS = 2 };
/* The backward's copy of the status (CUDA) has no use for TOKENS: its word 2 says whether the
 * workspace's routed x rows are already this call's (saved_open, rows.cu); words 4..6 are
 * saved_open's sums and count of finished blocks, zero between calls. */
enum { MOK_BSTATUS_X_ROWS = 2, MOK_BSTATUS_ROUTING = 4, MOK_BSTATUS_SCHEDULE = 5,
       MOK_BSTATUS_DONE = 6, MOK_BSTATUS_WORDS = 8 };

#ifdef __CUDACC__
#define MOK_HOST_DEVICE __host__ __device__
#else
#define MOK_HOST_DEVICE
#endif

/* Order-free checksums: a sum (mod 2^32) of one term per element, so that threads may add their
 * terms in any order and every backend gets the same sum. A term mixes the array, the index and
 * the value through murmur3's finaliser, a bijection: changing any one value always changes the
 * sum. */
enum { MOK_SUM_IDS, MOK_SUM_WEIGHTS, MOK_SUM_COUNTS, MOK_SUM_OFFSETS, MOK_SUM_ROW_SRC,
       MOK_SUM_ROW_WEIGHT, MOK_SUM_SLOT_ROW, MOK_SUM_MBLOCK };
MOK_HOST_DEVICE static inline uint32_t mok_mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}
MOK_HOST_DEVICE static inline uint32_t mok_sum_term(uint32_t array, int64_t index, uint32_t v) {
  return mok_mix32(mok_mix32((uint32_t)index ^ (array << 28)) ^ v);
}
MOK_HOST_DEVICE static inline uint32_t mok_sum_term_f(uint32_t array, int64_t index, float v) {
  union { float f; uint32_t u; } b;
  b.f = v;
  return mok_sum_term(array, index, b.u);
}

/* Whether a backward of `tokens` tokens on a workspace of identity `ident` may read the saved
 * whose header this is (both backends: the CPU's host check, the CUDA backward's first
 * kernel). A forward that failed passes: its error bits stand for it. The routing and schedule
 * sums are checked after this, and only when it passes. */
enum { MOK_SAVED_OK, MOK_SAVED_FOREIGN, MOK_SAVED_OTHER_TOKENS, MOK_SAVED_SCHEDULE_ONLY };
MOK_HOST_DEVICE static inline int mok_saved_check(const int32_t *status, uint32_t ident,
                                                  int64_t tokens) {
  if (status[MOK_STATUS_MAGIC] != MOK_SAVED_MAGIC || (uint32_t)status[MOK_STATUS_IDENT] != ident)
    return MOK_SAVED_FOREIGN;
  if (status[MOK_STATUS_TOKENS] != tokens) return MOK_SAVED_OTHER_TOKENS;
  if (status[MOK_STATUS_BITS] == 0 && status[MOK_STATUS_FILLED] != MOK_FILLED_ACTIVATIONS)
    return MOK_SAVED_SCHEDULE_ONLY;
  return MOK_SAVED_OK;
}

/* The per-call `saved` buffer: schedule, then the activations backward reads.
 * Every offset is in bytes from the start of `saved` and a multiple of MOK_ALIGN. */
typedef struct mok_saved_layout {
  int64_t tokens;        /* T */
  int64_t rows_cap;      /* most routed rows incl. padding: multiple of MOK_TILE_M */
  size_t status;         /* int32[MOK_STATUS_WORDS]: the header (MOK_STATUS_*) */
  size_t tag;            /* u64, CUDA: the number of the forward that filled saved (unique in
                          * the process), against which a backward knows the routed x rows the
                          * workspace still holds (rows.cu) */
  size_t counts;         /* int32[E_local] routed rows per local expert */
  size_t offsets;        /* int32[E_local + 1] padded first row per expert; [E_local] = total */
  size_t row_src;        /* int32[rows_cap] source of each routed row: its rank's slot t*k + j,
                          * plus rank * max_tokens * k; -1 on padding */
  size_t row_weight;     /* float[rows_cap] topk weight of each routed row; 0 on padding */
  size_t slot_row;       /* int32[T * k] the routed row on this rank of each of this rank's slots
                          * t*k + j (row_src inverted); -1 where its expert is on another rank */
  size_t mblock_expert;  /* int32[rows_cap / MOK_TILE_M] local expert of each 128-row block */
  size_t gu;             /* bf16[rows_cap, 2I]: [bf16(gate) | bf16(up)] pre-activations */
  size_t hw;             /* bf16[rows_cap, I]: bf16(w * silu(gate) * up) */
  size_t gus;            /* bf16[T, 2I_s]: shared expert pre-activations */
  size_t hs;             /* bf16[T, I_s]: shared expert silu(gate) * up */
  size_t bytes;          /* total */
} mok_saved_layout;

/* The FP8 weight buffer (DESIGN §8.3): for each weight tensor [E, N, K] (E = E_local, or 1 for
 * the shared expert's; none when I_s = 0), its e4m3 codes, the codes transposed and the block
 * scales. Offsets in bytes from the buffer's start, multiples of MOK_ALIGN. */
typedef struct mok_fp8_matrix_layout {
  int64_t experts, n, k;  /* E, N, K */
  size_t q;               /* u8 [E, N, K] codes */
  size_t qt;              /* u8 [E, K, N] the same codes, transposed */
  size_t s;               /* f32 [E, ceil(N / 128), ceil(K / 128)] block scales */
} mok_fp8_matrix_layout;
enum { MOK_W_GATE, MOK_W_UP, MOK_W_DOWN, MOK_WS_GATE, MOK_WS_UP, MOK_WS_DOWN, MOK_W_COUNT };
typedef struct mok_fp8_layout {
  mok_fp8_matrix_layout m[MOK_W_COUNT]; /* indexed by MOK_W_* */
  size_t bytes;
} mok_fp8_layout;

/* ---- expert-parallel group (group.c, nccl.c) ------------------------------------------------ */
/* Emulated ranks in one process, or one rank of a group of processes over NCCL. `ws` is the peer
 * table: rank r's workspace, whose symmetric buffers the other ranks read (dispatch pulls) and
 * write (combine pushes into their own slots); an NCCL group holds only its own rank's. */
/* Handles carry a magic word while they live; entry points refuse one without it (destroyed, or
 * not made by mok), and destroy refuses a handle its caller already destroyed. Best effort:
 * reading a freed handle is undefined, and this catches only what the allocator has not reused
 * (free overwrites the first words, where the magic is). */
#define MOK_MAGIC_GROUP 0x50474b4d     /* "MKGP" */
#define MOK_MAGIC_CONTEXT 0x58434b4d   /* "MKCX" */
#define MOK_MAGIC_WORKSPACE 0x53574b4d /* "MKWS" */

struct mok_ep_group {
  uint32_t magic;       /* MOK_MAGIC_GROUP until freed */
  int released;         /* the caller's handle was destroyed (contexts may still hold the group) */
  int refs;             /* the caller's handle + one per context: freed when the last goes */
  int size;
  int timeout_ms;
  int broken;           /* a barrier timed out: every later barrier fails at once */
  struct mok_workspace *ws[MOK_EP_MAX];
  void *sync;           /* mutex, condition and barrier state (group.c) */
  void *nccl;           /* NCCL group: its ncclComm_t; NULL for emulated ranks */
  int nccl_rank;        /* NCCL group: this process's rank and device */
  int nccl_device;
  /* Frees what the group's maker added when the group is freed (nccl.c: the communicator mok
   * made from an id); NULL for none. */
  void (*release)(struct mok_ep_group *g);
};

/* group.c: a group of `ranks` with its lock; nccl.c fills in the NCCL fields. */
mok_status mok_group_alloc(int ranks, int timeout_ms, mok_ep_group **out);

/* Every rank of the group calls this at the same points of a call, `call` its kind (MOK_CALL_*).
 * `bits` in: this rank's error bits (MOK_DEVERR_*); out: the OR over all ranks, so every rank
 * stops when any one must. MOK_ERR_TIMEOUT if some rank did not arrive within the group's
 * timeout; MOK_ERR_INVALID_ARG, on every rank, if they made different calls. A NULL group
 * (ep = 1) returns at once. */
mok_status mok_group_barrier(mok_ep_group *g, int call, int32_t *bits);
/* Checks a group handle of the caller's: live, and not destroyed by the caller. */
int mok_group_live(const mok_ep_group *g);
/* Contexts hold the group: destroy calls may come in any order (Python's collector has none). */
void mok_group_retain(mok_ep_group *g);
void mok_group_release(mok_ep_group *g);
/* The workspace of each rank joins the peer table when created and leaves it when destroyed. */
mok_status mok_group_join(mok_ep_group *g, int rank, struct mok_workspace *ws);
void mok_group_leave(mok_ep_group *g, int rank, struct mok_workspace *ws);
/* A barrier of the group timed out: api.c refuses later calls before they publish anything (a
 * peer that is late, not gone, may still be reading). */
int mok_group_broken(const mok_ep_group *g);
/* Emulated ranks on the CUDA backend enqueue their calls in rank order: rank r's n-th call
 * takes its turn once rank r - 1's n-th (rank R - 1's (n-1)-th for rank 0) has given it, that is,
 * has been enqueued. Called at once, the ranks' threads sometimes left one rank's work held back
 * on the GPU until its peers' barriers timed out (DESIGN §2.3); in this order, never. A turn not
 * given within the group's timeout is taken anyway (the calls before it are skipped: a late one
 * then goes at once); a failed group waits for no turn. */
void mok_group_turn_take(mok_ep_group *g, int rank);
void mok_group_turn_give(mok_ep_group *g, int rank);
/* Marks the group failed (a device barrier timed out; seen at mok_check). */
void mok_group_break(mok_ep_group *g);
/* 1 and every rank's workspace in out[0..size) if each rank has one, else 0. */
int mok_group_members(mok_ep_group *g, struct mok_workspace **out);

/* ---- NCCL (nccl.c), loaded at the first NCCL group -------------------------------------------- */
/* NCCL_VERSION_CODE of the NCCL loaded (0 if none). */
int mok_nccl_version(void);
/* Memory for a symmetric window: ncclMemAlloc / ncclMemFree. */
mok_status mok_nccl_mem_alloc(void **p, size_t bytes);
void mok_nccl_mem_free(void *p);
/* Collective over the group: registers [p, p + bytes) as a symmetric window and returns the
 * ncclWindow_t. */
mok_status mok_nccl_window_register(mok_ep_group *g, void *p, size_t bytes, void **win);
void mok_nccl_window_deregister(mok_ep_group *g, void *win);
/* Collective: every rank's `bytes` at `send` (device) into recv[rank * bytes] (device), on
 * `stream`, then waits for it. */
mok_status mok_nccl_all_gather(mok_ep_group *g, const void *send, void *recv, size_t bytes,
                               void *stream);

struct mok_backend_ops;

struct mok_context {
  uint32_t magic; /* MOK_MAGIC_CONTEXT until freed */
  int released;   /* the caller's handle was destroyed (workspaces may still hold the context) */
  int refs;      /* the caller's handle + one per workspace: freed when the last goes */
  mok_context_config cfg;
  const struct mok_backend_ops *ops;
  int sm_count;  /* CUDA: multiprocessors the kernels may use (cfg.sms or all) */
  int gemm_ctas[2]; /* CUDA: CTAs of the persistent GEMMs in clusters of 2 x cn CTAs, [cn - 1]: a
                     * multiple of the cluster, all resident at once; at most sm_count, or one
                     * cluster when sm_count is smaller */
  int gemm8_ctas;   /* CUDA: the same for the FP8 products (clusters of 2) */
};

struct mok_workspace {
  uint32_t magic;        /* MOK_MAGIC_WORKSPACE until destroyed */
  int busy;              /* 1 while a call runs on it (atomic): calls take a workspace one at a
                          * time, and one made meanwhile is refused */
  int call;              /* MOK_CALL_* of the call running */
  mok_context *ctx;
  mok_shape shape;
  int64_t experts_local; /* E / ep */
  int64_t expert_base;   /* first global expert id of this rank */
  size_t bytes;          /* memory held by the backend for this workspace */
  void *backend;         /* backend-owned state */
};

/* api.c: whether ctx is a live context of the caller's (internal.h's magic words); and the drop
 * of one hold on it (a workspace's or router's), which frees it after the last. */
int mok_context_live(const mok_context *ctx);
void mok_context_release(mok_context *ctx);

/* The one place that lays out `saved` for a call of `tokens` tokens. */
mok_saved_layout mok_saved_layout_of(const mok_workspace *ws, int64_t tokens);
/* The one place that lays out a workspace's FP8 weight buffer (bytes = 0 unless MOK_FP8). */
mok_fp8_layout mok_fp8_layout_of(const mok_workspace *ws);
/* What saved's layout depends on besides the tokens, hashed: the shape (but max_tokens at ep = 1,
 * where the layout does not depend on it: a workspace grown for more tokens reads the saved of a
 * smaller one), the rank and the EP size. */
uint32_t mok_saved_ident(const mok_workspace *ws);
/* The sums of saved's header (host side; the CUDA schedule and saved_open add the same terms):
 * of a call's own topk_ids and topk_weights, and of the schedule arrays in saved. */
uint32_t mok_routing_sum(const int32_t *ids, const float *weights, int64_t slots);
uint32_t mok_schedule_sum(const mok_workspace *ws, const void *saved, int64_t tokens);

/* Backend function table. Arguments have been checked by api.c when these are called. */
typedef struct mok_backend_ops {
  const char *name;
  mok_status (*context_init)(mok_context *ctx);
  mok_status (*workspace_init)(mok_workspace *ws);
  void (*workspace_fini)(mok_workspace *ws);
  mok_status (*schedule)(mok_workspace *ws, const mok_forward_args *a, void *stream);
  /* compute_y = 0: recompute (schedule + gate/up into saved only). */
  mok_status (*forward)(mok_workspace *ws, const mok_forward_args *a, int compute_y,
                        void *stream);
  mok_status (*backward)(mok_workspace *ws, const mok_backward_args *a, void *stream);
  /* Waits for the stream; returns the sticky device error bits and clears them. */
  mok_status (*check)(mok_workspace *ws, void *stream, int32_t *bits);
  /* Copies `bytes` from backend memory at `src` to host `dst`, after the stream's work. */
  mok_status (*copy_to_host)(mok_workspace *ws, void *dst, const void *src, size_t bytes,
                             void *stream);
  /* EP groups. group_ready (NULL: nothing to do): every rank of the group has its workspace now
   * (each rank's is passed). refuse: a call api.c refused still meets the group at its opening
   * barrier, carrying MOK_DEVERR_PEER_ARG, so that every rank fails it. */
  mok_status (*group_ready)(mok_workspace *ws);
  mok_status (*refuse)(mok_workspace *ws, void *stream);
  /* 1: emulated ranks meet at barriers on the device. Then a rank's call reads its peers'
   * buffers, so every rank needs its workspace before any rank calls; and the ranks enqueue
   * their calls in rank order (mok_group_turn_take says why). 0: they meet at group.c's host
   * barrier. */
  int device_barriers;
  /* MOK_FP8 workspaces (DESIGN §8.3): fp8 <- Q_blk of the bf16 weights w (given NULL), or the
   * codes and scales given (w NULL), with the transposed codes. */
  mok_status (*fp8_weights)(mok_workspace *ws, const mok_weights *w, const mok_fp8_given *given,
                            void *fp8, void *stream);
  /* mok_mxfp8_to_bf16 (DESIGN §8.5): out <- the bf16 values of MXFP8 rows, or nothing written
   * when a block cannot be decoded (mok_mx_block_ok). */
  mok_status (*mxfp8_to_bf16)(mok_workspace *ws, int64_t rows, int64_t k, const void *q,
                              const void *scales, void *out, void *stream);
} mok_backend_ops;

/* ---- the router (router.c; DESIGN §1.2) ----------------------------------------------------- */
struct mok_router {
  mok_context *ctx;      /* held: the router keeps its context alive */
  mok_router_config cfg;
  size_t bytes;          /* memory held by the backend for this router */
  void *backend;         /* backend-owned state */
};

/* The router's `saved` buffer for a call of `tokens` tokens; offsets in bytes from its start,
 * multiples of MOK_ALIGN (layout.c, the one place that computes it). */
typedef struct mok_router_layout {
  size_t counts;         /* int32[E] slots routed to each expert */
  size_t ids;            /* int32[T, k] the chosen experts */
  size_t logits;         /* float[T, E] */
  size_t bytes;
} mok_router_layout;
mok_router_layout mok_router_layout_of(const mok_router *r, int64_t tokens);

/* Arguments have been checked by router.c when these are called. */
typedef struct mok_router_ops {
  mok_status (*init)(mok_router *r);
  void (*fini)(mok_router *r);
  mok_status (*forward)(mok_router *r, const mok_router_forward_args *a, void *stream);
  mok_status (*backward)(mok_router *r, const mok_router_backward_args *a, void *stream);
} mok_router_ops;

extern const mok_router_ops mok_cpu_router_ops;
extern const mok_router_ops mok_cuda_router_ops;

extern const mok_backend_ops mok_cpu_ops;
extern const mok_backend_ops mok_cuda_ops;

#ifdef __cplusplus
}
#endif
#endif /* MOK_INTERNAL_H */
