/*
 * router.cu: the router on the GPU (DESIGN.md §1.2). The per-token math is router_math.h's, the
 * CPU reference's own code, run by a thread per token; here are the products and the reductions:
 *   forward:  logits (tiled, fp32, h ascending) -> select (scores, choice, weights, counts)
 *             -> [load-balancing and z-loss: per-chunk partials, then their sum in chunk order]
 *   backward: d_logits (a thread per token) -> dx (e ascending, added to dx_in)
 *             -> dW_r (per-split partials over fixed token ranges, summed in split order)
 * Every output element is one thread's fixed-order sum; the only atomics are the integer counts.
 * The number of splits of dW_r follows from E and H alone, never from the GPU (D2).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <string.h>

#include "cuda/backend.h"
#include "router_math.h"

#define RT_TILE 64   /* output tile of the products: 64 x 64, 4 x 4 per thread */
#define RT_KC 32     /* k-chunk held in shared memory */
#define RT_THREADS 256
#define RT_CHUNK 256 /* tokens per partial sum of the losses */
#define RT_SPLITS 16 /* most token ranges dW_r is split into */
#define RT_TOKENS 64 /* threads of a block of the thread-per-token kernels: small, so that a few
                      * thousand tokens still spread over every SM */

/* Scratch of one router (T = max_tokens), in one device allocation. */
typedef struct cuda_router {
  char *mem;
  float *rows;   /* [T, E] p (forward) or dl (backward) */
  float *srow;   /* [T, E] the scores of each token (backward's scratch) */
  float *lse;    /* [T] */
  float *part;   /* [T / RT_CHUNK + 1, E] per-chunk sums of p */
  float *zpart;  /* [T / RT_CHUNK + 1] per-chunk sums of lse^2 */
  float *dwpart; /* [splits, E, H] per-split sums of dW_r (splits > 1) */
  int splits;
} cuda_router;

/* ---- kernels --------------------------------------------------------------------------------- */
/* logits[t, e] = Σ_h x[t, h] W[e, h]; block (16, 16) over a 64 x 64 tile of (tokens, experts). */
__global__ void __launch_bounds__(RT_THREADS) router_logits(const __nv_bfloat16 *x,
                                                            const __nv_bfloat16 *w, int T, int E,
                                                            int H, float *logits) {
  __shared__ float xs[RT_TILE][RT_KC + 1], ws[RT_TILE][RT_KC + 1];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 16 + tx;
  const int t0 = blockIdx.y * RT_TILE, e0 = blockIdx.x * RT_TILE;
  float acc[4][4] = {};
  for (int h0 = 0; h0 < H; h0 += RT_KC) {
    for (int i = tid; i < RT_TILE * RT_KC; i += RT_THREADS) {
      const int r = i / RT_KC, c = i % RT_KC, h = h0 + c;
      xs[r][c] = t0 + r < T && h < H ? __bfloat162float(x[(size_t)(t0 + r) * H + h]) : 0.0f;
      ws[r][c] = e0 + r < E && h < H ? __bfloat162float(w[(size_t)(e0 + r) * H + h]) : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < RT_KC; kk++)
      for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = fmaf(xs[ty + 16 * i][kk], ws[tx + 16 * j][kk],
                                                     acc[i][j]);
    __syncthreads();
  }
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 4; j++) {
      const int t = t0 + ty + 16 * i, e = e0 + tx + 16 * j;
      if (t < T && e < E) logits[(size_t)t * E + e] = acc[i][j];
    }
}

/* One thread per token: scores, choice, weights, counts; p (for the load-balancing loss) and lse
 * (for the z-loss) where those are asked for. */
__global__ void router_select(const float *logits, const float *bias, rt_params p, int T,
                              int32_t *ids_saved, int32_t *ids, float *weights, int32_t *counts,
                              float *rows, int want_p, float *lse) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const float *l = logits + (size_t)t * p.E;
  float *s = rows + (size_t)t * p.E;
  rt_scores(l, &p, s);
  int32_t *id = ids_saved + (size_t)t * p.k;
  rt_select(s, bias, &p, id);
  rt_weights(s, id, &p, weights + (size_t)t * p.k);
  for (int j = 0; j < p.k; j++) {
    ids[(size_t)t * p.k + j] = id[j];
    atomicAdd(&counts[id[j]], 1);
  }
  if (want_p) rt_aux_probs(s, &p, s);
  if (lse) lse[t] = rt_lse(l, p.E);
}

