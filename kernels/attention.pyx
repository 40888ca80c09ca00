"""Causal multi-head self-attention (GPT-2 / llm.c layout), forward and backward.

qkv (B, T, 3C) holds [q | k | v], each split head-major (head h in columns
h*hs .. h*hs+hs, hs = C / n_head); out (B, T, C).  Scores are scaled by 1/sqrt(hs).
What the forward keeps for the backward is O(T) per head, not O(T^2): lse
(B, NH, T), each query's log-sum-exp of its scores.  The backward recomputes the
probabilities tile by tile from q, k and lse, P = exp(S - lse), as FlashAttention-2's
backward does (kernels/attention_lanes.h), so nothing T x T is ever stored (the
probabilities it kept before were 4.8 GB at GPT-2 124M, B=8, T=1024).  That costs
one more product, Q K^T, in the backward, and saves writing the probabilities in the
forward and reading them back: at T = 64 to 1024 the pair is as fast as before or
faster.

Parallelism: one OpenMP task per (batch, head) pair, each owning its slice of
out, lse and dqkv, so the backward needs no atomics and no serial loop over heads
(B * NH is 48 or more at GPT-2's shapes, enough tasks for the cores).

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
other compilers get the baseline build).  Queries go in blocks of 64 rows, and
register tiles past the diagonal are never computed.  The forward keeps a query
block's scores in per-thread scratch (in L2) and takes the softmax and the product
with V there; the backward works on 64 x 64 tiles of queries by keys (in L1).
The softmax uses kernels/simd.h's vector exp (Cody-Waite range reduction +
Cephes' polynomial, within 2 ulp, exactly 0 far below the row max).

Each kernel has a ``_naive`` twin (plain serial loops, float32 or float64) used
by the tests and for finite-difference checks.
"""
cimport numpy as cnp
from cython cimport floating
from cython.parallel cimport prange
from libc.math cimport exp, log, sqrt
from libc.stdint cimport uintptr_t
from libc.stdlib cimport free, malloc

from kernels._openmp cimport omp_get_thread_num_safe
from kernels.layers cimport (check_disjoint, checked_data, float_type, lanes_wide,
                             resolve_threads)

import numpy as np

from kernels.layers import overwrite_flags

cnp.import_array()

# B*T*T*C (about the multiply-adds of one pass) below which attention runs on one thread.
ATTN_PARALLEL_MIN_WORK = 1 << 22

cdef extern from "simd.h":
    pass

