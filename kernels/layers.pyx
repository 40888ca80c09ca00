"""GPT-2's pointwise and row-wise layers as forward/backward kernel pairs.

encoder (token + position embedding), layernorm (eps 1e-5, keeps mean and rstd for
backward), GELU (PyTorch's approximate='tanh') and residual add.  Forward kernels
overwrite their outputs; backward kernels add into every gradient.  The parallel
kernels split work by output ownership and keep a fixed summation order, so their
results do not depend on the thread count.  Every kernel has a serial ``_naive``
twin with the same signature; the twins also accept float64 arrays, which is how
the tests check the backward formulas against finite differences.
"""
from cython.parallel cimport prange
from libc.math cimport sqrt, tanh
from libc.stdint cimport int32_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset

import numpy as np
cimport numpy as cnp
from cython cimport floating

from kernels._common cimport (check_disjoint, check_rows, checked_data, column_sum_blocks,
                              f32_data, float_type, int32_within, lanes_kind, overwrite_flags,
                              reduce_blocks, resolve_threads, serial_if_small, slice_width,
                              use_stream, zero_core)
# The switches of kernels._common, here where they were first (tests and benchmarks
# call kernels.layers.set_vector_lanes and the like).
from kernels._common import (overwrite_flags, set_eight_lane_clones,  # noqa: F401
                             set_stream_min_bytes, set_vector_lanes, stream_min_bytes,
                             vector_lanes)

cnp.import_array()

cdef extern from *:
    """
    #define ADTAPE_LAYERNORM_EPS 1e-5
    #define ADTAPE_GELU_K 0.7978845608028654 /* sqrt(2/pi) */
    #define ADTAPE_GELU_A 0.044715
    """
    # double constants; float kernels cast them, which gcc folds at compile time
    const double LAYERNORM_EPS "ADTAPE_LAYERNORM_EPS"
    const double GELU_K "ADTAPE_GELU_K"
    const double GELU_A "ADTAPE_GELU_A"

cdef extern from "simd.h":
    pass

cdef extern from *:
    """
    /* GELU, layernorm and encoder rows and the adds (kernels/layers_lanes.h) in eight
       lanes, as target clones and as an explicit x86-64-v3 build, and in sixteen for
       CPUs with AVX-512; each entry point takes the build from its caller
       (lanes_kind()). */
    #define ADT_W 8
    #include "layers_lanes.h"
    #if ADT_HAVE_V3
    #undef ADT_LANES_SUFFIX
    #define ADT_LANES_SUFFIX _x3
    #include "layers_lanes.h"
    #undef ADT_LANES_SUFFIX
    #define ADT_LANES_SUFFIX
    #endif
    #undef ADT_W
    #if ADT_HAVE_V4
    #define ADT_W 16
    #include "layers_lanes.h"
    #undef ADT_W
    #endif

    static void gelu_forward_span(int kind, float* out, const float* inp, ptrdiff_t n,
                                  int stream) {
        ADT_LANES_CALL_X3(kind, gelu_forward_span, (out, inp, n, stream));
    }
    static void gelu_backward_span(int kind, float* dinp, const float* inp, const float* dout,
                                   ptrdiff_t n, int overwrite) {
        ADT_LANES_CALL_X3(kind, gelu_backward_span, (dinp, inp, dout, n, overwrite));
    }
    static void ln_forward_rows(int kind, float* out, float* mean, float* rstd,
                                const float* inp, const float* weight, const float* bias,
                                ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t C, int stream) {
        ADT_LANES_CALL_X3(kind, ln_forward_rows, (out, mean, rstd, inp, weight, bias, r0, r1, C,
                                               stream));
    }
    static void ln_backward_rows(int kind, float* dinp, float* part_w, float* part_b,
                                 const float* dout, const float* inp, const float* weight,
                                 const float* mean, const float* rstd, ptrdiff_t r0,
                                 ptrdiff_t r1, ptrdiff_t C, int ow_dinp) {
        ADT_LANES_CALL_X3(kind, ln_backward_rows, (dinp, part_w, part_b, dout, inp, weight,
                                                 mean, rstd, r0, r1, C, ow_dinp));
    }
    static void add_to_both_span(int kind, float* a, float* b, const float* d, ptrdiff_t n,
                                 int ow_a, int ow_b, int ahead) {
        ADT_LANES_CALL_X3(kind, add_to_both_span, (a, b, d, n, ow_a, ow_b, ahead));
    }
    static void add_span(int kind, float* out, const float* a, const float* b, ptrdiff_t n,
                         int stream) {
        ADT_LANES_CALL_X3(kind, add_span, (out, a, b, n, stream));
    }
    static void encoder_rows(int kind, float* out, const int32_t* ids, const float* wte,
                             const float* wpe, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t T,
                             ptrdiff_t C, int stream) {
        ADT_LANES_CALL_X3(kind, encoder_rows, (out, ids, wte, wpe, r0, r1, T, C, stream));
    }
    static void exp_span(int kind, float* out, const float* inp, ptrdiff_t n, int fast) {
        ADT_LANES_CALL_X3(kind, exp_span, (out, inp, n, fast));
    }
    """
    void _gelu_forward_span "gelu_forward_span" (int kind, float* out, const float* inp,
                                                 Py_ssize_t n, bint stream) nogil
    void _gelu_backward_span "gelu_backward_span" (int kind, float* dinp, const float* inp,
                                                   const float* dout, Py_ssize_t n,
                                                   int overwrite) nogil
    void ln_forward_rows(int kind, float* out, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, Py_ssize_t r0, Py_ssize_t r1,
                         Py_ssize_t C, bint stream) nogil
    void ln_backward_rows(int kind, float* dinp, float* part_w, float* part_b,
                          const float* dout, const float* inp, const float* weight,
                          const float* mean, const float* rstd, Py_ssize_t r0, Py_ssize_t r1,
                          Py_ssize_t C, int ow_dinp) nogil
    void add_to_both_span(int kind, float* a, float* b, const float* d, Py_ssize_t n,
                          bint ow_a, bint ow_b, bint ahead) nogil
    void exp_span(int kind, float* out, const float* inp, Py_ssize_t n, int fast) nogil
    void add_span(int kind, float* out, const float* a, const float* b, Py_ssize_t n,
                  bint stream) nogil
    void encoder_rows(int kind, float* out, const int32_t* ids, const float* wte,
                      const float* wpe, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t T, Py_ssize_t C,
                      bint stream) nogil


