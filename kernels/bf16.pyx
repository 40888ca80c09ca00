"""bfloat16 kernels: conversions, and the linear layer's products with bf16 operands
and float32 accumulation (``--precision bf16``).

A bf16 array is a ``numpy.uint16`` array of the top halves of float32s.  ``to_bf16``
rounds float32 to it (nearest, ties to even, NaN kept NaN), ``from_bf16`` widens it
back (exact).  The products are ``kernels.matmul``'s, with the operands in bf16:

    matmul_forward_bf16(out, inp, weight, bias)      out = inp @ weight.T + bias
    matmul_backward_bf16(dinp, dweight, dbias, dout, inp, weight)
        dinp += bf16(dout) @ weight, dweight += bf16(dout).T @ inp, dbias += sum(dout)

``inp`` and ``weight`` are bf16; ``out``, ``bias``, ``dout`` and the gradients float32.
``matmul_forward_w16(out, inp, weight, bias)`` takes the weight alone in bf16 and a
float32 ``inp`` (not rounded): decoding from bf16 weights (gpt2-generate --dtype bf16),
where the time is reading the weights (kernels.gemm's gemm_w16).
The caller keeps the float32 master weights and converts each weight to bf16 once per
step (after the optimizer's update), passing that copy to the forward and the
backward; it converts the layer's input once and keeps the bf16 copy for the backward
(half the memory of float32).  The backward rounds dout to bf16 itself, once for both
products, and sums dbias from the float32 dout.

Three implementations, chosen at run time (``bf16_path()``; the default is the first
this CPU has):
  ``"amx"``       AMX-BF16 tiles (TDPBF16PS, 32 x 32 of C at a time), where the CPU has
                  them and Linux grants the tile state: each product's operands laid
                  out once and shared by the threads (bf16.h), A read in place where
                  its rows run along the depth;
  ``"native"``    AVX512_BF16 (VDPBF16PS), where the CPU has it, on the same laid-out
                  operands as "amx";
  ``"emulated"``  everywhere else: the operands widened to float32 (exact) and multiplied
                  by ``kernels.gemm``'s float32 product, at float32's speed.
Two more, ``"twin"`` and ``"amx_twin"``, run the native and the AMX path's code with
VDPBF16PS and the tiles done in software, for the tests on any CPU (slow).  The products
of two bf16 are exact in float32, so every path computes the exact products and sums
them in float32; they differ only in the order of the sums (and the native and AMX
paths read subnormal bf16 as zero).  None depends on the thread count: the packed paths
sum every element in blocks of depth whatever the split, and the emulated path splits
its output into blocks that depend on the shapes alone.

Conversions have serial ``_naive`` twins for the tests.
"""
cimport numpy as cnp
from cython.parallel cimport parallel, prange
from libc.stdint cimport uint16_t, uint32_t

from kernels.gemm cimport gemm, gemm_w16
from kernels._common cimport check_disjoint, checked_data, overwrite_flags, resolve_threads

import numpy as np

from kernels.matmul import _backward_shapes, _matmul_shapes

cnp.import_array()

cdef extern from "<stdlib.h>" nogil:
    void* aligned_alloc(size_t alignment, size_t size)
    void* calloc(size_t n, size_t size)
    void free(void* ptr)

cdef extern from "bf16.h" nogil:
    void bf16_round_span(uint16_t* out, const float* inp, Py_ssize_t n)
    void bf16_widen_span(float* out, const uint16_t* inp, Py_ssize_t n)
    void bf16_round_f32_span(float* out, const float* inp, Py_ssize_t n)
    void bf16_dbias_cols(float* dbias, const float* dout, Py_ssize_t N, Py_ssize_t OC,
                         Py_ssize_t c0, Py_ssize_t c1, int overwrite)
    int bf16_cpu_native()
    int bf16_cpu_amx()
    enum: BF_DBIAS_COLS
    ctypedef struct bf_sprod:
        int b_direct
    size_t bf_sp_init(bf_sprod* p, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                       const uint16_t* A, Py_ssize_t a_rs, Py_ssize_t a_cs, const uint16_t* B,
                       Py_ssize_t b_rs, Py_ssize_t b_cs, int accumulate, float* C,
                       Py_ssize_t ldc, const float* bias, int n_threads)
    void bf_sp_attach(bf_sprod* p, uint32_t* buf)
    void bf_sp_trans_c(bf_sprod* p)
    int bf_sp_stream_c(bf_sprod* p)
    size_t bf_sp_direct_b(bf_sprod* p)
    Py_ssize_t bf_sp_chunks(const bf_sprod* p)
    Py_ssize_t bf_sp_pack_tasks(const bf_sprod* p, Py_ssize_t chunk)
    Py_ssize_t bf_sp_tile_tasks(const bf_sprod* p, Py_ssize_t chunk)
    void bf_sp_pack(const bf_sprod* p, Py_ssize_t chunk, Py_ssize_t t)
    void bf_sp_run_task(int path, const bf_sprod* p, Py_ssize_t chunk, Py_ssize_t t)
    Py_ssize_t bf_sp_chunk_pairs
    Py_ssize_t bf_sp_tiles[2]
    int bf_sp_plain_transposes
    int bf_sp_sub

cdef enum:
    PATH_EMULATED = 0
    PATH_NATIVE = 1
    PATH_TWIN = 2
    PATH_AMX = 3            # bf16.h's BF_PATH_* for the packed paths
    PATH_AMX_TWIN = 4
    # Below this many elements converted (or dbias's dout elements) and this many
    # multiply-adds (kernels.gemm's threshold), a call runs on one thread.
    CONVERT_PARALLEL_MIN = 65536
    PRODUCT_PARALLEL_MIN = 1 << 20
    # Conversions are handed out in chunks of this many elements (128 KiB of float32).
    CONVERT_CHUNK = 32768
    # The emulated path cuts a product's output along its longer side into an even
    # number of blocks of at most BLOCK_MAX rows or columns (a multiple of BLOCK_ALIGN),
    # one block below PRODUCT_PARALLEL_MIN (Plan).  The cut depends on the shape alone, so the results
    # do not depend on the thread count: kernels.gemm's own split follows the thread
    # count, and some of its paths (its split by depth, BLAS's kernels for small
    # blocks) sum in another order on each side of a cut.  Blocks of 512 keep each
    # block on the path kernels.gemm takes for the whole product (at 1024 x 768 x 768
    # blocks of 256 rows go to the packed GEMM, not BLAS: 26 ms of CPU against 17 on
    # one Zen 3 core); an even count keeps two threads equally busy.
    BLOCK_MAX = 512
    BLOCK_ALIGN = 16
    # dout @ W reads W in place up to this many rows (_direct_weight)
    DIRECT_WEIGHT_MAX_N = 256

