"""Fused softmax + cross-entropy over a padded vocabulary, as a forward/backward pair.

The forward reads each row of logits once (an online max and sum of exponentials over
L1-sized chunks) and saves the row's log-sum-exp; the backward turns it straight into
the softmax gradient, optionally in place over the logits so the (B,T,Vp) buffer is not
needed twice.  Columns V..Vp-1 (vocabulary padding) are ignored, and so is a row whose
target is ``IGNORE_INDEX`` (-100, PyTorch's ``ignore_index`` default: padding and prompt
positions of chat data): its loss is 0 and its gradient 0, whatever its ``dlosses``.  Rows run in sixteen-lane
vectors where the CPU has AVX-512, else in eight (AVX2+FMA where the CPU has it; see
kernels/loss_lanes.h and kernels.set_vector_lanes); the serial ``_naive`` twins use libm's
exp and also accept float64, for the finite-difference tests.
"""
from cython.parallel cimport prange
from libc.math cimport logf, exp, log, INFINITY
from libc.stdint cimport int32_t
from libc.string cimport memset

cimport numpy as cnp
from cython cimport floating

from kernels._common cimport (check_disjoint, checked_data, float_type, lanes_kind, leading_size,
                              resolve_threads, serial_if_small)

cnp.import_array()

# The target of a row that takes no loss (the C contract's CE_IGNORE_INDEX, kernels/loss.pxd).
IGNORE_INDEX = CE_IGNORE_INDEX

cdef extern from "simd.h":
    pass

cdef extern from *:
    """
    #include <math.h>
    /* Logits per chunk of the online log-sum-exp: 4 KiB, so the second read of a
       chunk (the exponentials after its max) comes from L1. */
    #define CE_CHUNK 1024

    /* The rows (kernels/loss_lanes.h) in eight lanes, as target clones and as an
       explicit x86-64-v3 build, and in sixteen for CPUs with AVX-512; each entry
       point takes the build from its caller (kernels._common's lanes_kind()). */
    #define ADT_W 8
    #include "loss_lanes.h"
    #if ADT_HAVE_V3
    #undef ADT_LANES_SUFFIX
    #define ADT_LANES_SUFFIX _x3
    #include "loss_lanes.h"
    #undef ADT_LANES_SUFFIX
    #define ADT_LANES_SUFFIX
    #endif
    #undef ADT_W
    #if ADT_HAVE_V4
    #define ADT_W 16
    #include "loss_lanes.h"
    #undef ADT_W
    #endif

    static void ce_rows_logsumexp(int kind, const float* x, ptrdiff_t ld, ptrdiff_t V, int rows,
                                  float* row_max, float* log_sum) {
        ADT_LANES_CALL_X3(kind, ce_rows_logsumexp, (x, ld, V, rows, row_max, log_sum));
    }
    static void ce_row_backward(int kind, float* d, const float* x, float lse, float g,
                                ptrdiff_t V, ptrdiff_t Vp, int inplace) {
        ADT_LANES_CALL_X3(kind, ce_row_backward, (d, x, lse, g, V, Vp, inplace));
    }
    """
    void ce_rows_logsumexp(int kind, const float* x, Py_ssize_t ld, Py_ssize_t V, int rows,
                           float* row_max, float* log_sum) nogil
    void ce_row_backward(int kind, float* d, const float* x, float lse, float g, Py_ssize_t V,
                         Py_ssize_t Vp, int inplace) nogil


cdef void _rows_forward(int kind, float* loss, float* lse, const float* x, const int32_t* target,
                        Py_ssize_t V, Py_ssize_t Vp, int rows) noexcept nogil:
    # rows (1 or 2) rows of logits, Vp apart, read side by side
    cdef float m[2]
    cdef float log_sum[2]
    cdef int r
    ce_rows_logsumexp(kind, x, Vp, V, rows, m, log_sum)
    for r in range(rows):
        lse[r] = m[r] + log_sum[r]
        if target[r] == CE_IGNORE_INDEX:
            loss[r] = 0
        else:
            loss[r] = (m[r] - x[r * Vp + target[r]]) + log_sum[r]


