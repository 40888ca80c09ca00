"""LoRA's adapter products on a packed output (``adtape.nn.lora_linear``).

A packed product (q|k|v, gate|up) adapts some of its output columns: target j owns
columns ``start_j:start_j + n_j`` and its adapters ``A_j`` (r x C, rows ``j*r:(j+1)*r`` of
the stacked ``a``) and ``B_j`` (n_j x r, its rows of the stacked ``b``).  With
``xa = scale * x_l @ a.T`` (N x k*r, k targets):

    lora_forward(out, xa, b, splits)      out[:, start_j:start_j+n_j] += xa_j @ B_j.T
    lora_backward(dxa, db, dout, xa, b, splits)
        dxa[:, j*r:(j+1)*r] = dout[:, start_j:start_j+n_j] @ B_j,
        db[rows of j] += dout_j.T @ xa_j

Each is one parallel region on our OpenMP threads (on a loaded machine a region can
cost milliseconds to wake its threads, and one per target and product made a LoRA
step's dozens of small products pay that hundreds of times): tasks of a fixed size,
blocks of 128 rows of the output (of dxa), every target's product on them, and blocks of
128 rows of each target's dB, each one ``kernels.gemm`` call on one thread.  They read
and write the strided column slices in place (ldc, lda = the packed width): the forward
adds into the base product's output with beta 1, the backward reads the output
gradient's columns where they lie; no copy of a column slice and no temporary of the
output's size.  Blocks of a fixed size make the results the same bits on any thread
count; they sum as ``kernels.gemm`` does at those sizes (the forward's sums are r terms).

Dropout on the adapters' input (peft's: ``x_l = dropout(x)``, scaled by 1/(1-p)) keeps
a byte a element: ``uniforms`` draws ``u`` from a key (counter-based, in parallel),
``dropout_forward`` turns the uniform draws ``u`` into ``keep = u >=
p`` and ``x_l = x * (keep ? 1/(1-p) : 0)``; ``dropout_apply`` makes ``x_l`` again from
x and keep (the backward's dA); ``dropout_backward`` adds ``dx_l * (keep ? 1/(1-p) :
0)`` into dx.  The same bits as multiplying by the float32 mask ``keep / (1-p)``.
"""
cimport numpy as cnp
from cython.parallel cimport prange
from libc.stdint cimport uint8_t, uint64_t

from kernels.gemm cimport gemm
from kernels._common cimport (check_disjoint, checked_data, overwrite_flags, resolve_threads,
                              serial_if_small)

import numpy as np

cnp.import_array()

cdef enum:
    CHUNK = 16384           # elements per task of the element-wise dropout kernels
    # The adapters' products are cut into tasks of a fixed size (so the same bits on any
    # thread count): blocks of ROW_BLOCK rows of the output (forward) and of dxa, and
    # blocks of DB_BLOCK rows of each target's dB.
    ROW_BLOCK = 128
    DB_BLOCK = 128
    PARALLEL_MIN_WORK = 65536


def _splits(splits, Py_ssize_t OC, Py_ssize_t rows_b, Py_ssize_t kr):
    """(starts, widths, r) of ``splits`` after checking them against the packed width OC,
    b's rows and xa's k*r columns."""
    k = len(splits)
    if k == 0 or kr % k:
        raise ValueError(f"splits: {k} target(s) do not divide xa's {kr} columns")
    starts = np.empty(k, np.intp)
    widths = np.empty(k, np.intp)
    total = 0
    for j, (start, n) in enumerate(splits):
        if start < 0 or n < 0 or start + n > OC:
            raise ValueError(f"splits: target {j} ({start}, {n}) is not within the {OC} "
                             f"output columns")
        starts[j], widths[j] = start, n
        total += n
    if total != rows_b:
        raise ValueError(f"splits: the targets' {total} rows do not match b's {rows_b}")
    return starts, widths, kr // k


