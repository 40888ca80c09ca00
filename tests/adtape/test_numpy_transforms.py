"""Higher-order and forward-mode transforms over adtape.numpy (against torch.autograd in
float64), the errors that keep a derivative from being silently wrong, and a NumPy
program whose saved values spill past a memory budget with a bit-identical gradient."""
import numpy as np
import pytest
import torch
from torch.autograd import functional as TF

import adtape as ad
import adtape.numpy as anp
from adtape import Tensor, nn

RNG = np.random.default_rng(11)


def f_np(x, a):
    """A scalar program that crosses elementwise ops, reductions, products and linalg."""
    h = anp.tanh(a @ x) + anp.sin(x) * anp.exp(-x * x)
    m = anp.outer(h, h) + 3 * anp.eye(3)
    return anp.logsumexp(h) + anp.linalg.slogdet(m)[1] + anp.sum(anp.sqrt(x * x + 1.0))


def f_torch(x, a):
    h = torch.tanh(a @ x) + torch.sin(x) * torch.exp(-x * x)
    m = torch.outer(h, h) + 3 * torch.eye(3, dtype=torch.float64)
    return torch.logsumexp(h, 0) + torch.linalg.slogdet(m)[1] + torch.sum(torch.sqrt(x * x + 1.0))


X = RNG.standard_normal(3)
A = RNG.standard_normal((3, 3))
V = RNG.standard_normal(3)
TX, TA, TV = (torch.tensor(v) for v in (X, A, V))


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)


def test_grad_hessian_and_hvp_match_torch():
    close(ad.grad(f_np)(X, A), TF.jacobian(lambda x: f_torch(x, TA), TX))
    H = TF.hessian(lambda x: f_torch(x, TA), TX)
    close(ad.hessian(f_np)(X, A), H)
    close(ad.jacrev(ad.grad(f_np))(X, A), H)
    close(ad.jacfwd(ad.grad(f_np))(X, A), H)
    close(ad.hvp(f_np)(X, A, V), H @ TV)
    close(ad.hvp(f_np, mode="forward")(X, A, V), H @ TV)
    # Second derivatives with respect to the matrix too.
    Ha = TF.hessian(lambda a: f_torch(TX, a), TA)
    close(ad.hessian(f_np, argnums=1)(X, A), Ha)


def test_third_order_and_grad_of_value_and_grad():
    f = lambda x: anp.sin(x) * x ** 3  # noqa: E731
    d3 = ad.grad(ad.grad(ad.grad(f)))(np.float64(0.7))
    x = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    g, = torch.autograd.grad(torch.sin(x) * x ** 3, x, create_graph=True)
    g2, = torch.autograd.grad(g, x, create_graph=True)
    g3, = torch.autograd.grad(g2, x)
    close(d3, g3)
    # value_and_grad under an outer grad: both parts are differentiable.
    outer = ad.grad(lambda x: ad.value_and_grad(f)(x)[0] + ad.value_and_grad(f)(x)[1])
    close(outer(np.float64(0.7)), g.item() + g2.item())


def test_jvp_jacfwd_jacrev_of_vector_functions_match_torch():
    def vec(x, a):
        return anp.concatenate([anp.linalg.solve(a @ a.T + 3 * anp.eye(3), x),
                                anp.cumprod(x), anp.softmax(a, axis=0)[0]])

    def vec_t(x, a):
        return torch.cat([torch.linalg.solve(a @ a.T + 3 * torch.eye(3, dtype=torch.float64), x),
                          torch.cumprod(x, 0), torch.softmax(a, 0)[0]])
    out, tangent = ad.jvp(vec, (X, A), (V, np.ones_like(A)))
    ref_out, ref_tangent = TF.jvp(vec_t, (TX, TA), (TV, torch.ones_like(TA)))
    close(out, ref_out)
    close(tangent, ref_tangent)
    J = TF.jacobian(vec_t, (TX, TA))
    jr = ad.jacrev(vec, argnums=(0, 1))(X, A)
    jf = ad.jacfwd(vec, argnums=(0, 1))(X, A)
    for ours_r, ours_f, ref in zip(jr, jf, J):
        assert ours_r.shape == ours_f.shape == tuple(ref.shape)
        close(ours_r, ref)
        close(ours_f, ref)
    assert ad.jacobian is ad.jacrev


