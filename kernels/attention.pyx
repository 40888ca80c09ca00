"""Causal multi-head self-attention (GPT-2 / llm.c layout), forward and backward.

qkv (B, T, 3C) holds [q | k | v], each split head-major (head h in columns
h*hs .. h*hs+hs, hs = C / n_head); out (B, T, C); att (B, NH, T, T) keeps the
softmax probabilities (zero above the diagonal) for the backward pass.
Scores are scaled by 1/sqrt(hs).

Parallelism: one OpenMP task per (batch, head) pair, each owning its slice of
out, att and dqkv, so the backward needs no atomics and no serial loop over heads.

Why not BLAS inside the parallel loop: the BLAS that scipy ships (OpenBLAS,
pthreads build) is not reentrant from an OpenMP team.  Measured here, sgemm
calls made from inside prange at T=1024 printed "Detect OpenMP Loop and this
application may hang" and took 40 s instead of 0.1 s; staying under its
single-thread size threshold would rely on an undocumented constant.  So each
task runs its own small GEMM: a 4x16 register tile (eight 8-lane FMA
accumulators) over B operands packed into 16-column slivers, with K and V packed
once per head and reused by every query block, and A read in place (with a head
size of 64 there is too little reuse to repay packing it).  The code uses GCC
vector extensions, not intrinsics; GCC's ``target_clones`` builds it twice, for
x86-64-v3 (AVX2+FMA) and for the baseline, and picks one at load time, so the
module stays portable while using the FMA units that PyTorch uses (other
compilers get the baseline build).  Queries go in blocks of 64 rows whose scores
stay in L2, and key blocks past the diagonal are never computed, which halves
the FLOPs of a dense T x T product.  The softmax uses an eight-lane exp
(Cody-Waite range reduction + Cephes' polynomial, about 1 ulp).

Each kernel has a ``_naive`` twin (plain serial loops, float32 or float64) used
by the tests and for finite-difference checks.
"""
cimport numpy as cnp
from cython cimport floating
from cython.parallel cimport prange
from libc.math cimport exp, sqrt
from libc.stdint cimport uintptr_t
from libc.stdlib cimport free, malloc

from kernels._openmp cimport omp_get_thread_num_safe

import numpy as np

from kernels.layers import overwrite_flags
from kernels.matmul import check_array, resolve_threads
from kernels.optim import zero_grad

cnp.import_array()

# B*T*T*C (about the multiply-adds of one pass) below which attention runs on one thread.
ATTN_PARALLEL_MIN_WORK = 1 << 22

