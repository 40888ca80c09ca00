"""Causal self-attention, multi-head (GPT-2 / llm.c layout) or grouped-query (Llama's),
forward and backward.

qkv (B, T, (n_head + 2 n_kv_head) hs) holds [q | k | v], each split head-major: n_head
query heads (head h in columns h*hs .. h*hs+hs), then n_kv_head key heads, then as
many value heads; query head h reads kv head h // (n_head / n_kv_head).  K and V are
read where they are, never repeated per query head.  out (B, T, C), C = n_head hs.
With n_kv_head = n_head (the default) qkv is GPT-2's (B, T, 3C).  Scores are scaled
by 1/sqrt(hs).
What the forward keeps for the backward is O(T) per head, not O(T^2): lse
(B, NH, T), each query's log-sum-exp of its scores.  The backward recomputes the
probabilities tile by tile from q, k and lse, P = exp(S - lse), as FlashAttention-2's
backward does (kernels/attention_lanes.h), so nothing T x T is ever stored (the
probabilities it kept before were 4.8 GB at GPT-2 124M, B=8, T=1024).  That costs
one more product, Q K^T, in the backward, and saves writing the probabilities in the
forward and reading them back: at T = 64 to 1024 the pair is as fast as before or
faster.

Parallelism: the forward runs one OpenMP task per (batch, query head), each owning
its slice of out and lse; a thread packs K and V only when its task's kv head is not
the one it packed last.  The backward runs one task per (batch, kv head), owning the
kv head's dk and dv and its group's dq, the group's query heads one after the other
(for GPT-2 that is one per (batch, head)): no atomics, no serial loop over heads, and
sums taken in one order whatever the thread count.  B * NH is 48 or more at GPT-2's
shapes, B * n_kv_head 12 at SmolLM2-135M's (B = 4, 3 kv heads), enough tasks for a
few cores.  Where they are too few for the threads (a batch of one: 8 kv heads for
Llama 3.2 1B, 2 for Qwen2.5-1.5B), the backward runs in two passes over finer tasks
instead: (key block, batch, kv head), each owning a key block's dk and dv, then
(query block, batch, query head), each owning a block's dq, both recomputing the
tiles from operands packed once and shared (seven products instead of five); every
element sums the same terms in the same order, so either way gives the same bits.

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
AVX-512, and eight (6 x 16) otherwise, built by ``target_clones`` for x86-64-v3
(AVX2+FMA) and for the baseline, so the module stays portable while using the FMA
units that PyTorch uses (``kernels.set_vector_lanes`` picks the width for tests;
other compilers get the baseline build).  Queries go in blocks of 64 rows, and
register tiles past the diagonal are never computed.  The forward keeps a query
block's scores in per-thread scratch (in L2) and takes the softmax and the product
with V there; the backward works on 64 x 64 tiles of queries by keys (in L1).
The softmax uses kernels/simd.h's vector exp (Cody-Waite range reduction +
Cephes' polynomial, within 2 ulp, exactly 0 far below the row max).

With ``precision="bf16"`` (``--precision bf16``) the five products take bf16 operands
(kernels/attention_bf16.h): q, k, v, dout and the probabilities P and dS rounded to
nearest even, summed in float32 by VDPBF16PS where kernels.bf16 runs the CPU's bf16
instructions, by its float32 twin elsewhere; the softmax and the log-sum-exps stay
float32.  Same tasks and blocks; each element one sum over its depth pairs in order.

Each kernel has a ``_naive`` twin (plain serial loops, float32 or float64; bf16 on
rounded operands) used by the tests and for finite-difference checks.
"""
cimport numpy as cnp
from cython cimport floating
from cython.parallel cimport prange
from libc.math cimport exp, log, sqrt
from libc.stdint cimport uint16_t, uint32_t, uintptr_t
from libc.stdlib cimport free, malloc

cdef extern from "<stdlib.h>" nogil:
    void* aligned_alloc(size_t alignment, size_t size)

from kernels._openmp cimport omp_get_thread_num_safe
from kernels._common cimport (check_disjoint, checked_data, float_type, lanes_wide,
                              overwrite_flags, resolve_threads)

import numpy as np

