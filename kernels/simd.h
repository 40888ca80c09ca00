/* Eight- and sixteen-lane float helpers shared by the kernels (GCC vector extensions).
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
#define ADT_MULTIVERSION_WIDE \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ADT_MULTIVERSION
#define ADT_MULTIVERSION_WIDE
#endif
#define ADT_INLINE static inline __attribute__((always_inline))

/* Streaming loops fetch ADT_AHEAD floats (2 KiB) ahead of their reads and writes
   with software prefetches, one per vector.  On the 2-core Xeon VM we measure on,
   the hardware prefetchers alone leave memory transfers and arithmetic nearly
   serialized (a loop's time is close to their sum): GELU forward at B=8, T=1024
   9.2 -> 6.2 ms (1 KiB ahead 6.5, 4 KiB 6.5, 512 bytes 7.1; reads only 6.6). */
#define ADT_AHEAD 512
#define ADT_PREFETCH_R(p) __builtin_prefetch((p) + ADT_AHEAD, 0, 3)
#define ADT_PREFETCH_W(p) __builtin_prefetch((p) + ADT_AHEAD, 1, 3)

#pragma GCC diagnostic ignored "-Wpsabi"
typedef float adt_v8 __attribute__((vector_size(32)));
typedef float adt_v8u __attribute__((vector_size(32), aligned(4)));
typedef int adt_v8i __attribute__((vector_size(32)));
typedef float adt_v16 __attribute__((vector_size(64)));
typedef float adt_v16u __attribute__((vector_size(64), aligned(4)));
typedef int adt_v16i __attribute__((vector_size(64)));

/* The operations of one width, defined once for both: S is the suffix of their
   names (empty for eight lanes: adt_load, adt_exp; 16: adt_load16, adt_exp16), VT,
   VU and VI the vector, unaligned vector and int vector types.
     load, store  unaligned
     splat        every lane x
     select       mask ? a : b lane-wise (GCC's C front end has no vector ?:)
     max, min     lane-wise
     exp_in_range exp(x) for x in [-87.3, 88.3], within 2 ulp, as Cephes' expf:
                  Cody-Waite reduction x = n ln2 + r, a degree-6 polynomial for
                  exp(r), 2^n built in the exponent bits.
     exp_bits     exp_in_range for x <= 88.3 (callers clamp larger inputs): exactly
                  0 below -87.3 (no denormals downstream); one compare serves both
                  selects.  adt_exp (eight lanes) is this; adt_exp16 is
                  the same function with AVX-512's scalef where the CPU has it (below). */
#define ADT_LANE_OPS(S, VT, VU, VI) \
    ADT_INLINE VT adt_load##S(const float* p) { return *(const VU*)p; } \
    ADT_INLINE void adt_store##S(float* p, VT v) { *(VU*)p = v; } \
    ADT_INLINE VT adt_splat##S(float x) { VT v = {0}; return v + x; } \
    ADT_INLINE VT adt_select##S(VI mask, VT a, VT b) { \
        return (VT)(((VI)a & mask) | ((VI)b & ~mask)); \
    } \
    ADT_INLINE VT adt_max##S(VT a, VT b) { return adt_select##S(a > b, a, b); } \
    ADT_INLINE VT adt_min##S(VT a, VT b) { return adt_select##S(a < b, a, b); } \
    ADT_INLINE VT adt_exp_in_range##S(VT x) { \
        VT n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; \
        VT r = x - n * 0.693359375f; \
        r = r + n * 2.12194440e-4f; \
        VT p = r * 1.9875691500e-4f + 1.3981999507e-3f; \
        p = p * r + 8.3334519073e-3f; \
        p = p * r + 4.1665795894e-2f; \
        p = p * r + 1.6666665459e-1f; \
        p = p * r + 5.0000001201e-1f; \
        p = p * r * r + r + 1.0f; \
        VI e = (__builtin_convertvector(n, VI) + 127) << 23; \
        return p * (VT)e; \
    } \
    ADT_INLINE VT adt_exp_bits##S(VT x) { \
        VI under = x < adt_splat##S(-87.3f); \
        VT y = adt_exp_in_range##S(adt_select##S(under, adt_splat##S(-87.3f), x)); \
        return adt_select##S(under, adt_splat##S(0.0f), y); \
    }
