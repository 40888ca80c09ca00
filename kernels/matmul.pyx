"""Fully connected layer: ``out = inp @ weight.T + bias`` and its backward.

All three products (forward, dinp, dweight) go through ``kernels.gemm.gemm``:
our OpenMP threads split the output into blocks and each calls BLAS sgemm
single-threaded on its block, so only one thread pool runs (see kernels/gemm.pyx
for why); the forward's bias is added to each block in the same parallel region.
dbias comes out of the weight gradient's product where that runs through the
packed GEMM (summed as dout is packed); elsewhere it is an OpenMP loop split by
output channel (each thread owns a range of channels), so no atomics are needed.

Each kernel has a ``_naive`` twin (plain serial loops, no BLAS) that also accepts
float64, for tests and finite-difference checks.
"""
cimport numpy as cnp
from cython cimport floating
from cython.parallel cimport prange
from libc.stdlib cimport calloc, free

from kernels.gemm cimport gemm
from kernels._common cimport (check_disjoint, checked_data, float_type, overwrite_flags,
                              resolve_threads)

import numpy as np

cnp.import_array()

cdef enum:
    DBIAS_PARALLEL_MIN = 65536   # below this many dout elements one thread sums dbias


cdef extern from "simd.h":
    pass

cdef extern from *:
    """
    /* dbias[c0:c1] (+)= the column sums of dout (N x OC) in float64, down the rows
       four at a time (their float32 sum, within an ulp or two of those four, then
       widened), DBIAS_COLS channels per pass so that the accumulator stays in L1,
       for AVX2 and the baseline.  One thread owns a contiguous range of channels,
       so it reads a long run of every row, and each channel's sum is the same
       whatever the thread count.  Before, 64-channel tasks of plain float64 sums
       (two doubles per instruction): 2.2 ms for 768 channels at 8192 rows on the
       Zen 3 VM, where PyTorch's dout.sum(0) takes 0.7. */
    #define DBIAS_COLS 512
    ADT_MULTIVERSION
    static void dbias_cols(float* dbias, const float* dout, ptrdiff_t N, ptrdiff_t OC,
                           ptrdiff_t c0, ptrdiff_t c1, int overwrite) {
        double acc[DBIAS_COLS] __attribute__((aligned(64)));
        for (ptrdiff_t s0 = c0; s0 < c1; s0 += DBIAS_COLS) {
            ptrdiff_t w = c1 - s0 < DBIAS_COLS ? c1 - s0 : DBIAS_COLS;
            for (ptrdiff_t j = 0; j < w; j++) acc[j] = 0.0;
            ptrdiff_t n = 0;
            for (; n + 4 <= N; n += 4) {
                const float* r0 = dout + n * OC + s0;
                const float* r1 = r0 + OC;
                const float* r2 = r1 + OC;
                const float* r3 = r2 + OC;
                for (ptrdiff_t j = 0; j < w; j++)
                    acc[j] += (double)((r0[j] + r1[j]) + (r2[j] + r3[j]));
            }
            for (; n < N; n++) {
                const float* r = dout + n * OC + s0;
                for (ptrdiff_t j = 0; j < w; j++) acc[j] += (double)r[j];
            }
            for (ptrdiff_t j = 0; j < w; j++)
                dbias[s0 + j] = overwrite ? (float)acc[j] : dbias[s0 + j] + (float)acc[j];
        }
    }
    """
    void dbias_cols(float* dbias, const float* dout, Py_ssize_t N, Py_ssize_t OC,
                    Py_ssize_t c0, Py_ssize_t c1, int overwrite) nogil


cdef void matmul_forward_c(float* out, const float* inp, const float* weight,
                           const float* bias, Py_ssize_t N, Py_ssize_t C,
                           Py_ssize_t OC, int n_threads) noexcept nogil:
    gemm(False, True, N, OC, C, 1.0, inp, C, weight, C, 0.0, out, OC, bias, NULL, n_threads)


