"""AdamW and gradient-norm kernels over flat float32 buffers.

adamw_step follows torch.optim.AdamW (its default single-tensor implementation)
operation by operation in float32, with the bias corrections computed in float64 as
PyTorch's Python code does.  grad_norm accumulates in float64 over fixed blocks, so
its result does not depend on the thread count.  Each kernel has a serial ``_naive``
twin with the same signature.
"""
from cython.parallel cimport prange
from libc.math cimport sqrt, sqrtf, pow, isfinite
from libc.stdint cimport uint16_t
from libc.stdlib cimport malloc, free

import numpy as np
cimport numpy as cnp

from kernels._common cimport (check_disjoint, checked_data, resolve_threads, serial_if_small,
                              zero_core)

cnp.import_array()

cdef enum:
    # Elements per parallel work item (64 KiB of float32).
    CHUNK = 16384


cdef inline Py_ssize_t _span(Py_ssize_t k, Py_ssize_t n) noexcept nogil:
    return min(<Py_ssize_t>CHUNK, n - k * CHUNK)


cdef extern from "simd.h":
    pass

cdef extern from "bf16_bits.h":
    pass

cdef extern from "<emmintrin.h>":
    pass

cdef extern from *:
    """
    /* One AdamW span, compiled for AVX2+FMA and for the baseline (target_clones);
       the build's -fno-math-errno lets sqrtf become one vector instruction (the
       correctly rounded square root either way).  With
       zero_grads the gradient is cleared in the same pass, which saves the
       separate zeroing pass over the gradient arena before the next backward; with
       out16 (not NULL) each updated parameter's bf16 rounding is written there too
       (the bf16 products' copy of the weights, without another pass over them). */
    ADT_MULTIVERSION
    static void adamw_span(float* restrict p, float* restrict g, float* restrict m,
                           float* restrict v, ptrdiff_t n, float decay, float w1, float beta2,
                           float w2, float neg_step_size, float bc2_sqrt, float eps,
                           float gscale, int zero_grads, uint16_t* restrict out16) {
        /* blocks of 16 floats, each fetching its four arrays ADT_AHEAD floats ahead
           (kernels/simd.h): 71.6 -> 65.7 ms over GPT-2's 124M parameters */
        uint16_t b16[16] __attribute__((aligned(16)));
        for (ptrdiff_t i0 = 0; i0 < n; i0 += 16) {
            ptrdiff_t i1 = n - i0 < 16 ? n : i0 + 16;
            ADT_PREFETCH_W(p + i0);
            ADT_PREFETCH_R(g + i0);
            ADT_PREFETCH_W(m + i0);
            ADT_PREFETCH_W(v + i0);
            for (ptrdiff_t i = i0; i < i1; i++) {
                float gi = g[i] * gscale;   /* exact when gscale is 1 */
                float pi = p[i] * decay;
                float mi = m[i] + w1 * (gi - m[i]);
                float vi = v[i] * beta2 + w2 * gi * gi;
                float pn = pi + neg_step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
                m[i] = mi;
                v[i] = vi;
                p[i] = pn;
                if (zero_grads) g[i] = 0.0f;
                if (out16 != NULL) b16[i - i0] = bf16_from_bits(bf16_f32_bits(pn));
            }
            if (out16 != NULL) {
                /* the copies are read in the next forward pass, long after: whole
                   16-byte runs stored past the caches (no read of the old lines) */
                if (i1 - i0 == 16 && ((uintptr_t)(out16 + i0) & 15) == 0) {
                    _mm_stream_si128((__m128i*)(out16 + i0), _mm_load_si128((const __m128i*)b16));
                    _mm_stream_si128((__m128i*)(out16 + i0 + 8),
                                     _mm_load_si128((const __m128i*)(b16 + 8)));
                } else {
                    memcpy(out16 + i0, b16, (size_t)(i1 - i0) * sizeof *b16);
                }
            }
        }
        if (out16 != NULL) _mm_sfence();
    }
    """
    void adamw_span(float* p, float* g, float* m, float* v, Py_ssize_t n, float decay,
                    float w1, float beta2, float w2, float neg_step_size, float bc2_sqrt,
                    float eps, float gscale, int zero_grads, uint16_t* out16) nogil