def _rows2(name, arr, Py_ssize_t width, bint writable):
    # (N, lead) of a float32 (N, width) or (B, T, width) array, checked
    if not isinstance(arr, np.ndarray) or arr.ndim not in (2, 3):
        raise ValueError(f"{name} must be a 2-D or 3-D array, got "
                         f"{getattr(arr, 'shape', type(arr).__name__)}")
    lead = tuple(arr.shape[:arr.ndim - 1])
    checked_data(name, arr, cnp.NPY_FLOAT32, lead + (width,), writable)
    N = 1
    for d in lead:
        N *= d
    return N, lead


def lora_forward(out, xa, b, splits, *, n_threads=None):
    """out[:, start_j:start_j + n_j] += xa[:, j*r:(j+1)*r] @ b[rows of j].T for each target
    j of ``splits`` ((start, n) pairs, b's rows in their order), in place.  out (N, OC) or
    (B, T, OC), xa (N, k*r) or (B, T, k*r), b (sum of n, r): float32, C-contiguous."""
    if not isinstance(out, np.ndarray) or out.ndim not in (2, 3):
        raise ValueError(f"out must be a 2-D or 3-D array, got "
                         f"{getattr(out, 'shape', type(out).__name__)}")
    if not isinstance(b, np.ndarray) or b.ndim != 2:
        raise ValueError(f"b must be a 2-D array, got {getattr(b, 'shape', type(b).__name__)}")
    cdef Py_ssize_t OC = out.shape[out.ndim - 1]
    cdef Py_ssize_t N, kr = len(splits) * b.shape[1]
    N, lead = _rows2("out", out, OC, True)
    checked_data("xa", xa, cnp.NPY_FLOAT32, lead + (kr,), False)
    checked_data("b", b, cnp.NPY_FLOAT32, None, False)
    starts, widths, r_ = _splits(splits, OC, b.shape[0], kr)
    check_disjoint((("out", out),), (("xa", xa), ("b", b)))
    cdef int nt = resolve_threads(n_threads)
    cdef Py_ssize_t r = r_, k = len(splits), t, lo, j, rows
    cdef Py_ssize_t[::1] s = starts, w = widths, first = _first_rows(widths)
    cdef Py_ssize_t nblocks = (N + ROW_BLOCK - 1) // ROW_BLOCK
    cdef float* o = <float*>cnp.PyArray_DATA(out)
    cdef const float* xp = <const float*>cnp.PyArray_DATA(xa)
    cdef const float* bp = <const float*>cnp.PyArray_DATA(b)
    if nblocks < 2 or N * (OC + kr) < PARALLEL_MIN_WORK:
        nt = 1
    # One parallel region: each task a block of rows, every target's product on it.
    with nogil:
        for t in prange(nblocks, schedule='dynamic', chunksize=1, num_threads=nt):
            lo = t * ROW_BLOCK
            for j in range(k):
                gemm(False, True, min(ROW_BLOCK, N - lo), w[j], r, 1.0, xp + lo * kr + j * r,
                     kr, bp + first[j] * r, r, 1.0, o + lo * OC + s[j], OC, NULL, NULL, 1)


cdef Py_ssize_t[::1] _first_rows(Py_ssize_t[::1] widths):
    # b's first row of each target
    out = np.zeros(widths.shape[0], np.intp)
    cdef Py_ssize_t[::1] f = out
    cdef Py_ssize_t j
    for j in range(1, widths.shape[0]):
        f[j] = f[j - 1] + widths[j - 1]
    return f