def _vector_exp(const float[::1] inp, bint fast=False):
    """exp of a float32 array through the vector exp the kernels inline (softmax,
    cross-entropy backward), or (``fast``) 2 ** inp through the exp2_fast of the
    GELU and cross-entropy sums, at the width in force: for the tests."""
    out = np.empty(inp.shape[0], np.float32)
    cdef float[::1] o = out
    if inp.shape[0]:
        exp_span(lanes_kind(), &o[0], &inp[0], inp.shape[0], fast)
    return out


cdef enum:
    # Elements per parallel work item of the pointwise kernels (64 KiB of float32).
    CHUNK = 16384


# ---------------------------------------------------------------------------
# Argument checks of the def wrappers (kernels._common's, and the layers' own)

cdef tuple _check_encoder_forward(out, ids, wte, wpe, int ft):
    checked_data("ids", ids, cnp.NPY_INT32, None, False)
    if ids.ndim != 2:
        raise ValueError(f"ids must have shape (B, T), got {ids.shape}")
    checked_data("wte", wte, ft, None, False)
    if wte.ndim != 2:
        raise ValueError(f"wte must have shape (Vp, C), got {wte.shape}")
    B, T = ids.shape
    Vp, C = wte.shape
    checked_data("wpe", wpe, ft, None, False)
    if wpe.ndim != 2 or wpe.shape[1] != C or wpe.shape[0] < T:
        raise ValueError(f"wpe must have shape (maxT, {C}) with maxT >= T={T}, got {wpe.shape}")
    checked_data("out", out, ft, (B, T, C), True)
    check_disjoint((("out", out),), (("ids", ids), ("wte", wte), ("wpe", wpe)))
    _check_ids(ids, Vp)
    return B, T, C


cdef tuple _check_encoder_backward(dwte, dwpe, dout, ids, int ft):
    checked_data("ids", ids, cnp.NPY_INT32, None, False)
    if ids.ndim != 2:
        raise ValueError(f"ids must have shape (B, T), got {ids.shape}")
    checked_data("dwte", dwte, ft, None, True)
    if dwte.ndim != 2:
        raise ValueError(f"dwte must have shape (Vp, C), got {dwte.shape}")
    B, T = ids.shape
    Vp, C = dwte.shape
    checked_data("dwpe", dwpe, ft, None, True)
    if dwpe.ndim != 2 or dwpe.shape[1] != C or dwpe.shape[0] < T:
        raise ValueError(f"dwpe must have shape (maxT, {C}) with maxT >= T={T}, got {dwpe.shape}")
    checked_data("dout", dout, ft, (B, T, C), False)
    # dwte and dwpe are scattered into in one pass: one array for both would lose adds
    check_disjoint((("dwte", dwte), ("dwpe", dwpe)), (("dout", dout), ("ids", ids)))
    _check_ids(ids, Vp)
    return B, T, C



cdef _check_ids(ids, Py_ssize_t Vp):
    if not int32_within(ids, Vp):
        raise ValueError(f"ids must lie in [0, {Vp}) (rows of wte), "
                         f"got values in [{ids.min()}, {ids.max()}]")



