/* The rows of kernels/loss.pyx, a template over the vector width: loss.pyx includes
 * it once per width after defining ADT_W (see the end of kernels/simd.h), giving
 * ce_rows_logsumexp_v8 and _v16, and so on.
 */

/* The log-sum-exp runs over chunks of CE_CHUNK logits, online: each chunk's max,
   then the sum of its exponentials relative to the running max.  The sum takes
   exp2_fast (kernels/simd.h, with the figures) of t = x log2(e) - hi, one fused
   multiply-add, hi being the running max times log2(e) rounded to a float: the
   product is exact, so t is (x - max) log2(e) + lo rounded once, where lo = max
   log2(e) - hi is the same for every term and exact as a float (fmaf); each chunk's
   sum is then multiplied by 2^-lo.  That is one operation per term fewer than
   (x - max) log2(e), 7.1 -> 6.3 cycles per 8 logits from L1 on Zen 3, and no less
   precise.  Past |max| = 2^16, lo (up to half an ulp of hi) is no longer small, and
   the chunk takes (x - max) log2(e).  Without FMA hardware (the x86-64 baseline
   clone) x log2(e) is rounded before the add, and terms lose up to |x| 2^-24
   relative, 3e-6 at GPT-2's logits.  exp2_fast's rounding weighs on a term as
   |x - max| exp(x - max) does, at most 2.2e-8 of the max's 1; a term below 2^-125
   is lost against that 1.  A leading chunk of -inf only (max -inf) adds 2^-125 per
   term, which the first finite max then scales to 0. */
typedef struct {
    float m;        /* running max */
    float unlo;     /* 2^-lo */
    int fused;      /* t in one FMA */
    ADT_VT s;       /* sum of exp(x - m), lane by lane */
    ADT_VT nhi;     /* -hi in every lane */
} ADT_LANES_FN(ce_state);

ADT_LANES_INLINE void ADT_LANES_FN(ce_start)(ADT_LANES_FN(ce_state)* st) {
    st->m = -INFINITY;
    st->unlo = 1.0f;
    st->fused = 1;
    st->s = st->nhi = ADT_V(splat)(0.0f);
}

/* The max of one chunk, with the running max raised to it (and the sum rescaled). */
ADT_LANES_INLINE void ADT_LANES_FN(ce_chunk_max)(ADT_LANES_FN(ce_state)* st,
                                                 const float* xc, ptrdiff_t n) {
    const float l2e = (float)ADT_LOG2E;
    ptrdiff_t i;
    /* four running maxima: one would wait on its own compare-and-blend */
    ADT_VT mv = ADT_V(splat)(xc[0]), mv1 = mv, mv2 = mv, mv3 = mv;
    for (i = 0; i + 4 * ADT_W <= n; i += 4 * ADT_W) {
        mv = ADT_V(max)(mv, ADT_V(load)(xc + i));
        mv1 = ADT_V(max)(mv1, ADT_V(load)(xc + i + ADT_W));
        mv2 = ADT_V(max)(mv2, ADT_V(load)(xc + i + 2 * ADT_W));
        mv3 = ADT_V(max)(mv3, ADT_V(load)(xc + i + 3 * ADT_W));
    }
    mv = ADT_V(max)(ADT_V(max)(mv, mv1), ADT_V(max)(mv2, mv3));
    for (; i + ADT_W <= n; i += ADT_W) mv = ADT_V(max)(mv, ADT_V(load)(xc + i));
    float cm = mv[0];
    for (int l = 1; l < ADT_W; l++) cm = mv[l] > cm ? mv[l] : cm;
    for (; i < n; i++) cm = xc[i] > cm ? xc[i] : cm;
    if (cm > st->m) {
        st->s = st->s * ADT_V(exp)(ADT_V(splat)(st->m - cm));
        st->m = cm;
        float hi = cm * l2e;
        st->fused = fabsf(cm) <= 0x1p16f;
        st->nhi = ADT_V(splat)(-hi);
        st->unlo = st->fused ? exp2f(-fmaf(cm, l2e, -hi)) : 1.0f;
    }
}

