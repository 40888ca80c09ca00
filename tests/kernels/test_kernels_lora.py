"""kernels.lora (LoRA's adapter products on a packed output, and its dropout) against
the unfused NumPy formulas in float64; kernels.matmul's backward without its input."""
import numpy as np
import pytest

from kernels import gemm, lora
from kernels.matmul import matmul_backward, matmul_backward_naive

# (rows N, packed width OC, splits (start, n), rank r): q|k|v-like with every column
# adapted, some columns only (out of order, gaps), one full-width target, awkward sizes;
# row counts across the skinny, packed and BLAS routes of kernels.gemm.
CASES = [(512, 960, ((0, 576), (576, 192), (768, 192)), 8),
         (37, 41, ((30, 11), (3, 9)), 3),
         (64, 3072, ((0, 1536), (1536, 1536)), 16),
         (300, 257, ((0, 257),), 5),
         (1, 7, ((2, 1),), 1),
         (8, 100, ((10, 40), (60, 40)), 4)]


def rel_err(actual, expected):
    scale = max(float(np.abs(expected).max()), 1e-30)
    return float(np.abs(np.asarray(actual, np.float64) - expected).max()) / scale


def operands(rng, N, OC, splits, r):
    k = len(splits)
    rows = sum(n for _, n in splits)
    xa = rng.standard_normal((N, k * r)).astype(np.float32)
    b = rng.standard_normal((rows, r)).astype(np.float32)
    out = rng.standard_normal((N, OC)).astype(np.float32)
    return xa, b, out


def forward_ref(out, xa, b, splits, r):
    want = out.astype(np.float64)
    rows = 0
    for j, (start, n) in enumerate(splits):
        want[:, start:start + n] += (xa[:, j * r:(j + 1) * r].astype(np.float64)
                                     @ b[rows:rows + n].astype(np.float64).T)
        rows += n
    return want


@pytest.mark.parametrize("N,OC,splits,r", CASES)
@pytest.mark.parametrize("packed", [0, 1, 2])
def test_forward_adds_into_the_strided_columns(N, OC, splits, r, packed):
    rng = np.random.default_rng(N + OC)
    xa, b, out = operands(rng, N, OC, splits, r)
    want = forward_ref(out, xa, b, splits, r)
    old = gemm.set_packed_gemm(packed)
    try:
        got = out.copy()
        lora.lora_forward(got, xa, b, list(splits))
    finally:
        gemm.set_packed_gemm(old)
    assert rel_err(got, want) < 1e-5
    adapted = np.zeros(OC, bool)
    for start, n in splits:
        adapted[start:start + n] = True
    assert np.array_equal(got[:, ~adapted], out[:, ~adapted])      # the rest untouched


@pytest.mark.parametrize("N,OC,splits,r", CASES)
@pytest.mark.parametrize("packed", [0, 1, 2])
def test_backward_reads_the_strided_columns(N, OC, splits, r, packed):
    rng = np.random.default_rng(N * OC)
    xa, b, dout = operands(rng, N, OC, splits, r)
    k = len(splits)
    want_dxa = np.zeros((N, k * r))
    want_db = np.zeros(b.shape)
    rows = 0
    for j, (start, n) in enumerate(splits):
        gj = dout[:, start:start + n].astype(np.float64)
        want_dxa[:, j * r:(j + 1) * r] = gj @ b[rows:rows + n].astype(np.float64)
        want_db[rows:rows + n] = gj.T @ xa[:, j * r:(j + 1) * r].astype(np.float64)
        rows += n
    old = gemm.set_packed_gemm(packed)
    try:
        dxa = np.full((N, k * r), np.nan, np.float32)
        db = np.full(b.shape, np.nan, np.float32)
        lora.lora_backward(dxa, db, dout, xa, b, list(splits), overwrite=True)
        assert rel_err(dxa, want_dxa) < 1e-5 and rel_err(db, want_db) < 1e-5
        db2 = np.full(b.shape, 1.5, np.float32)
        dxa2 = np.full((N, k * r), np.nan, np.float32)
        lora.lora_backward(dxa2, db2, dout, xa, b, list(splits))
        assert rel_err(db2, want_db + 1.5) < 1e-5 and np.array_equal(dxa2, dxa)
        dxa3 = np.full((N, k * r), np.nan, np.float32)
        lora.lora_backward(dxa3, None, dout, xa, b, list(splits))
        assert np.array_equal(dxa3, dxa)
    finally:
        gemm.set_packed_gemm(old)


