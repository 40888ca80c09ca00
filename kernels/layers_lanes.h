/* GELU and layernorm rows and the two-output add of kernels/layers.pyx, a template
 * over the vector width: layers.pyx includes it once per width after defining ADT_W
 * (see the end of kernels/simd.h), giving gelu_forward_span_v8 and _v16, and so on.
 */

/* GELU, tanh approximation: 0.5 (1 + tanh(u)) == 1 / (1 + 2^t), t = -2u log2(e),
   which needs one exp2 and no cancellation near tanh(u) = -1; t = x (c1 + c3 x^2)
   with log2(e) folded into the coefficients (kernels/simd.h's exp2_fast).  Beyond
   t = 80 log2(e) (2^t = e^80) the result is set to 0 rather than left as a value
   that turns denormal downstream. */
#ifndef ADTAPE_GELU_T_MAX
#define ADTAPE_GELU_T_MAX ((float)(80.0 * ADT_LOG2E))
#endif
ADT_LANES_INLINE ADT_VT ADT_LANES_FN(gelu_t)(ADT_VT x) {
    const float c1 = (float)(-2.0 * ADTAPE_GELU_K * ADT_LOG2E);
    const float c3 = (float)(-2.0 * ADTAPE_GELU_K * ADTAPE_GELU_A * ADT_LOG2E);
    return (c3 * (x * x) + c1) * x;
}

/* out[i] = exp(inp[i]) with this width's vector exp, or 2^inp[i] with its exp2_fast,
   for the tests (the kernels' exp itself is inlined into them). */
ADT_LANES_INLINE ADT_VT ADT_LANES_FN(exp_either)(ADT_VT x, int fast) {
    return fast ? ADT_V(exp2_fast)(x) : ADT_V(exp)(x);
}
ADT_LANES_ATTR
static void ADT_LANES_FN(exp_span)(float* out, const float* inp, ptrdiff_t n, int fast) {
    ptrdiff_t i = 0;
    for (; i + ADT_W <= n; i += ADT_W)
        ADT_V(store)(out + i, ADT_LANES_FN(exp_either)(ADT_V(load)(inp + i), fast));
    if (i < n) {
        float t[ADT_W];
        for (int l = 0; l < ADT_W; l++) t[l] = i + l < n ? inp[i + l] : 0.0f;
        ADT_VT y = ADT_LANES_FN(exp_either)(ADT_V(load)(t), fast);
        for (ptrdiff_t l = 0; i + l < n; l++) out[i + l] = y[l];
    }
}

ADT_LANES_INLINE ADT_VT ADT_LANES_FN(gelu_forward)(ADT_VT x) {
    /* x s = x / (1 + 2^t), no separate reciprocal; exp2_fast, being added to 1 */
    ADT_VT t = ADT_LANES_FN(gelu_t)(x);
    ADT_VI big = t > ADT_V(splat)(ADTAPE_GELU_T_MAX);
    ADT_VT e = ADT_V(exp2_fast)(ADT_V(min)(t, ADT_V(splat)(ADTAPE_GELU_T_MAX)));
    ADT_VT y = ADT_V(divide)(x, 1.0f + e);
    return ADT_V(select)(big, ADT_V(splat)(0.0f), y);
}

/* d/dx [x s] = s + x s (1 - s) 2u', with 1 - s = e s, e = 2^t.  Beyond |x| = 20
   the result is exactly 1 or 0 in float32; clamping there keeps x^2 from
   overflowing.  exp2_fast: e below 2^-125 only meets 1 + (a normal number), as in
   the forward's 1 + 2^t. */
ADT_LANES_INLINE ADT_VT ADT_LANES_FN(gelu_backward)(ADT_VT x, ADT_VT d) {
    const float k2 = (float)(2.0 * ADTAPE_GELU_K), a3 = (float)(3.0 * ADTAPE_GELU_A);
    x = ADT_V(max)(ADT_V(min)(x, ADT_V(splat)(20.0f)), ADT_V(splat)(-20.0f));
    ADT_VT t = ADT_LANES_FN(gelu_t)(x);
    ADT_VI big = t > ADT_V(splat)(ADTAPE_GELU_T_MAX);
    ADT_VT e = ADT_V(exp2_fast)(ADT_V(min)(t, ADT_V(splat)(ADTAPE_GELU_T_MAX)));
    ADT_VT s = ADT_V(select)(big, ADT_V(splat)(0.0f),
                             ADT_V(divide)(ADT_V(splat)(1.0f), 1.0f + e));
    ADT_VT du = k2 * (1.0f + a3 * x * x);
    return s * (1.0f + x * du * e * s) * d;
}