from kernels import bf16 as _bf16

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
       (kernels._common's lanes_wide()). */
    #include "bf16.h"
    #define ADT_W 8
    #include "attention_lanes.h"
    #undef ADT_W
    #if ADT_HAVE_V4
    #define ADT_W 16
    #include "attention_lanes.h"
    #undef ADT_W
    #endif

    /* The bf16 builds (kernels/attention_bf16.h): VDPBF16PS where the CPU has
       AVX512_BF16, its float32 twin elsewhere (the same bits where no subnormal
       occurs). */
    #define ABF_FN(f) f##_twin
    #define ABF_ATTR ADT_MULTIVERSION
    #define ABF_INL
    #define ABF_DOT(acc, a, b) bf_dot_twin(acc, a, b)
    #include "attention_bf16.h"
    #if BF_HAVE_NATIVE
    #define ABF_FN(f) f##_nat
    #define ABF_ATTR BF_TARGET
    #define ABF_INL BF_TARGET
    #define ABF_DOT(acc, a, b) bf_dot_nat(acc, a, b)
    #include "attention_bf16.h"
    #define ABF_CALL(nat, f, args) ((nat) ? f##_nat args : f##_twin args)
    #else
    #define ABF_CALL(nat, f, args) (f##_twin args)
    #endif
    static inline ptrdiff_t abf_lines(ptrdiff_t words) { return (words + 15) / 16 * 16; }

    /* Words of a thread's bf16 forward scratch: K^T and V packed, a query block's
       scores and probabilities (float32), its Q and P in bf16 rows. */
    static ptrdiff_t abf_forward_words(ptrdiff_t T, ptrdiff_t hs) {
        return abf_lines(abf_packed_words(hs, T)) + abf_lines(abf_packed_words(T, hs))
               + ATTN_BQ * attn_score_ld(T) + abf_lines(ATTN_BQ * abf_pairs(hs))
               + abf_lines(ATTN_BQ * attn_score_ld(T) / 2);
    }
    /* bf: ABF_NATIVE (the VDPBF16PS build) or ABF_TWIN, | ABF_QKV16 where qkv holds
       bf16 (already rounded) instead of float32; offsets into qkv in elements. */
    enum { ABF_NATIVE = 1, ABF_TWIN = 2, ABF_QKV16 = 4 };
    #define ABF_NAT(bf) (((bf) & 3) == ABF_NATIVE)
    #define ABF_Q16(bf) (((bf) & ABF_QKV16) != 0)
    /* attn_head_forward's bf16 twin: q, k, v at elements qo, ko, vo of qkv. */
    static void abf_head_forward(int bf, float* out, float* lse, const void* qkv,
                                 ptrdiff_t qo, ptrdiff_t ko, ptrdiff_t vo, ptrdiff_t T,
                                 ptrdiff_t ldq, ptrdiff_t ldo, ptrdiff_t hs, float scale,
                                 int pack_kv, float* work) {
        int x16 = ABF_Q16(bf);
        uint32_t* pk = (uint32_t*)work;
        uint32_t* pv = pk + abf_lines(abf_packed_words(hs, T));
        float* scores = (float*)(pv + abf_lines(abf_packed_words(T, hs)));
        uint32_t* qw = (uint32_t*)(scores + ATTN_BQ * attn_score_ld(T));
        uint32_t* pw = qw + abf_lines(ATTN_BQ * abf_pairs(hs));
        ABF_CALL(ABF_NAT(bf), abf_head_forward,
                 (out, lse, abf_at(qkv, x16, qo), abf_at(qkv, x16, ko), abf_at(qkv, x16, vo),
                  x16, T, ldq, ldo, hs, scale, pack_kv, pk, pv, scores, qw, pw));
    }
    /* The backward's tiles: P and dS in float32, P^T, dS^T and dS in bf16; words. */
    static ptrdiff_t abf_tile_words(void) {
        return 2 * ATTN_BQ * ATTN_BK + 2 * abf_pairs(ATTN_BQ) * ATTN_BK
               + ATTN_BQ * ATTN_BK / 2;
    }
    static void abf_tiles(abf_bwd_ops* o, float* work) {
        o->ptile = work;
        o->dstile = work + ATTN_BQ * ATTN_BK;
        o->pt = (uint32_t*)(o->dstile + ATTN_BQ * ATTN_BK);
        o->dst = o->pt + abf_pairs(ATTN_BQ) * ATTN_BK;
        o->dsw = o->dst + abf_pairs(ATTN_BQ) * ATTN_BK;
    }
    /* Words of a kv head's packed K^T, V^T and K. */
    static ptrdiff_t abf_kv_words(ptrdiff_t T, ptrdiff_t hs) {
        return 2 * abf_lines(abf_packed_words(hs, T)) + abf_lines(abf_packed_words(T, hs));
    }
    static void abf_kv_ops(abf_bwd_ops* o, uint32_t* kv, ptrdiff_t T, ptrdiff_t hs) {
        o->pkt = kv;
        o->pvt = kv + abf_lines(abf_packed_words(hs, T));
        o->pk = o->pvt + abf_lines(abf_packed_words(hs, T));
    }
    /* Words of a thread's one-pass bf16 backward scratch: the kv head's operands, a
       query block's four panels, the tiles, D_i. */
    static ptrdiff_t abf_backward_words(ptrdiff_t T, ptrdiff_t hs) {
        return abf_kv_words(T, hs) + 4 * abf_panel_words(ATTN_BQ, hs) + abf_tile_words()
               + ATTN_BQ;
    }
    /* attn_kv_backward's bf16 twin, on scratch of abf_backward_words; the batch's qkv
       rows from element qkv0 of qkv. */
    static void abf_kv_backward(int bf, float* dqkv, const float* dout, const void* qkv,
                                ptrdiff_t qkv0, const float* out, const float* lse, ptrdiff_t T,
                                ptrdiff_t ldq, ptrdiff_t ldo, ptrdiff_t hs, ptrdiff_t h0,
                                ptrdiff_t rep, ptrdiff_t kcol, ptrdiff_t vcol, float scale,
                                int overwrite, float* work) {
        abf_bwd_ops o;
        ptrdiff_t panel = abf_panel_words(ATTN_BQ, hs);
        abf_kv_ops(&o, (uint32_t*)work, T, hs);
        o.qw = o.pk + abf_lines(abf_packed_words(T, hs));
        o.dow = o.qw + panel, o.pq = o.dow + panel, o.pdo = o.pq + panel;
        abf_tiles(&o, (float*)(o.pdo + panel));
        float* drow = o.ptile + abf_tile_words();
        o.drow = drow;
        int x16 = ABF_Q16(bf);
        for (ptrdiff_t h = h0; h < h0 + rep; h++)
            ABF_CALL(ABF_NAT(bf), abf_head_backward,
                     (dqkv + h * hs, dqkv + kcol, dqkv + vcol, dout + h * hs,
                      abf_at(qkv, x16, qkv0 + h * hs), abf_at(qkv, x16, qkv0 + kcol),
                      abf_at(qkv, x16, qkv0 + vcol), x16, out + h * hs, lse + h * T, T, ldq,
                      ldo, hs, scale, overwrite, overwrite && h == h0, h == h0, &o, drow));
    }
    /* The two-pass bf16 backward's parts: shared operands (kv: a kv head's
       abf_kv_words; qw, dow, pq, pdo: panels of abf_panel_words, the group's first
       head's first query block, nblk a head), per-thread tiles of abf_tile_words. */
    static void abf_prepare_kv(int bf, uint32_t* kv, const void* qkv, ptrdiff_t ko,
                               ptrdiff_t vo, ptrdiff_t T, ptrdiff_t ldq, ptrdiff_t hs) {
        abf_bwd_ops o;
        int x16 = ABF_Q16(bf);
        abf_kv_ops(&o, kv, T, hs);
        ABF_CALL(ABF_NAT(bf), abf_prepare_kv, (o.pkt, o.pvt, o.pk, abf_at(qkv, x16, ko),
                                               abf_at(qkv, x16, vo), x16, T, ldq, hs));
    }
    static void abf_prepare_query(int bf, uint32_t* qw, uint32_t* dow, uint32_t* pq,
                                  uint32_t* pdo, float* drow, const void* qkv, ptrdiff_t qo,
                                  const float* dO, const float* o, ptrdiff_t T,
                                  ptrdiff_t ldq, ptrdiff_t ldo, ptrdiff_t hs, ptrdiff_t i0) {
        int x16 = ABF_Q16(bf);
        ABF_CALL(ABF_NAT(bf), abf_prepare_query, (qw, dow, pq, pdo, drow, abf_at(qkv, x16, qo),
                                                  x16, dO, o, T, ldq, ldo, hs, i0));
    }
    static void abf_key_backward(int bf, float* dk, float* dv, const float* lse, ptrdiff_t T,
                                 ptrdiff_t ldq, ptrdiff_t hs, float scale, ptrdiff_t rep,
                                 int overwrite_kv, ptrdiff_t j0, uint32_t* kv, uint32_t* qw,
                                 uint32_t* dow, uint32_t* pq, uint32_t* pdo, ptrdiff_t nblk,
                                 const float* drows, float* tiles) {
        abf_bwd_ops sh, tl;
        abf_kv_ops(&sh, kv, T, hs);
        sh.qw = qw, sh.dow = dow, sh.pq = pq, sh.pdo = pdo;
        abf_tiles(&tl, tiles);
        ABF_CALL(ABF_NAT(bf), abf_key_backward, (dk, dv, lse, T, ldq, hs, scale, rep, overwrite_kv,
                                         j0, &sh, abf_panel_words(ATTN_BQ, hs),
                                         nblk, drows, &tl));
    }
    static void abf_query_backward(int bf, float* dq, const float* lse, ptrdiff_t T,
                                   ptrdiff_t ldq, ptrdiff_t hs, float scale, int overwrite_q,
                                   ptrdiff_t i0, uint32_t* kv, uint32_t* qw, uint32_t* dow,
                                   const float* drow, float* tiles) {
        abf_bwd_ops sh, tl;
        abf_kv_ops(&sh, kv, T, hs);
        sh.qw = qw, sh.dow = dow;
        abf_tiles(&tl, tiles);
        ABF_CALL(ABF_NAT(bf), abf_query_backward, (dq, lse, T, ldq, hs, scale, overwrite_q, i0,
                                           &sh, drow, &tl));
    }

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

    /* wide: ATTN_WIDE (sixteen lanes), | ATTN_ROUND_BF16 for the emulated bf16 products
       (P and dS rounded to bf16 values; the caller rounded q, k, v and dO). */
    enum { ATTN_WIDE = 1, ATTN_ROUND_BF16 = 2 };
    static void attn_head_forward(int wide, float* out, float* lse, const float* q,
                                  const float* k, const float* v, ptrdiff_t T, ptrdiff_t ldq,
                                  ptrdiff_t ldo, ptrdiff_t hs, float scale, int pack_kv,
                                  float* pk, float* pv, float* scores) {
        ADT_LANES_CALL(wide & ATTN_WIDE, attn_head_forward,
                       (out, lse, q, k, v, T, ldq, ldo, hs, scale, pack_kv, pk, pv, scores,
                        (wide & ATTN_ROUND_BF16) != 0));
    }
    /* One (batch, kv head) task of the backward: the rep query heads of its group,
       h0 .. h0 + rep - 1, one after the other, each adding its share into the kv
       head's dk and dv (the first writes them, with overwrite), K and V packed once
       for the group.  The task owns the group's dq and the kv head's dk and dv, and
       adds in one order, whatever the thread count.  dqkv, qkv point at the batch's
       rows (ldq floats each), dout, out at the batch's (ldo floats), lse at the
       batch's (NH, T); kcol and vcol are the kv head's first columns of k and v. */
    static void attn_kv_backward(int wide, float* dqkv, const float* dout, const float* qkv,
                                 const float* out, const float* lse, ptrdiff_t T,
                                 ptrdiff_t ldq, ptrdiff_t ldo, ptrdiff_t hs, ptrdiff_t h0,
                                 ptrdiff_t rep, ptrdiff_t kcol, ptrdiff_t vcol, float scale,
                                 int overwrite, float* pkt, float* pvt, float* pk, float* pq,
                                 float* pdo, float* ptile, float* dstile, float* drow) {
        for (ptrdiff_t h = h0; h < h0 + rep; h++)
            ADT_LANES_CALL(wide & ATTN_WIDE, attn_head_backward,
                           (dqkv + h * hs, dqkv + kcol, dqkv + vcol, dout + h * hs,
                            qkv + h * hs, qkv + kcol, qkv + vcol, out + h * hs, lse + h * T,
                            T, ldq, ldo, hs, scale, overwrite, overwrite && h == h0, h == h0,
                            pkt, pvt, pk, pq, pdo, ptile, dstile, drow,
                            (wide & ATTN_ROUND_BF16) != 0));
    }
    /* The two-pass backward (attention_backward_c): its preparation, a key block's dk
       and dv, a query block's dq. */
    static void attn_prepare_kv(int wide, float* pkt, float* pvt, float* pk, const float* k,
                                const float* v, ptrdiff_t T, ptrdiff_t ldq, ptrdiff_t hs) {
        ADT_LANES_CALL(wide & ATTN_WIDE, attn_prepare_kv_task, (pkt, pvt, pk, k, v, T, ldq, hs));
    }
    static void attn_prepare_query(int wide, float* pq, float* pdo, float* drow,
                                   const float* q, const float* dO, const float* o,
                                   ptrdiff_t T, ptrdiff_t ldq, ptrdiff_t ldo, ptrdiff_t hs,
                                   ptrdiff_t i0) {
        ADT_LANES_CALL(wide & ATTN_WIDE, attn_prepare_query_task, (pq, pdo, drow, q, dO, o, T, ldq, ldo,
                                                       hs, i0));
    }
    static void attn_key_backward(int wide, float* dk, float* dv, const float* dO,
                                  const float* q, const float* lse, ptrdiff_t T, ptrdiff_t ldq,
                                  ptrdiff_t ldo, ptrdiff_t hs, float scale, ptrdiff_t rep,
                                  int overwrite_kv, ptrdiff_t j0, const float* pkt,
                                  const float* pvt, const float* pq, const float* pdo,
                                  ptrdiff_t panel, ptrdiff_t nblk, const float* drows,
                                  float* ptile, float* dstile) {
        ADT_LANES_CALL(wide & ATTN_WIDE, attn_key_backward,
                       (dk, dv, dO, q, lse, T, ldq, ldo, hs, scale, rep, overwrite_kv, j0, pkt,
                        pvt, pq, pdo, panel, nblk, drows, ptile, dstile,
                        (wide & ATTN_ROUND_BF16) != 0));
    }
    static void attn_query_backward(int wide, float* dq, const float* dO, const float* q,
                                    const float* lse, ptrdiff_t T, ptrdiff_t ldq,
                                    ptrdiff_t ldo, ptrdiff_t hs, float scale, int overwrite_q,
                                    ptrdiff_t i0, const float* pkt, const float* pvt,
                                    const float* pk, const float* drow, float* ptile,
                                    float* dstile) {
        ADT_LANES_CALL(wide & ATTN_WIDE, attn_query_backward,
                       (dq, dO, q, lse, T, ldq, ldo, hs, scale, overwrite_q, i0, pkt, pvt, pk,
                        drow, ptile, dstile, (wide & ATTN_ROUND_BF16) != 0));
    }
    """
    enum:
        ATTN_BQ
        ATTN_BK
        ATTN_ROUND_BF16
    void bf16_round_f32_span(float* out, const float* inp, Py_ssize_t n) noexcept nogil
    void bf16_widen_span(float* out, const uint16_t* inp, Py_ssize_t n) noexcept nogil
    Py_ssize_t abf_forward_words(Py_ssize_t T, Py_ssize_t hs) noexcept nogil
    void abf_head_forward(int bf, float* out, float* lse, const void* qkv, Py_ssize_t qo,
                          Py_ssize_t ko, Py_ssize_t vo, Py_ssize_t T, Py_ssize_t ldq,
                          Py_ssize_t ldo, Py_ssize_t hs, float scale, bint pack_kv,
                          float* work) noexcept nogil
    Py_ssize_t abf_backward_words(Py_ssize_t T, Py_ssize_t hs) noexcept nogil
    void abf_kv_backward(int bf, float* dqkv, const float* dout, const void* qkv,
                         Py_ssize_t qkv0, const float* out, const float* lse, Py_ssize_t T, Py_ssize_t ldq,
                         Py_ssize_t ldo, Py_ssize_t hs, Py_ssize_t h0, Py_ssize_t rep,
                         Py_ssize_t kcol, Py_ssize_t vcol, float scale, bint overwrite,
                         float* work) noexcept nogil
    Py_ssize_t abf_kv_words(Py_ssize_t T, Py_ssize_t hs) noexcept nogil
    Py_ssize_t abf_panel_words(Py_ssize_t bq, Py_ssize_t hs) noexcept nogil
    Py_ssize_t abf_tile_words() noexcept nogil
    void abf_prepare_kv(int bf, uint32_t* kv, const void* qkv, Py_ssize_t ko, Py_ssize_t vo,
                        Py_ssize_t T, Py_ssize_t ldq, Py_ssize_t hs) noexcept nogil
    void abf_prepare_query(int bf, uint32_t* qw, uint32_t* dow, uint32_t* pq, uint32_t* pdo,
                           float* drow, const void* qkv, Py_ssize_t qo, const float* dO,
                           const float* o,
                           Py_ssize_t T, Py_ssize_t ldq, Py_ssize_t ldo, Py_ssize_t hs,
                           Py_ssize_t i0) noexcept nogil
    void abf_key_backward(int bf, float* dk, float* dv, const float* lse, Py_ssize_t T,
                          Py_ssize_t ldq, Py_ssize_t hs, float scale, Py_ssize_t rep,
                          bint overwrite_kv, Py_ssize_t j0, uint32_t* kv, uint32_t* qw,
                          uint32_t* dow, uint32_t* pq, uint32_t* pdo, Py_ssize_t nblk,
                          const float* drows, float* tiles) noexcept nogil
    void abf_query_backward(int bf, float* dq, const float* lse, Py_ssize_t T,
                            Py_ssize_t ldq, Py_ssize_t hs, float scale, bint overwrite_q,
                            Py_ssize_t i0, uint32_t* kv, uint32_t* qw, uint32_t* dow,
                            const float* drow, float* tiles) noexcept nogil
    Py_ssize_t attn_pack_floats(Py_ssize_t T, Py_ssize_t hs) noexcept nogil
    Py_ssize_t attn_panel_floats(Py_ssize_t hs) noexcept nogil
    Py_ssize_t attn_score_ld(Py_ssize_t T) noexcept nogil
    void attn_head_forward(int wide, float* out, float* lse, const float* q, const float* k,
                           const float* v, Py_ssize_t T, Py_ssize_t ldq, Py_ssize_t ldo,
                           Py_ssize_t hs, float scale, bint pack_kv, float* pk, float* pv,
                           float* scores) noexcept nogil
    void attn_kv_backward(int wide, float* dqkv, const float* dout, const float* qkv,
                          const float* out, const float* lse, Py_ssize_t T, Py_ssize_t ldq,
                          Py_ssize_t ldo, Py_ssize_t hs, Py_ssize_t h0, Py_ssize_t rep,
                          Py_ssize_t kcol, Py_ssize_t vcol, float scale, bint overwrite,
                          float* pkt, float* pvt, float* pk, float* pq, float* pdo,
                          float* ptile, float* dstile, float* drow) noexcept nogil
    void attn_prepare_kv(int wide, float* pkt, float* pvt, float* pk, const float* k,
                         const float* v, Py_ssize_t T, Py_ssize_t ldq,
                         Py_ssize_t hs) noexcept nogil
    void attn_prepare_query(int wide, float* pq, float* pdo, float* drow, const float* q,
                            const float* dO, const float* o, Py_ssize_t T, Py_ssize_t ldq,
                            Py_ssize_t ldo, Py_ssize_t hs, Py_ssize_t i0) noexcept nogil
    void attn_key_backward(int wide, float* dk, float* dv, const float* dO, const float* q,
                           const float* lse, Py_ssize_t T, Py_ssize_t ldq, Py_ssize_t ldo,
                           Py_ssize_t hs, float scale, Py_ssize_t rep, bint overwrite_kv,
                           Py_ssize_t j0, const float* pkt, const float* pvt, const float* pq,
                           const float* pdo, Py_ssize_t panel, Py_ssize_t nblk,
                           const float* drows, float* ptile, float* dstile) noexcept nogil
    void attn_query_backward(int wide, float* dq, const float* dO, const float* q,
                             const float* lse, Py_ssize_t T, Py_ssize_t ldq, Py_ssize_t ldo,
                             Py_ssize_t hs, float scale, bint overwrite_q, Py_ssize_t i0,
                             const float* pkt, const float* pvt, const float* pk,
                             const float* drow, float* ptile, float* dstile) noexcept nogil


cdef struct Scratch:
    # One malloc for all threads: each thread's slice of floats, 64-byte aligned for the
    # packed panels, then a cache line per thread for the forward's held_kv.
    void* raw
    float* base
    Py_ssize_t per_thread
    # The (batch, kv head) whose K and V a thread's slice holds (-1: none yet), at
    # held_kv[8 * thread].
    Py_ssize_t* held_kv


cdef int _scratch_alloc(Scratch* s, int n_threads, Py_ssize_t floats) except -1 nogil:
    cdef int t
    s.per_thread = (floats + 15) // 16 * 16
    s.raw = malloc(n_threads * (s.per_thread * sizeof(float) + 64) + 64)
    if s.raw == NULL:
        with gil:
            raise MemoryError(f"attention: cannot allocate {n_threads} scratch buffers of "
                              f"{floats} floats")
    s.base = <float*>((<uintptr_t>s.raw + 63) & ~(<uintptr_t>63))
    s.held_kv = <Py_ssize_t*>(s.base + n_threads * s.per_thread)
    for t in range(n_threads):
        s.held_kv[8 * t] = -1
    return 0


cdef inline Py_ssize_t _lines(Py_ssize_t floats) noexcept nogil:
    # whole 64-byte lines, so that each scratch panel starts on one
    return (floats + 15) // 16 * 16


# bf16 operands: not (BF_NONE, float32's kernels), by VDPBF16PS (BF_NATIVE) or by its
# float32 twin (BF_TWIN); with BF_QKV16 added, qkv holds bf16 (uint16), not float32.
cdef enum:
    BF_NONE = 0
    BF_NATIVE = 1
    BF_TWIN = 2
    BF_EMULATED = 3     # float32's kernels on rounded q, k, v, dout, rounding P and dS
    BF_QKV16 = 4


cdef inline bint _packed_bf16(int bf) noexcept nogil:
    # the bf16 kernels (kernels/attention_bf16.h): VDPBF16PS or its twin
    return bf != BF_NONE and bf != BF_EMULATED


cdef inline int _lanes(int bf) noexcept nogil:
    # the float32 kernels' width, and whether they round P and dS (BF_EMULATED)
    return lanes_wide() | (ATTN_ROUND_BF16 if bf == BF_EMULATED else 0)


cdef int attention_forward_c(float* out, float* lse, const float* qkv,
                             Py_ssize_t B, Py_ssize_t T, Py_ssize_t C, Py_ssize_t NH,
                             Py_ssize_t NKV, int n_threads, int bf) except -1 nogil:
    # One task per (batch, query head).  A thread packs K and V only when its task's kv
    # head is not the one its scratch holds: the static schedule gives each thread a
    # run of consecutive query heads, mostly of one group.
    cdef Py_ssize_t hs = C // NH, rep = NH // NKV, ldq = C + 2 * NKV * hs
    cdef float scale = 1.0 / sqrt(<double>hs)
    cdef Py_ssize_t bh, b, h, kv, t
    cdef const float* k
    cdef float* work
    cdef bint pack_kv
    cdef Scratch s
    cdef Py_ssize_t pack = _lines(attn_pack_floats(T, hs))
    cdef int wide = _lanes(bf)
    _scratch_alloc(&s, n_threads, abf_forward_words(T, hs) if _packed_bf16(bf)
                   else 2 * pack + ATTN_BQ * attn_score_ld(T))
    for bh in prange(B * NH, schedule='static', nogil=True, num_threads=n_threads):
        b = bh // NH
        h = bh % NH
        kv = b * NKV + h // rep
        t = omp_get_thread_num_safe()
        pack_kv = s.held_kv[8 * t] != kv
        s.held_kv[8 * t] = kv
        work = s.base + t * s.per_thread
        k = qkv + b * T * ldq + C + (h // rep) * hs
        if _packed_bf16(bf):
            abf_head_forward(bf, out + b * T * C + h * hs, lse + bh * T, qkv,
                             b * T * ldq + h * hs, b * T * ldq + C + (h // rep) * hs,
                             b * T * ldq + C + (NKV + h // rep) * hs, T, ldq, C, hs, scale,
                             pack_kv, work)
        else:
            attn_head_forward(wide, out + b * T * C + h * hs, lse + bh * T,
                              qkv + b * T * ldq + h * hs, k, k + NKV * hs, T, ldq, C, hs,
                              scale, pack_kv, work, work + pack, work + 2 * pack)
    free(s.raw)
    return 0


# Which backward runs: 0 the faster for the threads (_two_passes), 1 one pass, 2 two.
cdef int _backward_mode = 0


def set_backward_passes(int mode):
    """Run ``attention_backward`` in one pass (1), in two (2), or as the thread count
    suits (0, the default); for tests and benchmarks, returns the previous mode.  Both
    give the same bits."""
    global _backward_mode
    if mode not in (0, 1, 2):
        raise ValueError(f"mode must be 0, 1 or 2, got {mode!r}")
    old = _backward_mode
    _backward_mode = mode
    return old


cdef inline bint _two_passes(Py_ssize_t tasks, Py_ssize_t T, int n_threads) noexcept nogil:
    # One pass runs ceil(tasks / n) rounds of 1/tasks of the work each; two passes run
    # 7/5 of it spread over all n threads, and measured 1.15-1.25x faster than one with
    # a single task on 2 threads (Zen 3, T = 1024, 8 heads, 1 kv head), as if they did
    # 1.65-1.75 times its work.  So two where ceil(tasks/n)/tasks > 1.7/n: a batch of one
    # with 8 kv heads on 16 threads, or Qwen2.5-1.5B's 2 on 4 or more.
    if _backward_mode:
        return _backward_mode == 2
    return (n_threads > 1 and T > ATTN_BQ
            and 10 * n_threads * ((tasks + n_threads - 1) // n_threads) > 17 * tasks)


cdef int _backward_two_passes(float* dqkv, const float* dout, const float* qkv,
                              const float* out, const float* lse, Py_ssize_t B, Py_ssize_t T,
                              Py_ssize_t C, Py_ssize_t NH, Py_ssize_t NKV, bint overwrite,
                              int n_threads, int bf) except -1 nogil:
    # For fewer (batch, kv head) tasks than threads (a batch of one and a few kv heads:
    # Qwen2.5-1.5B has 2): the first pass's tasks are (key block, batch, kv head), each
    # owning key block j's dk and dv over its group's query heads and the query blocks
    # from the diagonal on; the second's (query block, batch, query head), each owning a
    # block's dq.  Both recompute the tiles (7 products instead of 5) from operands
    # packed once beforehand and shared; each output element sums the same terms in the
    # same order as attn_head_backward's, so the bits are the one pass's.  Largest tasks
    # first, handed out dynamically.  Shared, in 4-byte units: each kv head's packed K^T,
    # V^T and K (kvw), then per query block its panels (float32: Q and dO packed; bf16
    # operands: Q and dO as rows and packed), then each head's D.
    cdef Py_ssize_t hs = C // NH, rep = NH // NKV, ldq = C + 2 * NKV * hs
    cdef float scale = 1.0 / sqrt(<double>hs)
    cdef bint vdp = _packed_bf16(bf)
    cdef Py_ssize_t pack = _lines(attn_pack_floats(T, hs))
    cdef Py_ssize_t kvw = abf_kv_words(T, hs) if vdp else 3 * pack
    cdef Py_ssize_t panel = abf_panel_words(ATTN_BQ, hs) if vdp else _lines(attn_panel_floats(hs))
    cdef Py_ssize_t n_panels = 4 if vdp else 2
    cdef Py_ssize_t nqb = (T + ATTN_BQ - 1) // ATTN_BQ, nkb = (T + ATTN_BK - 1) // ATTN_BK
    cdef Py_ssize_t tile = ATTN_BQ * ATTN_BK
    cdef Py_ssize_t x, y, b, g, h, blk, i0, at
    cdef Py_ssize_t kv_floats = B * NKV * kvw, panels_floats = B * NH * nqb * panel
    cdef Py_ssize_t shared_floats = kv_floats + n_panels * panels_floats + B * NH * T
    cdef int wide = _lanes(bf)
    cdef float* work
    cdef float* kvp
    cdef float* shared
    cdef float* pan0
    cdef float* pan1
    cdef float* pan2
    cdef float* pan3
    cdef float* drows
    cdef Scratch s
    _scratch_alloc(&s, n_threads, abf_tile_words() if vdp else 2 * tile)
    shared = <float*>aligned_alloc(64, (shared_floats * sizeof(float) + 63) // 64 * 64)
    if shared == NULL:
        free(s.raw)
        with gil:
            raise MemoryError(f"attention: cannot allocate the backward's packed operands "
                              f"({shared_floats} floats)")
    pan0 = shared + kv_floats           # float32: pq, pdo; bf16: qw, dow, pq, pdo
    pan1 = pan0 + panels_floats
    pan2 = pan1 + panels_floats
    pan3 = pan2 + panels_floats
    drows = pan0 + n_panels * panels_floats
    for x in prange(B * NKV + B * NH * nqb, schedule='dynamic', nogil=True,
                    num_threads=n_threads):
        if x < B * NKV:
            b = x // NKV
            g = x % NKV
            kvp = shared + x * kvw
            if vdp:
                abf_prepare_kv(bf, <uint32_t*>kvp, qkv, b * T * ldq + C + g * hs,
                               b * T * ldq + C + (NKV + g) * hs, T, ldq, hs)
            else:
                attn_prepare_kv(wide, kvp, kvp + pack, kvp + 2 * pack,
                                qkv + b * T * ldq + C + g * hs,
                                qkv + b * T * ldq + C + (NKV + g) * hs, T, ldq, hs)
        else:
            y = x - B * NKV                       # (batch * head, query block)
            b = y // (NH * nqb)
            h = y // nqb % NH
            blk = y % nqb
            if vdp:
                abf_prepare_query(bf, <uint32_t*>(pan0 + y * panel),
                                  <uint32_t*>(pan1 + y * panel), <uint32_t*>(pan2 + y * panel),
                                  <uint32_t*>(pan3 + y * panel),
                                  drows + (b * NH + h) * T + blk * ATTN_BQ, qkv,
                                  b * T * ldq + h * hs, dout + b * T * C + h * hs,
                                  out + b * T * C + h * hs, T, ldq, C, hs, blk * ATTN_BQ)
            else:
                attn_prepare_query(wide, pan0 + y * panel, pan1 + y * panel,
                                   drows + (b * NH + h) * T + blk * ATTN_BQ,
                                   qkv + b * T * ldq + h * hs, dout + b * T * C + h * hs,
                                   out + b * T * C + h * hs, T, ldq, C, hs, blk * ATTN_BQ)
    for x in prange(B * NKV * nkb, schedule='dynamic', nogil=True, num_threads=n_threads):
        blk = x // (B * NKV)                      # key blocks in order: the largest first
        b = x % (B * NKV) // NKV
        g = x % NKV
        work = s.base + omp_get_thread_num_safe() * s.per_thread
        kvp = shared + (b * NKV + g) * kvw
        at = (b * NH + g * rep) * nqb * panel
        if vdp:
            abf_key_backward(bf, dqkv + b * T * ldq + C + g * hs,
                             dqkv + b * T * ldq + C + (NKV + g) * hs,
                             lse + (b * NH + g * rep) * T, T, ldq, hs, scale, rep, overwrite,
                             blk * ATTN_BK, <uint32_t*>kvp, <uint32_t*>(pan0 + at),
                             <uint32_t*>(pan1 + at), <uint32_t*>(pan2 + at),
                             <uint32_t*>(pan3 + at), nqb, drows + (b * NH + g * rep) * T,
                             work)
        else:
            attn_key_backward(wide, dqkv + b * T * ldq + C + g * hs,
                              dqkv + b * T * ldq + C + (NKV + g) * hs,
                              dout + b * T * C + g * rep * hs, qkv + b * T * ldq + g * rep * hs,
                              lse + (b * NH + g * rep) * T, T, ldq, C, hs, scale, rep,
                              overwrite, blk * ATTN_BK, kvp, kvp + pack, pan0 + at, pan1 + at,
                              panel, nqb, drows + (b * NH + g * rep) * T, work, work + tile)
    for x in prange(B * NH * nqb, schedule='dynamic', nogil=True, num_threads=n_threads):
        blk = nqb - 1 - x // (B * NH)             # query blocks from the last: the largest
        b = x % (B * NH) // NH
        h = x % NH
        i0 = blk * ATTN_BQ
        work = s.base + omp_get_thread_num_safe() * s.per_thread
        kvp = shared + (b * NKV + h // rep) * kvw
        if vdp:
            at = ((b * NH + h) * nqb + blk) * panel
            abf_query_backward(bf, dqkv + b * T * ldq + h * hs, lse + (b * NH + h) * T, T,
                               ldq, hs, scale, overwrite, i0, <uint32_t*>kvp,
                               <uint32_t*>(pan0 + at), <uint32_t*>(pan1 + at),
                               drows + (b * NH + h) * T + i0, work)
        else:
            attn_query_backward(wide, dqkv + b * T * ldq + h * hs, dout + b * T * C + h * hs,
                                qkv + b * T * ldq + h * hs, lse + (b * NH + h) * T, T, ldq, C,
                                hs, scale, overwrite, i0, kvp, kvp + pack, kvp + 2 * pack,
                                drows + (b * NH + h) * T + i0, work, work + tile)
    free(s.raw)
    free(shared)
    return 0


cdef int attention_backward_c(float* dqkv, const float* dout, const float* qkv,
                              const float* out, const float* lse, Py_ssize_t B, Py_ssize_t T,
                              Py_ssize_t C, Py_ssize_t NH, Py_ssize_t NKV, bint overwrite,
                              int n_threads, int bf) except -1 nogil:
    # One task per (batch, kv head), owning the kv head's dk and dv and its group's dq
    # (attn_kv_backward): B * NKV tasks, B * NH for GPT-2.  Where that leaves threads
    # idle, two passes over finer tasks (_backward_two_passes).
    if _two_passes(B * NKV, T, n_threads):
        return _backward_two_passes(dqkv, dout, qkv, out, lse, B, T, C, NH, NKV, overwrite,
                                    n_threads, bf)
    cdef Py_ssize_t hs = C // NH, rep = NH // NKV, ldq = C + 2 * NKV * hs
    cdef float scale = 1.0 / sqrt(<double>hs)
    cdef Py_ssize_t bg, b, g
    cdef float* work
    cdef Scratch s
    cdef Py_ssize_t pack = _lines(attn_pack_floats(T, hs))
    cdef Py_ssize_t panel = _lines(attn_panel_floats(hs))
    cdef Py_ssize_t tile = ATTN_BQ * ATTN_BK
    cdef Py_ssize_t tiles = 3 * pack + 2 * panel
    cdef int wide = _lanes(bf)
    _scratch_alloc(&s, n_threads, abf_backward_words(T, hs) if _packed_bf16(bf)
                   else tiles + 2 * tile + ATTN_BQ)
    for bg in prange(B * NKV, schedule='static', nogil=True, num_threads=n_threads):
        b = bg // NKV
        g = bg % NKV
        work = s.base + omp_get_thread_num_safe() * s.per_thread
        if _packed_bf16(bf):
            abf_kv_backward(bf, dqkv + b * T * ldq, dout + b * T * C, qkv, b * T * ldq,
                            out + b * T * C, lse + b * NH * T, T, ldq, C,
                            hs, g * rep, rep, C + g * hs, C + (NKV + g) * hs, scale,
                            overwrite, work)
        else:
            attn_kv_backward(wide, dqkv + b * T * ldq, dout + b * T * C, qkv + b * T * ldq,
                             out + b * T * C, lse + b * NH * T, T, ldq, C, hs, g * rep, rep,
                             C + g * hs, C + (NKV + g) * hs, scale, overwrite,
                             work, work + pack, work + 2 * pack, work + 3 * pack,
                             work + 3 * pack + panel, work + tiles, work + tiles + tile,
                             work + tiles + 2 * tile)
    free(s.raw)
    return 0


# ---------------------------------------------------------------- Python boundary

def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def attention_shapes(qkv, n_head, n_kv_head=None):
    """(B, T, n_head, n_kv_head, head size) of a packed qkv (B, T, (n_head + 2 n_kv_head)
    * head size), checking the head split: n_kv_head (None: n_head) must divide n_head."""
    if not isinstance(qkv, np.ndarray) or qkv.ndim != 3:
        raise ValueError(f"qkv must be a 3-D (B, T, (n_head + 2*n_kv_head) * head_size) "
                         f"array, got {getattr(qkv, 'shape', type(qkv).__name__)}")
    NH = _positive_int("n_head", n_head)
    NKV = NH if n_kv_head is None else _positive_int("n_kv_head", n_kv_head)
    if NH % NKV:
        raise ValueError(f"n_kv_head = {NKV} does not divide n_head = {NH}: each kv head "
                         f"must serve the same number of query heads")
    B, T, W = qkv.shape
    if W == 0:
        # A head size of 0 makes the score scale 1/sqrt(0): there is no attention to take.
        raise ValueError("qkv's last dimension is 0: C (and the head size) must be positive")
    heads = NH + 2 * NKV
    if W % heads:
        raise ValueError(f"qkv's last dimension {W} must be (n_head + 2*n_kv_head) * "
                         f"head_size = {heads} * head_size (q, k and v heads) for "
                         f"n_head = {NH}, n_kv_head = {NKV}")
    return B, T, NH, NKV, W // heads


def _check_forward(out, lse, qkv, n_head, n_kv_head, int ft, int qkv_ft=-1):
    B, T, NH, NKV, hs = attention_shapes(qkv, n_head, n_kv_head)
    checked_data("qkv", qkv, ft if qkv_ft < 0 else qkv_ft, (B, T, (NH + 2 * NKV) * hs), False)
    checked_data("out", out, ft, (B, T, NH * hs), True)
    checked_data("lse", lse, ft, (B, NH, T), True)
    check_disjoint((("out", out), ("lse", lse)), (("qkv", qkv),))
    return B, T, NH, NKV, hs


def _check_backward(dqkv, dout, qkv, out, lse, n_head, n_kv_head, int ft, int qkv_ft=-1):
    B, T, NH, NKV, hs = attention_shapes(qkv, n_head, n_kv_head)
    checked_data("qkv", qkv, ft if qkv_ft < 0 else qkv_ft, (B, T, (NH + 2 * NKV) * hs), False)
    checked_data("dout", dout, ft, (B, T, NH * hs), False)
    checked_data("out", out, ft, (B, T, NH * hs), False)
    checked_data("lse", lse, ft, (B, NH, T), False)
    checked_data("dqkv", dqkv, ft, (B, T, (NH + 2 * NKV) * hs), True)
    check_disjoint((("dqkv", dqkv),),
                    (("dout", dout), ("qkv", qkv), ("out", out), ("lse", lse)))
    return B, T, NH, NKV, hs


def _threads_for(n_threads, B, T, C):
    """The default thread count, but one thread for work too small to repay waking
    a second one (a parallel region costs milliseconds on a busy machine)."""
    if n_threads is None and B * T * T * C < ATTN_PARALLEL_MIN_WORK:
        return 1
    return resolve_threads(n_threads)


PRECISIONS = ("fp32", "bf16")


def _bf_mode(precision):
    """BF_NONE for "fp32"; for "bf16" the path kernels.bf16 runs the linear layers' bf16
    products on: VDPBF16PS where they run on the CPU's bf16 instructions ("native",
    "amx"), its float32 twin for "twin" and "amx_twin" (tests), and for "emulated" (a
    CPU without AVX512_BF16) float32's kernels on rounded operands, at float32's speed
    (the twin runs 90x slower there)."""
    if precision == "fp32":
        return BF_NONE
    if precision != "bf16":
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if _bf16.bf16_native() and _bf16.cpu_has_avx512_bf16():
        return BF_NATIVE
    return BF_EMULATED if _bf16.bf16_path() == "emulated" else BF_TWIN


def _rounded(x):
    """A float32 copy of x holding its bf16 values (x float32: rounded to nearest even;
    x bf16 (uint16): widened), the operand the emulated products read."""
    cdef cnp.ndarray a = np.ascontiguousarray(x)
    cdef cnp.ndarray r = np.empty(np.shape(x), np.float32)
    cdef Py_ssize_t n = cnp.PyArray_SIZE(a)
    if a.dtype == np.uint16:
        with nogil:
            bf16_widen_span(<float*>cnp.PyArray_DATA(r), <const uint16_t*>cnp.PyArray_DATA(a), n)
    elif a.dtype == np.float32:
        with nogil:
            bf16_round_f32_span(<float*>cnp.PyArray_DATA(r), <const float*>cnp.PyArray_DATA(a),
                                n)
    else:
        return x          # the checks name the dtype
    return r


cdef int _qkv_mode(int bf, qkv, int* qkv_ft) except -1:
    # bf with BF_QKV16 where qkv is bf16 (uint16, kernels.bf16.to_bf16's: the operand
    # already rounded; precision="bf16" only), and the dtype the checks expect of it
    qkv_ft[0] = cnp.NPY_FLOAT32
    if not (isinstance(qkv, np.ndarray) and qkv.dtype == np.uint16):
        return bf
    if bf == BF_NONE:
        raise TypeError("qkv is bf16 (uint16): that takes precision='bf16' (float32 products "
                        "read a float32 qkv)")
    qkv_ft[0] = cnp.NPY_UINT16
    if bf == BF_EMULATED:       # widened by the caller (_rounded)
        return bf
    return bf | BF_QKV16


def attention_forward(out, lse, qkv, n_head, *, n_kv_head=None, n_threads=None,
                      precision="fp32"):
    """Causal attention: out (B, T, C) and lse (B, n_head, T), each query's
    log-sum-exp of its scaled scores (what the backward needs), from qkv (B, T,
    C + 2 n_kv_head hs), C = n_head hs; both overwritten.  Query head h reads kv head
    h // (n_head // n_kv_head) (grouped-query attention; n_kv_head None: n_head, each
    query head its own, GPT-2's qkv (B, T, 3C)).  precision="bf16": the two products
    take bf16 operands (q, k, v and the probabilities rounded to nearest even) and sum
    in float32; the softmax stays float32."""
    cdef int qkv_ft
    cdef int bf = _qkv_mode(_bf_mode(precision), qkv, &qkv_ft)
    cdef Py_ssize_t B, T, NH, NKV, hs
    B, T, NH, NKV, hs = _check_forward(out, lse, qkv, n_head, n_kv_head, cnp.NPY_FLOAT32,
                                       qkv_ft)
    cdef int nt = _threads_for(n_threads, B, T, NH * hs)
    if B == 0 or T == 0:
        return
    if bf == BF_EMULATED:
        qkv = _rounded(qkv)
    cdef float* out_p = <float*>cnp.PyArray_DATA(<cnp.ndarray>out)
    cdef float* lse_p = <float*>cnp.PyArray_DATA(<cnp.ndarray>lse)
    cdef const float* qkv_p = <const float*>cnp.PyArray_DATA(<cnp.ndarray>qkv)
    with nogil:
        attention_forward_c(out_p, lse_p, qkv_p, B, T, NH * hs, NH, NKV, nt, bf)


def attention_backward(dqkv, dout, qkv, out, lse, n_head, *, n_kv_head=None, overwrite=False,
                       n_threads=None, precision="fp32"):
    """Accumulate into dqkv (shaped as qkv) the gradient of attention_forward's out,
    given dout (B, T, C), the forward's qkv, and its out and lse (``overwrite``: dqkv is
    set instead, whatever it held).  The probabilities are recomputed, tile by tile; a
    kv head's dk and dv sum over its group's query heads.  precision="bf16": the five
    products take bf16 operands (q, k, v, dout, P and dS rounded), as the forward's."""
    cdef int qkv_ft
    cdef int bf = _qkv_mode(_bf_mode(precision), qkv, &qkv_ft)
    ow, = overwrite_flags(overwrite, ("dqkv",))
    cdef Py_ssize_t B, T, NH, NKV, hs
    B, T, NH, NKV, hs = _check_backward(dqkv, dout, qkv, out, lse, n_head, n_kv_head,
                                        cnp.NPY_FLOAT32, qkv_ft)
    cdef int nt = _threads_for(n_threads, B, T, NH * hs)
    if B == 0 or T == 0:
        return
    if bf == BF_EMULATED:
        qkv, dout = _rounded(qkv), _rounded(dout)
    cdef float* dqkv_p = <float*>cnp.PyArray_DATA(<cnp.ndarray>dqkv)
    cdef const float* dout_p = <const float*>cnp.PyArray_DATA(<cnp.ndarray>dout)
    cdef const float* qkv_p = <const float*>cnp.PyArray_DATA(<cnp.ndarray>qkv)
    cdef const float* out_p = <const float*>cnp.PyArray_DATA(<cnp.ndarray>out)
    cdef const float* lse_p = <const float*>cnp.PyArray_DATA(<cnp.ndarray>lse)
    cdef bint overwrite_c = ow
    with nogil:
        attention_backward_c(dqkv_p, dout_p, qkv_p, out_p, lse_p, B, T, NH * hs, NH, NKV,
                             overwrite_c, nt, bf)


