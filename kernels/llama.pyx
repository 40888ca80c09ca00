"""Llama's own layers as forward/backward kernel pairs: RMSNorm, rotary position
embedding (RoPE) and SwiGLU, plus ``rope_tables`` for RoPE's cosine and sine tables.

- RMSNorm follows Hugging Face's LlamaRMSNorm: ``rrms = 1 / sqrt(mean(x^2) + eps)``
  in float32, ``out = weight * (x * rrms)``; the forward keeps rrms (one float per
  row) for the backward.
- RoPE rotates the first ``n_rot_heads`` heads of each row of a packed (B, T, W)
  array with Hugging Face's rotate-half pairing (dim i with i + head_dim/2) by the
  angles of position t, and copies the other heads: with a GQA layer's packed
  ``[q heads | k heads | v heads]`` row, n_rot_heads = n_q + n_kv rotates q and k and
  carries v.  It saves nothing: the backward is the inverse rotation of the
  gradient.  The forward may run in place (``out`` is ``inp``).
- SwiGLU takes ``gate_up`` packed per row as ``[gate | up]`` (N, 2I), so that one
  matrix product (one weight of 2I rows) gives both and one gives the input's
  gradient back from ``dgate_up``; it saves nothing beyond its input.

Forward kernels overwrite their outputs; backward kernels add into every gradient
unless its ``overwrite`` flag says to write it.  Rows run in sixteen-lane vectors
where the CPU has AVX-512, else in eight (kernels/llama_lanes.h, the builds of
kernels._common's lanes_kind()), split over OpenMP threads by rows; results do not
depend on the thread count.  Every kernel has a serial ``_naive`` twin, which also
takes float64, for the tests and finite-difference checks.
"""
from cython.parallel cimport prange
from libc.math cimport exp, sqrt
from libc.stdlib cimport free, malloc
from libc.string cimport memset

import math

import numpy as np
cimport numpy as cnp
from cython cimport floating

from kernels._common cimport (check_disjoint, check_rows, checked_data, column_sum_blocks,
                              f32_data, float_type, lanes_kind, leading_size, overwrite_flags,
                              reduce_blocks, resolve_threads, serial_if_small, slice_width)

cnp.import_array()

cdef extern from "simd.h":
    pass

