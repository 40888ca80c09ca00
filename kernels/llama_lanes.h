/* RMSNorm rows, rotary embedding rows and SwiGLU rows of kernels/llama.pyx, a template
 * over the vector width like kernels/layers_lanes.h: llama.pyx includes it once per
 * width after defining ADT_W (see the end of kernels/simd.h), giving rms_forward_rows_v8
 * and _v16, and so on.
 */

/* Sum of squares of x[0:C] in two vectors plus a scalar tail, combined pairwise (the
   order of layers_lanes.h's ln_sum, so the result is the same whichever row it is). */
ADT_LANES_INLINE float ADT_LANES_FN(rms_sum_sq)(const float* x, ptrdiff_t C) {
    ADT_VT a = {0}, b = {0};
    ptrdiff_t i = 0;
    for (; i + 2 * ADT_W <= C; i += 2 * ADT_W) {
        ADT_VT x0 = ADT_V(load)(x + i), x1 = ADT_V(load)(x + i + ADT_W);
        a += x0 * x0;
        b += x1 * x1;
    }
    for (; i + ADT_W <= C; i += ADT_W) {
        ADT_VT x0 = ADT_V(load)(x + i);
        a += x0 * x0;
    }
    float t = 0.0f;
    for (; i < C; i++) t += x[i] * x[i];
    return ADT_V(hsum)(a + b) + t;
}

/* Rows r0..r1: rrms[r] = 1 / sqrt(mean(x^2) + eps) and out = weight * (x * rrms), in
   the order of Hugging Face's LlamaRMSNorm (the normalised x is rounded before the
   weight multiplies it).  The next row is fetched meanwhile, as in ln_forward_rows. */
ADT_LANES_ATTR
static void ADT_LANES_FN(rms_forward_rows)(float* out, float* rrms, const float* inp,
                                           const float* weight, float eps, ptrdiff_t r0,
                                           ptrdiff_t r1, ptrdiff_t C) {
    for (ptrdiff_t r = r0; r < r1; r++) {
        const float* x = inp + r * C;
        float* y = out + r * C;
        if (r + 1 < r1)
            for (ptrdiff_t i = 0; i < C; i += 16) __builtin_prefetch(x + C + i, 0, 3);
        float s = 1.0f / sqrtf(ADT_LANES_FN(rms_sum_sq)(x, C) / (float)C + eps);
        ADT_VT sv = ADT_V(splat)(s);
        ptrdiff_t i = 0;
        for (; i + ADT_W <= C; i += ADT_W)
            ADT_V(store)(y + i, ADT_V(load)(weight + i) * (ADT_V(load)(x + i) * sv));
        for (; i < C; i++) y[i] = weight[i] * (x[i] * s);
        rrms[r] = s;
    }
}

/* Rows r0..r1 of the backward: dinp += (g - norm * mean(g * norm)) * rrms with
   g = weight * dout and norm = x * rrms (= when ow_dinp), and this block's partial sums
   part_w[c] = sum of norm * dout (overwritten). */
ADT_LANES_ATTR
static void ADT_LANES_FN(rms_backward_rows)(float* dinp, float* part_w, const float* dout,
                                            const float* inp, const float* weight,
                                            const float* rrms, ptrdiff_t r0, ptrdiff_t r1,
                                            ptrdiff_t C, int ow_dinp) {
    memset(part_w, 0, C * sizeof(float));
    for (ptrdiff_t r = r0; r < r1; r++) {
        const float* x = inp + r * C;
        const float* d = dout + r * C;
        float* dx = dinp + r * C;
        float s = rrms[r];
        ADT_VT sv = ADT_V(splat)(s);
        ADT_VT agx = {0};
        ptrdiff_t i = 0;
        for (; i + ADT_W <= C; i += ADT_W)
            agx += ADT_V(load)(weight + i) * ADT_V(load)(d + i) * ADT_V(load)(x + i);
        float tgx = 0.0f;
        for (; i < C; i++) tgx += weight[i] * d[i] * x[i];
        float mean_gn = (ADT_V(hsum)(agx) + tgx) * s / (float)C;
        ADT_VT mgn = ADT_V(splat)(mean_gn);
        for (i = 0; i + ADT_W <= C; i += ADT_W) {
            ADT_VT dv = ADT_V(load)(d + i);
            ADT_VT norm = ADT_V(load)(x + i) * sv;
            ADT_V(store)(part_w + i, ADT_V(load)(part_w + i) + norm * dv);
            ADT_VT v = (ADT_V(load)(weight + i) * dv - norm * mgn) * sv;
            ADT_V(store)(dx + i, ow_dinp ? v : ADT_V(load)(dx + i) + v);
        }
        for (; i < C; i++) {
            float norm = x[i] * s;
            part_w[i] += norm * d[i];
            float v = (weight[i] * d[i] - norm * mean_gn) * s;
            dx[i] = ow_dinp ? v : dx[i] + v;
        }
    }
}