# ---------------------------------------------------------------- naive twins

cdef inline double _op(double x, bint bf) noexcept nogil:
    # x as a product's operand: itself, or with bf its float32 rounded to bf16 (nearest
    # even, NaN kept), as the kernels round it
    if not bf:
        return x
    cdef float f = <float>x
    cdef uint32_t u = (<uint32_t*>&f)[0]
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return x
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return (<float*>&u)[0]


cdef void _forward_naive(floating[:, :, ::1] out, floating[:, :, ::1] lse,
                         floating[:, :, ::1] qkv, Py_ssize_t NH, Py_ssize_t NKV,
                         bint bf) noexcept nogil:
    cdef Py_ssize_t B = qkv.shape[0], T = qkv.shape[1], hs = qkv.shape[2] // (NH + 2 * NKV)
    cdef Py_ssize_t C = NH * hs
    cdef double scale = 1.0 / sqrt(<double>hs)
    cdef Py_ssize_t b, h, i, j, d, kc, vc
    cdef double s, mx, total
    cdef double* p = <double*>malloc(max(T, 1) * sizeof(double))
    for b in range(B):
        for h in range(NH):
            kc = C + h // (NH // NKV) * hs         # the first columns of its kv head's k
            vc = kc + NKV * hs                     # and v
            for i in range(T):
                mx = -1e300
                for j in range(i + 1):
                    s = 0.0
                    for d in range(hs):
                        s += _op(qkv[b, i, h * hs + d], bf) * _op(qkv[b, j, kc + d], bf)
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
                        s += _op(p[j] / total, bf) * _op(qkv[b, j, vc + d], bf)
                    out[b, i, h * hs + d] = s
    free(p)


