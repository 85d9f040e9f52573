/*
 * group.c: the expert-parallel group of emulated ranks: its peer table and the barrier that opens
 * and closes each direction of a call (DESIGN §2). The barrier also carries every rank's error
 * bits, so that when one rank finds a bad id or overflows its capacity all of them leave their
 * outputs untouched, and it gives up after the group's timeout instead of hanging. And the turns
 * in which emulated ranks on the CUDA backend enqueue their calls (internal.h says why).
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "internal.h"

typedef struct group_sync {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int arrived;        /* ranks waiting at the current barrier */
  unsigned long gen;  /* barriers completed */
  int32_t bits;       /* OR of the error bits (and call bits) of the ranks arrived so far */
  int32_t result;     /* the OR of the last completed barrier */
  unsigned long turn; /* the call whose turn it is (mok_group_turn_take): n * size + rank */
  unsigned long calls[MOK_EP_MAX]; /* calls each rank has taken its turn for */
} group_sync;

mok_status mok_ep_group_create_emulated(int ranks, int timeout_ms, mok_ep_group **out) {
  if (!out) return mok_fail(MOK_ERR_INVALID_ARG, "out is NULL; expected a place for the group");
  *out = NULL;
  if (ranks < 1 || ranks > MOK_EP_MAX)
    return mok_fail(MOK_ERR_INVALID_ARG, "ranks is %d; expected 1..%d", ranks, MOK_EP_MAX);
  return mok_group_alloc(ranks, timeout_ms, out);
}

mok_status mok_group_alloc(int ranks, int timeout_ms, mok_ep_group **out) {
  if (timeout_ms < 0)
    return mok_fail(MOK_ERR_INVALID_ARG, "timeout_ms is %d; expected >= 0 (0 = 10 s)", timeout_ms);
  mok_ep_group *g = calloc(1, sizeof *g);
  group_sync *y = calloc(1, sizeof *y);
  if (!g || !y) {
    free(g);
    free(y);
    return mok_fail(MOK_ERR_OUT_OF_MEMORY, "no host memory for an EP group");
  }
  pthread_mutex_init(&y->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&y->cv, &ca);
  pthread_condattr_destroy(&ca);
  g->magic = MOK_MAGIC_GROUP;
  g->refs = 1;
  g->size = ranks;
  g->timeout_ms = timeout_ms ? timeout_ms : 10000;
  g->sync = y;
  *out = g;
  mok_clear_error();
  return MOK_OK;
}

void mok_group_retain(mok_ep_group *g) {
  if (g) __atomic_add_fetch(&g->refs, 1, __ATOMIC_RELAXED);
}

void mok_group_release(mok_ep_group *g) {
  if (!g || __atomic_sub_fetch(&g->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
  g->magic = 0;
  if (g->release) g->release(g);
  group_sync *y = g->sync;
  pthread_mutex_destroy(&y->mu);
  pthread_cond_destroy(&y->cv);
  free(y);
  free(g);
}

int mok_group_live(const mok_ep_group *g) {
  return g && g->magic == MOK_MAGIC_GROUP && !__atomic_load_n(&g->released, __ATOMIC_ACQUIRE);
}

/* A handle the caller destroyed already is left alone (its contexts may still hold it). */
void mok_ep_group_destroy(mok_ep_group *g) {
  if (!g) return;
  if (g->magic != MOK_MAGIC_GROUP || __atomic_exchange_n(&g->released, 1, __ATOMIC_ACQ_REL)) {
    mok_fail(MOK_ERR_INVALID_ARG, "mok_ep_group_destroy: %p is not a live group (destroyed "
                                  "already, or not made by mok); left alone", (void *)g);
    return;
  }
  mok_group_release(g);
}

/* Field by field: the struct has padding that a copy may carry. */
static int same_shape(const mok_shape *a, const mok_shape *b) {
  return a->max_tokens == b->max_tokens && a->hidden == b->hidden && a->inter == b->inter &&
         a->shared_inter == b->shared_inter && a->experts == b->experts &&
         a->top_k == b->top_k && a->precision == b->precision &&
         a->routed_rows == b->routed_rows;
}

mok_status mok_group_join(mok_ep_group *g, int rank, mok_workspace *ws) {
  if (!g) return MOK_OK;
  group_sync *y = g->sync;
  pthread_mutex_lock(&y->mu);
  mok_workspace *other = g->ws[rank];
  int differs = -1;
  for (int r = 0; r < g->size && differs < 0; r++)
    if (g->ws[r] && (!same_shape(&g->ws[r]->shape, &ws->shape) ||
                     g->ws[r]->ctx->ops != ws->ctx->ops))
      differs = r;
  if (!other && differs < 0) g->ws[rank] = ws;
  pthread_mutex_unlock(&y->mu);
  if (other)
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "rank %d of the EP group already has a workspace; one per rank and group",
                    rank);
  if (differs >= 0)
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "rank %d's workspace has another shape or backend than rank %d's; every rank "
                    "of an EP group needs the same shape and backend", rank, differs);
  return MOK_OK;
}