cdef void softmax_crossentropy_forward_core(float* losses, float* lse, const float* logits,
                                            const int32_t* targets, Py_ssize_t N, Py_ssize_t V,
                                            Py_ssize_t Vp, int n_threads) noexcept nogil:
    # by pairs of rows (and a last one alone when N is odd)
    cdef Py_ssize_t p, r
    cdef int kind = lanes_kind()
    if n_threads == 1:      # the same pairs, no parallel region (kernels._common's SERIAL)
        for p in range((N + 1) // 2):
            r = 2 * p
            _rows_forward(kind, losses + r, lse + r, logits + r * Vp, targets + r, V, Vp,
                          2 if r + 1 < N else 1)
        return
    for p in prange((N + 1) // 2, schedule='static', nogil=True, num_threads=n_threads):
        r = 2 * p
        _rows_forward(kind, losses + r, lse + r, logits + r * Vp, targets + r, V, Vp,
                      2 if r + 1 < N else 1)


cdef inline void _row_backward(int kind, float* d, const float* x, float lse, float g,
                               int32_t target, Py_ssize_t V, Py_ssize_t Vp,
                               int overwrite) noexcept nogil:
    # one row: (softmax - onehot(target)) g into d, or nothing (0 where overwriting) for a
    # row without loss
    if target == CE_IGNORE_INDEX:
        if overwrite:
            memset(d, 0, Vp * sizeof(float))
        return
    ce_row_backward(kind, d, x, lse, g, V, Vp, overwrite)
    d[target] -= g


cdef void softmax_crossentropy_backward_core(float* dlogits, const float* dlosses,
                                             const float* logits, const float* lse,
                                             const int32_t* targets, Py_ssize_t N, Py_ssize_t V,
                                             Py_ssize_t Vp, int n_threads) noexcept nogil:
    cdef Py_ssize_t r
    cdef int kind = lanes_kind()
    if n_threads == 1:      # no parallel region (kernels._common's SERIAL)
        for r in range(N):
            _row_backward(kind, dlogits + r * Vp, logits + r * Vp, lse[r], dlosses[r],
                          targets[r], V, Vp, 0)
        return
    for r in prange(N, schedule='static', nogil=True, num_threads=n_threads):
        _row_backward(kind, dlogits + r * Vp, logits + r * Vp, lse[r], dlosses[r], targets[r],
                      V, Vp, 0)


cdef void softmax_crossentropy_backward_overwrite_core(float* dlogits, const float* dlosses,
                                                       const float* logits, const float* lse,
                                                       const int32_t* targets, Py_ssize_t N,
                                                       Py_ssize_t V, Py_ssize_t Vp,
                                                       int n_threads) noexcept nogil:
    # dlogits written, not added into (it may be logits itself), padding set to 0
    cdef Py_ssize_t r
    cdef int kind = lanes_kind()
    if n_threads == 1:      # no parallel region (kernels._common's SERIAL)
        for r in range(N):
            _row_backward(kind, dlogits + r * Vp, logits + r * Vp, lse[r], dlosses[r],
                          targets[r], V, Vp, 1)
        return
    for r in prange(N, schedule='static', nogil=True, num_threads=n_threads):
        _row_backward(kind, dlogits + r * Vp, logits + r * Vp, lse[r], dlosses[r], targets[r],
                      V, Vp, 1)


cdef bint _targets_within(object targets, Py_ssize_t V) noexcept:
    # every target in [0, V) or IGNORE_INDEX
    cdef cnp.ndarray a = <cnp.ndarray>targets
    cdef const int32_t* p = <const int32_t*>cnp.PyArray_DATA(a)
    cdef Py_ssize_t i, n = cnp.PyArray_SIZE(a)
    for i in range(n):
        if (p[i] < 0 or p[i] >= V) and p[i] != CE_IGNORE_INDEX:
            return False
    return True


cdef tuple _check_logits(logits, targets, V, int ft):
    # -> (N, Vp, leading shape); targets must lie in [0, V) or be IGNORE_INDEX
    checked_data("logits", logits, ft, None, False)
    if logits.ndim not in (2, 3):
        raise ValueError(f"logits must have shape (B, T, Vp) or (N, Vp), got {logits.shape}")
    lead = logits.shape[:logits.ndim - 1]
    Vp = logits.shape[logits.ndim - 1]
    if not isinstance(V, int) or isinstance(V, bool) or not 1 <= V <= Vp:
        raise ValueError(f"V must be an integer in [1, Vp={Vp}], got {V!r}")
    checked_data("targets", targets, cnp.NPY_INT32, lead, False)
    if not _targets_within(targets, V):
        bad = targets[((targets < 0) | (targets >= V)) & (targets != CE_IGNORE_INDEX)]
        raise ValueError(f"targets must lie in [0, V={V}) or be IGNORE_INDEX "
                         f"({CE_IGNORE_INDEX}: no loss), got {bad.size} outside, such as "
                         f"{int(bad[0])}")
    return leading_size(logits), Vp, lead


cdef tuple _check_forward(losses, lse, logits, targets, V, int ft):
    N, Vp, lead = _check_logits(logits, targets, V, ft)
    checked_data("losses", losses, ft, lead, True)
    checked_data("lse", lse, ft, lead, True)
    check_disjoint((("losses", losses), ("lse", lse)), (("logits", logits), ("targets", targets)))
    return N, Vp


cdef tuple _check_backward(dlogits, dlosses, logits, lse, targets, V, int ft):
    # -> (N, Vp, in_place)
    N, Vp, lead = _check_logits(logits, targets, V, ft)
    checked_data("dlogits", dlogits, ft, logits.shape, True)
    checked_data("dlosses", dlosses, ft, lead, False)
    checked_data("lse", lse, ft, lead, False)
    check_disjoint((("dlogits", dlogits),), (("logits", logits), ("dlosses", dlosses),
                                            ("lse", lse), ("targets", targets)),
                   (("dlogits", "logits"),))
    in_place = (cnp.PyArray_DATA(<cnp.ndarray>dlogits) == cnp.PyArray_DATA(<cnp.ndarray>logits))
    return N, Vp, in_place


def softmax_crossentropy_forward(losses, lse, logits, targets, V, *, n_threads=None):
    """losses[r] = logsumexp(logits[r, :V]) - logits[r, targets[r]]; lse[r] saved.
    logits (B,T,Vp) or (N,Vp) with Vp >= V; targets int32 in [0, V), or IGNORE_INDEX for
    a row without loss (losses[r] = 0)."""
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


def softmax_crossentropy_backward(dlogits, dlosses, logits, lse, targets, V, *,
                                  bint overwrite=False, n_threads=None):
    """dlogits += (softmax(logits[:, :V]) - onehot(targets)) * dlosses[:, None], nothing for
    a row whose target is IGNORE_INDEX (0 where dlogits is set).  With ``overwrite``, or with dlogits being logits (the result then overwrites the
    logits), dlogits is set instead (its old contents never read) and its padded
    columns to 0; otherwise padded columns of dlogits are left unchanged."""
    cdef int nt = resolve_threads(n_threads)
    N, Vp, in_place = _check_backward(dlogits, dlosses, logits, lse, targets, V, cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, N * Vp)
    cdef float* dp = <float*>cnp.PyArray_DATA(<cnp.ndarray>dlogits)
    cdef const float* gp = <float*>cnp.PyArray_DATA(<cnp.ndarray>dlosses)
    cdef const float* xp = <float*>cnp.PyArray_DATA(<cnp.ndarray>logits)
    cdef const float* sp = <float*>cnp.PyArray_DATA(<cnp.ndarray>lse)
    cdef const int32_t* tp = <int32_t*>cnp.PyArray_DATA(<cnp.ndarray>targets)
    cdef Py_ssize_t n = N, v = V, vp = Vp
    cdef bint ow = in_place or overwrite
    with nogil:
        if ow:
            softmax_crossentropy_backward_overwrite_core(dp, gp, xp, sp, tp, n, v, vp, nt)
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
        losses[r] = 0 if targets[r] == CE_IGNORE_INDEX else (m - logits[r, targets[r]]) + log(s)


def _backward_naive(floating[:, ::1] dlogits, const floating[::1] dlosses,
                    const floating[:, ::1] logits, const floating[::1] lse,
                    const int32_t[::1] targets, Py_ssize_t V, bint overwrite):
    cdef Py_ssize_t r, i
    cdef double p
    for r in range(logits.shape[0]):
        if targets[r] == CE_IGNORE_INDEX:
            if overwrite:
                for i in range(logits.shape[1]):
                    dlogits[r, i] = 0
            continue
        for i in range(V):
            p = exp(logits[r, i] - lse[r])
            if i == targets[r]:
                p -= 1
            if overwrite:
                dlogits[r, i] = p * dlosses[r]
            else:
                dlogits[r, i] += p * dlosses[r]
        if overwrite:
            for i in range(V, logits.shape[1]):
                dlogits[r, i] = 0


def softmax_crossentropy_forward_naive(losses, lse, logits, targets, V, *, n_threads=None):
    """Serial twin of softmax_crossentropy_forward (float32 or float64)."""
    resolve_threads(n_threads)
    N, Vp = _check_forward(losses, lse, logits, targets, V, float_type(logits))
    _forward_naive(losses.reshape(N), lse.reshape(N), logits.reshape(N, Vp), targets.reshape(N), V)


def softmax_crossentropy_backward_naive(dlogits, dlosses, logits, lse, targets, V, *,
                                        overwrite=False, n_threads=None):
    """Serial twin of softmax_crossentropy_backward (float32 or float64)."""
    resolve_threads(n_threads)
    N, Vp, in_place = _check_backward(dlogits, dlosses, logits, lse, targets, V, float_type(logits))
    _backward_naive(dlogits.reshape(N, Vp), dlosses.reshape(N), logits.reshape(N, Vp),
                    lse.reshape(N), targets.reshape(N), V, in_place or bool(overwrite))