cdef extern from *:
    """
    /* Sums of squares of blocks in float64: sixteen lanes of partial sums per block
       (four vectors of four doubles), each float widened and squared into its lane,
       then a halving sum of the lanes.  Blocks go in pairs read side by side: one
       core reading two streams keeps more misses in flight than reading one (GPT-2's
       124M gradients, two threads, Zen 3 VM: 25.1-27.9 -> 28.7-30.7 GB/s, without
       software fetches, which the hardware's stream prefetchers make redundant
       here).  A block's sum is the same, bit for bit, alone or paired.  Compiled for
       AVX2+FMA and the baseline: the baseline build alone (two doubles per
       instruction, no FMA) read 10 GB/s on one core of the Zen 3 VM. */
    typedef double adt_v4d __attribute__((vector_size(32)));
    typedef float adt_v4f __attribute__((vector_size(16), aligned(4)));
    #define SS_ADD(acc, x, i) do { \
        for (int j_ = 0; j_ < 4; j_++) { \
            adt_v4d d_ = __builtin_convertvector(*(const adt_v4f*)((x) + (i) + 4 * j_), adt_v4d); \
            (acc)[j_] += d_ * d_; \
        } \
    } while (0)
    /* acc's block from element i on, its tail and its lanes summed */
    ADT_INLINE double ss_finish(adt_v4d* acc, const float* x, ptrdiff_t i, ptrdiff_t n) {
        for (; i + 16 <= n; i += 16) SS_ADD(acc, x, i);
        double lanes[16];
        memcpy(lanes, acc, sizeof lanes);
        for (ptrdiff_t j = 0; i + j < n; j++) {
            double xj = x[i + j];
            lanes[j] += xj * xj;
        }
        for (int h = 8; h >= 1; h /= 2)
            for (int j = 0; j < h; j++) lanes[j] += lanes[j + h];
        return lanes[0];
    }
    /* The sums of squares of x[0:nx] into sx and, where y, of y[0:ny] into sy. */
    ADT_MULTIVERSION
    static void sum_squares_spans(const float* x, ptrdiff_t nx, const float* y, ptrdiff_t ny,
                                  double* sx, double* sy) {
        adt_v4d a[4] = {{0}}, b[4] = {{0}};
        ptrdiff_t i = 0;
        if (y)
            for (; i + 16 <= nx && i + 16 <= ny; i += 16) {
                SS_ADD(a, x, i);
                SS_ADD(b, y, i);
            }
        *sx = ss_finish(a, x, i, nx);
        if (y) *sy = ss_finish(b, y, i, ny);
    }
    #undef SS_ADD
    """
    void sum_squares_spans(const float* x, Py_ssize_t nx, const float* y, Py_ssize_t ny,
                           double* sx, double* sy) nogil


