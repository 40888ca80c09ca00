"""Tensor-mode AD: finite-difference checks of every op (broadcasting included),
the API (backward, grad, value_and_grad, no_grad, .grad accumulation), the VJP
registry, bad use, and a 10^5-op chain."""
import numpy as np
import pytest

import adtape as ad
from adtape.tensor import Tensor

RNG = np.random.default_rng(1234)


def randn(*shape):
    return RNG.standard_normal(shape)


def positive(*shape):
    return RNG.uniform(0.5, 2.0, shape)


# (name, function of Tensors, argument arrays); shapes cross broadcasting cases.
BINARY_SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((3, 1), (1, 4)), ((2, 3, 4), (3, 1)),
                 ((), (2, 3)), ((4,), ())]
OP_CASES = []
for sx, sy in BINARY_SHAPES:
    OP_CASES += [
        (f"add{sx}{sy}", lambda x, y: x + y, (randn(*sx), randn(*sy))),
        (f"sub{sx}{sy}", lambda x, y: x - y, (randn(*sx), randn(*sy))),
        (f"mul{sx}{sy}", lambda x, y: x * y, (randn(*sx), randn(*sy))),
        (f"div{sx}{sy}", lambda x, y: x / y, (randn(*sx), positive(*sy))),
        (f"pow{sx}{sy}", lambda x, y: x ** y, (positive(*sx), randn(*sy))),
    ]
OP_CASES += [
    ("radd", lambda x: 2.5 + x, (randn(3, 2),)),
    ("rsub", lambda x: 2.5 - x, (randn(3, 2),)),
    ("rmul", lambda x: 2.5 * x, (randn(3, 2),)),
    ("rdiv", lambda x: 2.5 / x, (positive(3, 2),)),
    ("pow_const", lambda x: x ** 3.0, (randn(3, 2),)),
    ("rpow", lambda x: 1.7 ** x, (randn(3, 2),)),
    ("neg", lambda x: -x, (randn(3, 2),)),
    ("exp", ad.exp, (randn(3, 2),)),
    ("log", ad.log, (positive(3, 2),)),
    ("tanh", ad.tanh, (randn(3, 2),)),
    ("sum_all", lambda x: x.sum(), (randn(3, 4),)),
    ("sum_axis", lambda x: x.sum(axis=1), (randn(3, 4),)),
    ("sum_axes_keep", lambda x: x.sum(axis=(0, 2), keepdims=True), (randn(2, 3, 4),)),
    ("mean_all", lambda x: x.mean(), (randn(3, 4),)),
    ("mean_axis", lambda x: x.mean(axis=0), (randn(3, 4),)),
    ("mean_neg_axis_keep", lambda x: x.mean(axis=-1, keepdims=True), (randn(3, 4),)),
    ("reshape", lambda x: x.reshape(4, 3) * np.arange(12.0).reshape(4, 3), (randn(3, 4),)),
    ("reshape_tuple", lambda x: x.reshape((2, -1)), (randn(3, 4),)),
    ("transpose", lambda x: x.T * np.arange(12.0).reshape(4, 3), (randn(3, 4),)),
    ("transpose_axes", lambda x: x.transpose(2, 0, 1), (randn(2, 3, 4),)),
    ("getitem_slice", lambda x: x[1:, ::2], (randn(3, 4),)),
    ("getitem_int", lambda x: x[1], (randn(3, 4),)),
    ("getitem_fancy_repeated", lambda x: x[[0, 2, 0, 0]], (randn(3, 4),)),
    ("getitem_mask", lambda x: x[np.array([True, False, True])], (randn(3, 4),)),
    ("embedding", lambda w: ad.embedding(w, np.array([[1, 0, 1], [4, 1, 1]])), (randn(5, 3),)),
    ("matmul_2d", lambda x, y: x @ y, (randn(3, 4), randn(4, 2))),
    ("matmul_batched_bcast", lambda x, y: x @ y, (randn(2, 3, 4), randn(4, 5))),
    ("matmul_bcast_batch", lambda x, y: x @ y, (randn(1, 3, 4), randn(2, 4, 2))),
    ("matmul_mat_vec", lambda x, y: x @ y, (randn(2, 3, 4), randn(4))),
    ("matmul_vec_mat", lambda x, y: x @ y, (randn(4), randn(2, 4, 3))),
    ("matmul_vec_vec", lambda x, y: x @ y, (randn(4), randn(4))),
    ("rmatmul_const", lambda x: np.ones((2, 3)) @ x, (randn(3, 4),)),
    ("composite", lambda x, y: ad.tanh(x @ y).sum(axis=0) / (1.0 + (y * y).mean()),
     (randn(3, 4), randn(4, 2))),
    ("reuse", lambda x: x * x + ad.exp(x) * x - x, (randn(4),)),
]