cdef extern from *:
    """
    #include <math.h>
    /* The rows (kernels/llama_lanes.h) in eight lanes, as target clones and as an
       explicit x86-64-v3 build, and in sixteen for CPUs with AVX-512; each entry point
       takes the build from its caller (kernels._common's lanes_kind()). */
    #define ADT_W 8
    #include "llama_lanes.h"
    #if ADT_HAVE_V3
    #undef ADT_LANES_SUFFIX
    #define ADT_LANES_SUFFIX _x3
    #include "llama_lanes.h"
    #undef ADT_LANES_SUFFIX
    #define ADT_LANES_SUFFIX
    #endif
    #undef ADT_W
    #if ADT_HAVE_V4
    #define ADT_W 16
    #include "llama_lanes.h"
    #undef ADT_W
    #endif

    static void rms_forward_rows(int kind, float* out, float* rrms, const float* inp,
                                 const float* weight, float eps, ptrdiff_t r0, ptrdiff_t r1,
                                 ptrdiff_t C) {
        ADT_LANES_CALL_X3(kind, rms_forward_rows, (out, rrms, inp, weight, eps, r0, r1, C));
    }
    static void rms_backward_rows(int kind, float* dinp, float* part_w, const float* dout,
                                  const float* inp, const float* weight, const float* rrms,
                                  ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t C, int ow_dinp) {
        ADT_LANES_CALL_X3(kind, rms_backward_rows, (dinp, part_w, dout, inp, weight, rrms, r0,
                                                  r1, C, ow_dinp));
    }
    static void rope_rows(int kind, float* y, const float* x, const float* cos_t,
                          const float* sin_t, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t T,
                          ptrdiff_t W, ptrdiff_t h, ptrdiff_t n_rot, int inverse, int ow) {
        ADT_LANES_CALL_X3(kind, rope_rows, (y, x, cos_t, sin_t, r0, r1, T, W, h, n_rot, inverse,
                                          ow));
    }
    static void swiglu_forward_rows(int kind, float* out, const float* gate_up, ptrdiff_t r0,
                                    ptrdiff_t r1, ptrdiff_t n_up) {
        ADT_LANES_CALL_X3(kind, swiglu_forward_rows, (out, gate_up, r0, r1, n_up));
    }
    static void swiglu_backward_rows(int kind, float* dgate_up, const float* dout,
                                     const float* gate_up, ptrdiff_t r0, ptrdiff_t r1,
                                     ptrdiff_t n_up, int ow) {
        ADT_LANES_CALL_X3(kind, swiglu_backward_rows, (dgate_up, dout, gate_up, r0, r1, n_up, ow));
    }
    """
    void rms_forward_rows(int kind, float* out, float* rrms, const float* inp,
                          const float* weight, float eps, Py_ssize_t r0, Py_ssize_t r1,
                          Py_ssize_t C) nogil
    void rms_backward_rows(int kind, float* dinp, float* part_w, const float* dout,
                           const float* inp, const float* weight, const float* rrms,
                           Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t C, int ow_dinp) nogil
    void rope_rows(int kind, float* y, const float* x, const float* cos_t, const float* sin_t,
                   Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t T, Py_ssize_t W, Py_ssize_t h,
                   Py_ssize_t n_rot, int inverse, int ow) nogil
    void swiglu_forward_rows(int kind, float* out, const float* gate_up, Py_ssize_t r0,
                             Py_ssize_t r1, Py_ssize_t n_up) nogil
    void swiglu_backward_rows(int kind, float* dgate_up, const float* dout, const float* gate_up,
                              Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t n_up, int ow) nogil


cdef enum:
    # Floats of input per parallel task of the row kernels (whole rows, at least one).
    TASK_FLOATS = 16384