cdef void adamw_core(float* params, float* grads, float* m, float* v, Py_ssize_t n,
                     int step, double lr, double beta1, double beta2, double eps,
                     double weight_decay, float grad_scale, bint zero_grads,
                     int n_threads, uint16_t* out16=NULL) noexcept nogil:
    # The same float32 operations as torch: p *= 1 - lr*wd; m.lerp_(g, 1 - beta1);
    # v = v*beta2 + (1 - beta2)*g*g; p += -lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps).
    cdef float decay = <float>(1.0 - lr * weight_decay)
    cdef float w1 = <float>(1.0 - beta1)
    cdef float w2 = <float>(1.0 - beta2)
    cdef float neg_step_size = <float>(-lr / (1.0 - pow(beta1, step)))
    cdef float bc2_sqrt = <float>sqrt(1.0 - pow(beta2, step))
    cdef Py_ssize_t k
    for k in prange((n + CHUNK - 1) // CHUNK, schedule='static', nogil=True, num_threads=n_threads):
        adamw_span(params + k * CHUNK, grads + k * CHUNK, m + k * CHUNK, v + k * CHUNK,
                   _span(k, n), decay, w1, <float>beta2, w2, neg_step_size, bc2_sqrt,
                   <float>eps, grad_scale, zero_grads,
                   NULL if out16 == NULL else out16 + k * CHUNK)


cdef void _scale_span(float* buf, float factor, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        buf[i] = buf[i] * factor


cdef void scale_core(float* buf, float factor, Py_ssize_t n, int n_threads) noexcept nogil:
    cdef Py_ssize_t k
    for k in prange((n + CHUNK - 1) // CHUNK, schedule='static', nogil=True, num_threads=n_threads):
        _scale_span(buf + k * CHUNK, factor, _span(k, n))


cdef double sum_squares_core(const float* buf, Py_ssize_t n, int n_threads) except? -1 nogil:
    cdef Py_ssize_t n_blocks = (n + CHUNK - 1) // CHUNK, k
    cdef double total = 0
    if n_blocks == 0:
        return 0
    cdef double* partial = <double*>malloc(n_blocks * sizeof(double))
    if partial == NULL:
        with gil:
            raise MemoryError(f"grad_norm: cannot allocate {n_blocks} partial sums")
    # blocks k and k + half side by side (and the last alone when n_blocks is odd)
    cdef Py_ssize_t half = n_blocks // 2
    for k in prange(half + n_blocks % 2, schedule='static', nogil=True, num_threads=n_threads):
        if k < half:
            sum_squares_spans(buf + k * CHUNK, CHUNK, buf + (k + half) * CHUNK,
                              _span(k + half, n), partial + k, partial + k + half)
        else:
            sum_squares_spans(buf + (n_blocks - 1) * CHUNK, _span(n_blocks - 1, n), NULL, 0,
                              partial + n_blocks - 1, NULL)
    for k in range(n_blocks):
        total = total + partial[k]
    free(partial)
    return total


cdef Py_ssize_t _check_flat(str name, arr, bint writable) except -1:
    checked_data(name, arr, cnp.NPY_FLOAT32, None, writable)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a flat (1-D) array, got shape {arr.shape}")
    return arr.shape[0]


cdef _check_adamw(params, grads, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale):
    n = _check_flat("params", params, True)
    checked_data("grads", grads, cnp.NPY_FLOAT32, (n,), False)
    checked_data("m", m, cnp.NPY_FLOAT32, (n,), True)
    checked_data("v", v, cnp.NPY_FLOAT32, (n,), True)
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or not 1 <= step < 2**31:
        raise ValueError(f"step must be an integer >= 1 (it counts updates, for bias correction), "
                         f"got {step!r}")
    for name, value, low, high in (("lr", lr, 0.0, np.inf), ("beta1", beta1, 0.0, 1.0),
                                   ("beta2", beta2, 0.0, 1.0), ("eps", eps, 0.0, np.inf),
                                   ("weight_decay", weight_decay, 0.0, np.inf)):
        if not (low <= float(value) and (float(value) < high or high == np.inf)) or not isfinite(value):
            raise ValueError(f"{name} must be finite and in [{low}, {high}), got {value!r}")
    if not isfinite(grad_scale) or grad_scale < 0:
        raise ValueError(f"grad_scale must be finite and >= 0, got {grad_scale!r}")
    # all four are read and three written (grads too, with zero_grads)
    check_disjoint((("params", params), ("m", m), ("v", v)), (("grads", grads),))
    return n


def adamw_step(params, grads, m, v, step, lr, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=0.0, *, grad_scale=1.0, bint zero_grads=False, out_bf16=None,
               n_threads=None):
    """One AdamW update in place of params, m (first moment) and v (second moment).
    All four are flat float32 arrays of equal length; step >= 1 is this update's number.
    ``grad_scale`` multiplies each gradient as it is read (in float32, as scaling
    grads in place first would): clipping by global norm without a pass that
    rewrites the gradients (``clip_coefficient``).  ``zero_grads=True`` also sets
    grads to zero in the same pass (grads must then be writable), ready for the next
    backward to accumulate into.  ``out_bf16`` (a flat uint16 array of the same length,
    or None): the updated parameters rounded to bf16 are written there in the same pass
    (``kernels.bf16.to_bf16``'s bits), the bf16 products' copy of the weights."""
    cdef int nt = resolve_threads(n_threads)
    cdef Py_ssize_t n = _check_adamw(params, grads, m, v, step, lr, beta1, beta2, eps,
                                     weight_decay, grad_scale)
    cdef float gs = grad_scale
    cdef uint16_t* op = NULL
    if zero_grads:
        checked_data("grads", grads, cnp.NPY_FLOAT32, (n,), True)
    if out_bf16 is not None:
        op = <uint16_t*>checked_data("out_bf16", out_bf16, cnp.NPY_UINT16, (n,), True)
        check_disjoint((("out_bf16", out_bf16),), (("params", params), ("grads", grads),
                                                   ("m", m), ("v", v)))
    nt = serial_if_small(nt, n_threads, n)
    cdef float* pp = <float*>cnp.PyArray_DATA(<cnp.ndarray>params)
    cdef float* gp = <float*>cnp.PyArray_DATA(<cnp.ndarray>grads)
    cdef float* mp = <float*>cnp.PyArray_DATA(<cnp.ndarray>m)
    cdef float* vp = <float*>cnp.PyArray_DATA(<cnp.ndarray>v)
    cdef int s = step
    cdef double lr_ = lr, b1 = beta1, b2 = beta2, eps_ = eps, wd = weight_decay
    with nogil:
        adamw_core(pp, gp, mp, vp, n, s, lr_, b1, b2, eps_, wd, gs, zero_grads, nt, op)


def zero_grad(grads, *, n_threads=None):
    """grads[...] = 0 for a C-contiguous float32 array of any shape."""
    cdef int nt = resolve_threads(n_threads)
    cdef float* gp = <float*>checked_data("grads", grads, cnp.NPY_FLOAT32, None, True)
    cdef Py_ssize_t n = grads.size
    nt = serial_if_small(nt, n_threads, n)
    with nogil:
        zero_core(gp, n, nt)


def grad_norm(grads, *, n_threads=None):
    """Global L2 norm of a flat float32 array, accumulated in float64."""
    cdef int nt = resolve_threads(n_threads)
    cdef Py_ssize_t n = _check_flat("grads", grads, False)
    nt = serial_if_small(nt, n_threads, n)
    cdef const float* gp = <float*>cnp.PyArray_DATA(<cnp.ndarray>grads)
    cdef double total
    with nogil:
        total = sum_squares_core(gp, n, nt)
    return sqrt(total)


def sum_squares_blocks(x, *, n_threads=None):
    """The float64 sums of squares of ``x``'s consecutive blocks of ``norm_block()`` floats
    (the last may be shorter): the partial sums ``grad_norm`` adds, in order, for an
    array whose blocks these are.  So a gradient held in pieces (each starting on a
    block boundary of the whole) has the whole's norm to the bit: ``sqrt`` of the
    partials added one by one in block order."""
    cdef int nt = resolve_threads(n_threads)
    cdef Py_ssize_t n = _check_flat("x", x, False)
    cdef Py_ssize_t n_blocks = (n + CHUNK - 1) // CHUNK, k
    out = np.empty(n_blocks, np.float64)
    cdef double[::1] o = out
    cdef const float* xp = <float*>cnp.PyArray_DATA(<cnp.ndarray>x)
    nt = serial_if_small(nt, n_threads, n)
    if n_blocks:
        with nogil:
            for k in prange(n_blocks, schedule='static', num_threads=nt):
                sum_squares_spans(xp + k * CHUNK, _span(k, n), NULL, 0, &o[k], NULL)
    return out


def norm_block():
    """Floats per block of ``grad_norm``'s partial sums (``sum_squares_blocks``)."""
    return CHUNK


cdef _check_max_norm(max_norm):
    if not isfinite(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm must be finite and >= 0, got {max_norm!r}")


def clip_coefficient(norm, max_norm):
    """The factor clip_grad_norm scales by for a gradient of global norm ``norm``:
    max_norm / (norm + 1e-6) where that is below 1, else 1 (torch's rule)."""
    _check_max_norm(max_norm)
    coef = max_norm / (norm + 1e-6)
    return coef if coef < 1.0 else 1.0


def clip_grad_norm(grads, max_norm, *, n_threads=None):
    """Scale grads in place so their global L2 norm is at most max_norm, as
    torch.nn.utils.clip_grad_norm_ does (factor max_norm / (norm + 1e-6), applied when
    below 1).  Returns the norm before clipping."""
    cdef int nt = resolve_threads(n_threads)
    cdef Py_ssize_t n = _check_flat("grads", grads, True)
    nt = serial_if_small(nt, n_threads, n)
    _check_max_norm(max_norm)
    cdef float* gp = <float*>cnp.PyArray_DATA(<cnp.ndarray>grads)
    cdef double norm
    with nogil:
        norm = sqrt(sum_squares_core(gp, n, nt))
    cdef double coef = clip_coefficient(norm, max_norm)
    if coef < 1.0:
        with nogil:
            scale_core(gp, <float>coef, n, nt)
    return norm


def adamw_step_naive(params, grads, m, v, step, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.0, *, grad_scale=1.0, zero_grads=False, n_threads=None):
    """Serial twin of adamw_step."""
    resolve_threads(n_threads)
    _check_adamw(params, grads, m, v, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
    cdef float gs = grad_scale, gi
    if zero_grads:
        checked_data("grads", grads, cnp.NPY_FLOAT32, None, True)
    cdef float[::1] p = params, mm = m, vv = v
    cdef const float[::1] g = grads
    cdef Py_ssize_t i
    cdef float decay = 1.0 - lr * weight_decay
    cdef float step_size = lr / (1.0 - beta1 ** step)
    cdef float bc2_sqrt = sqrt(1.0 - beta2 ** step)
    for i in range(p.shape[0]):
        gi = g[i] * gs
        p[i] *= decay
        mm[i] = <float>beta1 * mm[i] + <float>(1.0 - beta1) * gi
        vv[i] = <float>beta2 * vv[i] + <float>(1.0 - beta2) * gi * gi
        p[i] -= step_size * mm[i] / (sqrtf(vv[i]) / bc2_sqrt + <float>eps)
    if zero_grads:
        grads[...] = 0


def zero_grad_naive(grads, *, n_threads=None):
    """Serial twin of zero_grad."""
    resolve_threads(n_threads)
    checked_data("grads", grads, cnp.NPY_FLOAT32, None, True)
    cdef float[::1] flat = grads.reshape(-1)
    cdef Py_ssize_t i
    for i in range(flat.shape[0]):
        flat[i] = 0


def grad_norm_naive(grads, *, n_threads=None):
    """Serial twin of grad_norm."""
    resolve_threads(n_threads)
    _check_flat("grads", grads, False)
    cdef const float[::1] g = grads
    cdef double total = 0
    cdef Py_ssize_t i
    for i in range(g.shape[0]):
        total += <double>g[i] * <double>g[i]
    return sqrt(total)


def clip_grad_norm_naive(grads, max_norm, *, n_threads=None):
    """Serial twin of clip_grad_norm."""
    _check_flat("grads", grads, True)
    _check_max_norm(max_norm)
    norm = grad_norm_naive(grads, n_threads=n_threads)
    cdef float[::1] g = grads
    cdef double coef = clip_coefficient(norm, max_norm)
    cdef Py_ssize_t i
    if coef < 1.0:
        for i in range(g.shape[0]):
            g[i] *= <float>coef
    return norm