cdef extern from *:
    """
    #include <stddef.h>
    #include <string.h>

    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
    #define ATTN_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
    #else
    #define ATTN_MULTIVERSION
    #endif
    #define ATTN_INLINE static inline __attribute__((always_inline))

    /* Register tile MR x NR and depth block KC of the GEMM below. */
    #define ATTN_MR 4
    #define ATTN_NR 16
    #define ATTN_KC 256
    #define ATTN_BQ 64

    #pragma GCC diagnostic ignored "-Wpsabi"
    typedef float attn_v8 __attribute__((vector_size(32)));
    typedef float attn_v8u __attribute__((vector_size(32), aligned(4)));

    /* Packed B: op(B) (K, N) cut into depth blocks of kcs = min(KC, K) rows and
       NR-column slivers, zero-padded; element (p, j) of block kb, sliver s lives at
       kb*kcs*npad + s*NR*kcs + (p % kcs)*NR + j % NR, npad = N rounded up to NR.
       Any leading (K', N') corner of a packed matrix is itself a valid packed
       operand with the same kcs and npad, so K and V are packed once per head and
       reused by every causal block. */
    ATTN_INLINE ptrdiff_t attn_npad(ptrdiff_t N) { return (N + ATTN_NR - 1) / ATTN_NR * ATTN_NR; }
    ATTN_INLINE ptrdiff_t attn_kcs(ptrdiff_t K) { return K < ATTN_KC ? K : ATTN_KC; }

    ATTN_INLINE void attn_pack_b(float* restrict pb, const float* B, ptrdiff_t ldb, int tb,
                                 ptrdiff_t K, ptrdiff_t N) {
        ptrdiff_t kcs = attn_kcs(K), npad = attn_npad(N);
        for (ptrdiff_t k0 = 0; k0 < K; k0 += kcs) {
            ptrdiff_t kc = K - k0 < kcs ? K - k0 : kcs;
            float* blk = pb + (k0 / kcs) * kcs * npad;
            for (ptrdiff_t j0 = 0; j0 < npad; j0 += ATTN_NR) {
                float* dst = blk + j0 * kcs;
                ptrdiff_t nr = N - j0 < ATTN_NR ? N - j0 : ATTN_NR;
                if (tb) {
                    for (ptrdiff_t j = 0; j < ATTN_NR; j++) {
                        const float* src = B + (j0 + j) * ldb + k0;
                        if (j < nr)
                            for (ptrdiff_t p = 0; p < kc; p++) dst[p * ATTN_NR + j] = src[p];
                        else
                            for (ptrdiff_t p = 0; p < kc; p++) dst[p * ATTN_NR + j] = 0.0f;
                    }
                } else if (nr == ATTN_NR) {
                    for (ptrdiff_t p = 0; p < kc; p++)
                        memcpy(dst + p * ATTN_NR, B + (k0 + p) * ldb + j0, ATTN_NR * sizeof(float));
                } else {
                    for (ptrdiff_t p = 0; p < kc; p++) {
                        const float* src = B + (k0 + p) * ldb + j0;
                        for (ptrdiff_t j = 0; j < ATTN_NR; j++)
                            dst[p * ATTN_NR + j] = j < nr ? src[j] : 0.0f;
                    }
                }
            }
        }
    }

    /* C tile (mr, nr) (+)= alpha * A tile (mr, kc) @ packed B sliver (kc, NR);
       A element (i, p) at a[i*rs + p*cs], read in place (no packing: with
       hs = 64 columns there is too little reuse to repay it). */
    ATTN_INLINE void attn_ukernel(ptrdiff_t kc, const float* a, ptrdiff_t rs, ptrdiff_t cs,
                                  const float* restrict b, float* c, ptrdiff_t ldc,
                                  ptrdiff_t mr, ptrdiff_t nr, float alpha, int accumulate) {
        /* rows past mr repeat the last valid row: computed, never stored */
        const float* a0 = a;
        const float* a1 = a + (mr > 1 ? 1 : 0) * rs;
        const float* a2 = a + (mr > 2 ? 2 : mr - 1) * rs;
        const float* a3 = a + (mr > 3 ? 3 : mr - 1) * rs;
        attn_v8 c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0};
        attn_v8 c20 = {0}, c21 = {0}, c30 = {0}, c31 = {0};
        for (ptrdiff_t p = 0; p < kc; p++) {
            attn_v8 b0 = *(const attn_v8*)(b + p * ATTN_NR);
            attn_v8 b1 = *(const attn_v8*)(b + p * ATTN_NR + 8);
            ptrdiff_t o = p * cs;
            c00 += a0[o] * b0; c01 += a0[o] * b1;
            c10 += a1[o] * b0; c11 += a1[o] * b1;
            c20 += a2[o] * b0; c21 += a2[o] * b1;
            c30 += a3[o] * b0; c31 += a3[o] * b1;
        }
        attn_v8 acc[ATTN_MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
        if (mr == ATTN_MR && nr == ATTN_NR) {
            for (int i = 0; i < ATTN_MR; i++) {
                attn_v8u* row = (attn_v8u*)(c + i * ldc);
                if (accumulate) {
                    row[0] += alpha * acc[i][0];
                    row[1] += alpha * acc[i][1];
                } else {
                    row[0] = alpha * acc[i][0];
                    row[1] = alpha * acc[i][1];
                }
            }
            return;
        }
        for (ptrdiff_t i = 0; i < mr; i++) {
            float tile[ATTN_NR];
            memcpy(tile, &acc[i][0], sizeof(tile));
            for (ptrdiff_t j = 0; j < nr; j++)
                c[i * ldc + j] = (accumulate ? c[i * ldc + j] : 0.0f) + alpha * tile[j];
        }
    }

    /* Single-threaded row-major C (M, N) (+)= alpha op(A) (M, K) @ B (K, N), B
       packed by attn_pack_b with (kcs, npad); op(A)(i, p) at a[i*rs + p*cs]. */
    ATTN_INLINE void attn_gemm(ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, float alpha,
                               const float* A, ptrdiff_t rs, ptrdiff_t cs,
                               const float* pb, ptrdiff_t kcs, ptrdiff_t npad,
                               int accumulate, float* Cm, ptrdiff_t ldc) {
        for (ptrdiff_t k0 = 0; k0 < K; k0 += kcs) {
            ptrdiff_t kc = K - k0 < kcs ? K - k0 : kcs;
            const float* blk = pb + (k0 / kcs) * kcs * npad;
            int acc = accumulate || k0 > 0;
            for (ptrdiff_t j0 = 0; j0 < N; j0 += ATTN_NR)
                for (ptrdiff_t i0 = 0; i0 < M; i0 += ATTN_MR)
                    attn_ukernel(kc, A + i0 * rs + k0 * cs, rs, cs, blk + j0 * kcs,
                                 Cm + i0 * ldc + j0, ldc,
                                 M - i0 < ATTN_MR ? M - i0 : ATTN_MR,
                                 N - j0 < ATTN_NR ? N - j0 : ATTN_NR, alpha, acc);
        }
    }

    typedef int attn_v8i __attribute__((vector_size(32)));

    /* exp(x) for x <= 0 (softmax after subtracting the row max), eight lanes:
       Cody-Waite reduction x = n ln2 + r, Cephes' degree-6 polynomial for
       exp(r), 2^n built in the exponent bits.  Inputs below -87 are clamped
       (their exp is < 2e-38, below float32's normal range). */
    ATTN_INLINE attn_v8 attn_exp8(attn_v8 x) {
        const attn_v8 lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
        attn_v8i below = x < lo;
        x = (attn_v8)(((attn_v8i)x & ~below) | ((attn_v8i)lo & below));
        attn_v8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
        attn_v8 r = x - n * 0.693359375f;
        r = r + n * 2.12194440e-4f;
        attn_v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = p * r * r + r + 1.0f;
        attn_v8i e = (__builtin_convertvector(n, attn_v8i) + 127) << 23;
        return p * (attn_v8)e;
    }

    /* Sums and maxima in eight partial lanes: without -ffast-math GCC may not
       reorder a float reduction, so a plain loop would stay scalar. */
    ATTN_INLINE float attn_dot(const float* x, const float* y, ptrdiff_t n) {
        attn_v8 acc = {0};
        ptrdiff_t j = 0;
        for (; j + 8 <= n; j += 8) acc += *(const attn_v8u*)(x + j) * *(const attn_v8u*)(y + j);
        float s = 0.0f;
        for (; j < n; j++) s += x[j] * y[j];
        for (int l = 0; l < 8; l++) s += acc[l];
        return s;
    }

    /* Softmax of row[0..n) in place. */
    ATTN_INLINE void attn_softmax_row(float* row, ptrdiff_t n) {
        float lanes[8];
        for (int l = 0; l < 8; l++) lanes[l] = row[0];
        ptrdiff_t j = 0;
        for (; j + 8 <= n; j += 8)
            for (int l = 0; l < 8; l++) lanes[l] = row[j + l] > lanes[l] ? row[j + l] : lanes[l];
        float mx = lanes[0];
        for (int l = 1; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
        for (; j < n; j++) mx = row[j] > mx ? row[j] : mx;
        attn_v8 sum = {0};
        for (j = 0; j + 8 <= n; j += 8) {
            attn_v8u* chunk = (attn_v8u*)(row + j);
            attn_v8 e = attn_exp8(*chunk - mx);
            *chunk = e;
            sum += e;
        }
        if (j < n) {
            attn_v8 tail = {0};
            for (ptrdiff_t t = j; t < n; t++) tail[t - j] = row[t] - mx;
            tail = attn_exp8(tail);
            for (ptrdiff_t t = j; t < n; t++) {
                row[t] = tail[t - j];
                sum[t - j] += tail[t - j];
            }
        }
        float total = 0.0f;
        for (int l = 0; l < 8; l++) total += sum[l];
        float inv = 1.0f / total;
        for (j = 0; j < n; j++) row[j] *= inv;
    }

    /* Floats of per-thread scratch: packed operands of (T, hs) and, for the
       backward, the (BQ, T) score-gradient block. */
    static ptrdiff_t attn_pack_floats(ptrdiff_t T, ptrdiff_t hs) {
        ptrdiff_t a = attn_npad(T) * hs, b = attn_npad(hs) * T;
        return (a > b ? a : b) + 16;
    }

    /* One (batch, head): qkv and out point at this batch's (T, 3C) / (T, C) rows,
       att at this head's (T, T) matrix; pk, pv are attn_pack_floats scratch. */
    ATTN_MULTIVERSION
    static void attn_head_forward(float* out, float* att, const float* qkv, ptrdiff_t T,
                                  ptrdiff_t C, ptrdiff_t hs, ptrdiff_t h, float scale,
                                  float* pk, float* pv) {
        ptrdiff_t C3 = 3 * C;
        const float* q = qkv + h * hs;
        attn_pack_b(pk, qkv + C + h * hs, C3, 1, hs, T);      /* K^T (hs, T) */
        attn_pack_b(pv, qkv + 2 * C + h * hs, C3, 0, T, hs);  /* V (T, hs) */
        for (ptrdiff_t i0 = 0; i0 < T; i0 += ATTN_BQ) {
            ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ;
            ptrdiff_t kend = i0 + rows;
            attn_gemm(rows, kend, hs, scale, q + i0 * C3, C3, 1, pk, attn_kcs(hs),
                      attn_npad(T), 0, att + i0 * T, T);
            for (ptrdiff_t i = i0; i < kend; i++) {
                float* row = att + i * T;
                attn_softmax_row(row, i + 1);
                memset(row + i + 1, 0, (size_t)(T - i - 1) * sizeof(float));
            }
            attn_gemm(rows, hs, kend, 1.0f, att + i0 * T, T, 1, pv, attn_kcs(T),
                      attn_npad(hs), 0, out + i0 * C + h * hs, C);
        }
    }

    /* One (batch, head), accumulating into dqkv; pvt, pk, psmall are
       attn_pack_floats scratch, dscore is (BQ, T). */
    ATTN_MULTIVERSION
    static void attn_head_backward(float* dqkv, const float* dout, const float* qkv,
                                   const float* att, ptrdiff_t T, ptrdiff_t C, ptrdiff_t hs,
                                   ptrdiff_t h, float scale, float* pvt, float* pk,
                                   float* psmall, float* dscore) {
        ptrdiff_t C3 = 3 * C;
        const float* q = qkv + h * hs;
        float* dq = dqkv + h * hs;
        float* dk = dqkv + C + h * hs;
        float* dv = dqkv + 2 * C + h * hs;
        const float* dO = dout + h * hs;
        ptrdiff_t ks = attn_kcs(hs);
        attn_pack_b(pvt, qkv + 2 * C + h * hs, C3, 1, hs, T);  /* V^T (hs, T) */
        attn_pack_b(pk, qkv + C + h * hs, C3, 0, T, hs);       /* K (T, hs) */
        for (ptrdiff_t i0 = 0; i0 < T; i0 += ATTN_BQ) {
            ptrdiff_t rows = T - i0 < ATTN_BQ ? T - i0 : ATTN_BQ;
            ptrdiff_t kend = i0 + rows;
            const float* p_blk = att + i0 * T;
            /* dP = dO V^T ; dV += P^T dO */
            attn_gemm(rows, kend, hs, 1.0f, dO + i0 * C, C, 1, pvt, ks, attn_npad(T), 0,
                      dscore, kend);
            attn_pack_b(psmall, dO + i0 * C, C, 0, rows, hs);
            attn_gemm(kend, hs, rows, 1.0f, p_blk, 1, T, psmall, attn_kcs(rows),
                      attn_npad(hs), 1, dv, C3);
            /* dS = P * (dP - sum_j P dP) * scale, zero above the diagonal */
            for (ptrdiff_t i = 0; i < rows; i++) {
                const float* p = p_blk + i * T;
                float* ds = dscore + i * kend;
                ptrdiff_t n = i0 + i + 1;
                float dot = attn_dot(p, ds, n);
                for (ptrdiff_t j = 0; j < n; j++) ds[j] = p[j] * (ds[j] - dot) * scale;
                for (ptrdiff_t j = n; j < kend; j++) ds[j] = 0.0f;
            }
            /* dQ += dS K ; dK += dS^T Q */
            attn_gemm(rows, hs, kend, 1.0f, dscore, kend, 1, pk, attn_kcs(T), attn_npad(hs), 1,
                      dq + i0 * C3, C3);
            attn_pack_b(psmall, q + i0 * C3, C3, 0, rows, hs);
            attn_gemm(kend, hs, rows, 1.0f, dscore, 1, kend, psmall, attn_kcs(rows),
                      attn_npad(hs), 1, dk, C3);
        }
    }
    """
    enum:
        ATTN_BQ
    Py_ssize_t attn_pack_floats(Py_ssize_t T, Py_ssize_t hs) noexcept nogil
    void attn_head_forward(float* out, float* att, const float* qkv, Py_ssize_t T,
                           Py_ssize_t C, Py_ssize_t hs, Py_ssize_t h, float scale,
                           float* pk, float* pv) noexcept nogil
    void attn_head_backward(float* dqkv, const float* dout, const float* qkv,
                            const float* att, Py_ssize_t T, Py_ssize_t C, Py_ssize_t hs,
                            Py_ssize_t h, float scale, float* pvt, float* pk,
                            float* psmall, float* dscore) noexcept nogil