@pytest.mark.parametrize("N,OC,splits,r", CASES)
def test_the_same_bits_on_any_thread_count(N, OC, splits, r):
    rng = np.random.default_rng(3)
    xa, b, dout = operands(rng, N, OC, splits, r)
    results = []
    for nt in (1, 2, 3):
        out = dout.copy()
        lora.lora_forward(out, xa, b, list(splits), n_threads=nt)
        dxa = np.empty(xa.shape, np.float32)
        db = np.empty(b.shape, np.float32)
        lora.lora_backward(dxa, db, dout, xa, b, list(splits), overwrite=True, n_threads=nt)
        results.append((out, dxa, db))
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert np.array_equal(x, y)


def test_the_products_are_those_of_contiguous_copies():
    # The strided products against the contiguous ones the unfused path ran (whole
    # gemm calls, routed by their full size): float32 sums, in another order at most.
    rng = np.random.default_rng(3)
    N, OC, splits, r = 512, 960, ((0, 576), (576, 192), (768, 192)), 8
    xa, b, dout = operands(rng, N, OC, splits, r)
    dxa = np.empty((N, 3 * r), np.float32)
    db = np.empty(b.shape, np.float32)
    lora.lora_backward(dxa, db, dout, xa, b, list(splits), overwrite=True)
    rows = 0
    for j, (start, n) in enumerate(splits):
        gj = np.ascontiguousarray(dout[:, start:start + n])
        dxaj = np.empty((N, r), np.float32)
        dbj = np.empty((n, r), np.float32)
        matmul_backward(dxaj, dbj, None, gj, np.ascontiguousarray(xa[:, j * r:(j + 1) * r]),
                        b[rows:rows + n], overwrite=True)
        # Each float32 sum of K products lies within gamma_K * sum |terms| of the exact
        # one (Higham 3.1), in any order: two of them within twice that of each other.
        g64, xa64, b64 = (np.abs(a.astype(np.float64)) for a in (
            gj, xa[:, j * r:(j + 1) * r], b[rows:rows + n]))
        for got, ref, magnitude, K in ((dxa[:, j * r:(j + 1) * r], dxaj, g64 @ b64, n),
                                       (db[rows:rows + n], dbj, g64.T @ xa64, N)):
            gamma = K * 2.0 ** -24 / (1 - K * 2.0 ** -24)
            assert (np.abs(got.astype(np.float64) - ref) <= 2 * gamma * magnitude).all()
            assert rel_err(got, ref.astype(np.float64)) < 1e-5
        rows += n


def test_three_dimensional_rows_and_bad_arguments():
    rng = np.random.default_rng(4)
    xa, b, out = operands(rng, 12, 30, ((0, 10), (20, 10)), 2)
    want = forward_ref(out, xa, b, ((0, 10), (20, 10)), 2)
    got = out.reshape(3, 4, 30).copy()
    lora.lora_forward(got, xa.reshape(3, 4, 4), b, [(0, 10), (20, 10)])
    assert rel_err(got.reshape(12, 30), want) < 1e-5
    with pytest.raises(ValueError, match="splits"):
        lora.lora_forward(out.copy(), xa, b, [(0, 10), (25, 10)])       # past the width
    with pytest.raises(ValueError, match="splits"):
        lora.lora_forward(out.copy(), xa, b, [(0, 10), (20, 9)])        # b's rows
    with pytest.raises(ValueError, match="xa"):
        lora.lora_forward(out.copy(), xa[:, :3].copy(), b, [(0, 10), (20, 10)])
    with pytest.raises(ValueError, match="overlaps"):
        lora.lora_backward(xa, None, out, xa, b, [(0, 10), (20, 10)])


def _splitmix_uniforms(key, n):
    """SplitMix64's outputs for counters 0..n-1 from ``key``, top 24 bits over 2^24."""
    z = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(key) + z * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)