cdef enum:
    CONVERT_WIDEN = 0       # bf16 -> float32
    CONVERT_ROUND = 1       # float32 -> bf16
    CONVERT_ROUND_F32 = 2   # float32 -> its bf16 value in float32

_PATH_NAMES = {PATH_EMULATED: "emulated", PATH_NATIVE: "native", PATH_TWIN: "twin",
               PATH_AMX: "amx", PATH_AMX_TWIN: "amx_twin"}
cdef int _path = (PATH_AMX if bf16_cpu_amx() else
                  PATH_NATIVE if bf16_cpu_native() else PATH_EMULATED)


def cpu_has_avx512_bf16():
    """Whether this CPU has AVX512_BF16 (and AVX-512 state saved by the OS)."""
    return bool(bf16_cpu_native())


def cpu_has_amx_bf16():
    """Whether this CPU has AMX-BF16 tiles and Linux lets this process use them."""
    return bool(bf16_cpu_amx())


def bf16_path():
    """Which implementation the products run: "amx" (AMX-BF16 tiles), "native"
    (AVX512_BF16), "emulated" (widened to float32, kernels.gemm), "twin" or "amx_twin"
    (the native or AMX code with the instructions done in software; tests).  The
    default is the fastest this CPU has."""
    return _PATH_NAMES[_path]


def set_bf16_path(str path):
    """Run the products on ``path`` ("native" only where ``cpu_has_avx512_bf16()``,
    "amx" only where ``cpu_has_amx_bf16()``).

    For tests and benchmarks; not thread-safe against running kernels.  Returns the
    previous path."""
    global _path
    names = {name: key for key, name in _PATH_NAMES.items()}
    if path not in names:
        raise ValueError(f"path must be one of {sorted(names)}, got {path!r}")
    if names[path] == PATH_NATIVE and not bf16_cpu_native():
        raise ValueError("the native bf16 path needs a CPU with AVX512_BF16")
    if names[path] == PATH_AMX and not bf16_cpu_amx():
        raise ValueError("the amx bf16 path needs a CPU with AMX-BF16 (and Linux's "
                         "permission to use its tiles)")
    old = bf16_path()
    _path = names[path]
    return old


def bf16_native():
    """Whether the products run on the CPU's bf16 instructions (AMX or VDPBF16PS)."""
    return _path == PATH_NATIVE or _path == PATH_AMX


def set_bf16_native(bint native):
    """Run the products on AVX512_BF16 (True; the CPU must have it) or emulated
    (False).  For tests; returns the previous setting."""
    old = bf16_native()
    set_bf16_path("native" if native else "emulated")
    return old


def _set_chunk_pairs(Py_ssize_t pairs):
    """Cap the packed paths' packed operands at ``pairs`` uint32 each (2 Mi pairs, 8 MiB, by
    default), for the tests of products done in chunks.  Returns the previous cap."""
    global bf_sp_chunk_pairs
    if pairs < 1:
        raise ValueError(f"pairs must be positive, got {pairs}")
    old = bf_sp_chunk_pairs
    bf_sp_chunk_pairs = pairs
    return old


def _set_task_tiles(Py_ssize_t tile_m=0, Py_ssize_t tile_n=0):
    """The packed paths' tasks: blocks of tile_m x tile_n of C (multiples of 32; 0: the
    largest square that gives each thread about four), for the benchmarks.  The
    results' bits do not depend on them."""
    if tile_m < 0 or tile_n < 0 or tile_m % 32 or tile_n % 32:
        raise ValueError(f"tiles must be multiples of 32 (or 0), got {tile_m} x {tile_n}")
    bf_sp_tiles[0] = tile_m
    bf_sp_tiles[1] = tile_n


def _set_plain_transposes(bint plain):
    """Lay the packed paths' operands out with plain loops (True) instead of the
    AVX-512 transposes where the CPU has them, for the tests (the same layout: the
    results' bits do not depend on it).  Returns the previous setting."""
    global bf_sp_plain_transposes
    old = bool(bf_sp_plain_transposes)
    bf_sp_plain_transposes = plain
    return old


def forward_transposed(Py_ssize_t N, Py_ssize_t C, Py_ssize_t OC):
    """Whether ``matmul_forward_bf16`` of N rows, C inputs and OC outputs runs as out^T
    = W x^T on this path (x laid out, the weight's rows read in place) rather than out
    = x W^T (the weight laid out): for the memory planner's figure of its buffer."""
    return _forward_transposed(_path, N, C, OC)


def _set_forward_layout(str layout):
    """The VDPBF16PS paths' forward: "auto" (by the shape), "x_wt" (out = x W^T, the
    weight laid out) or "w_xt" (out^T = W x^T, x laid out), for the tests and
    benchmarks: the results' bits do not depend on it.  Returns the previous one."""
    global _forward_layout
    names = ("auto", "x_wt", "w_xt")
    if layout not in names:
        raise ValueError(f"layout must be one of {names}, got {layout!r}")
    old = names[_forward_layout]
    _forward_layout = names.index(layout)
    return old


