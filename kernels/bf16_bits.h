/* bf16 bits: the rounding and the float32 <-> bits moves, shared by kernels/bf16.h
   and the optimizer (kernels/optim.pyx: AdamW writes the weights' bf16 copies in its
   pass). */
#ifndef ADTAPE_KERNELS_BF16_BITS_H
#define ADTAPE_KERNELS_BF16_BITS_H

#include <stdint.h>
#include <string.h>
#include "simd.h"

/* float32 bits -> bf16, round to nearest even; a NaN stays NaN (its sign and top
   payload bits kept, the quiet bit set), values past the largest bf16 go to inf. */
ADT_INLINE uint16_t bf16_from_bits(uint32_t u) {
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

/* sixteen bf16, and sixteen float32's bits (a bf16 widened by a shift left of 16) */
typedef uint16_t bf16_h16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t bf16_w16 __attribute__((vector_size(64)));

/* sixteen float32 rounded to bf16 as bf16_from_bits rounds each (the same bits) */
ADT_INLINE bf16_h16 bf16_round16(adt_v16 x) {
    bf16_w16 u = (bf16_w16)x;
    bf16_w16 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    bf16_w16 quiet = (u >> 16) | 0x40u;
    bf16_w16 nan = (bf16_w16)((u & 0x7FFFFFFFu) > 0x7F800000u);
    return __builtin_convertvector((quiet & nan) | (rounded & ~nan), bf16_h16);
}

ADT_INLINE uint32_t bf16_f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

ADT_INLINE float bf16_bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

#endif /* ADTAPE_KERNELS_BF16_BITS_H */
