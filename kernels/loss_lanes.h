/* The rows of kernels/loss.pyx, a template over the vector width: loss.pyx includes
 * it once per width after defining ADT_W (see the end of kernels/simd.h), giving
 * ce_row_logsumexp_v8 and _v16, and so on.
 */

/* sum(2^t) over one chunk of a row, t = x log2(e) - hi in one fused multiply-add
   where fused (a constant at each call), else (x - m) log2(e). */
ADT_LANES_INLINE ADT_VT ADT_LANES_FN(ce_chunk_exp2_sum)(const float* xc, ptrdiff_t n,
                                                        float m, ADT_VT nhi, int fused) {
    const float l2e = (float)ADT_LOG2E;
    ADT_VT mm = ADT_V(splat)(m), s1 = {0}, s2 = {0};
#define CE_T(v) (fused ? (v) * l2e + nhi : ((v) - mm) * l2e)
    ptrdiff_t i;
    /* meanwhile the chunk after next comes in, which the row's max loop then finds
       in the cache (prefetches past the row's end are harmless: the next row, or
       nothing).  The chunk after next, not the next: 5-10% faster over GPT-2's
       logits from memory (256 rows, two threads, Zen 3 VM), as was dropping the max
       loop's own prefetches. */
    for (i = 0; i + 2 * ADT_W <= n; i += 2 * ADT_W) {
        for (int q = 0; q < 2 * ADT_W; q += 16)
            __builtin_prefetch(xc + 2 * CE_CHUNK + i + q, 0, 3);
        s1 += ADT_V(exp2_fast)(CE_T(ADT_V(load)(xc + i)));
        s2 += ADT_V(exp2_fast)(CE_T(ADT_V(load)(xc + i + ADT_W)));
    }
    s1 += s2;
    for (; i + ADT_W <= n; i += ADT_W) s1 += ADT_V(exp2_fast)(CE_T(ADT_V(load)(xc + i)));
    if (i < n) {
        float t[ADT_W];
        for (int l = 0; l < ADT_W; l++) t[l] = i + l < n ? xc[i + l] : -INFINITY;
        s1 += ADT_V(exp2_fast)(CE_T(ADT_V(load)(t)));
    }
#undef CE_T
    return s1;
}

/* log(sum(exp(x - max))) of one row, storing the max: the loss is then
   (max - x[target]) + that, which keeps its precision when the logits are large.
   The sum takes exp2_fast (kernels/simd.h, with the figures) of t = x log2(e) - hi,
   one fused multiply-add, hi being max log2(e) rounded to a float: the product is
   exact, so t is (x - max) log2(e) + lo rounded once, where lo = max log2(e) - hi is
   the same for every term and exact as a float (fmaf); each chunk's sum is then
   multiplied by 2^-lo.  That is one operation per term fewer than (x - max) log2(e),
   13% of the sum's time from L1 on Zen 3, and no less precise.  Past |max| = 2^16, lo
   (up to half an ulp of hi) is no longer small and the chunk takes (x - max) log2(e).
   Without FMA hardware (the x86-64 baseline clone) x log2(e) is rounded before the
   add, and terms lose up to |x| 2^-24 relative, 3e-6 at GPT-2's logits.
   exp2_fast's rounding weighs on a term as |x - max| exp(x - max) does, at most
   2.2e-8 of the max's 1; a term below 2^-125 is lost against that 1.  A leading
   chunk of -inf only (max -inf) adds 2^-125 per term, which the first finite max
   then scales to 0. */
ADT_LANES_ATTR
static float ADT_LANES_FN(ce_row_logsumexp)(const float* x, ptrdiff_t V, float* row_max) {
    const float l2e = (float)ADT_LOG2E;
    float m = -INFINITY, unlo = 1.0f;
    int fused = 1;
    ADT_VT s = {0}, nhi = {0};
    for (ptrdiff_t c0 = 0; c0 < V; c0 += CE_CHUNK) {
        ptrdiff_t n = V - c0 < CE_CHUNK ? V - c0 : CE_CHUNK, i;
        const float* xc = x + c0;
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
        if (cm > m) {
            s = s * ADT_V(exp)(ADT_V(splat)(m - cm));
            m = cm;
            float hi = m * l2e;
            fused = fabsf(m) <= 0x1p16f;
            nhi = ADT_V(splat)(-hi);
            unlo = fused ? exp2f(-fmaf(m, l2e, -hi)) : 1.0f;
        }
        if (fused)
            s += ADT_LANES_FN(ce_chunk_exp2_sum)(xc, n, m, nhi, 1) * unlo;
        else
            s += ADT_LANES_FN(ce_chunk_exp2_sum)(xc, n, m, nhi, 0);
    }
    *row_max = m;
    return logf(ADT_V(hsum)(s));
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