cdef tuple _check_layernorm_forward(out, mean, rstd, inp, weight, bias, int ft):
    N, C, lead = check_rows("inp", inp, ft, False)
    checked_data("weight", weight, ft, (C,), False)
    checked_data("bias", bias, ft, (C,), False)
    checked_data("out", out, ft, inp.shape, True)
    checked_data("mean", mean, ft, lead, True)
    checked_data("rstd", rstd, ft, lead, True)
    check_disjoint((("out", out), ("mean", mean), ("rstd", rstd)),
                   (("inp", inp), ("weight", weight), ("bias", bias)))
    return N, C


cdef tuple _check_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, int ft,
                                     tuple flags):
    # -> (N, C).  dweight may be dbias itself (a weight that is also the bias, in the AD
    # runtime): the kernel finishes each slice of dweight before adding dbias's into
    # it, so overwrite may be set for dweight only.
    N, C, lead = check_rows("inp", inp, ft, False)
    checked_data("weight", weight, ft, (C,), False)
    checked_data("mean", mean, ft, lead, False)
    checked_data("rstd", rstd, ft, lead, False)
    checked_data("dout", dout, ft, inp.shape, False)
    checked_data("dinp", dinp, ft, inp.shape, True)
    checked_data("dweight", dweight, ft, (C,), True)
    checked_data("dbias", dbias, ft, (C,), True)
    check_disjoint((("dinp", dinp), ("dweight", dweight), ("dbias", dbias)),
                   (("dout", dout), ("inp", inp), ("weight", weight), ("mean", mean),
                    ("rstd", rstd)), (("dweight", "dbias"),))
    if flags[2] and f32_data(dweight) == f32_data(dbias):
        raise ValueError("dbias is dweight: overwrite may be set for dweight only, which "
                         "takes its gradient first")
    return N, C


cdef Py_ssize_t _check_pointwise(tuple outputs, tuple inputs, int ft,
                                 tuple same_ok=()) except -1:
    # Every array has the first input's shape; returns the element count.
    first_name, first = inputs[0]
    checked_data(first_name, first, ft, None, False)
    shape = first.shape
    for name, arr in inputs[1:]:
        checked_data(name, arr, ft, shape, False)
    for name, arr in outputs:
        checked_data(name, arr, ft, shape, True)
    check_disjoint(outputs, inputs, same_ok)
    return first.size


# ---------------------------------------------------------------------------
# encoder

cdef enum:
    # Rows per parallel task of encoder_forward.
    ENCODER_ROWS_PER_TASK = 16


cdef void encoder_forward_core(float* out, const int32_t* ids, const float* wte, const float* wpe,
                               Py_ssize_t B, Py_ssize_t T, Py_ssize_t C, int n_threads) noexcept nogil:
    cdef Py_ssize_t k, N = B * T
    cdef Py_ssize_t n_tasks = (N + ENCODER_ROWS_PER_TASK - 1) // ENCODER_ROWS_PER_TASK
    cdef int kind = lanes_kind()
    cdef bint stream = use_stream(out, 3 * N * C * sizeof(float), C)
    for k in prange(n_tasks, schedule='static', nogil=True, num_threads=n_threads):
        encoder_rows(kind, out, ids, wte, wpe, k * ENCODER_ROWS_PER_TASK,
                     min(N, (k + 1) * ENCODER_ROWS_PER_TASK), T, C, stream)


cdef extern from *:
    """
    /* Fetch floats [0, n) of p ahead of use, one request per 64-byte line. */
    static inline void adt_prefetch_span(const float* p, ptrdiff_t n) {
        for (ptrdiff_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 1);
    }
    """
    void prefetch_span "adt_prefetch_span" (const float* p, Py_ssize_t n) nogil


cdef enum:
    # Rows ahead whose dwte slice encoder_backward fetches: the rows are random
    # lines of a table far larger than the caches, so each would otherwise wait
    # on memory.
    ENCODER_PREFETCH_ROWS = 4
    # Elements of dout below which encoder_backward runs on one thread by default.
    # Measured here (C = 768, interleaved with PyTorch), one thread vs two: 0.15 vs
    # 0.24 ms at 512 rows, 0.33 vs 0.42 at 1024, 0.68 vs 0.58-0.80 at 2048 (waking the
    # second thread costs about as much as the half of the rows it takes).
    ENCODER_PARALLEL_MIN_WORK = 1 << 20


cdef void _encoder_backward_slice(float* dwte, float* dwpe, const float* dout,
                                  const int32_t* ids, Py_ssize_t N, Py_ssize_t T, Py_ssize_t C,
                                  Py_ssize_t c0, Py_ssize_t c1) noexcept nogil:
    # One thread owns channels [c0, c1) of every row of dwte and dwpe, so repeated ids
    # need no atomics, each element is summed in row order whatever the thread count,
    # and dout is read once for both.
    cdef Py_ssize_t r
    cdef int kind = lanes_kind()
    for r in range(N):
        if r + ENCODER_PREFETCH_ROWS < N:
            prefetch_span(dwte + <Py_ssize_t>ids[r + ENCODER_PREFETCH_ROWS] * C + c0, c1 - c0)
        add_to_both_span(kind, dwte + <Py_ssize_t>ids[r] * C + c0, dwpe + (r % T) * C + c0,
                         dout + r * C + c0, c1 - c0, False, False, False)


