"""kernels.layers against its naive twins, PyTorch and float64 finite differences."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import layers

# (B, T, C): T=1, C=1, C not a multiple of 8 or of the 64 accumulator lanes, C with
# every kind of 16-lane tail (one vector and 8 more, 32 and 15 more), B*T not a
# multiple of any unroll or block count, and one GPT-2 width.
SHAPES = [(1, 1, 1), (1, 1, 5), (2, 3, 7), (1, 4, 24), (2, 3, 47), (3, 5, 67), (1, 37, 130),
          (2, 11, 768)]


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def close(actual, expected, rtol, scale=0.0):
    """Each element within rtol of itself or of the largest reference magnitude (or of
    `scale`, for results that cancel to about 0)."""
    expected = np.asarray(expected, dtype=np.float64)
    atol = rtol * max(np.abs(expected).max(initial=0.0), scale, 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def fd_check(forward, inputs, wrt, analytic, n_probe=12, h=1e-6, seed=0):
    """Central differences in float64 of sum(forward(inputs) * probe weights) against
    the analytic gradients; `forward` returns the output array, `analytic[name]` the
    gradient of that same scalar w.r.t. inputs[name]."""
    rng = np.random.default_rng(seed)
    for name in wrt:
        x = inputs[name]
        flat = x.reshape(-1)
        idx = rng.choice(flat.size, size=min(n_probe, flat.size), replace=False)
        for i in idx:
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
# encoder

def encoder_case(rng, B, T, C, Vp=11, maxT=None):
    maxT = maxT or T + 2
    ids = rng.integers(0, Vp, size=(B, T)).astype(np.int32)
    return ids, rand(rng, Vp, C), rand(rng, maxT, C)


@pytest.mark.parametrize("B,T,C", SHAPES)
def test_encoder_matches_naive_and_torch(B, T, C, vector_lanes):
    rng = np.random.default_rng(1)
    # Few ids for many positions: the dwte scatter sees each id many times.
    ids, wte, wpe = encoder_case(rng, B, T, C, Vp=3)
    out, out_naive = np.empty((B, T, C), np.float32), np.empty((B, T, C), np.float32)
    layers.encoder_forward(out, ids, wte, wpe)
    layers.encoder_forward_naive(out_naive, ids, wte, wpe)
    np.testing.assert_array_equal(out, out_naive)

    twte = torch.tensor(wte, requires_grad=True)
    twpe = torch.tensor(wpe, requires_grad=True)
    tout = F.embedding(torch.tensor(ids, dtype=torch.long), twte) + twpe[:T]
    close(out, tout.detach().numpy(), 1e-5)

    dout = rand(rng, B, T, C)
    tout.backward(torch.tensor(dout))
    dwte0, dwpe0 = rand(rng, *wte.shape), rand(rng, *wpe.shape)
    dwte, dwpe = dwte0.copy(), dwpe0.copy()
    layers.encoder_backward(dwte, dwpe, dout, ids)
    close(dwte - dwte0, twte.grad.numpy(), 1e-4)
    close(dwpe - dwpe0, twpe.grad.numpy(), 1e-4)
    dwte_n, dwpe_n = dwte0.copy(), dwpe0.copy()
    layers.encoder_backward_naive(dwte_n, dwpe_n, dout, ids)
    close(dwte, dwte_n, 1e-5)
    close(dwpe, dwpe_n, 1e-5)
    # Sizes this small run on one thread by default; two threads split the channels
    # and sum each element in the same order.
    dwte2, dwpe2 = dwte0.copy(), dwpe0.copy()
    layers.encoder_backward(dwte2, dwpe2, dout, ids, n_threads=2)
    np.testing.assert_array_equal(dwte2, dwte)
    np.testing.assert_array_equal(dwpe2, dwpe)


def test_encoder_backward_finite_differences():
    rng = np.random.default_rng(2)
    B, T, C = 2, 3, 4
    ids = np.array([[0, 2, 2], [2, 1, 0]], np.int32)
    inputs = {"wte": rng.standard_normal((3, C)), "wpe": rng.standard_normal((T + 1, C))}
    probe = rng.standard_normal((B, T, C))

    def forward(inp):
        out = np.empty((B, T, C))
        layers.encoder_forward_naive(out, ids, inp["wte"], inp["wpe"])
        return float((out * probe).sum())

    grads = {"wte": np.zeros((3, C)), "wpe": np.zeros((T + 1, C))}
    layers.encoder_backward_naive(grads["wte"], grads["wpe"], probe, ids)
    fd_check(forward, inputs, ["wte", "wpe"], grads, n_probe=12)


def test_encoder_ids_checked_at_the_boundary():
    rng = np.random.default_rng(3)
    ids, wte, wpe = encoder_case(rng, 2, 3, 4, Vp=5)
    out = np.empty((2, 3, 4), np.float32)
    for bad, ok in ((5, 4), (-1, 0)):
        ids[1, 2] = ok
        layers.encoder_forward(out, ids, wte, wpe)
        layers.encoder_backward(np.zeros_like(wte), np.zeros_like(wpe), out, ids)
        ids[1, 2] = bad
        with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\)"):
            layers.encoder_forward(out, ids, wte, wpe)
        with pytest.raises(ValueError, match="ids"):
            layers.encoder_backward(np.zeros_like(wte), np.zeros_like(wpe), out, ids)
        with pytest.raises(ValueError, match="ids"):
            layers.encoder_forward_naive(out, ids, wte, wpe)


def test_encoder_rejects_bad_arguments():
    rng = np.random.default_rng(4)
    ids, wte, wpe = encoder_case(rng, 2, 3, 4)
    out = np.empty((2, 3, 4), np.float32)
    with pytest.raises(TypeError, match="ids"):
        layers.encoder_forward(out, ids.astype(np.int64), wte, wpe)
    with pytest.raises(TypeError, match="wte"):
        layers.encoder_forward(out, ids, wte.astype(np.float64), wpe)
    with pytest.raises(ValueError, match="wpe"):
        layers.encoder_forward(out, ids, wte, wpe[:2])  # maxT < T
    with pytest.raises(ValueError, match="out"):
        layers.encoder_forward(np.empty((2, 3, 5), np.float32), ids, wte, wpe)
    with pytest.raises(ValueError, match="C-contiguous"):
        layers.encoder_forward(out, ids, np.asfortranarray(wte), wpe)
    with pytest.raises(TypeError, match="dout"):
        layers.encoder_backward(np.zeros_like(wte), np.zeros_like(wpe), out.tolist(), ids)


# ---------------------------------------------------------------------------
# layernorm

def layernorm_arrays(rng, B, T, C):
    x = rand(rng, B, T, C, scale=2.0) + 0.5
    return x, rand(rng, C), rand(rng, C)


@pytest.mark.parametrize("B,T,C", SHAPES)
def test_layernorm_matches_naive_and_torch(B, T, C, vector_lanes):
    rng = np.random.default_rng(5)
    x, w, b = layernorm_arrays(rng, B, T, C)
    out, mean, rstd = np.empty_like(x), np.empty((B, T), np.float32), np.empty((B, T), np.float32)
    layers.layernorm_forward(out, mean, rstd, x, w, b)
    out_n, mean_n, rstd_n = np.empty_like(x), np.empty_like(mean), np.empty_like(rstd)
    layers.layernorm_forward_naive(out_n, mean_n, rstd_n, x, w, b)
    close(out, out_n, 1e-5)
    close(mean, mean_n, 1e-5)
    close(rstd, rstd_n, 1e-5)

    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    tout = F.layer_norm(tx, (C,), tw, tb, eps=1e-5)
    close(out, tout.detach().numpy(), 1e-5)
    close(mean, x.astype(np.float64).mean(-1), 1e-5)
    close(rstd, 1 / np.sqrt(x.astype(np.float64).var(-1) + 1e-5), 1e-5)

    dout = rand(rng, B, T, C)
    tout.backward(torch.tensor(dout))
    grads0 = [rand(rng, B, T, C), rand(rng, C), rand(rng, C)]  # backward accumulates
    grads = [g.copy() for g in grads0]
    layers.layernorm_backward(*grads, dout, x, w, mean, rstd)
    # With C = 1, dinp and dweight cancel to 0 exactly (PyTorch leaves rounding noise);
    # their natural scales are |dout| * rstd and the column sums of |dout|.
    scales = (float(np.abs(dout).max() * rstd.max()),
              float(np.abs(dout).reshape(-1, C).sum(0).max()), 0.0)
    for got, g0, ref, scale in zip(grads, grads0, (tx.grad, tw.grad, tb.grad), scales):
        close(got - g0, ref.numpy(), 1e-4, scale=scale)
    grads_n = [g.copy() for g in grads0]
    layers.layernorm_backward_naive(*grads_n, dout, x, w, mean, rstd)
    for got, ref, scale in zip(grads, grads_n, scales):
        close(got, ref, 1e-5, scale=scale)


def test_layernorm_accepts_rows():
    rng = np.random.default_rng(6)
    x, w, b = layernorm_arrays(rng, 1, 9, 13)
    x2 = x.reshape(9, 13)
    out, mean, rstd = np.empty_like(x), np.empty((1, 9), np.float32), np.empty((1, 9), np.float32)
    out2, mean2, rstd2 = np.empty_like(x2), np.empty(9, np.float32), np.empty(9, np.float32)
    layers.layernorm_forward(out, mean, rstd, x, w, b)
    layers.layernorm_forward(out2, mean2, rstd2, x2, w, b)
    np.testing.assert_array_equal(out.reshape(9, 13), out2)
    np.testing.assert_array_equal(rstd.reshape(9), rstd2)


def test_layernorm_backward_finite_differences():
    rng = np.random.default_rng(7)
    B, T, C = 2, 3, 5
    inputs = {"inp": rng.standard_normal((B, T, C)), "weight": rng.standard_normal(C),
              "bias": rng.standard_normal(C)}
    probe = rng.standard_normal((B, T, C))

    def forward(inp):
        out, mean, rstd = np.empty((B, T, C)), np.empty((B, T)), np.empty((B, T))
        layers.layernorm_forward_naive(out, mean, rstd, inp["inp"], inp["weight"], inp["bias"])
        return float((out * probe).sum())

    out, mean, rstd = np.empty((B, T, C)), np.empty((B, T)), np.empty((B, T))
    layers.layernorm_forward_naive(out, mean, rstd, inputs["inp"], inputs["weight"], inputs["bias"])
    grads = {"inp": np.zeros((B, T, C)), "weight": np.zeros(C), "bias": np.zeros(C)}
    layers.layernorm_backward_naive(grads["inp"], grads["weight"], grads["bias"], probe,
                                    inputs["inp"], inputs["weight"], mean, rstd)
    fd_check(forward, inputs, ["inp", "weight", "bias"], grads, n_probe=30)


def test_layernorm_rejects_bad_arguments():
    rng = np.random.default_rng(8)
    x, w, b = layernorm_arrays(rng, 2, 3, 4)
    out, mean, rstd = np.empty_like(x), np.empty((2, 3), np.float32), np.empty((2, 3), np.float32)
    with pytest.raises(ValueError, match="weight"):
        layers.layernorm_forward(out, mean, rstd, x, w[:3], b)
    with pytest.raises(ValueError, match="mean"):
        layers.layernorm_forward(out, np.empty(6, np.float32), rstd, x, w, b)
    with pytest.raises(TypeError, match="inp"):
        layers.layernorm_forward(out, mean, rstd, x.astype(np.float16), w, b)
    with pytest.raises(ValueError, match="C-contiguous"):
        layers.layernorm_forward(out, mean, rstd, x[:, :, ::2].copy()[:, ::2], w[:2], b[:2])
    with pytest.raises(ValueError, match="inp"):
        layers.layernorm_forward(out.reshape(-1), mean, rstd, x.reshape(-1), w, b)
    x.setflags(write=False)
    layers.layernorm_forward(out, mean, rstd, x, w, b)  # read-only inputs are fine
    out.setflags(write=False)
    with pytest.raises(ValueError, match="out must be writable"):
        layers.layernorm_forward(out, mean, rstd, x, w, b)
    with pytest.raises(ValueError, match="dinp"):
        layers.layernorm_backward(np.zeros((2, 3, 5), np.float32), np.zeros(4, np.float32),
                                  np.zeros(4, np.float32), x, x, w, mean, rstd)


# ---------------------------------------------------------------------------
# GELU

# Sizes with every tail: under one vector of 8 or 16, one vector and 1 or 15 more,
# and chunks of 16384 with 18 left over.
@pytest.mark.parametrize("shape", [(1,), (7,), (9,), (15,), (17,), (31,), (3, 5, 67),
                                   (2, 3, 16387)])
def test_gelu_matches_naive_and_torch(shape, vector_lanes):
    rng = np.random.default_rng(9)
    x = rand(rng, *shape, scale=3.0)
    if x.size >= 4:
        x.reshape(-1)[:4] = [-60.0, -9.0, 9.0, 60.0]
    out, out_n = np.empty_like(x), np.empty_like(x)
    layers.gelu_forward(out, x)
    layers.gelu_forward_naive(out_n, x)
    close(out, out_n, 1e-5)
    tx = torch.tensor(x, requires_grad=True)
    tout = F.gelu(tx, approximate="tanh")
    close(out, tout.detach().numpy(), 1e-5)
    # Elementwise relative error against x * sigmoid(2u) in float64, which unlike the
    # tanh form does not cancel where tanh(u) is near -1.
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):  # exp -> inf is right: the reference is then -0
        ref64 = x64 / (1 + np.exp(-2 * np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3)))
    np.testing.assert_allclose(out, ref64, rtol=1e-5, atol=1e-30)

    dout = rand(rng, *shape)
    tout.backward(torch.tensor(dout))
    dinp0 = rand(rng, *shape)
    dinp, dinp_n = dinp0.copy(), dinp0.copy()
    layers.gelu_backward(dinp, x, dout)
    layers.gelu_backward_naive(dinp_n, x, dout)
    close(dinp - dinp0, tx.grad.numpy(), 1e-4)
    close(dinp, dinp_n, 1e-5)


def test_gelu_extremes_are_finite_and_exact_zero_far_left(vector_lanes):
    # Twice over, so that both the whole vectors and the tail see them.
    x = np.tile(np.array([-1e30, -500.0, -50.0, 0.0, 50.0, 1e30, 3e38], np.float32), 2)
    out, dinp = np.empty_like(x), np.zeros_like(x)
    layers.gelu_forward(out, x)
    layers.gelu_backward(dinp, x, np.ones_like(x))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(dinp))
    np.testing.assert_array_equal(out.reshape(2, 7)[:, :3], 0.0)
    np.testing.assert_array_equal(out.reshape(2, 7)[:, 3:], x.reshape(2, 7)[:, 3:])
    np.testing.assert_array_equal(dinp, [0, 0, 0, 0.5, 1, 1, 1] * 2)


def test_gelu_backward_finite_differences():
    rng = np.random.default_rng(10)
    inputs = {"inp": rng.standard_normal(40) * 3}
    probe = rng.standard_normal(40)

    def forward(inp):
        out = np.empty(40)
        layers.gelu_forward_naive(out, inp["inp"])
        return float((out * probe).sum())

    grads = {"inp": np.zeros(40)}
    layers.gelu_backward_naive(grads["inp"], inputs["inp"], probe)
    fd_check(forward, inputs, ["inp"], grads, n_probe=40)


# ---------------------------------------------------------------------------
# residual

@pytest.mark.parametrize("shape", [(1,), (3, 5, 67), (2, 3, 16387)])
def test_residual_matches_naive_and_torch(shape, vector_lanes):
    rng = np.random.default_rng(11)
    a, b = rand(rng, *shape), rand(rng, *shape)
    out, out_n = np.empty_like(a), np.empty_like(a)
    layers.residual_forward(out, a, b)
    layers.residual_forward_naive(out_n, a, b)
    np.testing.assert_array_equal(out, out_n)
    np.testing.assert_array_equal(out, (torch.tensor(a) + torch.tensor(b)).numpy())
    in_place = a.copy()
    layers.residual_forward(in_place, in_place, b)
    np.testing.assert_array_equal(in_place, out)

    dout = rand(rng, *shape)
    d1, d2 = rand(rng, *shape), rand(rng, *shape)
    e1, e2 = d1.copy(), d2.copy()
    layers.residual_backward(d1, d2, dout)
    layers.residual_backward_naive(e1, e2, dout)
    np.testing.assert_array_equal(d1, e1)
    np.testing.assert_array_equal(d2, e2)


def test_residual_finite_differences_and_errors():
    rng = np.random.default_rng(12)
    inputs = {"a": rng.standard_normal(6), "b": rng.standard_normal(6)}
    probe = rng.standard_normal(6)

    def forward(inp):
        out = np.empty(6)
        layers.residual_forward_naive(out, inp["a"], inp["b"])
        return float((out * probe).sum())

    grads = {"a": np.zeros(6), "b": np.zeros(6)}
    layers.residual_backward_naive(grads["a"], grads["b"], probe)
    fd_check(forward, inputs, ["a", "b"], grads, n_probe=6)
    a = np.zeros(6, np.float32)
    with pytest.raises(ValueError, match="inp2"):
        layers.residual_forward(a, a, np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="dinp1 overlaps dinp2"):
        layers.residual_backward(a, a, a.copy())
    with pytest.raises(ValueError, match="n_threads"):
        layers.residual_forward(a, a, a, n_threads=0)


# ---------------------------------------------------------------------------
# vector width and threads

def test_vector_lanes_setting():
    import kernels
    for bad in (4, 32, True, "16"):
        with pytest.raises(ValueError, match="lanes must be 8 or 16"):
            kernels.set_vector_lanes(bad)
    if kernels.vector_lanes() == 8:
        with pytest.raises(ValueError, match="AVX-512"):
            kernels.set_vector_lanes(16)
        return
    assert kernels.set_vector_lanes(8) == 16
    try:
        assert kernels.vector_lanes() == layers.vector_lanes() == 8
    finally:
        assert kernels.set_vector_lanes(16) == 8
    assert kernels.vector_lanes() == 16


def test_one_and_two_threads_give_identical_results(vector_lanes):
    rng = np.random.default_rng(13)
    B, T, C = 3, 37, 200
    x, w, b = layernorm_arrays(rng, B, T, C)
    ids, wte, wpe = encoder_case(rng, B, T, C, Vp=5)
    dout = rand(rng, B, T, C)
    results = []
    for n_threads in (1, 2):
        out, mean, rstd = np.empty_like(x), np.empty((B, T), np.float32), np.empty((B, T), np.float32)
        layers.layernorm_forward(out, mean, rstd, x, w, b, n_threads=n_threads)
        grads = [np.zeros_like(x), np.zeros(C, np.float32), np.zeros(C, np.float32)]
        layers.layernorm_backward(*grads, dout, x, w, mean, rstd, n_threads=n_threads)
        dwte, dwpe = np.zeros_like(wte), np.zeros_like(wpe)
        layers.encoder_backward(dwte, dwpe, dout, ids, n_threads=n_threads)
        g, dg = np.empty_like(x), np.zeros_like(x)
        layers.gelu_forward(g, x, n_threads=n_threads)
        layers.gelu_backward(dg, x, dout, n_threads=n_threads)
        results.append([out, mean, rstd, *grads, dwte, dwpe, g, dg])
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)


def test_vector_exp_within_two_ulp_and_exact_zero_below_cutoff(vector_lanes):
    # The exp inlined into GELU, softmax and cross-entropy, at each vector width:
    # within 2 ulp of exp over its whole range, exactly 0 below -87.3 (no denormals
    # downstream), and a length that is no multiple of the width.
    x = np.concatenate([np.linspace(-87.29, 88.3, 400_001, dtype=np.float32),
                        np.float32([-87.3, -87.2999, -1e-30, 0.0, 1e-30, -0.5 * np.log(2)]),
                        np.linspace(-200.0, -87.31, 1001, dtype=np.float32)])
    y = layers._vector_exp(x)
    assert y.dtype == np.float32 and y.shape == x.shape
    keep = x >= np.float32(-87.3)
    assert not y[~keep].any()
    ref = np.exp(x[keep].astype(np.float64))
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert (np.abs(y[keep] - ref) / ulp).max() <= 2.0
    assert layers._vector_exp(np.zeros(0, np.float32)).shape == (0,)
    # NaN stays NaN (a NaN logit gives a NaN loss), -inf gives 0
    special = layers._vector_exp(np.float32([np.nan, -np.inf, 0.0] * 7))
    assert np.isnan(special[0::3]).all() and not special[1::3].any()
    assert (special[2::3] == 1.0).all()


def test_fast_vector_exp2_within_its_bound(vector_lanes):
    # exp2_fast, for sums of exponentials and 1 + 2^t (cross-entropy, GELU): within
    # 4e-7 relative of 2^t up to 127, exact at integers, 2^-125 (not 0, and never
    # negative) below -125, NaN for NaN, at each vector width.
    t = np.concatenate([np.linspace(-125.0, 127.0, 400_001, dtype=np.float32),
                        np.float32([-1e-30, 0.0, 1e-30, -0.5, 0.5, -0.4999999, 0.4999999])])
    y = layers._vector_exp(t, fast=True)
    ref = np.exp2(t.astype(np.float64))
    rel = np.abs(y - ref) / ref
    assert rel.max() <= 4e-7, (t[rel.argmax()], rel.max())
    # exact references only: NumPy's float32 exp2 is one ulp high at 127 on its
    # AVX-512 path, so the powers of two come from ldexp
    n = np.arange(-125, 128, dtype=np.float32)
    np.testing.assert_array_equal(layers._vector_exp(n, fast=True),
                                  np.ldexp(np.float32(1.0), n.astype(np.int32)))
    low = layers._vector_exp(np.linspace(-300.0, -125.0, 1001, dtype=np.float32), fast=True)
    assert (low == np.float32(2.0 ** -125)).all()
    special = layers._vector_exp(np.float32([np.nan, -np.inf, 1.0] * 7), fast=True)
    assert np.isnan(special[0::3]).all() and (special[1::3] == np.float32(2.0 ** -125)).all()
    assert (special[2::3] == 2.0).all()


# ---------------------------------------------------------------------------
# non-temporal stores for large outputs

def test_streamed_outputs_equal_plain_ones(vector_lanes):
    """With stream_min_bytes 0 every aligned fresh output (encoder, layernorm, GELU
    and residual forward) is written with non-temporal stores: the same bits as the
    plain stores, on aligned arrays, on misaligned ones (which keep plain stores), with
    rows that are no multiple of 16 floats and with GELU's last chunk ending in a
    partial vector."""
    from adtape import buffers
    rng = np.random.default_rng(21)

    def run(B, T, C, offset):
        def arr(*shape):
            # `offset` floats into a 64-byte aligned block: aligned when 0
            flat = buffers.empty((int(np.prod(shape)) + offset,))[offset:]
            return flat.reshape(shape)
        x, w, b = layernorm_arrays(rng, B, T, C)
        ids, wte, wpe = encoder_case(rng, B, T, C, Vp=7)
        outs = []
        for min_bytes in (1 << 62, 0):
            old = layers.set_stream_min_bytes(min_bytes)
            try:
                enc, ln, res, gel = arr(B, T, C), arr(B, T, C), arr(B, T, C), arr(B, T, C)
                mean, rstd = np.empty((B, T), np.float32), np.empty((B, T), np.float32)
                layers.encoder_forward(enc, ids, wte, wpe)
                layers.layernorm_forward(ln, mean, rstd, x, w, b)
                layers.residual_forward(res, x, enc)
                layers.gelu_forward(gel, x)
                outs.append([enc.copy(), ln.copy(), mean, rstd, res.copy(), gel.copy()])
            finally:
                assert layers.set_stream_min_bytes(old) == min_bytes
        for plain, streamed in zip(*outs):
            np.testing.assert_array_equal(plain, streamed)
        enc_n = np.empty((B, T, C), np.float32)
        layers.encoder_forward_naive(enc_n, ids, wte, wpe)
        np.testing.assert_array_equal(outs[1][0], enc_n)

    for B, T, C, offset in ((2, 37, 768, 0), (3, 5, 64, 0), (2, 9, 48, 3), (1, 11, 40, 0),
                            (4, 300, 16, 0), (3, 331, 17, 0)):
        run(B, T, C, offset)


def test_stream_min_bytes_setting():
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="stream_min_bytes"):
            layers.set_stream_min_bytes(bad)
    old = layers.set_stream_min_bytes(123)
    try:
        assert layers.stream_min_bytes() == 123
    finally:
        assert layers.set_stream_min_bytes(old) == 123


# ---------------------------------------------------------------------------
# the eight-lane builds: explicit x86-64-v3 and target clones

def test_eight_lane_builds_agree():
    """On a CPU with AVX2 the eight-lane layers and loss kernels run an explicit
    x86-64-v3 build (real vminps/vmaxps, a clamped exp where exact zeros do not
    matter); the portable target clones must give the same bits, extremes, NaNs and
    odd sizes included.  Elsewhere only the clones exist and this compares them with
    themselves."""
    from kernels import loss
    rng = np.random.default_rng(31)
    x = rand(rng, 3, 37, 771, scale=4.0).reshape(-1)
    x[:13] = [0.0, -0.0, 1e-30, -1e-30, 10.0, -10.0, 30.0, -30.0, 1e30, -1e30, np.inf, -np.inf,
              np.nan]
    d = rand(rng, x.size)
    B, T, C = 3, 37, 130
    xl, w, b = layernorm_arrays(rng, B, T, C)
    dl = rand(rng, B, T, C)
    ids, wte, wpe = encoder_case(rng, B, T, C, Vp=9)
    V, Vp = 1003, 1024
    logits = rand(rng, 2, 7, Vp, scale=8.0)
    logits[0, 0, :V] = -1e30
    logits[0, 0, 5] = 3.0
    logits[1, 2, 17] = np.nan
    targets = rng.integers(0, V, (2, 7)).astype(np.int32)
    dlosses = rand(rng, 2, 7)

    def run():
        out = {}
        out["gelu"] = np.empty_like(x)
        layers.gelu_forward(out["gelu"], x)
        out["dgelu"] = np.zeros_like(x)
        layers.gelu_backward(out["dgelu"], x, d)
        out["ln"], out["mean"], out["rstd"] = (np.empty_like(xl), np.empty((B, T), np.float32),
                                               np.empty((B, T), np.float32))
        layers.layernorm_forward(out["ln"], out["mean"], out["rstd"], xl, w, b)
        out["dx"], out["dw"], out["db"] = np.zeros_like(xl), np.zeros(C, np.float32), np.zeros(C, np.float32)
        layers.layernorm_backward(out["dx"], out["dw"], out["db"], dl, xl, w, out["mean"], out["rstd"])
        out["enc"] = np.empty((B, T, C), np.float32)
        layers.encoder_forward(out["enc"], ids, wte, wpe)
        out["res"] = np.empty_like(xl)
        layers.residual_forward(out["res"], xl, dl)
        out["losses"], out["lse"] = np.empty((2, 7), np.float32), np.empty((2, 7), np.float32)
        loss.softmax_crossentropy_forward(out["losses"], out["lse"], logits, targets, V)
        out["dlogits"] = np.zeros_like(logits)
        loss.softmax_crossentropy_backward(out["dlogits"], dlosses, logits, out["lse"], targets, V)
        out["exp"] = layers._vector_exp(x)
        return out

    old_lanes = layers.set_vector_lanes(8)
    try:
        assert layers.set_eight_lane_clones(False) is False
        built = run()
        assert layers.set_eight_lane_clones(True) is False
        clones = run()
    finally:
        layers.set_eight_lane_clones(False)
        layers.set_vector_lanes(old_lanes)
    assert np.isnan(built["losses"][1, 2]) and np.isfinite(built["losses"][0, 0])
    for name in built:
        np.testing.assert_array_equal(built[name], clones[name], err_msg=name)
    with pytest.raises(ValueError, match="bool"):
        layers.set_eight_lane_clones(1)