cdef struct Scratch:
    # One malloc for all threads, each slice 64-byte aligned for the packed panels.
    void* raw
    float* base
    Py_ssize_t per_thread


cdef int _scratch_alloc(Scratch* s, int n_threads, Py_ssize_t floats) except -1 nogil:
    s.per_thread = (floats + 15) // 16 * 16
    s.raw = malloc(n_threads * s.per_thread * sizeof(float) + 64)
    if s.raw == NULL:
        with gil:
            raise MemoryError(f"attention: cannot allocate {n_threads} scratch buffers of "
                              f"{floats} floats")
    s.base = <float*>((<uintptr_t>s.raw + 63) & ~(<uintptr_t>63))
    return 0


cdef int attention_forward_c(float* out, float* att, const float* qkv,
                             Py_ssize_t B, Py_ssize_t T, Py_ssize_t C, Py_ssize_t NH,
                             int n_threads) except -1 nogil:
    cdef Py_ssize_t hs = C // NH
    cdef float scale = 1.0 / sqrt(<double>hs)
    cdef Py_ssize_t bh, b
    cdef float* work
    cdef Scratch s
    cdef Py_ssize_t pack = attn_pack_floats(T, hs)
    _scratch_alloc(&s, n_threads, 2 * pack)
    for bh in prange(B * NH, schedule='static', nogil=True, num_threads=n_threads):
        b = bh // NH
        work = s.base + omp_get_thread_num_safe() * s.per_thread
        attn_head_forward(out + b * T * C, att + bh * T * T, qkv + b * T * 3 * C,
                          T, C, hs, bh % NH, scale, work, work + pack)
    free(s.raw)
    return 0