cdef void encoder_backward_core(float* dwte, float* dwpe, const float* dout, const int32_t* ids,
                                Py_ssize_t B, Py_ssize_t T, Py_ssize_t C, int n_threads,
                                Py_ssize_t wte_rows, Py_ssize_t wpe_rows, bint ow_wte,
                                bint ow_wpe) noexcept nogil:
    # ow_wte / ow_wpe: zero that whole table first (it is scattered into).
    cdef Py_ssize_t s, c0, c1
    if ow_wte:
        zero_core(dwte, wte_rows * C, n_threads)
    if ow_wpe:
        zero_core(dwpe, wpe_rows * C, n_threads)
    cdef Py_ssize_t width = slice_width(C, n_threads)
    cdef Py_ssize_t n_slices = (C + width - 1) // width
    for s in prange(n_slices, schedule='static', nogil=True, num_threads=n_threads):
        c0 = s * width
        c1 = min(C, c0 + width)
        _encoder_backward_slice(dwte, dwpe, dout, ids, B * T, T, C, c0, c1)


def encoder_forward(out, ids, wte, wpe, *, n_threads=None):
    """out[b, t] = wte[ids[b, t]] + wpe[t].  out (B,T,C); ids (B,T) int32 in [0, Vp);
    wte (Vp,C); wpe (maxT,C) with maxT >= T."""
    cdef int nt = resolve_threads(n_threads)
    B, T, C = _check_encoder_forward(out, ids, wte, wpe, cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, B * T * C)
    cdef float* o = f32_data(out)
    cdef const int32_t* idp = <const int32_t*>cnp.PyArray_DATA(<cnp.ndarray>ids)
    cdef const float* wtep = f32_data(wte)
    cdef const float* wpep = f32_data(wpe)
    cdef Py_ssize_t b = B, t = T, c = C
    with nogil:
        encoder_forward_core(o, idp, wtep, wpep, b, t, c, nt)


def encoder_backward(dwte, dwpe, dout, ids, *, overwrite=False, n_threads=None):
    """dwte[ids[b, t]] += dout[b, t]; dwpe[t] += sum_b dout[b, t].
    ``overwrite`` (bool, or one per table): that table is set, not added to."""
    cdef int nt = resolve_threads(n_threads)
    cdef bint ow_wte, ow_wpe
    ow_wte, ow_wpe = overwrite_flags(overwrite, ("dwte", "dwpe"))
    B, T, C = _check_encoder_backward(dwte, dwpe, dout, ids, cnp.NPY_FLOAT32)
    cdef Py_ssize_t wte_rows = dwte.shape[0], wpe_rows = dwpe.shape[0]
    # The tables to overwrite are zeroed here, on threads for their own size (dwte is
    # the whole vocabulary), and the scatter runs on threads for dout's.
    cdef int zero_nt = serial_if_small(nt, n_threads, wte_rows * C)
    if n_threads is None and B * T * C < ENCODER_PARALLEL_MIN_WORK:
        nt = 1
    cdef float* dwtep = f32_data(dwte)
    cdef float* dwpep = f32_data(dwpe)
    cdef const float* doutp = f32_data(dout)
    cdef const int32_t* idp = <const int32_t*>cnp.PyArray_DATA(<cnp.ndarray>ids)
    cdef Py_ssize_t b = B, t = T, c = C
    with nogil:
        if ow_wte:
            zero_core(dwtep, wte_rows * c, zero_nt)
        if ow_wpe:
            zero_core(dwpep, wpe_rows * c, zero_nt)
        encoder_backward_core(dwtep, dwpep, doutp, idp, b, t, c, nt, wte_rows, wpe_rows, False,
                              False)


def _encoder_forward_naive(floating[:, :, ::1] out, const int32_t[:, ::1] ids,
                           const floating[:, ::1] wte, const floating[:, ::1] wpe):
    cdef Py_ssize_t b, t, c
    for b in range(out.shape[0]):
        for t in range(out.shape[1]):
            for c in range(out.shape[2]):
                out[b, t, c] = wte[ids[b, t], c] + wpe[t, c]


def _encoder_backward_naive(floating[:, ::1] dwte, floating[:, ::1] dwpe,
                            const floating[:, :, ::1] dout, const int32_t[:, ::1] ids):
    cdef Py_ssize_t b, t, c
    for b in range(dout.shape[0]):
        for t in range(dout.shape[1]):
            for c in range(dout.shape[2]):
                dwte[ids[b, t], c] += dout[b, t, c]
                dwpe[t, c] += dout[b, t, c]


def encoder_forward_naive(out, ids, wte, wpe, *, n_threads=None):
    """Serial twin of encoder_forward (float32 or float64)."""
    resolve_threads(n_threads)
    _check_encoder_forward(out, ids, wte, wpe, float_type(out))
    _encoder_forward_naive(out, ids, wte, wpe)


