"""Fused softmax + cross-entropy over a padded vocabulary, as a forward/backward pair.

The forward reads each row of logits once (an online max and sum of exponentials over
L1-sized chunks) and saves the row's log-sum-exp; the backward turns it straight into
the softmax gradient, optionally in place over the logits so the (B,T,Vp) buffer is not
needed twice.  Columns V..Vp-1 (vocabulary padding) are ignored.  Rows run in eight-lane
vectors (kernels/simd.h, AVX2+FMA where the CPU has it); the serial ``_naive`` twins use libm's exp
and also accept float64, for the finite-difference tests.
"""
from cython.parallel cimport prange
from libc.math cimport logf, exp, log, INFINITY
from libc.stdint cimport int32_t

import numpy as np
cimport numpy as cnp
from cython cimport floating

from kernels.layers cimport checked_data, resolve_threads, serial_if_small

cnp.import_array()

cdef extern from "simd.h":
    pass

cdef extern from *:
    """
    #include <math.h>
    /* Logits per chunk of the online log-sum-exp: 4 KiB, so the second read of a
       chunk (the exponentials after its max) comes from L1. */
    #define CE_CHUNK 1024

    /* log(sum(exp(x - max))) of one row, storing the max: the loss is then
       (max - x[target]) + that, which keeps its precision when the logits are large.
       Eight lanes, compiled for AVX2+FMA and for the baseline (target_clones). */
    ADT_MULTIVERSION
    static float ce_row_logsumexp(const float* x, ptrdiff_t V, float* row_max) {
        float m = -INFINITY;
        adt_v8 s = {0};
        for (ptrdiff_t c0 = 0; c0 < V; c0 += CE_CHUNK) {
            ptrdiff_t n = V - c0 < CE_CHUNK ? V - c0 : CE_CHUNK, i;
            const float* xc = x + c0;
            /* four running maxima: one would wait on its own compare-and-blend */
            adt_v8 mv = adt_splat(xc[0]), mv1 = mv, mv2 = mv, mv3 = mv;
            for (i = 0; i + 32 <= n; i += 32) {
                mv = adt_max(mv, adt_load(xc + i));
                mv1 = adt_max(mv1, adt_load(xc + i + 8));
                mv2 = adt_max(mv2, adt_load(xc + i + 16));
                mv3 = adt_max(mv3, adt_load(xc + i + 24));
            }
            mv = adt_max(adt_max(mv, mv1), adt_max(mv2, mv3));
            for (; i + 8 <= n; i += 8) mv = adt_max(mv, adt_load(xc + i));
            float cm = mv[0];
            for (int l = 1; l < 8; l++) cm = mv[l] > cm ? mv[l] : cm;
            for (; i < n; i++) cm = xc[i] > cm ? xc[i] : cm;
            if (cm > m) {
                s = s * adt_exp8(adt_splat(m - cm));
                m = cm;
            }
            adt_v8 mm = adt_splat(m), s2 = {0};
            for (i = 0; i + 16 <= n; i += 16) {
                s += adt_exp8(adt_load(xc + i) - mm);
                s2 += adt_exp8(adt_load(xc + i + 8) - mm);
            }
            s += s2;
            for (; i + 8 <= n; i += 8) s += adt_exp8(adt_load(xc + i) - mm);
            if (i < n) {
                float t[8];
                for (int l = 0; l < 8; l++) t[l] = i + l < n ? xc[i + l] : -INFINITY;
                s += adt_exp8(adt_load(t) - mm);
            }
        }
        *row_max = m;
        return logf(adt_hsum(s));
    }

    /* d[0:V] (+)= exp(x - lse) * g (accumulate, or overwrite when in place, where
       d == x), then the padding d[V:Vp] = 0 when in place. */
    ADT_MULTIVERSION
    static void ce_row_backward(float* d, const float* x, float lse, float g, ptrdiff_t V,
                                ptrdiff_t Vp, int inplace) {
        ptrdiff_t i = 0;
        adt_v8 l = adt_splat(lse);
        if (inplace) {
            for (; i + 8 <= V; i += 8) adt_store(d + i, adt_exp8(adt_load(x + i) - l) * g);
        } else {
            for (; i + 8 <= V; i += 8)
                adt_store(d + i, adt_load(d + i) + adt_exp8(adt_load(x + i) - l) * g);
        }
        if (i < V) {
            float t[8] = {0};
            memcpy(t, x + i, (V - i) * sizeof(float));
            adt_store(t, adt_exp8(adt_load(t) - l) * g);
            for (ptrdiff_t j = 0; j < V - i; j++) d[i + j] = inplace ? t[j] : d[i + j] + t[j];
        }
        if (inplace)
            for (i = V; i < Vp; i++) d[i] = 0.0f;
    }
    """
    float ce_row_logsumexp(const float* x, Py_ssize_t V, float* row_max) nogil
    void ce_row_backward(float* d, const float* x, float lse, float g, Py_ssize_t V,
                         Py_ssize_t Vp, int inplace) nogil