/* Spans in whole vectors, the tail through a zero-padded one.  stream: out is
   written with non-temporal stores (kernels/simd.h; out 64-byte aligned). */
ADT_LANES_ATTR
static void ADT_LANES_FN(gelu_forward_span)(float* out, const float* inp, ptrdiff_t n,
                                            int stream) {
    ptrdiff_t i = 0;
    for (; i + ADT_W <= n; i += ADT_W) {
        ADT_PREFETCH_R(inp + i);
        if (!stream) ADT_PREFETCH_W(out + i);   /* streamed lines are not read */
        ADT_V(put)(out + i, ADT_LANES_FN(gelu_forward)(ADT_V(load)(inp + i)), stream);
    }
    if (stream) adt_stream_fence();
    if (i < n) {
        float x[ADT_W] = {0}, y[ADT_W];
        memcpy(x, inp + i, (n - i) * sizeof(float));
        ADT_V(store)(y, ADT_LANES_FN(gelu_forward)(ADT_V(load)(x)));
        memcpy(out + i, y, (n - i) * sizeof(float));
    }
}

ADT_LANES_ATTR
static void ADT_LANES_FN(gelu_backward_span)(float* dinp, const float* inp, const float* dout,
                                             ptrdiff_t n, int overwrite) {
    ptrdiff_t i = 0;
    if (overwrite)
        for (; i + ADT_W <= n; i += ADT_W) {
            ADT_PREFETCH_R(inp + i);
            ADT_PREFETCH_R(dout + i);
            ADT_PREFETCH_W(dinp + i);
            ADT_V(store)(dinp + i, ADT_LANES_FN(gelu_backward)(ADT_V(load)(inp + i),
                                                               ADT_V(load)(dout + i)));
        }
    else
        for (; i + ADT_W <= n; i += ADT_W) {
            ADT_PREFETCH_R(inp + i);
            ADT_PREFETCH_R(dout + i);
            ADT_PREFETCH_W(dinp + i);
            ADT_V(store)(dinp + i, ADT_V(load)(dinp + i)
                                   + ADT_LANES_FN(gelu_backward)(ADT_V(load)(inp + i),
                                                                 ADT_V(load)(dout + i)));
        }
    if (i < n) {
        float x[ADT_W] = {0}, d[ADT_W] = {0}, y[ADT_W];
        memcpy(x, inp + i, (n - i) * sizeof(float));
        memcpy(d, dout + i, (n - i) * sizeof(float));
        ADT_V(store)(y, ADT_LANES_FN(gelu_backward)(ADT_V(load)(x), ADT_V(load)(d)));
        for (ptrdiff_t j = 0; j < n - i; j++) dinp[i + j] = overwrite ? y[j] : dinp[i + j] + y[j];
    }
}

/* Layernorm rows.  Sums run in two vectors plus a scalar tail, combined pairwise. */
ADT_LANES_INLINE float ADT_LANES_FN(ln_sum)(const float* x, ptrdiff_t C) {
    ADT_VT a = {0}, b = {0};
    ptrdiff_t i = 0;
    for (; i + 2 * ADT_W <= C; i += 2 * ADT_W) {
        a += ADT_V(load)(x + i);
        b += ADT_V(load)(x + i + ADT_W);
    }
    for (; i + ADT_W <= C; i += ADT_W) a += ADT_V(load)(x + i);
    float t = 0.0f;
    for (; i < C; i++) t += x[i];
    return ADT_V(hsum)(a + b) + t;
}

ADT_LANES_INLINE float ADT_LANES_FN(ln_sum_sq_dev)(const float* x, float m, ptrdiff_t C) {
    ADT_VT a = {0}, b = {0}, mv = ADT_V(splat)(m);
    ptrdiff_t i = 0;
    for (; i + 2 * ADT_W <= C; i += 2 * ADT_W) {
        ADT_VT d0 = ADT_V(load)(x + i) - mv, d1 = ADT_V(load)(x + i + ADT_W) - mv;
        a += d0 * d0;
        b += d1 * d1;
    }
    for (; i + ADT_W <= C; i += ADT_W) {
        ADT_VT d = ADT_V(load)(x + i) - mv;
        a += d * d;
    }
    float t = 0.0f;
    for (; i < C; i++) t += (x[i] - m) * (x[i] - m);
    return ADT_V(hsum)(a + b) + t;
}