def encoder_backward_naive(dwte, dwpe, dout, ids, *, overwrite=False, n_threads=None):
    """Serial twin of encoder_backward (float32 or float64)."""
    resolve_threads(n_threads)
    flags = overwrite_flags(overwrite, ("dwte", "dwpe"))
    _check_encoder_backward(dwte, dwpe, dout, ids, float_type(dout))
    for arr, flag in zip((dwte, dwpe), flags):
        if flag:
            arr[...] = 0
    _encoder_backward_naive(dwte, dwpe, dout, ids)


# ---------------------------------------------------------------------------
# layernorm

cdef enum:
    # Rows per parallel task of layernorm's forward.
    LAYERNORM_ROWS_PER_TASK = 16


cdef void layernorm_forward_core(float* out, float* mean, float* rstd, const float* inp,
                                 const float* weight, const float* bias,
                                 Py_ssize_t N, Py_ssize_t C, int n_threads) noexcept nogil:
    cdef Py_ssize_t k, n_tasks = (N + LAYERNORM_ROWS_PER_TASK - 1) // LAYERNORM_ROWS_PER_TASK
    cdef int kind = lanes_kind()
    cdef bint stream = use_stream(out, 2 * N * C * sizeof(float), C)
    if n_threads == 1:      # the same tasks, no parallel region (see _common's SERIAL)
        for k in range(n_tasks):
            ln_forward_rows(kind, out, mean, rstd, inp, weight, bias, k * LAYERNORM_ROWS_PER_TASK,
                            min(N, (k + 1) * LAYERNORM_ROWS_PER_TASK), C, stream)
        return
    for k in prange(n_tasks, schedule='static', nogil=True, num_threads=n_threads):
        ln_forward_rows(kind, out, mean, rstd, inp, weight, bias, k * LAYERNORM_ROWS_PER_TASK,
                        min(N, (k + 1) * LAYERNORM_ROWS_PER_TASK), C, stream)


cdef int layernorm_backward_core(float* dinp, float* dweight, float* dbias, const float* dout,
                                 const float* inp, const float* weight, const float* mean,
                                 const float* rstd, Py_ssize_t N, Py_ssize_t C,
                                 int n_threads, bint ow_dinp, bint ow_dweight,
                                 bint ow_dbias) except -1 nogil:
    if N == 0:
        if ow_dweight:
            memset(dweight, 0, C * sizeof(float))
        if ow_dbias:
            memset(dbias, 0, C * sizeof(float))
        return 0
    # Column sums as _common.pxd describes them, for dweight and dbias.
    cdef Py_ssize_t n_blocks = column_sum_blocks(N)
    # Partial dweight sums, one row per block, then partial dbias sums.
    cdef float* parts = <float*>malloc(2 * n_blocks * C * sizeof(float))
    if parts == NULL:
        with gil:
            raise MemoryError(f"layernorm_backward: cannot allocate {2 * n_blocks * C} floats")
    cdef float* parts_b = parts + n_blocks * C
    cdef Py_ssize_t blk, s, c0, c1
    cdef int kind = lanes_kind()
    if n_threads == 1:      # the same blocks and sums, no parallel region (see _common's SERIAL)
        for blk in range(n_blocks):
            ln_backward_rows(kind, dinp, parts + blk * C, parts_b + blk * C, dout, inp, weight,
                             mean, rstd, blk * N // n_blocks, (blk + 1) * N // n_blocks, C,
                             ow_dinp)
        reduce_blocks(dweight, parts, n_blocks, C, 0, C, ow_dweight)
        reduce_blocks(dbias, parts_b, n_blocks, C, 0, C, ow_dbias)
        free(parts)
        return 0
    for blk in prange(n_blocks, schedule='static', nogil=True, num_threads=n_threads):
        ln_backward_rows(kind, dinp, parts + blk * C, parts_b + blk * C, dout, inp, weight,
                         mean, rstd, blk * N // n_blocks, (blk + 1) * N // n_blocks, C, ow_dinp)
    cdef Py_ssize_t width = slice_width(C, n_threads)
    cdef Py_ssize_t n_slices = (C + width - 1) // width
    for s in prange(n_slices, schedule='static', nogil=True, num_threads=n_threads):
        c0 = s * width
        c1 = min(C, c0 + width)
        reduce_blocks(dweight, parts, n_blocks, C, c0, c1, ow_dweight)
        reduce_blocks(dbias, parts_b, n_blocks, C, c0, c1, ow_dbias)
    free(parts)
    return 0


def layernorm_forward(out, mean, rstd, inp, weight, bias, *, n_threads=None):
    """out = (inp - mean) * rstd * weight + bias over the last axis (eps 1e-5).
    inp/out (B,T,C) or (N,C); mean/rstd (B,T) or (N,) are written for backward."""
    cdef int nt = resolve_threads(n_threads)
    N, C = _check_layernorm_forward(out, mean, rstd, inp, weight, bias, cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, N * C)
    cdef float* o = f32_data(out)
    cdef float* mp = f32_data(mean)
    cdef float* rp = f32_data(rstd)
    cdef const float* ip = f32_data(inp)
    cdef const float* wp = f32_data(weight)
    cdef const float* bp = f32_data(bias)
    cdef Py_ssize_t n = N, c = C
    with nogil:
        layernorm_forward_core(o, mp, rp, ip, wp, bp, n, c, nt)


def layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, *,
                       overwrite=False, n_threads=None):
    """Adds layernorm's gradients into dinp, dweight and dbias (``overwrite``, a bool or
    one per output: that output is set instead)."""
    cdef int nt = resolve_threads(n_threads)
    cdef bint ow_i, ow_w, ow_b
    flags = overwrite_flags(overwrite, ("dinp", "dweight", "dbias"))
    ow_i, ow_w, ow_b = flags
    N, C = _check_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                                     cnp.NPY_FLOAT32, flags)
    nt = serial_if_small(nt, n_threads, N * C)
    cdef float* dip = f32_data(dinp)
    cdef float* dwp = f32_data(dweight)
    cdef float* dbp = f32_data(dbias)
    cdef const float* dop = f32_data(dout)
    cdef const float* ip = f32_data(inp)
    cdef const float* wp = f32_data(weight)
    cdef const float* mp = f32_data(mean)
    cdef const float* rp = f32_data(rstd)
    cdef Py_ssize_t n = N, c = C
    with nogil:
        layernorm_backward_core(dip, dwp, dbp, dop, ip, wp, mp, rp, n, c, nt, ow_i, ow_w, ow_b)