cdef int attention_backward_c(float* dqkv, const float* dout, const float* qkv,
                              const float* att, Py_ssize_t B, Py_ssize_t T, Py_ssize_t C,
                              Py_ssize_t NH, int n_threads) except -1 nogil:
    cdef Py_ssize_t hs = C // NH
    cdef float scale = 1.0 / sqrt(<double>hs)
    cdef Py_ssize_t bh, b
    cdef float* work
    cdef Scratch s
    cdef Py_ssize_t pack = attn_pack_floats(T, hs)
    _scratch_alloc(&s, n_threads, 3 * pack + ATTN_BQ * T)
    for bh in prange(B * NH, schedule='static', nogil=True, num_threads=n_threads):
        b = bh // NH
        work = s.base + omp_get_thread_num_safe() * s.per_thread
        attn_head_backward(dqkv + b * T * 3 * C, dout + b * T * C, qkv + b * T * 3 * C,
                           att + bh * T * T, T, C, hs, bh % NH, scale, work, work + pack,
                           work + 2 * pack, work + 3 * pack)
    free(s.raw)
    return 0


# ---------------------------------------------------------------- Python boundary

def _attention_shapes(qkv, n_head):
    """(B, T, C, n_head) from qkv (B, T, 3C), checking the head split."""
    if not isinstance(qkv, np.ndarray) or qkv.ndim != 3:
        raise ValueError(f"qkv must be a 3-D (B, T, 3C) array, got "
                         f"{getattr(qkv, 'shape', type(qkv).__name__)}")
    B, T, C3 = qkv.shape
    if C3 % 3:
        raise ValueError(f"qkv's last dimension {C3} must be 3*C (q, k and v)")
    if isinstance(n_head, bool) or not isinstance(n_head, (int, np.integer)) or n_head < 1:
        raise ValueError(f"n_head must be a positive integer, got {n_head!r}")
    C = C3 // 3
    if C % n_head:
        raise ValueError(f"C = {C} (qkv's last dimension / 3) is not divisible by "
                         f"n_head = {n_head}")
    return B, T, C, int(n_head)