/* Per chunk of RT_CHUNK tokens c: part[c, e] = Σ_t p[t, e], zpart[c] = Σ_t lse_t^2. */
__global__ void __launch_bounds__(RT_THREADS) router_loss_part(const float *rows, const float *lse,
                                                               int T, int E, float *part,
                                                               float *zpart) {
  const int c = blockIdx.x, ta = c * RT_CHUNK, tb = min(T, ta + RT_CHUNK);
  if (rows)
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      float s = 0.0f;
      for (int t = ta; t < tb; t++) s += rows[(size_t)t * E + e];
      part[(size_t)c * E + e] = s;
    }
  if (lse && threadIdx.x == 0) {
    float s = 0.0f;
    for (int t = ta; t < tb; t++) s += lse[t] * lse[t];
    zpart[c] = s;
  }
}

/* The losses from the partials, chunks ascending, then experts ascending. One block. */
__global__ void __launch_bounds__(1024) router_loss_final(const float *part, const float *zpart,
                                                          const int32_t *counts, int chunks,
                                                          int T, int E, int k, float *aux,
                                                          float *z) {
  __shared__ float terms[MOK_ROUTER_MAX_EXPERTS];
  if (aux)
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      float s = 0.0f;
      for (int c = 0; c < chunks; c++) s += part[(size_t)c * E + e];
      terms[e] = rt_aux_term(counts[e], s, T, k);
    }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (aux) {
    float s = 0.0f;
    for (int e = 0; e < E; e++) s += terms[e];
    *aux = (float)E * s;
  }
  if (z) {
    float s = 0.0f;
    for (int c = 0; c < chunks; c++) s += zpart[c];
    *z = s / (float)T;
  }
}

/* One thread per token: dl[t, :] (router_math.h). */
__global__ void router_dlogits(const float *logits, const int32_t *ids, const float *g,
                               rt_params p, const int32_t *counts, const float *d_aux,
                               const float *d_z, int T, float *srow, float *dl) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const size_t r = (size_t)t * p.E;
  rt_dlogits(logits + r, ids + (size_t)t * p.k, g + (size_t)t * p.k, &p, d_aux ? counts : NULL,
             d_aux ? *d_aux : 0.0f, T, d_z != NULL, d_z ? *d_z : 0.0f, srow + r, dl + r);
}

/* dx[t, h] = bf16(dx_in + Σ_e dl[t, e] W[e, h]); block (16, 16) over 64 tokens x 64 columns. */
__global__ void __launch_bounds__(RT_THREADS) router_dx(const float *dl, const __nv_bfloat16 *w,
                                                        int T, int E, int H, int accumulate,
                                                        __nv_bfloat16 *dx) {
  __shared__ float ds[RT_TILE][RT_KC + 1], ws[RT_KC][RT_TILE + 1];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 16 + tx;
  const int t0 = blockIdx.y * RT_TILE, h0 = blockIdx.x * RT_TILE;
  float acc[4][4] = {};
  for (int e0 = 0; e0 < E; e0 += RT_KC) {
    for (int i = tid; i < RT_TILE * RT_KC; i += RT_THREADS) {
      const int r = i / RT_KC, c = i % RT_KC;
      ds[r][c] = t0 + r < T && e0 + c < E ? dl[(size_t)(t0 + r) * E + e0 + c] : 0.0f;
      const int er = i / RT_TILE, hc = i % RT_TILE;
      ws[er][hc] = e0 + er < E && h0 + hc < H
                       ? __bfloat162float(w[(size_t)(e0 + er) * H + h0 + hc]) : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < RT_KC; kk++)
      for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = fmaf(ds[ty + 16 * i][kk], ws[kk][tx + 16 * j],
                                                     acc[i][j]);
    __syncthreads();
  }
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 4; j++) {
      const int t = t0 + ty + 16 * i, h = h0 + tx + 16 * j;
      if (t >= T || h >= H) continue;
      __nv_bfloat16 *o = dx + (size_t)t * H + h;
      const float in = accumulate ? __bfloat162float(*o) : 0.0f;
      *o = __float2bfloat16_rn(in + acc[i][j]);
    }
}

