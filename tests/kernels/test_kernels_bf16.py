"""kernels.bf16: the conversions bit for bit against NumPy, and every product shape of a
linear layer against float64 on the bf16-rounded operands, on every path this CPU runs
("emulated", "twin" and "amx_twin" everywhere, "native" where it has AVX512_BF16,
"amx" where it has AMX-BF16).

The error bound of a product.  The operands are bf16 (8 significant bits), so each
product a b is exact in float32 (16 bits; no product here underflows); an element of
C is then a float32 sum of n = K + 1 terms (the K products and the bias or the
gradient added into), in some order.  Any order of summing n terms in floating point is within
gamma_(n-1) = (n-1) u / (1 - (n-1) u) of the sum of their magnitudes (Higham, Accuracy
and Stability of Numerical Algorithms, 4.2; u = 2^-24, float32's unit roundoff), so

    |C - C_exact| <= gamma_K (sum_k |a_ik b_kj| + |c0_ij|)

with c0 the bias or the old gradient.  The float64 reference adds about K 2^-53 of the
same sum, covered by rounding gamma_K up by a part in a million.  dbias is a float64
sum of the float32 dout rounded once to float32 and added once: within 3 u
(sum |dout| + |old|).  The native path reads subnormal bf16 as zero; the operands here
are normal numbers, so the bound holds on every path.  A CPU with AVX512_BF16 runs
every test on the native path as well, and checks it against the twin bit for bit; one
with AMX-BF16 runs them on the AMX path too (its tiles sum a pair's two products in
another order than VDPBF16PS: the bound, not the twin's bits, is its check).
"""
import contextlib
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kernels import bf16, threads

U = 2.0 ** -24


# --------------------------------------------------------------------------- reference

