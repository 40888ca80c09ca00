"""kernels.attention against its naive twin, PyTorch SDPA, and float64 finite differences."""
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import threads
from kernels.attention import (attention_backward, attention_backward_naive,
                               attention_forward, attention_forward_naive)

# (B, T, C, n_head): GPT-2 head size, T = 1, T across the 64-row query and key blocks
# (7, 65, 100, 130) and the 16- and 32-wide register tiles, C not a multiple of 8,
# head sizes 1 and 47 (32 + 15: every kind of 16-lane tail in the softmax, dot and
# tile rows).
SHAPES = [(2, 64, 128, 2), (1, 1, 24, 2), (3, 5, 30, 3), (1, 67, 20, 4), (2, 130, 64, 1),
          (1, 17, 3, 3), (1, 49, 94, 2), (2, 33, 47, 1), (2, 7, 16, 2), (1, 65, 64, 1),
          (2, 100, 96, 3)]


def rel_err(actual, expected):
    """Largest absolute error relative to the largest magnitude in ``expected``."""
    scale = max(float(np.abs(expected).max()), 1e-30)
    return float(np.abs(np.asarray(actual, np.float64) - expected).max()) / scale


def make(rng, B, T, C, dtype=np.float32):
    return (rng.standard_normal((B, T, 3 * C)).astype(dtype),
            rng.standard_normal((B, T, C)).astype(dtype))


