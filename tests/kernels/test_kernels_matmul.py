"""kernels.matmul against its naive twin, PyTorch, and float64 finite differences."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from kernels import threads
from kernels.matmul import (matmul_backward, matmul_backward_naive, matmul_forward,
                            matmul_forward_naive)

# (lead shape, C, OC): GPT-2-like, awkward (primes, 1s), 3-D inputs.
SHAPES = [((4, 16), 64, 192), ((37,), 29, 41), ((1,), 1, 1), ((1, 1), 7, 3),
          ((3, 5), 13, 1), ((2, 7), 1, 9), ((131,), 100, 257)]


def rel_err(actual, expected):
    """Largest absolute error relative to the largest magnitude in ``expected``."""
    scale = max(float(np.abs(expected).max()), 1e-30)
    return float(np.abs(np.asarray(actual, np.float64) - expected).max()) / scale


def make(rng, lead, C, OC, dtype=np.float32):
    inp = rng.standard_normal(lead + (C,)).astype(dtype)
    weight = rng.standard_normal((OC, C)).astype(dtype)
    bias = rng.standard_normal(OC).astype(dtype)
    dout = rng.standard_normal(lead + (OC,)).astype(dtype)
    return inp, weight, bias, dout


def grads_of(backward, inp, weight, dout, fill, with_dinp=True, with_dbias=True, **kw):
    dinp = np.full(inp.shape, fill, inp.dtype) if with_dinp else None
    dweight = np.full(weight.shape, fill, inp.dtype)
    dbias = np.full(weight.shape[0], fill, inp.dtype) if with_dbias else None
    backward(dinp, dweight, dbias, dout, inp, weight, **kw)
    return dinp, dweight, dbias


@pytest.mark.parametrize("lead,C,OC", SHAPES)
@pytest.mark.parametrize("use_bias", [True, False])
def test_forward_matches_naive_and_torch(lead, C, OC, use_bias):
    rng = np.random.default_rng(1)
    inp, weight, bias, _ = make(rng, lead, C, OC)
    bias = bias if use_bias else None
    out = np.full(lead + (OC,), np.nan, np.float32)
    matmul_forward(out, inp, weight, bias)
    out_naive = np.full_like(out, np.nan)
    matmul_forward_naive(out_naive, inp, weight, bias)
    expected = torch.nn.functional.linear(
        torch.from_numpy(inp), torch.from_numpy(weight),
        None if bias is None else torch.from_numpy(bias)).numpy()
    assert rel_err(out, out_naive) < 1e-5
    assert rel_err(out, expected) < 1e-5


@pytest.mark.parametrize("lead,C,OC", SHAPES)
def test_backward_matches_naive_and_torch(lead, C, OC):
    rng = np.random.default_rng(2)
    inp, weight, bias, dout = make(rng, lead, C, OC)
    got = grads_of(matmul_backward, inp, weight, dout, 0.0)
    naive = grads_of(matmul_backward_naive, inp, weight, dout, 0.0)
    x = torch.from_numpy(inp).requires_grad_()
    w = torch.from_numpy(weight).requires_grad_()
    b = torch.from_numpy(bias).requires_grad_()
    torch.nn.functional.linear(x, w, b).backward(torch.from_numpy(dout))
    for name, g, n, t in zip(("dinp", "dweight", "dbias"), got, naive, (x.grad, w.grad, b.grad)):
        assert rel_err(g, n) < 1e-5, name
        assert rel_err(g, t.numpy()) < 1e-4, name


def test_backward_formula_by_finite_differences_float64():
    # The naive twin in float64 is checked against central differences of
    # L = sum(out * dout); the optimized kernel is checked against the twin above.
    rng = np.random.default_rng(3)
    lead, C, OC = (2, 3), 5, 4
    inp, weight, bias, dout = make(rng, lead, C, OC, np.float64)
    dinp, dweight, dbias = grads_of(matmul_backward_naive, inp, weight, dout, 0.0)

    def loss():
        out = np.empty(lead + (OC,))
        matmul_forward_naive(out, inp, weight, bias)
        return float((out * dout).sum())

    eps = 1e-6
    for param, grad in ((inp, dinp), (weight, dweight), (bias, dbias)):
        numeric = np.empty_like(param)
        for idx in np.ndindex(param.shape):
            keep = param[idx]
            param[idx] = keep + eps
            up = loss()
            param[idx] = keep - eps
            down = loss()
            param[idx] = keep
            numeric[idx] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-7, atol=1e-8)


def test_backward_accumulates_and_skips_optional_outputs():
    rng = np.random.default_rng(4)
    inp, weight, bias, dout = make(rng, (3, 11), 19, 23)
    fresh = grads_of(matmul_backward, inp, weight, dout, 0.0)
    prefilled = grads_of(matmul_backward, inp, weight, dout, 1.5)
    for f, p in zip(fresh, prefilled):
        assert rel_err(p - 1.5, f) < 1e-6
    dinp_none, dweight_only, dbias_none = grads_of(matmul_backward, inp, weight, dout, 0.0,
                                                   with_dinp=False, with_dbias=False)
    assert dinp_none is None and dbias_none is None
    np.testing.assert_array_equal(dweight_only, fresh[1])


def test_one_and_two_threads_agree():
    rng = np.random.default_rng(5)
    inp, weight, bias, dout = make(rng, (4, 33), 96, 300)
    results = []
    previous = threads.get_num_threads()
    try:
        for n in (1, 2):
            threads.set_num_threads(n)
            out = np.empty((4, 33, 300), np.float32)
            matmul_forward(out, inp, weight, bias, n_threads=n)
            results.append((out,) + grads_of(matmul_backward, inp, weight, dout, 0.0, n_threads=n))
    finally:
        threads.set_num_threads(previous)
    for a, b in zip(*results):
        assert rel_err(a, b) < 1e-6


# dbias is summed two ways: by the weight gradient's packed GEMM as it packs dout
# (float64, in order of rows), or, where that product does not run, by a pass of its
# own (dbias_cols: four rows in float32 at a time, then float64).  Shapes: the
# weight gradient split by rows (1100 channels, 8 inputs) and by columns (40, 300),
# both large enough for two threads; 407 rows (not a multiple of the four summed at
# a time); 1100 channels (each thread's share crosses a pass of 512 channels, and
# the shares end mid-line).
@pytest.mark.parametrize("OC, C", [(1100, 8), (40, 300)])
@pytest.mark.parametrize("packed", [0, 2], ids=["own pass", "in the packing"])
def test_dbias_is_a_float64_sum_the_same_on_any_thread_count(OC, C, packed):
    from kernels import gemm
    rng = np.random.default_rng(11)
    inp, weight, bias, dout = make(rng, (407,), C, OC)
    dout *= np.float32(1e3) ** rng.integers(-1, 2, dout.shape).astype(np.float32)
    want = dout.astype(np.float64).sum(0)
    got = []
    previous = gemm.set_packed_gemm(packed)
    try:
        for n in (1, 2):
            dbias = np.full(OC, np.nan, np.float32)
            matmul_backward(None, np.zeros_like(weight), dbias, dout, inp, weight,
                            overwrite=True, n_threads=n)
            got.append(dbias)
            more = np.ones(OC, np.float32)             # and added into, not overwritten
            matmul_backward(None, np.zeros_like(weight), more, dout, inp, weight, n_threads=n)
            np.testing.assert_array_equal(more, dbias + np.float32(1))
    finally:
        gemm.set_packed_gemm(previous)
    np.testing.assert_array_equal(got[0], got[1])
    if packed:      # a float64 sum, rounded once
        np.testing.assert_array_equal(got[0], want.astype(np.float32))
    else:
        np.testing.assert_allclose(got[0], want, rtol=1e-6,
                                   atol=1e-6 * np.abs(dout).sum(0).max())


def test_explicit_thread_count_still_keeps_blas_single_threaded():
    # A first call with an explicit n_threads resolves the policy too: BLAS runs one
    # thread inside each of ours, whatever the entry point (fresh interpreter).
    code = (
        "import numpy as np\n"
        "from threadpoolctl import threadpool_info\n"
        "from kernels import gemm, matmul\n"
        "a = np.ones((300, 64), np.float32); w = np.ones((200, 64), np.float32)\n"
        "out = np.empty((300, 200), np.float32)\n"
        "{call}\n"
        "blas = [d for d in threadpool_info() if d['user_api'] == 'blas']\n"
        "assert blas and all(d['num_threads'] == 1 for d in blas), blas\n")
    import kernels
    root = str(pathlib.Path(kernels.__file__).resolve().parent.parent)
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=root)
    for call in ("matmul.matmul_forward(out, a, w, None, n_threads=2)",
                 "gemm.gemm_rowmajor(out, a, w, trans_b=True, n_threads=2)"):
        run = subprocess.run([sys.executable, "-c", code.format(call=call)],
                             capture_output=True, text=True, env=env, cwd=os.path.dirname(root))
        assert run.returncode == 0, run.stderr


def test_gpt2_shape_against_torch():
    rng = np.random.default_rng(6)
    inp, weight, bias, dout = make(rng, (4, 64), 768, 2304)
    out = np.empty((4, 64, 2304), np.float32)
    matmul_forward(out, inp, weight, bias)
    x = torch.from_numpy(inp).requires_grad_()
    w = torch.from_numpy(weight).requires_grad_()
    b = torch.from_numpy(bias).requires_grad_()
    y = torch.nn.functional.linear(x, w, b)
    y.backward(torch.from_numpy(dout))
    assert rel_err(out, y.detach().numpy()) < 1e-5
    got = grads_of(matmul_backward, inp, weight, dout, 0.0)
    for g, t in zip(got, (x.grad, w.grad, b.grad)):
        assert rel_err(g, t.numpy()) < 1e-4


def test_bad_inputs_raise_clear_errors():
    rng = np.random.default_rng(7)
    inp, weight, bias, dout = make(rng, (5,), 6, 4)
    out = np.empty((5, 4), np.float32)
    with pytest.raises(ValueError, match="weight"):
        matmul_forward(out, inp, np.zeros((4, 7), np.float32), bias)
    with pytest.raises(ValueError, match="out"):
        matmul_forward(np.empty((5, 5), np.float32), inp, weight, bias)
    with pytest.raises(ValueError, match="bias"):
        matmul_forward(out, inp, weight, np.zeros(5, np.float32))
    with pytest.raises(TypeError, match="inp.*float32"):
        matmul_forward(out, inp.astype(np.float64), weight, bias)
    with pytest.raises(ValueError, match="weight.*C-contiguous"):
        matmul_forward(out, inp, np.asfortranarray(weight), bias)
    with pytest.raises(ValueError, match="inp"):
        matmul_forward(out, inp.ravel(), weight, bias)
    with pytest.raises(TypeError, match="bias"):
        matmul_forward(out, inp, weight, [0.0] * 4)
    readonly = np.empty((5, 4), np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="out.*writable"):
        matmul_forward(readonly, inp, weight, bias)
    with pytest.raises(ValueError, match="dout"):
        matmul_backward(None, np.zeros_like(weight), None, dout[:, :3].copy(), inp, weight)
    with pytest.raises(ValueError, match="dweight"):
        matmul_backward(None, np.zeros((4, 5), np.float32), None, dout, inp, weight)
    with pytest.raises(ValueError, match="dinp.*C-contiguous"):
        matmul_backward(np.zeros((6, 5), np.float32).T, np.zeros_like(weight), None, dout,
                        inp, weight)
    with pytest.raises(ValueError, match="n_threads"):
        matmul_forward(out, inp, weight, bias, n_threads=0)
    with pytest.raises(TypeError, match="inp"):
        matmul_forward_naive(out, inp.astype(np.int32), weight, bias)


# ---------------------------------------------------------------- skinny products
# kernels.gemm routes products with few rows to its own kernels (the skinny ones, and
# on AVX-512 the packed GEMM); check them against BLAS (the same call with the routing
# off) on awkward sizes.

def _skinny_lanes():
    from kernels import gemm
    return [8, 16] if gemm.skinny_lanes() == 16 else [8]


@pytest.mark.parametrize("lanes", _skinny_lanes())
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 24, 25, 31, 32, 33, 40, 48, 64])
@pytest.mark.parametrize("layout", ["nt", "nn", "tn"])
def test_skinny_gemm_matches_blas(M, layout, lanes):
    # nt, nn: M rows of C; tn: depth M (C = A^T B with A (M, rows)), the weight
    # gradient at M tokens.  Each in eight lanes and, where the CPU has AVX-512, 16.
    from kernels import gemm
    trans_a, trans_b = layout == "tn", layout == "nt"
    rng = np.random.default_rng(M)
    old_lanes = gemm.set_skinny_lanes(lanes)
    try:
        for N, other in ((1, 1), (3, 8), (25, 7), (47, 9), (100, 131), (769, 300)):
            rows, K = (other, M) if trans_a else (M, other)
            a = rng.standard_normal((K, rows) if trans_a else (rows, K)).astype(np.float32)
            b = rng.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32)
            c0 = rng.standard_normal((rows, N)).astype(np.float32)
            bias = rng.standard_normal(N).astype(np.float32)
            for alpha, beta, with_bias in ((1.0, 0.0, True), (1.0, 1.0, False), (0.5, 1.0, True)):
                for n_threads in (1, 2):
                    call = dict(trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta,
                                n_threads=n_threads)
                    got = gemm.gemm_rowmajor(c0.copy(), a, b, bias if with_bias else None, **call)
                    previous = gemm.set_skinny_max_m(0)
                    previous_packed = gemm.set_packed_gemm(0)     # BLAS only
                    try:
                        want = gemm.gemm_rowmajor(c0.copy(), a, b, bias if with_bias else None,
                                                  **call)
                    finally:
                        gemm.set_skinny_max_m(previous)
                        gemm.set_packed_gemm(previous_packed)
                    assert rel_err(got, want) < 1e-5, (N, K, alpha, beta, n_threads)
    finally:
        gemm.set_skinny_lanes(old_lanes)


@pytest.mark.parametrize("lanes", _skinny_lanes())
@pytest.mark.parametrize("M", [1, 3, 4, 7, 16, 33, 64])
def test_depth_split_gemm_matches_float64(M, lanes):
    # Few rows, no transposed operand, deep enough: the threads split the depth
    # (skinny_nn_depth) and add up their shares.  Columns across the full tiles, the
    # one-vector tail and the scalar tail; depths across the 64-row blocks.
    from kernels import gemm
    rng = np.random.default_rng(M + lanes)
    old_lanes = gemm.set_skinny_lanes(lanes)
    old_depth = gemm.set_depth_split_max_m(64)      # eight lanes default to none
    try:
        for N, K in ((1, 256), (17, 300), (131, 257), (200, 700), (777, 1000)):
            a = rng.standard_normal((M, K)).astype(np.float32)
            b = rng.standard_normal((K, N)).astype(np.float32)
            c0 = rng.standard_normal((M, N)).astype(np.float32)
            bias = rng.standard_normal(N).astype(np.float32)
            for alpha, beta, with_bias in ((1.0, 0.0, False), (1.0, 1.0, True), (-0.5, 2.0, True)):
                for n_threads in (2, 3):
                    got = gemm.gemm_rowmajor(c0.copy(), a, b, bias if with_bias else None,
                                             alpha=alpha, beta=beta, n_threads=n_threads)
                    want = alpha * (a.astype(np.float64) @ b) + beta * c0
                    if with_bias:
                        want = want + bias
                    assert rel_err(got, want) < 1e-5, (N, K, alpha, beta, n_threads)
    finally:
        gemm.set_skinny_lanes(old_lanes)
        gemm.set_depth_split_max_m(old_depth)


def test_skinny_lanes_setting():
    from kernels import gemm
    with pytest.raises(ValueError, match="lanes"):
        gemm.set_skinny_lanes(4)
    if gemm.skinny_lanes() == 8:
        with pytest.raises(ValueError, match="AVX-512"):
            gemm.set_skinny_lanes(16)


@pytest.mark.parametrize("lanes", _skinny_lanes())
def test_skinny_gpt2_shapes_against_torch(lanes):
    # B*T = 16 rows through every GPT-2 124M product: forward and both gradients.
    from kernels import gemm
    old_lanes = gemm.set_skinny_lanes(lanes)
    try:
        _check_gpt2_shapes_against_torch()
    finally:
        gemm.set_skinny_lanes(old_lanes)


def _check_gpt2_shapes_against_torch():
    rng = np.random.default_rng(8)
    for C, OC in ((768, 2304), (768, 768), (768, 3072), (3072, 768)):
        inp, weight, bias, dout = make(rng, (1, 16), C, OC)
        out = np.empty((1, 16, OC), np.float32)
        matmul_forward(out, inp, weight, bias)
        x = torch.from_numpy(inp).requires_grad_()
        y = torch.nn.functional.linear(x, torch.from_numpy(weight), torch.from_numpy(bias))
        y.backward(torch.from_numpy(dout))
        assert rel_err(out, y.detach().numpy()) < 1e-5
        dinp, dweight, _ = grads_of(matmul_backward, inp, weight, dout, 0.0)
        assert rel_err(dinp, x.grad.numpy()) < 1e-5
        dw_torch = torch.from_numpy(dout).reshape(-1, OC).T @ torch.from_numpy(inp).reshape(-1, C)
        assert rel_err(dweight, dw_torch.numpy()) < 1e-5


# ---------------------------------------------------------------- packed GEMM
# kernels.gemm computes some products with its own packed GEMM (kernels/sgemm.h)
# instead of BLAS; set_packed_gemm(2) routes every product there.  Checked against
# float64 in eight lanes (6 x 16 tiles) and, where the CPU has AVX-512, sixteen
# (8 x 32), with and without the bias that its micro-kernel adds, on sizes that
# cross each blocking edge: rows past a multiple of the tile and of the 96-row
# block, columns past the panel and the 512-column block of each thread (1024 for a
# block of more than 512 rows), depths past the 256-deep block and past the 8 x 8
# and 16 x 16 transposes.  In eight lanes the forward (nt) of up to 128 rows takes
# the W-broadcast kernel: 16-row tiles of x, 6 rows of W (N not a multiple of 6, the
# 8-wide row store next to a block's last column), depth blocks of 512 at 120 rows.

@pytest.mark.parametrize("lanes", _skinny_lanes())
@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("M,N,K", [(65, 33, 1), (97, 31, 385), (130, 1, 200), (200, 2100, 70),
                                   (77, 300, 800), (13, 1043, 523), (1100, 1500, 300), (120, 50, 1100)])
def test_packed_gemm_matches_float64(layout, M, N, K, lanes):
    from kernels import gemm
    trans_a, trans_b = layout[0] == "t", layout[1] == "t"
    rng = np.random.default_rng(M * N + K)
    a = rng.standard_normal((K, M) if trans_a else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if trans_b else (K, N)).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    a64 = (a.T if trans_a else a).astype(np.float64)
    b64 = (b.T if trans_b else b).astype(np.float64)
    old_mode, old_m = gemm.set_packed_gemm(2), gemm.set_skinny_max_m(0)
    old_lanes = gemm.set_skinny_lanes(lanes)
    try:
        for alpha, beta, with_bias in ((1.0, 0.0, True), (1.0, 1.0, False), (0.5, -2.0, True),
                                       (1.0, 0.0, False)):
            for n_threads in (1, 2):
                c = c0.copy()
                if beta == 0.0:
                    c[...] = np.nan            # beta 0: C's old contents are never read
                gemm.gemm_rowmajor(c, a, b, bias if with_bias else None, trans_a=trans_a,
                                   trans_b=trans_b, alpha=alpha, beta=beta, n_threads=n_threads)
                want = alpha * (a64 @ b64) + beta * c0 + (bias if with_bias else 0.0)
                # float32 rounding grows with the sum of the terms' magnitudes
                size = abs(alpha) * (np.abs(a64) @ np.abs(b64)) + abs(beta * c0) + 1.0
                assert (np.abs(c - want) / size).max() < 1e-6, (alpha, beta, n_threads)
    finally:
        gemm.set_packed_gemm(old_mode)
        gemm.set_skinny_max_m(old_m)
        gemm.set_skinny_lanes(old_lanes)


def test_packed_gemm_setting():
    from kernels import gemm
    with pytest.raises(ValueError, match="mode"):
        gemm.set_packed_gemm(3)
    old = gemm.set_packed_gemm(0)
    assert gemm.set_packed_gemm(old) == 0
    with pytest.raises(ValueError, match="0 or more"):
        gemm.set_broadcast_max_m(-1)
    old = gemm.set_broadcast_max_m(0)
    assert old == 128 and gemm.set_broadcast_max_m(old) == 0
    for bad in (-1, 2.0, "64"):
        with pytest.raises(ValueError, match="None or an int"):
            gemm.set_direct_b_max_m(bad)
    assert gemm.set_direct_b_max_m(64) is None
    assert gemm.set_direct_b_max_m(None) == 64


@pytest.mark.parametrize("lanes", _skinny_lanes())
@pytest.mark.parametrize("layout", ["nn", "tn"])
@pytest.mark.parametrize("M,N,K", [(64, 768, 300), (13, 1043, 523), (130, 100, 257),
                                   (8, 32, 1), (70, 1030, 600)])
def test_packed_gemm_reads_b_in_place_with_the_same_bits(layout, M, N, K, lanes):
    # Where op(B)'s rows run along the columns, few-row products read B's whole
    # panels where they lie (kernels/sgemm.h's direct panels), the panel past the last
    # whole one (N not a multiple of 16 or 32) packed, rows past the tile through the
    # edge buffer, depths past the 256-deep block: the same sums in the same order as
    # with B packed, on 1 and 2 threads, alpha and beta, in both widths.
    from kernels import gemm
    trans_a = layout == "tn"
    rng = np.random.default_rng(M + 7 * N + K)
    a = rng.standard_normal((K, M) if trans_a else (M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    old_mode, old_m = gemm.set_packed_gemm(2), gemm.set_skinny_max_m(0)
    old_lanes, old_direct = gemm.set_skinny_lanes(lanes), gemm.set_direct_b_max_m(None)
    got = {}
    try:
        for direct in (1 << 20, 0):
            gemm.set_direct_b_max_m(direct)
            for n in (1, 2):
                c = np.full((M, N), np.nan, np.float32)
                got[direct, n, 0] = gemm.gemm_rowmajor(c, a, b, bias, trans_a=trans_a,
                                                       n_threads=n)
                got[direct, n, 1] = gemm.gemm_rowmajor(c0.copy(), a, b, trans_a=trans_a,
                                                       alpha=0.5, beta=-2.0, n_threads=n)
    finally:
        gemm.set_direct_b_max_m(old_direct)
        gemm.set_packed_gemm(old_mode)
        gemm.set_skinny_max_m(old_m)
        gemm.set_skinny_lanes(old_lanes)
    for (direct, n, which), c in got.items():
        np.testing.assert_array_equal(c, got[0, 1, which], err_msg=str((direct, n, which)))
    a64 = (a.T if trans_a else a).astype(np.float64)
    size = np.abs(a64) @ np.abs(b.astype(np.float64)) + np.abs(bias) + 1.0
    assert (np.abs(got[0, 1, 0] - (a64 @ b + bias)) / size).max() < 1e-6


def test_products_route_by_vendor():
    # Which products the packed GEMM takes (kernels/gemm.pyx's _use_packed), GPT-2's
    # qkv shapes: in eight lanes the same on every CPU (the forward to 256 rows); in
    # sixteen, AMD's routes take the weight gradient past 64 tokens (the skinny
    # kernel's), the forward to 512 rows and the input gradient to 1024, the others'
    # leave them to BLAS past 64 tokens, 128 rows and 512.
    from kernels import gemm

    def routes():
        fwd = [gemm.packed_route(False, True, m, 2304, 768) for m in (40, 41, 512, 513)]
        dx = [gemm.packed_route(False, False, m, 768, 2304) for m in (15, 16, 512, 1024, 1025)]
        dw = [gemm.packed_route(True, False, 2304, 768, t) for t in (15, 16, 64, 65, 8192)]
        return fwd, dx, dw

    old_lanes, old_amd = gemm.skinny_lanes(), gemm.set_amd_routes(True)
    try:
        assert gemm.set_amd_routes(None) is True
        seen = {}
        for lanes in _skinny_lanes():
            gemm.set_skinny_lanes(lanes)
            for amd in (True, False):
                gemm.set_amd_routes(amd)
                seen[lanes, amd] = routes()
        with pytest.raises(ValueError, match="True, False or None"):
            gemm.set_amd_routes(1)
    finally:
        gemm.set_skinny_lanes(old_lanes)
        gemm.set_amd_routes(old_amd)
    eight = ([False, True, False, False], [False, True, True, False, False],
             [False, True, True, True, True])
    assert seen[8, True] == seen[8, False] == eight
    if 16 in _skinny_lanes():
        assert seen[16, True] == ([False, True, True, False], [False, True, True, True, False],
                                  [False, False, False, True, True])
        assert seen[16, False] == ([False, True, False, False],
                                   [False, True, True, False, False],
                                   [False, False, False, False, False])


@pytest.mark.parametrize("amd", [True, False], ids=["amd routes", "other routes"])
@pytest.mark.parametrize("lead, C, OC", [((1100,), 300, 70), ((600,), 96, 500),
                                         ((2, 300), 64, 40)])
def test_linear_products_on_either_vendors_routes(lead, C, OC, amd):
    # A linear layer's three products where the vendors' routes differ (100-1100
    # rows), against float64 and the same bits on 1 and 2 threads.
    from kernels import gemm
    rng = np.random.default_rng(C + OC)
    inp, weight, bias, dout = make(rng, lead, C, OC)
    old = gemm.set_amd_routes(amd)
    try:
        got = {}
        for n in (1, 2):
            out = np.full(lead + (OC,), np.nan, np.float32)
            matmul_forward(out, inp, weight, bias, n_threads=n)
            got[n] = (out,) + grads_of(matmul_backward, inp, weight, dout, np.nan,
                                       overwrite=True, n_threads=n)
    finally:
        gemm.set_amd_routes(old)
    for a, b in zip(got[1], got[2]):
        np.testing.assert_array_equal(a, b)
    x, w, g = (v.astype(np.float64).reshape(-1, v.shape[-1]) for v in (inp, weight, dout))
    wants = (x @ w.T + bias, g @ w, g.T @ x, g.sum(0))
    sizes = (np.abs(x) @ np.abs(w.T) + np.abs(bias), np.abs(g) @ np.abs(w),
             np.abs(g.T) @ np.abs(x), np.abs(g).sum(0))
    for value, want, size in zip(got[1], wants, sizes):
        assert (np.abs(value.reshape(want.shape) - want) / size).max() < 1e-6


@pytest.mark.parametrize("lanes", _skinny_lanes())
@pytest.mark.parametrize("M,N,K", [(16, 200, 300), (41, 200, 300), (64, 200, 300), (128, 200, 300),
                                   (33, 203, 1100), (100, 107, 530), (5, 9, 300)])
def test_broadcast_forward_equals_the_packed_gemm_within_rounding_and_across_threads(M, N, K, lanes):
    # The forward of up to 128 rows reads W where it lies (sg_bcast: 16 rows of x by 6
    # of W in eight lanes, 32 by 8 in sixteen; N past a multiple of the tile, depth
    # blocks of 512 in sixteen lanes, rows past the 16-row half); the packed GEMM (its
    # routing turned off) is the twin.  Same bits on 1 and 2 threads, beta 0 and 1.
    from kernels import gemm
    rng = np.random.default_rng(M + N + K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    old_mode, old_m = gemm.set_packed_gemm(2), gemm.set_skinny_max_m(0)
    old_lanes = gemm.set_skinny_lanes(lanes)
    got, added = {}, {}
    try:
        for bc in (128, 0):
            gemm.set_broadcast_max_m(bc)
            for n in (1, 2):
                c = np.full((M, N), np.nan, np.float32)
                got[bc, n] = gemm.gemm_rowmajor(c, x, w, bias, trans_b=True, n_threads=n)
                added[bc, n] = gemm.gemm_rowmajor(c0.copy(), x, w, trans_b=True, beta=1.0, n_threads=n)
    finally:
        gemm.set_broadcast_max_m(128)
        gemm.set_packed_gemm(old_mode)
        gemm.set_skinny_max_m(old_m)
        gemm.set_skinny_lanes(old_lanes)
    np.testing.assert_array_equal(got[128, 1], got[128, 2])
    np.testing.assert_array_equal(added[128, 1], added[128, 2])
    size = np.abs(x.astype(np.float64)) @ np.abs(w.T.astype(np.float64))
    for key in got:
        assert (np.abs(got[key] - want) / (size + np.abs(bias))).max() < 1e-6
        assert (np.abs(added[key] - (want - bias + c0)) / (size + np.abs(c0))).max() < 1e-6
    assert not np.array_equal(got[128, 1], got[0, 1])    # two kernels, two roundings


@pytest.mark.parametrize("lanes", _skinny_lanes())
def test_broadcast_forward_past_its_rows_still_multiplies(lanes):
    # set_broadcast_max_m lets any number of rows through (as many columns: a forward
    # with fewer columns than rows is split by rows, never packed): the x panels' depth
    # block shrinks to keep them within 256 KiB (104 deep at 600 rows, 32 at 2000, and
    # no less than 8: 8200 rows).
    from kernels import gemm
    rng = np.random.default_rng(5)
    old_mode, old_lanes = gemm.set_packed_gemm(2), gemm.set_skinny_lanes(lanes)
    old_m = gemm.set_broadcast_max_m(1 << 20)
    try:
        for M, K in ((600, 300), (2000, 300), (8200, 20)):
            x = rng.standard_normal((M, K)).astype(np.float32)
            w = rng.standard_normal((M, K)).astype(np.float32)
            c = gemm.gemm_rowmajor(np.empty((M, M), np.float32), x, w, trans_b=True)
            np.testing.assert_allclose(c, x.astype(np.float64) @ w.T.astype(np.float64),
                                       rtol=1e-4, atol=1e-4)
    finally:
        gemm.set_broadcast_max_m(old_m)
        gemm.set_packed_gemm(old_mode)
        gemm.set_skinny_lanes(old_lanes)


def test_packed_gemm_buffers_are_freed_with_their_threads():
    # Each thread packs into a 0.6 MiB buffer of its own, freed when the thread exits:
    # 120 short-lived threads must not leave 70 MiB behind.
    import threading

    import psutil

    from kernels import gemm
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 300)).astype(np.float32)
    b = rng.standard_normal((300, 1000)).astype(np.float32)    # fills the buffer's B part
    want = a.astype(np.float64) @ b

    def work(out):
        c = np.empty((64, 1000), np.float32)
        gemm.gemm_rowmajor(c, a, b, n_threads=1)
        out.append(np.abs(c - want).max())

    old_mode = gemm.set_packed_gemm(2)
    try:
        errors = []
        for _ in range(2):                  # warm up the allocator
            t = threading.Thread(target=work, args=(errors,))
            t.start()
            t.join()
        rss = psutil.Process().memory_info().rss
        for _ in range(120):
            t = threading.Thread(target=work, args=(errors,))
            t.start()
            t.join()
        grown = psutil.Process().memory_info().rss - rss
    finally:
        gemm.set_packed_gemm(old_mode)
    assert len(errors) == 122 and max(errors) < 1e-3
    assert grown < 40 << 20, f"RSS grew by {grown >> 20} MiB"


def test_a_frozen_weight_has_no_weight_gradient():
    # dweight None (LoRA's frozen base): the same dinp and dbias, no weight product
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 9, 40)).astype(np.float32)
    w = rng.standard_normal((70, 40)).astype(np.float32)
    dout = rng.standard_normal((2, 9, 70)).astype(np.float32)
    want = [np.zeros_like(x), np.zeros_like(w), np.zeros(70, np.float32)]
    matmul_backward(*want, dout, x, w, overwrite=True)
    dinp, dbias = np.full_like(x, np.nan), np.full(70, np.nan, np.float32)
    matmul_backward(dinp, None, dbias, dout, x, w, overwrite=True)
    assert np.array_equal(dinp, want[0])
    # The bias gradient is then summed on its own (not as dout is packed): float rounding.
    np.testing.assert_allclose(dbias, dout.reshape(-1, 70).astype(np.float64).sum(0), rtol=1e-5,
                               atol=1e-5)
