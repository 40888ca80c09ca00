"""Grouped-query causal attention (n_kv_head < n_head, Llama's): the kernels against
PyTorch in float64, Hugging Face's repeat_kv written out and SDPA's enable_gqa, against
their naive twin, and through adtape.nn's attention ops.

qkv is [q heads | k heads | v heads]: (B, T, (n_head + 2 n_kv_head) hs); query head h
reads kv head h // (n_head // n_kv_head)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adtape import nn
from adtape.tensor import Tensor
from kernels import threads
from kernels.attention import (attention_backward, attention_backward_naive,
                               attention_forward, attention_forward_naive, set_backward_passes)

NH = 6                          # divisible by every n_kv_head below
KV_HEADS = [1, 2, 3, NH]        # multi-query, two groups, three, GPT-2's multi-head
# T = 1 and 2, odd, around the 64-row query and key blocks, and past two of them.
LENGTHS = [1, 2, 17, 63, 64, 65, 200]


def rel_err(actual, expected):
    """Largest absolute error relative to the largest magnitude in ``expected``."""
    scale = max(float(np.abs(expected).max()), 1e-30)
    return float(np.abs(np.asarray(actual, np.float64) - expected).max()) / scale


def make(rng, B, T, n_head, n_kv_head, hs, dtype=np.float32):
    """qkv (B, T, (n_head + 2 n_kv_head) hs) and dout (B, T, n_head hs)."""
    return (rng.standard_normal((B, T, (n_head + 2 * n_kv_head) * hs)).astype(dtype),
            rng.standard_normal((B, T, n_head * hs)).astype(dtype))


def run_forward(forward, qkv, n_head, n_kv_head, **kw):
    B, T, W = qkv.shape
    hs = W // (n_head + 2 * (n_kv_head or n_head))
    out = np.full((B, T, n_head * hs), np.nan, qkv.dtype)
    lse = np.full((B, n_head, T), np.nan, qkv.dtype)
    forward(out, lse, qkv, n_head, n_kv_head=n_kv_head, **kw)
    return out, lse


def run_backward(backward, dout, qkv, out, lse, n_head, n_kv_head, fill=0.0, **kw):
    dqkv = np.full(qkv.shape, fill, qkv.dtype)
    backward(dqkv, dout, qkv, out, lse, n_head, n_kv_head=n_kv_head, **kw)
    return dqkv


def _split(x, n_head, n_kv_head):
    """q (B, n_head, T, hs), k and v (B, n_kv_head, T, hs) views of a torch qkv."""
    B, T, W = x.shape
    hs = W // (n_head + 2 * n_kv_head)
    q, k, v = x.split([n_head * hs, n_kv_head * hs, n_kv_head * hs], dim=2)
    return (q.view(B, T, n_head, hs).transpose(1, 2),
            k.view(B, T, n_kv_head, hs).transpose(1, 2),
            v.view(B, T, n_kv_head, hs).transpose(1, 2))


def repeat_kv(hidden, n_rep):
    """Hugging Face's repeat_kv (modeling_llama): (B, n_kv, T, hs) -> (B, n_kv n_rep, T,
    hs), each kv head repeated n_rep times in place along the head axis."""
    B, n_kv, T, hs = hidden.shape
    return hidden[:, :, None, :, :].expand(B, n_kv, n_rep, T, hs).reshape(B, n_kv * n_rep, T, hs)


def torch_oracle(qkv, dout, n_head, n_kv_head, how):
    """out, lse and dqkv in float64 from torch autograd: ``how`` is "repeat_kv" (the
    causal softmax written out over Hugging Face's repeated k and v) or "sdpa"
    (F.scaled_dot_product_attention with enable_gqa)."""
    B, T, W = qkv.shape
    hs = W // (n_head + 2 * n_kv_head)
    x = torch.from_numpy(qkv.astype(np.float64)).requires_grad_()
    q, k, v = _split(x, n_head, n_kv_head)
    rep = n_head // n_kv_head
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    scores = q @ repeat_kv(k, rep).transpose(-1, -2) / hs ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    if how == "repeat_kv":
        out = torch.softmax(scores, dim=-1) @ repeat_kv(v, rep)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = out.transpose(1, 2).reshape(B, T, n_head * hs)
    out.backward(torch.from_numpy(dout.astype(np.float64)))
    return (out.detach().numpy(), torch.logsumexp(scores, dim=-1).detach().numpy(),
            x.grad.numpy())


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("n_kv_head", KV_HEADS)
@pytest.mark.parametrize("hs", [64, 128])
def test_matches_torch_repeat_kv_and_sdpa(B, T, n_kv_head, hs, vector_lanes):
    rng = np.random.default_rng(1000 * T + 10 * n_kv_head + B + hs)
    qkv, dout = make(rng, B, T, NH, n_kv_head, hs)
    out, lse = run_forward(attention_forward, qkv, NH, n_kv_head)
    dqkv = run_backward(attention_backward, dout, qkv, out, lse, NH, n_kv_head)
    for how in ("repeat_kv", "sdpa"):
        out_t, lse_t, dqkv_t = torch_oracle(qkv, dout, NH, n_kv_head, how)
        assert rel_err(out, out_t) < 1e-5, how
        assert rel_err(lse, lse_t) < 1e-5, how
        assert rel_err(dqkv, dqkv_t) < 1e-4, how


@pytest.mark.parametrize("B,T,n_kv_head,hs", [(3, 17, 1, 64), (3, 65, 2, 64), (1, 200, 3, 64),
                                              (2, 64, 2, 128), (1, 63, 3, 128),
                                              (1, 1, 1, 64), (2, 2, 3, 128), (2, 33, 2, 5)])
def test_kernel_equals_naive_twin_and_float64_twin_equals_torch(B, T, n_kv_head, hs,
                                                               vector_lanes):
    # Head size 5: the lanes' tails in every product (the models have 64).
    rng = np.random.default_rng(T + n_kv_head)
    qkv, dout = make(rng, B, T, NH, n_kv_head, hs)
    out, lse = run_forward(attention_forward, qkv, NH, n_kv_head)
    out_n, lse_n = run_forward(attention_forward_naive, qkv, NH, n_kv_head)
    assert rel_err(out, out_n) < 1e-5
    assert rel_err(lse, lse_n) < 1e-5
    dqkv = run_backward(attention_backward, dout, qkv, out, lse, NH, n_kv_head)
    dqkv_n = run_backward(attention_backward_naive, dout, qkv, out, lse, NH, n_kv_head)
    assert rel_err(dqkv, dqkv_n) < 1e-5
    q64, d64 = qkv.astype(np.float64), dout.astype(np.float64)
    out64, lse64 = run_forward(attention_forward_naive, q64, NH, n_kv_head)
    dqkv64 = run_backward(attention_backward_naive, d64, q64, out64, lse64, NH, n_kv_head)
    out_t, lse_t, dqkv_t = torch_oracle(qkv, dout, NH, n_kv_head, "repeat_kv")
    assert rel_err(out64, out_t) < 1e-12
    assert rel_err(lse64, lse_t) < 1e-12
    assert rel_err(dqkv64, dqkv_t) < 1e-12


@pytest.mark.parametrize("naive,T", [pytest.param(naive, T, id=f"{name}-T{T}")
                                     for naive, name, lengths in ((False, "kernel", (1, 65, 200)),
                                                                  (True, "naive", (1, 65)))
                                     for T in lengths])
@pytest.mark.parametrize("n_kv_head", [1, 2, 3])
def test_overwrite_equals_adding_into_zeros(n_kv_head, naive, T, vector_lanes):
    # A kv head's dk and dv are written by its group's first query head and added to
    # by the others: NaN left in dqkv must not reach the result.
    forward = attention_forward_naive if naive else attention_forward
    backward = attention_backward_naive if naive else attention_backward
    rng = np.random.default_rng(200 + T + n_kv_head)
    qkv, dout = make(rng, 2, T, NH, n_kv_head, 64)
    out, lse = run_forward(forward, qkv, NH, n_kv_head)
    added = run_backward(backward, dout, qkv, out, lse, NH, n_kv_head)
    written = run_backward(backward, dout, qkv, out, lse, NH, n_kv_head, fill=np.nan,
                           overwrite=True)
    np.testing.assert_array_equal(written, added)


def test_backward_accumulates(vector_lanes):
    rng = np.random.default_rng(5)
    qkv, dout = make(rng, 2, 70, NH, 2, 64)
    out, lse = run_forward(attention_forward, qkv, NH, 2)
    fresh = run_backward(attention_backward, dout, qkv, out, lse, NH, 2)
    prefilled = run_backward(attention_backward, dout, qkv, out, lse, NH, 2, fill=2.5)
    assert rel_err(prefilled - 2.5, fresh) < 1e-6
    twice = fresh.copy()
    attention_backward(twice, dout, qkv, out, lse, NH, n_kv_head=2)
    assert rel_err(twice, 2 * fresh) < 1e-6


@pytest.mark.parametrize("B,n_kv_head", [(3, 1), (1, 3), (2, 2), (3, 3)])
def test_one_and_two_threads_agree(B, n_kv_head, vector_lanes):
    # The forward's tasks are (batch, query head), each thread packing K and V again
    # only where its kv head changes; the backward's are (batch, kv head), adding the
    # group's query heads in order: the bits do not depend on the thread count (nor on
    # which tasks share a thread; B * n_kv_head = 3 splits a group's heads unevenly).
    rng = np.random.default_rng(6)
    qkv, dout = make(rng, B, 70, NH, n_kv_head, 64)
    results = []
    previous = threads.get_num_threads()
    try:
        for n in (1, 2):
            threads.set_num_threads(n)
            out, lse = run_forward(attention_forward, qkv, NH, n_kv_head, n_threads=n)
            results.append((out, lse, run_backward(attention_backward, dout, qkv, out, lse,
                                                   NH, n_kv_head, n_threads=n)))
    finally:
        threads.set_num_threads(previous)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("B,T,n_kv_head,hs", [(1, 200, 1, 64), (2, 65, 2, 64), (1, 130, 3, 128),
                                              (3, 64, 6, 64), (1, 1, 1, 64), (2, 33, 2, 5),
                                              (1, 129, 2, 16)])
@pytest.mark.parametrize("overwrite", [False, True])
def test_two_passes_give_the_one_pass_bits(B, T, n_kv_head, hs, overwrite, vector_lanes):
    # Where (batch, kv head) tasks are fewer than the threads, the backward runs in two
    # passes (key blocks' dk and dv, then query blocks' dq), recomputing the tiles: each
    # element sums the same terms in the same order, so the bits are the one pass's, at
    # any thread count, and NaN left in dqkv under overwrite reaches nothing.
    rng = np.random.default_rng(300 + T + n_kv_head + hs)
    qkv, dout = make(rng, B, T, NH, n_kv_head, hs)
    out, lse = run_forward(attention_forward, qkv, NH, n_kv_head)
    fill = np.nan if overwrite else 0.5
    results = {}
    try:
        for mode in (1, 2):
            set_backward_passes(mode)
            for n in (1, 2):
                results[mode, n] = run_backward(attention_backward, dout, qkv, out, lse, NH,
                                                n_kv_head, fill=fill, overwrite=overwrite,
                                                n_threads=n)
    finally:
        set_backward_passes(0)
    for key, dqkv in results.items():
        np.testing.assert_array_equal(dqkv, results[1, 1], err_msg=str(key))
    naive = run_backward(attention_backward_naive, dout, qkv, out, lse, NH, n_kv_head,
                         fill=0.0 if overwrite else 0.5)
    assert rel_err(results[2, 2], naive) < 1e-5


def test_backward_passes_mode_is_checked():
    with pytest.raises(ValueError, match="mode must be 0, 1 or 2"):
        set_backward_passes(3)
    assert set_backward_passes(0) == 0


@pytest.mark.parametrize("naive", [False, True], ids=["kernel", "naive"])
def test_n_kv_head_equal_to_n_head_is_the_default(naive):
    # GPT-2's layout: the same bits with n_kv_head = n_head as without it.
    forward = attention_forward_naive if naive else attention_forward
    backward = attention_backward_naive if naive else attention_backward
    rng = np.random.default_rng(7)
    qkv, dout = make(rng, 2, 33, NH, NH, 16)
    results = []
    for n_kv_head in (None, NH):
        out, lse = run_forward(forward, qkv, NH, n_kv_head)
        results.append((out, lse, run_backward(backward, dout, qkv, out, lse, NH, n_kv_head)))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("naive", [False, True], ids=["kernel", "naive"])
def test_bad_head_splits_raise_clear_errors(naive):
    forward = attention_forward_naive if naive else attention_forward
    backward = attention_backward_naive if naive else attention_backward
    rng = np.random.default_rng(8)
    hs = 4
    qkv, dout = make(rng, 2, 5, NH, 2, hs)            # width (6 + 4) * 4 = 40
    out, lse = run_forward(forward, qkv, NH, 2)
    dqkv = np.zeros_like(qkv)
    with pytest.raises(ValueError, match=r"n_kv_head = 4 does not divide n_head = 6"):
        forward(out, lse, qkv, NH, n_kv_head=4)
    with pytest.raises(ValueError, match=r"n_kv_head = 4 does not divide n_head = 6"):
        backward(dqkv, dout, qkv, out, lse, NH, n_kv_head=4)
    for bad in (0, -2, 2.0, True, "2"):
        with pytest.raises(ValueError, match="n_kv_head must be a positive integer"):
            forward(out, lse, qkv, NH, n_kv_head=bad)
        with pytest.raises(ValueError, match="n_kv_head must be a positive integer"):
            backward(dqkv, dout, qkv, out, lse, NH, n_kv_head=bad)
    # The qkv of another split: its width is not (n_head + 2 n_kv_head) head sizes.
    with pytest.raises(ValueError, match=r"qkv's last dimension 40 must be \(n_head \+ "
                                         r"2\*n_kv_head\) \* head_size = 12 \* head_size"):
        forward(out, lse, qkv, NH, n_kv_head=3)
    with pytest.raises(ValueError, match=r"qkv's last dimension 40 .* = 18 \* head_size"):
        forward(out, lse, qkv, NH)                    # n_kv_head forgotten
    with pytest.raises(ValueError, match=r"qkv's last dimension 39"):
        forward(out, lse, qkv[:, :, :39].copy(), NH, n_kv_head=2)
    # A width that divides, but for another head size than out's: out (and dout, and
    # dqkv) are named with the shape they must have.
    with pytest.raises(ValueError, match=r"out must have shape \(2, 5, 20\)"):
        forward(out, lse, qkv, 2, n_kv_head=1)        # 40 = (2 + 2) * 10
    wide = np.zeros((2, 5, 80), np.float32)           # (6 + 4) * 8
    with pytest.raises(ValueError, match=r"out must have shape \(2, 5, 48\)"):
        forward(out, lse, wide, NH, n_kv_head=2)
    with pytest.raises(ValueError, match=r"dout must have shape \(2, 5, 48\)"):
        backward(np.zeros_like(wide), dout, wide, out, lse, NH, n_kv_head=2)
    with pytest.raises(ValueError, match=r"dqkv must have shape \(2, 5, 40\)"):
        backward(np.zeros((2, 5, 72), np.float32), dout, qkv, out, lse, NH, n_kv_head=2)
    # lse has a row per query head, not per kv head.
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 6, 5\)"):
        forward(out, np.zeros((2, 2, 5), np.float32), qkv, NH, n_kv_head=2)


def _nn_grads(qkv0, dout, n_kv_head, fused, w0=None):
    q = Tensor(qkv0.copy(), requires_grad=True)
    if fused:
        w = Tensor(w0.copy(), requires_grad=True)
        out = nn.attention_linear(q, NH, w, None, n_kv_head=n_kv_head)
    else:
        out = nn.attention(q, NH, n_kv_head=n_kv_head)
    out.backward(seed=dout)
    return out.data, q.grad, (w.grad if fused else None)


@pytest.mark.parametrize("n_kv_head", [1, 2, 3])
def test_nn_attention_gradient_is_the_kernels_and_torchs(n_kv_head):
    rng = np.random.default_rng(9)
    B, T, hs = 2, 65, 64
    qkv, dout = make(rng, B, T, NH, n_kv_head, hs)
    out, lse = run_forward(attention_forward, qkv, NH, n_kv_head)
    dqkv = run_backward(attention_backward, dout, qkv, out, lse, NH, n_kv_head)
    out_ad, dqkv_ad, _ = _nn_grads(qkv, dout, n_kv_head, fused=False)
    np.testing.assert_array_equal(out_ad, out)
    np.testing.assert_array_equal(dqkv_ad, dqkv)
    out_t, _, dqkv_t = torch_oracle(qkv, dout, NH, n_kv_head, "sdpa")
    assert rel_err(out_ad, out_t) < 1e-5
    assert rel_err(dqkv_ad, dqkv_t) < 1e-4


@pytest.mark.parametrize("n_kv_head", [1, 3])
def test_nn_attention_linear_is_linear_of_attention_and_torch(n_kv_head):
    rng = np.random.default_rng(10)
    B, T, hs = 2, 40, 64
    qkv, _ = make(rng, B, T, NH, n_kv_head, hs)
    w0 = (0.1 * rng.standard_normal((32, NH * hs))).astype(np.float32)
    seed = rng.standard_normal((B, T, 32)).astype(np.float32)
    out_f, dqkv_f, dw_f = _nn_grads(qkv, seed, n_kv_head, fused=True, w0=w0)
    q, w = Tensor(qkv.copy(), requires_grad=True), Tensor(w0.copy(), requires_grad=True)
    out_u = nn.linear(nn.attention(q, NH, n_kv_head=n_kv_head), w)
    out_u.backward(seed=seed)
    np.testing.assert_array_equal(out_f, out_u.data)
    np.testing.assert_array_equal(dqkv_f, q.grad)
    np.testing.assert_array_equal(dw_f, w.grad)
    x = torch.from_numpy(qkv.astype(np.float64)).requires_grad_()
    wt = torch.from_numpy(w0.astype(np.float64)).requires_grad_()
    a = F.scaled_dot_product_attention(*_split(x, NH, n_kv_head), is_causal=True,
                                       enable_gqa=True).transpose(1, 2).reshape(B, T, NH * hs)
    F.linear(a, wt).backward(torch.from_numpy(seed.astype(np.float64)))
    assert rel_err(dqkv_f, x.grad.numpy()) < 1e-4
    assert rel_err(dw_f, wt.grad.numpy()) < 1e-4


def test_nn_ops_name_themselves_in_a_bad_split():
    qkv = Tensor(np.zeros((1, 3, 40), np.float32), requires_grad=True)
    with pytest.raises(ValueError, match="^attention: n_kv_head = 4 does not divide"):
        nn.attention(qkv, NH, n_kv_head=4)
    with pytest.raises(ValueError, match="^attention_linear: qkv's last dimension 40"):
        nn.attention_linear(qkv, NH, Tensor(np.zeros((8, 24), np.float32)), n_kv_head=3)
