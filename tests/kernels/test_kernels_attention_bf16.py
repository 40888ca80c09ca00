"""Attention with bf16 operands (precision="bf16", kernels/attention_bf16.h) against its
float64 twin on the same bf16-rounded operands, on every path this CPU runs.

The kernel rounds q, k, v, dout and the probabilities P and dS to bf16 and sums each
product in float32 (D from the rounded dout); the float64 twin rounds the same operands
(P and dS from its own float64 values, each first to float32).  Where the kernel's float32 P lands on the other
side of a bf16 rounding boundary from the twin's, that one operand differs by a bf16
ulp (2^-8 relative): rare, so nearly every element agrees to float32's accumulation
error, and all of them within a bf16 ulp of the largest.  The float32 kernel, whose
operands are not rounded, is off by about 2^-9 everywhere: the tests check that too,
so that they can tell the two apart.
"""
import numpy as np
import pytest

from kernels import attention, bf16
from kernels.attention import (attention_backward, attention_backward_naive,
                               attention_forward, attention_forward_naive)


def paths():
    """The bf16 paths this CPU runs: the VDPBF16PS build where it has AVX512_BF16, its
    float32 twin and the emulated path (float32's kernels on rounded operands)
    everywhere."""
    return (["native"] if bf16.cpu_has_avx512_bf16() else []) + ["twin", "emulated"]


@pytest.fixture(params=paths())
def bf16_path(request):
    old = bf16.set_bf16_path(request.param)
    yield request.param
    bf16.set_bf16_path(old)


def run(qkv, dout, NH, NKV, precision="bf16", n_threads=None, overwrite=True):
    B, T, _ = qkv.shape
    C = dout.shape[2]
    out, lse = np.empty((B, T, C), np.float32), np.empty((B, NH, T), np.float32)
    attention_forward(out, lse, qkv, NH, n_kv_head=NKV, precision=precision,
                      n_threads=n_threads)
    dqkv = np.full(qkv.shape, np.nan, np.float32) if overwrite else np.zeros_like(qkv)
    attention_backward(dqkv, dout, qkv, out, lse, NH, n_kv_head=NKV, overwrite=overwrite,
                       precision=precision, n_threads=n_threads)
    return out, lse, dqkv


def twin(qkv, dout, out, NH, NKV):
    """The float64 twin's out, lse and dqkv on bf16 operands (the backward from the
    kernel's out, as the kernel's backward reads it)."""
    B, T, _ = qkv.shape
    C = dout.shape[2]
    q64 = qkv.astype(np.float64)
    out64, lse64 = np.empty((B, T, C)), np.empty((B, NH, T))
    attention_forward_naive(out64, lse64, q64, NH, n_kv_head=NKV, precision="bf16")
    d64 = np.zeros_like(q64)
    attention_backward_naive(d64, dout.astype(np.float64), q64, out.astype(np.float64),
                             lse64, NH, n_kv_head=NKV, precision="bf16")
    return out64, lse64, d64


def agreement(actual, expected):
    """(the largest error over the largest magnitude, the share of elements within
    1e-5 of the largest magnitude)"""
    err = np.abs(np.asarray(actual, np.float64) - expected)
    scale = float(np.abs(expected).max())
    return float(err.max()) / scale, float((err <= 1e-5 * scale).mean())


SHAPES = [  # B, T, NH, NKV, hs: block edges (64-row blocks), odd sizes, GQA
    (1, 1, 2, 2, 16), (2, 37, 2, 1, 16), (1, 63, 2, 2, 64), (1, 64, 2, 2, 64),
    (1, 65, 4, 2, 32), (1, 129, 2, 1, 64), (2, 200, 4, 2, 32), (1, 64, 1, 1, 12),
    (1, 5, 2, 1, 3), (1, 257, 3, 1, 48),
]


@pytest.mark.parametrize("B,T,NH,NKV,hs", SHAPES)
def test_bf16_attention_against_the_float64_twin(B, T, NH, NKV, hs, bf16_path):
    rng = np.random.default_rng(T * 7 + hs)
    qkv = rng.standard_normal((B, T, (NH + 2 * NKV) * hs)).astype(np.float32)
    dout = rng.standard_normal((B, T, NH * hs)).astype(np.float32)
    out, lse, dqkv = run(qkv, dout, NH, NKV)
    out64, lse64, d64 = twin(qkv, dout, out, NH, NKV)
    for name, got, ref in (("out", out, out64), ("lse", lse, lse64), ("dqkv", dqkv, d64)):
        worst, within = agreement(got, ref)
        assert worst < 2.0 ** -8 and within >= 0.99, (name, worst, within)
    # the float32 kernel is not this: its operands are not rounded
    out32, _, d32 = run(qkv, dout, NH, NKV, precision="fp32")
    if T >= 37:
        assert agreement(out32, out64)[1] < 0.5 and agreement(d32, d64)[1] < 0.5


@pytest.mark.parametrize("B,T,NH,NKV,hs", [(2, 130, 4, 2, 64), (1, 300, 4, 1, 32),
                                             (3, 100, 2, 2, 16)])
def test_threads_passes_and_paths_give_the_same_bits(B, T, NH, NKV, hs):
    # Each element is one float32 sum over its depth pairs in order, whoever computes
    # it: one thread or two, one pass or two, VDPBF16PS or its twin (no subnormals
    # here).  The emulated path sums in float32's kernels' order: the same bits on
    # one thread or two, one pass or two.
    rng = np.random.default_rng(5)
    qkv = rng.standard_normal((B, T, (NH + 2 * NKV) * hs)).astype(np.float32)
    dout = rng.standard_normal((B, T, NH * hs)).astype(np.float32)
    results = {}
    old_path, old_mode = bf16.bf16_path(), attention.set_backward_passes(0)
    try:
        for path in paths():
            bf16.set_bf16_path(path)
            for passes in (1, 2):
                attention.set_backward_passes(passes)
                for nt in (1, 2):
                    results.setdefault(path == "emulated", []).append(
                        run(qkv, dout, NH, NKV, n_threads=nt))
    finally:
        bf16.set_bf16_path(old_path)
        attention.set_backward_passes(old_mode)
    for group in results.values():
        for other in group[1:]:
            for a, b in zip(group[0], other):
                np.testing.assert_array_equal(a, b)


