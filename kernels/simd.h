/* Eight-lane float helpers shared by the kernels (GCC vector extensions).
 *
 * Functions marked ADT_MULTIVERSION are compiled twice by GCC's target_clones, for
 * x86-64-v3 (AVX2 + FMA) and for the baseline, and the loader picks one per machine:
 * the wheel stays portable while the hot loops use 8-lane FMA where the CPU has it.
 * Other compilers and architectures get the plain build (the vector types then
 * lower to whatever the target has).
 */
#ifndef ADTAPE_KERNELS_SIMD_H
#define ADTAPE_KERNELS_SIMD_H

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define ADT_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ADT_MULTIVERSION
#endif
#define ADT_INLINE static inline __attribute__((always_inline))

#pragma GCC diagnostic ignored "-Wpsabi"
typedef float adt_v8 __attribute__((vector_size(32)));
typedef float adt_v8u __attribute__((vector_size(32), aligned(4)));
typedef int adt_v8i __attribute__((vector_size(32)));

ADT_INLINE adt_v8 adt_load(const float* p) { return *(const adt_v8u*)p; }
ADT_INLINE void adt_store(float* p, adt_v8 v) { *(adt_v8u*)p = v; }
ADT_INLINE adt_v8 adt_splat(float x) { adt_v8 v = {x, x, x, x, x, x, x, x}; return v; }

/* Lane-wise select, max and min (GCC's C front end has no vector ?:). */
ADT_INLINE adt_v8 adt_select(adt_v8i mask, adt_v8 a, adt_v8 b) {
    return (adt_v8)(((adt_v8i)a & mask) | ((adt_v8i)b & ~mask));
}
ADT_INLINE adt_v8 adt_max(adt_v8 a, adt_v8 b) { return adt_select(a > b, a, b); }
ADT_INLINE adt_v8 adt_min(adt_v8 a, adt_v8 b) { return adt_select(a < b, a, b); }

/* Sum of the eight lanes, pairwise (the same order on every path). */
ADT_INLINE float adt_hsum(adt_v8 v) {
    float a = (v[0] + v[4]) + (v[2] + v[6]);
    float b = (v[1] + v[5]) + (v[3] + v[7]);
    return a + b;
}

/* exp(x) in eight lanes for x <= 88.3 (callers clamp larger inputs), within 2 ulp,
   like kernels.layers' fast_expf: Cody-Waite reduction x = n ln2 + r, Cephes'
   degree-6 polynomial for exp(r), 2^n built in the exponent bits.  Exactly 0 below
   -87.3 (no denormals downstream); one compare serves both selects. */
ADT_INLINE adt_v8 adt_exp8(adt_v8 x) {
    adt_v8i under = x < adt_splat(-87.3f);
    adt_v8 xc = adt_select(under, adt_splat(-87.3f), x);
    adt_v8 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    adt_v8 r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    adt_v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    adt_v8i e = (__builtin_convertvector(n, adt_v8i) + 127) << 23;
    return adt_select(under, adt_splat(0.0f), p * (adt_v8)e);
}

/* Sixteen lanes for the AVX-512 paths (x86-64-v4): functions marked ADT_TARGET_V4
   are compiled for it alone and called only when adt_cpu_v4() says the CPU has it;
   elsewhere the eight-lane versions run.  ADT_HAVE_V4 is 0 where the compiler
   cannot build such functions. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define ADT_HAVE_V4 1
#define ADT_TARGET_V4 __attribute__((target("arch=x86-64-v4")))
ADT_INLINE int adt_cpu_v4(void) {
    static int has = -1;
    if (has < 0) has = __builtin_cpu_supports("x86-64-v4") ? 1 : 0;   /* benign race */
    return has;
}
#else
#define ADT_HAVE_V4 0
#define ADT_TARGET_V4
ADT_INLINE int adt_cpu_v4(void) { return 0; }
#endif
typedef float adt_v16 __attribute__((vector_size(64)));
typedef float adt_v16u __attribute__((vector_size(64), aligned(4)));

ADT_INLINE adt_v16 adt_load16(const float* p) { return *(const adt_v16u*)p; }
ADT_INLINE void adt_store16(float* p, adt_v16 v) { *(adt_v16u*)p = v; }
/* Sum of the sixteen lanes: the two halves added, then adt_hsum. */
ADT_INLINE float adt_hsum16(adt_v16 v) {
    adt_v8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    adt_v8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    return adt_hsum(lo + hi);
}

#endif
