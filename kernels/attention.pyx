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
task runs its own small GEMM (kernels/attention_lanes.h): a register tile of
rows by two vectors of columns over B operands packed into slivers two vectors
wide, with K and V packed once per head and reused by every query block, and A
read in place (with a head size of 64 there is too little reuse to repay packing
it).  The code uses GCC vector extensions, not intrinsics, written once for two
widths: sixteen lanes (an 8 x 32 tile, sixteen accumulators) where the CPU has
AVX-512, and eight (4 x 16) otherwise, built by ``target_clones`` for x86-64-v3
(AVX2+FMA) and for the baseline, so the module stays portable while using the FMA
units that PyTorch uses (``kernels.set_vector_lanes`` picks the width for tests;
other compilers get the baseline build).  Queries go in blocks of 64 rows, and key
blocks past the diagonal are never computed, which halves the FLOPs of a dense
T x T product.  The forward keeps a block's scores in per-thread scratch (in L2),
takes the softmax and the product with V there, and writes att with non-temporal
stores: att (400 MB at GPT-2's B=8, T=1024) is not read again until the backward,
and plain stores would first fetch every line they overwrite (that and its zeros
above the diagonal were a fifth of the forward's time).  The softmax uses
kernels/simd.h's vector exp (Cody-Waite range reduction + Cephes' polynomial,
within 2 ulp, exactly 0 far below the row max).

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
from kernels.layers cimport checked_data, float_type, lanes_wide, resolve_threads

import numpy as np

from kernels.layers import overwrite_flags
from kernels.optim import zero_grad

cnp.import_array()

# B*T*T*C (about the multiply-adds of one pass) below which attention runs on one thread.
ATTN_PARALLEL_MIN_WORK = 1 << 22

cdef extern from "simd.h":
    pass

cdef extern from *:
    """
    #if defined(__SSE__)
    #include <immintrin.h>   /* the non-temporal stores of the forward's att */
    #endif
    /* Depth block KC and query block BQ of the GEMM in kernels/attention_lanes.h. */
    #define ATTN_KC 256
    #define ATTN_BQ 64
    static inline ptrdiff_t attn_kcs(ptrdiff_t K) { return K < ATTN_KC ? K : ATTN_KC; }
    /* Row stride of the forward's (BQ, T) score block: whole slivers of the widest
       tile (32 columns) and one more vector of zeros for the softmax to read. */
    static inline ptrdiff_t attn_score_ld(ptrdiff_t T) { return (T + 31) / 32 * 32 + 16; }

    /* The per-head kernels in eight lanes, as target clones, and in sixteen for CPUs
       with AVX-512; each entry point takes the width from its caller
       (kernels.layers' lanes_wide()). */
    #define ADT_W 8
    #include "attention_lanes.h"
    #undef ADT_W
    #if ADT_HAVE_V4
    #define ADT_W 16
    #include "attention_lanes.h"
    #undef ADT_W
    #endif

    /* Floats of a (K, N) operand packed by attn_pack_b for the widest tile (32
       columns): its last depth block is laid out as a whole one. */
    static ptrdiff_t attn_packed_floats(ptrdiff_t K, ptrdiff_t N) {
        ptrdiff_t kcs = attn_kcs(K);
        return (K + kcs - 1) / kcs * kcs * ((N + 31) / 32 * 32);
    }
    /* Floats of each per-thread scratch panel: a packed (hs, T) or (T, hs) operand. */
    static ptrdiff_t attn_pack_floats(ptrdiff_t T, ptrdiff_t hs) {
        ptrdiff_t a = attn_packed_floats(hs, T), b = attn_packed_floats(T, hs);
        return (a > b ? a : b) + 16;
    }

    static void attn_head_forward(int wide, float* out, float* att, const float* qkv,
                                  ptrdiff_t T, ptrdiff_t C, ptrdiff_t hs, ptrdiff_t h,
                                  float scale, float* pk, float* pv, float* scores) {
        ADT_LANES_CALL(wide, attn_head_forward, (out, att, qkv, T, C, hs, h, scale, pk, pv,
                                                 scores));
    }
    static void attn_head_backward(int wide, float* dqkv, const float* dout, const float* qkv,
                                   const float* att, ptrdiff_t T, ptrdiff_t C, ptrdiff_t hs,
                                   ptrdiff_t h, float scale, float* pvt, float* pk,
                                   float* psmall, float* dscore) {
        ADT_LANES_CALL(wide, attn_head_backward, (dqkv, dout, qkv, att, T, C, hs, h, scale,
                                                  pvt, pk, psmall, dscore));
    }
    """
    enum:
        ATTN_BQ
    Py_ssize_t attn_pack_floats(Py_ssize_t T, Py_ssize_t hs) noexcept nogil
    Py_ssize_t attn_score_ld(Py_ssize_t T) noexcept nogil
    void attn_head_forward(bint wide, float* out, float* att, const float* qkv, Py_ssize_t T,
                           Py_ssize_t C, Py_ssize_t hs, Py_ssize_t h, float scale,
                           float* pk, float* pv, float* scores) noexcept nogil
    void attn_head_backward(bint wide, float* dqkv, const float* dout, const float* qkv,
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
    cdef bint wide = lanes_wide()
    _scratch_alloc(&s, n_threads, 2 * pack + ATTN_BQ * attn_score_ld(T))
    for bh in prange(B * NH, schedule='static', nogil=True, num_threads=n_threads):
        b = bh // NH
        work = s.base + omp_get_thread_num_safe() * s.per_thread
        attn_head_forward(wide, out + b * T * C, att + bh * T * T, qkv + b * T * 3 * C,
                          T, C, hs, bh % NH, scale, work, work + pack, work + 2 * pack)
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
    cdef bint wide = lanes_wide()
    _scratch_alloc(&s, n_threads, 3 * pack + ATTN_BQ * T)
    for bh in prange(B * NH, schedule='static', nogil=True, num_threads=n_threads):
        b = bh // NH
        work = s.base + omp_get_thread_num_safe() * s.per_thread
        attn_head_backward(wide, dqkv + b * T * 3 * C, dout + b * T * C, qkv + b * T * 3 * C,
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
    if C == 0:
        # A head size of 0 makes the score scale 1/sqrt(0): there is no attention to take.
        raise ValueError("qkv's last dimension is 0: C (and the head size) must be positive")
    if C % n_head:
        raise ValueError(f"C = {C} (qkv's last dimension / 3) is not divisible by "
                         f"n_head = {n_head}")
    return B, T, C, int(n_head)


def _check_disjoint(outputs, inputs):
    """ValueError unless every output shares no memory with any input or other output:
    the kernels read their inputs after writing parts of their outputs."""
    named = list(outputs) + list(inputs)
    for i, (out_name, out) in enumerate(outputs):
        for other_name, other in named[i + 1:]:
            if np.may_share_memory(out, other):
                raise ValueError(f"{out_name} must not overlap {other_name}")


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
    cdef float* qkv_p = <float*>checked_data("qkv", qkv, cnp.NPY_FLOAT32, (B, T, 3 * C), False)
    cdef float* out_p = <float*>checked_data("out", out, cnp.NPY_FLOAT32, (B, T, C), True)
    cdef float* att_p = <float*>checked_data("att", att, cnp.NPY_FLOAT32, (B, NH, T, T), True)
    _check_disjoint((("out", out), ("att", att)), (("qkv", qkv),))
    cdef int nt = _threads_for(n_threads, B, T, C)
    if B == 0 or T == 0:
        return
    with nogil:
        attention_forward_c(out_p, att_p, qkv_p, B, T, C, NH, nt)


def attention_backward(dqkv, dout, qkv, att, n_head, *, overwrite=False, n_threads=None):
    """Accumulate into dqkv (B, T, 3C) the gradient of attention_forward's out,
    given dout (B, T, C), the forward's qkv and its saved att (``overwrite``: dqkv
    is set instead, whatever it held)."""
    ow, = overwrite_flags(overwrite, ("dqkv",))
    cdef Py_ssize_t B, T, C, NH
    B, T, C, NH = _attention_shapes(qkv, n_head)
    cdef float* qkv_p = <float*>checked_data("qkv", qkv, cnp.NPY_FLOAT32, (B, T, 3 * C), False)
    cdef float* dout_p = <float*>checked_data("dout", dout, cnp.NPY_FLOAT32, (B, T, C), False)
    cdef float* att_p = <float*>checked_data("att", att, cnp.NPY_FLOAT32, (B, NH, T, T), False)
    cdef float* dqkv_p = <float*>checked_data("dqkv", dqkv, cnp.NPY_FLOAT32, (B, T, 3 * C), True)
    _check_disjoint((("dqkv", dqkv),), (("dout", dout), ("qkv", qkv), ("att", att)))
    cdef int nt = _threads_for(n_threads, B, T, C)
    if B == 0 or T == 0:
        return
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


def attention_forward_naive(out, att, qkv, n_head, *, n_threads=None):
    """Plain-loop twin of ``attention_forward`` (serial; float32 or float64)."""
    B, T, C, NH = _attention_shapes(qkv, n_head)
    cdef int ft = float_type(qkv)
    checked_data("qkv", qkv, ft, (B, T, 3 * C), False)
    checked_data("out", out, ft, (B, T, C), True)
    checked_data("att", att, ft, (B, NH, T, T), True)
    _check_disjoint((("out", out), ("att", att)), (("qkv", qkv),))
    resolve_threads(n_threads)
    if ft == cnp.NPY_FLOAT32:
        _forward_naive[float](out, att, qkv, NH)
    else:
        _forward_naive[double](out, att, qkv, NH)


def attention_backward_naive(dqkv, dout, qkv, att, n_head, *, overwrite=False, n_threads=None):
    """Plain-loop twin of ``attention_backward`` (serial; float32 or float64)."""
    ow, = overwrite_flags(overwrite, ("dqkv",))
    B, T, C, NH = _attention_shapes(qkv, n_head)
    cdef int ft = float_type(qkv)
    checked_data("qkv", qkv, ft, (B, T, 3 * C), False)
    checked_data("dout", dout, ft, (B, T, C), False)
    checked_data("att", att, ft, (B, NH, T, T), False)
    checked_data("dqkv", dqkv, ft, (B, T, 3 * C), True)
    _check_disjoint((("dqkv", dqkv),), (("dout", dout), ("qkv", qkv), ("att", att)))
    resolve_threads(n_threads)
    if ow:
        dqkv[...] = 0
    if ft == cnp.NPY_FLOAT32:
        _backward_naive[float](dqkv, dout, qkv, att, NH)
    else:
        _backward_naive[double](dqkv, dout, qkv, att, NH)