def test_higher_order_through_indexing_max_and_einsum():
    def f(x):
        return (anp.max(x[np.array([0, 2, 2])] ** 2) + anp.einsum("i,i->", x, anp.cumsum(x))
                + anp.sum(anp.take_along_axis(anp.outer(x, x), np.array([[1], [0], [2]]), 1)))

    def ft(x):
        return ((x[torch.tensor([0, 2, 2])] ** 2).amax() + torch.einsum("i,i->", x, x.cumsum(0))
                + torch.take_along_dim(torch.outer(x, x), torch.tensor([[1], [0], [2]]), 1).sum())
    close(ad.hessian(f)(X), TF.hessian(ft, TX))


def test_transforms_on_float32_keep_the_dtype():
    x = X.astype(np.float32)
    assert ad.grad(lambda a: anp.sum(anp.sin(a)))(x).dtype == np.float32
    assert ad.hessian(lambda a: anp.sum(anp.sin(a) * a))(x).dtype == np.float32
    assert ad.jvp(anp.tanh, (x,), (x,))[1].dtype == np.float32


def test_ops_without_a_differentiable_rule_raise_in_higher_order():
    x32 = RNG.standard_normal((2, 4)).astype(np.float32)
    w, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    # First order through a kernel op works; differentiating its rule again cannot.
    assert ad.grad(lambda x: anp.sum(nn.layernorm(x, w, b) ** 2))(x32).shape == (2, 4)
    with pytest.raises(NotImplementedError, match="'layernorm' has no rule adtape can "
                                                  "differentiate again"):
        ad.hessian(lambda x: anp.sum(nn.layernorm(x, w, b) ** 2))(x32)

    @ad.primitive
    def cube(x):
        return x ** 3
    ad.defvjp(cube, lambda g, ans, x: g * 3 * x ** 2)
    assert ad.grad(lambda x: anp.sum(cube(x)))(X).shape == (3,)
    with pytest.raises(NotImplementedError, match="'cube' has no rule"):
        ad.grad(ad.grad(lambda x: anp.sum(cube(x))))(np.float64(0.5))
    ad.defvjp(cube, lambda g, ans, x: g * 3 * x ** 2, differentiable=True)
    assert float(ad.grad(ad.grad(lambda x: anp.sum(cube(x))))(np.float64(0.5))) == 3.0


def test_functions_without_a_rule_raise_naming_them_and_the_argument():
    x = Tensor(RNG.standard_normal((3, 3)), requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"einsum: no rule for operand 0 \('ii'\)"):
        anp.einsum("ii->", x).backward()
    with pytest.raises(NotImplementedError, match="'...'"):
        anp.einsum("...i->...", x)
    with pytest.raises(NotImplementedError, match="mode='constant' only, not mode='reflect'"):
        anp.pad(x, 1, mode="reflect")
    with pytest.raises(NotImplementedError, match="full_matrices=True with a non-square"):
        anp.linalg.svd(x[:2])
    with pytest.raises(NotImplementedError, match="argument constant_values"):
        anp.pad(x, 1, constant_values=Tensor(np.float64(1.0), requires_grad=True))
    with pytest.raises(AttributeError, match=r"no derivative rule for numpy\.linalg\.qr"):
        anp.linalg.qr
    with pytest.raises(AttributeError, match=r"no derivative rule for numpy\.gradient"):
        anp.gradient
    with pytest.raises(TypeError, match=r"numpy\.gradient on an adtape Tensor"):
        np.gradient(x)
    with pytest.raises(NotImplementedError, match="cross: adtape has a rule for 3-vectors"):
        anp.cross(x[:, :2], x[:, :2])


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="jvp: 1 primals but 2 tangents"):
        ad.jvp(anp.sin, (X,), (X, X))
    with pytest.raises(ValueError, match=r"tangent 0 has shape \(2,\)"):
        ad.jvp(anp.sin, (X,), (X[:2],))
    with pytest.raises(ValueError, match="scalar-valued"):
        ad.grad(ad.grad(lambda x: anp.sin(x)))(X)
    with pytest.raises(ValueError, match="argnums 3 is out of range"):
        ad.jacrev(anp.sin, argnums=3)(X)
    with pytest.raises(ValueError, match="mode must be"):
        ad.hvp(anp.sin, mode="sideways")
    with pytest.raises(ValueError, match="same shape"):
        anp.stack([X, X[:2]])
    with pytest.raises(np.exceptions.AxisError, match="axis 3 is out of bounds"):
        anp.swapaxes(A, 0, 3)


