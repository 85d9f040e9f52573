/*
 * ref64.h: a float64 recomputation of the layer for checking, one token or one gradient row at a
 * time (so it stays cheap at any size). It rounds to bf16 exactly where DESIGN.md §1.1 stores
 * bf16 and keeps everything else in double, so a correct backend differs from it by
 * accumulation-order error only; at MOK_FP8 (L->shape.precision) with the quantizations of
 * DESIGN.md §8 (a call then holds its experts' weights dequantized, 3 I H floats each). Used by
 * the tests and by `mok run`.
 */
#ifndef MOK_REF64_H
#define MOK_REF64_H

#include <stdint.h>

#include "mok_gen.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Token t of L: y[H], dx[H], d_topk_weights[k] (any output pointer may be NULL). */
void mok_ref64_token(const mok_host_layer *L, int64_t t, double *y, double *dx,
                     double *d_topk_weights);

typedef enum mok_ref_grad {
  MOK_REF_DW_GATE = 0,  /* dw_gate[e][row][0..H)  */
  MOK_REF_DW_UP = 1,    /* dw_up[e][row][0..H)    */
  MOK_REF_DW_DOWN = 2,  /* dw_down[e][row][0..I)  */
  MOK_REF_DWS_GATE = 3, /* dws_gate[row][0..H)    */
  MOK_REF_DWS_UP = 4,   /* dws_up[row][0..H)      */
  MOK_REF_DWS_DOWN = 5  /* dws_down[row][0..I_s)  */
} mok_ref_grad;

/* One row of a weight gradient (e is ignored for the shared expert), summed over every token
 * routed to e, in double. */
void mok_ref64_grad_row(const mok_host_layer *L, mok_ref_grad which, int64_t e, int64_t row,
                        double *out);
/* One column of a down gradient (MOK_REF_DW_DOWN or MOK_REF_DWS_DOWN): out[h] = its element
 * [e][h][col] for h < H, the same values as the rows give. A row of a down gradient needs all of
 * gate/up for each of the expert's tokens (2 I H multiply-adds a token); a column needs one
 * column of each (3 H), like a gate or up row. */
void mok_ref64_down_col(const mok_host_layer *L, mok_ref_grad which, int64_t e, int64_t col,
                        double *out);

#ifdef __cplusplus
}
#endif
#endif /* MOK_REF64_H */