ADT_LANE_OPS(, adt_v8, adt_v8u, adt_v8i)
ADT_LANE_OPS(16, adt_v16, adt_v16u, adt_v16i)
#undef ADT_LANE_OPS
ADT_INLINE adt_v8 adt_exp(adt_v8 x) { return adt_exp_bits(x); }
/* 2^t for t <= 127, where only a sum of exponentials or 1 + 2^t is kept; callers
   fold log2(e) into their own arithmetic (GELU into its cubic's coefficients,
   cross-entropy into one FMA, x log2(e) - max log2(e); kernels/loss_lanes.h), which
   is why it is 2^t and not exp.
   t = n + r with n rounded in the low bits of k = t + 1.5 * 2^23 + 127 and r = t - n
   exactly (|r| <= 1/2), 2^r by a degree-5 polynomial (a relative-error fit): within
   4e-7 relative, 2^n exactly.  k's low nine bits hold n + 127, the biased exponent
   of 2^n, so k shifted left by 23 is 2^n (the bias folded into the constant saves an
   integer add and a register: GELU forward 0.611 -> 0.590 ns per element on one
   core of the Zen 3 VM, a cross-entropy sum 6.3 -> 6.0 cycles per 8 logits).  Below
   -125 it gives 2^-125 (2.4e-38), a value lost against a sum's 1, where exp gives 0;
   NaN gives NaN.  Not for values that are written out and multiplied further (a
   denormal would slow every operation downstream).  t is clamped below by the
   caller's max (one vmaxps in the x86-64-v3 build).  11 vector operations with the
   clamp, 6 of them multiplies or FMAs (the polynomial and the scaling), the rest on
   the adder and integer pipes; the exp_fast it replaced took exp's argument, its
   r = x log2(e) - n two FMAs with a split constant and the rounding a third: 13
   operations, 9 of them on the two FMA pipes of Zen 3, which bound GELU and the
   cross-entropy sums.  One core of the Zen 3 VM, operands in L1: GELU forward
   12.3 -> 10.5 cycles per 8 floats, a cross-entropy sum 7.0 -> 5.8 (before the
   bias fold). */
#define ADT_LOG2E 1.4426950408889634
#define ADT_EXP2_FAST(S, VT, VI) \
    ADT_INLINE VT adt_exp2_fast_clamped##S(VT t) { \
        VT k = t + 12583039.0f; \
        VT r = t - (k - 12583039.0f); \
        VT p = r * 1.2915660627186298e-3f + 9.668532758951187e-3f; \
        p = p * r + 5.5516887456178665e-2f; \
        p = p * r + 2.4022264778614044e-1f; \
        p = p * r + 6.931464672088623e-1f; \
        p = p * r + 1.0f; \
        return p * (VT)((VI)k << 23); \
    } \
    ADT_INLINE VT adt_exp2_fast##S(VT t) { \
        return adt_exp2_fast_clamped##S(adt_max##S(adt_splat##S(-125.0f), t));   /* NaN: t */ \
    }
ADT_EXP2_FAST(, adt_v8, adt_v8i)
ADT_EXP2_FAST(16, adt_v16, adt_v16i)
#undef ADT_EXP2_FAST

/* Non-temporal stores, for outputs far larger than the caches: the written lines go
   to memory without first being read into the cache (write-allocate), a third less
   traffic for out = f(a, b).  On the Zen 3 VM, out = a + b over 6.3M floats with two
   threads: 3.3 -> 1.9 ms.  Below the size of the last-level cache they lose (the
   plain stores' output stays cached for the next pass), so callers choose them by
   size (kernels._common's stream_min_bytes).  p must be 16-byte aligned (eight
   lanes: two SSE stores, which the baseline has too) or 64-byte (sixteen); a thread
   ends its streamed stores with adt_stream_fence() before others may read them. */
#if defined(__GNUC__) && defined(__x86_64__)
#include <xmmintrin.h>
ADT_INLINE void adt_stream(float* p, adt_v8 v) {
    _mm_stream_ps(p, (__m128)__builtin_shufflevector(v, v, 0, 1, 2, 3));
    _mm_stream_ps(p + 4, (__m128)__builtin_shufflevector(v, v, 4, 5, 6, 7));
}
ADT_INLINE void adt_stream_fence(void) { _mm_sfence(); }
#else
ADT_INLINE void adt_stream(float* p, adt_v8 v) { adt_store(p, v); }
ADT_INLINE void adt_stream_fence(void) {}
#endif
/* A store that streams where stream is set (a loop invariant: GCC unswitches the
   loop on it). */
ADT_INLINE void adt_put(float* p, adt_v8 v, int stream) {
    if (stream) adt_stream(p, v);
    else adt_store(p, v);
}

/* Sum of the eight lanes, pairwise (the same order on every path). */
ADT_INLINE float adt_hsum(adt_v8 v) {
    float a = (v[0] + v[4]) + (v[2] + v[6]);
    float b = (v[1] + v[5]) + (v[3] + v[7]);
    return a + b;
}
/* Sum of the sixteen lanes: the two halves added, then adt_hsum. */
ADT_INLINE float adt_hsum16(adt_v16 v) {
    adt_v8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    adt_v8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    return adt_hsum(lo + hi);
}

