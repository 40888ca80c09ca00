"""kernels.optim against its naive twins, torch.optim.AdamW and clip_grad_norm_."""
import numpy as np
import pytest
import torch

from kernels import optim

SIZES = [1, 7, 16384, 16387, 100003]


def close(actual, expected, rtol):
    expected = np.asarray(expected, dtype=np.float64)
    np.testing.assert_allclose(actual, expected, rtol=rtol,
                               atol=rtol * max(np.abs(expected).max(initial=0.0), 1e-30))


def rand(rng, n, scale=1.0):
    return (rng.standard_normal(n) * scale).astype(np.float32)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_matches_torch_and_naive_over_steps(n, weight_decay):
    rng = np.random.default_rng(1)
    params = rand(rng, n, 0.02)
    tparam = torch.nn.Parameter(torch.tensor(params))
    opt = torch.optim.AdamW([tparam], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=weight_decay)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    params_n, m_n, v_n = params.copy(), m.copy(), v.copy()
    for step in range(1, 6):
        grads = rand(rng, n, 10.0 ** -step)  # shrinking gradients exercise eps and v's memory
        tparam.grad = torch.tensor(grads)
        opt.step()
        optim.adamw_step(params, grads, m, v, step, 1e-3, weight_decay=weight_decay)
        optim.adamw_step_naive(params_n, grads, m_n, v_n, step, 1e-3, weight_decay=weight_decay)
        state = opt.state[tparam]
        close(params, tparam.detach().numpy(), 1e-5)
        close(m, state["exp_avg"].numpy(), 1e-5)
        close(v, state["exp_avg_sq"].numpy(), 1e-5)
        close(params, params_n, 1e-5)
        close(m, m_n, 1e-5)


def test_adamw_hyperparameters_follow_torch():
    rng = np.random.default_rng(2)
    n = 1000
    params, grads = rand(rng, n), rand(rng, n)
    tparam = torch.nn.Parameter(torch.tensor(params))
    opt = torch.optim.AdamW([tparam], lr=0.05, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.5)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for step in range(1, 4):
        tparam.grad = torch.tensor(grads)
        opt.step()
        optim.adamw_step(params, grads, m, v, step, 0.05, beta1=0.8, beta2=0.95, eps=1e-3,
                         weight_decay=0.5)
    close(params, tparam.detach().numpy(), 1e-5)


def test_adamw_one_and_two_threads_identical():
    rng = np.random.default_rng(3)
    n = 100003
    start = [rand(rng, n), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    grads = rand(rng, n)
    results = []
    for n_threads in (1, 2):
        p, m, v = (a.copy() for a in start)
        for step in (1, 2):
            optim.adamw_step(p, grads, m, v, step, 1e-3, weight_decay=0.1, n_threads=n_threads)
        results.append((p, m, v))
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)


def test_adamw_rejects_bad_arguments():
    n = 10
    p, g, m, v = (np.zeros(n, np.float32) for _ in range(4))
    with pytest.raises(ValueError, match="step"):
        optim.adamw_step(p, g, m, v, 0, 1e-3)
    with pytest.raises(ValueError, match="step"):
        optim.adamw_step(p, g, m, v, 1.0, 1e-3)
    with pytest.raises(ValueError, match="beta1"):
        optim.adamw_step(p, g, m, v, 1, 1e-3, beta1=1.0)
    with pytest.raises(ValueError, match="lr"):
        optim.adamw_step(p, g, m, v, 1, -1e-3)
    with pytest.raises(ValueError, match="weight_decay"):
        optim.adamw_step(p, g, m, v, 1, 1e-3, weight_decay=float("nan"))
    with pytest.raises(ValueError, match="grads"):
        optim.adamw_step(p, np.zeros(n + 1, np.float32), m, v, 1, 1e-3)
    with pytest.raises(TypeError, match="m must"):
        optim.adamw_step(p, g, m.astype(np.float64), v, 1, 1e-3)
    with pytest.raises(ValueError, match="params"):
        optim.adamw_step(p.reshape(2, 5), g, m, v, 1, 1e-3)
    with pytest.raises(ValueError, match="C-contiguous"):
        optim.adamw_step(np.zeros(2 * n, np.float32)[::2], g, m, v, 1, 1e-3)
    with pytest.raises(ValueError, match="m overlaps v"):
        optim.adamw_step(p, g, m, m, 1, 1e-3)