cdef extern from *:
    """
    #include <math.h>
    /* Depth block KC of the GEMM in kernels/attention_lanes.h, its query block BQ and
       the backward's key block BK: BK divides BQ (a key block lies within one query
       block's range, see attn_head_backward) and KC (a key block's rows of a packed
       operand lie in one depth block), and is a multiple of the widest tile (32).
       A 64 x 64 tile is 16 KiB, the backward's two of them in L1; 128 x 128, 128 x 64
       and 64 x 32 were no faster at T = 1024. */
    #define ATTN_KC 256
    #define ATTN_BQ 64
    #define ATTN_BK 64
    /* Rows the transposing pack fetches ahead: 16 and 4 both made the backward 3-6%
       faster at B=2, T=1024 (one thread, Zen 4), reading K and V rows 9 KiB apart. */
    #define ATTN_PACK_AHEAD 16
    _Static_assert(ATTN_BQ % ATTN_BK == 0 && ATTN_KC % ATTN_BK == 0 && ATTN_BK % 32 == 0,
                   "attention block sizes");
    enum { ATTN_TRI_C = 1, ATTN_TRI_UPTO, ATTN_TRI_FROM };  /* attn_gemm's tri */
    static inline ptrdiff_t attn_kcs(ptrdiff_t K) { return K < ATTN_KC ? K : ATTN_KC; }
    /* Row stride of the forward's (BQ, T) score block: whole slivers of the widest
       tile (32 columns), and 16 floats more so that rows 4 KiB apart (T = 1024) do
       not map to the same L1 sets. */
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

    /* Floats of a (BQ, hs) panel packed by attn_pack_b (a query block's Q or dO). */
    static ptrdiff_t attn_panel_floats(ptrdiff_t hs) {
        return attn_packed_floats(ATTN_BQ, hs) + 16;
    }

    static void attn_head_forward(int wide, float* out, float* lse, const float* qkv,
                                  ptrdiff_t T, ptrdiff_t C, ptrdiff_t hs, ptrdiff_t h,
                                  float scale, float* pk, float* pv, float* scores) {
        ADT_LANES_CALL(wide, attn_head_forward, (out, lse, qkv, T, C, hs, h, scale, pk, pv,
                                                 scores));
    }
    static void attn_head_backward(int wide, float* dqkv, const float* dout, const float* qkv,
                                   const float* out, const float* lse, ptrdiff_t T,
                                   ptrdiff_t C, ptrdiff_t hs, ptrdiff_t h, float scale,
                                   int overwrite, float* pkt, float* pvt, float* pk,
                                   float* pq, float* pdo, float* ptile, float* dstile,
                                   float* drow) {
        ADT_LANES_CALL(wide, attn_head_backward, (dqkv, dout, qkv, out, lse, T, C, hs, h,
                                                  scale, overwrite, pkt, pvt, pk, pq, pdo,
                                                  ptile, dstile, drow));
    }
    """
    enum:
        ATTN_BQ
        ATTN_BK
    Py_ssize_t attn_pack_floats(Py_ssize_t T, Py_ssize_t hs) noexcept nogil
    Py_ssize_t attn_panel_floats(Py_ssize_t hs) noexcept nogil
    Py_ssize_t attn_score_ld(Py_ssize_t T) noexcept nogil
    void attn_head_forward(bint wide, float* out, float* lse, const float* qkv, Py_ssize_t T,
                           Py_ssize_t C, Py_ssize_t hs, Py_ssize_t h, float scale,
                           float* pk, float* pv, float* scores) noexcept nogil
    void attn_head_backward(bint wide, float* dqkv, const float* dout, const float* qkv,
                            const float* out, const float* lse, Py_ssize_t T, Py_ssize_t C,
                            Py_ssize_t hs, Py_ssize_t h, float scale, bint overwrite,
                            float* pkt, float* pvt, float* pk, float* pq, float* pdo,
                            float* ptile, float* dstile, float* drow) noexcept nogil


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


cdef inline Py_ssize_t _lines(Py_ssize_t floats) noexcept nogil:
    # whole 64-byte lines, so that each scratch panel starts on one
    return (floats + 15) // 16 * 16


cdef int attention_forward_c(float* out, float* lse, const float* qkv,
                             Py_ssize_t B, Py_ssize_t T, Py_ssize_t C, Py_ssize_t NH,
                             int n_threads) except -1 nogil:
    cdef Py_ssize_t hs = C // NH
    cdef float scale = 1.0 / sqrt(<double>hs)
    cdef Py_ssize_t bh, b
    cdef float* work
    cdef Scratch s
    cdef Py_ssize_t pack = _lines(attn_pack_floats(T, hs))
    cdef bint wide = lanes_wide()
    _scratch_alloc(&s, n_threads, 2 * pack + ATTN_BQ * attn_score_ld(T))
    for bh in prange(B * NH, schedule='static', nogil=True, num_threads=n_threads):
        b = bh // NH
        work = s.base + omp_get_thread_num_safe() * s.per_thread
        attn_head_forward(wide, out + b * T * C, lse + bh * T, qkv + b * T * 3 * C,
                          T, C, hs, bh % NH, scale, work, work + pack, work + 2 * pack)
    free(s.raw)
    return 0


cdef int attention_backward_c(float* dqkv, const float* dout, const float* qkv,
                              const float* out, const float* lse, Py_ssize_t B, Py_ssize_t T,
                              Py_ssize_t C, Py_ssize_t NH, bint overwrite,
                              int n_threads) except -1 nogil:
    cdef Py_ssize_t hs = C // NH
    cdef float scale = 1.0 / sqrt(<double>hs)
    cdef Py_ssize_t bh, b
    cdef float* work
    cdef Scratch s
    cdef Py_ssize_t pack = _lines(attn_pack_floats(T, hs))
    cdef Py_ssize_t panel = _lines(attn_panel_floats(hs))
    cdef Py_ssize_t tile = ATTN_BQ * ATTN_BK
    cdef Py_ssize_t tiles = 3 * pack + 2 * panel
    cdef bint wide = lanes_wide()
    _scratch_alloc(&s, n_threads, tiles + 2 * tile + ATTN_BQ)
    for bh in prange(B * NH, schedule='static', nogil=True, num_threads=n_threads):
        b = bh // NH
        work = s.base + omp_get_thread_num_safe() * s.per_thread
        attn_head_backward(wide, dqkv + b * T * 3 * C, dout + b * T * C, qkv + b * T * 3 * C,
                           out + b * T * C, lse + bh * T, T, C, hs, bh % NH, scale, overwrite,
                           work, work + pack, work + 2 * pack, work + 3 * pack,
                           work + 3 * pack + panel, work + tiles, work + tiles + tile,
                           work + tiles + 2 * tile)
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