cdef inline Py_ssize_t _rows_per_task(Py_ssize_t row_floats) noexcept nogil:
    return max(<Py_ssize_t>1, TASK_FLOATS // max(row_floats, <Py_ssize_t>1))


# ---------------------------------------------------------------------------
# RMSNorm

cdef void rmsnorm_forward_core(float* out, float* rrms, const float* inp, const float* weight,
                               float eps, Py_ssize_t N, Py_ssize_t C,
                               int n_threads) noexcept nogil:
    cdef Py_ssize_t k, per = _rows_per_task(C)
    cdef int kind = lanes_kind()
    for k in prange((N + per - 1) // per, schedule='static', nogil=True, num_threads=n_threads):
        rms_forward_rows(kind, out, rrms, inp, weight, eps, k * per, min(N, (k + 1) * per), C)


cdef int rmsnorm_backward_core(float* dinp, float* dweight, const float* dout,
                               const float* inp, const float* weight, const float* rrms,
                               Py_ssize_t N, Py_ssize_t C, int n_threads, bint ow_dinp,
                               bint ow_dweight) except -1 nogil:
    if N == 0:
        if ow_dweight:
            memset(dweight, 0, C * sizeof(float))
        return 0
    # dweight as a column sum (_common.pxd): each row block sums its rows' terms into
    # its own row of parts, then each thread adds up the blocks of a channel slice.
    cdef Py_ssize_t n_blocks = column_sum_blocks(N)
    cdef float* parts = <float*>malloc(n_blocks * C * sizeof(float))
    if parts == NULL:
        with gil:
            raise MemoryError(f"rmsnorm_backward: cannot allocate {n_blocks * C} floats")
    cdef Py_ssize_t blk, s, c0, c1
    cdef int kind = lanes_kind()
    for blk in prange(n_blocks, schedule='static', nogil=True, num_threads=n_threads):
        rms_backward_rows(kind, dinp, parts + blk * C, dout, inp, weight, rrms,
                          blk * N // n_blocks, (blk + 1) * N // n_blocks, C, ow_dinp)
    cdef Py_ssize_t width = slice_width(C, n_threads)
    for s in prange((C + width - 1) // width, schedule='static', nogil=True,
                    num_threads=n_threads):
        c0 = s * width
        c1 = min(C, c0 + width)
        reduce_blocks(dweight, parts, n_blocks, C, c0, c1, ow_dweight)
    free(parts)
    return 0


cdef float _checked_eps(eps) except? -1:
    if (not isinstance(eps, (int, float, np.integer, np.floating)) or isinstance(eps, bool)
            or not math.isfinite(eps) or eps < 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return <float>eps


cdef tuple _check_rmsnorm_forward(out, rrms, inp, weight, int ft):
    N, C, lead = check_rows("inp", inp, ft, False)
    checked_data("weight", weight, ft, (C,), False)
    checked_data("out", out, ft, inp.shape, True)
    checked_data("rrms", rrms, ft, lead, True)
    check_disjoint((("out", out), ("rrms", rrms)), (("inp", inp), ("weight", weight)))
    return N, C


cdef tuple _check_rmsnorm_backward(dinp, dweight, dout, inp, weight, rrms, int ft):
    N, C, lead = check_rows("inp", inp, ft, False)
    checked_data("weight", weight, ft, (C,), False)
    checked_data("rrms", rrms, ft, lead, False)
    checked_data("dout", dout, ft, inp.shape, False)
    checked_data("dinp", dinp, ft, inp.shape, True)
    checked_data("dweight", dweight, ft, (C,), True)
    check_disjoint((("dinp", dinp), ("dweight", dweight)),
                   (("dout", dout), ("inp", inp), ("weight", weight), ("rrms", rrms)))
    return N, C


def rmsnorm_forward(out, rrms, inp, weight, eps, *, n_threads=None):
    """out = weight * (inp * rrms), rrms = 1 / sqrt(mean(inp^2) + eps) over the last
    axis, in float32 as Hugging Face's LlamaRMSNorm.  inp/out (B,T,C) or (N,C), weight
    (C,); rrms (B,T) or (N,) is written for backward.  eps: a finite number >= 0."""
    cdef int nt = resolve_threads(n_threads)
    cdef float e = _checked_eps(eps)
    N, C = _check_rmsnorm_forward(out, rrms, inp, weight, cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, N * C)
    cdef float* o = f32_data(out)
    cdef float* rp = f32_data(rrms)
    cdef const float* ip = f32_data(inp)
    cdef const float* wp = f32_data(weight)
    cdef Py_ssize_t n = N, c = C
    with nogil:
        rmsnorm_forward_core(o, rp, ip, wp, e, n, c, nt)


def rmsnorm_backward(dinp, dweight, dout, inp, weight, rrms, *, overwrite=False, n_threads=None):
    """Adds RMSNorm's gradients into dinp and dweight (``overwrite``, a bool or one per
    output: that output is set instead).  rrms is the forward's."""
    cdef int nt = resolve_threads(n_threads)
    cdef bint ow_i, ow_w
    ow_i, ow_w = overwrite_flags(overwrite, ("dinp", "dweight"))
    N, C = _check_rmsnorm_backward(dinp, dweight, dout, inp, weight, rrms, cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, N * C)
    cdef float* dip = f32_data(dinp)
    cdef float* dwp = f32_data(dweight)
    cdef const float* dop = f32_data(dout)
    cdef const float* ip = f32_data(inp)
    cdef const float* wp = f32_data(weight)
    cdef const float* rp = f32_data(rrms)
    cdef Py_ssize_t n = N, c = C
    with nogil:
        rmsnorm_backward_core(dip, dwp, dop, ip, wp, rp, n, c, nt, ow_i, ow_w)


def _rmsnorm_forward_naive(floating[:, ::1] out, floating[::1] rrms, const floating[:, ::1] inp,
                           const floating[::1] weight, floating eps):
    cdef Py_ssize_t r, i, C = inp.shape[1]
    cdef floating ss
    for r in range(inp.shape[0]):
        ss = 0
        for i in range(C):
            ss += inp[r, i] * inp[r, i]
        rrms[r] = 1 / sqrt(ss / C + eps)
        for i in range(C):
            out[r, i] = weight[i] * (inp[r, i] * rrms[r])


def _rmsnorm_backward_naive(floating[:, ::1] dinp, floating[::1] dweight,
                            const floating[:, ::1] dout, const floating[:, ::1] inp,
                            const floating[::1] weight, const floating[::1] rrms):
    cdef Py_ssize_t r, i, C = inp.shape[1]
    cdef floating norm, mean_gn
    for r in range(inp.shape[0]):
        mean_gn = 0
        for i in range(C):
            mean_gn += weight[i] * dout[r, i] * inp[r, i] * rrms[r]
        mean_gn = mean_gn / C
        for i in range(C):
            norm = inp[r, i] * rrms[r]
            dweight[i] += norm * dout[r, i]
            dinp[r, i] += (weight[i] * dout[r, i] - norm * mean_gn) * rrms[r]


def rmsnorm_forward_naive(out, rrms, inp, weight, eps, *, n_threads=None):
    """Serial twin of rmsnorm_forward (float32 or float64)."""
    resolve_threads(n_threads)
    _checked_eps(eps)
    N, C = _check_rmsnorm_forward(out, rrms, inp, weight, float_type(inp))
    _rmsnorm_forward_naive(out.reshape(N, C), rrms.reshape(N), inp.reshape(N, C), weight,
                           float(eps))


def rmsnorm_backward_naive(dinp, dweight, dout, inp, weight, rrms, *, overwrite=False,
                           n_threads=None):
    """Serial twin of rmsnorm_backward (float32 or float64)."""
    resolve_threads(n_threads)
    flags = overwrite_flags(overwrite, ("dinp", "dweight"))
    N, C = _check_rmsnorm_backward(dinp, dweight, dout, inp, weight, rrms, float_type(inp))
    for arr, flag in zip((dinp, dweight), flags):
        if flag:
            arr[...] = 0
    _rmsnorm_backward_naive(dinp.reshape(N, C), dweight, dout.reshape(N, C), inp.reshape(N, C),
                            weight, rrms.reshape(N))


# ---------------------------------------------------------------------------
# Rotary position embedding

cdef void rope_forward_core(float* out, const float* inp, const float* cos, const float* sin,
                            Py_ssize_t B, Py_ssize_t T, Py_ssize_t W, Py_ssize_t h,
                            Py_ssize_t n_rot_heads, int n_threads) noexcept nogil:
    cdef Py_ssize_t k, N = B * T, per = _rows_per_task(W)
    cdef int kind = lanes_kind()
    for k in prange((N + per - 1) // per, schedule='static', nogil=True, num_threads=n_threads):
        rope_rows(kind, out, inp, cos, sin, k * per, min(N, (k + 1) * per), T, W, h,
                  n_rot_heads, 0, 1)


cdef void rope_backward_core(float* dinp, const float* dout, const float* cos, const float* sin,
                             Py_ssize_t B, Py_ssize_t T, Py_ssize_t W, Py_ssize_t h,
                             Py_ssize_t n_rot_heads, int n_threads, bint ow) noexcept nogil:
    cdef Py_ssize_t k, N = B * T, per = _rows_per_task(W)
    cdef int kind = lanes_kind()
    for k in prange((N + per - 1) // per, schedule='static', nogil=True, num_threads=n_threads):
        rope_rows(kind, dinp, dout, cos, sin, k * per, min(N, (k + 1) * per), T, W, h,
                  n_rot_heads, 1, ow)


cdef tuple _check_rope(str out_name, out, str inp_name, inp, cos, sin, n_rot_heads, int ft):
    # -> (B, T, W, h, n_rot_heads, in place); out may be inp itself
    checked_data(inp_name, inp, ft, None, False)
    if inp.ndim != 3:
        raise ValueError(f"{inp_name} must have shape (B, T, W), got {inp.shape}")
    B, T, W = inp.shape
    checked_data("cos", cos, ft, None, False)
    if cos.ndim != 2 or cos.shape[0] < T or cos.shape[1] < 1:
        raise ValueError(f"cos must have shape (maxT, head_dim/2) with maxT >= T={T} and "
                         f"head_dim/2 >= 1, got {cos.shape}")
    checked_data("sin", sin, ft, cos.shape, False)
    h = cos.shape[1]
    if W % (2 * h):
        raise ValueError(f"{inp_name}'s last axis W={W} must be a multiple of head_dim = "
                         f"2 * cos.shape[1] = {2 * h}")
    n_heads = W // (2 * h)
    if (not isinstance(n_rot_heads, (int, np.integer)) or isinstance(n_rot_heads, bool)
            or not 0 <= n_rot_heads <= n_heads):
        raise ValueError(f"n_rot_heads must be an integer in [0, {n_heads}] (the heads of "
                         f"{inp_name}), got {n_rot_heads!r}")
    checked_data(out_name, out, ft, inp.shape, True)
    check_disjoint(((out_name, out),), ((inp_name, inp), ("cos", cos), ("sin", sin)),
                   ((out_name, inp_name),))
    in_place = cnp.PyArray_DATA(<cnp.ndarray>out) == cnp.PyArray_DATA(<cnp.ndarray>inp)
    return B, T, W, h, int(n_rot_heads), in_place


def rope_forward(out, inp, cos, sin, n_rot_heads, *, n_threads=None):
    """Rotary position embedding of a packed (B, T, W) array, Hugging Face's rotate-half
    convention: in each of the first ``n_rot_heads`` heads of a row at position t (head
    size head_dim = 2h, h = cos.shape[1], W a multiple of it),
    out[i] = x[i] cos[t, i] - x[i+h] sin[t, i] and out[i+h] = x[i+h] cos[t, i] +
    x[i] sin[t, i] for i < h; the other heads are copied.  cos, sin (maxT, h) with
    maxT >= T, from ``rope_tables``.  ``out`` may be ``inp`` itself (in place), but
    may not overlap it otherwise."""
    cdef int nt = resolve_threads(n_threads)
    B, T, W, h, n_rot, _ = _check_rope("out", out, "inp", inp, cos, sin, n_rot_heads,
                                       cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, B * T * W)
    cdef float* o = f32_data(out)
    cdef const float* ip = f32_data(inp)
    cdef const float* cp = f32_data(cos)
    cdef const float* sp = f32_data(sin)
    cdef Py_ssize_t b = B, t = T, w = W, hh = h, nr = n_rot
    with nogil:
        rope_forward_core(o, ip, cp, sp, b, t, w, hh, nr, nt)


def rope_backward(dinp, dout, cos, sin, n_rot_heads, *, overwrite=False, n_threads=None):
    """dinp += the gradient of rope_forward: dout rotated back (by minus the angles) in
    the first ``n_rot_heads`` heads, passed through in the others.  With ``overwrite``,
    or with dinp being dout (the gradient is then rotated in place), dinp is set
    instead of added into."""
    cdef int nt = resolve_threads(n_threads)
    cdef bint ow
    ow, = overwrite_flags(overwrite, ("dinp",))
    B, T, W, h, n_rot, in_place = _check_rope("dinp", dinp, "dout", dout, cos, sin, n_rot_heads,
                                              cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, B * T * W)
    ow = ow or in_place
    cdef float* dp = f32_data(dinp)
    cdef const float* dop = f32_data(dout)
    cdef const float* cp = f32_data(cos)
    cdef const float* sp = f32_data(sin)
    cdef Py_ssize_t b = B, t = T, w = W, hh = h, nr = n_rot
    with nogil:
        rope_backward_core(dp, dop, cp, sp, b, t, w, hh, nr, nt, ow)


def _rope_naive(floating[:, :, ::1] out, const floating[:, :, ::1] inp,
                const floating[:, ::1] cos, const floating[:, ::1] sin, Py_ssize_t n_rot,
                floating sign, bint ow):
    # sign -1: the inverse rotation.  Both halves of a pair are read before either is
    # written, so out may be inp.
    cdef Py_ssize_t b, t, head, i, j, h = cos.shape[1]
    cdef floating x1, x2, y1, y2, sn
    for b in range(inp.shape[0]):
        for t in range(inp.shape[1]):
            for head in range(n_rot):
                for i in range(h):
                    j = head * 2 * h + i
                    x1 = inp[b, t, j]
                    x2 = inp[b, t, j + h]
                    sn = sign * sin[t, i]
                    y1 = x1 * cos[t, i] - x2 * sn
                    y2 = x2 * cos[t, i] + x1 * sn
                    out[b, t, j] = y1 if ow else out[b, t, j] + y1
                    out[b, t, j + h] = y2 if ow else out[b, t, j + h] + y2
            for j in range(n_rot * 2 * h, inp.shape[2]):
                out[b, t, j] = inp[b, t, j] if ow else out[b, t, j] + inp[b, t, j]


def rope_forward_naive(out, inp, cos, sin, n_rot_heads, *, n_threads=None):
    """Serial twin of rope_forward (float32 or float64)."""
    resolve_threads(n_threads)
    _, _, _, _, n_rot, _ = _check_rope("out", out, "inp", inp, cos, sin, n_rot_heads,
                                       float_type(inp))
    _rope_naive(out, inp, cos, sin, n_rot, 1.0, True)


def rope_backward_naive(dinp, dout, cos, sin, n_rot_heads, *, overwrite=False, n_threads=None):
    """Serial twin of rope_backward (float32 or float64)."""
    resolve_threads(n_threads)
    ow, = overwrite_flags(overwrite, ("dinp",))
    _, _, _, _, n_rot, in_place = _check_rope("dinp", dinp, "dout", dout, cos, sin, n_rot_heads,
                                              float_type(dout))
    _rope_naive(dinp, dout, cos, sin, n_rot, -1.0, ow or in_place)


def rope_tables(head_dim, max_positions, theta=10000.0, scaling=None):
    """(cos, sin), each float32 (max_positions, head_dim // 2): row t holds the cosines and
    sines of t * inv_freq, the tables rope_forward takes.

    Computed as Hugging Face transformers does (modeling_rope_utils.py), each step
    rounded to float32: inv_freq = 1 / theta ** (arange(0, head_dim, 2) / head_dim) (the
    power taken in float64 and rounded: transformers' inverse frequencies to the bit),
    the angles t * inv_freq, their cosine and sine (correctly rounded from float64,
    within an ulp of PyTorch's float32 ones).  ``scaling`` None (or ``{"rope_type": "default"}``) leaves
    inv_freq as it is; ``{"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}`` (a Llama 3.1+ config's
    ``rope_scaling``) applies Llama 3's scaling: wavelengths longer than
    original / low_freq_factor are stretched by ``factor``, those shorter than
    original / high_freq_factor kept, and those between interpolated smoothly."""
    if (not isinstance(head_dim, (int, np.integer)) or isinstance(head_dim, bool)
            or head_dim < 2 or head_dim % 2):
        raise ValueError(f"head_dim must be an even integer >= 2, got {head_dim!r}")
    if (not isinstance(max_positions, (int, np.integer)) or isinstance(max_positions, bool)
            or max_positions < 0):
        raise ValueError(f"max_positions must be an integer >= 0, got {max_positions!r}")
    if (not isinstance(theta, (int, float, np.integer, np.floating)) or isinstance(theta, bool)
            or not math.isfinite(theta) or theta <= 0):
        raise ValueError(f"theta must be a finite number > 0, got {theta!r}")
    f32 = np.float32
    exponents = np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)
    inv_freq = f32(1) / np.power(float(f32(theta)), exponents.astype(np.float64)).astype(f32)
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"scaling must be None or a dict, got {type(scaling).__name__}")
    # older configs name the type "type" (transformers reads either)
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif rope_type != "default":
        raise ValueError(f"scaling: rope_type must be 'default' or 'llama3', got {rope_type!r}")
    angles = np.arange(max_positions, dtype=f32)[:, None] * inv_freq[None, :]
    angles = angles.astype(np.float64)
    return np.cos(angles).astype(f32), np.sin(angles).astype(f32)


def _llama3_inv_freq(inv_freq, scaling):
    # transformers' _compute_llama3_parameters, operation by operation in float32 (a
    # Python number divided by a tensor is its reciprocal times the number there).
    values = {}
    for key in ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"):
        value = scaling.get(key)
        if (not isinstance(value, (int, float, np.integer, np.floating))
                or isinstance(value, bool) or not math.isfinite(value) or value <= 0):
            raise ValueError(f"scaling[{key!r}] must be a finite number > 0 for rope_type "
                             f"'llama3', got {value!r}")
        values[key] = value
    factor, low, high = values["factor"], values["low_freq_factor"], values["high_freq_factor"]
    old_context = values["original_max_position_embeddings"]
    if high <= low:
        raise ValueError(f"scaling: high_freq_factor ({high!r}) must exceed low_freq_factor "
                         f"({low!r})")
    f32 = np.float32
    low_freq_wavelen = f32(old_context / low)
    high_freq_wavelen = f32(old_context / high)
    wavelen = (f32(1) / inv_freq) * f32(2 * math.pi)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / f32(factor), inv_freq)
    smooth = ((f32(1) / wavelen) * f32(old_context) - f32(low)) / f32(high - low)
    smoothed = (f32(1) - smooth) * scaled / f32(factor) + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(f32)


# ---------------------------------------------------------------------------
# SwiGLU

cdef void swiglu_forward_core(float* out, const float* gate_up, Py_ssize_t N, Py_ssize_t I,
                              int n_threads) noexcept nogil:
    cdef Py_ssize_t k, per = _rows_per_task(2 * I)
    cdef int kind = lanes_kind()
    for k in prange((N + per - 1) // per, schedule='static', nogil=True, num_threads=n_threads):
        swiglu_forward_rows(kind, out, gate_up, k * per, min(N, (k + 1) * per), I)


cdef void swiglu_backward_core(float* dgate_up, const float* dout, const float* gate_up,
                               Py_ssize_t N, Py_ssize_t I, int n_threads,
                               bint ow) noexcept nogil:
    cdef Py_ssize_t k, per = _rows_per_task(2 * I)
    cdef int kind = lanes_kind()
    for k in prange((N + per - 1) // per, schedule='static', nogil=True, num_threads=n_threads):
        swiglu_backward_rows(kind, dgate_up, dout, gate_up, k * per, min(N, (k + 1) * per), I,
                             ow)


cdef tuple _check_gate_up(gate_up, int ft):
    # -> (N, I, shape of out)
    checked_data("gate_up", gate_up, ft, None, False)
    if gate_up.ndim not in (2, 3) or gate_up.shape[gate_up.ndim - 1] % 2:
        raise ValueError(f"gate_up must have shape (B, T, 2I) or (N, 2I) ([gate | up] in each "
                         f"row), got {gate_up.shape}")
    lead = gate_up.shape[:gate_up.ndim - 1]
    I = gate_up.shape[gate_up.ndim - 1] // 2
    return leading_size(gate_up), I, lead + (I,)


def swiglu_forward(out, gate_up, *, n_threads=None):
    """out = silu(gate) * up, silu(x) = x * sigmoid(x), with gate_up (B,T,2I) or (N,2I)
    holding [gate | up] in each row and out (B,T,I) or (N,I)."""
    cdef int nt = resolve_threads(n_threads)
    N, I, out_shape = _check_gate_up(gate_up, cnp.NPY_FLOAT32)
    checked_data("out", out, cnp.NPY_FLOAT32, out_shape, True)
    check_disjoint((("out", out),), (("gate_up", gate_up),))
    nt = serial_if_small(nt, n_threads, N * 2 * I)
    cdef float* o = f32_data(out)
    cdef const float* gp = f32_data(gate_up)
    cdef Py_ssize_t n = N, i = I
    with nogil:
        swiglu_forward_core(o, gp, n, i, nt)


cdef tuple _check_swiglu_backward(dgate_up, dout, gate_up, int ft):
    N, I, out_shape = _check_gate_up(gate_up, ft)
    checked_data("dout", dout, ft, out_shape, False)
    checked_data("dgate_up", dgate_up, ft, gate_up.shape, True)
    check_disjoint((("dgate_up", dgate_up),), (("dout", dout), ("gate_up", gate_up)))
    return N, I


def swiglu_backward(dgate_up, dout, gate_up, *, overwrite=False, n_threads=None):
    """dgate_up += [dout * up * silu'(gate) | dout * silu(gate)] (``overwrite``: set)."""
    cdef int nt = resolve_threads(n_threads)
    cdef bint ow
    ow, = overwrite_flags(overwrite, ("dgate_up",))
    N, I = _check_swiglu_backward(dgate_up, dout, gate_up, cnp.NPY_FLOAT32)
    nt = serial_if_small(nt, n_threads, N * 2 * I)
    cdef float* dp = f32_data(dgate_up)
    cdef const float* dop = f32_data(dout)
    cdef const float* gp = f32_data(gate_up)
    cdef Py_ssize_t n = N, i = I
    with nogil:
        swiglu_backward_core(dp, dop, gp, n, i, nt, ow)


def _swiglu_forward_naive(floating[:, ::1] out, const floating[:, ::1] gate_up):
    cdef Py_ssize_t r, j, I = out.shape[1]
    cdef floating g
    for r in range(out.shape[0]):
        for j in range(I):
            g = gate_up[r, j]
            out[r, j] = g / (1 + exp(-g)) * gate_up[r, I + j]


def _swiglu_backward_naive(floating[:, ::1] dgate_up, const floating[:, ::1] dout,
                           const floating[:, ::1] gate_up):
    cdef Py_ssize_t r, j, I = dout.shape[1]
    cdef floating g, s
    for r in range(dout.shape[0]):
        for j in range(I):
            g = gate_up[r, j]
            s = 1 / (1 + exp(-g))
            dgate_up[r, j] += dout[r, j] * gate_up[r, I + j] * s * (1 + g * (1 - s))
            dgate_up[r, I + j] += dout[r, j] * g * s


def swiglu_forward_naive(out, gate_up, *, n_threads=None):
    """Serial twin of swiglu_forward, written with exp (float32 or float64)."""
    resolve_threads(n_threads)
    ft = float_type(gate_up)
    N, I, out_shape = _check_gate_up(gate_up, ft)
    checked_data("out", out, ft, out_shape, True)
    check_disjoint((("out", out),), (("gate_up", gate_up),))
    _swiglu_forward_naive(out.reshape(N, I), gate_up.reshape(N, 2 * I))


def swiglu_backward_naive(dgate_up, dout, gate_up, *, overwrite=False, n_threads=None):
    """Serial twin of swiglu_backward, written with exp (float32 or float64)."""
    resolve_threads(n_threads)
    ow, = overwrite_flags(overwrite, ("dgate_up",))
    N, I = _check_swiglu_backward(dgate_up, dout, gate_up, float_type(gate_up))
    if ow:
        dgate_up[...] = 0
    _swiglu_backward_naive(dgate_up.reshape(N, 2 * I), dout.reshape(N, I),
                           gate_up.reshape(N, 2 * I))