/* The weight gradient over tokens [split * per, (split + 1) * per), t ascending, for a 64 x 64
 * tile of (experts, columns): with one split straight into the output, else into its partial. */
__global__ void __launch_bounds__(RT_THREADS) router_dw(const float *dl, const __nv_bfloat16 *x,
                                                        int T, int E, int H, int per,
                                                        float *part, void *out, int mode) {
  __shared__ float ds[RT_KC][RT_TILE + 1], xs[RT_KC][RT_TILE + 1];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 16 + tx;
  const int e0 = blockIdx.y * RT_TILE, h0 = blockIdx.x * RT_TILE;
  const int ta = blockIdx.z * per, tb = min(T, ta + per);
  float acc[4][4] = {};
  for (int k0 = ta; k0 < tb; k0 += RT_KC) {
    for (int i = tid; i < RT_TILE * RT_KC; i += RT_THREADS) {
      const int r = i / RT_TILE, c = i % RT_TILE, t = k0 + r;
      ds[r][c] = t < tb && e0 + c < E ? dl[(size_t)t * E + e0 + c] : 0.0f;
      xs[r][c] = t < tb && h0 + c < H ? __bfloat162float(x[(size_t)t * H + h0 + c]) : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < RT_KC; kk++)
      for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = fmaf(ds[kk][ty + 16 * i], xs[kk][tx + 16 * j],
                                                     acc[i][j]);
    __syncthreads();
  }
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 4; j++) {
      const int e = e0 + ty + 16 * i, h = h0 + tx + 16 * j;
      if (e >= E || h >= H) continue;
      const size_t o = (size_t)e * H + h;
      if (part)
        part[(size_t)blockIdx.z * E * H + o] = acc[i][j];
      else if (mode == MOK_GRAD_ACCUMULATE_F32)
        ((float *)out)[o] += acc[i][j];
      else
        ((__nv_bfloat16 *)out)[o] = __float2bfloat16_rn(acc[i][j]);
    }
}

/* dW_r from the partials, splits ascending. */
__global__ void router_dw_final(const float *part, int splits, size_t n, void *out, int mode) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float s = 0.0f;
    for (int z = 0; z < splits; z++) s += part[(size_t)z * n + i];
    if (mode == MOK_GRAD_ACCUMULATE_F32)
      ((float *)out)[i] += s;
    else
      ((__nv_bfloat16 *)out)[i] = __float2bfloat16_rn(s);
  }
}

/* Loads the kernels of this file now (see ep_preload in kernels.h for why). */
cudaError_t router_preload(void) {
  const void *k[] = {(const void *)router_logits,   (const void *)router_select,
                     (const void *)router_loss_part, (const void *)router_loss_final,
                     (const void *)router_dlogits,  (const void *)router_dx,
                     (const void *)router_dw,       (const void *)router_dw_final};
  cudaFuncAttributes a;
  cudaError_t e = cudaSuccess;
  for (size_t i = 0; i < sizeof k / sizeof k[0] && e == cudaSuccess; i++)
    e = cudaFuncGetAttributes(&a, k[i]);
  return e;
}

/* ---- host side ------------------------------------------------------------------------------- */
static int cdiv(int64_t a, int64_t b) { return (int)((a + b - 1) / b); }

/* Token ranges of dW_r: enough tiles for a GPU of ~100 SMs, from E and H alone. */
static int splits_of(const mok_router_config *c) {
  const int tiles = cdiv(c->experts, RT_TILE) * cdiv(c->hidden, RT_TILE);
  const int s = cdiv(512, tiles);
  return s < 1 ? 1 : s > RT_SPLITS ? RT_SPLITS : s;
}

