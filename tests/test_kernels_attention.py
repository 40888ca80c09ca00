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

# (B, T, C, n_head): GPT-2 head size, T = 1, odd T across the 64-row block and the
# 16- and 32-wide register tiles, C not a multiple of 8, head sizes 1 and 47 (32 + 15:
# every kind of 16-lane tail in the softmax, dot and tile rows).
SHAPES = [(2, 64, 128, 2), (1, 1, 24, 2), (3, 5, 30, 3), (1, 67, 20, 4), (2, 130, 64, 1),
          (1, 17, 3, 3), (1, 49, 94, 2), (2, 33, 47, 1)]


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
    att = np.full((B, NH, T, T), np.nan, qkv.dtype)
    forward(out, att, qkv, NH, **kw)
    return out, att


def run_backward(backward, dout, qkv, att, NH, fill=0.0, **kw):
    dqkv = np.full(qkv.shape, fill, qkv.dtype)
    backward(dqkv, dout, qkv, att, NH, **kw)
    return dqkv


def torch_attention(qkv, dout, NH):
    """out, att probabilities and dqkv from PyTorch's causal SDPA and autograd."""
    B, T, C3 = qkv.shape
    C, hs = C3 // 3, C3 // 3 // NH
    x = torch.from_numpy(qkv).requires_grad_()
    q, k, v = (t.view(B, T, NH, hs).transpose(1, 2) for t in x.split(C, dim=2))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = out.transpose(1, 2).reshape(B, T, C)
    out.backward(torch.from_numpy(dout))
    with torch.no_grad():
        scores = (q @ k.transpose(-1, -2)) / hs ** 0.5
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return out.detach().numpy(), att.numpy(), x.grad.numpy()