def spill_program(ws, x):
    """A NumPy program that saves about 40 x 64 KiB of values for its backward pass."""
    h = x
    for w in ws:
        h = anp.tanh(h @ w) + 0.1 * anp.sin(h) * anp.maximum(h, 0.0)
    return anp.sum(anp.logsumexp(h, axis=-1)) + anp.linalg.norm(h)


def test_gradient_is_bit_identical_when_saved_values_spill_to_disk(tmp_path):
    rng = np.random.default_rng(3)
    ws = rng.standard_normal((8, 64, 64)) / 8
    x = rng.standard_normal((128, 64))
    in_memory = ad.grad(spill_program)(ws, x)
    budget = 256 << 10
    with ad.OpTape(memory_budget=budget, spill_dir=str(tmp_path), spill_unit=64 << 10) as tape:
        spilled = ad.grad(spill_program)(ws, x)
        stats = tape.stats
    assert stats["peak_spilled_bytes"] > 4 * budget, stats     # most of it went to disk
    assert stats["reloads"] > 0 and stats["bytes_read"] >= stats["peak_spilled_bytes"]
    assert stats["peak_resident_bytes"] <= budget + (512 << 10)
    np.testing.assert_array_equal(spilled, in_memory, strict=True)


def test_higher_order_under_reference_residuals_and_a_spilling_outer_recording(tmp_path):
    f = lambda x: anp.sum(anp.sin(x) * anp.exp(x))  # noqa: E731
    x = np.linspace(0.1, 1.0, 5)
    h = ad.hessian(f)(x)
    with ad.OpTape(residuals="reference"):
        np.testing.assert_array_equal(ad.hessian(f)(x), h)
    big = np.linspace(0.0, 1.0, 1 << 15)

    def outer(w):       # first-order records that spill, around a grad in keep mode
        return anp.sum(anp.tanh(big * w[0]) * anp.cos(big)) + anp.sum(ad.grad(f)(w) ** 2)
    in_memory = ad.grad(outer)(x)
    with ad.OpTape(memory_budget=128 << 10, spill_dir=str(tmp_path),
                   spill_unit=64 << 10) as tape:
        spilled = ad.grad(outer)(x)
        assert tape.stats["peak_spilled_bytes"] > 0
    np.testing.assert_array_equal(spilled, in_memory)
    ref = torch.tensor(x, requires_grad=True)
    tb = torch.tensor(big)
    inner = torch.autograd.grad((torch.sin(ref) * torch.exp(ref)).sum(), ref, create_graph=True)[0]
    total = (torch.tanh(tb * ref[0]) * torch.cos(tb)).sum() + (inner ** 2).sum()
    close(in_memory, torch.autograd.grad(total, ref)[0])


def test_has_aux_and_python_floats_under_transforms():
    x = np.linspace(0.1, 1.0, 4)
    (value, aux), g = ad.value_and_grad(lambda a: (anp.sum(anp.sin(a)), "aux"), has_aux=True)(x)
    assert aux == "aux"
    close(g, np.cos(x))
    nested = ad.grad(lambda a: ad.grad(lambda b: (anp.sum(anp.sin(b) ** 2), 1),
                                       has_aux=True)(a)[0].sum())(x)
    close(nested, 2 * np.cos(2 * x))           # d/dx sum(sin(2x)) = 2 cos(2x)
    out, tangent = ad.jvp(lambda s: s * s, (1.5,), (1.0,))
    assert float(out) == 2.25 and float(tangent) == 3.0


def test_array_of_tensors_keeps_the_gradient():
    x = np.array([1.5, 2.0])

    def f(a):
        m = anp.array([[a[0] ** 2, a[0] * a[1]], [3.0, anp.sin(a[1])]])
        return anp.sum(m * np.array([[1.0, 2.0], [3.0, 4.0]])) + anp.sum(anp.asarray([a[1], 1.0]))
    g = ad.grad(f)(x)
    close(g, [2 * 1.5 + 2 * 2.0, 2 * 1.5 + 4 * np.cos(2.0) + 1])
    assert type(anp.array([1.0, 2.0])) is np.ndarray         # no Tensor: plain NumPy
    t = Tensor(x, requires_grad=True)
    assert anp.asarray(t) is t and anp.array(t) is t
    with pytest.raises(TypeError, match="would lose the gradient"):
        anp.array(t, dtype=np.float32)