/* a / b.  Eight lanes divide; sixteen multiply by AVX-512's 14-bit reciprocal
   estimate refined by one Newton step (within 2 ulp for normal b whose reciprocal is
   normal), a third of the cost of a 512-bit division. */
ADT_INLINE adt_v8 adt_divide(adt_v8 a, adt_v8 b) { return a / b; }

/* Sixteen lanes for the AVX-512 paths (x86-64-v4): functions marked ADT_TARGET_V4
   are compiled for it alone and called only when adt_cpu_v4() says the CPU has it;
   elsewhere the eight-lane versions run.  ADT_HAVE_V4 is 0 where the compiler
   cannot build such functions. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define ADT_HAVE_V4 1
#include <immintrin.h>
#define ADT_TARGET_V4 __attribute__((target("arch=x86-64-v4")))
ADT_INLINE int adt_cpu_v4(void) {
    static int has = -1;
    if (has < 0) has = __builtin_cpu_supports("x86-64-v4") ? 1 : 0;   /* benign race */
    return has;
}
ADT_TARGET_V4 ADT_INLINE void adt_stream16(float* p, adt_v16 v) {
    _mm512_stream_ps(p, (__m512)v);
}
ADT_TARGET_V4 ADT_INLINE adt_v16 adt_divide16(adt_v16 a, adt_v16 b) {
    adt_v16 r = __builtin_ia32_rcp14ps512_mask(b, b, (unsigned short)-1);
    r = r + r * (1.0f - b * r);
    return a * r;
}
/* exp_bits with 2^n applied by vscalefps, whose mask also gives the exact zeros
   below -87.3, and 1 + r + r^2 P(r) evaluated as 1 + r (1 + r P(r)): 14 vector
   operations instead of about 21 (the conversion, shift, multiply and two selects
   go), 1.5x the throughput in a sum of exps (3.6 -> 2.4 ns per vector on a Xeon),
   within 1.3 ulp as before. */
ADT_TARGET_V4 ADT_INLINE adt_v16 adt_exp16(adt_v16 x) {
    /* not below -87.3: NaN lanes are kept, and stay NaN (a NaN logit must make a
       NaN loss) */
    __mmask16 keep = __builtin_ia32_cmpps512_mask(x, adt_splat16(-87.3f), _CMP_NLT_UQ,
                                                  (__mmask16)-1, _MM_FROUND_CUR_DIRECTION);
    /* clamped, so that scalef never underflows: an underflowing scalef costs a
       microcode assist even in masked-off lanes (1.6x slower), and -inf would make
       NaNs */
    x = (adt_v16)_mm512_max_ps(_mm512_set1_ps(-87.3f), (__m512)x);   /* NaN: x */
    adt_v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    adt_v16 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    adt_v16 q = r * 1.9875691500e-4f + 1.3981999507e-3f;
    q = q * r + 8.3334519073e-3f;
    q = q * r + 4.1665795894e-2f;
    q = q * r + 1.6666665459e-1f;
    q = q * r + 5.0000001201e-1f;
    adt_v16 p = (q * r + 1.0f) * r + 1.0f;
    return __builtin_ia32_scalefps512_mask(p, n, adt_splat16(0.0f), keep,
                                           _MM_FROUND_CUR_DIRECTION);
}
#else
#define ADT_HAVE_V4 0
#define ADT_TARGET_V4
ADT_INLINE int adt_cpu_v4(void) { return 0; }
ADT_INLINE adt_v16 adt_divide16(adt_v16 a, adt_v16 b) { return a / b; }
ADT_INLINE void adt_stream16(float* p, adt_v16 v) { adt_store16(p, v); }
ADT_INLINE adt_v16 adt_exp16(adt_v16 x) { return adt_exp_bits16(x); }
#endif
ADT_TARGET_V4 ADT_INLINE void adt_put16(float* p, adt_v16 v, int stream) {
    if (stream) adt_stream16(p, v);
    else adt_store16(p, v);
}

/* An explicit x86-64-v3 (AVX2 + FMA) build of eight-lane code, for the modules that
   include their template headers a third time with ADT_LANES_SUFFIX _x3 (below): it
   runs where adt_cpu_v3() says the CPU has AVX2, and the target clones elsewhere.
   What it buys is real vminps/vmaxps: GCC turns the generic adt_min/adt_max (and
   any C form of them) into compares and blends, and target clones cannot call the
   AVX builtins, their baseline clone having no AVX.  Its min and max give the same
   results as the generic ones (b where a and b are unordered or equal), and its
   exp2_fast clamps below at -125 with one vmaxps instead of a compare and a
   select.  GELU forward on one core of the Zen 3 VM: 0.80 -> 0.62 ns per element,
   bit-identical output. */