@pytest.mark.parametrize("B,T,C,NH", SHAPES)
def test_matches_naive_and_torch(B, T, C, NH, vector_lanes):
    rng = np.random.default_rng(1)
    qkv, dout = make(rng, B, T, C)
    out, att = run_forward(attention_forward, qkv, NH)
    out_naive, att_naive = run_forward(attention_forward_naive, qkv, NH)
    out_torch, att_torch, dqkv_torch = torch_attention(qkv, dout, NH)
    assert rel_err(out, out_naive) < 1e-5
    assert rel_err(att, att_naive) < 1e-5
    assert rel_err(out, out_torch) < 1e-5
    assert rel_err(att, att_torch) < 1e-5
    assert np.all(att[:, :, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)
    dqkv = run_backward(attention_backward, dout, qkv, att, NH)
    dqkv_naive = run_backward(attention_backward_naive, dout, qkv, att, NH)
    assert rel_err(dqkv, dqkv_naive) < 1e-5
    assert rel_err(dqkv, dqkv_torch) < 1e-4


def test_gpt2_shape_against_torch(vector_lanes):
    rng = np.random.default_rng(2)
    qkv, dout = make(rng, 2, 256, 768)
    out, att = run_forward(attention_forward, qkv, 12)
    out_torch, _, dqkv_torch = torch_attention(qkv, dout, 12)
    assert rel_err(out, out_torch) < 1e-5
    assert rel_err(run_backward(attention_backward, dout, qkv, att, 12), dqkv_torch) < 1e-4


@pytest.mark.parametrize("offset", [0, 1, 5, 15])
def test_att_rows_at_every_alignment(offset, vector_lanes):
    # The forward streams att rows in aligned vectors after a scalar lead: att starting
    # `offset` floats past a 64-byte boundary.  T = 300 is past the depth block of 256
    # (whose partial last block once overran the packed-operand scratch) and not a
    # multiple of the 64-row query block or of any tile width.
    rng = np.random.default_rng(8)
    B, T, C, NH = 1, 300, 128, 2
    qkv, dout = make(rng, B, T, C)
    raw = np.full(B * NH * T * T + 32, np.nan, np.float32)
    start = (-raw.ctypes.data % 64) // 4 + offset
    att = raw[start:start + B * NH * T * T].reshape(B, NH, T, T)
    out = np.full((B, T, C), np.nan, np.float32)
    attention_forward(out, att, qkv, NH)
    out_torch, att_torch, dqkv_torch = torch_attention(qkv, dout, NH)
    assert rel_err(out, out_torch) < 1e-5
    assert rel_err(att, att_torch) < 1e-5
    assert np.all(att[:, :, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)
    assert np.isnan(raw[:start]).all() and np.isnan(raw[start + att.size:]).all()
    assert rel_err(run_backward(attention_backward, dout, qkv, att, NH), dqkv_torch) < 1e-4


def test_large_scores_stay_finite(vector_lanes):
    # Scores of several hundred: the softmax must subtract the row max.
    rng = np.random.default_rng(3)
    qkv, dout = make(rng, 1, 40, 32)
    qkv *= 8.0
    out, att = run_forward(attention_forward, qkv, 2)
    out_torch, att_torch, dqkv_torch = torch_attention(qkv, dout, 2)
    assert np.isfinite(out).all() and np.isfinite(att).all()
    assert rel_err(out, out_torch) < 1e-5
    assert rel_err(run_backward(attention_backward, dout, qkv, att, 2), dqkv_torch) < 1e-4


def test_backward_formula_by_finite_differences_float64():
    # The naive twin in float64 is checked against central differences of
    # L = sum(out * dout); the optimized kernel is checked against the twin above.
    rng = np.random.default_rng(4)
    B, T, C, NH = 2, 4, 6, 2
    qkv, dout = make(rng, B, T, C, np.float64)
    _, att = run_forward(attention_forward_naive, qkv, NH)
    dqkv = run_backward(attention_backward_naive, dout, qkv, att, NH)

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
    _, att = run_forward(attention_forward, qkv, 4)
    fresh = run_backward(attention_backward, dout, qkv, att, 4)
    prefilled = run_backward(attention_backward, dout, qkv, att, 4, fill=2.5)
    assert rel_err(prefilled - 2.5, fresh) < 1e-6
    twice = fresh.copy()
    attention_backward(twice, dout, qkv, att, 4)
    assert rel_err(twice, 2 * fresh) < 1e-6


def test_one_and_two_threads_agree(vector_lanes):
    rng = np.random.default_rng(6)
    qkv, dout = make(rng, 3, 70, 48)
    results = []
    previous = threads.get_num_threads()
    try:
        for n in (1, 2):
            threads.set_num_threads(n)
            out, att = run_forward(attention_forward, qkv, 4, n_threads=n)
            results.append((out, att, run_backward(attention_backward, dout, qkv, att, 4,
                                                   n_threads=n)))
    finally:
        threads.set_num_threads(previous)
    for a, b in zip(*results):
        assert rel_err(a, b) < 1e-6


def test_bad_inputs_raise_clear_errors():
    rng = np.random.default_rng(7)
    qkv, dout = make(rng, 2, 5, 12)
    out, att = run_forward(attention_forward, qkv, 3)
    dqkv = np.zeros_like(qkv)
    with pytest.raises(ValueError, match="n_head"):
        attention_forward(out, att, qkv, 5)
    with pytest.raises(ValueError, match="n_head"):
        attention_forward(out, att, qkv, 0)
    with pytest.raises(ValueError, match="qkv.*3"):
        attention_forward(out, att, np.zeros((2, 5, 35), np.float32), 3)
    with pytest.raises(ValueError, match="qkv"):
        attention_forward(out, att, qkv[0], 3)
    with pytest.raises(ValueError, match="att"):
        attention_forward(out, np.zeros((2, 3, 5, 4), np.float32), qkv, 3)
    with pytest.raises(ValueError, match="out"):
        attention_forward(np.zeros((2, 5, 13), np.float32), att, qkv, 3)
    with pytest.raises(TypeError, match="qkv.*float32"):
        attention_forward(out, att, qkv.astype(np.float64), 3)
    with pytest.raises(ValueError, match="qkv.*C-contiguous"):
        attention_forward(out, att, np.asfortranarray(qkv), 3)
    with pytest.raises(ValueError, match="dout"):
        attention_backward(dqkv, dout[:, :4].copy(), qkv, att, 3)
    with pytest.raises(TypeError, match="att"):
        attention_backward(dqkv, dout, qkv, att.astype(np.float16), 3)
    with pytest.raises(ValueError, match="dqkv.*C-contiguous"):
        attention_backward(np.zeros((36, 5, 2), np.float32).T, dout, qkv, att, 3)
    with pytest.raises(TypeError, match="qkv"):
        attention_forward_naive(out, att, qkv.astype(np.int64), 3)


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
        att = np.zeros((B, 3, T, T), np.float32)
        fwd(out, att, qkv, 3)
        dqkv = np.zeros_like(qkv)
        bwd(dqkv, out, qkv, att, 3)
        bwd(dqkv, out, qkv, att, 3, overwrite=True)
    for B, T in ((2, 5), (0, 5), (2, 0)):
        qkv = np.zeros((B, T, 0), np.float32)
        for call in (lambda: fwd(np.zeros((B, T, 0), np.float32),
                                 np.zeros((B, 1, T, T), np.float32), qkv, 1),
                     lambda: bwd(np.zeros_like(qkv), np.zeros((B, T, 0), np.float32), qkv,
                                 np.zeros((B, 1, T, T), np.float32), 1)):
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
    out, att = run_forward(forward, qkv, NH)
    with pytest.raises(ValueError, match="dqkv must not overlap qkv"):
        backward(qkv, dout, qkv, att, NH)
    big = np.zeros(B * T * 3 * C + B * T * C, np.float32)
    dqkv, tail = big[:B * T * 3 * C].reshape(qkv.shape), big[B * T * C:].reshape(qkv.shape)
    with pytest.raises(ValueError, match="dqkv must not overlap qkv"):
        backward(dqkv, dout, tail, att, NH)
    shared = np.zeros(B * T * 3 * C, np.float32)
    with pytest.raises(ValueError, match="dqkv must not overlap dout"):
        backward(shared.reshape(qkv.shape), shared[:B * T * C].reshape(dout.shape), qkv,
                 att, NH)
    with pytest.raises(ValueError, match="dqkv must not overlap att"):
        backward(shared.reshape(qkv.shape), dout, qkv,
                 shared[:att.size].reshape(att.shape), NH)
    with pytest.raises(ValueError, match="out must not overlap qkv"):
        forward(qkv.reshape(-1)[:out.size].reshape(out.shape), att, qkv, NH)
    att_store = np.zeros(att.size + out.size, np.float32)
    with pytest.raises(ValueError, match="out must not overlap att"):
        forward(att_store[:out.size].reshape(out.shape),
                att_store[out.size // 2:out.size // 2 + att.size].reshape(att.shape), qkv, NH)
    with pytest.raises(ValueError, match="att must not overlap qkv"):
        forward(out, qkv.reshape(-1)[:att.size].reshape(att.shape), qkv, NH)
    frozen = np.zeros_like(qkv)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="dqkv must be writable"):
        backward(frozen, dout, qkv, att, NH)
    frozen_out = np.zeros_like(out)
    frozen_out.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writable"):
        forward(frozen_out, att, qkv, NH)