cdef void matmul_backward_c(float* dinp, float* dweight, float* dbias,
                            const float* dout, const float* inp, const float* weight,
                            Py_ssize_t N, Py_ssize_t C, Py_ssize_t OC,
                            int n_threads, bint ow_dinp, bint ow_dweight,
                            bint ow_dbias) noexcept nogil:
    # ow_*: write that gradient instead of adding into it (beta 0: its old contents
    # are never read, which also saves zeroing it beforehand).
    cdef Py_ssize_t per, o
    cdef int t
    cdef double* sums = NULL
    cdef bint summed
    if dinp != NULL:
        gemm(False, False, N, C, OC, 1.0, dout, OC, weight, C, 0.0 if ow_dinp else 1.0,
             dinp, C, NULL, NULL, n_threads)
    if dbias != NULL:
        sums = <double*>calloc(OC, sizeof(double))
    # dbias is the row sums of dout^T, which the weight gradient's product can take
    # as it packs dout (the packed GEMM): one read of dout from memory fewer (75 MB
    # for the qkv layer at 8192 tokens, 3.6 ms of 320 on the Zen 3 VM).
    # dweight NULL: a frozen weight (LoRA's base), no weight gradient.
    summed = dweight != NULL and gemm(True, False, OC, C, N, 1.0, dout, OC, inp, C,
                                      0.0 if ow_dweight else 1.0, dweight, C, NULL, sums,
                                      n_threads) and sums != NULL
    if summed:
        for o in range(OC):
            dbias[o] = <float>sums[o] if ow_dbias else dbias[o] + <float>sums[o]
    free(sums)
    if summed or dbias == NULL:
        return
    if N * OC < DBIAS_PARALLEL_MIN:
        n_threads = 1
    per = ((OC + n_threads - 1) // n_threads + 15) // 16 * 16
    for t in prange(n_threads, schedule='static', chunksize=1, nogil=True,
                    num_threads=n_threads):
        if t * per < OC:
            dbias_cols(dbias, dout, N, OC, t * per, min(OC, (t + 1) * per), ow_dbias)


# ---------------------------------------------------------------- Python boundary

def _check_weight(weight):
    if not isinstance(weight, np.ndarray) or weight.ndim != 2:
        raise ValueError(f"weight must be a 2-D (OC, C) array, got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")


def _matmul_shapes(inp, weight):
    """(lead, N, C, OC) from inp (N, C) or (B, T, C) and weight (OC, C)."""
    if not isinstance(inp, np.ndarray) or inp.ndim not in (2, 3):
        raise ValueError(f"inp must be a 2-D (N, C) or 3-D (B, T, C) array, got "
                         f"{getattr(inp, 'shape', type(inp).__name__)}")
    _check_weight(weight)
    lead = tuple(inp.shape[:inp.ndim - 1])
    C = inp.shape[inp.ndim - 1]
    OC = weight.shape[0]
    if weight.shape[1] != C:
        raise ValueError(f"weight has shape {weight.shape}, expected ({OC}, {C}) to match inp's "
                         f"last dimension {C}")
    N = 1
    for d in lead:
        N *= d
    return lead, N, C, OC


cdef _check_forward_overlap(out, inp, weight, bias):
    check_disjoint((("out", out),), (("inp", inp), ("weight", weight), ("bias", bias)))


cdef _check_backward_overlap(dinp, dweight, dbias, dout, inp, weight, tuple flags):
    # inp may be None (a frozen weight: check_disjoint skips None).
    # dinp may be dweight itself (an input that is also the weight, in the AD runtime):
    # dinp's product is finished before dweight's reads or adds, so overwrite may be
    # set for dinp only.
    check_disjoint((("dinp", dinp), ("dweight", dweight), ("dbias", dbias)),
                   (("dout", dout), ("inp", inp), ("weight", weight)), (("dinp", "dweight"),))
    if (flags[1] and dinp is not None and dweight is not None
            and cnp.PyArray_DATA(<cnp.ndarray>dinp) == cnp.PyArray_DATA(<cnp.ndarray>dweight)):
        raise ValueError("dweight is dinp: overwrite may be set for dinp only, which takes "
                         "its gradient first")


def matmul_forward(out, inp, weight, bias, *, n_threads=None):
    """out = inp @ weight.T + bias.  inp (N, C) or (B, T, C); weight (OC, C);
    bias (OC,) or None; out (N, OC) or (B, T, OC), overwritten."""
    cdef Py_ssize_t N, C, OC
    lead, N, C, OC = _matmul_shapes(inp, weight)
    cdef float* inp_p = <float*>checked_data("inp", inp, cnp.NPY_FLOAT32, lead + (C,), False)
    cdef float* w_p = <float*>checked_data("weight", weight, cnp.NPY_FLOAT32, (OC, C), False)
    cdef float* b_p = NULL
    if bias is not None:
        b_p = <float*>checked_data("bias", bias, cnp.NPY_FLOAT32, (OC,), False)
    cdef float* out_p = <float*>checked_data("out", out, cnp.NPY_FLOAT32, lead + (OC,), True)
    _check_forward_overlap(out, inp, weight, bias)
    cdef int nt = resolve_threads(n_threads)
    with nogil:
        matmul_forward_c(out_p, inp_p, w_p, b_p, N, C, OC, nt)


def _backward_shapes(dout, inp, weight, dweight):
    """(lead, N, C, OC) of a backward: from inp, or where inp is None (allowed only
    without dweight: a frozen weight's dinp needs dout and the weight alone) from dout."""
    if inp is not None:
        return _matmul_shapes(inp, weight)
    if dweight is not None:
        raise ValueError("inp is None but dweight is not: the weight gradient needs inp")
    if not isinstance(dout, np.ndarray) or dout.ndim not in (2, 3):
        raise ValueError(f"dout must be a 2-D (N, OC) or 3-D (B, T, OC) array, got "
                         f"{getattr(dout, 'shape', type(dout).__name__)}")
    _check_weight(weight)
    lead = tuple(dout.shape[:dout.ndim - 1])
    N = 1
    for d in lead:
        N *= d
    return lead, N, weight.shape[1], weight.shape[0]


def matmul_backward(dinp, dweight, dbias, dout, inp, weight, *, overwrite=False,
                    n_threads=None):
    """Accumulate the gradients of ``out = inp @ weight.T + bias``:
    dinp += dout @ weight (skipped when dinp is None), dweight += dout.T @ inp (skipped
    when dweight is None: a frozen weight),
    dbias += dout summed over rows (skipped when dbias is None).
    ``inp`` may be None where dweight is: a frozen weight's gradients need only dout and
    the weight (so a frozen layer need not keep its input for the backward).
    ``overwrite`` (a bool, or one each for dinp, dweight, dbias): that gradient is
    set instead, its old contents never read."""
    cdef Py_ssize_t N, C, OC
    cdef bint ow_i, ow_w, ow_b
    flags = overwrite_flags(overwrite, ("dinp", "dweight", "dbias"))
    ow_i, ow_w, ow_b = flags
    lead, N, C, OC = _backward_shapes(dout, inp, weight, dweight)
    cdef float* inp_p = NULL
    if inp is not None:
        inp_p = <float*>checked_data("inp", inp, cnp.NPY_FLOAT32, lead + (C,), False)
    cdef float* w_p = <float*>checked_data("weight", weight, cnp.NPY_FLOAT32, (OC, C), False)
    cdef float* dout_p = <float*>checked_data("dout", dout, cnp.NPY_FLOAT32, lead + (OC,), False)
    cdef float* dw_p = NULL
    cdef float* dinp_p = NULL
    cdef float* db_p = NULL
    if dweight is not None:
        dw_p = <float*>checked_data("dweight", dweight, cnp.NPY_FLOAT32, (OC, C), True)
    if dinp is not None:
        dinp_p = <float*>checked_data("dinp", dinp, cnp.NPY_FLOAT32, lead + (C,), True)
    if dbias is not None:
        db_p = <float*>checked_data("dbias", dbias, cnp.NPY_FLOAT32, (OC,), True)
    _check_backward_overlap(dinp, dweight, dbias, dout, inp, weight, flags)
    cdef int nt = resolve_threads(n_threads)
    with nogil:
        matmul_backward_c(dinp_p, dw_p, db_p, dout_p, inp_p, w_p, N, C, OC, nt, ow_i, ow_w,
                          ow_b)


# ---------------------------------------------------------------- naive twins

cdef void _forward_naive(floating[:, ::1] out, floating[:, ::1] inp,
                         floating[:, ::1] weight, floating[::1] bias,
                         bint has_bias) noexcept nogil:
    cdef Py_ssize_t n, o, c
    cdef floating acc
    for n in range(inp.shape[0]):
        for o in range(weight.shape[0]):
            acc = bias[o] if has_bias else 0
            for c in range(inp.shape[1]):
                acc = acc + inp[n, c] * weight[o, c]
            out[n, o] = acc


cdef void _backward_naive(floating[:, ::1] dinp, floating[:, ::1] dweight,
                          floating[::1] dbias, floating[:, ::1] dout,
                          floating[:, ::1] inp, floating[:, ::1] weight,
                          bint has_dinp, bint has_dbias) noexcept nogil:
    cdef Py_ssize_t n, o, c
    for n in range(inp.shape[0]):
        for o in range(weight.shape[0]):
            if has_dbias:
                dbias[o] += dout[n, o]
            for c in range(inp.shape[1]):
                dweight[o, c] += dout[n, o] * inp[n, c]
                if has_dinp:
                    dinp[n, c] += dout[n, o] * weight[o, c]


def matmul_forward_naive(out, inp, weight, bias, *, n_threads=None):
    """Plain-loop twin of ``matmul_forward`` (serial; float32 or float64)."""
    lead, N, C, OC = _matmul_shapes(inp, weight)
    cdef int ft = float_type(inp)
    checked_data("inp", inp, ft, lead + (C,), False)
    checked_data("weight", weight, ft, (OC, C), False)
    if bias is not None:
        checked_data("bias", bias, ft, (OC,), False)
    checked_data("out", out, ft, lead + (OC,), True)
    _check_forward_overlap(out, inp, weight, bias)
    resolve_threads(n_threads)
    bias_or_dummy = bias if bias is not None else np.zeros(1, inp.dtype)
    if ft == cnp.NPY_FLOAT32:
        _forward_naive[float](out.reshape(N, OC), inp.reshape(N, C), weight,
                              bias_or_dummy, bias is not None)
    else:
        _forward_naive[double](out.reshape(N, OC), inp.reshape(N, C), weight,
                               bias_or_dummy, bias is not None)


def matmul_backward_naive(dinp, dweight, dbias, dout, inp, weight, *, overwrite=False,
                          n_threads=None):
    """Plain-loop twin of ``matmul_backward`` (serial; float32 or float64)."""
    flags = overwrite_flags(overwrite, ("dinp", "dweight", "dbias"))
    lead, N, C, OC = _backward_shapes(dout, inp, weight, dweight)
    cdef int ft = float_type(inp if inp is not None else dout)
    if inp is not None:
        checked_data("inp", inp, ft, lead + (C,), False)
    checked_data("weight", weight, ft, (OC, C), False)
    checked_data("dout", dout, ft, lead + (OC,), False)
    if dweight is not None:
        checked_data("dweight", dweight, ft, (OC, C), True)
    if dinp is not None:
        checked_data("dinp", dinp, ft, lead + (C,), True)
    if dbias is not None:
        checked_data("dbias", dbias, ft, (OC,), True)
    _check_backward_overlap(dinp, dweight, dbias, dout, inp, weight, flags)
    resolve_threads(n_threads)
    for arr, flag in zip((dinp, dweight, dbias), flags):
        if flag and arr is not None:
            arr[...] = 0
    dt = dout.dtype
    dummy = np.zeros(1, dt)
    dinp2 = dinp.reshape(N, C) if dinp is not None else np.zeros((1, 1), dt)
    dbias1 = dbias if dbias is not None else dummy
    # A frozen weight (dweight None): its gradient is taken into a throwaway buffer, and
    # inp (which may then be None) read as zeros.
    dweight2 = dweight if dweight is not None else np.zeros((OC, C), dt)
    inp2 = inp.reshape(N, C) if inp is not None else np.zeros((N, C), dt)
    if ft == cnp.NPY_FLOAT32:
        _backward_naive[float](dinp2, dweight2, dbias1, dout.reshape(N, OC), inp2,
                               weight, dinp is not None, dbias is not None)
    else:
        _backward_naive[double](dinp2, dweight2, dbias1, dout.reshape(N, OC), inp2,
                                weight, dinp is not None, dbias is not None)