#if ADT_HAVE_V4
#define ADT_HAVE_V3 1
#define ADT_TARGET_V3 __attribute__((target("arch=x86-64-v3")))
ADT_INLINE int adt_cpu_v3(void) {
    static int has = -1;
    if (has < 0) has = __builtin_cpu_supports("x86-64-v3") ? 1 : 0;   /* benign race */
    return has;
}
ADT_TARGET_V3 ADT_INLINE adt_v8 adt_v3_min(adt_v8 a, adt_v8 b) {
    return (adt_v8)_mm256_min_ps((__m256)a, (__m256)b);
}
ADT_TARGET_V3 ADT_INLINE adt_v8 adt_v3_max(adt_v8 a, adt_v8 b) {
    return (adt_v8)_mm256_max_ps((__m256)a, (__m256)b);
}
ADT_TARGET_V3 ADT_INLINE adt_v8 adt_v3_exp2_fast(adt_v8 t) {
    /* NaN: t, and the result NaN */
    return adt_exp2_fast_clamped(adt_v3_max(adt_splat(-125.0f), t));
}
#else
#define ADT_HAVE_V3 0
#define ADT_TARGET_V3
ADT_INLINE int adt_cpu_v3(void) { return 0; }
#endif
/* the rest of the v3 build's operations are the generic ones */
#define adt_v3_load adt_load
#define adt_v3_store adt_store
#define adt_v3_stream adt_stream
#define adt_v3_put adt_put
#define adt_v3_splat adt_splat
#define adt_v3_select adt_select
#define adt_v3_hsum adt_hsum
#define adt_v3_divide adt_divide
#define adt_v3_exp adt_exp

/* Code written once for both widths: a template header that a module includes once
   per width (no include guard), after defining ADT_W to 8 or 16 (and undefining it
   before the next), like kernels/skinny.h.  There
     ADT_VT, ADT_VI     are the vector and int vector types, ADT_W their lanes,
     ADT_V(op)          the operation op of that width (ADT_V(exp): adt_exp, adt_exp16),
     ADT_LANES_FN(f)    the function f of that width (f_v8, f_v16),
     ADT_LANES_ATTR     its target (target_clones for eight lanes, x86-64-v4 for 16),
     ADT_LANES_INLINE   the attributes of an inline helper of that width.
   The sixteen-lane instance exists only #if ADT_HAVE_V4; ADT_LANES_CALL(wide, f,
   (args)) calls f_v16 where wide is true, else f_v8.
   With ADT_LANES_SUFFIX defined as _x3 while ADT_W is 8 (#if ADT_HAVE_V3), the
   instance is the explicit x86-64-v3 build above (f_v8_x3), and ADT_LANES_CALL_X3(kind,
   f, (args)) calls f_v16 for kind 1, f_v8_x3 for kind 2 and f_v8 for kind 0. */
#define ADT_LANES_SUFFIX
#define ADT_CAT2(a, b) a##b
#define ADT_CAT(a, b) ADT_CAT2(a, b)
#define ADT_VT ADT_CAT(adt_v, ADT_W)
#define ADT_VI ADT_CAT(ADT_VT, i)
#define ADT_CAT3_(a, b, c) a##b##c
#define ADT_CAT3(a, b, c) ADT_CAT3_(a, b, c)
#define ADT_LANES_KEY(prefix) ADT_CAT3(prefix, ADT_W, ADT_LANES_SUFFIX)
#define ADT_V(op) ADT_LANES_KEY(ADT_V_)(op)
#define ADT_V_8(op) adt_##op
#define ADT_V_8_x3(op) adt_v3_##op
#define ADT_V_16(op) adt_##op##16
#define ADT_LANES_FN(f) ADT_LANES_KEY(f##_v)
#define ADT_LANES_ATTR ADT_LANES_KEY(ADT_LANES_ATTR_)
#define ADT_LANES_ATTR_8 ADT_MULTIVERSION
#define ADT_LANES_ATTR_8_x3 ADT_TARGET_V3
#define ADT_LANES_ATTR_16 ADT_TARGET_V4
#define ADT_LANES_INLINE ADT_LANES_KEY(ADT_LANES_INLINE_)
#define ADT_LANES_INLINE_8 ADT_INLINE
#define ADT_LANES_INLINE_8_x3 ADT_TARGET_V3 ADT_INLINE
#define ADT_LANES_INLINE_16 ADT_TARGET_V4 ADT_INLINE
#if ADT_HAVE_V4
#define ADT_LANES_CALL(wide, f, args) ((wide) ? f##_v16 args : f##_v8 args)
#define ADT_LANES_CALL_X3(kind, f, args) \
    ((kind) == 1 ? f##_v16 args : (kind) == 2 ? f##_v8_x3 args : f##_v8 args)
#else
#define ADT_LANES_CALL(wide, f, args) (f##_v8 args)
#define ADT_LANES_CALL_X3(kind, f, args) (f##_v8 args)
#endif

#endif