def _check_forward(out, lse, qkv, n_head, int ft):
    B, T, C, NH = _attention_shapes(qkv, n_head)
    checked_data("qkv", qkv, ft, (B, T, 3 * C), False)
    checked_data("out", out, ft, (B, T, C), True)
    checked_data("lse", lse, ft, (B, NH, T), True)
    check_disjoint((("out", out), ("lse", lse)), (("qkv", qkv),))
    return B, T, C, NH


def _check_backward(dqkv, dout, qkv, out, lse, n_head, int ft):
    B, T, C, NH = _attention_shapes(qkv, n_head)
    checked_data("qkv", qkv, ft, (B, T, 3 * C), False)
    checked_data("dout", dout, ft, (B, T, C), False)
    checked_data("out", out, ft, (B, T, C), False)
    checked_data("lse", lse, ft, (B, NH, T), False)
    checked_data("dqkv", dqkv, ft, (B, T, 3 * C), True)
    check_disjoint((("dqkv", dqkv),),
                    (("dout", dout), ("qkv", qkv), ("out", out), ("lse", lse)))
    return B, T, C, NH


def _threads_for(n_threads, B, T, C):
    """The default thread count, but one thread for work too small to repay waking
    a second one (a parallel region costs milliseconds on a busy machine)."""
    if n_threads is None and B * T * T * C < ATTN_PARALLEL_MIN_WORK:
        return 1
    return resolve_threads(n_threads)


def attention_forward(out, lse, qkv, n_head, *, n_threads=None):
    """Causal attention: out (B, T, C) and lse (B, n_head, T), each query's
    log-sum-exp of its scaled scores (what the backward needs), from qkv (B, T, 3C);
    both overwritten."""
    cdef Py_ssize_t B, T, C, NH
    B, T, C, NH = _check_forward(out, lse, qkv, n_head, cnp.NPY_FLOAT32)
    cdef int nt = _threads_for(n_threads, B, T, C)
    if B == 0 or T == 0:
        return
    cdef float* out_p = <float*>cnp.PyArray_DATA(<cnp.ndarray>out)
    cdef float* lse_p = <float*>cnp.PyArray_DATA(<cnp.ndarray>lse)
    cdef const float* qkv_p = <const float*>cnp.PyArray_DATA(<cnp.ndarray>qkv)
    with nogil:
        attention_forward_c(out_p, lse_p, qkv_p, B, T, C, NH, nt)


def attention_backward(dqkv, dout, qkv, out, lse, n_head, *, overwrite=False, n_threads=None):
    """Accumulate into dqkv (B, T, 3C) the gradient of attention_forward's out, given
    dout (B, T, C), the forward's qkv, and its out and lse (``overwrite``: dqkv is set
    instead, whatever it held).  The probabilities are recomputed, tile by tile."""
    ow, = overwrite_flags(overwrite, ("dqkv",))
    cdef Py_ssize_t B, T, C, NH
    B, T, C, NH = _check_backward(dqkv, dout, qkv, out, lse, n_head, cnp.NPY_FLOAT32)
    cdef int nt = _threads_for(n_threads, B, T, C)
    if B == 0 or T == 0:
        return
    cdef float* dqkv_p = <float*>cnp.PyArray_DATA(<cnp.ndarray>dqkv)
    cdef const float* dout_p = <const float*>cnp.PyArray_DATA(<cnp.ndarray>dout)
    cdef const float* qkv_p = <const float*>cnp.PyArray_DATA(<cnp.ndarray>qkv)
    cdef const float* out_p = <const float*>cnp.PyArray_DATA(<cnp.ndarray>out)
    cdef const float* lse_p = <const float*>cnp.PyArray_DATA(<cnp.ndarray>lse)
    cdef bint overwrite_c = ow
    with nogil:
        attention_backward_c(dqkv_p, dout_p, qkv_p, out_p, lse_p, B, T, C, NH, overwrite_c, nt)


