"""kernels.llama (RMSNorm, RoPE, SwiGLU and rope_tables) against its naive twins, PyTorch in
float64, transformers' formulas and float64 finite differences, and misused."""
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import layers, llama, threads

F32 = np.float32
LLAMA32 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F32)


def t64(a, grad=False):
    return torch.tensor(np.asarray(a, np.float64), requires_grad=grad)


def close(actual, expected, rtol, scale=0.0):
    """Each element within rtol of itself or of the largest reference magnitude (or of
    `scale`, for results that cancel to about 0), as in test_kernels_layers."""
    expected = np.asarray(expected, dtype=np.float64)
    atol = rtol * max(np.abs(expected).max(initial=0.0), scale, 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def fd_check(forward, inputs, wrt, analytic, n_probe=12, h=1e-6, seed=0):
    """Central differences in float64 of forward(inputs) (a scalar) against the analytic
    gradients analytic[name], at n_probe random elements of each input in wrt."""
    rng = np.random.default_rng(seed)
    for name in wrt:
        flat = inputs[name].reshape(-1)
        for i in rng.choice(flat.size, size=min(n_probe, flat.size), replace=False):
            orig = flat[i]
            flat[i] = orig + h
            plus = forward(inputs)
            flat[i] = orig - h
            minus = forward(inputs)
            flat[i] = orig
            numeric = (plus - minus) / (2 * h)
            got = analytic[name].reshape(-1)[i]
            assert abs(got - numeric) <= 1e-6 * max(1.0, abs(numeric)), (name, i, got, numeric)


# ---------------------------------------------------------------------------
# RMSNorm

# (B, T, C): C = 1, 3, 17 (one vector and a tail in either width), 576 (SmolLM2); T from
# 1 to above 64 (several row blocks in the backward), B > 1.
RMS_SHAPES = [(1, 1, 1), (2, 3, 3), (1, 5, 17), (3, 7, 40), (2, 33, 576), (1, 70, 130),
              (3, 65, 17)]


def rms_reference(x, w, eps):
    """Hugging Face's LlamaRMSNorm in torch float64."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("B,T,C", RMS_SHAPES)
def test_rmsnorm_matches_naive_and_torch(B, T, C, vector_lanes):
    rng = np.random.default_rng(1)
    eps = 1e-5
    x, w = rand(rng, B, T, C, scale=2.0) + 0.3, 1 + rand(rng, C, scale=0.5)
    out, rrms = np.empty_like(x), np.empty((B, T), F32)
    llama.rmsnorm_forward(out, rrms, x, w, eps)
    out_n, rrms_n = np.empty_like(x), np.empty_like(rrms)
    llama.rmsnorm_forward_naive(out_n, rrms_n, x, w, eps)
    close(out, out_n, 1e-5)
    close(rrms, rrms_n, 1e-5)

    tx, tw = t64(x, True), t64(w, True)
    tout = rms_reference(tx, tw, eps)
    close(out, tout.detach().numpy(), 1e-5)
    close(rrms, 1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1) + eps), 1e-5)

    dout = rand(rng, B, T, C)
    tout.backward(t64(dout))
    grads0 = [rand(rng, B, T, C), rand(rng, C)]        # backward accumulates
    grads = [g.copy() for g in grads0]
    llama.rmsnorm_backward(*grads, dout, x, w, rrms)
    # With C = 1 the input's gradient cancels to about 0: its natural scale is
    # |dout * weight| * rrms.
    scales = (float(np.abs(dout * w).max() * rrms.max()), 0.0)
    for got, g0, ref, scale in zip(grads, grads0, (tx.grad, tw.grad), scales):
        close(got - g0, ref.numpy(), 1e-4, scale=scale)
    grads_n = [g.copy() for g in grads0]
    llama.rmsnorm_backward_naive(*grads_n, dout, x, w, rrms)
    for got, ref, scale in zip(grads, grads_n, scales):
        close(got, ref, 1e-5, scale=scale)
    for flags in ((True, False), (False, True), (True, True)):
        fresh = [np.full_like(g, np.nan) if f else g0.copy()
                 for g, g0, f in zip(grads, grads0, flags)]
        llama.rmsnorm_backward(*fresh, dout, x, w, rrms, overwrite=flags)
        for got, want, g0, f, scale in zip(fresh, grads, grads0, flags, scales):
            close(got, want - g0 if f else want, 1e-5, scale=scale)


def test_rmsnorm_float32_statistics_as_hugging_face():
    # LlamaRMSNorm on float32 input: variance and rsqrt in float32, then the weight.
    rng = np.random.default_rng(2)
    x, w = rand(rng, 4, 9, 576, scale=3.0), rand(rng, 576)
    out, rrms = np.empty_like(x), np.empty((4, 9), F32)
    llama.rmsnorm_forward(out, rrms, x, w, 1e-6)
    tx = torch.tensor(x)
    r = torch.rsqrt(tx.pow(2).mean(-1, keepdim=True) + 1e-6)
    np.testing.assert_allclose(rrms, r[..., 0].numpy(), rtol=3e-7)
    np.testing.assert_allclose(out, (torch.tensor(w) * (tx * r)).numpy(), rtol=5e-7, atol=1e-7)


def test_rmsnorm_accepts_rows_and_threads_agree(vector_lanes):
    rng = np.random.default_rng(3)
    B, T, C = 3, 100, 130            # 300 rows: four row blocks in the backward
    x, w = rand(rng, B, T, C), rand(rng, C)
    dout = rand(rng, B, T, C)
    results = []
    for shape, n_threads in (((B, T, C), 1), ((B, T, C), 2), ((B * T, C), 2)):
        xs, ds = x.reshape(shape), dout.reshape(shape)
        out, rrms = np.empty(shape, F32), np.empty(shape[:-1], F32)
        llama.rmsnorm_forward(out, rrms, xs, w, 1e-5, n_threads=n_threads)
        dx, dw = np.empty(shape, F32), np.empty(C, F32)
        llama.rmsnorm_backward(dx, dw, ds, xs, w, rrms, overwrite=True, n_threads=n_threads)
        results.append([a.reshape(-1) for a in (out, rrms, dx, dw)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_rmsnorm_backward_finite_differences():
    rng = np.random.default_rng(4)
    B, T, C, eps = 2, 3, 5, 1e-3
    inputs = {"inp": rng.standard_normal((B, T, C)), "weight": rng.standard_normal(C)}
    probe = rng.standard_normal((B, T, C))

    def forward(inp):
        out, rrms = np.empty((B, T, C)), np.empty((B, T))
        llama.rmsnorm_forward_naive(out, rrms, inp["inp"], inp["weight"], eps)
        return float((out * probe).sum())

    out, rrms = np.empty((B, T, C)), np.empty((B, T))
    llama.rmsnorm_forward_naive(out, rrms, inputs["inp"], inputs["weight"], eps)
    grads = {"inp": np.zeros((B, T, C)), "weight": np.zeros(C)}
    llama.rmsnorm_backward_naive(grads["inp"], grads["weight"], probe, inputs["inp"],
                                 inputs["weight"], rrms)
    fd_check(forward, inputs, ["inp", "weight"], grads, n_probe=15)


def test_rmsnorm_zero_row_and_eps():
    x, w = np.zeros((2, 8), F32), np.ones(8, F32)
    out, rrms = np.empty_like(x), np.empty(2, F32)
    llama.rmsnorm_forward(out, rrms, x, w, 1e-6)
    np.testing.assert_allclose(rrms, 1 / np.sqrt(np.float32(1e-6)), rtol=1e-6)
    assert not out.any()
    for bad in (-1e-6, math.inf, math.nan, "1e-6", True, None):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            llama.rmsnorm_forward(out, rrms, x, w, bad)
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            llama.rmsnorm_forward_naive(out, rrms, x, w, bad)


# ---------------------------------------------------------------------------
# RoPE

def rotate_half(x):
    x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x, cos, sin, head_dim, n_rot):
    """Hugging Face's apply_rotary_pos_emb on the first n_rot heads of (B, T, W), torch
    float64, with the same (half-width) tables laid out as transformers lays them
    (cat(freqs, freqs))."""
    B, T, W = x.shape
    heads = x.reshape(B, T, W // head_dim, head_dim)
    c = torch.cat([t64(cos[:T])] * 2, dim=-1)[None, :, None, :]
    s = torch.cat([t64(sin[:T])] * 2, dim=-1)[None, :, None, :]
    rotated = heads[:, :, :n_rot] * c + rotate_half(heads[:, :, :n_rot]) * s
    return torch.cat([rotated, heads[:, :, n_rot:]], dim=2).reshape(B, T, W)


# (B, T, head_dim, n_q, n_kv, extra table rows): SmolLM2's 9 + 3 + 3 heads of 64, Llama 3's
# heads of 128, T from 1 to above 64, and head sizes whose half is a vector and a tail
# (17: 16 + 1, 8 + 8 + 1) or below a vector (3).
ROPE_CASES = [(2, 70, 64, 9, 3, 0), (1, 1, 64, 9, 3, 5), (3, 65, 128, 4, 2, 3),
              (2, 7, 128, 2, 1, 0), (2, 9, 34, 3, 1, 2), (1, 5, 6, 2, 2, 0)]


@pytest.mark.parametrize("B,T,head_dim,n_q,n_kv,extra", ROPE_CASES)
def test_rope_matches_naive_and_torch(B, T, head_dim, n_q, n_kv, extra, vector_lanes):
    rng = np.random.default_rng(5)
    cos, sin = llama.rope_tables(head_dim, T + extra, 10000.0)
    W, n_rot = (n_q + 2 * n_kv) * head_dim, n_q + n_kv
    x = rand(rng, B, T, W)
    out = np.empty_like(x)
    llama.rope_forward(out, x, cos, sin, n_rot)
    out_n = np.empty_like(x)
    llama.rope_forward_naive(out_n, x, cos, sin, n_rot)
    close(out, out_n, 1e-6)
    tx = t64(x, True)
    tout = rope_reference(tx, cos, sin, head_dim, n_rot)
    close(out, tout.detach().numpy(), 1e-6)
    np.testing.assert_array_equal(out[..., n_rot * head_dim:], x[..., n_rot * head_dim:])
    inplace = x.copy()
    llama.rope_forward(inplace, inplace, cos, sin, n_rot)
    np.testing.assert_array_equal(inplace, out)

    dout = rand(rng, B, T, W)
    tout.backward(t64(dout))
    prior = rand(rng, B, T, W)
    dx = prior.copy()
    llama.rope_backward(dx, dout, cos, sin, n_rot)
    close(dx - prior, tx.grad.numpy(), 1e-6)
    dx_n = prior.copy()
    llama.rope_backward_naive(dx_n, dout, cos, sin, n_rot)
    close(dx, dx_n, 1e-6)
    fresh = np.full_like(x, np.nan)
    llama.rope_backward(fresh, dout, cos, sin, n_rot, overwrite=True)
    close(fresh, tx.grad.numpy(), 1e-6)
    inplace = dout.copy()              # dinp is dout: rotated back in place, overwritten
    llama.rope_backward(inplace, inplace, cos, sin, n_rot)
    np.testing.assert_array_equal(inplace, fresh)
    inplace = dout.copy()
    llama.rope_backward_naive(inplace, inplace, cos, sin, n_rot)
    close(inplace, fresh, 1e-6)
    # the backward is the inverse: it takes the forward's output back to its input
    back = np.empty_like(x)
    llama.rope_backward(back, out, cos, sin, n_rot, overwrite=True)
    close(back, x, 1e-6)


def test_rope_float64_twins_are_exact_rotations():
    rng = np.random.default_rng(6)
    B, T, head_dim, n_rot = 2, 5, 8, 2
    angles = np.arange(T)[:, None] * rng.standard_normal(head_dim // 2)[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    x = rng.standard_normal((B, T, 3 * head_dim))
    out = np.empty_like(x)
    llama.rope_forward_naive(out, x, cos, sin, n_rot)
    np.testing.assert_allclose(out, rope_reference(t64(x), cos, sin, head_dim, n_rot).numpy(),
                               rtol=1e-14, atol=1e-15)
    dx = np.zeros_like(x)
    llama.rope_backward_naive(dx, out, cos, sin, n_rot)
    np.testing.assert_allclose(dx, x, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("n_rot", [0, 15])
def test_rope_none_or_all_heads_and_threads_agree(n_rot, vector_lanes):
    rng = np.random.default_rng(7)
    B, T, head_dim = 4, 256, 64
    cos, sin = llama.rope_tables(head_dim, T, 10000.0)
    x, dout = rand(rng, B, T, 15 * head_dim), rand(rng, B, T, 15 * head_dim)
    runs = []
    for n_threads in (1, 2):
        out, dx = np.empty_like(x), dout.copy()
        llama.rope_forward(out, x, cos, sin, n_rot, n_threads=n_threads)
        llama.rope_backward(dx, dout, cos, sin, n_rot, n_threads=n_threads)
        runs.append((out, dx))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    if n_rot == 0:
        np.testing.assert_array_equal(runs[0][0], x)
        np.testing.assert_array_equal(runs[0][1], 2 * dout)
    else:
        close(runs[0][0], rope_reference(t64(x), cos, sin, head_dim, n_rot).numpy(), 1e-6)


# rope_tables

def inv_freq64(head_dim, theta, scaling=None):
    """transformers' inverse frequencies (_compute_default_rope_parameters,
    _compute_llama3_parameters) in float64."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if scaling is None:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled)