def _layernorm_forward_naive(floating[:, ::1] out, floating[::1] mean, floating[::1] rstd,
                             const floating[:, ::1] inp, const floating[::1] weight,
                             const floating[::1] bias):
    cdef Py_ssize_t r, i, C = inp.shape[1]
    cdef floating m, v
    for r in range(inp.shape[0]):
        m = 0
        for i in range(C):
            m += inp[r, i]
        m = m / C
        v = 0
        for i in range(C):
            v += (inp[r, i] - m) * (inp[r, i] - m)
        v = v / C
        mean[r] = m
        rstd[r] = 1 / sqrt(v + LAYERNORM_EPS)
        for i in range(C):
            out[r, i] = (inp[r, i] - m) * rstd[r] * weight[i] + bias[i]


def _layernorm_backward_naive(floating[:, ::1] dinp, floating[::1] dweight, floating[::1] dbias,
                              const floating[:, ::1] dout, const floating[:, ::1] inp,
                              const floating[::1] weight, const floating[::1] mean,
                              const floating[::1] rstd):
    cdef Py_ssize_t r, i, C = inp.shape[1]
    cdef floating norm, dnorm, mean_dnorm, mean_dnorm_norm
    for r in range(inp.shape[0]):
        mean_dnorm = 0
        mean_dnorm_norm = 0
        for i in range(C):
            norm = (inp[r, i] - mean[r]) * rstd[r]
            dnorm = weight[i] * dout[r, i]
            mean_dnorm += dnorm
            mean_dnorm_norm += dnorm * norm
        mean_dnorm = mean_dnorm / C
        mean_dnorm_norm = mean_dnorm_norm / C
        for i in range(C):
            norm = (inp[r, i] - mean[r]) * rstd[r]
            dnorm = weight[i] * dout[r, i]
            dbias[i] += dout[r, i]
            dweight[i] += norm * dout[r, i]
            dinp[r, i] += (dnorm - mean_dnorm - norm * mean_dnorm_norm) * rstd[r]


def layernorm_forward_naive(out, mean, rstd, inp, weight, bias, *, n_threads=None):
    """Serial twin of layernorm_forward (float32 or float64)."""
    resolve_threads(n_threads)
    N, C = _check_layernorm_forward(out, mean, rstd, inp, weight, bias, float_type(inp))
    _layernorm_forward_naive(out.reshape(N, C), mean.reshape(N), rstd.reshape(N),
                             inp.reshape(N, C), weight, bias)


def layernorm_backward_naive(dinp, dweight, dbias, dout, inp, weight, mean, rstd, *,
                             overwrite=False, n_threads=None):
    """Serial twin of layernorm_backward (float32 or float64)."""
    resolve_threads(n_threads)
    flags = overwrite_flags(overwrite, ("dinp", "dweight", "dbias"))
    N, C = _check_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                                     float_type(inp), flags)
    for arr, flag in zip((dinp, dweight, dbias), flags):
        if flag:
            arr[...] = 0
    _layernorm_backward_naive(dinp.reshape(N, C), dweight, dbias, dout.reshape(N, C),
                              inp.reshape(N, C), weight, mean.reshape(N), rstd.reshape(N))


# ---------------------------------------------------------------------------
# GELU, tanh approximation (the vector code is in kernels/layers_lanes.h)

