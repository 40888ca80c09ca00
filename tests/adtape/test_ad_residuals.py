"""OpTape(residuals="reference"): the arrays ops save for the backward are held as they
are instead of copied onto the byte tape.  Same gradients as the byte tape, read-only
while held (an in-place write raises instead of changing the gradient), writable
again once the sweep, reset or close is done, and no memory_budget."""
import numpy as np
import pytest

import adtape as ad
from adtape import nn
from adtape.tensor import Tensor


def _block(rng):
    """A GPT-2-like block and loss; returns (loss tensor, leaves, intermediates)."""
    B, T, C, NH, V = 2, 8, 16, 4, 50
    f = lambda *s: (0.2 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    leaves = dict(wte=f(V, C), wpe=f(T, C), lnw=1 + f(C), lnb=f(C), qw=f(3 * C, C),
                  qb=f(3 * C), pw=f(C, C), pb=f(C), fw=f(4 * C, C), fb=f(4 * C))
    t = {k: Tensor(v, requires_grad=True) for k, v in leaves.items()}
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    x = nn.encoder(ids, t["wte"], t["wpe"])
    h = nn.layernorm(x, t["lnw"], t["lnb"])
    x = nn.residual(x, nn.linear(nn.attention(nn.linear(h, t["qw"], t["qb"]), NH),
                                 t["pw"], t["pb"]))
    h = nn.gelu(nn.linear(x, t["fw"], t["fb"]))
    x = nn.residual(x, nn.linear(h, Tensor(f(C, 4 * C))))
    logits = nn.linear(x, t["wte"])
    loss = nn.softmax_cross_entropy(logits, ids, V).mean()
    return loss, t, dict(x=x, h=h, logits=logits)


def _grads(residuals, seed=0):
    rng = np.random.default_rng(seed)
    with ad.OpTape(residuals=residuals) as tape:
        loss, leaves, mid = _block(rng)
        logits_before = mid["logits"].data.copy()
        saved = tape.saved_bytes
        on_tape = tape.tape.nbytes
        loss.backward()
        np.testing.assert_array_equal(mid["logits"].data, logits_before)  # not clobbered
    tape.close()
    return float(loss), {k: v.grad for k, v in leaves.items()}, saved, on_tape


def test_reference_gives_the_byte_tapes_gradients_without_copies():
    loss, grads, saved, on_tape = _grads("tape")
    loss_r, grads_r, saved_r, on_tape_r = _grads("reference")
    assert loss_r == loss
    for k in grads:
        np.testing.assert_array_equal(grads_r[k], grads[k], err_msg=k)
    assert on_tape > 0 and on_tape_r == 0          # nothing copied onto the byte tape
    assert saved_r > 0 and saved_r <= saved        # the same residuals, without trailers


def test_held_residuals_are_read_only_until_the_sweep():
    rng = np.random.default_rng(1)
    with ad.OpTape(residuals="reference") as tape:
        x = Tensor(rng.standard_normal((4, 3)), requires_grad=True)
        y = ad.tanh(x * 2.0)             # tanh saves its output
        z = (y * y).sum()                # mul saves y
        assert not y.data.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            y.data[0, 0] = 5.0
        z.backward()
        assert y.data.flags.writeable
        np.testing.assert_allclose(x.grad, 2 * 2 * y.data * (1 - y.data ** 2), rtol=1e-12)
    tape.close()


def test_retain_graph_keeps_them_held_and_reset_and_close_release():
    rng = np.random.default_rng(2)
    with ad.OpTape(residuals="reference") as tape:
        x = Tensor(rng.standard_normal(5), requires_grad=True)
        y = ad.exp(x)
        z = (y * 3.0).sum()
        z.backward(retain_graph=True)
        first = x.grad.copy()
        assert not y.data.flags.writeable
        z.backward()
        np.testing.assert_allclose(x.grad, 2 * first)
        assert y.data.flags.writeable
        w = ad.exp(x * 1.0)
        assert not w.data.flags.writeable
        tape.reset()
        assert w.data.flags.writeable
        v = ad.exp(x * 1.0)
    tape.close()
    assert v.data.flags.writeable


def test_caller_read_only_arrays_stay_read_only():
    data = np.arange(3.0)
    data.flags.writeable = False
    with ad.OpTape(residuals="reference") as tape:
        x = Tensor(data.copy(), requires_grad=True)
        c = Tensor(data)                 # a constant the op keeps
        (x * c).sum().backward()
    tape.close()
    assert not data.flags.writeable


def test_bad_residuals_settings():
    with pytest.raises(ValueError, match="memory_budget"):
        ad.OpTape(residuals="reference", memory_budget=1 << 20)
    with pytest.raises(ValueError, match="residuals"):
        ad.OpTape(residuals="disk")


@pytest.mark.parametrize("residuals", ["tape", "reference"])
def test_gelu_linear_is_bitwise_linear_of_gelu_and_saves_only_its_input(residuals):
    # The fused op recomputes GELU in the backward with the same kernel: the same bits
    # as the two ops, for a quarter-block less saved.
    rng = np.random.default_rng(5)
    x0 = rng.standard_normal((2, 7, 24)).astype(np.float32)
    w0 = (0.3 * rng.standard_normal((10, 24))).astype(np.float32)
    b0 = rng.standard_normal(10).astype(np.float32)
    seed = rng.standard_normal((2, 7, 10)).astype(np.float32)
    results = []
    for fused in (False, True):
        x, w, b = (Tensor(a.copy(), requires_grad=True) for a in (x0, w0, b0))
        with ad.OpTape(residuals=residuals) as tape:
            u = nn.residual(x, x)          # an intermediate: its array is saved, not held
            out = nn.gelu_linear(u, w, b) if fused else nn.linear(nn.gelu(u), w, b)
            saved = tape.saved_bytes
            out.backward(seed=seed)
        results.append((out.data, x.grad, w.grad, b.grad, saved))
    (o1, dx1, dw1, db1, s1), (o2, dx2, dw2, db2, s2) = results
    for a, b_ in ((o1, o2), (dx1, dx2), (dw1, dw2), (db1, db2)):
        np.testing.assert_array_equal(a, b_)
    # One array saved instead of two (a record's header aside, on the byte tape).
    assert x0.nbytes <= s2 < x0.nbytes + 256 and s1 - s2 >= x0.nbytes


@pytest.mark.parametrize("residuals", ["tape", "reference"])
def test_attention_linear_is_bitwise_linear_of_attention_and_saves_its_output_once(residuals):
    rng = np.random.default_rng(6)
    B, T, C, NH = 2, 9, 12, 3
    q0 = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    w0 = (0.3 * rng.standard_normal((C, C))).astype(np.float32)
    b0 = rng.standard_normal(C).astype(np.float32)
    seed = rng.standard_normal((B, T, C)).astype(np.float32)
    results = []
    for fused in (False, True):
        q, w, b = (Tensor(a.copy(), requires_grad=True) for a in (q0, w0, b0))
        with ad.OpTape(residuals=residuals) as tape:
            u = nn.residual(q, q)          # an intermediate: its array is saved, not held
            out = (nn.attention_linear(u, NH, w, b) if fused
                   else nn.linear(nn.attention(u, NH), w, b))
            saved = tape.saved_bytes
            out.backward(seed=seed)
        results.append((out.data, q.grad, w.grad, b.grad, saved))
    (o1, dq1, dw1, db1, s1), (o2, dq2, dw2, db2, s2) = results
    for x1, x2 in ((o1, o2), (dq1, dq2), (dw1, dw2), (db1, db2)):
        np.testing.assert_array_equal(x1, x2)
    out_bytes = B * T * C * 4
    if residuals == "tape":             # the two ops pushed the output twice
        assert s1 - s2 >= out_bytes
    else:                               # held once either way
        assert s1 == s2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("op", ["linear", "gelu_linear", "swiglu_linear", "attention_linear"])
def test_a_frozen_weight_keeps_no_input_for_itself(op, precision):
    # A frozen weight (the LM head under LoRA, a projection LoRA leaves alone) has no
    # weight gradient and dx = g W reads no input: the plain product keeps none of it
    # (the fused ones keep what their activation's gradient reads, and recompute
    # nothing), and the input's gradient is the same bits as with a trainable weight.
    rng = np.random.default_rng(7)
    B, T, C, NH = 2, 5, 12, 3
    width = {"linear": C, "gelu_linear": C, "swiglu_linear": 2 * C, "attention_linear": 3 * C}[op]
    x0 = rng.standard_normal((B, T, width)).astype(np.float32)
    w0 = (0.3 * rng.standard_normal((7, width // (2 if op == "swiglu_linear" else 1)
                                     if op != "attention_linear" else C))).astype(np.float32)
    b0 = rng.standard_normal(7).astype(np.float32)
    seed = rng.standard_normal((B, T, 7)).astype(np.float32)
    call = {"linear": nn.linear, "gelu_linear": nn.gelu_linear, "swiglu_linear": nn.swiglu_linear,
            "attention_linear": lambda u, w, b: nn.attention_linear(u, NH, w, b)}[op]
    previous = nn.set_precision(precision)
    try:
        results = []
        for frozen in (False, True):
            x, b = Tensor(x0.copy(), requires_grad=True), Tensor(b0.copy(), requires_grad=True)
            w = Tensor(w0.copy(), requires_grad=not frozen)     # a leaf: held, not copied
            with ad.OpTape(residuals="tape") as tape:
                out = call(nn.residual(x, x), w, b)    # an intermediate input: saved, not held
                saved = tape.saved_bytes
                out.backward(seed=seed)
            results.append((out.data, x.grad, b.grad, saved))
    finally:
        nn.set_precision(previous)
    (o1, dx1, db1, s1), (o2, dx2, db2, s2) = results
    for a, b_ in ((o1, o2), (dx1, dx2), (db1, db2)):
        np.testing.assert_array_equal(a, b_)
    if op == "linear":
        assert s2 == 0 and s1 >= x0.nbytes // (2 if precision == "bf16" else 1)
    else:
        assert s2 == s1
