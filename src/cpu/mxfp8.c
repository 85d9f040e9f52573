/*
 * mxfp8.c: MXFP8 rows to bf16 on the CPU backend (DESIGN.md §8.5), by the rules of src/fp8.h:
 * every block is checked before any value is written, so a refused call leaves out untouched.
 * Each value is decoded on its own, so no bit depends on the thread count.
 */
#include "cpu/cpu.h"
#include "fp8.h"

mok_status cpu_mxfp8_to_bf16(mok_workspace *ws, int64_t rows, int64_t k, const void *q,
                             const void *scales, void *out, void *stream) {
  (void)stream;
  const int64_t nb = k / MOK_MX_BLOCK, blocks = rows * nb; /* block i: row i / nb, i % nb */
  const uint8_t *code = q, *scale = scales;
  uint16_t *o = out;
  const int threads = cpu_state_of(ws)->threads;
  int64_t bad = blocks; /* the first block that cannot be decoded */
  #pragma omp parallel for schedule(static) reduction(min : bad) num_threads(threads)
  for (int64_t i = 0; i < blocks; i++)
    if (i < bad && !mok_mx_block_ok(code + i * MOK_MX_BLOCK, scale[i])) bad = i;
  if (bad < blocks)
    return mok_fail(MOK_ERR_INVALID_ARG,
                    "row %lld, block %lld (values %lld..%lld) has scale byte 0x%02x: %s; out "
                    "untouched",
                    (long long)(bad / nb), (long long)(bad % nb),
                    (long long)(bad % nb * MOK_MX_BLOCK),
                    (long long)(bad % nb * MOK_MX_BLOCK + MOK_MX_BLOCK - 1), scale[bad],
                    scale[bad] == MOK_E8M0_NAN
                        ? "NaN (0xff); expected 0x00..0xfe"
                        : "a value of the block is 2^128 or more, beyond bf16");
  #pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < blocks; i++)
    for (int64_t j = i * MOK_MX_BLOCK; j < (i + 1) * MOK_MX_BLOCK; j++)
      o[j] = mok_mx_to_bf16(code[j], scale[i]);
  return MOK_OK;
}