void mok_group_break(mok_ep_group *g) {
  if (!g) return;
  group_sync *y = g->sync;
  pthread_mutex_lock(&y->mu);
  g->broken = 1;
  pthread_cond_broadcast(&y->cv); /* nobody waits for a turn in a failed group */
  pthread_mutex_unlock(&y->mu);
}

int mok_group_members(mok_ep_group *g, mok_workspace **out) {
  group_sync *y = g->sync;
  pthread_mutex_lock(&y->mu);
  int all = 1;
  for (int r = 0; r < g->size; r++) {
    out[r] = g->ws[r];
    all = all && g->ws[r];
  }
  pthread_mutex_unlock(&y->mu);
  return all;
}

int mok_group_broken(const mok_ep_group *g) {
  if (!g) return 0;
  group_sync *y = g->sync;
  pthread_mutex_lock(&y->mu);
  int b = g->broken;
  pthread_mutex_unlock(&y->mu);
  return b;
}

void mok_group_leave(mok_ep_group *g, int rank, mok_workspace *ws) {
  if (!g) return;
  group_sync *y = g->sync;
  pthread_mutex_lock(&y->mu);
  if (g->ws[rank] == ws) g->ws[rank] = NULL;
  pthread_mutex_unlock(&y->mu);
}

/* The group's timeout from now, on the clock of its condition variable. */
static struct timespec deadline(const mok_ep_group *g) {
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  until.tv_sec += g->timeout_ms / 1000;
  until.tv_nsec += (long)(g->timeout_ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
  return until;
}

void mok_group_turn_take(mok_ep_group *g, int rank) {
  group_sync *y = g->sync;
  const struct timespec until = deadline(g);
  pthread_mutex_lock(&y->mu);
  const unsigned long mine = y->calls[rank] * (unsigned long)g->size + (unsigned long)rank;
  /* A call whose turn has passed (it was skipped) goes at once. */
  while (y->turn < mine && !g->broken)
    if (pthread_cond_timedwait(&y->cv, &y->mu, &until) == ETIMEDOUT && y->turn < mine) {
      y->turn = mine; /* skip the calls that did not come: the barriers tell if they never do */
      pthread_cond_broadcast(&y->cv);
    }
  pthread_mutex_unlock(&y->mu);
}

void mok_group_turn_give(mok_ep_group *g, int rank) {
  group_sync *y = g->sync;
  pthread_mutex_lock(&y->mu);
  const unsigned long mine = y->calls[rank]++ * (unsigned long)g->size + (unsigned long)rank;
  if (y->turn == mine) {
    y->turn = mine + 1;
    pthread_cond_broadcast(&y->cv);
  }
  pthread_mutex_unlock(&y->mu);
}

mok_status mok_group_barrier(mok_ep_group *g, int call, int32_t *bits) {
  if (!g) return MOK_OK;
  group_sync *y = g->sync;
  const struct timespec until = deadline(g);
  pthread_mutex_lock(&y->mu);
  int timed_out = g->broken;
  if (!timed_out) {
    y->bits |= *bits | 1 << (MOK_CALL_SHIFT + call);
    if (++y->arrived == g->size) { /* the last to arrive opens it for everyone */
      y->result = y->bits;
      y->bits = 0;
      y->arrived = 0;
      y->gen++;
      pthread_cond_broadcast(&y->cv);
    } else {
      const unsigned long gen = y->gen;
      while (y->gen == gen && !g->broken) {
        if (pthread_cond_timedwait(&y->cv, &y->mu, &until) == ETIMEDOUT && y->gen == gen) {
          g->broken = 1; /* the missing rank may never come: nobody waits for it again */
          pthread_cond_broadcast(&y->cv);
        }
      }
      timed_out = y->gen == gen;
    }
    *bits = y->result;
  }
  pthread_mutex_unlock(&y->mu);
  if (timed_out)
    return mok_fail(MOK_ERR_TIMEOUT,
                    "a rank of the EP group did not arrive within %d ms (or an earlier call "
                    "timed out and left the group failed); outputs untouched",
                    g->timeout_ms);
  const int32_t calls = *bits & MOK_CALL_MASK;
  *bits &= ~MOK_CALL_MASK;
  if (calls & (calls - 1)) { /* more than one kind */
    *bits |= MOK_DEVERR_PEER_CALL;
    char names[128];
    mok_call_names(calls, names, sizeof names);
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "the ranks of the EP group made different calls at once (%s); every rank "
                    "must make the same calls in the same order; this one was left undone on "
                    "every rank, outputs untouched", names);
  }
  return MOK_OK;
}