def _packed_bytes(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, bint a_rows_along_depth,
                  bint b_in_place=False):
    """The bytes of the buffer the packed paths lay an M x N x K product's operands out
    in, A's rows along the depth (x, dout) or across it (dout^T), B laid out or (where
    it can be) read in place (the weight in dout @ W); for the tests of the memory
    planner's figure (gpt2.perfmodel.plan.bf16_packed_bytes)."""
    cdef bf_sprod p
    cdef uint16_t one = 0
    # B's rows along the columns, as W in dout @ W (laid out, B's strides change nothing)
    cdef size_t pairs = bf_sp_init(&p, M, N, K, &one, K if a_rows_along_depth else 1,
                                   1 if a_rows_along_depth else M, &one, N, 1, False, NULL,
                                   N, NULL, 1)
    return 4 * (bf_sp_direct_b(&p) if b_in_place else pairs)


# ---------------------------------------------------------------- the engine
# Every call is one parallel region: its conversions, handed out in chunks, then its
# products' blocks (and dbias's channels), handed out one at a time.  A region's
# threads must all be woken, which costs microseconds on an idle machine and tens of
# milliseconds on a busy one (a 2-thread conversion of 200,000 elements on the Zen 3
# VM at a load of 10: 24-34 ms, against 0.03 on one thread), so the emulated forward's
# three regions (two conversions, the product) cost it 1.8-1.9x the float32 product's
# time there at 1024 x 768 x 768; and dynamic hand-out lets a thread that is running
# take the work of one that is not.

cdef struct Convert:
    int kind                  # CONVERT_*
    const void* src
    void* dst
    Py_ssize_t n


cdef struct Plan:
    # How the emulated path cuts a product's output: into blocks of `rows` x `cols`
    # (the last of each row and column shorter), `col_blocks` to a row of blocks,
    # `nblocks` in all.
    Py_ssize_t rows, cols, col_blocks, nblocks


cdef struct Product:
    # The emulated path's row-major C (M, N) (+= where accumulate) op(A) (M, K) op(B)
    # (K, N) (+ bias per column), A and B float32 holding bf16 values, of row strides
    # lda and ldb.
    bint trans_a, trans_b, accumulate
    Py_ssize_t M, N, K, lda, ldb, ldc
    const void* A
    const void* B
    float* C
    const float* bias
    Plan plan


cdef struct Dbias:
    # dbias (+)= the column sums of dout (N, OC), BF_DBIAS_COLS channels a task
    float* dbias
    const float* dout
    Py_ssize_t N, OC
    bint overwrite