def _threads_for(n_threads, B, T, C):
    """The default thread count, but one thread for work too small to repay waking
    a second one (a parallel region costs milliseconds on a busy machine)."""
    if n_threads is None and B * T * T * C < ATTN_PARALLEL_MIN_WORK:
        return 1
    return resolve_threads(n_threads)


def attention_forward(out, att, qkv, n_head, *, n_threads=None):
    """Causal attention: out (B, T, C) and att (B, n_head, T, T) probabilities
    from qkv (B, T, 3C), both overwritten."""
    cdef Py_ssize_t B, T, C, NH
    B, T, C, NH = _attention_shapes(qkv, n_head)
    check_array(qkv, "qkv", (B, T, 3 * C))
    check_array(out, "out", (B, T, C), writable=True)
    check_array(att, "att", (B, NH, T, T), writable=True)
    cdef int nt = _threads_for(n_threads, B, T, C)
    cdef float* out_p = <float*>cnp.PyArray_DATA(out)
    cdef float* att_p = <float*>cnp.PyArray_DATA(att)
    cdef float* qkv_p = <float*>cnp.PyArray_DATA(qkv)
    with nogil:
        attention_forward_c(out_p, att_p, qkv_p, B, T, C, NH, nt)


def attention_backward(dqkv, dout, qkv, att, n_head, *, overwrite=False, n_threads=None):
    """Accumulate into dqkv (B, T, 3C) the gradient of attention_forward's out,
    given dout (B, T, C), the forward's qkv and its saved att (``overwrite``: dqkv
    is set instead, whatever it held)."""
    ow, = overwrite_flags(overwrite, ("dqkv",))
    cdef Py_ssize_t B, T, C, NH
    B, T, C, NH = _attention_shapes(qkv, n_head)
    check_array(qkv, "qkv", (B, T, 3 * C))
    check_array(dout, "dout", (B, T, C))
    check_array(att, "att", (B, NH, T, T))
    check_array(dqkv, "dqkv", (B, T, 3 * C), writable=True)
    cdef int nt = _threads_for(n_threads, B, T, C)
    cdef float* dqkv_p = <float*>cnp.PyArray_DATA(dqkv)
    cdef float* dout_p = <float*>cnp.PyArray_DATA(dout)
    cdef float* att_p = <float*>cnp.PyArray_DATA(att)
    cdef float* qkv_p = <float*>cnp.PyArray_DATA(qkv)
    if ow:
        # The per-head kernels add into their slices of dqkv: start them from zero.
        zero_grad(dqkv, n_threads=n_threads)
    with nogil:
        attention_backward_c(dqkv_p, dout_p, qkv_p, att_p, B, T, C, NH, nt)