cdef void _backward_naive(floating[:, :, ::1] dqkv, floating[:, :, ::1] dout,
                          floating[:, :, ::1] qkv, floating[:, :, ::1] out,
                          floating[:, :, ::1] lse, Py_ssize_t NH, Py_ssize_t NKV,
                          bint bf) noexcept nogil:
    # The same recomputation as the kernel, in plain loops: P[i, j] = exp(s[i, j] -
    # lse[i]), D[i] = dout[i] . out[i], dS = P (dout[i] . v[j] - D[i]) * scale; a kv
    # head's dk and dv gather the terms of every query head of its group.  With bf
    # each product's operands (q, k, v, dout, P, dS) are rounded to bf16, and D takes
    # the rounded dout too (as PyTorch's bf16 flash attention, whose dout is bf16).
    cdef Py_ssize_t B = qkv.shape[0], T = qkv.shape[1], hs = qkv.shape[2] // (NH + 2 * NKV)
    cdef Py_ssize_t C = NH * hs
    cdef double scale = 1.0 / sqrt(<double>hs)
    cdef Py_ssize_t b, h, i, j, d, kc, vc
    cdef double s, p, dp, dsum, ds
    for b in range(B):
        for h in range(NH):
            kc = C + h // (NH // NKV) * hs
            vc = kc + NKV * hs
            for i in range(T):
                dsum = 0.0
                for d in range(hs):
                    dsum += _op(dout[b, i, h * hs + d], bf) * out[b, i, h * hs + d]
                for j in range(i + 1):
                    s = 0.0
                    dp = 0.0
                    for d in range(hs):
                        s += _op(qkv[b, i, h * hs + d], bf) * _op(qkv[b, j, kc + d], bf)
                        dp += _op(dout[b, i, h * hs + d], bf) * _op(qkv[b, j, vc + d], bf)
                    p = exp(s * scale - lse[b, h, i])
                    ds = p * (dp - dsum) * scale
                    for d in range(hs):
                        dqkv[b, j, vc + d] += _op(p, bf) * _op(dout[b, i, h * hs + d], bf)
                        dqkv[b, i, h * hs + d] += _op(ds, bf) * _op(qkv[b, j, kc + d], bf)
                        dqkv[b, j, kc + d] += _op(ds, bf) * _op(qkv[b, i, h * hs + d], bf)