/* 2^t of the vector at v, t taken as the state says (fused: a constant at each
   call, so that the branch folds away). */
#define CE_T(v, st, fused) \
    ((fused) ? ADT_V(load)(v) * l2e + (st)->nhi \
             : (ADT_V(load)(v) - ADT_V(splat)((st)->m)) * l2e)
#define CE_EXP2(v, st, fused) ADT_V(exp2_fast)(CE_T(v, st, fused))

/* s plus the terms of xc[i:n] (fewer than two vectors), in the order the loops
   below take them: whole vectors, then the last part padded with -inf. */
ADT_LANES_INLINE ADT_VT ADT_LANES_FN(ce_chunk_tail)(ADT_VT s, const ADT_LANES_FN(ce_state)* st,
                                                    const float* xc, ptrdiff_t i, ptrdiff_t n,
                                                    int fused) {
    const float l2e = (float)ADT_LOG2E;
    for (; i + ADT_W <= n; i += ADT_W) s += CE_EXP2(xc + i, st, fused);
    if (i < n) {
        float t[ADT_W];
        for (int l = 0; l < ADT_W; l++) t[l] = i + l < n ? xc[i + l] : -INFINITY;
        s += CE_EXP2(t, st, fused);
    }
    return s;
}

/* Adds one chunk's exponentials to the state's sum, in one accumulator (its chain,
   an FMA per vector, is shorter than exp2_fast's throughput).  Meanwhile the chunk
   after next comes in, which ce_chunk_max then finds in the cache (fetches past the
   row's end are harmless: the next row, or nothing).  The chunk after next, not
   the next: 5-10% faster over GPT-2's logits from memory (256 rows, two threads,
   Zen 3 VM), as was the max loop fetching nothing itself. */
ADT_LANES_INLINE void ADT_LANES_FN(ce_chunk_sum)(ADT_LANES_FN(ce_state)* st, const float* xc,
                                                 ptrdiff_t n, int fused) {
    const float l2e = (float)ADT_LOG2E;
    ADT_VT s1 = ADT_V(splat)(0.0f);
    ptrdiff_t i;
    for (i = 0; i + 2 * ADT_W <= n; i += 2 * ADT_W) {
        for (int q = 0; q < 2 * ADT_W; q += 16)
            __builtin_prefetch(xc + 2 * CE_CHUNK + i + q, 0, 3);
        s1 += CE_EXP2(xc + i, st, fused);
        s1 += CE_EXP2(xc + i + ADT_W, st, fused);
    }
    s1 = ADT_LANES_FN(ce_chunk_tail)(s1, st, xc, i, n, fused);
    st->s += s1 * st->unlo;   /* 1 where not fused */
}

/* The same for one chunk of each of two rows, a and b, read side by side: one core
   reading two streams keeps more misses in flight than reading one (a plain sum
   over 512 MB with two threads, Zen 3 VM: 26.5 GB/s with one stream per thread,
   29.5-31 with two), and the sums are the same, bit for bit.  Two accumulators per
   row here spilled three of the four to the stack (sixteen registers on AVX2). */
ADT_LANES_INLINE void ADT_LANES_FN(ce_chunk_sum2)(ADT_LANES_FN(ce_state)* a, const float* xa,
                                                  ADT_LANES_FN(ce_state)* b, const float* xb,
                                                  ptrdiff_t n) {
    const float l2e = (float)ADT_LOG2E;
    ADT_VT a1 = ADT_V(splat)(0.0f), b1 = a1;
    ptrdiff_t i;
    for (i = 0; i + 2 * ADT_W <= n; i += 2 * ADT_W) {
        for (int q = 0; q < 2 * ADT_W; q += 16) {
            __builtin_prefetch(xa + 2 * CE_CHUNK + i + q, 0, 3);
            __builtin_prefetch(xb + 2 * CE_CHUNK + i + q, 0, 3);
        }
        a1 += CE_EXP2(xa + i, a, 1);
        b1 += CE_EXP2(xb + i, b, 1);
        a1 += CE_EXP2(xa + i + ADT_W, a, 1);
        b1 += CE_EXP2(xb + i + ADT_W, b, 1);
    }
    a->s += ADT_LANES_FN(ce_chunk_tail)(a1, a, xa, i, n, 1) * a->unlo;
    b->s += ADT_LANES_FN(ce_chunk_tail)(b1, b, xb, i, n, 1) * b->unlo;
}
#undef CE_EXP2
#undef CE_T