cdef void _row_forward(float* loss, float* lse, const float* x, int32_t target,
                       Py_ssize_t V) noexcept nogil:
    cdef float m
    cdef float log_sum = ce_row_logsumexp(x, V, &m)
    lse[0] = m + log_sum
    loss[0] = (m - x[target]) + log_sum


cdef void softmax_crossentropy_forward_core(float* losses, float* lse, const float* logits,
                                            const int32_t* targets, Py_ssize_t N, Py_ssize_t V,
                                            Py_ssize_t Vp, int n_threads) noexcept nogil:
    cdef Py_ssize_t r
    for r in prange(N, schedule='static', nogil=True, num_threads=n_threads):
        _row_forward(losses + r, lse + r, logits + r * Vp, targets[r], V)


cdef void softmax_crossentropy_backward_core(float* dlogits, const float* dlosses,
                                             const float* logits, const float* lse,
                                             const int32_t* targets, Py_ssize_t N, Py_ssize_t V,
                                             Py_ssize_t Vp, int n_threads) noexcept nogil:
    cdef Py_ssize_t r
    for r in prange(N, schedule='static', nogil=True, num_threads=n_threads):
        ce_row_backward(dlogits + r * Vp, logits + r * Vp, lse[r], dlosses[r], V, Vp, 0)
        dlogits[r * Vp + targets[r]] -= dlosses[r]


cdef void softmax_crossentropy_backward_inplace_core(float* logits, const float* dlosses,
                                                     const float* lse, const int32_t* targets,
                                                     Py_ssize_t N, Py_ssize_t V, Py_ssize_t Vp,
                                                     int n_threads) noexcept nogil:
    cdef Py_ssize_t r
    for r in prange(N, schedule='static', nogil=True, num_threads=n_threads):
        ce_row_backward(logits + r * Vp, logits + r * Vp, lse[r], dlosses[r], V, Vp, 1)
        logits[r * Vp + targets[r]] -= dlosses[r]


cdef int _float_type(object arr):
    if isinstance(arr, np.ndarray) and arr.dtype == np.float64:
        return cnp.NPY_FLOAT64
    return cnp.NPY_FLOAT32


cdef tuple _check_logits(logits, targets, V, int ft):
    # -> (N, Vp, leading shape); targets must lie in [0, V)
    checked_data("logits", logits, ft, None, False)
    if logits.ndim not in (2, 3):
        raise ValueError(f"logits must have shape (B, T, Vp) or (N, Vp), got {logits.shape}")
    lead = logits.shape[:logits.ndim - 1]
    Vp = logits.shape[logits.ndim - 1]
    if not isinstance(V, int) or isinstance(V, bool) or not 1 <= V <= Vp:
        raise ValueError(f"V must be an integer in [1, Vp={Vp}], got {V!r}")
    checked_data("targets", targets, cnp.NPY_INT32, lead, False)
    if targets.size and (targets.min() < 0 or targets.max() >= V):
        raise ValueError(f"targets must lie in [0, V={V}), got values in "
                         f"[{targets.min()}, {targets.max()}]")
    return int(np.prod(lead)), Vp, lead


cdef tuple _check_forward(losses, lse, logits, targets, V, int ft):
    N, Vp, lead = _check_logits(logits, targets, V, ft)
    checked_data("losses", losses, ft, lead, True)
    checked_data("lse", lse, ft, lead, True)
    return N, Vp


cdef tuple _check_backward(dlogits, dlosses, logits, lse, targets, V, int ft):
    # -> (N, Vp, in_place)
    N, Vp, lead = _check_logits(logits, targets, V, ft)
    checked_data("dlogits", dlogits, ft, logits.shape, True)
    checked_data("dlosses", dlosses, ft, lead, False)
    checked_data("lse", lse, ft, lead, False)
    in_place = (cnp.PyArray_DATA(<cnp.ndarray>dlogits) == cnp.PyArray_DATA(<cnp.ndarray>logits))
    if not in_place and np.may_share_memory(dlogits, logits):
        raise ValueError("dlogits must be either logits itself or not overlap it")
    return N, Vp, in_place


