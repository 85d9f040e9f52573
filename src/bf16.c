/* bf16.c: mok.h's bf16 conversions, over bf16.h's inline forms (the ones the CPU backend uses). */
#include "bf16.h"
#include "mok.h"

uint16_t mok_f32_to_bf16(float f) { return f32_to_bf16(f); }
float mok_bf16_to_f32(uint16_t b) { return bf16_to_f32(b); }