# ---------------------------------------------------------------- naive twins

cdef void _forward_naive(floating[:, :, ::1] out, floating[:, :, ::1] lse,
                         floating[:, :, ::1] qkv, Py_ssize_t NH) noexcept nogil:
    cdef Py_ssize_t B = qkv.shape[0], T = qkv.shape[1], C = qkv.shape[2] // 3
    cdef Py_ssize_t hs = C // NH
    cdef double scale = 1.0 / sqrt(<double>hs)
    cdef Py_ssize_t b, h, i, j, d
    cdef double s, mx, total
    cdef double* p = <double*>malloc(max(T, 1) * sizeof(double))
    for b in range(B):
        for h in range(NH):
            for i in range(T):
                mx = -1e300
                for j in range(i + 1):
                    s = 0.0
                    for d in range(hs):
                        s += qkv[b, i, h * hs + d] * qkv[b, j, C + h * hs + d]
                    p[j] = s * scale
                    mx = max(mx, p[j])
                total = 0.0
                for j in range(i + 1):
                    p[j] = exp(p[j] - mx)
                    total += p[j]
                lse[b, h, i] = mx + log(total)
                for d in range(hs):
                    s = 0.0
                    for j in range(i + 1):
                        s += p[j] / total * qkv[b, j, 2 * C + h * hs + d]
                    out[b, i, h * hs + d] = s
    free(p)


cdef void _backward_naive(floating[:, :, ::1] dqkv, floating[:, :, ::1] dout,
                          floating[:, :, ::1] qkv, floating[:, :, ::1] out,
                          floating[:, :, ::1] lse, Py_ssize_t NH) noexcept nogil:
    # The same recomputation as the kernel, in plain loops: P[i, j] = exp(s[i, j] -
    # lse[i]), D[i] = dout[i] . out[i], dS = P (dout[i] . v[j] - D[i]) * scale.
    cdef Py_ssize_t B = qkv.shape[0], T = qkv.shape[1], C = qkv.shape[2] // 3
    cdef Py_ssize_t hs = C // NH
    cdef double scale = 1.0 / sqrt(<double>hs)
    cdef Py_ssize_t b, h, i, j, d
    cdef double s, p, dp, dsum, ds
    for b in range(B):
        for h in range(NH):
            for i in range(T):
                dsum = 0.0
                for d in range(hs):
                    dsum += dout[b, i, h * hs + d] * out[b, i, h * hs + d]
                for j in range(i + 1):
                    s = 0.0
                    dp = 0.0
                    for d in range(hs):
                        s += qkv[b, i, h * hs + d] * qkv[b, j, C + h * hs + d]
                        dp += dout[b, i, h * hs + d] * qkv[b, j, 2 * C + h * hs + d]
                    p = exp(s * scale - lse[b, h, i])
                    ds = p * (dp - dsum) * scale
                    for d in range(hs):
                        dqkv[b, j, 2 * C + h * hs + d] += p * dout[b, i, h * hs + d]
                        dqkv[b, i, h * hs + d] += ds * qkv[b, j, C + h * hs + d]
                        dqkv[b, j, C + h * hs + d] += ds * qkv[b, i, h * hs + d]


def attention_forward_naive(out, lse, qkv, n_head, *, n_threads=None):
    """Plain-loop twin of ``attention_forward`` (serial; float32 or float64)."""
    cdef int ft = float_type(qkv)
    B, T, C, NH = _check_forward(out, lse, qkv, n_head, ft)
    resolve_threads(n_threads)
    if ft == cnp.NPY_FLOAT32:
        _forward_naive[float](out, lse, qkv, NH)
    else:
        _forward_naive[double](out, lse, qkv, NH)


def attention_backward_naive(dqkv, dout, qkv, out, lse, n_head, *, overwrite=False,
                             n_threads=None):
    """Plain-loop twin of ``attention_backward`` (serial; float32 or float64)."""
    ow, = overwrite_flags(overwrite, ("dqkv",))
    cdef int ft = float_type(qkv)
    B, T, C, NH = _check_backward(dqkv, dout, qkv, out, lse, n_head, ft)
    resolve_threads(n_threads)
    if ow:
        dqkv[...] = 0
    if ft == cnp.NPY_FLOAT32:
        _backward_naive[float](dqkv, dout, qkv, out, lse, NH)
    else:
        _backward_naive[double](dqkv, dout, qkv, out, lse, NH)