def lora_backward(dxa, db, dout, xa, b, splits, *, overwrite=False, n_threads=None):
    """For each target j of ``splits``: dxa[:, j*r:(j+1)*r] = dout_j @ b_j (always
    written) and db[rows of j] += dout_j.T @ xa_j (skipped when db is None;
    ``overwrite``: set instead), where dout_j = dout[:, start_j:start_j + n_j] is read
    in place.  dout (N, OC) or (B, T, OC); dxa and xa (N, k*r) or (B, T, k*r); b and
    db (sum of n, r): float32, C-contiguous."""
    if not isinstance(dout, np.ndarray) or dout.ndim not in (2, 3):
        raise ValueError(f"dout must be a 2-D or 3-D array, got "
                         f"{getattr(dout, 'shape', type(dout).__name__)}")
    if not isinstance(b, np.ndarray) or b.ndim != 2:
        raise ValueError(f"b must be a 2-D array, got {getattr(b, 'shape', type(b).__name__)}")
    cdef bint ow = overwrite_flags(overwrite, ("db",))[0]
    cdef Py_ssize_t OC = dout.shape[dout.ndim - 1]
    cdef Py_ssize_t N, kr = len(splits) * b.shape[1]
    N, lead = _rows2("dout", dout, OC, False)
    checked_data("xa", xa, cnp.NPY_FLOAT32, lead + (kr,), False)
    checked_data("dxa", dxa, cnp.NPY_FLOAT32, lead + (kr,), True)
    checked_data("b", b, cnp.NPY_FLOAT32, None, False)
    if db is not None:
        checked_data("db", db, cnp.NPY_FLOAT32, b.shape, True)
    starts, widths, r_ = _splits(splits, OC, b.shape[0], kr)
    check_disjoint((("dxa", dxa), ("db", db)), (("dout", dout), ("xa", xa), ("b", b)))
    cdef int nt = resolve_threads(n_threads)
    cdef Py_ssize_t r = r_, k = len(splits), t, lo, j, c0, m
    cdef Py_ssize_t[::1] s = starts, w = widths, first = _first_rows(widths)
    cdef const float* g = <const float*>cnp.PyArray_DATA(dout)
    cdef const float* xp = <const float*>cnp.PyArray_DATA(xa)
    cdef const float* bp = <const float*>cnp.PyArray_DATA(b)
    cdef float* dxp = <float*>cnp.PyArray_DATA(dxa)
    cdef float* dbp = NULL if db is None else <float*>cnp.PyArray_DATA(db)
    # Tasks: blocks of rows of dxa (every target's dout_j @ B_j on them), then blocks of
    # each target's rows of db (dout_j^T xa_j over all N rows): one parallel region.
    cdef Py_ssize_t nrow = (N + ROW_BLOCK - 1) // ROW_BLOCK
    tj, tc = [], []
    if db is not None:
        for j in range(k):
            for c0 in range(0, widths[j], DB_BLOCK):
                tj.append(j)
                tc.append(c0)
    cdef Py_ssize_t[::1] task_j = np.array(tj, np.intp) if tj else np.zeros(1, np.intp)
    cdef Py_ssize_t[::1] task_c = np.array(tc, np.intp) if tc else np.zeros(1, np.intp)
    cdef Py_ssize_t ntasks = nrow + len(tj)
    if ntasks < 2 or N * (OC + kr) < PARALLEL_MIN_WORK:
        nt = 1
    with nogil:
        for t in prange(ntasks, schedule='dynamic', chunksize=1, num_threads=nt):
            if t < nrow:
                lo = t * ROW_BLOCK
                m = min(ROW_BLOCK, N - lo)
                for j in range(k):
                    gemm(False, False, m, r, w[j], 1.0, g + lo * OC + s[j], OC,
                         bp + first[j] * r, r, 0.0, dxp + lo * kr + j * r, kr, NULL, NULL, 1)
            else:
                j = task_j[t - nrow]
                c0 = task_c[t - nrow]
                m = min(<Py_ssize_t>DB_BLOCK, w[j] - c0)
                gemm(True, False, m, r, N, 1.0, g + s[j] + c0, OC, xp + j * r, kr,
                     0.0 if ow else 1.0, dbp + (first[j] + c0) * r, r, NULL, NULL, 1)


# ---------------------------------------------------------------- dropout

cdef inline float _uniform(uint64_t key, uint64_t i) noexcept nogil:
    # SplitMix64 (Steele, Lea and Flood 2014): the finalizer of the i-th Weyl step from
    # key; its top 24 bits over 2^24, exact in float32, in [0, 1).
    cdef uint64_t z = key + (i + 1) * <uint64_t>0x9E3779B97F4A7C15ULL
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EBULL
    z = z ^ (z >> 31)
    return <float><int>(z >> 40) * <float>5.9604644775390625e-08