/* log(sum(exp(x - max))) of rows (1 or 2) rows of V logits ld apart, storing each
   row's max: the loss is then (max - x[target]) + that, which keeps its precision
   when the logits are large.  Two rows are read side by side (ce_chunk_sum2), with
   the same results as one by one: over 2048 rows of GPT-2's logits from memory (two
   threads, Zen 3 VM) 7-15% faster than one by one; over 256 (51 MB, partly still
   in L3 when run back to back) 3-5%. */
ADT_LANES_ATTR
static void ADT_LANES_FN(ce_rows_logsumexp)(const float* x, ptrdiff_t ld, ptrdiff_t V, int rows,
                                            float* row_max, float* log_sum) {
    ADT_LANES_FN(ce_state) st[2];
    for (int r = 0; r < rows; r++) ADT_LANES_FN(ce_start)(&st[r]);
    for (ptrdiff_t c0 = 0; c0 < V; c0 += CE_CHUNK) {
        ptrdiff_t n = V - c0 < CE_CHUNK ? V - c0 : CE_CHUNK;
        for (int r = 0; r < rows; r++) ADT_LANES_FN(ce_chunk_max)(&st[r], x + r * ld + c0, n);
        if (rows == 2 && st[0].fused && st[1].fused) {
            ADT_LANES_FN(ce_chunk_sum2)(&st[0], x + c0, &st[1], x + ld + c0, n);
        } else {
            for (int r = 0; r < rows; r++) {
                if (st[r].fused) ADT_LANES_FN(ce_chunk_sum)(&st[r], x + r * ld + c0, n, 1);
                else ADT_LANES_FN(ce_chunk_sum)(&st[r], x + r * ld + c0, n, 0);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        row_max[r] = st[r].m;
        log_sum[r] = logf(ADT_V(hsum)(st[r].s));
    }
}

/* d[0:V] (+)= exp(x - lse) * g (accumulate, or overwrite when in place, where d == x),
   then the padding d[V:Vp] = 0 when in place. */
ADT_LANES_ATTR
static void ADT_LANES_FN(ce_row_backward)(float* d, const float* x, float lse, float g,
                                          ptrdiff_t V, ptrdiff_t Vp, int inplace) {
    ptrdiff_t i = 0;
    ADT_VT l = ADT_V(splat)(lse);
    if (inplace) {
        for (; i + ADT_W <= V; i += ADT_W) {
            ADT_PREFETCH_W(d + i);
            ADT_V(store)(d + i, ADT_V(exp)(ADT_V(load)(x + i) - l) * g);
        }
    } else {
        for (; i + ADT_W <= V; i += ADT_W) {
            ADT_PREFETCH_R(x + i);
            ADT_PREFETCH_W(d + i);
            ADT_V(store)(d + i, ADT_V(load)(d + i) + ADT_V(exp)(ADT_V(load)(x + i) - l) * g);
        }
    }
    if (i < V) {
        float t[ADT_W] = {0};
        memcpy(t, x + i, (V - i) * sizeof(float));
        ADT_V(store)(t, ADT_V(exp)(ADT_V(load)(t) - l) * g);
        for (ptrdiff_t j = 0; j < V - i; j++) d[i + j] = inplace ? t[j] : d[i + j] + t[j];
    }
    if (inplace)
        for (i = V; i < Vp; i++) d[i] = 0.0f;
}