def test_overwrite_equals_adding_into_zeros(bf16_path):
    rng = np.random.default_rng(9)
    qkv = rng.standard_normal((2, 100, 6 * 32)).astype(np.float32)
    dout = rng.standard_normal((2, 100, 2 * 32)).astype(np.float32)
    for passes in (1, 2):
        old = attention.set_backward_passes(passes)
        try:
            written = run(qkv, dout, 2, 2)[2]
            added = run(qkv, dout, 2, 2, overwrite=False)[2]
        finally:
            attention.set_backward_passes(old)
        np.testing.assert_array_equal(written, added)


def test_unknown_precision_is_refused():
    qkv = np.zeros((1, 4, 6 * 8), np.float32)
    out, lse = np.empty((1, 4, 16), np.float32), np.empty((1, 2, 4), np.float32)
    for call in (lambda: attention_forward(out, lse, qkv, 2, precision="fp16"),
                 lambda: attention_backward(np.zeros_like(qkv), out, qkv, out, lse, 2,
                                            precision="bfloat16"),
                 lambda: attention_forward_naive(out, lse, qkv, 2, precision="fp64")):
        with pytest.raises(ValueError, match="precision must be one of"):
            call()


def test_nn_attention_follows_the_precision():
    # Under set_precision("bf16") nn.attention and its gradient are the bf16 kernels',
    # the backward in the forward's precision even if it changed in between.
    from adtape import nn
    from adtape.tensor import Tensor
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((2, 70, 4 * 16)).astype(np.float32)
    dout = rng.standard_normal((2, 70, 2 * 16)).astype(np.float32)
    out, _, dqkv = run(qkv, dout, 2, 1)
    old = nn.set_precision("bf16")
    try:
        x = Tensor(qkv.copy(), requires_grad=True)
        y = nn.attention(x, 2, 1)
        nn.set_precision("fp32")
        y.backward(seed=dout)
    finally:
        nn.set_precision(old)
    np.testing.assert_array_equal(np.asarray(y.data), out)
    np.testing.assert_array_equal(np.asarray(x.grad), dqkv)


@pytest.mark.parametrize("B,T,NH,NKV,hs", [(2, 37, 2, 1, 16), (1, 130, 2, 2, 64),
                                             (2, 200, 4, 2, 32), (1, 5, 2, 1, 3)])
def test_qkv_held_in_bf16_gives_the_float32_qkvs_bits(B, T, NH, NKV, hs, bf16_path):
    # What nn keeps on the tape under bf16: qkv rounded once (kernels.bf16.to_bf16), which
    # the kernels read as they are, in both backwards.
    rng = np.random.default_rng(T + hs)
    qkv = rng.standard_normal((B, T, (NH + 2 * NKV) * hs)).astype(np.float32)
    dout = rng.standard_normal((B, T, NH * hs)).astype(np.float32)
    q16 = np.empty(qkv.shape, np.uint16)
    bf16.to_bf16(q16, qkv)
    for passes in (1, 2):
        old = attention.set_backward_passes(passes)
        try:
            for a, b in zip(run(qkv, dout, NH, NKV), run(q16, dout, NH, NKV)):
                np.testing.assert_array_equal(a, b)
        finally:
            attention.set_backward_passes(old)


def test_qkv_in_bf16_takes_precision_bf16():
    q16 = np.zeros((1, 4, 6 * 8), np.uint16)
    out, lse = np.empty((1, 4, 16), np.float32), np.empty((1, 2, 4), np.float32)
    with pytest.raises(TypeError, match="qkv is bf16"):
        attention_forward(out, lse, q16, 2)
    with pytest.raises(TypeError, match="qkv is bf16"):
        attention_backward(np.zeros(q16.shape, np.float32), out, q16, out, lse, 2)
    with pytest.raises(TypeError, match="qkv must be an aligned native float32"):
        attention_forward(out, lse, q16.astype(np.int32), 2, precision="bf16")


def test_nn_keeps_qkv_in_bf16_under_bf16(monkeypatch):
    # Half the bytes on the tape: the attention records its qkv rounded to bf16, and its
    # backward reads that.
    from adtape import nn
    from adtape.tensor import Tensor
    qkv = np.random.default_rng(2).standard_normal((1, 20, 3 * 16)).astype(np.float32)
    dout = np.random.default_rng(3).standard_normal((1, 20, 16)).astype(np.float32)
    read = []
    backward = nn._attention.attention_backward

    def spy(dqkv, g, q, *args, **kwargs):
        read.append(q.dtype)
        return backward(dqkv, g, q, *args, **kwargs)
    monkeypatch.setattr(nn._attention, "attention_backward", spy)
    grads = {}
    for precision in ("fp32", "bf16"):
        old = nn.set_precision(precision)
        try:
            x = Tensor(qkv.copy(), requires_grad=True)
            nn.attention(x, 1).backward(seed=dout)
            grads[precision] = np.asarray(x.grad)
        finally:
            nn.set_precision(old)
    assert read == [np.float32, np.uint16]
    np.testing.assert_array_equal(grads["bf16"], run(qkv, dout, 1, 1)[2])