def ref_to_bf16(x):
    """float32 -> bf16 bits: round to nearest even; NaN -> quiet NaN, sign and top
    payload bits kept."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet = (u >> 16) | 0x40
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, quiet, rounded).astype(np.uint16)


def ref_from_bf16(b):
    return (np.asarray(b, np.uint16).astype(np.uint32) << 16).view(np.float32)


def bits(values):
    return np.array(values, np.uint32).view(np.float32)


def to_bf16(x):
    out = np.empty(x.shape, np.uint16)
    bf16.to_bf16(out, np.ascontiguousarray(x, np.float32))
    return out


def gamma(n):
    return n * U / (1 - n * U) * (1 + 1e-6)


def paths():
    return (["emulated", "twin", "amx_twin"] + (["native"] if bf16.cpu_has_avx512_bf16() else [])
            + (["amx"] if bf16.cpu_has_amx_bf16() else []))


@pytest.fixture(params=paths())
def path(request):
    old = bf16.set_bf16_path(request.param)
    yield request.param
    bf16.set_bf16_path(old)


# --------------------------------------------------------------------------- conversions

EDGES = {
    0x00000000: 0x0000,   # +0
    0x80000000: 0x8000,   # -0
    0x00000001: 0x0000,   # the least subnormal rounds to 0
    0x00008000: 0x0000,   # a tie between 0 and the least bf16 subnormal: to even (0)
    0x00018000: 0x0002,   # a tie between 0x0001 and 0x0002: to even (up)
    0x00008001: 0x0001,   # just past the tie: up
    0x007FFFFF: 0x0080,   # the largest subnormal rounds up to the least normal
    0x807FFFFF: 0x8080,
    0x00800000: 0x0080,   # the least normal
    0x3F800000: 0x3F80,   # 1
    0x3F808000: 0x3F80,   # 1 + 2^-8: a tie, to even (down)
    0x3F818000: 0x3F82,   # a tie, to even (up)
    0x3F807FFF: 0x3F80,   # just below a tie
    0x3F808001: 0x3F81,   # just past a tie
    0xBF818000: 0xBF82,   # negative ties round the same way
    0x7F7F7FFF: 0x7F7F,   # below the tie under the largest bf16: stays finite
    0x7F7F8000: 0x7F80,   # the tie above the largest bf16 (odd): to even, which is inf
    0x7F7FFFFF: 0x7F80,   # the largest float32 rounds up to inf
    0xFF7FFFFF: 0xFF80,
    0x7F800000: 0x7F80,   # inf
    0xFF800000: 0xFF80,   # -inf
    0x7FC00000: 0x7FC0,   # the default NaN
    0xFFC00000: 0xFFC0,
    0x7F800001: 0x7FC0,   # a signalling NaN whose payload lies in the bits rounded off
    0xFF800001: 0xFFC0,
    0x7FFFFFFF: 0x7FFF,   # all payload bits: no carry into the sign
    0x7FA00000: 0x7FE0,   # payload kept, quiet bit set
}


def test_conversion_edge_cases():
    x = bits(list(EDGES))
    want = np.array(list(EDGES.values()), np.uint16)
    for fn in (bf16.to_bf16, bf16.to_bf16_naive):
        got = np.empty(x.shape, np.uint16)
        fn(got, x)
        np.testing.assert_array_equal(got, want, err_msg=fn.__name__)
    np.testing.assert_array_equal(ref_to_bf16(x), want)
    got = to_bf16(x)
    assert np.isnan(ref_from_bf16(got[np.isnan(x)])).all()


@pytest.mark.parametrize("n", [1, 7, 33, 257, 100_003])
def test_to_bf16_matches_numpy_on_every_kind_of_float(n):
    # random bit patterns: every exponent, subnormals, infinities and NaNs, in the
    # parallel path too (100_003: two threads, an odd tail)
    rng = np.random.default_rng(n)
    x = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    want = ref_to_bf16(x)
    for nt in (1, 2):
        got = np.empty(n, np.uint16)
        bf16.to_bf16(got, x, n_threads=nt)
        np.testing.assert_array_equal(got, want)
    got = np.empty(n, np.uint16)
    bf16.to_bf16_naive(got, x)
    np.testing.assert_array_equal(got, want)


def test_to_bf16_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[~np.isnan(x)]         # PyTorch writes every NaN as 0x7FC0
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(to_bf16(x), want)


def test_from_bf16_is_exact_on_every_bf16():
    b = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    want = ref_from_bf16(b)
    for nt in (1, 2):
        got = np.empty(b.shape, np.float32)
        bf16.from_bf16(got, b, n_threads=nt)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    got = np.empty(b.shape, np.float32)
    bf16.from_bf16_naive(got, b)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # every bf16 but a NaN comes back from float32 as itself
    finite_or_inf = ~np.isnan(want)
    np.testing.assert_array_equal(to_bf16(want)[finite_or_inf], b[finite_or_inf])


def test_conversions_keep_shapes():
    x = np.random.default_rng(2).standard_normal((3, 5, 7)).astype(np.float32)
    b = to_bf16(x)
    assert b.shape == x.shape
    back = np.empty_like(x)
    bf16.from_bf16(back, b)
    assert (np.abs(back - x) <= np.abs(x) * 2.0 ** -8).all()


# --------------------------------------------------------------------------- products

def operands(rng, lead, C, OC):
    """bf16 inp and weight, float32 bias and dout, and the float64 values of each."""
    x = rng.standard_normal(lead + (C,)).astype(np.float32)
    w = (rng.standard_normal((OC, C)) / np.sqrt(max(C, 1))).astype(np.float32)
    bias = rng.standard_normal(OC).astype(np.float32)
    dout = rng.standard_normal(lead + (OC,)).astype(np.float32)
    xb, wb = to_bf16(x), to_bf16(w)
    return xb, wb, bias, dout


def f64(b):
    return ref_from_bf16(b).astype(np.float64)


def check_within(got, exact, magnitude, terms, what):
    bound = gamma(terms) * magnitude
    err = np.abs(got.astype(np.float64) - exact)
    assert np.isfinite(got).all(), what
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (f"{what}: error {err[worst]:.3g} past the bound "
                                  f"{bound[worst]:.3g} at {worst}")


def forward_check(xb, wb, bias, n_threads=None):
    N = int(np.prod(xb.shape[:-1]))
    C, OC = wb.shape[1], wb.shape[0]
    out = np.full(xb.shape[:-1] + (OC,), np.nan, np.float32)
    bf16.matmul_forward_bf16(out, xb, wb, bias, n_threads=n_threads)
    x, w = f64(xb).reshape(N, C), f64(wb)
    b = np.zeros(OC) if bias is None else bias.astype(np.float64)
    exact = x @ w.T + b
    magnitude = np.abs(x) @ np.abs(w).T + np.abs(b)
    check_within(out.reshape(N, OC), exact, magnitude, C, "out")
    return out


def backward_check(xb, wb, dout, prefill, with_dinp=True, with_dbias=True, overwrite=False,
                   n_threads=None):
    """Runs the backward into gradients holding `prefill` (NaN under overwrite) and
    checks them; returns them."""
    N = int(np.prod(xb.shape[:-1]))
    C, OC = wb.shape[1], wb.shape[0]
    rng = np.random.default_rng(99)
    fill = (lambda shape: np.full(shape, np.nan, np.float32)) if overwrite else (
        lambda shape: (prefill * rng.standard_normal(shape)).astype(np.float32))
    dinp = fill(xb.shape) if with_dinp else None
    dweight = fill(wb.shape)
    dbias = fill(OC) if with_dbias else None
    old = [None if g is None else np.zeros(g.shape) if overwrite else g.astype(np.float64)
           for g in (dinp, dweight, dbias)]
    bf16.matmul_backward_bf16(dinp, dweight, dbias, dout, xb, wb, overwrite=overwrite,
                              n_threads=n_threads)
    x, w = f64(xb).reshape(N, C), f64(wb)
    d = f64(to_bf16(dout)).reshape(N, OC)      # the products take dout in bf16
    if with_dinp:
        check_within(dinp.reshape(N, C), old[0].reshape(N, C) + d @ w,
                     np.abs(old[0].reshape(N, C)) + np.abs(d) @ np.abs(w), OC, "dinp")
    check_within(dweight, old[1] + d.T @ x, np.abs(old[1]) + np.abs(d).T @ np.abs(x), N,
                 "dweight")
    if with_dbias:
        # dbias from the float32 dout, not its bf16 rounding
        d32 = dout.reshape(N, OC).astype(np.float64)
        exact = old[2] + d32.sum(0)
        bound = 3 * U * (np.abs(old[2]) + np.abs(d32).sum(0)) + 1e-300
        assert (np.abs(dbias - exact) <= bound).all(), "dbias"
    return dinp, dweight, dbias


SIZES = [1, 7, 33, 64, 257]


@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("C", [1, 7, 33, 257, 521])
def test_forward_within_the_float32_bound(path, N, C):
    rng = np.random.default_rng(N * 1000 + C)
    for OC in (1, 33, 64, 257):
        xb, wb, bias, _ = operands(rng, (N,), C, OC)
        forward_check(xb, wb, bias)
        forward_check(xb, wb, None)


@pytest.mark.parametrize("N", SIZES + [521])
@pytest.mark.parametrize("C", [1, 7, 33, 257])
def test_backward_within_the_float32_bound(path, N, C):
    rng = np.random.default_rng(N * 1000 + C + 7)
    for OC in (1, 33, 64, 521):
        xb, wb, _, dout = operands(rng, (N,), C, OC)
        backward_check(xb, wb, dout, prefill=0.0, overwrite=True)
        backward_check(xb, wb, dout, prefill=1.0)


def test_products_past_one_block_of_each_loop(path):
    # 1100 rows and 600 columns: several blocks (the emulated path) and tasks (the
    # packed paths) of each, past 512; 521 depths past a 512-depth block; 3-D input
    rng = np.random.default_rng(3)
    xb, wb, bias, dout = operands(rng, (4, 275), 521, 600)
    forward_check(xb, wb, bias)
    backward_check(xb, wb, dout, prefill=1.0)


def test_backward_accumulates_overwrites_and_skips(path):
    rng = np.random.default_rng(4)
    xb, wb, _, dout = operands(rng, (3, 11), 19, 23)
    # NaN-filled gradients under overwrite: their old contents are never read
    backward_check(xb, wb, dout, prefill=0.0, overwrite=True)
    backward_check(xb, wb, dout, prefill=3.0, overwrite=False)
    _, dw_only, _ = backward_check(xb, wb, dout, prefill=0.0, overwrite=True, with_dinp=False,
                                   with_dbias=False)
    _, dw_all, _ = backward_check(xb, wb, dout, prefill=0.0, overwrite=True)
    np.testing.assert_array_equal(dw_only, dw_all)
    # one flag per gradient
    dinp = np.ones(xb.shape, np.float32)
    dweight = np.full(wb.shape, np.nan, np.float32)
    dbias = np.ones(wb.shape[0], np.float32)
    bf16.matmul_backward_bf16(dinp, dweight, dbias, dout, xb, wb, overwrite=(False, True, False))
    fresh = [np.zeros(xb.shape, np.float32), np.zeros(wb.shape, np.float32),
             np.zeros(wb.shape[0], np.float32)]
    bf16.matmul_backward_bf16(*fresh, dout, xb, wb, overwrite=True)
    np.testing.assert_array_equal(dweight, fresh[1])
    assert np.abs(dinp - 1 - fresh[0]).max() <= 4 * U * (1 + np.abs(fresh[0]).max())
    assert np.abs(dbias - 1 - fresh[2]).max() <= 4 * U * (1 + np.abs(fresh[2]).max())


def test_empty_sizes(path):
    # no rows: nothing written, gradients unchanged; no depth: out = bias, dweight += 0
    wb = to_bf16(np.ones((3, 4), np.float32))
    out = np.empty((0, 3), np.float32)
    bf16.matmul_forward_bf16(out, np.empty((0, 4), np.uint16), wb, None)
    dweight = np.ones((3, 4), np.float32)
    bf16.matmul_backward_bf16(None, dweight, None, np.empty((0, 3), np.float32),
                              np.empty((0, 4), np.uint16), wb)
    np.testing.assert_array_equal(dweight, 1)
    bias = np.arange(3, dtype=np.float32)
    out = np.full((2, 3), np.nan, np.float32)
    bf16.matmul_forward_bf16(out, np.empty((2, 0), np.uint16), np.empty((3, 0), np.uint16), bias)
    np.testing.assert_array_equal(out, np.broadcast_to(bias, (2, 3)))


@pytest.mark.parametrize("N, C, OC", [(300, 200, 520), (520, 200, 96), (40, 700, 300),
                                      (2000, 64, 64), (40, 2049, 70), (1100, 96, 40),
                                      (70, 96, 600)])
def test_results_do_not_depend_on_the_thread_count(path, N, C, OC):
    rng = np.random.default_rng(N + C + OC)
    xb, wb, bias, dout = operands(rng, (N,), C, OC)
    results = []
    previous = threads.get_num_threads()
    try:
        for nt in (1, 2, 3):
            threads.set_num_threads(nt)
            out = forward_check(xb, wb, bias, n_threads=nt)
            grads = backward_check(xb, wb, dout, prefill=1.0, n_threads=nt)
            results.append((out,) + grads)
    finally:
        threads.set_num_threads(previous)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def packed_paths():
    return (["twin", "amx_twin"] + (["native"] if bf16.cpu_has_avx512_bf16() else [])
            + (["amx"] if bf16.cpu_has_amx_bf16() else []))


@pytest.mark.parametrize("packed", packed_paths())
@pytest.mark.parametrize("N, C, OC", [(97, 64, 100), (64, 96, 70), (70, 45, 96), (33, 600, 64)])
def test_products_in_chunks_give_the_same_bits(packed, N, C, OC):
    # The packed paths lay each product's operands out once for all threads, in chunks
    # of rows and columns where they would pass a cap: with the cap at a few tiles the
    # chunks (several of rows and of columns, a row tail read in place or packed, an
    # odd depth), cut into other tasks, give the unchunked bits, within the bound.
    rng = np.random.default_rng(N * C + OC)
    xb, wb, bias, dout = operands(rng, (N,), C, OC)
    old = bf16.set_bf16_path(packed)
    try:
        whole = (forward_check(xb, wb, bias),) + backward_check(xb, wb, dout, prefill=1.0)
        cap = bf16._set_chunk_pairs(2048)
        bf16._set_task_tiles(64, 32)
        try:
            chunked = ((forward_check(xb, wb, bias),)
                       + backward_check(xb, wb, dout, prefill=1.0))
        finally:
            bf16._set_chunk_pairs(cap)
            bf16._set_task_tiles()
    finally:
        bf16.set_bf16_path(old)
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="positive"):
        bf16._set_chunk_pairs(0)
    with pytest.raises(ValueError, match="multiples of 32"):
        bf16._set_task_tiles(48, 0)


@contextlib.contextmanager
def kernel_modes(plain=None, layout=None, weight=None, sub=None):
    """The packing's plain loops (``plain``), the forward's layout (``layout``), the
    weight of dout @ W read in place or laid out (``weight``) and its rows 4 KiB apart
    read in place by sub-blocks (``sub``) set for the block, restored after."""
    setters = [(bf16._set_plain_transposes, plain), (bf16._set_forward_layout, layout),
               (bf16._set_direct_weight, weight), (bf16._set_sub_blocks, sub)]
    previous = [(setter, setter(value)) for setter, value in setters if value is not None]
    try:
        yield
    finally:
        for setter, value in previous:
            setter(value)


def assert_same_bits_in_modes(packed, shapes, seed, modes, products):
    """``products(xb, wb, bias, dout)`` on path ``packed`` under each of ``modes``
    (kernel_modes' arguments) gives the same bits, for every (N, C, OC) of ``shapes``."""
    rng = np.random.default_rng(seed)
    old = bf16.set_bf16_path(packed)
    try:
        for N, C, OC in shapes:
            args = operands(rng, (N,), C, OC)
            runs = []
            for mode in modes:
                with kernel_modes(**mode):
                    runs.append(products(*args))
            for run in runs[1:]:
                for a, b in zip(runs[0], run):
                    np.testing.assert_array_equal(a, b)
    finally:
        bf16.set_bf16_path(old)


@pytest.mark.parametrize("packed", packed_paths())
def test_layouts_by_plain_loops_give_the_same_bits(packed):
    # The packing transposes 16 x 16 blocks of pairs in AVX-512 registers where the CPU
    # has it, with plain loops elsewhere (and for the twins on CPUs without it): the
    # same layout.  Deep narrow B (its pack cut by depth, an odd depth), whole and
    # partial blocks of 16 columns and of 32 rows of dout^T.
    assert_same_bits_in_modes(
        packed, [(40, 2049, 70), (97, 1024, 48), (64, 768, 96), (1100, 96, 40), (33, 32, 33)],
        11, [{"plain": False}, {"plain": True}],
        lambda xb, wb, bias, dout: ((forward_check(xb, wb, bias),)
                                    + backward_check(xb, wb, dout, prefill=1.0)))


@pytest.mark.parametrize("packed", packed_paths())
def test_forward_layouts_give_the_same_bits(packed):
    # The VDPBF16PS paths run a forward of few rows as out^T = W x^T (x laid out, W's
    # rows read in place, the tiles stored transposed with a per-row bias): the same
    # sums, the same bits as out = x W^T, whole and edge tiles, with and without bias,
    # in registers and in plain loops.  The AMX paths ignore the setting.
    assert_same_bits_in_modes(
        packed, [(64, 768, 300), (37, 64, 100), (1, 32, 40), (300, 96, 3000), (33, 64, 33),
                 (100, 1024, 2048)],
        12, [{"layout": layout, "plain": plain} for layout in ("x_wt", "w_xt", "auto")
             for plain in (False, True)],
        lambda xb, wb, bias, dout: (forward_check(xb, wb, bias), forward_check(xb, wb, None)))
    with pytest.raises(ValueError, match="layout must be one of"):
        bf16._set_forward_layout("wx")


@pytest.mark.parametrize("packed", packed_paths())
def test_streamed_weight_gradients_give_the_same_bits(packed):
    # A weight gradient written afresh in one block of depths (up to 512 rows) into a
    # 64-byte-aligned array is stored past the caches on the VDPBF16PS path
    # (bf_sp_stream_c): the same bits as plain stores, whole and edge tiles; two
    # blocks of depths (600 rows) and a destination off the 64-byte grid are not
    # streamed, and come out the same too.
    from adtape import buffers
    rng = np.random.default_rng(21)
    old = bf16.set_bf16_path(packed)
    try:
        for N, C, OC in [(64, 768, 96), (33, 40, 70), (512, 64, 48), (600, 64, 48)]:
            xb, wb, bias, dout = operands(rng, (N,), C, OC)
            runs = []
            for stream in (True, False):
                previous = bf16._set_stream_dweight(stream)
                try:
                    aligned = buffers.empty((OC, C))
                    off = buffers.empty((OC * C + 1,))[1:].reshape(OC, C)
                    for dw in (aligned, off):
                        dw[...] = np.nan
                        bf16.matmul_backward_bf16(None, dw, None, dout, xb, wb, overwrite=True)
                finally:
                    bf16._set_stream_dweight(previous)
                runs.append((aligned.copy(), off.copy()))
            for a, b in zip(runs[0] + runs[0][:1], runs[1] + runs[0][1:]):
                np.testing.assert_array_equal(a, b)
            x, d = f64(xb), f64(to_bf16(dout))
            check_within(runs[0][0], d.T @ x, np.abs(d).T @ np.abs(x), N, "dweight")
    finally:
        bf16.set_bf16_path(old)


@pytest.mark.parametrize("packed", packed_paths())
def test_input_gradients_with_the_weight_in_place_give_the_same_bits(packed):
    # The VDPBF16PS paths read W's rows in place for dinp = dout @ W at few rows (two
    # rows of a depth pair interleaved in registers, the sums put back in the columns'
    # order): the same bits as W laid out, accumulated or overwritten, whole and edge
    # tiles (rows), two blocks of depths, dout read in place or its tail copied; W's
    # rows 4 KiB apart (2048 columns) read a sub-block of depths at a time, the sums
    # spilled in between (a short last sub-block, edge rows), or laid out; an odd depth
    # or columns short of a panel lay W out either way.  The AMX paths ignore it.
    def backward(xb, wb, bias, dout):
        N, C, OC = dout.shape[0], wb.shape[1], wb.shape[0]
        dinp = np.full((N, C), 0.5, np.float32)
        bf16.matmul_backward_bf16(dinp, None, None, dout, None, wb)
        fresh = np.full((N, C), np.nan, np.float32)
        bf16.matmul_backward_bf16(fresh, None, None, dout, None, wb, overwrite=True)
        return dinp, fresh
    shapes = [(64, 768, 2304), (37, 64, 100), (8, 32, 1030), (1, 96, 64), (300, 64, 96),
              (64, 64, 33), (64, 40, 64), (37, 2048, 200), (64, 2048, 700)]
    assert_same_bits_in_modes(packed, shapes, 13, [{"weight": "laid_out"},
                                                    {"weight": "in_place"},
                                                    {"weight": "auto"},
                                                    {"weight": "auto", "sub": False}],
                              backward)
    rng = np.random.default_rng(14)
    xb, wb, bias, dout = operands(rng, (37,), 64, 100)
    with kernel_modes(weight="in_place"):
        old = bf16.set_bf16_path(packed)
        try:
            dinp = backward(xb, wb, bias, dout)[1]
        finally:
            bf16.set_bf16_path(old)
    d, w = f64(to_bf16(dout)), f64(wb)
    check_within(dinp, d @ w, np.abs(d) @ np.abs(w), 100, "dinp")
    with pytest.raises(ValueError, match="mode must be one of"):
        bf16._set_direct_weight("direct")


def test_input_gradient_in_place_choice():
    # W read in place for dout @ W up to 256 rows on the VDPBF16PS paths, where the
    # depth (OC) is even and the columns (C) whole panels of 32; W's rows a multiple of
    # 4 KiB apart (C a multiple of 2048) a sub-block of depths at a time, up to 128 rows
    # and where those rows reach 8 of L2's sets or more (not 16 KiB apart: 8192), unless
    # that is turned off; never on the AMX or emulated paths.  The planner's figure of
    # the backward's buffers follows it.
    from gpt2.perfmodel.plan import bf16_backward_scratch, bf16_packed_bytes
    old = bf16.bf16_path()
    try:
        bf16.set_bf16_path("twin")
        cases = {(64, 768, 2304): True, (256, 576, 49152): True, (257, 768, 768): False,
                 (1, 32, 2): True, (64, 40, 64): False, (64, 64, 33): False,
                 (64, 2048, 8192): True, (64, 14336, 4096): True, (64, 2080, 2048): True,
                 (128, 4096, 2048): True, (129, 2048, 8192): False, (64, 8192, 2048): False,
                 (64, 16384, 2048): False}
        for (N, C, OC), in_place in cases.items():
            assert bf16.input_gradient_in_place(N, C, OC) == in_place, (N, C, OC)
            dinp = bf16_packed_bytes(N, C, OC, True, in_place)
            assert dinp == bf16._packed_bytes(N, C, OC, True, in_place)
            dweight = bf16_packed_bytes(OC, C, N, False)
            assert bf16_backward_scratch(N, C, OC, emulated=False) == [2.0 * N * OC,
                                                                       dinp + dweight]
        assert bf16._packed_bytes(64, 768, 2304, True, True) == 0
        with kernel_modes(sub=False):
            assert not bf16.input_gradient_in_place(64, 2048, 8192)
            assert bf16.input_gradient_in_place(64, 2080, 2048)
        for path in ("amx_twin", "emulated"):
            bf16.set_bf16_path(path)
            assert not bf16.input_gradient_in_place(64, 768, 2304)
    finally:
        bf16.set_bf16_path(old)


def test_forward_layout_choice():
    # out^T = W x^T on the VDPBF16PS paths where the weight's rows can be read in place
    # and there are fewer rows than outputs: up to 256, or 8 times fewer and no more
    # than the depth; never on the AMX or emulated paths.  The planner's figure of the
    # forward's buffer follows it.
    from gpt2.perfmodel.plan import bf16_forward_scratch, bf16_packed_bytes
    old = bf16.bf16_path()
    try:
        bf16.set_bf16_path("twin")
        cases = {(64, 768, 2304): True, (256, 768, 768): True, (512, 768, 3072): False,
                 (768, 768, 50304): True, (1024, 768, 50304): False,
                 (1024, 2048, 128256): True, (4096, 768, 50304): False,
                 (1024, 576, 49152): False, (8192, 768, 50304): False,
                 (64, 33, 2304): False, (300, 768, 200): False, (64, 768, 64): False}
        for (N, C, OC), transposed in cases.items():
            assert bf16.forward_transposed(N, C, OC) == transposed, (N, C, OC)
            laid_out = (bf16_packed_bytes(OC, N, C, True) if transposed
                        else bf16_packed_bytes(N, OC, C, True))
            assert bf16_forward_scratch(N, C, OC, emulated=False) == [laid_out]
        for path in ("amx_twin", "emulated"):
            bf16.set_bf16_path(path)
            assert not bf16.forward_transposed(64, 768, 2304)
    finally:
        bf16.set_bf16_path(old)


def test_native_matches_its_twin_bit_for_bit():
    # VDPBF16PS against the twin's two float32 multiply-adds per pair: the same bits
    # on normal numbers (the products are exact; each step rounds once)
    # Without AVX512_BF16 the native path is refused, and the twin stands for it.
    if not bf16.cpu_has_avx512_bf16():
        with pytest.raises((ValueError, RuntimeError)):
            bf16.set_bf16_path("native")
        assert bf16.bf16_path() != "native"
        return
    rng = np.random.default_rng(5)
    xb, wb, bias, dout = operands(rng, (3, 97), 521, 130)
    got = {}
    old = bf16.bf16_path()
    try:
        for p in ("native", "twin"):
            bf16.set_bf16_path(p)
            out = forward_check(xb, wb, bias)
            got[p] = (out,) + backward_check(xb, wb, dout, prefill=1.0)
    finally:
        bf16.set_bf16_path(old)
    for a, b in zip(got["native"], got["twin"]):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- the paths

def test_path_switches():
    old = bf16.bf16_path()
    try:
        assert bf16.set_bf16_native(False) == (old in ("native", "amx"))
        assert bf16.bf16_path() == "emulated" and not bf16.bf16_native()
        assert bf16.set_bf16_path("twin") == "emulated"
        assert not bf16.bf16_native()
        if bf16.cpu_has_avx512_bf16():
            bf16.set_bf16_native(True)
            assert bf16.bf16_path() == "native" and bf16.bf16_native()
        else:
            with pytest.raises(ValueError, match="AVX512_BF16"):
                bf16.set_bf16_native(True)
            with pytest.raises(ValueError, match="AVX512_BF16"):
                bf16.set_bf16_path("native")
        if bf16.cpu_has_amx_bf16():
            bf16.set_bf16_path("amx")
            assert bf16.bf16_path() == "amx" and bf16.bf16_native()
        else:
            with pytest.raises(ValueError, match="AMX-BF16"):
                bf16.set_bf16_path("amx")
        with pytest.raises(ValueError, match="path must be one of"):
            bf16.set_bf16_path("avx512_fp16")
    finally:
        bf16.set_bf16_path(old)


def test_native_by_default_where_the_cpu_has_it():
    # in a fresh interpreter, and the CPU check against the kernel's own flags
    code = ("from kernels import bf16\n"
            "assert bf16.bf16_native() == (bf16.cpu_has_avx512_bf16() or bf16.cpu_has_amx_bf16())\n"
            "assert bf16.bf16_path() == ('amx' if bf16.cpu_has_amx_bf16() else 'native' if "
            "bf16.cpu_has_avx512_bf16() else 'emulated')\n"
            "print(bf16.cpu_has_avx512_bf16(), bf16.cpu_has_amx_bf16())\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = set()
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
        # AMX counts only where Linux grants the tiles too: the flags say at most that
        avx512_bf16, amx = res.stdout.split()
        assert avx512_bf16 == str("avx512_bf16" in flags and "avx512f" in flags)
        assert amx == "False" or {"amx_bf16", "amx_tile"} <= flags


# --------------------------------------------------------------------------- misuse

def test_bad_inputs_raise_errors_naming_the_argument():
    rng = np.random.default_rng(7)
    xb, wb, bias, dout = operands(rng, (5,), 6, 4)
    out = np.empty((5, 4), np.float32)
    fwd = bf16.matmul_forward_bf16
    with pytest.raises(TypeError, match="inp.*uint16"):
        fwd(out, ref_from_bf16(xb), wb, bias)
    with pytest.raises(TypeError, match="weight.*uint16"):
        fwd(out, xb, wb.astype(np.int16), bias)
    with pytest.raises(TypeError, match="bias.*float32"):
        fwd(out, xb, wb, to_bf16(bias))
    with pytest.raises(TypeError, match="out.*float32"):
        fwd(np.empty((5, 4), np.uint16), xb, wb, bias)
    with pytest.raises(TypeError, match="inp.*uint16"):
        fwd(out, xb.astype(">u2"), wb, bias)
    with pytest.raises(ValueError, match="weight"):
        fwd(out, xb, np.zeros((4, 7), np.uint16), bias)
    with pytest.raises(ValueError, match="out"):
        fwd(np.empty((5, 5), np.float32), xb, wb, bias)
    with pytest.raises(ValueError, match="bias"):
        fwd(out, xb, wb, np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="weight.*C-contiguous"):
        fwd(out, xb, np.asfortranarray(wb), bias)
    with pytest.raises(ValueError, match="inp.*C-contiguous"):
        fwd(out, np.zeros((6, 10), np.uint16)[::2, :6], wb, bias)
    with pytest.raises(ValueError, match="inp"):
        fwd(out, xb.ravel(), wb, bias)
    with pytest.raises(TypeError, match="bias"):
        fwd(out, xb, wb, [0.0] * 4)
    readonly = np.empty((5, 4), np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="out.*writable"):
        fwd(readonly, xb, wb, bias)
    shared = np.empty(24, np.float32)
    with pytest.raises(ValueError, match="out overlaps bias"):
        fwd(shared[:20].reshape(5, 4), xb, wb, shared[16:20])
    with pytest.raises(ValueError, match="n_threads"):
        fwd(out, xb, wb, bias, n_threads=0)

    bwd = bf16.matmul_backward_bf16
    dweight = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match="dout"):
        bwd(None, dweight, None, dout[:, :3].copy(), xb, wb)
    with pytest.raises(TypeError, match="dout.*float32"):
        bwd(None, dweight, None, to_bf16(dout), xb, wb)
    with pytest.raises(ValueError, match="dweight"):
        bwd(None, np.zeros((4, 5), np.float32), None, dout, xb, wb)
    with pytest.raises(ValueError, match="dinp.*C-contiguous"):
        bwd(np.zeros((6, 5), np.float32).T, dweight, None, dout, xb, wb)
    with pytest.raises(TypeError, match="dinp.*float32"):
        bwd(np.zeros((5, 6), np.uint16), dweight, None, dout, xb, wb)
    with pytest.raises(ValueError, match="dbias"):
        bwd(None, dweight, np.zeros(5, np.float32), dout, xb, wb)
    grads = np.zeros(28, np.float32)
    with pytest.raises(ValueError, match="dweight overlaps dbias"):
        bwd(None, grads[:24].reshape(4, 6), grads[20:24], dout, xb, wb)
    with pytest.raises(ValueError, match="overwrite"):
        bwd(None, dweight, None, dout, xb, wb, overwrite=(True, False))

    x = np.zeros((2, 3), np.float32)
    with pytest.raises(TypeError, match="out.*uint16"):
        bf16.to_bf16(np.empty((2, 3), np.float32), x)
    with pytest.raises(ValueError, match="out must have shape"):
        bf16.to_bf16(np.empty((3, 2), np.uint16), x)
    with pytest.raises(TypeError, match="inp.*float32"):
        bf16.to_bf16(np.empty((2, 3), np.uint16), x.astype(np.float64))
    with pytest.raises(TypeError, match="inp.*uint16"):
        bf16.from_bf16(np.empty((2, 3), np.float32), x)
    with pytest.raises(ValueError, match="out.*C-contiguous"):
        bf16.from_bf16(np.empty((3, 2), np.float32).T, np.zeros((2, 3), np.uint16))
    with pytest.raises(TypeError, match="inp"):
        bf16.to_bf16_naive(np.empty(3, np.uint16), [1.0, 2.0, 3.0])


def test_a_weight_wider_than_the_emulated_block():
    # 2^23 floats of a weight are widened at a time: 131,080 rows of 64 take two blocks
    # (the first of 131,072 rows), the head of a large vocabulary more.  Every path.
    rng = np.random.default_rng(5)
    xb, wb, bias, dout = operands(rng, (3,), 64, (1 << 23) // 64 + 8)
    for p in paths():
        old = bf16.set_bf16_path(p)
        try:
            forward_check(xb, wb, bias)
            backward_check(xb, wb, dout, prefill=1.0)
            backward_check(xb, wb, dout, prefill=0.0, overwrite=True, with_dbias=False)
        finally:
            bf16.set_bf16_path(old)


def test_a_frozen_weight_has_no_weight_gradient(path):
    # dweight None (LoRA's frozen base): dinp and dbias only, nothing else written
    rng = np.random.default_rng(6)
    xb, wb, _, dout = operands(rng, (2, 9), 33, 70)
    want = backward_check(xb, wb, dout, prefill=0.0, overwrite=True)
    dinp, dbias = np.full(xb.shape, np.nan, np.float32), np.full(70, np.nan, np.float32)
    bf16.matmul_backward_bf16(dinp, None, dbias, dout, xb, wb, overwrite=True)
    assert np.array_equal(dinp, want[0]) and np.array_equal(dbias, want[2])


def test_a_frozen_weight_needs_no_input(path):
    # inp None with dweight None: the same dinp and dbias bits as with the input given
    rng = np.random.default_rng(7)
    for lead, C, OC in (((2, 9), 33, 70), ((64,), 96, 40), ((1,), 5, 3)):
        xb, wb, _, dout = operands(rng, lead, C, OC)
        want = [np.full(xb.shape, 0.5, np.float32), np.full(OC, 0.5, np.float32)]
        bf16.matmul_backward_bf16(want[0], None, want[1], dout, xb, wb)
        got = [np.full(xb.shape, 0.5, np.float32), np.full(OC, 0.5, np.float32)]
        bf16.matmul_backward_bf16(got[0], None, got[1], dout, None, wb)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="dweight"):
        bf16.matmul_backward_bf16(got[0], np.zeros((OC, C), np.float32), None, dout, None, wb)


# ---------------------------------------------------------- weight-only bf16 (decoding)

@pytest.mark.parametrize("N", [1, 2, 3, 4, 5, 17, 65, 130])
@pytest.mark.parametrize("C,OC", [(7, 3), (64, 70), (257, 200), (1030, 33)])
def test_weight_only_bf16_forward_within_the_float32_bound(N, C, OC):
    # float32 inp (not rounded) times a bf16 weight widened exactly: the float32
    # accumulation bound on the exact product; the fused kernel (up to 4 rows), the
    # widened groups through skinny_nt and through BLAS; odd depths take the tails.
    rng = np.random.default_rng(N * 1000 + C)
    x = rng.standard_normal((N, C)).astype(np.float32)
    _, wb, bias, _ = operands(rng, (N,), C, OC)
    for b in (bias, None):
        out = np.full((N, OC), np.nan, np.float32)
        bf16.matmul_forward_w16(out, x, wb, b)
        bb = np.zeros(OC) if b is None else b.astype(np.float64)
        exact = x.astype(np.float64) @ f64(wb).T + bb
        magnitude = np.abs(x.astype(np.float64)) @ np.abs(f64(wb)).T + np.abs(bb)
        check_within(out, exact, magnitude, C + 1, "out")


def test_weight_only_bf16_forward_shapes_threads_and_errors():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    _, wb, bias, _ = operands(rng, (6,), 40, 300)
    outs = []
    for n in (1, 2):
        out = np.empty((2, 3, 300), np.float32)
        bf16.matmul_forward_w16(out, x, wb, bias, n_threads=n)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])       # the groups do not follow the threads
    flat = np.empty((6, 300), np.float32)
    bf16.matmul_forward_w16(flat, x.reshape(6, 40), wb, bias)
    assert np.array_equal(flat, outs[0].reshape(6, 300))
    with pytest.raises(TypeError, match="weight must be an aligned native uint16"):
        bf16.matmul_forward_w16(flat, x.reshape(6, 40), ref_from_bf16(wb), bias)
    with pytest.raises(ValueError):
        bf16.matmul_forward_w16(flat, x.reshape(6, 40)[:, :39].copy(), wb, bias)
    empty = np.full((2, 300), np.nan, np.float32)
    bf16.matmul_forward_w16(empty, np.zeros((2, 0), np.float32), np.zeros((300, 0), np.uint16),
                            bias)
    assert np.array_equal(empty, np.broadcast_to(bias, (2, 300)))