cdef void gelu_forward_core(float* out, const float* inp, Py_ssize_t n, int n_threads) noexcept nogil:
    cdef Py_ssize_t k
    cdef int kind = lanes_kind()
    cdef bint stream = use_stream(out, 2 * n * sizeof(float), CHUNK)
    if n_threads == 1:      # no parallel region (see _common's SERIAL)
        for k in range((n + CHUNK - 1) // CHUNK):
            _gelu_forward_span(kind, out + k * CHUNK, inp + k * CHUNK,
                               min(<Py_ssize_t>CHUNK, n - k * CHUNK), stream)
        return
    for k in prange((n + CHUNK - 1) // CHUNK, schedule='static', nogil=True, num_threads=n_threads):
        _gelu_forward_span(kind, out + k * CHUNK, inp + k * CHUNK,
                           min(<Py_ssize_t>CHUNK, n - k * CHUNK), stream)


cdef void gelu_backward_core(float* dinp, const float* inp, const float* dout, Py_ssize_t n,
                             int n_threads, bint overwrite) noexcept nogil:
    cdef Py_ssize_t k
    cdef int kind = lanes_kind()
    if n_threads == 1:      # no parallel region (see _common's SERIAL)
        for k in range((n + CHUNK - 1) // CHUNK):
            _gelu_backward_span(kind, dinp + k * CHUNK, inp + k * CHUNK, dout + k * CHUNK,
                                min(<Py_ssize_t>CHUNK, n - k * CHUNK), overwrite)
        return
    for k in prange((n + CHUNK - 1) // CHUNK, schedule='static', nogil=True, num_threads=n_threads):
        _gelu_backward_span(kind, dinp + k * CHUNK, inp + k * CHUNK, dout + k * CHUNK,
                            min(<Py_ssize_t>CHUNK, n - k * CHUNK), overwrite)


def gelu_forward(out, inp, *, n_threads=None):
    """out = GELU(inp), tanh approximation; any shape."""
    cdef int nt = resolve_threads(n_threads)
    cdef Py_ssize_t n = _check_pointwise((("out", out),), (("inp", inp),), cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, n)
    cdef float* o = f32_data(out)
    cdef const float* ip = f32_data(inp)
    with nogil:
        gelu_forward_core(o, ip, n, nt)


def gelu_backward(dinp, inp, dout, *, overwrite=False, n_threads=None):
    """dinp += GELU'(inp) * dout (``overwrite``: dinp = ...)."""
    cdef int nt = resolve_threads(n_threads)
    cdef bint ow
    ow, = overwrite_flags(overwrite, ("dinp",))
    cdef Py_ssize_t n = _check_pointwise((("dinp", dinp),), (("inp", inp), ("dout", dout)),
                                         cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, n)
    cdef float* dp = f32_data(dinp)
    cdef const float* ip = f32_data(inp)
    cdef const float* dop = f32_data(dout)
    with nogil:
        gelu_backward_core(dp, ip, dop, n, nt, ow)


def _gelu_forward_naive(floating[::1] out, const floating[::1] inp):
    cdef Py_ssize_t i
    cdef floating x
    for i in range(inp.shape[0]):
        x = inp[i]
        out[i] = 0.5 * x * (1 + tanh(GELU_K * (x + GELU_A * x * x * x)))


def _gelu_backward_naive(floating[::1] dinp, const floating[::1] inp, const floating[::1] dout):
    cdef Py_ssize_t i
    cdef floating x, th
    for i in range(inp.shape[0]):
        x = inp[i]
        th = tanh(GELU_K * (x + GELU_A * x * x * x))
        dinp[i] += (0.5 * (1 + th)
                    + 0.5 * x * (1 - th * th) * GELU_K * (1 + 3 * GELU_A * x * x)) * dout[i]


def gelu_forward_naive(out, inp, *, n_threads=None):
    """Serial twin of gelu_forward, written with tanh (float32 or float64)."""
    resolve_threads(n_threads)
    _check_pointwise((("out", out),), (("inp", inp),), float_type(inp))
    _gelu_forward_naive(out.reshape(-1), inp.reshape(-1))


def gelu_backward_naive(dinp, inp, dout, *, overwrite=False, n_threads=None):
    """Serial twin of gelu_backward, written with tanh (float32 or float64)."""
    resolve_threads(n_threads)
    ow, = overwrite_flags(overwrite, ("dinp",))
    _check_pointwise((("dinp", dinp),), (("inp", inp), ("dout", dout)), float_type(inp))
    if ow:
        dinp[...] = 0
    _gelu_backward_naive(dinp.reshape(-1), inp.reshape(-1), dout.reshape(-1))


# ---------------------------------------------------------------------------
# residual

cdef void residual_forward_core(float* out, const float* inp1, const float* inp2, Py_ssize_t n,
                                int n_threads) noexcept nogil:
    cdef Py_ssize_t k
    cdef int kind = lanes_kind()
    cdef bint stream = use_stream(out, 3 * n * sizeof(float), CHUNK)
    if n_threads == 1:      # no parallel region (see _common's SERIAL)
        for k in range((n + CHUNK - 1) // CHUNK):
            add_span(kind, out + k * CHUNK, inp1 + k * CHUNK, inp2 + k * CHUNK,
                     min(<Py_ssize_t>CHUNK, n - k * CHUNK), stream)
        return
    for k in prange((n + CHUNK - 1) // CHUNK, schedule='static', nogil=True, num_threads=n_threads):
        add_span(kind, out + k * CHUNK, inp1 + k * CHUNK, inp2 + k * CHUNK,
                 min(<Py_ssize_t>CHUNK, n - k * CHUNK), stream)


cdef void residual_backward_core(float* dinp1, float* dinp2, const float* dout, Py_ssize_t n,
                                 int n_threads, bint ow1, bint ow2) noexcept nogil:
    # One pass: each vector of dout is read once for both outputs.
    cdef Py_ssize_t k
    cdef int kind = lanes_kind()
    if n_threads == 1:      # no parallel region (see _common's SERIAL)
        for k in range((n + CHUNK - 1) // CHUNK):
            add_to_both_span(kind, dinp1 + k * CHUNK, dinp2 + k * CHUNK, dout + k * CHUNK,
                             min(<Py_ssize_t>CHUNK, n - k * CHUNK), ow1, ow2, True)
        return
    for k in prange((n + CHUNK - 1) // CHUNK, schedule='static', nogil=True, num_threads=n_threads):
        add_to_both_span(kind, dinp1 + k * CHUNK, dinp2 + k * CHUNK, dout + k * CHUNK,
                         min(<Py_ssize_t>CHUNK, n - k * CHUNK), ow1, ow2, True)


# Each element is read before it is written: out may be inp1 or inp2 itself.
_RESIDUAL_IN_PLACE = (("out", "inp1"), ("out", "inp2"))


def residual_forward(out, inp1, inp2, *, n_threads=None):
    """out = inp1 + inp2; any shape (out may be inp1 or inp2)."""
    cdef int nt = resolve_threads(n_threads)
    cdef Py_ssize_t n = _check_pointwise((("out", out),), (("inp1", inp1), ("inp2", inp2)),
                                         cnp.NPY_FLOAT32, _RESIDUAL_IN_PLACE)
    nt = serial_if_small(nt, n_threads, n)
    cdef float* o = f32_data(out)
    cdef const float* p1 = f32_data(inp1)
    cdef const float* p2 = f32_data(inp2)
    with nogil:
        residual_forward_core(o, p1, p2, n, nt)


def residual_backward(dinp1, dinp2, dout, *, overwrite=False, n_threads=None):
    """dinp1 += dout; dinp2 += dout (``overwrite``, a bool or one per output: =)."""
    cdef int nt = resolve_threads(n_threads)
    cdef bint ow1, ow2
    ow1, ow2 = overwrite_flags(overwrite, ("dinp1", "dinp2"))
    cdef Py_ssize_t n = _check_pointwise((("dinp1", dinp1), ("dinp2", dinp2)), (("dout", dout),),
                                         cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, n)
    cdef float* d1 = f32_data(dinp1)
    cdef float* d2 = f32_data(dinp2)
    cdef const float* dop = f32_data(dout)
    with nogil:
        residual_backward_core(d1, d2, dop, n, nt, ow1, ow2)


def _residual_forward_naive(floating[::1] out, const floating[::1] inp1, const floating[::1] inp2):
    cdef Py_ssize_t i
    for i in range(out.shape[0]):
        out[i] = inp1[i] + inp2[i]


def _residual_backward_naive(floating[::1] dinp1, floating[::1] dinp2, const floating[::1] dout):
    cdef Py_ssize_t i
    for i in range(dout.shape[0]):
        dinp1[i] += dout[i]
        dinp2[i] += dout[i]


def residual_forward_naive(out, inp1, inp2, *, n_threads=None):
    """Serial twin of residual_forward (float32 or float64)."""
    resolve_threads(n_threads)
    _check_pointwise((("out", out),), (("inp1", inp1), ("inp2", inp2)), float_type(inp1),
                     _RESIDUAL_IN_PLACE)
    _residual_forward_naive(out.reshape(-1), inp1.reshape(-1), inp2.reshape(-1))


def residual_backward_naive(dinp1, dinp2, dout, *, overwrite=False, n_threads=None):
    """Serial twin of residual_backward (float32 or float64)."""
    resolve_threads(n_threads)
    flags = overwrite_flags(overwrite, ("dinp1", "dinp2"))
    _check_pointwise((("dinp1", dinp1), ("dinp2", dinp2)), (("dout", dout),), float_type(dout))
    for arr, flag in zip((dinp1, dinp2), flags):
        if flag:
            arr[...] = 0
    _residual_backward_naive(dinp1.reshape(-1), dinp2.reshape(-1), dout.reshape(-1))