@pytest.mark.parametrize("n", SIZES)
def test_grad_norm_in_float64(n):
    rng = np.random.default_rng(4)
    grads = rand(rng, n)
    expected = np.sqrt(np.sum(grads.astype(np.float64) ** 2))
    assert optim.grad_norm(grads) == pytest.approx(expected, rel=1e-12)
    assert optim.grad_norm_naive(grads) == pytest.approx(expected, rel=1e-12)
    assert optim.grad_norm(grads, n_threads=1) == optim.grad_norm(grads, n_threads=2)
    assert optim.grad_norm(np.zeros(0, np.float32)) == 0.0


def test_grad_norm_blocks_alone_or_paired():
    # The blocks of 16384 go in pairs, k with k + n_blocks // 2, read side by side,
    # the last alone when their number is odd; a block's sum must not depend on
    # its partner.  Each block here holds one nonzero value, so the norm of the
    # whole is exact in float64 and every block can be checked on its own.
    B = 16384
    for n_blocks, tail in ((1, 0), (2, 0), (3, 0), (4, 7), (5, B - 1), (6, 17), (7, 1)):
        n = (n_blocks - 1) * B + (tail or B)
        grads = np.zeros(n, np.float32)
        grads[::B] = 2.0 ** np.arange(n_blocks, dtype=np.float32)
        grads[-1] += 3.0
        expected = np.sqrt(np.sum(grads.astype(np.float64) ** 2))
        assert optim.grad_norm(grads) == expected, (n_blocks, tail)
    # random values: the same sum as blocks summed one by one
    rng = np.random.default_rng(11)
    grads = rand(rng, 5 * B + 123)
    per_block = [optim.grad_norm(grads[k:k + B]) ** 2 for k in range(0, grads.size, B)]
    assert optim.grad_norm(grads) == pytest.approx(np.sqrt(sum(per_block)), rel=1e-15)


def test_grad_norm_float64_accumulation_matters():
    # 2^24 + many ones: a float32 running sum would stop growing at 2^24.
    grads = np.ones(3 * 16384 + 5, np.float32)
    grads[0] = 4096.0  # 4096^2 = 2^24
    expected = np.sqrt(2.0**24 + grads.size - 1)
    assert optim.grad_norm(grads) == pytest.approx(expected, rel=1e-14)


@pytest.mark.parametrize("max_norm", [0.5, 1e6, 0.0])
def test_clip_grad_norm_matches_torch(max_norm):
    rng = np.random.default_rng(5)
    grads = rand(rng, 50001, 0.01)
    tparam = torch.nn.Parameter(torch.zeros(grads.size))
    tparam.grad = torch.tensor(grads)
    expected_norm = torch.nn.utils.clip_grad_norm_([tparam], max_norm).item()
    grads_n = grads.copy()
    norm = optim.clip_grad_norm(grads, max_norm)
    assert norm == pytest.approx(expected_norm, rel=1e-5)
    close(grads, tparam.grad.numpy(), 1e-5)
    assert optim.clip_grad_norm_naive(grads_n, max_norm) == pytest.approx(norm, rel=1e-12)
    close(grads_n, grads, 1e-6)
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_grad_norm(grads, -1.0)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_zero_grad_large_unaligned_pieces(n_threads):
    # Pieces of 1 MiB and more are zeroed with streamed stores after an unaligned
    # head: every float of the slice becomes 0 and its neighbours keep their values.
    rng = np.random.default_rng(7)
    for offset, n in ((0, 1 << 20), (1, (1 << 19) + 7), (5, 3 * (1 << 18) + 13)):
        buf = rng.standard_normal(n + offset + 9).astype(np.float32) + 10.0
        before = buf.copy()
        optim.zero_grad(buf[offset:offset + n], n_threads=n_threads)
        np.testing.assert_array_equal(buf[offset:offset + n], 0.0)
        np.testing.assert_array_equal(buf[:offset], before[:offset])
        np.testing.assert_array_equal(buf[offset + n:], before[offset + n:])


def test_zero_grad_any_shape():
    rng = np.random.default_rng(6)
    for shape in [(0,), (1,), (3, 5, 16387)]:
        grads = rng.standard_normal(shape).astype(np.float32)
        optim.zero_grad(grads)
        np.testing.assert_array_equal(grads, 0.0)
        grads_n = rng.standard_normal(shape).astype(np.float32)
        optim.zero_grad_naive(grads_n)
        np.testing.assert_array_equal(grads_n, 0.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        optim.zero_grad(np.zeros((4, 4), np.float32)[:, ::2])
    with pytest.raises(TypeError, match="grads"):
        optim.zero_grad(np.zeros(4, np.float64))
    frozen = np.zeros(4, np.float32)
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match="writable"):
        optim.zero_grad(frozen)