/* Rows r0..r1: two passes over each row (it sits in L1) avoid the cancellation of
   E[x^2] - E[x]^2; the next row is fetched meanwhile (B=8, T=1024, C=768, two
   threads on the Zen 3 VM: 1.39-1.47 -> 1.19-1.32 ms, one thread 2.66-2.78 ->
   2.11-2.17; the backward, whose rows the same fetches made slower, has none).
   stream: out is written with non-temporal stores (kernels/simd.h; out 64-byte
   aligned, C a multiple of 16). */
ADT_LANES_ATTR
static void ADT_LANES_FN(ln_forward_rows)(float* out, float* mean, float* rstd,
                                          const float* inp, const float* weight,
                                          const float* bias, ptrdiff_t r0, ptrdiff_t r1,
                                          ptrdiff_t C, int stream) {
    for (ptrdiff_t r = r0; r < r1; r++) {
        const float* x = inp + r * C;
        float* y = out + r * C;
        if (r + 1 < r1)   /* the next row, as the encoder's */
            for (ptrdiff_t i = 0; i < C; i += 16) __builtin_prefetch(x + C + i, 0, 3);
        float m = ADT_LANES_FN(ln_sum)(x, C) / C;
        float s = 1.0f / sqrtf(ADT_LANES_FN(ln_sum_sq_dev)(x, m, C) / C
                               + (float)ADTAPE_LAYERNORM_EPS);
        ADT_VT mv = ADT_V(splat)(m), sv = ADT_V(splat)(s);
        ptrdiff_t i = 0;
        for (; i + ADT_W <= C; i += ADT_W)
            ADT_V(put)(y + i, (ADT_V(load)(x + i) - mv) * sv * ADT_V(load)(weight + i)
                              + ADT_V(load)(bias + i), stream);
        for (; i < C; i++) y[i] = (x[i] - m) * s * weight[i] + bias[i];
        mean[r] = m;
        rstd[r] = s;
    }
    if (stream) adt_stream_fence();
}

/* Rows r0..r1 of the backward: dinp += ... (= when ow_dinp), and this block's partial
   sums part_w[c] = sum norm * dout, part_b[c] = sum dout (overwritten). */
ADT_LANES_ATTR
static void ADT_LANES_FN(ln_backward_rows)(float* dinp, float* part_w, float* part_b,
                                           const float* dout, const float* inp,
                                           const float* weight, const float* mean,
                                           const float* rstd, ptrdiff_t r0, ptrdiff_t r1,
                                           ptrdiff_t C, int ow_dinp) {
    memset(part_w, 0, C * sizeof(float));
    memset(part_b, 0, C * sizeof(float));
    for (ptrdiff_t r = r0; r < r1; r++) {
        const float* x = inp + r * C;
        const float* d = dout + r * C;
        float* dx = dinp + r * C;
        float m = mean[r], s = rstd[r];
        ADT_VT mv = ADT_V(splat)(m), sv = ADT_V(splat)(s);
        ADT_VT ag = {0}, agx = {0};
        ptrdiff_t i = 0;
        for (; i + ADT_W <= C; i += ADT_W) {
            ADT_VT g = ADT_V(load)(weight + i) * ADT_V(load)(d + i);
            ag += g;
            agx += g * (ADT_V(load)(x + i) - mv);
        }
        float tg = 0.0f, tgx = 0.0f;
        for (; i < C; i++) {
            float g = weight[i] * d[i];
            tg += g;
            tgx += g * (x[i] - m);
        }
        /* dinp = rstd * (g - mean(g) - norm * mean(g * norm)), norm = (x - mean) * rstd */
        float mean_g = (ADT_V(hsum)(ag) + tg) / C;
        float mean_gn = (ADT_V(hsum)(agx) + tgx) * s / C;
        ADT_VT mg = ADT_V(splat)(mean_g), mgn = ADT_V(splat)(mean_gn);
        for (i = 0; i + ADT_W <= C; i += ADT_W) {
            ADT_VT dv = ADT_V(load)(d + i);
            ADT_VT norm = (ADT_V(load)(x + i) - mv) * sv;
            ADT_V(store)(part_w + i, ADT_V(load)(part_w + i) + norm * dv);
            ADT_V(store)(part_b + i, ADT_V(load)(part_b + i) + dv);
            ADT_VT r = (ADT_V(load)(weight + i) * dv - mg - norm * mgn) * sv;
            ADT_V(store)(dx + i, ow_dinp ? r : ADT_V(load)(dx + i) + r);
        }
        for (; i < C; i++) {
            float norm = (x[i] - m) * s;
            part_w[i] += norm * d[i];
            part_b[i] += d[i];
            float r = (weight[i] * d[i] - mean_g - norm * mean_gn) * s;
            dx[i] = ow_dinp ? r : dx[i] + r;
        }
    }
}