cdef void _uniforms(float* u, uint64_t key, Py_ssize_t n, int nt) noexcept nogil:
    cdef Py_ssize_t c, i, i1, nchunks = (n + CHUNK - 1) // CHUNK
    for c in prange(nchunks, schedule='static', nogil=True, num_threads=nt):
        i1 = min(n, (c + 1) * CHUNK)
        for i in range(c * CHUNK, i1):
            u[i] = _uniform(key, <uint64_t>i)


cdef void _dropout_forward(float* xl, uint8_t* keep, const float* x, const float* u,
                           float p, float inv, Py_ssize_t n, int nt) noexcept nogil:
    # m is float: x * m is float32's product (no double in between), the bits of
    # x * mask with NumPy's float32 mask.
    cdef Py_ssize_t c, i, i1, nchunks = (n + CHUNK - 1) // CHUNK
    cdef uint8_t kp
    cdef float m
    for c in prange(nchunks, schedule='static', nogil=True, num_threads=nt):
        i1 = min(n, (c + 1) * CHUNK)
        for i in range(c * CHUNK, i1):
            kp = u[i] >= p
            keep[i] = kp
            m = inv if kp else <float>0.0
            xl[i] = x[i] * m


cdef void _dropout_apply(float* xl, const float* x, const uint8_t* keep, float inv,
                         Py_ssize_t n, int nt) noexcept nogil:
    cdef Py_ssize_t c, i, i1, nchunks = (n + CHUNK - 1) // CHUNK
    cdef float m
    for c in prange(nchunks, schedule='static', nogil=True, num_threads=nt):
        i1 = min(n, (c + 1) * CHUNK)
        for i in range(c * CHUNK, i1):
            m = inv if keep[i] else <float>0.0
            xl[i] = x[i] * m


cdef void _dropout_backward(float* dx, const float* dxl, const uint8_t* keep, float inv,
                            Py_ssize_t n, bint ow, int nt) noexcept nogil:
    # t = dxl * m rounded to float32 before the add (NumPy's two passes' bits; the
    # build has no FMA contraction at its baseline x86-64)
    cdef Py_ssize_t c, i, i1, nchunks = (n + CHUNK - 1) // CHUNK
    cdef float m, t
    for c in prange(nchunks, schedule='static', nogil=True, num_threads=nt):
        i1 = min(n, (c + 1) * CHUNK)
        for i in range(c * CHUNK, i1):
            m = inv if keep[i] else <float>0.0
            t = dxl[i] * m
            if ow:
                dx[i] = t
            else:
                dx[i] = dx[i] + t


cdef Py_ssize_t _same_shape(tuple arrays) except -1:
    # checks float32 / uint8 arrays of one shape; returns their size
    shape = arrays[0][1].shape if isinstance(arrays[0][1], np.ndarray) else None
    for name, arr, typenum, writable in arrays:
        checked_data(name, arr, typenum, shape, writable)
    return arrays[0][1].size


def uniforms(u, key, *, n_threads=None):
    """u[i] = uniform draw i of the stream ``key`` (an integer in [0, 2^64)), in [0, 1)
    as multiples of 2^-24: SplitMix64's output for counter i, its top 24 bits.  Each
    element depends on (key, i) alone, so threads fill their own ranges and the result is
    the same on any thread count; dropout's masks draw one key from the caller's
    Generator per call (NumPy's Generator.random fills an array on one thread, 8 ns an
    element on the Zen 3: 1.9 s a step of Llama 3.2 1B at (1, 1024) with dropout on
    every projection)."""
    cdef Py_ssize_t n = _same_shape((("u", u, cnp.NPY_FLOAT32, True),))
    key = int(key)
    if not 0 <= key < 1 << 64:
        raise ValueError(f"uniforms: key must be in [0, 2**64), got {key}")
    cdef uint64_t k = key
    cdef int nt = serial_if_small(resolve_threads(n_threads), n_threads, n)
    cdef float* up = <float*>cnp.PyArray_DATA(u)
    with nogil:
        _uniforms(up, k, n, nt)