def test_uniforms_are_splitmix64_on_any_thread_count():
    # SplitMix64 from state 0 first gives 0xE220A8397B1DCDAF (Vigna's splitmix64.c).
    u = np.empty(1, np.float32)
    lora.uniforms(u, 0)
    assert u[0] == np.float32(0xE220A8 / 2 ** 24)
    for key in (0, 12345, (1 << 64) - 1):
        want = _splitmix_uniforms(key, 97 * 1031)
        for nt in (1, 2, 3):
            u = np.full((97, 1031), 7.0, np.float32)
            lora.uniforms(u, key, n_threads=nt)
            assert np.array_equal(u.ravel(), want)
    # Uniform enough for dropout: a million draws keep 1 - p of the elements within 10
    # standard deviations, and the halves of [0, 1) hold half each.
    u = np.empty(1_000_000, np.float32)
    lora.uniforms(u, 42)
    assert 0.0 <= u.min() and u.max() < 1.0
    for p in (0.05, 0.1, 0.5):
        assert abs(np.mean(u >= p) - (1 - p)) < 10 * np.sqrt(p * (1 - p) / u.size)
    with pytest.raises(ValueError, match="key"):
        lora.uniforms(u, 1 << 64)
    with pytest.raises(ValueError, match="key"):
        lora.uniforms(u, -1)


@pytest.mark.parametrize("shape", [(7, 5), (3, 300, 129), (1,)])
def test_dropout_is_the_float32_masks(shape):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape).astype(np.float32)
    x.flat[0] = -0.0
    for p in (0.1, 0.5, 0.05):
        u = np.random.default_rng(6).random(shape, dtype=np.float32)
        mask = (u >= p).astype(np.float32)
        mask *= np.float32(1.0 / (1.0 - p))
        xl = np.empty(shape, np.float32)
        keep = np.empty(shape, np.uint8)
        lora.dropout_forward(xl, keep, x, u, p)
        assert np.array_equal(keep, u >= p)
        assert np.array_equal((x * mask).view(np.uint32), xl.view(np.uint32))
        again = np.empty(shape, np.float32)
        lora.dropout_apply(again, x, keep, p)
        assert np.array_equal(again.view(np.uint32), xl.view(np.uint32))
        dxl = rng.standard_normal(shape).astype(np.float32)
        dx = rng.standard_normal(shape).astype(np.float32)
        want = dx + dxl * mask
        lora.dropout_backward(dx, dxl, keep, p)
        assert np.array_equal(dx, want)
        lora.dropout_backward(dx, dxl, keep, p, overwrite=True)
        assert np.array_equal(dx, dxl * mask)


# -- kernels.matmul's backward without its input (a frozen weight) ---------------------

@pytest.mark.parametrize("lead,C,OC", [((4, 16), 64, 192), ((37,), 29, 41), ((1,), 1, 1),
                                       ((300,), 100, 257)])
def test_a_frozen_weights_backward_needs_no_input(lead, C, OC):
    rng = np.random.default_rng(C)
    inp = rng.standard_normal(lead + (C,)).astype(np.float32)
    weight = rng.standard_normal((OC, C)).astype(np.float32)
    dout = rng.standard_normal(lead + (OC,)).astype(np.float32)
    for overwrite in (False, True):
        want = [np.full(inp.shape, 0.5, np.float32), np.full(OC, 0.5, np.float32)]
        matmul_backward(want[0], None, want[1], dout, inp, weight, overwrite=overwrite)
        got = [np.full(inp.shape, 0.5, np.float32), np.full(OC, 0.5, np.float32)]
        matmul_backward(got[0], None, got[1], dout, None, weight, overwrite=overwrite)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    # The naive twin in float64, against NumPy's formula.
    d64, w64 = dout.astype(np.float64), weight.astype(np.float64)
    dinp = np.full(inp.shape, 0.25)
    dbias = np.full(OC, 0.25)
    matmul_backward_naive(dinp, None, dbias, d64, None, w64)
    assert rel_err(dinp, 0.25 + d64 @ w64) < 1e-12
    assert rel_err(dbias, 0.25 + d64.reshape(-1, OC).sum(0)) < 1e-12
    matmul_backward_naive(dinp, None, None, d64, None, w64, overwrite=True)
    assert rel_err(dinp, d64 @ w64) < 1e-12
    # The weight's gradient needs the input.
    for kernel, d, w in ((matmul_backward, dout, weight), (matmul_backward_naive, d64, w64)):
        with pytest.raises(ValueError, match="dweight"):
            kernel(None, np.zeros(w.shape, w.dtype), None, d, None, w)