# ---------------------------------------------------------------- naive twins

cdef void _forward_naive(floating[:, :, ::1] out, floating[:, :, :, ::1] att,
                         floating[:, :, ::1] qkv, Py_ssize_t NH) noexcept nogil:
    cdef Py_ssize_t B = qkv.shape[0], T = qkv.shape[1], C = qkv.shape[2] // 3
    cdef Py_ssize_t hs = C // NH
    cdef double scale = 1.0 / sqrt(<double>hs)
    cdef Py_ssize_t b, h, i, j, d
    cdef double s, mx, total
    for b in range(B):
        for h in range(NH):
            for i in range(T):
                mx = -1e300
                for j in range(i + 1):
                    s = 0.0
                    for d in range(hs):
                        s += qkv[b, i, h * hs + d] * qkv[b, j, C + h * hs + d]
                    att[b, h, i, j] = s * scale
                    mx = max(mx, att[b, h, i, j])
                total = 0.0
                for j in range(i + 1):
                    att[b, h, i, j] = exp(att[b, h, i, j] - mx)
                    total += att[b, h, i, j]
                for j in range(T):
                    att[b, h, i, j] = att[b, h, i, j] / total if j <= i else 0.0
                for d in range(hs):
                    s = 0.0
                    for j in range(i + 1):
                        s += att[b, h, i, j] * qkv[b, j, 2 * C + h * hs + d]
                    out[b, i, h * hs + d] = s