cdef Plan _plan(Py_ssize_t M, Py_ssize_t N, Py_ssize_t K) noexcept nogil:
    cdef Plan p
    cdef Py_ssize_t extent, count, block
    cdef bint by_columns = N >= M
    p.rows, p.cols = max(M, 1), max(N, 1)
    if M * N * K >= PRODUCT_PARALLEL_MIN:
        extent = N if by_columns else M
        count = 2 * ((extent + 2 * BLOCK_MAX - 1) // (2 * BLOCK_MAX))
        if extent < 2 * BLOCK_ALIGN:
            count = 1
        block = max(1, ((extent + count - 1) // count + BLOCK_ALIGN - 1) // BLOCK_ALIGN
                    * BLOCK_ALIGN)
        if by_columns:
            p.cols = block
        else:
            p.rows = block
    p.col_blocks = (N + p.cols - 1) // p.cols
    p.nblocks = 0 if M == 0 or N == 0 else (M + p.rows - 1) // p.rows * p.col_blocks
    return p


cdef Product _product(bint trans_a, bint trans_b, Py_ssize_t M, Py_ssize_t N,
                      Py_ssize_t K,
                      const void* A, Py_ssize_t lda, const void* B, Py_ssize_t ldb,
                      bint accumulate, float* C, Py_ssize_t ldc,
                      const float* bias) noexcept nogil:
    cdef Product p
    p.trans_a, p.trans_b, p.accumulate = trans_a, trans_b, accumulate
    p.M, p.N, p.K, p.lda, p.ldb, p.ldc = M, N, K, lda, ldb, ldc
    p.A, p.B, p.C, p.bias = A, B, C, bias
    p.plan = _plan(M, N, K)
    return p


cdef void _convert_chunk(const Convert* conv, int nconv, Py_ssize_t chunk) noexcept nogil:
    # chunk `chunk` of the conversions, counted across all of them in order
    cdef int i
    cdef Py_ssize_t count, lo, n
    for i in range(nconv):
        count = (conv[i].n + CONVERT_CHUNK - 1) // CONVERT_CHUNK
        if chunk < count:
            lo = chunk * CONVERT_CHUNK
            n = min(<Py_ssize_t>CONVERT_CHUNK, conv[i].n - lo)
            if conv[i].kind == CONVERT_WIDEN:
                bf16_widen_span(<float*>conv[i].dst + lo, <const uint16_t*>conv[i].src + lo, n)
            elif conv[i].kind == CONVERT_ROUND:
                bf16_round_span(<uint16_t*>conv[i].dst + lo, <const float*>conv[i].src + lo, n)
            else:
                bf16_round_f32_span(<float*>conv[i].dst + lo, <const float*>conv[i].src + lo, n)
            return
        chunk -= count


cdef void _block(const Product* p, Py_ssize_t t) noexcept nogil:
    # block t of p by its plan: rows r0:r1 of op(A) times columns c0:c1 of op(B)
    cdef Py_ssize_t r0 = t // p.plan.col_blocks * p.plan.rows
    cdef Py_ssize_t c0 = t % p.plan.col_blocks * p.plan.cols
    cdef Py_ssize_t r1 = min(r0 + p.plan.rows, p.M)
    cdef Py_ssize_t c1 = min(c0 + p.plan.cols, p.N)
    cdef Py_ssize_t a_rs = 1 if p.trans_a else p.lda
    cdef Py_ssize_t b_cs = p.ldb if p.trans_b else 1
    cdef float* C = p.C + r0 * p.ldc + c0
    cdef const float* bias = p.bias
    cdef Py_ssize_t i, j
    if bias != NULL:
        bias = bias + c0
    if p.K == 0:
        for i in range(r1 - r0):
            for j in range(c1 - c0):
                C[i * p.ldc + j] = ((C[i * p.ldc + j] if p.accumulate else 0.0)
                                    + (0.0 if bias == NULL else bias[j]))
    else:
        gemm(p.trans_a, p.trans_b, r1 - r0, c1 - c0, p.K, 1.0, <const float*>p.A + r0 * a_rs,
             p.lda, <const float*>p.B + c0 * b_cs, p.ldb, 1.0 if p.accumulate else 0.0, C,
             p.ldc, bias, NULL, 1)


cdef void _dbias_task(const Dbias* db, Py_ssize_t t) noexcept nogil:
    # dbias's channel block t
    cdef Py_ssize_t c0 = t * BF_DBIAS_COLS
    bf16_dbias_cols(db.dbias, db.dout, db.N, db.OC, c0, min(c0 + BF_DBIAS_COLS, db.OC),
                    db.overwrite)


cdef void _task(const Product* prods, int nprod, const Dbias* db, Py_ssize_t t) noexcept nogil:
    # task t: the products' blocks in order, then dbias's channel blocks
    cdef int i
    for i in range(nprod):
        if t < prods[i].plan.nblocks:
            _block(&prods[i], t)
            return
        t -= prods[i].plan.nblocks
    _dbias_task(db, t)


cdef int _threads(const Convert* conv, int nconv, const Product* prods, int nprod,
                  const Dbias* db, int n_threads) noexcept nogil:
    # n_threads, or 1 where the whole call is small
    cdef Py_ssize_t elements = 0 if db == NULL else db.N * db.OC
    cdef int i
    for i in range(nconv):
        elements += conv[i].n
    for i in range(nprod):
        if prods[i].plan.nblocks > 1:
            return n_threads
    return n_threads if elements >= CONVERT_PARALLEL_MIN else 1


cdef void _run(const Convert* conv, int nconv, const Product* prods, int nprod,
               const Dbias* db, int nt) noexcept nogil:
    # The call's one parallel region (the conversions and the emulated path).
    cdef Py_ssize_t nchunks = 0, ntasks = 0, c, t
    cdef int i
    for i in range(nconv):
        nchunks += (conv[i].n + CONVERT_CHUNK - 1) // CONVERT_CHUNK
    for i in range(nprod):
        ntasks += prods[i].plan.nblocks
    if db != NULL:
        ntasks += (db.OC + BF_DBIAS_COLS - 1) // BF_DBIAS_COLS
    with parallel(num_threads=nt):
        for c in prange(nchunks, schedule='dynamic', chunksize=1):
            _convert_chunk(conv, nconv, c)
        for t in prange(ntasks, schedule='dynamic', chunksize=1):
            _task(prods, nprod, db, t)


cdef void* _scratch(Py_ssize_t n, size_t size) noexcept nogil:
    return aligned_alloc(64, (max(n, 1) * size + 63) // 64 * 64)


cdef int _out_of_memory(str what) except -1 with gil:
    raise MemoryError(f"bf16 products: no memory for {what}; nothing was written")


# ---------------------------------------------------------------- the cores

cdef void to_bf16_c(uint16_t* out, const float* inp, Py_ssize_t n, int n_threads) noexcept nogil:
    cdef Convert conv = Convert(CONVERT_ROUND, inp, out, n)
    _run(&conv, 1, NULL, 0, NULL,
         _threads(&conv, 1, NULL, 0, NULL, n_threads))


cdef void from_bf16_c(float* out, const uint16_t* inp, Py_ssize_t n, int n_threads) noexcept nogil:
    cdef Convert conv = Convert(CONVERT_WIDEN, inp, out, n)
    _run(&conv, 1, NULL, 0, NULL,
         _threads(&conv, 1, NULL, 0, NULL, n_threads))


# The emulated path widens the weight to float32 a block of rows at a time (at most
# EMULATED_BLOCK floats of it): a whole LM head of Llama 3 (128256 x 4096) would take 2.1 GB
# of scratch per product, past what a machine holding an 8B base in bf16 has left.
cdef enum:
    EMULATED_BLOCK = 1 << 23


cdef Py_ssize_t _emulated_rows(Py_ssize_t C, Py_ssize_t OC) noexcept nogil:
    return max(1, min(OC, EMULATED_BLOCK // max(C, 1)))


cdef int _emulated_forward(float* out, const uint16_t* inp, const uint16_t* weight,
                           const float* bias, Py_ssize_t N, Py_ssize_t C, Py_ssize_t OC,
                           int n_threads) except -1 nogil:
    # out[:, o0:o0+ob] = widen(inp) @ widen(weight[o0:o0+ob]).T + bias, block by block
    cdef Py_ssize_t rows = _emulated_rows(C, OC), o0, ob
    cdef float* xf = <float*>_scratch(N * C, sizeof(float))
    cdef float* wf = <float*>_scratch(rows * C, sizeof(float))
    cdef Convert conv
    cdef Product p
    if xf == NULL or wf == NULL:
        free(xf)
        free(wf)
        _out_of_memory("the operands in float32")
    conv = Convert(CONVERT_WIDEN, inp, xf, N * C)
    _run(&conv, 1, NULL, 0, NULL,
         _threads(&conv, 1, NULL, 0, NULL, n_threads))
    o0 = 0
    while o0 < OC:
        ob = min(rows, OC - o0)
        conv = Convert(CONVERT_WIDEN, weight + o0 * C, wf, ob * C)
        p = _product(False, True, N, ob, C, xf, C, wf, C, False, out + o0, OC,
                     NULL if bias == NULL else bias + o0)
        _run(&conv, 1, &p, 1, NULL,
             _threads(&conv, 1, &p, 1, NULL, n_threads))
        o0 += ob
    free(xf)
    free(wf)
    return 0


cdef int _emulated_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                            const uint16_t* inp, const uint16_t* weight, Py_ssize_t N,
                            Py_ssize_t C, Py_ssize_t OC, int n_threads, bint ow_dinp,
                            bint ow_dweight, bint ow_dbias) except -1 nogil:
    # dout rounded to its bf16 values once; then per block of the weight's rows:
    # dinp += d[:, blk] @ widen(weight[blk]), dweight[blk] = d[:, blk].T @ widen(inp)
    cdef Py_ssize_t rows = _emulated_rows(C, OC), o0, ob
    cdef float* d = <float*>_scratch(N * OC, sizeof(float))
    cdef float* xf = <float*>_scratch(N * C if dweight != NULL else 0, sizeof(float))
    cdef float* wf = <float*>_scratch(rows * C if dinp != NULL else 0, sizeof(float))
    cdef Convert conv[2]
    cdef Product prods[2]
    cdef Dbias db = Dbias(dbias, dout, N, OC, ow_dbias)
    cdef int nconv = 1, nprod
    if d == NULL or xf == NULL or wf == NULL:
        free(d)
        free(xf)
        free(wf)
        _out_of_memory("dout and the operands in float32")
    conv[0] = Convert(CONVERT_ROUND_F32, dout, d, N * OC)
    if dweight != NULL:
        conv[1] = Convert(CONVERT_WIDEN, inp, xf, N * C)
        nconv = 2
    _run(conv, nconv, NULL, 0, &db if dbias != NULL else NULL,
         _threads(conv, nconv, NULL, 0, &db if dbias != NULL else NULL, n_threads))
    o0 = 0
    while o0 < OC:
        ob = min(rows, OC - o0)
        nconv = nprod = 0
        if dinp != NULL:
            conv[0] = Convert(CONVERT_WIDEN, weight + o0 * C, wf, ob * C)
            nconv = 1
            prods[0] = _product(False, False, N, C, ob, d + o0, OC, wf, C,
                                not ow_dinp or o0 > 0, dinp, C, NULL)
            nprod = 1
        if dweight != NULL:
            prods[nprod] = _product(True, False, ob, C, N, d + o0, OC, xf, C,
                                    not ow_dweight, dweight + o0 * C, C, NULL)
            nprod += 1
        _run(conv, nconv, prods, nprod, NULL,
             _threads(conv, nconv, prods, nprod, NULL, n_threads))
        o0 += ob
    free(d)
    free(xf)
    free(wf)
    return 0


# The packed paths (native, AMX and their twins) run each call as rounds of chunks (one
# round unless a packed operand would pass bf16.h's bf_sp_chunk_pairs), each round one
# parallel region of three phases: the conversions (the first round), the pack tasks
# that lay the operands out for all the threads, then the tile tasks (and dbias's
# channels, the first round).

cdef int _packed_threads(Py_ssize_t size, Py_ssize_t elements, int n_threads) noexcept nogil:
    # n_threads, or 1 where the whole call is small (size: its products' M N K, elements:
    # those converted)
    if size >= PRODUCT_PARALLEL_MIN or elements >= CONVERT_PARALLEL_MIN:
        return n_threads
    return 1


cdef int _which_product(const bf_sprod* prods, int nprod, Py_ssize_t r, bint tiles,
                        Py_ssize_t* t) noexcept nogil:
    # The product whose pack task (tiles: tile task) t[0] of round r is, t[0] made its
    # index among that product's; -1 past them all, t[0] then counting past them.
    cdef int i
    cdef Py_ssize_t n
    for i in range(nprod):
        if r < bf_sp_chunks(&prods[i]):
            n = bf_sp_tile_tasks(&prods[i], r) if tiles else bf_sp_pack_tasks(&prods[i], r)
            if t[0] < n:
                return i
            t[0] -= n
    return -1


cdef void _pack_task(const bf_sprod* prods, int nprod, Py_ssize_t r,
                     Py_ssize_t t) noexcept nogil:
    cdef int i = _which_product(prods, nprod, r, False, &t)
    if i >= 0:
        bf_sp_pack(&prods[i], r, t)


cdef void _tile_task(int path, const bf_sprod* prods, int nprod, Py_ssize_t r,
                     const Dbias* db, Py_ssize_t t) noexcept nogil:
    cdef int i = _which_product(prods, nprod, r, True, &t)
    if i >= 0:
        bf_sp_run_task(path, &prods[i], r, t)
    else:
        _dbias_task(db, t)


cdef bint _packed_run(int path, const Convert* conv, int nconv, bf_sprod* prods, int nprod,
                      size_t* pairs, const Dbias* db, int nt) noexcept nogil:
    # prods planned (bf_sp_init, `pairs` each); their packing buffers, then the rounds.
    # False where a buffer could not be had (nothing written).  A buffer each, at most
    # 16 MiB and a tile of A's rows: glibc serves an allocation past its mmap threshold
    # (at most 32 MiB) with fresh pages every call, which cost a fault each.
    cdef uint32_t* bufs[2]
    cdef Py_ssize_t rounds = 1, r, nchunks = 0, ndb = 0, npack, ntile, c, t
    cdef int i
    cdef bint ok = True
    for i in range(nprod):
        bufs[i] = <uint32_t*>_scratch(pairs[i], sizeof(uint32_t))
        ok = ok and bufs[i] != NULL
    if not ok:
        for i in range(nprod):
            free(bufs[i])
        return False
    for i in range(nprod):
        bf_sp_attach(&prods[i], bufs[i])
        rounds = max(rounds, bf_sp_chunks(&prods[i]))
    for i in range(nconv):
        nchunks += (conv[i].n + CONVERT_CHUNK - 1) // CONVERT_CHUNK
    if db != NULL:
        ndb = (db.OC + BF_DBIAS_COLS - 1) // BF_DBIAS_COLS
    for r in range(rounds):
        npack = ntile = 0
        for i in range(nprod):
            if r < bf_sp_chunks(&prods[i]):
                npack += bf_sp_pack_tasks(&prods[i], r)
                ntile += bf_sp_tile_tasks(&prods[i], r)
        if r == 0:
            ntile += ndb
        else:
            nchunks = 0
        with parallel(num_threads=nt):
            for c in prange(nchunks, schedule='dynamic', chunksize=1):
                _convert_chunk(conv, nconv, c)
            for t in prange(npack, schedule='dynamic', chunksize=1):
                _pack_task(prods, nprod, r, t)
            for t in prange(ntile, schedule='dynamic', chunksize=1):
                _tile_task(path, prods, nprod, r, db, t)
    for i in range(nprod):
        free(bufs[i])
    return True


# Whether a weight gradient written afresh at few rows (one block of depths) is stored
# past the caches on the VDPBF16PS path (bf_sp_stream_c; _set_stream_dweight, for the
# tests and benchmarks)
cdef bint _stream_dweight = True


def _set_stream_dweight(bint on):
    """Stream fresh weight gradients past the caches (the default) or store them plainly;
    returns the previous setting.  The bits are the same either way."""
    global _stream_dweight
    previous = _stream_dweight
    _stream_dweight = on
    return previous


# Whether dout @ W on the VDPBF16PS paths reads W's rows in place (bf_sp_direct_b): -1
# by the rows, 0 never, 1 always (_set_direct_weight, for the tests and benchmarks)
cdef int _direct_weight_mode = -1


cdef bint _direct_weight(int path, Py_ssize_t N) noexcept nogil:
    # Laying W out costs a read and a write of it per call, shared by the call's N rows;
    # reading it in place costs two unpacks per 16 VDPBF16PS in every tile, and its
    # columns are read 64 bytes a row (the tiles prefetch the next panel's).  Zen 4, 2
    # threads, 12 weights from memory, in place / laid out: GPT-2's five layers 1.07-1.47x
    # at 64 rows, 1.04-1.12x at 128, 0.99-1.05x at 256, 0.93-1.00x at 512, 0.95-0.99x at
    # 1024; SmolLM2-135M's five 1.08-1.34x at 64, 1.10-1.15x at 256, 0.88-1.00x at 512.
    # (bf_sp_direct_b keeps W laid out where its rows are a multiple of 4 KiB apart.)
    if path != PATH_NATIVE and path != PATH_TWIN:
        return False
    if _direct_weight_mode >= 0:
        return _direct_weight_mode == 1
    return N <= DIRECT_WEIGHT_MAX_N


def input_gradient_in_place(Py_ssize_t N, Py_ssize_t C, Py_ssize_t OC):
    """Whether ``matmul_backward_bf16``'s dinp = dout @ weight of N rows, C inputs and
    OC outputs reads the weight in place on this path (no laid-out copy): for the memory
    planner's figure of its buffer."""
    cdef bf_sprod p
    cdef uint16_t one = 0
    if N <= 0 or C <= 0 or OC <= 0 or not _direct_weight(_path, N):
        return False
    bf_sp_init(&p, N, C, OC, &one, OC, 1, &one, C, 1, False, NULL, C, NULL, 1)
    bf_sp_direct_b(&p)
    return bool(p.b_direct)


def _set_sub_blocks(bint on):
    """Whether dout @ W reads a weight whose rows lie a multiple of 4 KiB apart in
    place, a sub-block of depths at a time (True, the default), or lays it out (False),
    at the rows where the VDPBF16PS paths read weights in place; for the tests and
    benchmarks: the results' bits do not depend on it.  Returns the previous setting."""
    global bf_sp_sub
    old = bool(bf_sp_sub)
    bf_sp_sub = on
    return old


def _set_direct_weight(str mode):
    """The VDPBF16PS paths' dout @ W: "auto" (W read in place at few rows, laid out
    at many), "in_place" or "laid_out", for the tests and benchmarks: the results' bits
    do not depend on it.  Returns the previous one."""
    global _direct_weight_mode
    names = {"auto": -1, "laid_out": 0, "in_place": 1}
    if mode not in names:
        raise ValueError(f"mode must be one of {tuple(names)}, got {mode!r}")
    old = next(k for k, v in names.items() if v == _direct_weight_mode)
    _direct_weight_mode = names[mode]
    return old


# The VDPBF16PS forward's orientation: 0 chosen by the shape, 1 out = x W^T, 2 out^T = W
# x^T (_set_forward_layout, for the tests and benchmarks)
cdef int _forward_layout = 0


cdef bint _forward_transposed(int path, Py_ssize_t N, Py_ssize_t C, Py_ssize_t OC) noexcept nogil:
    # Whether the forward runs as out^T = W x^T: the operand laid out is then x (N x C),
    # not the weight (OC x C), and W's rows are read where they lie.  The VDPBF16PS
    # paths (the AMX tiles' loads read A in place either way), where the weight's rows
    # can be read in place (C a multiple of 32) and there are fewer rows than outputs:
    # up to 256 rows, or 8 times fewer (the LM head) and no more than the depth C.
    # Laying W out costs per row of x as 1/N, storing C transposed per product as 1/C.
    # Zen 4, 2 threads, GPT-2's five forwards, 12 weights from memory, medians of 7
    # interleaved: 1.13-1.43x the rate at 64 rows, 1.03-1.25x at 128, 0.96-1.20x at 256.
    # The head (one weight, medians of 3, three rounds, x W^T / W x^T, GFLOP/s): C =
    # 576, 49152 outputs (SmolLM2): 401 / 396 at 512 rows, 398 / 382 at 1024, 417 / 396
    # at 2048, 416 / 391 at 4096; C = 768 (GPT-2): 416 / 425 at 512, 421 / 422 at 1024,
    # 434 / 426 at 2048, 434 / 421 at 4096; C = 896, 151936 outputs: 437 / 431 at 2048;
    # C = 2048, 128256 outputs: 417 / 437 at 512, 432 / 438 at 1024.
    if path != PATH_NATIVE and path != PATH_TWIN:
        return False
    if _forward_layout != 0:
        return _forward_layout == 2
    return C % 32 == 0 and N < OC and (N <= 256 or (8 * N <= OC and N <= C))


cdef int _packed_forward(int path, float* out, const uint16_t* inp, const uint16_t* weight,
                         const float* bias, Py_ssize_t N, Py_ssize_t C, Py_ssize_t OC,
                         int n_threads) except -1 nogil:
    # out = inp @ weight.T + bias: inp read in place, weight laid out once; or out^T =
    # weight @ inp.T + bias (per row): weight read in place, inp laid out once
    cdef bf_sprod p
    cdef int nt = _packed_threads(N * C * OC, 0, n_threads)
    cdef size_t pairs
    if _forward_transposed(path, N, C, OC):
        pairs = bf_sp_init(&p, OC, N, C, weight, C, 1, inp, 1, C, False, out, OC, bias, nt)
        bf_sp_trans_c(&p)
    else:
        pairs = bf_sp_init(&p, N, OC, C, inp, C, 1, weight, 1, C, False, out, OC, bias, nt)
    if not _packed_run(path, NULL, 0, &p, 1, &pairs, NULL, nt):
        _out_of_memory("the packed operands")
    return 0


cdef int _packed_backward(int path, float* dinp, float* dweight, float* dbias,
                          const float* dout, const uint16_t* inp, const uint16_t* weight,
                          Py_ssize_t N, Py_ssize_t C, Py_ssize_t OC, int n_threads,
                          bint ow_dinp, bint ow_dweight, bint ow_dbias) except -1 nogil:
    # dout rounded to bf16 once for both products (read in place by dout @ W, laid out
    # transposed for dout^T @ inp)
    cdef bf_sprod prods[2]
    cdef size_t pairs[2]
    cdef Convert conv
    cdef Dbias db = Dbias(dbias, dout, N, OC, ow_dbias)
    cdef int nprod = 0, nt
    cdef uint16_t* d = <uint16_t*>_scratch(N * OC, sizeof(uint16_t))
    if d == NULL:
        _out_of_memory("dout in bf16")
    conv = Convert(CONVERT_ROUND, dout, d, N * OC)
    nt = _packed_threads(N * C * OC if dinp != NULL or dweight != NULL else 0, N * OC,
                         n_threads)
    if dinp != NULL:
        pairs[nprod] = bf_sp_init(&prods[nprod], N, C, OC, d, OC, 1, weight, C, 1,
                                  not ow_dinp, dinp, C, NULL, nt)
        if _direct_weight(path, N):
            pairs[nprod] = bf_sp_direct_b(&prods[nprod])
        nprod += 1
    if dweight != NULL:     # NULL: a frozen weight (LoRA's base), no weight gradient
        pairs[nprod] = bf_sp_init(&prods[nprod], OC, C, N, d, 1, OC, inp, C, 1,
                                  not ow_dweight, dweight, C, NULL, nt)
        if path == PATH_NATIVE and _stream_dweight:
            bf_sp_stream_c(&prods[nprod])
        nprod += 1
    cdef bint done = _packed_run(path, &conv, 1, prods, nprod, pairs,
                                 &db if dbias != NULL else NULL, nt)
    free(d)
    if not done:
        _out_of_memory("the packed operands")
    return 0


cdef int matmul_forward_bf16_c(float* out, const uint16_t* inp, const uint16_t* weight,
                               const float* bias, Py_ssize_t N, Py_ssize_t C, Py_ssize_t OC,
                               int n_threads) except -1 nogil:
    # where nothing is multiplied (an empty size) the emulated path writes the bias
    if _path == PATH_EMULATED or N == 0 or C == 0 or OC == 0:
        return _emulated_forward(out, inp, weight, bias, N, C, OC, n_threads)
    return _packed_forward(_path, out, inp, weight, bias, N, C, OC, n_threads)


cdef int matmul_backward_bf16_c(float* dinp, float* dweight, float* dbias, const float* dout,
                                const uint16_t* inp, const uint16_t* weight, Py_ssize_t N,
                                Py_ssize_t C, Py_ssize_t OC, int n_threads, bint ow_dinp,
                                bint ow_dweight, bint ow_dbias) except -1 nogil:
    # where nothing is multiplied the emulated path writes the zeros and dbias
    if _path == PATH_EMULATED or N == 0 or C == 0 or OC == 0:
        return _emulated_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC,
                                  n_threads, ow_dinp, ow_dweight, ow_dbias)
    return _packed_backward(_path, dinp, dweight, dbias, dout, inp, weight, N, C, OC,
                            n_threads, ow_dinp, ow_dweight, ow_dbias)


# ---------------------------------------------------------------- Python boundary

def to_bf16(out, inp, *, n_threads=None):
    """out = inp rounded to bf16: float32 ``inp`` of any shape, uint16 ``out`` of its
    shape.  Nearest, ties to even; a NaN stays NaN (quiet, its sign and top payload
    bits kept); finite values past the largest bf16 round to inf."""
    cdef const float* src = <const float*>checked_data("inp", inp, cnp.NPY_FLOAT32, None, False)
    cdef uint16_t* dst = <uint16_t*>checked_data("out", out, cnp.NPY_UINT16, inp.shape, True)
    check_disjoint((("out", out),), (("inp", inp),))
    cdef int nt = resolve_threads(n_threads)
    cdef Py_ssize_t n = inp.size
    with nogil:
        to_bf16_c(dst, src, n, nt)


def from_bf16(out, inp, *, n_threads=None):
    """out = inp widened to float32 (exact): uint16 (bf16) ``inp`` of any shape,
    float32 ``out`` of its shape."""
    cdef const uint16_t* src = <const uint16_t*>checked_data("inp", inp, cnp.NPY_UINT16, None,
                                                             False)
    cdef float* dst = <float*>checked_data("out", out, cnp.NPY_FLOAT32, inp.shape, True)
    check_disjoint((("out", out),), (("inp", inp),))
    cdef int nt = resolve_threads(n_threads)
    cdef Py_ssize_t n = inp.size
    with nogil:
        from_bf16_c(dst, src, n, nt)


cdef int _forward_operands(out, inp, weight, bias, bint bf16_inp, void** inp_p,
                           uint16_t** w_p, float** b_p, float** out_p,
                           Py_ssize_t* dims) except -1:
    # The forwards' checks: inp (N, C) or (B, T, C), bf16 or float32; weight (OC, C)
    # bf16; bias (OC,) float32 or None; out float32; dims = N, C, OC.
    lead, dims[0], dims[1], dims[2] = _matmul_shapes(inp, weight)
    shape = lead + (dims[1],)
    inp_p[0] = (checked_data("inp", inp, cnp.NPY_UINT16, shape, False) if bf16_inp else
                checked_data("inp", inp, cnp.NPY_FLOAT32, shape, False))
    w_p[0] = <uint16_t*>checked_data("weight", weight, cnp.NPY_UINT16, (dims[2], dims[1]), False)
    b_p[0] = NULL
    if bias is not None:
        b_p[0] = <float*>checked_data("bias", bias, cnp.NPY_FLOAT32, (dims[2],), False)
    out_p[0] = <float*>checked_data("out", out, cnp.NPY_FLOAT32, lead + (dims[2],), True)
    check_disjoint((("out", out),), (("inp", inp), ("weight", weight), ("bias", bias)))
    return 0


def matmul_forward_bf16(out, inp, weight, bias, *, n_threads=None):
    """out = inp @ weight.T + bias with bf16 operands and float32 sums.  inp (N, C) or
    (B, T, C) and weight (OC, C) uint16 (bf16); bias (OC,) float32 or None; out (N, OC)
    or (B, T, OC) float32, overwritten."""
    cdef void* inp_p
    cdef uint16_t* w_p
    cdef float* b_p
    cdef float* out_p
    cdef Py_ssize_t dims[3]
    _forward_operands(out, inp, weight, bias, True, &inp_p, &w_p, &b_p, &out_p, dims)
    cdef int nt = resolve_threads(n_threads)
    with nogil:
        matmul_forward_bf16_c(out_p, <uint16_t*>inp_p, w_p, b_p, dims[0], dims[1], dims[2], nt)


def matmul_forward_w16(out, inp, weight, bias, *, n_threads=None):
    """out = inp @ weight.T + bias with the weight alone in bf16: inp (N, C) or (B, T, C)
    float32 (not rounded), weight (OC, C) uint16 (bf16), bias (OC,) float32 or None,
    out float32, overwritten.  The weight is read once at two bytes an element and
    widened (exact) in cache, the products and sums float32: for decoding from bf16
    weights, where reading the weights is the time (``kernels.gemm``'s gemm_w16)."""
    cdef void* inp_p
    cdef uint16_t* w_p
    cdef float* b_p
    cdef float* out_p
    cdef Py_ssize_t dims[3]
    _forward_operands(out, inp, weight, bias, False, &inp_p, &w_p, &b_p, &out_p, dims)
    cdef int nt = resolve_threads(n_threads)
    with nogil:
        gemm_w16(dims[0], dims[2], dims[1], <float*>inp_p, dims[1], w_p, dims[1], b_p, out_p,
                 dims[2], nt)


def matmul_backward_bf16(dinp, dweight, dbias, dout, inp, weight, *, overwrite=False,
                         n_threads=None):
    """Accumulate the gradients of ``out = inp @ weight.T + bias`` with bf16 operands:
    dinp += bf16(dout) @ weight (skipped when dinp is None), dweight += bf16(dout).T @
    inp (skipped when dweight is None: a frozen weight), dbias += dout summed over rows
    (float32 dout, float64 sums; skipped when dbias is None).  dout, dinp, dweight, dbias
    float32; inp and weight uint16 (bf16), as given to the forward; inp may be None where
    dweight is (a frozen weight: dinp needs dout and the weight alone).  ``overwrite`` (a
    bool, or one each for dinp, dweight, dbias): that gradient is set instead, its old
    contents never read."""
    cdef Py_ssize_t N, C, OC
    cdef bint ow_i, ow_w, ow_b
    ow_i, ow_w, ow_b = overwrite_flags(overwrite, ("dinp", "dweight", "dbias"))
    lead, N, C, OC = _backward_shapes(dout, inp, weight, dweight)
    cdef uint16_t* inp_p = NULL
    if inp is not None:
        inp_p = <uint16_t*>checked_data("inp", inp, cnp.NPY_UINT16, lead + (C,), False)
    cdef uint16_t* w_p = <uint16_t*>checked_data("weight", weight, cnp.NPY_UINT16, (OC, C), False)
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
    check_disjoint((("dinp", dinp), ("dweight", dweight), ("dbias", dbias)),
                   (("dout", dout), ("inp", inp), ("weight", weight)))
    cdef int nt = resolve_threads(n_threads)
    with nogil:
        matmul_backward_bf16_c(dinp_p, dw_p, db_p, dout_p, inp_p, w_p, N, C, OC, nt, ow_i,
                               ow_w, ow_b)


# ---------------------------------------------------------------- naive twins

def to_bf16_naive(out, inp):
    """Plain-loop twin of ``to_bf16`` (serial)."""
    cdef const uint32_t* src = <const uint32_t*>checked_data("inp", inp, cnp.NPY_FLOAT32, None,
                                                             False)
    cdef uint16_t* dst = <uint16_t*>checked_data("out", out, cnp.NPY_UINT16, inp.shape, True)
    check_disjoint((("out", out),), (("inp", inp),))
    cdef Py_ssize_t i, n = inp.size
    cdef uint32_t u
    for i in range(n):
        u = src[i]
        if u & 0x7FFFFFFF > 0x7F800000:
            dst[i] = <uint16_t>((u >> 16) | 0x40)
        else:
            dst[i] = <uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


def from_bf16_naive(out, inp):
    """Plain-loop twin of ``from_bf16`` (serial)."""
    cdef const uint16_t* src = <const uint16_t*>checked_data("inp", inp, cnp.NPY_UINT16, None,
                                                             False)
    cdef uint32_t* dst = <uint32_t*>checked_data("out", out, cnp.NPY_FLOAT32, inp.shape, True)
    check_disjoint((("out", out),), (("inp", inp),))
    cdef Py_ssize_t i, n = inp.size
    for i in range(n):
        dst[i] = <uint32_t>src[i] << 16