@pytest.mark.parametrize("n", [7, 100003])
@pytest.mark.parametrize("zero_grads", [False, True])
def test_adamw_grad_scale_equals_scaling_the_gradients_first(n, zero_grads):
    # grad_scale multiplies each gradient as AdamW reads it, in float32, exactly as
    # clip_grad_norm's in-place scaling would: the results agree to the bit.
    rng = np.random.default_rng(5)
    params, grads = rand(rng, n, 0.02), rand(rng, n, 3.0)
    m, v = rand(rng, n, 0.01), np.abs(rand(rng, n, 0.01))
    p2, m2, v2, p3, m3, v3 = params.copy(), m.copy(), v.copy(), params.copy(), m.copy(), v.copy()
    g1 = grads.copy()
    max_norm = 0.5
    norm = optim.grad_norm(g1)
    coef = optim.clip_coefficient(norm, max_norm)
    assert coef == pytest.approx(max_norm / (norm + 1e-6)) and coef < 1
    optim.adamw_step(params, g1, m, v, 3, 1e-3, weight_decay=0.1, grad_scale=coef,
                     zero_grads=zero_grads)
    g2 = grads.copy()
    assert optim.clip_grad_norm(g2, max_norm) == norm
    optim.adamw_step(p2, g2, m2, v2, 3, 1e-3, weight_decay=0.1)
    for a, b in ((params, p2), (m, m2), (v, v2)):
        np.testing.assert_array_equal(a, b)
    if zero_grads:
        assert not g1.any()
    else:
        np.testing.assert_array_equal(g1, grads)       # read, not rewritten
    optim.adamw_step_naive(p3, grads.copy(), m3, v3, 3, 1e-3, weight_decay=0.1,
                           grad_scale=coef)
    close(params, p3, 1e-6)
    close(m, m3, 1e-6)
    close(v, v3, 1e-6)


def test_clip_coefficient_and_grad_scale_checks():
    assert optim.clip_coefficient(0.5, 1.0) == 1.0
    assert optim.clip_coefficient(4.0, 1.0) == pytest.approx(0.25, rel=1e-6)
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_coefficient(1.0, float("nan"))
    n = 10
    args = [np.zeros(n, np.float32) for _ in range(4)]
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="grad_scale"):
            optim.adamw_step(*args, 1, 1e-3, grad_scale=bad)
        with pytest.raises(ValueError, match="grad_scale"):
            optim.adamw_step_naive(*args, 1, 1e-3, grad_scale=bad)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 1])
def test_adamw_writes_the_bf16_rounding_of_its_result(n, offset):
    # out_bf16: the updated parameters rounded to bf16 in the same pass, kernels.bf16's
    # bits (streamed in whole 16-byte runs, the edges and an unaligned array plainly);
    # the update itself unchanged, on one thread and on two
    from kernels import bf16
    rng = np.random.default_rng(7)
    arrays = [rand(rng, n, 0.02), rand(rng, n), rand(rng, n, 0.1), np.abs(rand(rng, n, 0.01))]
    plain = [a.copy() for a in arrays]
    optim.adamw_step(*plain, 3, 1e-3, weight_decay=0.1, grad_scale=0.5)
    expected = np.empty(n, np.uint16)
    bf16.to_bf16(expected, plain[0])
    for nt in (1, 2):
        fused = [a.copy() for a in arrays]
        out = np.full(n + offset, 0xFFFF, np.uint16)[offset:]
        optim.adamw_step(*fused, 3, 1e-3, weight_decay=0.1, grad_scale=0.5, out_bf16=out,
                         n_threads=nt)
        for a, b in zip(fused, plain):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(out, expected)


def test_adamw_bf16_output_is_checked():
    n = 64
    p, g, m, v = (np.zeros(n, np.float32) for _ in range(4))
    with pytest.raises(TypeError, match="out_bf16"):
        optim.adamw_step(p, g, m, v, 1, 1e-3, out_bf16=np.zeros(n, np.float32))
    with pytest.raises(ValueError, match="out_bf16"):
        optim.adamw_step(p, g, m, v, 1, 1e-3, out_bf16=np.zeros(n - 1, np.uint16))
    with pytest.raises(ValueError, match="out_bf16"):
        optim.adamw_step(p, g, m, v, 1, 1e-3, out_bf16=p.view(np.uint16)[:n])