/* Rotary embedding of rows r0..r1 of (B*T, W), W = n_heads * 2h, row r at position
   r % T: in each of the first n_rot heads, dims i and i + h (Hugging Face's
   rotate-half pairing) are rotated by the angle whose cosine and sine are row t of
   the (maxT, h) tables; the other heads are copied.  inverse: rotate by minus the angle
   (the backward).  ow: y is written, else added into.  y may be x itself: both halves
   of a pair are loaded before either is stored (then ow must be set). */
ADT_LANES_ATTR
static void ADT_LANES_FN(rope_rows)(float* y, const float* x, const float* cos_t,
                                    const float* sin_t, ptrdiff_t r0, ptrdiff_t r1,
                                    ptrdiff_t T, ptrdiff_t W, ptrdiff_t h, ptrdiff_t n_rot,
                                    int inverse, int ow) {
    const ptrdiff_t hd = 2 * h;
    for (ptrdiff_t r = r0; r < r1; r++) {
        const float* c = cos_t + (r % T) * h;
        const float* s = sin_t + (r % T) * h;
        const float* xr = x + r * W;
        float* yr = y + r * W;
        for (ptrdiff_t head = 0; head < n_rot; head++) {
            const float* x1 = xr + head * hd;
            const float* x2 = x1 + h;
            float* y1 = yr + head * hd;
            float* y2 = y1 + h;
            ptrdiff_t i = 0;
            for (; i + ADT_W <= h; i += ADT_W) {
                ADT_VT cv = ADT_V(load)(c + i), sv = ADT_V(load)(s + i);
                if (inverse) sv = -sv;
                ADT_VT a = ADT_V(load)(x1 + i), b = ADT_V(load)(x2 + i);
                ADT_VT u = a * cv - b * sv, v = b * cv + a * sv;
                ADT_V(store)(y1 + i, ow ? u : ADT_V(load)(y1 + i) + u);
                ADT_V(store)(y2 + i, ow ? v : ADT_V(load)(y2 + i) + v);
            }
            for (; i < h; i++) {
                float cs = c[i], sn = inverse ? -s[i] : s[i];
                float a = x1[i], b = x2[i];
                float u = a * cs - b * sn, v = b * cs + a * sn;
                y1[i] = ow ? u : y1[i] + u;
                y2[i] = ow ? v : y2[i] + v;
            }
        }
        ptrdiff_t i = n_rot * hd;
        if (yr == xr) continue;   /* in place: the other heads are already there */
        if (ow) {
            memcpy(yr + i, xr + i, (W - i) * sizeof(float));
            continue;
        }
        for (; i + ADT_W <= W; i += ADT_W)
            ADT_V(store)(yr + i, ADT_V(load)(yr + i) + ADT_V(load)(xr + i));
        for (; i < W; i++) yr[i] += xr[i];
    }
}

/* SwiGLU: silu(g) = g / (1 + e), e = 2^t, t = -g log2(e) (exp2_fast, which only meets
   1 + e here, as in GELU).  Beyond t = 80 log2(e) (g < -80) silu(g) is set to 0
   rather than left as a value that turns denormal downstream. */
#ifndef ADTAPE_SILU_T_MAX
#define ADTAPE_SILU_T_MAX ((float)(80.0 * ADT_LOG2E))
#endif

/* Rows r0..r1 of the forward: out[r, j] = silu(gate_up[r, j]) * gate_up[r, n_up + j]
   (n_up is Llama's I, the width of gate and of up; complex.h takes the name I). */