@pytest.mark.parametrize("name,f,args", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_finite_differences(name, f, args):
    ad.check_grads(f, *args)


def test_check_grads_catches_a_wrong_rule():
    wrong = ad.custom_vjp(lambda x: np.sin(x))
    wrong.defvjp(lambda x: (np.sin(x), (x,)), lambda res, g: (g * np.sin(res[0]),))
    with pytest.raises(AssertionError, match="argument 0"):
        ad.check_grads(wrong, randn(3))


def test_leaf_grad_accumulates_and_has_leaf_dtype():
    x = Tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    (x * x).sum().backward()
    (x * 3.0).sum().backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_allclose(x.grad, 2 * x.data + 3.0)


def test_preallocated_grad_buffer_is_added_into_in_place():
    arena = np.zeros(6)
    x = Tensor(randn(2, 3), requires_grad=True)
    x.grad = arena.reshape(2, 3)
    (x * 2.0).sum().backward()
    assert x.grad.base is arena
    np.testing.assert_array_equal(arena, 2.0)


def test_no_grad_records_nothing_and_enable_grad_restores():
    x = Tensor(randn(3), requires_grad=True)
    with ad.no_grad():
        y = x * 2.0
        assert not y.requires_grad and ad.current_op_tape().n_nodes == 0
        with ad.enable_grad():
            assert (x * 2.0).requires_grad
    ad.current_op_tape().reset()

    @ad.no_grad()
    def f(a):
        return a + 1.0
    assert not f(x).requires_grad


def test_grad_and_value_and_grad():
    def f(x, y, scale):
        return (x * y).sum() * scale
    x, y = randn(3), randn(3)
    gx, gy = ad.grad(f, (0, 1))(x, y, 2.0)
    np.testing.assert_allclose(gx, 2 * y)
    np.testing.assert_allclose(gy, 2 * x)
    value, gy = ad.value_and_grad(f, 1)(x, y, 2.0)
    np.testing.assert_allclose(value, 2 * np.dot(x, y))
    np.testing.assert_allclose(gy, 2 * x)
    (value, aux), gx = ad.value_and_grad(lambda x: ((x * x).sum(), "aux"), has_aux=True)(x)
    assert aux == "aux"
    np.testing.assert_allclose(gx, 2 * x)
    with pytest.warns(UserWarning, match="Output seems independent of input"):
        np.testing.assert_array_equal(ad.grad(lambda x, y: (y * 1.0).sum())(x, y), np.zeros(3))


def test_grad_inside_an_open_recording_leaves_it_intact():
    w = Tensor(randn(3), requires_grad=True)
    outer = (w * w).sum()
    inner = ad.grad(lambda x: (ad.tanh(x) * w.detach()).sum())(randn(3))
    assert inner.shape == (3,)
    outer.backward()
    np.testing.assert_allclose(w.grad, 2 * w.data)


def test_retain_graph_allows_a_second_backward():
    x = Tensor(randn(4), requires_grad=True)
    y = (ad.exp(x) * x).sum()
    y.backward(retain_graph=True)
    first = x.grad.copy()
    y.backward()
    np.testing.assert_allclose(x.grad, 2 * first)


def test_custom_vjp_jax_style():
    @ad.custom_vjp
    def clip_gradient(x, lo, hi):
        return x

    clip_gradient.defvjp(lambda x, lo, hi: (x, (lo, hi)),
                         lambda res, g: (np.clip(g, res[0], res[1]), None, None))
    x = Tensor(randn(5), requires_grad=True)
    (clip_gradient(x, -0.1, 0.1) * 10.0).sum().backward()
    np.testing.assert_array_equal(x.grad, np.full(5, 0.1))


def test_primitive_defvjp_autograd_style_and_missing_rule():
    @ad.primitive
    def logaddexp(x, y):
        return np.logaddexp(x, y)

    ad.defvjp(logaddexp, lambda g, ans, x, y: g * np.exp(x - ans))
    x, y = randn(4), randn(4)
    ad.check_grads(logaddexp, x, y, argnums=0)
    with pytest.raises(NotImplementedError, match=r"argument 1 \('y'\) of op 'logaddexp'"):
        ad.grad(lambda x, y: logaddexp(x, y).sum(), 1)(x, y)
    ad.defvjp(logaddexp, lambda g, ans, x, y: g * np.exp(x - ans),
              lambda g, ans, x, y: g * np.exp(y - ans))
    ad.check_grads(lambda x, y: logaddexp(x, y).sum(), x, y)


def test_custom_vjp_without_rules_raises_naming_the_op():
    @ad.custom_vjp
    def opaque(x):
        return np.cos(x)
    with pytest.raises(NotImplementedError, match=r"argument 0 \('x'\) of op 'opaque'"):
        ad.grad(lambda x: opaque(x).sum())(randn(3))


def test_shape_mismatch_is_a_clear_error():
    x = Tensor(randn(3, 4), requires_grad=True)
    with pytest.raises(ValueError, match=r"add: operand shapes \(3, 4\) and \(3,\)"):
        x + Tensor(randn(3))
    with pytest.raises(ValueError, match="matmul"):
        x @ Tensor(randn(3, 4))
    with pytest.raises(ValueError, match="reshape"):
        x.reshape(5, 2)
    ad.current_op_tape().reset()


def test_backward_twice_without_retain_graph():
    x = Tensor(randn(3), requires_grad=True)
    y = (x * x).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        y.backward()


def test_gradient_of_non_scalar_needs_a_seed():
    x = Tensor(randn(3), requires_grad=True)
    y = x * 2.0
    with pytest.raises(ValueError, match=r"needs a seed for a non-scalar tensor of shape \(3,\)"):
        y.backward()
    with pytest.raises(ValueError, match="seed has shape"):
        y.backward(seed=np.ones(4))
    y.backward(seed=np.array([1.0, 0.0, 2.0]))
    np.testing.assert_allclose(x.grad, [2.0, 0.0, 4.0])
    with pytest.raises(ValueError, match="scalar-valued"):
        ad.grad(lambda a: a * 2.0)(randn(3))


def test_op_on_a_closed_tape():
    with ad.OpTape() as t:
        x = Tensor(randn(3), requires_grad=True)
        y = ad.exp(x)
        t.close()
        with pytest.raises(ad.TapeClosedError, match="closed"):
            ad.exp(y)
    with pytest.raises(ad.TapeClosedError):
        t.__enter__()


def test_a_consumed_graph_cannot_be_extended():
    x = Tensor(randn(3), requires_grad=True)
    y = x * 2.0
    (y * 1.0).sum().backward()
    with pytest.raises(RuntimeError, match="already consumed"):
        y * 3.0
    z = y.detach() * x
    z.sum().backward()


def test_bad_tensor_data():
    with pytest.raises(TypeError, match="float32 or float64"):
        Tensor(np.array(["a"]))
    with pytest.raises(TypeError, match="integer array"):
        ad.embedding(Tensor(randn(3, 2)), np.array([0.5]))
    with pytest.raises(IndexError, match=r"ids must lie in \[0, 3\)"):
        ad.embedding(Tensor(randn(3, 2)), np.array([3]))
    with pytest.raises(TypeError, match="argument 0"):
        ad.grad(lambda a: a.sum())(np.arange(3))


def test_chain_of_1e5_ops_without_recursion():
    x = Tensor(np.array([0.5, -0.25]), requires_grad=True)
    y = x
    for _ in range(100_000):
        y = y * 1.0000001
    y.sum().backward()
    np.testing.assert_allclose(x.grad, np.full(2, 1.0000001 ** 100_000), rtol=1e-9)


def test_optape_memory_budget_spills_and_gradients_match(tmp_path):
    W = randn(64, 64) / 8

    def program():
        x = Tensor(randn(256, 64) * 0 + 0.1, requires_grad=True)
        w = Tensor(W, requires_grad=True)
        y = x
        for _ in range(40):
            y = ad.tanh(y @ w)
        y.sum().backward()
        return x.grad, w.grad

    with ad.OpTape() as full:
        gx, gw = program()
    with ad.OpTape(memory_budget=1 << 20, spill_dir=tmp_path, slab_size=1 << 14) as small:
        gx2, gw2 = program()
        assert small.tape.stats["spills"] > 0
    np.testing.assert_array_equal(gx, gx2)
    np.testing.assert_array_equal(gw, gw2)
    full.close()
    small.close()


def test_a_failing_rule_leaves_the_tape_usable():
    @ad.custom_vjp
    def fails(x):
        return x * 1.0

    fails.defvjp(lambda x: (x * 1.0, (x,)), lambda res, g: 1 / 0)
    w = Tensor(randn(3), requires_grad=True)
    outer = ad.exp(w)
    with pytest.raises(ZeroDivisionError):
        ad.grad(lambda x: (ad.exp(fails(x)) * 2.0).sum())(randn(3))
    outer.sum().backward()
    np.testing.assert_allclose(w.grad, np.exp(w.data))
    with pytest.raises(ZeroDivisionError):
        (fails(w) * w).sum().backward()
    w.grad = None
    (w * 2.0).sum().backward()
    np.testing.assert_array_equal(w.grad, np.full(3, 2.0))