def attention_forward_naive(out, lse, qkv, n_head, *, n_kv_head=None, n_threads=None,
                            precision="fp32"):
    """Plain-loop twin of ``attention_forward`` (serial; float32 or float64; bf16: the
    products' operands rounded to bf16, each from its float32 value)."""
    cdef bint bf = _bf_mode(precision) != BF_NONE
    cdef int ft = float_type(qkv)
    B, T, NH, NKV, hs = _check_forward(out, lse, qkv, n_head, n_kv_head, ft)
    resolve_threads(n_threads)
    if ft == cnp.NPY_FLOAT32:
        _forward_naive[float](out, lse, qkv, NH, NKV, bf)
    else:
        _forward_naive[double](out, lse, qkv, NH, NKV, bf)


def attention_backward_naive(dqkv, dout, qkv, out, lse, n_head, *, n_kv_head=None,
                             overwrite=False, n_threads=None, precision="fp32"):
    """Plain-loop twin of ``attention_backward`` (serial; float32 or float64; bf16 as
    ``attention_forward_naive``'s)."""
    cdef bint bf = _bf_mode(precision) != BF_NONE
    ow, = overwrite_flags(overwrite, ("dqkv",))
    cdef int ft = float_type(qkv)
    B, T, NH, NKV, hs = _check_backward(dqkv, dout, qkv, out, lse, n_head, n_kv_head, ft)
    resolve_threads(n_threads)
    if ow:
        dqkv[...] = 0
    if ft == cnp.NPY_FLOAT32:
        _backward_naive[float](dqkv, dout, qkv, out, lse, NH, NKV, bf)
    else:
        _backward_naive[double](dqkv, dout, qkv, out, lse, NH, NKV, bf)