@pytest.mark.parametrize("head_dim,theta,scaling", [(64, 10000.0, None), (128, 500000.0, None),
                                                    (64, 100000.0, None), (64, 500000.0, LLAMA32),
                                                    (128, 500000.0, LLAMA32), (6, 10.0, None)])
def test_rope_tables_match_transformers_formulas(head_dim, theta, scaling):
    T = 9000
    cos, sin = llama.rope_tables(head_dim, T, theta, scaling)
    assert cos.dtype == sin.dtype == F32 and cos.shape == sin.shape == (T, head_dim // 2)
    assert cos.flags.c_contiguous and sin.flags.c_contiguous
    angles = np.arange(T)[:, None] * inv_freq64(head_dim, theta, scaling)[None, :]
    # transformers computes in float32: the exponent i / d, the power, the reciprocal,
    # the product with t (and Llama 3's few operations) each round, and the power
    # magnifies the exponent's rounding by ln(theta): the angle is off by up to
    # (ln(theta) + 10) 2^-24 of itself, the cosine and sine by that much more.
    tol = (math.log(theta) + 10) * 2.0 ** -24 * angles + 2.0 ** -23
    assert np.all(np.abs(cos - np.cos(angles)) <= tol)
    assert np.all(np.abs(sin - np.sin(angles)) <= tol)
    if scaling is not None:
        assert np.any(np.abs(inv_freq64(head_dim, theta, scaling) - inv_freq64(head_dim, theta))
                      > 1e-3 * inv_freq64(head_dim, theta))


def test_rope_tables_match_transformers_itself():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    T = 8192
    for head_dim, theta, scaling in ((64, 10000.0, None), (64, 500000.0, LLAMA32),
                                     (128, 500000.0, None)):
        params = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
        config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                                          head_dim=head_dim, max_position_embeddings=2 * T,
                                          rope_parameters=params)
        hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(T)[None])
        cos, sin = llama.rope_tables(head_dim, T, theta, scaling)
        # within an ulp of PyTorch's float32 cos and sin (ours are correctly rounded)
        np.testing.assert_allclose(cos, hf_cos[0, :, :head_dim // 2].numpy(), rtol=0, atol=6e-8)
        np.testing.assert_allclose(sin, hf_sin[0, :, :head_dim // 2].numpy(), rtol=0, atol=6e-8)
        np.testing.assert_array_equal(hf_cos[0, :, :head_dim // 2], hf_cos[0, :, head_dim // 2:])


def test_rope_tables_reject_bad_arguments():
    for bad in (63, 0, -2, 64.0, True):
        with pytest.raises(ValueError, match="head_dim must be an even integer >= 2"):
            llama.rope_tables(bad, 10)
    with pytest.raises(ValueError, match="max_positions must be an integer >= 0"):
        llama.rope_tables(64, -1)
    for bad in (0.0, -1.0, math.inf, "1e4"):
        with pytest.raises(ValueError, match="theta must be a finite number > 0"):
            llama.rope_tables(64, 10, bad)
    with pytest.raises(ValueError, match="rope_type must be 'default' or 'llama3', got 'yarn'"):
        llama.rope_tables(64, 10, 1e4, dict(LLAMA32, rope_type="yarn"))
    with pytest.raises(ValueError, match=r"scaling\['low_freq_factor'\] must be a finite number"):
        llama.rope_tables(64, 10, 1e4, {k: v for k, v in LLAMA32.items() if k != "low_freq_factor"})
    with pytest.raises(ValueError, match="high_freq_factor"):
        llama.rope_tables(64, 10, 1e4, dict(LLAMA32, high_freq_factor=1.0))
    with pytest.raises(ValueError, match="scaling must be None or a dict"):
        llama.rope_tables(64, 10, 1e4, [("rope_type", "llama3")])
    assert llama.rope_tables(64, 0)[0].shape == (0, 32)
    default = llama.rope_tables(64, 5, 1e4)
    for same in ({"rope_type": "default"}, {"type": "default"}):
        for a, b in zip(default, llama.rope_tables(64, 5, 1e4, same)):
            np.testing.assert_array_equal(a, b)
    old_style = {k: v for k, v in LLAMA32.items() if k != "rope_type"}
    for a, b in zip(llama.rope_tables(64, 5, 5e5, LLAMA32),
                    llama.rope_tables(64, 5, 5e5, dict(old_style, type="llama3"))):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------
# SwiGLU

# (leading shape, I): I = 1, 3, 17, 1536 (SmolLM2), rows from 1 to above 64
SWIGLU_CASES = [((1,), 1), ((2, 3), 3), ((5,), 17), ((3, 70), 17), ((2, 9), 40), ((4, 16), 1536)]


@pytest.mark.parametrize("lead,I", SWIGLU_CASES)
def test_swiglu_matches_naive_and_torch(lead, I, vector_lanes):
    rng = np.random.default_rng(8)
    gu = rand(rng, *lead, 2 * I, scale=3.0)
    out = np.empty(lead + (I,), F32)
    llama.swiglu_forward(out, gu)
    out_n = np.empty_like(out)
    llama.swiglu_forward_naive(out_n, gu)
    close(out, out_n, 2e-6)
    tg = t64(gu, True)
    tout = F.silu(tg[..., :I]) * tg[..., I:]
    close(out, tout.detach().numpy(), 2e-6)

    dout = rand(rng, *lead, I)
    tout.backward(t64(dout))
    prior = rand(rng, *gu.shape)
    dg = prior.copy()
    llama.swiglu_backward(dg, dout, gu)
    close(dg - prior, tg.grad.numpy(), 1e-5)
    dg_n = prior.copy()
    llama.swiglu_backward_naive(dg_n, dout, gu)
    close(dg, dg_n, 1e-5)
    fresh = np.full_like(gu, np.nan)
    llama.swiglu_backward(fresh, dout, gu, overwrite=True)
    close(fresh, tg.grad.numpy(), 1e-5)


def test_swiglu_extremes(vector_lanes):
    gate = np.array([0.0, -0.0, 1e-30, -1e-30, 5.0, -5.0, 17.0, 21.0, -30.0, 30.0, -79.0, -81.0,
                     -87.0, -90.0, 88.0, 1e30, -1e30, 3e38, np.inf], F32)
    I = gate.size
    up = np.linspace(-2, 3, I).astype(F32)
    up[-2] = 0.25                      # silu(3e38) * up stays finite
    gu = np.concatenate([gate, up])[None]
    out = np.empty((1, I), F32)
    llama.swiglu_forward(out, gu)
    tg = t64(gu, True)
    tout = F.silu(tg[:, :I]) * tg[:, I:]
    ref = tout.detach().numpy()
    assert np.isfinite(out[0, :-1]).all() and out[0, -1] == np.inf
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-30)
    assert out[0, gate < -80].tolist() == [0.0] * int((gate < -80).sum())   # no denormals
    dout = np.ones((1, I), F32)
    tout[:, :-1].sum().backward()
    dg = np.empty_like(gu)
    llama.swiglu_backward(dg, dout, gu, overwrite=True)
    finite = np.r_[np.ones(I - 1, bool), False, np.ones(I - 1, bool), False]
    np.testing.assert_allclose(dg[0, finite], tg.grad.numpy()[0, finite], rtol=2e-6, atol=1e-30)
    nan_gate = gu.copy()
    nan_gate[0, 0] = np.nan
    llama.swiglu_forward(out, nan_gate)
    assert np.isnan(out[0, 0]) and np.isfinite(out[0, 1:-1]).all()


def test_swiglu_threads_agree(vector_lanes):
    rng = np.random.default_rng(9)
    gu, dout = rand(rng, 4, 64, 2 * 96, scale=3.0), rand(rng, 4, 64, 96)
    runs = []
    for n_threads in (1, 2):
        out, dg = np.empty((4, 64, 96), F32), np.empty_like(gu)
        llama.swiglu_forward(out, gu, n_threads=n_threads)
        llama.swiglu_backward(dg, dout, gu, overwrite=True, n_threads=n_threads)
        runs.append((out, dg))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_swiglu_backward_finite_differences():
    rng = np.random.default_rng(10)
    N, I = 3, 4
    inputs = {"gate_up": rng.standard_normal((N, 2 * I)) * 2}
    probe = rng.standard_normal((N, I))

    def forward(inp):
        out = np.empty((N, I))
        llama.swiglu_forward_naive(out, inp["gate_up"])
        return float((out * probe).sum())

    grads = {"gate_up": np.zeros((N, 2 * I))}
    llama.swiglu_backward_naive(grads["gate_up"], probe, inputs["gate_up"])
    fd_check(forward, inputs, ["gate_up"], grads, n_probe=2 * N * I)


# ---------------------------------------------------------------------------
# the eight-lane builds: explicit x86-64-v3 and target clones

def test_eight_lane_builds_agree():
    """The x86-64-v3 build and the target clones give the same bits (see
    test_kernels_layers.test_eight_lane_builds_agree)."""
    rng = np.random.default_rng(11)
    x, w, d = rand(rng, 3, 37, 131, scale=3.0), rand(rng, 131), rand(rng, 3, 37, 131)
    cos, sin = llama.rope_tables(34, 37, 1e4)
    q, dq = rand(rng, 3, 37, 5 * 34), rand(rng, 3, 37, 5 * 34)
    gu, dy = rand(rng, 3, 37, 2 * 131, scale=8.0), rand(rng, 3, 37, 131)
    gu[0, 0, :13] = [0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 90.0, -90.0, 1e30, -1e30, np.inf,
                     -np.inf, np.nan]

    def run():
        out = {"rms": np.empty_like(x), "rrms": np.empty((3, 37), F32), "dx": np.empty_like(x),
               "dw": np.empty_like(w), "rope": np.empty_like(q), "drope": np.empty_like(q),
               "swiglu": np.empty_like(dy), "dswiglu": np.empty_like(gu)}
        llama.rmsnorm_forward(out["rms"], out["rrms"], x, w, 1e-5)
        llama.rmsnorm_backward(out["dx"], out["dw"], d, x, w, out["rrms"], overwrite=True)
        llama.rope_forward(out["rope"], q, cos, sin, 3)
        llama.rope_backward(out["drope"], dq, cos, sin, 3, overwrite=True)
        llama.swiglu_forward(out["swiglu"], gu)
        llama.swiglu_backward(out["dswiglu"], dy, gu, overwrite=True)
        return out

    old_lanes = layers.set_vector_lanes(8)
    try:
        built = run()
        layers.set_eight_lane_clones(True)
        clones = run()
    finally:
        layers.set_eight_lane_clones(False)
        layers.set_vector_lanes(old_lanes)
    for name in built:
        np.testing.assert_array_equal(built[name], clones[name], err_msg=name)


# ---------------------------------------------------------------------------
# misuse: zero sizes, thread counts, read-only and overlapping outputs, bad arguments
# (the cases of tests/kernels/test_kernels_misuse.py, run in this process: every one is refused
# or done before any thread starts)

def _arr(rng, shape):
    return rng.standard_normal(shape).astype(F32)


def _copies(arrays):
    return {k: v.copy() for k, v in arrays.items()}


def _outcome(call):
    """'ok', or the exception as 'TypeName: message'."""
    try:
        call()
    except Exception as e:      # noqa: BLE001 - the outcome is the test's subject
        return f"{type(e).__name__}: {e}"
    return "ok"


def _placed_together(first, second, offset):
    """Copies of two arrays in one buffer, the second starting ``offset`` floats into
    the first (each keeps its values where they do not overlap)."""
    buf = np.zeros(max(first.size, offset + second.size), F32)
    a = buf[:first.size].reshape(first.shape)
    b = buf[offset:offset + second.size].reshape(second.shape)
    a[...] = first
    b[...] = second
    return a, b


THREAD_COUNTS = (threads.MAX_THREADS + 1, 65536, 0, -1, True, 2.0)


def _thread_error(n):
    return (f"ValueError: n_threads must be an integer in [1, {threads.MAX_THREADS}] "
            f"(kernels.threads.MAX_THREADS), got {n!r}")


def _rmsnorm_forward(rng, s):
    B, T, C = s["B"], s["T"], s["C"]
    return (dict(out=_arr(rng, (B, T, C)), rrms=_arr(rng, (B, T))),
            dict(inp=_arr(rng, (B, T, C)), weight=_arr(rng, C)),
            lambda f, o, i, **kw: f(o["out"], o["rrms"], i["inp"], i["weight"], 1e-5, **kw))


def _rmsnorm_backward(rng, s):
    B, T, C = s["B"], s["T"], s["C"]
    inp = _arr(rng, (B, T, C))
    rrms = (1 / np.sqrt((inp ** 2).sum(-1) / max(C, 1) + 1e-5)).astype(F32)
    return (dict(dinp=_arr(rng, (B, T, C)), dweight=_arr(rng, C)),
            dict(dout=_arr(rng, (B, T, C)), inp=inp, weight=_arr(rng, C), rrms=rrms),
            lambda f, o, i, **kw: f(o["dinp"], o["dweight"], i["dout"], i["inp"], i["weight"],
                                    i["rrms"], **kw))


def _tables(s):
    if s["h"] == 0 or s["maxT"] == 0:
        return np.zeros((s["maxT"], s["h"]), F32), np.zeros((s["maxT"], s["h"]), F32)
    return llama.rope_tables(2 * s["h"], s["maxT"], 1e4)


def _rope_forward(rng, s):
    B, T, W = s["B"], s["T"], s["heads"] * 2 * s["h"]
    cos, sin = _tables(s)
    return (dict(out=_arr(rng, (B, T, W))), dict(inp=_arr(rng, (B, T, W)), cos=cos, sin=sin),
            lambda f, o, i, **kw: f(o["out"], i["inp"], i["cos"], i["sin"],
                                    min(s["rot"], s["heads"]), **kw))


def _rope_backward(rng, s):
    B, T, W = s["B"], s["T"], s["heads"] * 2 * s["h"]
    cos, sin = _tables(s)
    return (dict(dinp=_arr(rng, (B, T, W))), dict(dout=_arr(rng, (B, T, W)), cos=cos, sin=sin),
            lambda f, o, i, **kw: f(o["dinp"], i["dout"], i["cos"], i["sin"],
                                    min(s["rot"], s["heads"]), **kw))


def _swiglu_forward(rng, s):
    B, T, I = s["B"], s["T"], s["I"]
    return (dict(out=_arr(rng, (B, T, I))), dict(gate_up=_arr(rng, (B, T, 2 * I))),
            lambda f, o, i, **kw: f(o["out"], i["gate_up"], **kw))


def _swiglu_backward(rng, s):
    B, T, I = s["B"], s["T"], s["I"]
    return (dict(dgate_up=_arr(rng, (B, T, 2 * I))),
            dict(dout=_arr(rng, (B, T, I)), gate_up=_arr(rng, (B, T, 2 * I))),
            lambda f, o, i, **kw: f(o["dgate_up"], i["dout"], i["gate_up"], **kw))


ROPE_SIZES = dict(B=2, T=3, h=4, heads=3, rot=2, maxT=5)
# name: (fast kernel, naive twin, builder, default sizes, has an overwrite flag)
KERNELS = {
    "rmsnorm_forward": (llama.rmsnorm_forward, llama.rmsnorm_forward_naive, _rmsnorm_forward,
                        dict(B=2, T=3, C=20), False),
    "rmsnorm_backward": (llama.rmsnorm_backward, llama.rmsnorm_backward_naive,
                         _rmsnorm_backward, dict(B=2, T=3, C=20), True),
    "rope_forward": (llama.rope_forward, llama.rope_forward_naive, _rope_forward, ROPE_SIZES,
                     False),
    "rope_backward": (llama.rope_backward, llama.rope_backward_naive, _rope_backward, ROPE_SIZES,
                      True),
    "swiglu_forward": (llama.swiglu_forward, llama.swiglu_forward_naive, _swiglu_forward,
                       dict(B=2, T=3, I=20), False),
    "swiglu_backward": (llama.swiglu_backward, llama.swiglu_backward_naive, _swiglu_backward,
                        dict(B=2, T=3, I=20), True),
}
TWINS = ("fast", "naive")

ZERO_CASES = [(name, size, ow, nt) for name, (_, _, _, sizes, has_ow) in KERNELS.items()
              for size in (*sizes, "all") for ow in ((False, True) if has_ow else (None,))
              for nt in (None, 3)]
# The zero sizes a kernel rejects, with what its ValueError says: no row can be normalised
# over C = 0 channels, no head has size 0, and a table needs a row per position.
ZERO_ERRORS = {
    ("rmsnorm_forward", "C"): r"with C >= 1, got \(2, 3, 0\)",
    ("rmsnorm_forward", "all"): r"with C >= 1, got \(0, 0, 0\)",
    ("rmsnorm_backward", "C"): r"with C >= 1, got \(2, 3, 0\)",
    ("rmsnorm_backward", "all"): r"with C >= 1, got \(0, 0, 0\)",
    ("rope_forward", "h"): r"cos must have shape \(maxT, head_dim/2\) with maxT >= T=3 and "
                           r"head_dim/2 >= 1, got \(5, 0\)",
    ("rope_forward", "maxT"): r"maxT >= T=3 .*got \(0, 4\)",
    ("rope_forward", "all"): r"head_dim/2 >= 1, got \(0, 0\)",
    ("rope_backward", "h"): r"head_dim/2 >= 1, got \(5, 0\)",
    ("rope_backward", "maxT"): r"maxT >= T=3 .*got \(0, 4\)",
    ("rope_backward", "all"): r"head_dim/2 >= 1, got \(0, 0\)",
}


def _key(*parts):
    return "/".join(str(p) for p in parts)


@pytest.mark.parametrize("name,size,overwrite,n_threads", ZERO_CASES, ids=_key)
def test_zero_size_gives_the_naive_result_or_a_value_error(name, size, overwrite, n_threads):
    fast, naive, build, sizes, _ = KERNELS[name]
    sizes = {k: 0 if size in (k, "all") else v for k, v in sizes.items()}
    kw = {} if overwrite is None else {"overwrite": overwrite}
    outs, ins, call = build(np.random.default_rng(1), sizes)
    ref_outs, ref_ins = _copies(outs), _copies(ins)
    got = _outcome(lambda: call(fast, outs, ins, n_threads=n_threads, **kw))
    want = _outcome(lambda: call(naive, ref_outs, ref_ins, **kw))
    assert got == want
    error = ZERO_ERRORS.get((name, size))
    if error is not None:
        assert re.fullmatch("ValueError: .*" + error + ".*", got), got
        return
    assert got == "ok"
    for key in outs:
        np.testing.assert_allclose(outs[key], ref_outs[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("n_threads", THREAD_COUNTS)
def test_thread_count_out_of_range_is_a_value_error(name, twin, n_threads):
    fast, naive, build, sizes, _ = KERNELS[name]
    outs, ins, call = build(np.random.default_rng(2), sizes)
    kernel = fast if twin == "fast" else naive
    assert _outcome(lambda: call(kernel, outs, ins, n_threads=n_threads)) == \
        _thread_error(n_threads)


def _arrays(name):
    fast, naive, build, sizes, _ = KERNELS[name]
    return build(np.random.default_rng(0), sizes)[:2]


READ_ONLY_CASES = [(name, twin, output) for name in KERNELS for twin in TWINS
                   for output in _arrays(name)[0]]


@pytest.mark.parametrize("name,twin,output", READ_ONLY_CASES, ids=_key)
def test_read_only_output_is_a_value_error(name, twin, output):
    fast, naive, build, sizes, _ = KERNELS[name]
    outs, ins, call = build(np.random.default_rng(3), sizes)
    before = _copies({**outs, **ins})
    outs[output].flags.writeable = False
    got = _outcome(lambda: call(fast if twin == "fast" else naive, outs, ins))
    assert got == f"ValueError: {output} must be writable (it is an output)"
    for key, arr in {**outs, **ins}.items():
        np.testing.assert_array_equal(arr, before[key], err_msg=key)


# The pairs a kernel documents as in place, when they are the very same memory.
SAME_OK = {("rope_forward", "out", "inp"), ("rope_backward", "dinp", "dout")}


def _alias_cases():
    cases = []
    for name in KERNELS:
        outs, ins = _arrays(name)
        names = list(outs) + list(ins)
        for i, output in enumerate(outs):
            for other in names[i + 1:]:
                smaller = min(outs[output].size, {**outs, **ins}[other].size)
                for offset in sorted({0, smaller // 2, smaller - 1}):
                    for twin in TWINS:
                        cases.append((name, twin, output, other, offset))
    return cases


@pytest.mark.parametrize("name,twin,output,other,offset", _alias_cases(), ids=_key)
def test_output_overlapping_an_input_or_output_is_a_value_error(name, twin, output, other,
                                                                offset):
    fast, naive, build, sizes, _ = KERNELS[name]
    outs, ins, call = build(np.random.default_rng(4), sizes)
    where = outs if other in outs else ins
    same = offset == 0 and outs[output].nbytes == where[other].nbytes
    outs[output], where[other] = _placed_together(outs[output], where[other], offset)
    got = _outcome(lambda: call(fast if twin == "fast" else naive, outs, ins))
    if same and (name, output, other) in SAME_OK:
        assert got == "ok"
    else:
        assert got.startswith(f"ValueError: {output} overlaps {other}: "), got


def test_rmsnorm_rejects_bad_arguments():
    rng = np.random.default_rng(12)
    x, w = rand(rng, 2, 3, 4), rand(rng, 4)
    out, rrms = np.empty_like(x), np.empty((2, 3), F32)
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        llama.rmsnorm_forward(out, rrms, x, w[:3], 1e-5)
    with pytest.raises(ValueError, match=r"rrms must have shape \(2, 3\)"):
        llama.rmsnorm_forward(out, np.empty(6, F32), x, w, 1e-5)
    with pytest.raises(TypeError, match="inp must be an aligned native float32"):
        llama.rmsnorm_forward(out, rrms, x.astype(np.float64), w, 1e-5)
    with pytest.raises(ValueError, match="inp must be C-contiguous"):
        llama.rmsnorm_forward(out, rrms, np.swapaxes(x, 0, 1), w, 1e-5)
    with pytest.raises(ValueError, match=r"inp must have shape \(B, T, C\) or \(N, C\)"):
        llama.rmsnorm_forward(out.reshape(-1), rrms, x.reshape(-1), w, 1e-5)
    with pytest.raises(TypeError, match="weight must be a numpy.ndarray"):
        llama.rmsnorm_forward(out, rrms, x, list(w), 1e-5)
    with pytest.raises(ValueError, match=r"dout must have shape \(2, 3, 4\)"):
        llama.rmsnorm_backward(np.empty_like(x), np.empty_like(w), x[:1].copy(), x, w, rrms)
    with pytest.raises(ValueError, match=r"overwrite must be a bool or 2 bools"):
        llama.rmsnorm_backward(np.empty_like(x), np.empty_like(w), x, x, w, rrms,
                               overwrite=(True,))


def test_rope_rejects_bad_arguments():
    rng = np.random.default_rng(13)
    cos, sin = llama.rope_tables(8, 6, 1e4)
    x = rand(rng, 2, 5, 24)
    out = np.empty_like(x)
    with pytest.raises(ValueError, match=r"inp's last axis W=20 must be a multiple of head_dim "
                                         r"= 2 \* cos.shape\[1\] = 8"):
        llama.rope_forward(np.empty((2, 5, 20), F32), x[..., :20].copy(), cos, sin, 1)
    with pytest.raises(ValueError, match=r"inp must have shape \(B, T, W\)"):
        llama.rope_forward(out[0], x[0], cos, sin, 1)
    with pytest.raises(ValueError, match="maxT >= T=5"):
        llama.rope_forward(out, x, cos[:4].copy(), sin[:4].copy(), 1)
    with pytest.raises(ValueError, match=r"sin must have shape \(6, 4\)"):
        llama.rope_forward(out, x, cos, sin[:, :3].copy(), 1)
    with pytest.raises(TypeError, match="cos must be an aligned native float32"):
        llama.rope_forward(out, x, cos.astype(np.float64), sin, 1)
    with pytest.raises(ValueError, match="cos must be C-contiguous"):
        llama.rope_forward(out, x, np.asfortranarray(cos), sin, 1)
    for bad in (-1, 4, True, 1.0, None):
        with pytest.raises(ValueError, match=r"n_rot_heads must be an integer in \[0, 3\]"):
            llama.rope_forward(out, x, cos, sin, bad)
        with pytest.raises(ValueError, match=r"n_rot_heads must be an integer in \[0, 3\]"):
            llama.rope_backward_naive(out, x, cos, sin, bad)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 5, 24\)"):
        llama.rope_forward(out[:1], x, cos, sin, 1)


def test_swiglu_rejects_bad_arguments():
    rng = np.random.default_rng(14)
    gu = rand(rng, 2, 3, 10)
    with pytest.raises(ValueError, match=r"gate_up must have shape \(B, T, 2I\) or \(N, 2I\) "
                                         r"\(\[gate \| up\] in each row\), got \(2, 3, 9\)"):
        llama.swiglu_forward(np.empty((2, 3, 4), F32), gu[..., :9].copy())
    with pytest.raises(ValueError, match=r"out must have shape \(2, 3, 5\)"):
        llama.swiglu_forward(np.empty((2, 3, 10), F32), gu)
    with pytest.raises(ValueError, match=r"gate_up must have shape"):
        llama.swiglu_forward(np.empty(5, F32), gu.reshape(-1))
    with pytest.raises(ValueError, match=r"dout must have shape \(2, 3, 5\)"):
        llama.swiglu_backward(np.empty_like(gu), np.empty((2, 3, 4), F32), gu)
    with pytest.raises(ValueError, match="gate_up must be C-contiguous"):
        llama.swiglu_forward(np.empty((3, 2, 5), F32), np.swapaxes(gu, 0, 1))
    with pytest.raises(TypeError, match="dgate_up must be an aligned native float32"):
        llama.swiglu_backward(np.empty(gu.shape, np.float16), np.empty((2, 3, 5), F32), gu)