def run_forward(forward, qkv, NH, **kw):
    B, T, C3 = qkv.shape
    out = np.full((B, T, C3 // 3), np.nan, qkv.dtype)
    lse = np.full((B, NH, T), np.nan, qkv.dtype)
    forward(out, lse, qkv, NH, **kw)
    return out, lse


def run_backward(backward, dout, qkv, out, lse, NH, fill=0.0, **kw):
    dqkv = np.full(qkv.shape, fill, qkv.dtype)
    backward(dqkv, dout, qkv, out, lse, NH, **kw)
    return dqkv


def torch_attention(qkv, dout, NH):
    """out, lse and dqkv from PyTorch's causal SDPA and autograd, in float64."""
    B, T, C3 = qkv.shape
    C, hs = C3 // 3, C3 // 3 // NH
    x = torch.from_numpy(qkv.astype(np.float64)).requires_grad_()
    q, k, v = (t.view(B, T, NH, hs).transpose(1, 2) for t in x.split(C, dim=2))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = out.transpose(1, 2).reshape(B, T, C)
    out.backward(torch.from_numpy(dout.astype(np.float64)))
    with torch.no_grad():
        scores = (q @ k.transpose(-1, -2)) / hs ** 0.5
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return out.detach().numpy(), lse.numpy(), x.grad.numpy()


@pytest.mark.parametrize("B,T,C,NH", SHAPES)
def test_matches_naive_and_torch(B, T, C, NH, vector_lanes):
    rng = np.random.default_rng(1)
    qkv, dout = make(rng, B, T, C)
    out, lse = run_forward(attention_forward, qkv, NH)
    out_naive, lse_naive = run_forward(attention_forward_naive, qkv, NH)
    out_torch, lse_torch, dqkv_torch = torch_attention(qkv, dout, NH)
    assert rel_err(out, out_naive) < 1e-5
    assert rel_err(lse, lse_naive) < 1e-5
    assert rel_err(out, out_torch) < 1e-5
    assert rel_err(lse, lse_torch) < 1e-5
    dqkv = run_backward(attention_backward, dout, qkv, out, lse, NH)
    dqkv_naive = run_backward(attention_backward_naive, dout, qkv, out, lse, NH)
    assert rel_err(dqkv, dqkv_naive) < 1e-5
    assert rel_err(dqkv, dqkv_torch) < 1e-4


def test_gpt2_shape_against_torch(vector_lanes):
    rng = np.random.default_rng(2)
    qkv, dout = make(rng, 2, 256, 768)
    out, lse = run_forward(attention_forward, qkv, 12)
    out_torch, lse_torch, dqkv_torch = torch_attention(qkv, dout, 12)
    assert rel_err(out, out_torch) < 1e-5
    assert rel_err(lse, lse_torch) < 1e-5
    assert rel_err(run_backward(attention_backward, dout, qkv, out, lse, 12), dqkv_torch) < 1e-4


@pytest.mark.parametrize("T", [300, 520])
def test_past_the_depth_block(T, vector_lanes):
    # T past the depth block of 256 (a key block's rows of packed K must lie in one
    # depth block; the partial last one once overran the scratch), and not a multiple
    # of the 64-row query and key blocks or of any tile width.
    rng = np.random.default_rng(8)
    qkv, dout = make(rng, 1, T, 128)
    out, lse = run_forward(attention_forward, qkv, 2)
    out_torch, lse_torch, dqkv_torch = torch_attention(qkv, dout, 2)
    assert rel_err(out, out_torch) < 1e-5
    assert rel_err(lse, lse_torch) < 1e-5
    assert rel_err(run_backward(attention_backward, dout, qkv, out, lse, 2), dqkv_torch) < 1e-4


def test_large_scores_stay_finite(vector_lanes):
    # Scores of several hundred: the softmax must subtract the row max, and the
    # backward's exp(S - lse) must not overflow.
    rng = np.random.default_rng(3)
    qkv, dout = make(rng, 1, 40, 32)
    qkv *= 8.0
    out, lse = run_forward(attention_forward, qkv, 2)
    out_torch, lse_torch, dqkv_torch = torch_attention(qkv, dout, 2)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert rel_err(out, out_torch) < 1e-5
    assert rel_err(lse, lse_torch) < 1e-5
    dqkv = run_backward(attention_backward, dout, qkv, out, lse, 2)
    assert np.isfinite(dqkv).all()
    assert rel_err(dqkv, dqkv_torch) < 1e-4


def test_backward_formula_by_finite_differences_float64():
    # The naive twin in float64 is checked against central differences of
    # L = sum(out * dout); the optimized kernel is checked against the twin above.
    rng = np.random.default_rng(4)
    B, T, C, NH = 2, 4, 6, 2
    qkv, dout = make(rng, B, T, C, np.float64)
    out, lse = run_forward(attention_forward_naive, qkv, NH)
    dqkv = run_backward(attention_backward_naive, dout, qkv, out, lse, NH)

    def loss():
        out, _ = run_forward(attention_forward_naive, qkv, NH)
        return float((out * dout).sum())

    eps = 1e-6
    numeric = np.empty_like(qkv)
    for idx in np.ndindex(qkv.shape):
        keep = qkv[idx]
        qkv[idx] = keep + eps
        up = loss()
        qkv[idx] = keep - eps
        down = loss()
        qkv[idx] = keep
        numeric[idx] = (up - down) / (2 * eps)
    np.testing.assert_allclose(dqkv, numeric, rtol=1e-6, atol=1e-8)


def test_backward_accumulates(vector_lanes):
    rng = np.random.default_rng(5)
    qkv, dout = make(rng, 2, 33, 40)
    out, lse = run_forward(attention_forward, qkv, 4)
    fresh = run_backward(attention_backward, dout, qkv, out, lse, 4)
    prefilled = run_backward(attention_backward, dout, qkv, out, lse, 4, fill=2.5)
    assert rel_err(prefilled - 2.5, fresh) < 1e-6
    twice = fresh.copy()
    attention_backward(twice, dout, qkv, out, lse, 4)
    assert rel_err(twice, 2 * fresh) < 1e-6


def test_one_and_two_threads_agree(vector_lanes):
    # Each (batch, head) is one thread's whole task: the bits do not depend on the
    # thread count.
    rng = np.random.default_rng(6)
    qkv, dout = make(rng, 3, 70, 48)
    results = []
    previous = threads.get_num_threads()
    try:
        for n in (1, 2):
            threads.set_num_threads(n)
            out, lse = run_forward(attention_forward, qkv, 4, n_threads=n)
            results.append((out, lse, run_backward(attention_backward, dout, qkv, out, lse, 4,
                                                   n_threads=n)))
    finally:
        threads.set_num_threads(previous)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_bad_inputs_raise_clear_errors():
    rng = np.random.default_rng(7)
    qkv, dout = make(rng, 2, 5, 12)
    out, lse = run_forward(attention_forward, qkv, 3)
    dqkv = np.zeros_like(qkv)
    with pytest.raises(ValueError, match="n_head"):
        attention_forward(out, lse, qkv, 5)
    with pytest.raises(ValueError, match="n_head"):
        attention_forward(out, lse, qkv, 0)
    with pytest.raises(ValueError, match="qkv.*3"):
        attention_forward(out, lse, np.zeros((2, 5, 35), np.float32), 3)
    with pytest.raises(ValueError, match="qkv"):
        attention_forward(out, lse, qkv[0], 3)
    with pytest.raises(ValueError, match="lse"):
        attention_forward(out, np.zeros((2, 3, 4), np.float32), qkv, 3)
    with pytest.raises(ValueError, match="out"):
        attention_forward(np.zeros((2, 5, 13), np.float32), lse, qkv, 3)
    with pytest.raises(TypeError, match="qkv.*float32"):
        attention_forward(out, lse, qkv.astype(np.float64), 3)
    with pytest.raises(ValueError, match="qkv.*C-contiguous"):
        attention_forward(out, lse, np.asfortranarray(qkv), 3)
    with pytest.raises(ValueError, match="dout"):
        attention_backward(dqkv, dout[:, :4].copy(), qkv, out, lse, 3)
    with pytest.raises(ValueError, match="out"):
        attention_backward(dqkv, dout, qkv, out[:, :4].copy(), lse, 3)
    with pytest.raises(TypeError, match="lse"):
        attention_backward(dqkv, dout, qkv, out, lse.astype(np.float16), 3)
    with pytest.raises(ValueError, match="dqkv.*C-contiguous"):
        attention_backward(np.zeros((36, 5, 2), np.float32).T, dout, qkv, out, lse, 3)
    with pytest.raises(TypeError, match="qkv"):
        attention_forward_naive(out, lse, qkv.astype(np.int64), 3)


def test_zero_sizes_in_a_child_process():
    # B = 0 or T = 0 used to divide by zero sizing the scratch (SIGFPE): now nothing to
    # compute; C = 0 (a head size of 0, a score scale of 1/sqrt(0)) is a ValueError.
    code = """
import numpy as np
from kernels.attention import (attention_backward, attention_backward_naive,
                               attention_forward, attention_forward_naive)
for fwd, bwd in ((attention_forward, attention_backward),
                 (attention_forward_naive, attention_backward_naive)):
    for B, T in ((0, 5), (2, 0), (0, 0)):
        qkv = np.zeros((B, T, 36), np.float32)
        out = np.zeros((B, T, 12), np.float32)
        lse = np.zeros((B, 3, T), np.float32)
        fwd(out, lse, qkv, 3)
        dqkv = np.zeros_like(qkv)
        bwd(dqkv, np.zeros_like(out), qkv, out, lse, 3)
        bwd(dqkv, np.zeros_like(out), qkv, out, lse, 3, overwrite=True)
    for B, T in ((2, 5), (0, 5), (2, 0)):
        qkv = np.zeros((B, T, 0), np.float32)
        out = np.zeros((B, T, 0), np.float32)
        lse = np.zeros((B, 1, T), np.float32)
        for call in (lambda: fwd(out, lse, qkv, 1),
                     lambda: bwd(np.zeros_like(qkv), np.zeros_like(out), qkv, out, lse, 1)):
            try:
                call()
            except ValueError as e:
                assert "C" in str(e) and "positive" in str(e), e
            else:
                raise AssertionError("C = 0 accepted")
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("naive", [False, True], ids=["kernel", "naive"])
def test_outputs_must_not_overlap_inputs(naive):
    # dqkv aliasing qkv used to give a wrong gradient silently (the kernel reads q, k
    # and v after writing parts of dqkv): every output against every input and the
    # other outputs is a ValueError naming both.
    forward = attention_forward_naive if naive else attention_forward
    backward = attention_backward_naive if naive else attention_backward
    rng = np.random.default_rng(9)
    B, T, C, NH = 2, 6, 12, 3
    qkv, dout = make(rng, B, T, C)
    out, lse = run_forward(forward, qkv, NH)
    with pytest.raises(ValueError, match="dqkv overlaps qkv"):
        backward(qkv, dout, qkv, out, lse, NH)
    big = np.zeros(B * T * 3 * C + B * T * C, np.float32)
    dqkv, tail = big[:B * T * 3 * C].reshape(qkv.shape), big[B * T * C:].reshape(qkv.shape)
    with pytest.raises(ValueError, match="dqkv overlaps qkv"):
        backward(dqkv, dout, tail, out, lse, NH)
    shared = np.zeros(B * T * 3 * C, np.float32)
    dqkv = shared.reshape(qkv.shape)
    with pytest.raises(ValueError, match="dqkv overlaps dout"):
        backward(dqkv, shared[:dout.size].reshape(dout.shape), qkv, out, lse, NH)
    with pytest.raises(ValueError, match="dqkv overlaps out"):
        backward(dqkv, dout, qkv, shared[-out.size:].reshape(out.shape), lse, NH)
    with pytest.raises(ValueError, match="dqkv overlaps lse"):
        backward(dqkv, dout, qkv, out, shared[5:5 + lse.size].reshape(lse.shape), NH)
    with pytest.raises(ValueError, match="out overlaps qkv"):
        forward(qkv.reshape(-1)[:out.size].reshape(out.shape), lse, qkv, NH)
    store = np.zeros(lse.size + out.size, np.float32)
    with pytest.raises(ValueError, match="out overlaps lse"):
        forward(store[:out.size].reshape(out.shape),
                store[out.size - 1:out.size - 1 + lse.size].reshape(lse.shape), qkv, NH)
    with pytest.raises(ValueError, match="lse overlaps qkv"):
        forward(out, qkv.reshape(-1)[-lse.size:].reshape(lse.shape), qkv, NH)
    frozen = np.zeros_like(qkv)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="dqkv must be writable"):
        backward(frozen, dout, qkv, out, lse, NH)
    frozen_out = np.zeros_like(out)
    frozen_out.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writable"):
        forward(frozen_out, lse, qkv, NH)