def dropout_forward(xl, keep, x, u, p, *, n_threads=None):
    """keep = u >= p (uint8, 0 or 1) and xl = x * (keep ? 1/(1-p) : 0), the scale rounded
    to float32 once: ``torch.nn.Dropout``'s p from uniform draws ``u`` in [0, 1).  All of
    one shape; x, u, xl float32."""
    cdef Py_ssize_t n = _same_shape((("x", x, cnp.NPY_FLOAT32, False),
                                     ("u", u, cnp.NPY_FLOAT32, False),
                                     ("xl", xl, cnp.NPY_FLOAT32, True),
                                     ("keep", keep, cnp.NPY_UINT8, True)))
    if not 0 <= p < 1:
        raise ValueError(f"dropout p must be in [0, 1), got {p!r}")
    check_disjoint((("xl", xl), ("keep", keep)), (("x", x), ("u", u)))
    cdef float pf = np.float32(p), inv = np.float32(1.0 / (1.0 - p))
    cdef int nt = serial_if_small(resolve_threads(n_threads), n_threads, n)
    cdef float* xlp = <float*>cnp.PyArray_DATA(xl)
    cdef uint8_t* kp = <uint8_t*>cnp.PyArray_DATA(keep)
    cdef const float* xp = <const float*>cnp.PyArray_DATA(x)
    cdef const float* up = <const float*>cnp.PyArray_DATA(u)
    with nogil:
        _dropout_forward(xlp, kp, xp, up, pf, inv, n, nt)


def dropout_apply(xl, x, keep, p, *, n_threads=None):
    """xl = x * (keep ? 1/(1-p) : 0): ``dropout_forward``'s xl again, from x and keep."""
    cdef Py_ssize_t n = _same_shape((("x", x, cnp.NPY_FLOAT32, False),
                                     ("keep", keep, cnp.NPY_UINT8, False),
                                     ("xl", xl, cnp.NPY_FLOAT32, True)))
    check_disjoint((("xl", xl),), (("x", x), ("keep", keep)))
    cdef float inv = np.float32(1.0 / (1.0 - p))
    cdef int nt = serial_if_small(resolve_threads(n_threads), n_threads, n)
    cdef float* xlp = <float*>cnp.PyArray_DATA(xl)
    cdef const float* xp = <const float*>cnp.PyArray_DATA(x)
    cdef const uint8_t* kp = <const uint8_t*>cnp.PyArray_DATA(keep)
    with nogil:
        _dropout_apply(xlp, xp, kp, inv, n, nt)


def dropout_backward(dx, dxl, keep, p, *, overwrite=False, n_threads=None):
    """dx += dxl * (keep ? 1/(1-p) : 0) (``overwrite``: =), the gradient through
    ``dropout_forward``'s xl into x."""
    cdef bint ow = overwrite_flags(overwrite, ("dx",))[0]
    cdef Py_ssize_t n = _same_shape((("dxl", dxl, cnp.NPY_FLOAT32, False),
                                     ("keep", keep, cnp.NPY_UINT8, False),
                                     ("dx", dx, cnp.NPY_FLOAT32, True)))
    check_disjoint((("dx", dx),), (("dxl", dxl), ("keep", keep)))
    cdef float inv = np.float32(1.0 / (1.0 - p))
    cdef int nt = serial_if_small(resolve_threads(n_threads), n_threads, n)
    cdef float* dxp = <float*>cnp.PyArray_DATA(dx)
    cdef const float* dlp = <const float*>cnp.PyArray_DATA(dxl)
    cdef const uint8_t* kp = <const uint8_t*>cnp.PyArray_DATA(keep)
    with nogil:
        _dropout_backward(dxp, dlp, kp, inv, n, ow, nt)