/* out[0:n] = a + b (the residual forward; out may be a or b); stream: non-temporal
   stores (out 64-byte aligned). */
ADT_LANES_ATTR
static void ADT_LANES_FN(add_span)(float* out, const float* a, const float* b, ptrdiff_t n,
                                   int stream) {
    ptrdiff_t i = 0;
    for (; i + ADT_W <= n; i += ADT_W) {
        ADT_PREFETCH_R(a + i);
        ADT_PREFETCH_R(b + i);
        if (!stream) ADT_PREFETCH_W(out + i);   /* streamed lines are not read */
        ADT_V(put)(out + i, ADT_V(load)(a + i) + ADT_V(load)(b + i), stream);
    }
    for (; i < n; i++) out[i] = a[i] + b[i];
    if (stream) adt_stream_fence();
}

/* Rows r0..r1 of the encoder: out[r] = wte[ids[r]] + wpe[r % T]; stream as above
   (C a multiple of 16).  The table rows are random lines, fetched a row ahead. */
ADT_LANES_ATTR
static void ADT_LANES_FN(encoder_rows)(float* out, const int32_t* ids, const float* wte,
                                       const float* wpe, ptrdiff_t r0, ptrdiff_t r1,
                                       ptrdiff_t T, ptrdiff_t C, int stream) {
    for (ptrdiff_t r = r0; r < r1; r++) {
        const float* a = wte + (ptrdiff_t)ids[r] * C;
        const float* b = wpe + (r % T) * C;
        float* y = out + r * C;
        if (r + 1 < r1)
            for (ptrdiff_t i = 0; i < C; i += 16)
                __builtin_prefetch(wte + (ptrdiff_t)ids[r + 1] * C + i, 0, 3);
        ptrdiff_t i = 0;
        for (; i + ADT_W <= C; i += ADT_W)
            ADT_V(put)(y + i, ADT_V(load)(a + i) + ADT_V(load)(b + i), stream);
        for (; i < C; i++) y[i] = a[i] + b[i];
    }
    if (stream) adt_stream_fence();
}

/* a (+)= d and b (+)= d in one pass that reads d once (residual backward; a row of
   encoder backward, a and b one row each of dwte and dwpe); ow_a / ow_b: that output
   is set, not read.  a and b may be the same memory: each vector is stored before
   the next is loaded.  ahead: fetch ADT_AHEAD floats past each vector; off where
   the span is one thread's share of a row, as that would take lines that another
   thread is writing. */
ADT_LANES_ATTR
static void ADT_LANES_FN(add_to_both_span)(float* a, float* b, const float* d, ptrdiff_t n,
                                           int ow_a, int ow_b, int ahead) {
    ptrdiff_t i = 0;
    for (; i + ADT_W <= n; i += ADT_W) {
        if (ahead) {
            ADT_PREFETCH_R(d + i);
            ADT_PREFETCH_W(a + i);
            ADT_PREFETCH_W(b + i);
        }
        ADT_VT v = ADT_V(load)(d + i);
        ADT_V(store)(a + i, ow_a ? v : ADT_V(load)(a + i) + v);
        ADT_V(store)(b + i, ow_b ? v : ADT_V(load)(b + i) + v);
    }
    for (; i < n; i++) {
        float v = d[i];
        a[i] = ow_a ? v : a[i] + v;
        b[i] = ow_b ? v : b[i] + v;
    }
}