static mok_status cuda_router_init(mok_router *r) {
  const mok_router_config *c = &r->cfg;
  const int64_t T = c->max_tokens, E = c->experts, H = c->hidden;
  const int64_t chunks = T / RT_CHUNK + 1;
  cuda_router *st = (cuda_router *)calloc(1, sizeof *st);
  if (!st) return mok_fail(MOK_ERR_OUT_OF_MEMORY, "no host memory for the CUDA router");
  st->splits = splits_of(c);
  size_t at = 0;
  const size_t o_rows = mok_take(&at, T * E * 4), o_srow = mok_take(&at, T * E * 4);
  const size_t o_lse = mok_take(&at, T * 4), o_part = mok_take(&at, chunks * E * 4);
  const size_t o_zpart = mok_take(&at, chunks * 4);
  const size_t o_dw = mok_take(&at, st->splits > 1 ? st->splits * E * H * 4 : 0);
  device_guard d;
  mok_status s = device_enter(r->ctx, &d);
  if (s == MOK_OK) {
    cudaError_t e = cudaMalloc((void **)&st->mem, at);
    if (e != cudaSuccess)
      s = e == cudaErrorMemoryAllocation
              ? mok_fail(MOK_ERR_OUT_OF_MEMORY, "router: no device memory for %zu bytes", at)
              : cuda_fail(e, "router: cudaMalloc");
    device_leave(r->ctx, &d);
  }
  if (s != MOK_OK) {
    free(st);
    return s;
  }
  st->rows = (float *)(st->mem + o_rows);
  st->srow = (float *)(st->mem + o_srow);
  st->lse = (float *)(st->mem + o_lse);
  st->part = (float *)(st->mem + o_part);
  st->zpart = (float *)(st->mem + o_zpart);
  st->dwpart = (float *)(st->mem + o_dw);
  r->backend = st;
  r->bytes = at;
  return MOK_OK;
}

static void cuda_router_fini(mok_router *r) {
  cuda_router *st = (cuda_router *)r->backend;
  if (!st) return;
  device_guard d;
  if (device_enter(r->ctx, &d) == MOK_OK) {
    cudaFree(st->mem);
    device_leave(r->ctx, &d);
  }
  free(st);
  r->backend = NULL;
}

/* Host-checkable: the kernels touch device memory only (NULL: an optional tensor not given). */
#define RT_CHECK(p, name)                          \
  do {                                             \
    if (p) TRY(check_device((p), (name)));         \
  } while (0)

static mok_status forward_on_device(mok_router *r, const mok_router_forward_args *a,
                                    cudaStream_t stream) {
  RT_CHECK(a->x, "x");
  RT_CHECK(a->w_router, "w_router");
  RT_CHECK(a->bias, "bias");
  RT_CHECK(a->topk_ids, "topk_ids");
  RT_CHECK(a->topk_weights, "topk_weights");
  RT_CHECK(a->counts, "counts");
  RT_CHECK(a->aux_loss, "aux_loss");
  RT_CHECK(a->z_loss, "z_loss");
  RT_CHECK(a->saved, "saved");
  cuda_router *st = (cuda_router *)r->backend;
  const mok_router_config *c = &r->cfg;
  const rt_params p = rt_params_of(c);
  const int T = (int)a->tokens, E = c->experts, H = (int)c->hidden;
  const mok_router_layout L = mok_router_layout_of(r, T);
  char *saved = (char *)a->saved;
  float *logits = (float *)(saved + L.logits);
  int32_t *counts = (int32_t *)(saved + L.counts);
  const dim3 block(16, 16);
  router_logits<<<dim3(cdiv(E, RT_TILE), cdiv(T, RT_TILE)), block, 0, stream>>>(
      (const __nv_bfloat16 *)a->x, (const __nv_bfloat16 *)a->w_router, T, E, H, logits);
  CUDA_TRY(cudaGetLastError(), "logits");
  CUDA_TRY(cudaMemsetAsync(counts, 0, (size_t)E * 4, stream), "counts");
  router_select<<<cdiv(T, RT_TOKENS), RT_TOKENS, 0, stream>>>(
      logits, a->bias, p, T, (int32_t *)(saved + L.ids), a->topk_ids, a->topk_weights, counts,
      st->rows, a->aux_loss != NULL, a->z_loss ? st->lse : NULL);
  CUDA_TRY(cudaGetLastError(), "select");
  CUDA_TRY(cudaMemcpyAsync(a->counts, counts, (size_t)E * 4, cudaMemcpyDeviceToDevice, stream),
         "counts");
  if (a->aux_loss || a->z_loss) {
    const int chunks = cdiv(T, RT_CHUNK);
    router_loss_part<<<chunks, RT_THREADS, 0, stream>>>(a->aux_loss ? st->rows : NULL,
                                                        a->z_loss ? st->lse : NULL, T, E,
                                                        st->part, st->zpart);
    CUDA_TRY(cudaGetLastError(), "loss partials");
    router_loss_final<<<1, 1024, 0, stream>>>(st->part, st->zpart, counts, chunks, T, E, p.k,
                                              a->aux_loss, a->z_loss);
    CUDA_TRY(cudaGetLastError(), "losses");
  }
  return MOK_OK;
}

