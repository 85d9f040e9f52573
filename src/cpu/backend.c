/*
 * backend.c: the CPU reference backend's function table (work in progress).
 */
#include "internal.h"

static mok_status not_yet(void) { return mok_fail(MOK_ERR_UNSUPPORTED, "CPU backend: not built yet"); }
static mok_status cpu_context_init(mok_context *ctx) { (void)ctx; return MOK_OK; }
static mok_status cpu_workspace_init(mok_workspace *ws) { (void)ws; return MOK_OK; }
static void cpu_workspace_fini(mok_workspace *ws) { (void)ws; }
static mok_status cpu_schedule(mok_workspace *ws, const mok_forward_args *a, void *s) { (void)ws; (void)a; (void)s; return not_yet(); }
static mok_status cpu_forward(mok_workspace *ws, const mok_forward_args *a, int y, void *s) { (void)ws; (void)a; (void)y; (void)s; return not_yet(); }
static mok_status cpu_backward(mok_workspace *ws, const mok_backward_args *a, void *s) { (void)ws; (void)a; (void)s; return not_yet(); }
static mok_status cpu_check(mok_workspace *ws, void *s, int32_t *bits) { (void)ws; (void)s; *bits = 0; return MOK_OK; }
static mok_status cpu_copy_to_host(mok_workspace *ws, void *d, const void *src, size_t n, void *s) { (void)ws; (void)d; (void)src; (void)n; (void)s; return not_yet(); }

const mok_backend_ops mok_cpu_ops = {"cpu", cpu_context_init, cpu_workspace_init, cpu_workspace_fini,
                                     cpu_schedule, cpu_forward, cpu_backward, cpu_check, cpu_copy_to_host};