def softmax_crossentropy_forward(losses, lse, logits, targets, V, *, n_threads=None):
    """losses[r] = logsumexp(logits[r, :V]) - logits[r, targets[r]]; lse[r] saved.
    logits (B,T,Vp) or (N,Vp) with Vp >= V; targets int32 in [0, V)."""
    cdef int nt = resolve_threads(n_threads)
    N, Vp = _check_forward(losses, lse, logits, targets, V, cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, N * Vp)
    cdef float* lp = <float*>cnp.PyArray_DATA(<cnp.ndarray>losses)
    cdef float* sp = <float*>cnp.PyArray_DATA(<cnp.ndarray>lse)
    cdef const float* xp = <float*>cnp.PyArray_DATA(<cnp.ndarray>logits)
    cdef const int32_t* tp = <int32_t*>cnp.PyArray_DATA(<cnp.ndarray>targets)
    cdef Py_ssize_t n = N, v = V, vp = Vp
    with nogil:
        softmax_crossentropy_forward_core(lp, sp, xp, tp, n, v, vp, nt)


def softmax_crossentropy_backward(dlogits, dlosses, logits, lse, targets, V, *, n_threads=None):
    """dlogits += (softmax(logits[:, :V]) - onehot(targets)) * dlosses[:, None].
    With dlogits is logits the result overwrites the logits instead, padded columns set
    to 0; otherwise padded columns of dlogits are left unchanged."""
    cdef int nt = resolve_threads(n_threads)
    N, Vp, in_place = _check_backward(dlogits, dlosses, logits, lse, targets, V, cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, N * Vp)
    cdef float* dp = <float*>cnp.PyArray_DATA(<cnp.ndarray>dlogits)
    cdef const float* gp = <float*>cnp.PyArray_DATA(<cnp.ndarray>dlosses)
    cdef const float* xp = <float*>cnp.PyArray_DATA(<cnp.ndarray>logits)
    cdef const float* sp = <float*>cnp.PyArray_DATA(<cnp.ndarray>lse)
    cdef const int32_t* tp = <int32_t*>cnp.PyArray_DATA(<cnp.ndarray>targets)
    cdef Py_ssize_t n = N, v = V, vp = Vp
    cdef bint inplace = in_place
    with nogil:
        if inplace:
            softmax_crossentropy_backward_inplace_core(dp, gp, sp, tp, n, v, vp, nt)
        else:
            softmax_crossentropy_backward_core(dp, gp, xp, sp, tp, n, v, vp, nt)


def _forward_naive(floating[::1] losses, floating[::1] lse, const floating[:, ::1] logits,
                   const int32_t[::1] targets, Py_ssize_t V):
    cdef Py_ssize_t r, i
    cdef double m, s
    for r in range(logits.shape[0]):
        m = logits[r, 0]
        for i in range(V):
            if logits[r, i] > m:
                m = logits[r, i]
        s = 0
        for i in range(V):
            s += exp(logits[r, i] - m)
        lse[r] = m + log(s)
        losses[r] = (m - logits[r, targets[r]]) + log(s)


def _backward_naive(floating[:, ::1] dlogits, const floating[::1] dlosses,
                    const floating[:, ::1] logits, const floating[::1] lse,
                    const int32_t[::1] targets, Py_ssize_t V, bint in_place):
    cdef Py_ssize_t r, i
    cdef double p
    for r in range(logits.shape[0]):
        for i in range(V):
            p = exp(logits[r, i] - lse[r])
            if i == targets[r]:
                p -= 1
            if in_place:
                dlogits[r, i] = p * dlosses[r]
            else:
                dlogits[r, i] += p * dlosses[r]
        if in_place:
            for i in range(V, logits.shape[1]):
                dlogits[r, i] = 0


def softmax_crossentropy_forward_naive(losses, lse, logits, targets, V, *, n_threads=None):
    """Serial twin of softmax_crossentropy_forward (float32 or float64)."""
    resolve_threads(n_threads)
    N, Vp = _check_forward(losses, lse, logits, targets, V, _float_type(logits))
    _forward_naive(losses.reshape(N), lse.reshape(N), logits.reshape(N, Vp), targets.reshape(N), V)


def softmax_crossentropy_backward_naive(dlogits, dlosses, logits, lse, targets, V, *, n_threads=None):
    """Serial twin of softmax_crossentropy_backward (float32 or float64)."""
    resolve_threads(n_threads)
    N, Vp, in_place = _check_backward(dlogits, dlosses, logits, lse, targets, V, _float_type(logits))
    _backward_naive(dlogits.reshape(N, Vp), dlosses.reshape(N), logits.reshape(N, Vp),
                    lse.reshape(N), targets.reshape(N), V, in_place)