static mok_status backward_on_device(mok_router *r, const mok_router_backward_args *a,
                                     cudaStream_t stream) {
  RT_CHECK(a->x, "x");
  RT_CHECK(a->w_router, "w_router");
  RT_CHECK(a->saved, "saved");
  RT_CHECK(a->d_topk_weights, "d_topk_weights");
  RT_CHECK(a->d_aux_loss, "d_aux_loss");
  RT_CHECK(a->d_z_loss, "d_z_loss");
  RT_CHECK(a->dx, "dx");
  RT_CHECK(a->dw_router, "dw_router");
  cuda_router *st = (cuda_router *)r->backend;
  const mok_router_config *c = &r->cfg;
  const rt_params p = rt_params_of(c);
  const int T = (int)a->tokens, E = c->experts, H = (int)c->hidden;
  const mok_router_layout L = mok_router_layout_of(r, T);
  const char *saved = (const char *)a->saved;
  router_dlogits<<<cdiv(T, RT_TOKENS), RT_TOKENS, 0, stream>>>(
      (const float *)(saved + L.logits), (const int32_t *)(saved + L.ids), a->d_topk_weights, p,
      (const int32_t *)(saved + L.counts), a->d_aux_loss, a->d_z_loss, T, st->srow, st->rows);
  CUDA_TRY(cudaGetLastError(), "d_logits");
  const dim3 block(16, 16);
  router_dx<<<dim3(cdiv(H, RT_TILE), cdiv(T, RT_TILE)), block, 0, stream>>>(
      st->rows, (const __nv_bfloat16 *)a->w_router, T, E, H, a->accumulate_dx,
      (__nv_bfloat16 *)a->dx);
  CUDA_TRY(cudaGetLastError(), "dx");
  const int splits = st->splits, per = cdiv(cdiv(T, splits), RT_KC) * RT_KC;
  router_dw<<<dim3(cdiv(H, RT_TILE), cdiv(E, RT_TILE), splits), block, 0, stream>>>(
      st->rows, (const __nv_bfloat16 *)a->x, T, E, H, per, splits > 1 ? st->dwpart : NULL,
      a->dw_router, (int)a->grad_mode);
  CUDA_TRY(cudaGetLastError(), "dW_r");
  if (splits > 1) {
    const size_t n = (size_t)E * H;
    router_dw_final<<<cdiv((int64_t)n, RT_THREADS * 4), RT_THREADS, 0, stream>>>(
        st->dwpart, splits, n, a->dw_router, (int)a->grad_mode);
    CUDA_TRY(cudaGetLastError(), "dW_r sum");
  }
  return MOK_OK;
}

static mok_status cuda_router_forward(mok_router *r, const mok_router_forward_args *a,
                                      void *stream) {
  device_guard d;
  mok_status s = device_enter(r->ctx, &d);
  if (s == MOK_OK) s = forward_on_device(r, a, (cudaStream_t)stream);
  device_leave(r->ctx, &d);
  return s;
}

static mok_status cuda_router_backward(mok_router *r, const mok_router_backward_args *a,
                                       void *stream) {
  device_guard d;
  mok_status s = device_enter(r->ctx, &d);
  if (s == MOK_OK) s = backward_on_device(r, a, (cudaStream_t)stream);
  device_leave(r->ctx, &d);
  return s;
}

extern "C" const mok_router_ops mok_cuda_router_ops = {.init = cuda_router_init,
                                                       .fini = cuda_router_fini,
                                                       .forward = cuda_router_forward,
                                                       .backward = cuda_router_backward};