cdef void _backward_naive(floating[:, :, ::1] dqkv, floating[:, :, ::1] dout,
                          floating[:, :, ::1] qkv, floating[:, :, :, ::1] att,
                          Py_ssize_t NH) noexcept nogil:
    cdef Py_ssize_t B = qkv.shape[0], T = qkv.shape[1], C = qkv.shape[2] // 3
    cdef Py_ssize_t hs = C // NH
    cdef double scale = 1.0 / sqrt(<double>hs)
    cdef Py_ssize_t b, h, i, j, d
    cdef double dp, dot, ds
    for b in range(B):
        for h in range(NH):
            for i in range(T):
                # d(att[i, j]) = dout[i] . v[j]; dot = sum_j att[i, j] d(att[i, j])
                dot = 0.0
                for j in range(i + 1):
                    dp = 0.0
                    for d in range(hs):
                        dp += dout[b, i, h * hs + d] * qkv[b, j, 2 * C + h * hs + d]
                    dot += att[b, h, i, j] * dp
                for j in range(i + 1):
                    dp = 0.0
                    for d in range(hs):
                        dp += dout[b, i, h * hs + d] * qkv[b, j, 2 * C + h * hs + d]
                        dqkv[b, j, 2 * C + h * hs + d] += att[b, h, i, j] * dout[b, i, h * hs + d]
                    ds = att[b, h, i, j] * (dp - dot) * scale
                    for d in range(hs):
                        dqkv[b, i, h * hs + d] += ds * qkv[b, j, C + h * hs + d]
                        dqkv[b, j, C + h * hs + d] += ds * qkv[b, i, h * hs + d]


def _naive_dtype(qkv):
    if not isinstance(qkv, np.ndarray) or qkv.dtype not in (np.float32, np.float64):
        raise TypeError(f"qkv must be a float32 or float64 numpy.ndarray, got "
                        f"{getattr(qkv, 'dtype', type(qkv).__name__)}")
    return (qkv.dtype,)


def attention_forward_naive(out, att, qkv, n_head, *, n_threads=None):
    """Plain-loop twin of ``attention_forward`` (serial; float32 or float64)."""
    B, T, C, NH = _attention_shapes(qkv, n_head)
    dt = _naive_dtype(qkv)
    check_array(qkv, "qkv", (B, T, 3 * C), dt)
    check_array(out, "out", (B, T, C), dt, writable=True)
    check_array(att, "att", (B, NH, T, T), dt, writable=True)
    resolve_threads(n_threads)
    if dt[0] == np.float32:
        _forward_naive[float](out, att, qkv, NH)
    else:
        _forward_naive[double](out, att, qkv, NH)


def attention_backward_naive(dqkv, dout, qkv, att, n_head, *, overwrite=False, n_threads=None):
    """Plain-loop twin of ``attention_backward`` (serial; float32 or float64)."""
    ow, = overwrite_flags(overwrite, ("dqkv",))
    B, T, C, NH = _attention_shapes(qkv, n_head)
    dt = _naive_dtype(qkv)
    check_array(qkv, "qkv", (B, T, 3 * C), dt)
    check_array(dout, "dout", (B, T, C), dt)
    check_array(att, "att", (B, NH, T, T), dt)
    check_array(dqkv, "dqkv", (B, T, 3 * C), dt, writable=True)
    resolve_threads(n_threads)
    if ow:
        dqkv[...] = 0
    if dt[0] == np.float32:
        _backward_naive[float](dqkv, dout, qkv, att, NH)
    else:
        _backward_naive[double](dqkv, dout, qkv, att, NH)