ADT_LANES_ATTR
static void ADT_LANES_FN(swiglu_forward_rows)(float* out, const float* gate_up, ptrdiff_t r0,
                                              ptrdiff_t r1, ptrdiff_t n_up) {
    const ADT_VT tmax = ADT_V(splat)(ADTAPE_SILU_T_MAX);
    for (ptrdiff_t r = r0; r < r1; r++) {
        const float* g = gate_up + r * 2 * n_up;
        const float* u = g + n_up;
        float* y = out + r * n_up;
        ptrdiff_t i = 0;
        for (; i + ADT_W <= n_up; i += ADT_W) {
            ADT_PREFETCH_R(g + i);
            ADT_PREFETCH_R(u + i);
            ADT_PREFETCH_W(y + i);
            ADT_VT gv = ADT_V(load)(g + i);
            ADT_VT t = gv * (float)(-ADT_LOG2E);
            ADT_VT e = ADT_V(exp2_fast)(ADT_V(min)(t, tmax));
            ADT_VT silu = ADT_V(select)(t > tmax, ADT_V(splat)(0.0f), ADT_V(divide)(gv, 1.0f + e));
            ADT_V(store)(y + i, silu * ADT_V(load)(u + i));
        }
        if (i < n_up) {
            float gt[ADT_W] = {0}, ut[ADT_W] = {0}, yt[ADT_W];
            memcpy(gt, g + i, (n_up - i) * sizeof(float));
            memcpy(ut, u + i, (n_up - i) * sizeof(float));
            ADT_VT gv = ADT_V(load)(gt);
            ADT_VT t = gv * (float)(-ADT_LOG2E);
            ADT_VT e = ADT_V(exp2_fast)(ADT_V(min)(t, tmax));
            ADT_VT silu = ADT_V(select)(t > tmax, ADT_V(splat)(0.0f), ADT_V(divide)(gv, 1.0f + e));
            ADT_V(store)(yt, silu * ADT_V(load)(ut));
            memcpy(y + i, yt, (n_up - i) * sizeof(float));
        }
    }
}

/* d/dgate = dout * up * s (1 + g e s) with s = 1 / (1 + e) (1 - s = e s), d/dup =
   dout * silu(g).  e s (at most 1, and 0 where s is) is taken first, so that g e s
   cannot overflow for g far below 0; g is taken at most 20 there: beyond, g e s is
   below half an ulp of 1 and would only be wrong (g e^-g with e^-g clamped at 2^-125
   is not small for g near the float maximum). */
ADT_LANES_INLINE void ADT_LANES_FN(swiglu_grads)(ADT_VT gv, ADT_VT uv, ADT_VT dv,
                                                ADT_VT* dg, ADT_VT* du) {
    const ADT_VT tmax = ADT_V(splat)(ADTAPE_SILU_T_MAX);
    ADT_VT t = gv * (float)(-ADT_LOG2E);
    ADT_VT e = ADT_V(exp2_fast)(ADT_V(min)(t, tmax));
    ADT_VT s = ADT_V(select)(t > tmax, ADT_V(splat)(0.0f),
                             ADT_V(divide)(ADT_V(splat)(1.0f), 1.0f + e));
    *du = dv * (gv * s);
    *dg = dv * uv * (s * (1.0f + ADT_V(min)(gv, ADT_V(splat)(20.0f)) * (e * s)));
}

/* Rows r0..r1 of the backward: dgate_up[r] (+)= [d/dgate | d/dup] (= when ow). */
ADT_LANES_ATTR
static void ADT_LANES_FN(swiglu_backward_rows)(float* dgate_up, const float* dout,
                                               const float* gate_up, ptrdiff_t r0,
                                               ptrdiff_t r1, ptrdiff_t n_up, int ow) {
    for (ptrdiff_t r = r0; r < r1; r++) {
        const float* g = gate_up + r * 2 * n_up;
        const float* u = g + n_up;
        const float* d = dout + r * n_up;
        float* dg = dgate_up + r * 2 * n_up;
        float* du = dg + n_up;
        ptrdiff_t i = 0;
        for (; i + ADT_W <= n_up; i += ADT_W) {
            ADT_PREFETCH_R(g + i);
            ADT_PREFETCH_R(u + i);
            ADT_PREFETCH_R(d + i);
            ADT_VT a, b;
            ADT_LANES_FN(swiglu_grads)(ADT_V(load)(g + i), ADT_V(load)(u + i),
                                       ADT_V(load)(d + i), &a, &b);
            ADT_V(store)(dg + i, ow ? a : ADT_V(load)(dg + i) + a);
            ADT_V(store)(du + i, ow ? b : ADT_V(load)(du + i) + b);
        }
        if (i < n_up) {
            float gt[ADT_W] = {0}, ut[ADT_W] = {0}, dt[ADT_W] = {0}, at[ADT_W], bt[ADT_W];
            memcpy(gt, g + i, (n_up - i) * sizeof(float));
            memcpy(ut, u + i, (n_up - i) * sizeof(float));
            memcpy(dt, d + i, (n_up - i) * sizeof(float));
            ADT_VT a, b;
            ADT_LANES_FN(swiglu_grads)(ADT_V(load)(gt), ADT_V(load)(ut), ADT_V(load)(dt), &a, &b);
            ADT_V(store)(at, a);
            ADT_V(store)(bt, b);
            for (ptrdiff_t j = 0; j < n_up - i; j++) {
                dg[i + j] = ow ? at[j] : dg[i + j] + at[j];
                du[i + j] = ow ? bt[j] : du[i + j] + bt[j];
            }
        }
    }
}
